"""notebook_launch: ranks forked from a freshly executed interpreter, supervised from the caller.

The fork server (``_server.py``) is a new ``/usr/bin/python3`` process: nothing the notebook did
to CUDA reaches it. It preloads the named modules once (``torch`` when installed), so a rank is a
``fork()`` of a warm interpreter. The function travels by value (cloudpickle) in a memfd; each
rank's stdout and stderr come back on pipes and are printed here line by line, prefixed
``[rankN]``; its outcome (return value, or exception with traceback) on a third pipe.
"""
from __future__ import annotations

import importlib.util
import json
import fcntl
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ._native import Error, _RankOutput

_lock = threading.RLock()
_server: Optional["_Server"] = None


class RankError(Error):
    """A rank failed: raised in the caller with the rank, its traceback text and the report.

    Attributes: ``rank`` (the root cause: the first rank to fail), ``exc_type`` (its exception's
    type name, or None when it died without one), ``traceback`` (the rank's traceback text),
    ``exit_code`` / ``signal`` (how it ended), ``report`` (every rank's line, root cause first),
    ``restarts`` (group restarts made before giving up).
    """

    def __init__(self, message, *, rank, exc_type, traceback, exit_code, signal, report,
                 restarts):
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.traceback = traceback
        self.exit_code = exit_code
        self.signal = signal
        self.report = report
        self.restarts = restarts


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
        self.proc = subprocess.Popen(
            [python, script, str(theirs.fileno()), json.dumps(self.preload), json.dumps(path)],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self.sock = ours
        self.pid = self.proc.pid
        self.ready = None  # the "ready" message, once received
        self.exits: Dict[int, int] = {}  # exit reports not yet claimed
        self.start_time = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, msg, fds=()):
        if fds:
            socket.send_fds(self.sock, [pickle.dumps(msg)], list(fds))
        else:
            self.sock.sendmsg([pickle.dumps(msg)])

    def recv(self, timeout: Optional[float]):
        """One message (exit reports are queued and the next one read), or None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                return None
            data = self.sock.recv(1 << 20)
            if not data:
                raise Error(f"notebook_launch: the fork server (PID {self.pid}) exited "
                            f"(status {self.proc.wait()})")
            msg = pickle.loads(data)
            if msg["op"] == "exit":
                self.exits[msg["pid"]] = msg["status"]
                continue
            return msg

    def wait_ready(self, timeout: float = 300.0):
        if self.ready is None:
            msg = self.recv(timeout)
            if msg is None or msg["op"] != "ready":
                raise Error(f"notebook_launch: the fork server (PID {self.pid}, {self.python}) "
                            f"did not start within {timeout:.0f} s")
            self.ready = msg
            for name, err in msg["errors"].items():
                print(f"forkguard: the fork server could not preload {name}: {err}",
                      file=sys.stderr)
        return self.ready

    def ensure_preloaded(self, modules: Sequence[str]):
        missing = [m for m in modules if m not in self.preload]
        if missing:
            self.send({"op": "preload", "modules": missing})
            msg = self.recv(300.0)
            if msg is None or msg["op"] != "preloaded":
                raise Error("notebook_launch: the fork server did not answer a preload request")
            self.preload += missing

    def close(self):
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
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


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _visible_gpus() -> List[str]:
    """The GPUs CUDA would show, without touching CUDA: CUDA_VISIBLE_DEVICES, else /proc."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    try:
        n = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        n = 0
    return [str(i) for i in range(n)]


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        core = " (core dumped)" if os.WCOREDUMP(status) else ""
        return f"killed by signal {sig} ({name}){core}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


class _Rank:
    def __init__(self, rank: int):
        self.rank = rank
        self.pid = 0
        self.fds: Dict[int, str] = {}  # our read ends: fd -> "out" | "err" | "res"
        # As the console shows each stream: the launcher's own code, so notebook_launch prints
        # lines, '\r' progress bars and partial lines exactly as `forkguard run` does.
        self.output = {"out": _RankOutput(rank), "err": _RankOutput(rank, tail_lines=20)}
        self.result: List[bytes] = []  # chunks, joined once: linear in the return value's size
        self.status: Optional[int] = None
        self.outcome = None
        self.failed_at: Optional[float] = None
        self.stopped_by_us = False
        self.start = time.monotonic()

    def done(self) -> bool:
        return self.status is not None and not self.fds


def _emit(r: _Rank, stream: str, data: bytes, final: bool = False):
    out = r.output[stream]
    _show(stream, out.close() if final else out.feed(data))


def _show(stream: str, text: bytes):
    if text:
        out = sys.stdout if stream == "out" else sys.stderr
        out.write(text.decode(errors="replace"))
        out.flush()


def _show_due(ranks) -> float:
    """Shows the '\r' states that are due; the seconds until the next one (1 when none)."""
    wait = 1.0
    for r in ranks:
        for stream, out in r.output.items():
            text, due = out.show_due()
            _show(stream, text)
            if due is not None:
                wait = min(wait, due)
    return wait


def _tail(r: _Rank) -> List[str]:
    return [line.decode(errors="replace") for line in r.output["err"].tail]


def notebook_launch(fn: Callable[..., Any], args: Sequence[Any] = (), nproc: int = 1, *,
                    kwargs: Optional[Dict[str, Any]] = None, bind_gpus: bool = False,
                    max_restarts: int = 0, master_addr: str = "127.0.0.1",
                    master_port: Optional[int] = None, env: Optional[Dict[str, str]] = None,
                    preload: Optional[Sequence[str]] = None, grace: float = 5.0,
                    timeout: Optional[float] = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` in ``nproc`` ranks and returns their return values by rank.

    The ranks are forked by a fork server that is a freshly executed interpreter, so they can use
    CUDA whatever this process did with it. Each rank gets torchrun's environment (RANK,
    LOCAL_RANK, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    TORCHELASTIC_RESTART_COUNT, OMP_NUM_THREADS=1 when unset and nproc > 1) over this process's
    environment as it is now, plus ``env``; with ``bind_gpus`` one GPU each through
    CUDA_VISIBLE_DEVICES (more ranks than visible GPUs is refused before anything starts).

    Output appears here line by line, prefixed ``[rankN]:``. The first rank to fail stops the
    others (SIGTERM, then SIGKILL after ``grace`` seconds); the group restarts up to
    ``max_restarts`` times, then :class:`RankError` is raised with the rank, its traceback text
    and every rank's status (the rank's own exception, when it could be pickled, is its
    ``__cause__``). KeyboardInterrupt stops every rank before it propagates. ``timeout``: seconds
    for the whole group, then it is stopped and RankError raised. Nothing is left running.
    """
    if nproc < 1:
        raise ValueError("nproc must be at least 1")
    import cloudpickle

    kwargs = dict(kwargs or {})
    gpus: List[Optional[str]] = [None] * nproc
    if bind_gpus:
        visible = _visible_gpus()
        if nproc > len(visible):
            raise Error(f"notebook_launch: nproc={nproc} with bind_gpus, but {len(visible)} GPU"
                        f"{'' if len(visible) == 1 else 's'} visible ({visible or 'none'})")
        gpus = visible[:nproc]
    payload = cloudpickle.dumps((fn, tuple(args), kwargs))
    with _lock:
        start_server(preload)
        server = _server
        assert server is not None
        server.wait_ready()
        if preload:
            server.ensure_preloaded(preload)
        port = master_port or _free_port(master_addr)
        restarts = 0
        while True:
            ranks = _run_group(server, payload, nproc, gpus, env, master_addr, port, restarts,
                               grace, timeout)
            failed = [r for r in ranks if r.failed_at is not None]
            if not failed:
                return [r.outcome[1] if r.outcome and r.outcome[0] == "ok" else None
                        for r in ranks]
            if restarts >= max_restarts:
                raise _rank_error(ranks, restarts)
            restarts += 1
            print(f"forkguard: restarting the group ({restarts}/{max_restarts})", file=sys.stderr)


def _run_group(server, payload, nproc, gpus, extra_env, master_addr, port, restart, grace,
               timeout) -> List[_Rank]:
    base = dict(os.environ)
    base.update(extra_env or {})
    base.update({
        "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
        "ROLE_RANK": "0", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(restart),
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "forkguard-notebook",
    })
    if nproc > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"
    cwd = os.getcwd()
    path = [p if p else cwd for p in sys.path]
    memfd = os.memfd_create("forkguard-payload", os.MFD_CLOEXEC)
    os.write(memfd, payload)
    ranks = [_Rank(r) for r in range(nproc)]
    by_pid: Dict[int, _Rank] = {}
    try:
        try:
            for r in ranks:
                env = dict(base, RANK=str(r.rank), LOCAL_RANK=str(r.rank))
                if gpus[r.rank] is not None:
                    env["CUDA_VISIBLE_DEVICES"] = gpus[r.rank]
                theirs = []
                for kind in ("out", "err", "res"):
                    rd, wr = os.pipe2(os.O_CLOEXEC)
                    if kind == "res":  # a large return value in 1 MiB steps, not 64 KiB ones
                        try:
                            fcntl.fcntl(wr, fcntl.F_SETPIPE_SZ, 1 << 20)
                        except OSError:
                            pass  # above /proc/sys/fs/pipe-max-size: the default still works
                    r.fds[rd] = kind
                    theirs.append(wr)
                try:
                    server.send({"op": "start", "rank": r.rank, "env": env, "cwd": cwd,
                                 "path": path}, [memfd] + theirs)
                finally:
                    for f in theirs:
                        os.close(f)
            for _ in ranks:
                msg = server.recv(60.0)
                if msg is None or msg["op"] != "started":
                    raise Error("notebook_launch: the fork server could not start a rank: "
                                f"{msg['message'] if msg else 'no answer'}")
                ranks[msg["rank"]].pid = msg["pid"]
                by_pid[msg["pid"]] = ranks[msg["rank"]]
        finally:
            os.close(memfd)
        _supervise(server, ranks, by_pid, grace, timeout)
    except BaseException:
        _stop(server, ranks, by_pid, grace)
        raise
    finally:
        for r in ranks:
            for f in r.fds:
                os.close(f)
            r.fds.clear()
    return ranks


def _claim_exits(server, by_pid):
    for pid in [p for p in server.exits if p in by_pid]:
        by_pid[pid].status = server.exits.pop(pid)


def _outcome(r):
    """The rank's pickled outcome; one cut short (the rank died while sending it) is its error."""
    data, r.result = b"".join(r.result), []
    try:
        return pickle.loads(data)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the bytes are not whole
        return ("error", "TruncatedResult",
                f"rank {r.rank}'s return value arrived incomplete ({len(data)} bytes): "
                f"{type(e).__name__}: {e}", "", None)


def _mark_failures(ranks, now):
    for r in ranks:
        if r.failed_at is not None:
            continue
        if r.outcome is not None and r.outcome[0] == "error":
            r.failed_at = now
        elif r.status is not None and not r.fds and r.status != 0:
            r.failed_at = now


def _supervise(server, ranks, by_pid, grace, timeout):
    poller = select.poll()
    owner: Dict[int, _Rank] = {}
    for r in ranks:
        for f in r.fds:
            poller.register(f, select.POLLIN)
            owner[f] = r
    poller.register(server.sock, select.POLLIN)
    deadline = None if timeout is None else time.monotonic() + timeout
    stop_sent = kill_at = None
    while not all(r.done() for r in ranks):
        now = time.monotonic()
        wait = _show_due(ranks)
        if kill_at is not None:
            wait = max(0.0, min(wait, kill_at - now))
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - now))
        for fd, _ in poller.poll(wait * 1000):
            if fd == server.sock.fileno():
                msg = server.recv(0)
                if msg is not None:
                    raise Error(f"notebook_launch: unexpected message from the fork server: {msg}")
                continue
            r = owner[fd]
            kind = r.fds[fd]
            data = os.read(fd, 1 << 20 if kind == "res" else 1 << 16)
            if kind == "res":
                r.result.append(data)
            else:
                _emit(r, kind, data)
            if not data:
                poller.unregister(fd)
                os.close(fd)
                del r.fds[fd]
                if kind == "res" and r.result:
                    r.outcome = _outcome(r)
                elif kind != "res":
                    _emit(r, kind, b"", final=True)
        _claim_exits(server, by_pid)
        now = time.monotonic()
        _mark_failures(ranks, now)
        timed_out = deadline is not None and now >= deadline
        if (timed_out or any(r.failed_at for r in ranks)) and stop_sent is None:
            stop_sent = now
            kill_at = now + grace
            live = [r for r in ranks if r.status is None]
            for r in live:
                r.stopped_by_us = True
            if timed_out:
                for r in live:
                    r.failed_at = r.failed_at or now
                    r.outcome = r.outcome or ("error", "TimeoutError",
                                              f"notebook_launch timeout ({timeout} s)", "", None)
            server.send({"op": "kill", "pids": [r.pid for r in live], "signal": signal.SIGTERM})
        if kill_at is not None and now >= kill_at:
            server.send({"op": "kill", "pids": [r.pid for r in ranks if r.status is None],
                         "signal": signal.SIGKILL})
            kill_at = None


def _stop(server, ranks, by_pid, grace):
    """KeyboardInterrupt or an error here: stop every rank and wait for all of them."""
    live = [r for r in ranks if r.pid and r.status is None]
    if not live:
        return
    try:
        server.send({"op": "kill", "pids": [r.pid for r in live], "signal": signal.SIGTERM})
        deadline = time.monotonic() + grace
        escalated = False
        while any(r.status is None for r in live):
            now = time.monotonic()
            if now >= deadline and not escalated:
                server.send({"op": "kill", "pids": [r.pid for r in live if r.status is None],
                             "signal": signal.SIGKILL})
                escalated = True
            try:
                server.recv(0.05 if not escalated else 1.0)
            except KeyboardInterrupt:
                deadline = now  # a second Ctrl-C: SIGKILL now
            _claim_exits(server, by_pid)
    except (OSError, Error):
        stop_server()  # the server is gone or confused: closing it kills every rank


def _rank_error(ranks: List[_Rank], restarts: int) -> RankError:
    failed = sorted((r for r in ranks if r.failed_at is not None and not
                     (r.stopped_by_us and (r.outcome is None or r.outcome[0] != "error"))),
                    key=lambda r: (r.failed_at, r.rank))
    root = failed[0] if failed else sorted(ranks, key=lambda r: (r.failed_at or 1e30))[0]
    lines = []
    for r in [root] + [r for r in ranks if r is not root]:
        how = _describe_status(r.status) if r.status is not None else "no exit status"
        what = ""
        if r.outcome and r.outcome[0] == "error":
            what = f"{r.outcome[1]}: {r.outcome[2]}; "
        note = " (root cause)" if r is root else (" (stopped by forkguard)" if r.stopped_by_us
                                                  else "")
        lines.append(f"  rank {r.rank} (PID {r.pid}): {what}{how}{note}")
    exc_type = tb = None
    cause = None
    if root.outcome and root.outcome[0] == "error":
        _, exc_type, text, tb, pickled = root.outcome
        head = f"rank {root.rank} failed: {exc_type}: {text}"
        if pickled is not None:
            try:
                cause = pickle.loads(pickled)
            except Exception:  # noqa: BLE001 - the text above still says what happened
                cause = None
    else:
        head = f"rank {root.rank} failed: {_describe_status(root.status or 0)}"
        if _tail(root):
            tb = "\n".join(_tail(root))
    restarts_note = f" after {restarts} restart{'s' if restarts != 1 else ''}" if restarts else ""
    message = head + restarts_note
    if tb:
        message += f"\n\nrank {root.rank}'s traceback:\n{tb.rstrip()}"
    message += "\n\nranks:\n" + "\n".join(lines)
    status = root.status or 0
    err = RankError(message, rank=root.rank, exc_type=exc_type, traceback=tb or "",
                    exit_code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                    signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                    report="\n".join(lines), restarts=restarts)
    err.__cause__ = cause
    return err
