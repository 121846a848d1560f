"""The parent's side of a rerouted start (forkguard.guard(), policy "reroute").

The child is forked by the interpreter fork server of notebook_launch (``_launch._server``): one
"guard_start" request carrying a memfd with three pickles (multiprocessing's preparation data,
``__main__`` by value when it has no file, the Process object) and the fds the child needs:
  [payload, sentinel write end, parent-alive read end, stdout, stderr, *inherited]
``inherited`` are the fds multiprocessing's reducers asked for (DupFd: Connections, Arenas,
torch's shared-memory storages), found by the child as a forkserver child finds them.
The server reports the child's exit status; the Popen below reads it from there.
"""
from __future__ import annotations

import io
import os
import pickle
import signal
import sys
import time
from collections import ChainMap
from typing import Optional

from multiprocessing import connection, context, popen_forkserver, reduction, spawn, util
from multiprocessing import synchronize

from . import _launch
from ._guard import RerouteError
from ._native import Error


def _pickler_class():
    from . import _by_value  # cloudpickle, keeping the code's file names for tracebacks

    base = _by_value.Pickler

    class GuardPickler(base):
        """cloudpickle (functions and classes of __main__ by value) with multiprocessing's
        reducers (Connection, Arena, SemLock, torch's tensors: ForkingPickler._extra_reducers)."""

        dispatch_table = ChainMap(reduction.ForkingPickler._extra_reducers, base.dispatch_table)

        def reducer_override(self, obj):
            if isinstance(obj, synchronize.SemLock) and obj._semlock.name is None:
                raise _CannotTravel(
                    f"{type(obj).__name__} {obj!r} was created by the fork context while this "
                    "process was fork-safe (or before guard()): its semaphore has no name, so a "
                    "child that is not a fork of this process cannot open it. Create it after "
                    "guard() once CUDA is initialized, or use get_context('spawn')")
            return super().reducer_override(obj)

    return GuardPickler


class _CannotTravel(Exception):
    pass


_pickler = None


def _dumps(obj) -> bytes:
    global _pickler
    if _pickler is None:
        _pickler = _pickler_class()
    buf = io.BytesIO()
    _pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _main_by_value():
    """__main__'s functions and classes, by value, for a __main__ without a file (a notebook,
    python -c): what multiprocessing's queues later pickle by reference to __main__ resolves."""
    main = sys.modules.get("__main__")
    out = {}
    if main is None:
        return out
    for name, obj in list(vars(main).items()):
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
            if getattr(obj, "__module__", None) != "__main__":
                continue
            try:
                out[name] = _dumps(obj)
            except Exception:  # noqa: BLE001 - what cannot travel is looked up in vain, as in spawn
                continue
    return out


class ReroutedPopen:
    """popen_fork.Popen's interface over a child of the interpreter fork server."""

    method = "fork"
    DupFd = popen_forkserver._DupFd  # the child finds its fds where a forkserver child does

    def __init__(self, process_obj, dirty):
        util._flush_std_streams()
        self.returncode: Optional[int] = None
        self.finalizer = None
        self._fds = []
        self._launch(process_obj, dirty)

    def duplicate_for_child(self, fd):
        self._fds.append(fd)
        return len(self._fds) - 1

    def _launch(self, process_obj, dirty):
        prep = spawn.get_preparation_data(process_obj._name)
        by_value = {} if ("init_main_from_path" in prep or "init_main_from_name" in prep) \
            else _main_by_value()
        context.set_spawning_popen(self)
        try:
            parts = [_dumps(prep), _dumps(by_value), _dumps(dict(os.environ)),
                     _dumps(process_obj)]
        except _CannotTravel as e:
            raise RerouteError(dirty, process_obj.name, str(e)) from None
        except Exception as e:  # noqa: BLE001 - converted: the message names what failed
            raise RerouteError(dirty, process_obj.name,
                               f"its Process object cannot be pickled: {type(e).__name__}: {e}"
                               ) from e
        finally:
            context.set_spawning_popen(None)
        memfd = os.memfd_create("forkguard-guard-child", os.MFD_CLOEXEC)
        sentinel_r, sentinel_w = os.pipe()
        alive_r, alive_w = os.pipe()
        try:
            with os.fdopen(os.dup(memfd), "wb") as f:
                for p in parts:
                    f.write(p)
            os.lseek(memfd, 0, os.SEEK_SET)  # the child reads from this fd's offset
            with _launch._lock:
                server = _server()
            msg = server.exchange(["guard_start", process_obj.name],
                                  [memfd, sentinel_w, alive_r, 1, 2] + self._fds, 60.0)
            if msg is None or msg[0] != "guard_started":
                raise Error(f"forkguard.guard(): the fork server could not start "
                            f"{process_obj.name}: {msg[1] if msg else 'no answer'}")
        except BaseException:
            os.close(sentinel_r)
            os.close(alive_w)
            raise
        finally:
            for f in (memfd, sentinel_w, alive_r):
                os.close(f)
        self.pid = int(msg[1])
        self.sentinel = sentinel_r
        self.finalizer = util.Finalize(self, util.close_fds, (sentinel_r, alive_w))

    def _status(self, timeout: float) -> Optional[int]:
        """The child's wait status from the server's exit report, waiting up to timeout (the
        report is claimed from the queue this process's attachments to the server share: a
        launch or a DataLoader reading the socket meanwhile keeps it for us)."""
        deadline = time.monotonic() + timeout
        exited_at = None
        while True:
            server = _launch._server
            if server is None:
                return None
            try:
                status = server.link.wait_exit(
                    self.pid, min(max(0.0, deadline - time.monotonic()), 0.05))
            except (OSError, Error, ValueError):
                return None
            if status is not None:
                return status
            now = time.monotonic()
            if exited_at is None and connection.wait([self.sentinel], 0):
                exited_at = now
            if exited_at is not None and now - exited_at > 5.0:
                return 255 << 8  # the server died without a report: it took the child along
            if now >= deadline:
                return None

    def _server_gone(self) -> bool:
        server = _launch._server
        return server is None or not server.alive()

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            blocking = flag == 0
            status = self._status(3600 * 24 * 365 if blocking else 0)
            if status is not None:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif self._server_gone() and connection.wait([self.sentinel], 0):
                self.returncode = -signal.SIGKILL  # the fork server died and took it along
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            if timeout is None:  # not the sentinel: a grandchild may hold its write end
                return self.poll(0)
            if not connection.wait([self.sentinel], timeout):
                return None
            # The child has exited (its sentinel closed): the server's report follows at once.
            return self.poll(os.WNOHANG if timeout == 0.0 else 0)
        return self.returncode

    def _send_signal(self, sig):
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self):
        self._send_signal(signal.SIGTERM)

    def kill(self):
        self._send_signal(signal.SIGKILL)

    def close(self):
        if self.finalizer is not None:
            self.finalizer()


def _server():
    """The interpreter fork server, started (and ready) on first use. Call with _launch._lock."""
    _launch.start_server()
    server = _launch._server
    server.wait_ready()
    return server


