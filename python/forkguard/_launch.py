"""notebook_launch: ranks forked from a freshly executed interpreter, supervised by forkguard's
C++ supervisor — the one ``forkguard run`` uses.

The fork server (``_server.py``) is a new ``/usr/bin/python3`` process: nothing the notebook did
to CUDA reaches it. It preloads the named modules once (``torch`` when installed), so a rank is a
``fork()`` of a warm interpreter. It speaks the C++ fork server's protocol; the native module
attaches the supervisor to it (``_native._supervise_notebook``), which builds each rank's
environment, prints its output prefixed ``[rankN]:``, stops and restarts the group and reports as
for a command rank. What stays here is Python's: cloudpickle (the function travels by value in a
memfd, the outcome comes back in the same memfd), RankError and the notebook-facing API.
multiprocessing's objects in the arguments (a Queue, a Pipe's Connection, an Event) travel as to a
forkserver child: their fds held by the server for the launch (its ranks inherit them), their
semaphores by name (_travel.py).
"""
from __future__ import annotations

import atexit
import importlib.util
import json
import operator
import os
import pickle
import socket
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import _server as _wire
from . import _native
from ._native import Error, _ServerLink, _supervise_notebook

_lock = threading.RLock()
_server: Optional["_Server"] = None


class RankError(Error):
    """A rank failed: raised in the caller with the rank, its traceback text and the report.

    Attributes: ``rank`` (the root cause: the first rank to fail; None when the group timed out
    or was interrupted), ``exc_type`` (its exception's type name, or None when it died without
    one), ``traceback`` (the rank's traceback text), ``exit_code`` / ``signal`` (how it ended),
    ``report`` (the launcher's report, as ``forkguard run`` prints it), ``json`` (the same as
    ``forkguard run --json-report`` writes), ``restarts`` (group restarts made before giving up).
    """

    def __init__(self, message, *, rank, exc_type, traceback, exit_code, signal, report,
                 restarts, json=None):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.traceback = traceback
        self.exit_code = exit_code
        self.signal = signal
        self.report = report
        self.restarts = restarts
        self.json = json


def default_preload() -> List[str]:
    """``["torch"]`` when torch is importable, else nothing."""
    return ["torch"] if importlib.util.find_spec("torch") is not None else []


def _default_python() -> str:
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python") and os.access(exe, os.X_OK):
        return exe
    return "/usr/bin/python3"


class _Server:
    def __init__(self, preload: Sequence[str], python: str):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_server.py")
        path = [p for p in sys.path if p]
        self.preload = list(preload)
        self.python = python
        # Started by the native layer and held by its pidfd. TODO(issue 26, one fork server):
        # started by the C++ zygote instead, it would be no child a reap-all loop of the program
        # (os.wait() until ChildProcessError) waits for; an exec'd child of ours always is.
        try:
            self.proc = _native.start_process(
                [python, script, str(theirs.fileno()), json.dumps(self.preload),
                 json.dumps(path)], pass_fds=[theirs.fileno()], name="the fork server")
        finally:
            theirs.close()
        self.pid = self.proc.pid
        # The socket's one reader in this process, shared with the DataLoaders and launches that
        # attach to this server: every reply and exit report reaches whoever it is for.
        try:
            self.link = _ServerLink(self.pid, ours.fileno())
        finally:
            ours.close()
        self.owner = os.getpid()  # a fork of the owner holds a copy of this object, not the server
        self.ready = None  # the "ready" message's fields, once received

    def fd(self) -> int:
        return self.link.fd()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exchange(self, fields: Sequence[str], fds: Sequence[int] = (),
                 timeout: Optional[float] = None):
        """Sends a request (none when `fields` is empty) and returns its reply's fields, or None
        when none came within `timeout` seconds."""
        return self._ask(self.link.exchange, fields, fds, timeout)

    def start_child(self, fields: Sequence[str], fds: Sequence[int] = (),
                    timeout: Optional[float] = None):
        """Sends a start request (guard_start); the child's handle (_native._ServerChild: the
        pidfd this server opened before it could reap it). An Error says why not."""
        return self._ask(self.link.start_child, fields, fds, timeout)

    def _ask(self, method, fields, fds, timeout):
        try:
            return method(list(fields), list(fds), timeout)
        except Error as e:
            if self.alive() and f"the fork server (PID {self.pid}) ended" not in str(e):
                raise
            raise Error(f"notebook_launch: the fork server (PID {self.pid}) exited "
                        f"(status {self.proc.wait()})") from None

    def wait_ready(self, timeout: float = 300.0):
        if self.ready is None:
            msg = self.exchange([], timeout=timeout)
            if msg is None or msg[0] != "ready":
                raise Error(f"notebook_launch: the fork server (PID {self.pid}, {self.python}) "
                            f"did not start within {timeout:.0f} s")
            self.ready = msg
            for name, err in json.loads(msg[3]).items():
                print(f"forkguard: the fork server could not preload {name}: {err}",
                      file=sys.stderr)
        return self.ready

    def ensure_preloaded(self, modules: Sequence[str]):
        missing = [m for m in modules if m not in self.preload]
        if missing:
            msg = self.exchange(["preload", json.dumps(missing)], timeout=300.0)
            if msg is None or msg[0] != "preloaded":
                raise Error("notebook_launch: the fork server did not answer a preload request")
            self.preload += missing

    def close(self):
        try:
            self.link.close()
        finally:
            if self.proc.wait(timeout=10) is None:
                self.proc.kill()
                self.proc.wait()


def start_server(preload: Optional[Sequence[str]] = None, python: Optional[str] = None,
                 wait: bool = False) -> int:
    """Starts the notebook fork server now (it also starts at the first notebook_launch).

    ``preload``: modules the server imports once, before any rank exists (default: torch when
    installed). ``python``: the interpreter to execute (default: this one, ``sys.executable``).
    ``wait``: return only once the preloads are done. Returns the server's PID.
    """
    global _server
    with _lock:
        if _server is not None and not _server.alive():
            _server = None
        if _server is None:
            _server = _Server(default_preload() if preload is None else preload,
                              python or _default_python())
        elif preload:
            _server.wait_ready()
            _server.ensure_preloaded(preload)
        if wait:
            _server.wait_ready()
        return _server.pid


def stop_server() -> None:
    """Stops the notebook fork server (its ranks are killed); the next launch starts a new one."""
    global _server
    with _lock:
        if _server is not None:
            _server.close()
            _server = None


@atexit.register
def _stop_server_at_exit():
    # Gone with this interpreter rather than just after it (its EOF): whoever waits for this
    # process and what it started (a test harness, a job scheduler) finds nothing left.
    if _server is not None and _server.owner == os.getpid():
        stop_server()


def whole(name: str, value: Any) -> int:
    """``value`` as the int a count must be (what ``range()`` accepts: int, bool, numpy's ints),
    or a TypeError naming the argument, before anything is printed or started."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {type(value).__name__} "
                        f"({value!r})") from None


def notebook_launch(fn: Callable[..., Any], args: Sequence[Any] = (), nproc: int = 1, *,
                    kwargs: Optional[Dict[str, Any]] = None, bind_gpus: bool = False,
                    max_restarts: int = 0, master_addr: str = "127.0.0.1",
                    master_port: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                    preload: Optional[Sequence[str]] = None, grace: float = 5.0,
                    timeout: Optional[float] = None, nnodes: int = 1,
                    node_rank: int = 0) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` in ``nproc`` ranks and returns their return values by rank.

    The ranks are forked by a fork server that is a freshly executed interpreter, so they can use
    CUDA whatever this process did with it, and supervised by the launcher behind ``forkguard
    run``: each rank gets the same environment as a command rank (torchrun's RANK, LOCAL_RANK,
    GROUP_RANK, ROLE_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE, ROLE_WORLD_SIZE,
    ROLE_NAME, MASTER_ADDR, MASTER_PORT (a free port unless ``master_port``), TORCHELASTIC_*;
    OMP_NUM_THREADS=1 when unset and nproc > 1) over this process's environment as it is now,
    plus ``env``; with ``bind_gpus`` one GPU each through CUDA_VISIBLE_DEVICES (more ranks than
    visible GPUs is refused before anything starts).

    Output appears here (sys.stdout / sys.stderr) as it comes, prefixed ``[rankN]:``. The first
    rank to fail stops the others (SIGTERM, then SIGKILL after ``grace`` seconds); the group
    restarts up to ``max_restarts`` times, then :class:`RankError` is raised with the rank, its
    traceback text and the launcher's report (the rank's own exception, when it could be pickled,
    is its ``__cause__``). KeyboardInterrupt sends SIGINT to every rank, waits for them (SIGKILL
    after ``grace``) and propagates. ``timeout``: seconds for the whole group, then it is stopped
    and RankError raised. Nothing is left running.

    ``args`` may hold multiprocessing's objects made before the call, by any context (a fork
    context's Queue too): each rank gets them as a forkserver child would (their fds by
    SCM_RIGHTS; a fork context's semaphores, which have no name, through named twins that take
    their value and give it back after the launch).

    ``nnodes``/``node_rank``: this call starts node ``node_rank``'s ranks of a world of ``nnodes``
    nodes of ``nproc`` ranks each (RANK = node_rank * nproc + LOCAL_RANK), whose rank 0 listens
    at ``master_addr``:``master_port`` (required then); run the same call on every node.
    """
    nproc, nnodes, node_rank, max_restarts = (
        whole(name, value) for name, value in (("nproc", nproc), ("nnodes", nnodes),
                                               ("node_rank", node_rank),
                                               ("max_restarts", max_restarts)))
    if nproc < 1:
        raise ValueError("nproc must be at least 1")
    from . import _travel

    cwd = os.getcwd()
    path = [p if p else cwd for p in sys.path]
    with _travel.payload(fn, tuple(args), dict(kwargs or {})) as (payload, fds), _lock:
        start_server(preload)
        server = _server
        assert server is not None
        server.wait_ready()
        if preload:
            server.ensure_preloaded(preload)
        if fds:
            _exchange(server, ["hold_fds"], fds, "held")
        try:
            done = _supervise_notebook(
                server_pid=server.pid, server_sock=server.fd(), payload=payload, nproc=nproc,
                args=[cwd, json.dumps(path)], grace=float(grace), bind_gpus=bind_gpus,
                max_restarts=max_restarts, master_addr=master_addr, master_port=master_port,
                env=dict(env or {}), timeout=None if timeout is None else float(timeout),
                nnodes=nnodes, node_rank=node_rank)
        finally:
            if fds and server.alive():
                _exchange(server, ["release_fds"], [], "released")
    result = json.loads(done.json)
    try:
        outcomes = [_outcome(r, fd) for r, fd in enumerate(done.memfds)]
    finally:
        for fd in done.memfds:
            if fd >= 0:
                os.close(fd)
    truncated = [r for r, o in enumerate(outcomes) if o and o[1] == "TruncatedResult"]
    if not result["success"] or truncated:
        raise _rank_error(result, done.report, outcomes, truncated, timeout)
    return [o[1] if o and o[0] == "ok" else None for o in outcomes]


def _exchange(server: _Server, fields, fds, expect: str, who: str = "notebook_launch") -> None:
    """One request to the interpreter fork server whose answer must be ``expect``; else an Error
    naming ``who`` asked, the server and what it answered."""
    msg = server.exchange(fields, fds, timeout=60.0)
    if msg is None or msg[0] != expect:
        raise Error(f"{who}: the fork server (PID {server.pid}) did not answer "
                    f"{fields[0]}: {msg}")


def _outcome(rank: int, fd: int):
    """A rank's outcome from its memfd: None when it wrote none, an error when it was cut short."""
    if fd < 0:
        return None
    size = os.fstat(fd).st_size
    head = _wire._HEADER
    if size < head.size:
        return None
    # Read through a file, not a mapping: pickle reads a large bytes value straight into its
    # object (one copy), where unpickling from a mapping faults in every page first (200 MB:
    # 0.67 s against 1.28 s here).
    with os.fdopen(os.dup(fd), "rb") as f:  # the dup shares the offset: seek first
        f.seek(0)
        magic, length = head.unpack(f.read(head.size))
        if magic != _wire.RESULT_MAGIC:
            return None  # the payload is still there: the rank died before its outcome
        got = size - head.size
        if got != length:
            return ("error", "TruncatedResult",
                    f"rank {rank}'s return value arrived incomplete ({got} bytes of {length})",
                    "", None)
        try:
            return pickle.load(f)
        except Exception as e:  # noqa: BLE001 - the bytes are not a whole pickle
            return ("error", "TruncatedResult",
                    f"rank {rank}'s return value could not be read ({got} bytes): "
                    f"{type(e).__name__}: {e}", "", None)


def _rank_error(result, report: str, outcomes, truncated, timeout) -> RankError:
    ranks = result["ranks"]
    restarts = result["restarts"]
    if result["root_cause"] is not None:
        root = next(r for r in ranks if r["rank"] == result["root_cause"])
    elif truncated:
        root = ranks[truncated[0]]
    else:
        root = None
    exc_type = tb = cause = None
    if root is None:
        head = (f"timed out after {timeout} s" if result["timed_out"] else
                f"interrupted by signal {result['interrupted_by']}")
    else:
        outcome = outcomes[root["local_rank"]]
        if outcome and outcome[0] == "error":
            _, exc_type, text, tb, pickled = outcome
            head = f"rank {root['rank']} failed: {exc_type}: {text}"
            if pickled is not None:
                try:
                    cause = pickle.loads(pickled)
                except Exception:  # noqa: BLE001 - the text above still says what happened
                    cause = None
        else:
            head = f"rank {root['rank']} failed: {root['description']}"
            if root["stderr_tail"]:
                tb = "\n".join(root["stderr_tail"])
    restarts_note = f" after {restarts} restart{'s' if restarts != 1 else ''}" if restarts else ""
    message = head + restarts_note
    if tb:
        message += f"\n\nrank {root['rank']}'s traceback:\n{tb.rstrip()}"
    message += "\n\n" + report.rstrip()
    signaled = root is not None and root["status"] == "signaled"
    exited = root is not None and root["status"] == "exited"
    err = RankError(message, rank=None if root is None else root["rank"], exc_type=exc_type,
                    traceback=tb or "", exit_code=root["exit_code"] if exited else None,
                    signal=root["signal"] if signaled else None, report=report,
                    restarts=restarts, json=json.dumps(result, indent=2))
    err.__cause__ = cause
    return err
