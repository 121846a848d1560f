"""The parent's side of a rerouted start (forkguard.guard(), policy "reroute").

The child is forked by the interpreter fork server of notebook_launch (``_launch._server``): one
"guard_start" request carrying a memfd (the payload, below) and the fds the child needs:
  [payload, sentinel write end, parent-alive read end, stdout, stderr, resource tracker,
   *inherited]
``inherited`` are the fds multiprocessing's reducers asked for (DupFd: Connections, Arenas,
torch's shared-memory storages), found by the child as a forkserver child finds them; the
resource tracker is this process's, which a spawn child shares too (a SharedMemory the child
attaches to stays its creator's to unlink).
The server reports the child's exit status; the Popen below reads it from there.

__main__ in the child is a fresh module standing for this one, never executed (a fork child does
not run the script again; _guard_child._fresh_main), holding this process's values of the
__main__ globals the Process refers to and of all of __main__'s functions and classes, as a fork
would see them. They are one name each (``_main_state``): a function of __main__ runs with the
child's __main__ as its globals, and what the Process holds of __main__ by name travels by
reference to it, so the child's __main__.X is the X it was given (an initializer's global is the
tasks' global; an instance of a __main__ class pickles again in the child). A value that cannot
travel, or cannot be rebuilt in the child, is a stand-in there that raises NotCarriedError,
naming it and why, at its first use.

The payload: large buffers (numpy arrays: ``_OUT_OF_BAND``) first, each at a page boundary, then
one plain pickle of the parts, each a pickle and the indexes of its buffers; the child maps the
buffers copy-on-write instead of reading them, and this process writes them straight from their
memory: a 400 MB global costs one copy in the memfd per start, no pickled copy in this process.
"""
from __future__ import annotations

import importlib
import io
import mmap
import os
import pickle
import signal
import sys
import time
import types
from collections import ChainMap
from typing import Optional

from multiprocessing import connection, context, popen_forkserver, reduction, resource_tracker
from multiprocessing import spawn, synchronize, util

from . import _launch
from ._guard import RerouteError
from ._native import Error


_OUT_OF_BAND = 1 << 20  # a buffer this large travels beside the pickle, mapped by the child


class _ChildMain:
    """Pickled as the child's __main__ module."""


class _ChildMainDict:
    """Pickled as the child's __main__.__dict__: the globals of __main__'s functions there."""


_CHILD_MAIN = _ChildMain()
_CHILD_MAIN_DICT = _ChildMainDict()


def _main_name(main, obj):
    """The name under which ``obj``, a function or class of __main__, is a __main__ global."""
    if (type(obj) is types.FunctionType or isinstance(obj, type)) and \
            getattr(obj, "__module__", None) == "__main__":
        name = getattr(obj, "__qualname__", None)
        if isinstance(name, str) and vars(main).get(name) is obj:
            return name
    return None


def _reduce_library(lib):
    """A ctypes library (``DRIVER = ctypes.CDLL(path)`` at a script's top level) travels as its
    name: the child loads the same library, which a fork child would have mapped."""
    return type(lib), (lib._name,)


def _pickler_class():
    import ctypes

    from . import _by_value  # cloudpickle, keeping the code's file names for tracebacks

    base = _by_value.Pickler
    libraries = {ctypes.CDLL: _reduce_library, ctypes.PyDLL: _reduce_library}

    class GuardPickler(base):
        """cloudpickle (functions and classes of __main__ by value) with multiprocessing's
        reducers (Connection, Arena, SemLock, torch's tensors: ForkingPickler._extra_reducers).
        With ``main``: __main__'s functions and classes (but ``root``) by reference to the
        child's __main__, their names in ``main_refs``, and __main__'s functions with the child's
        __main__ as their globals (the names they read in ``main_names``, not in their state)."""

        dispatch_table = ChainMap(libraries, reduction.ForkingPickler._extra_reducers,
                                  base.dispatch_table)

        def __init__(self, file, main=None, root=None, buffer_callback=None):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL,
                             buffer_callback=buffer_callback)
            self._main = main
            self._root = root
            self.main_refs = set()
            self.main_names = set()

        def reducer_override(self, obj):
            if obj is _CHILD_MAIN_DICT:
                return vars, (_CHILD_MAIN,)
            if obj is _CHILD_MAIN:
                return importlib.import_module, ("__main__",)
            if isinstance(obj, synchronize.SemLock) and obj._semlock.name is None:
                raise _CannotTravel(
                    f"{type(obj).__name__} {obj!r} was created by the fork context while this "
                    "process was fork-safe (or before guard()): its semaphore has no name, so a "
                    "child that is not a fork of this process cannot open it. Create it after "
                    "guard() once CUDA is initialized, or use get_context('spawn')")
            if self._main is not None and obj is not self._root:
                name = _main_name(self._main, obj)
                if name is not None:
                    self.main_refs.add(name)
                    return NotImplemented  # pickle's own: by reference, __main__.name
            return super().reducer_override(obj)

        def _dynamic_function_reduce(self, func):
            reduced = super()._dynamic_function_reduce(func)
            if self._main is None or func.__globals__ is not vars(self._main):
                return reduced
            make, newargs, (state, slotstate), *rest = reduced
            self.main_names.update(name for name in slotstate["__globals__"]
                                   if not (name.startswith("__") and name.endswith("__")))
            slotstate = dict(slotstate, __globals__={})
            return (make, (newargs[0], _CHILD_MAIN_DICT, *newargs[2:]), (state, slotstate),
                    *rest)

    return GuardPickler


class _CannotTravel(Exception):
    pass


_pickler = None


class _Pickled:
    """One object's pickle: its bytes, its out-of-band buffers, the __main__ names it refers to."""

    def __init__(self, obj, main=None, root=None):
        global _pickler
        if _pickler is None:
            _pickler = _pickler_class()
        self.views = []
        buf = io.BytesIO()
        pickler = _pickler(buf, main, root, self._offer)
        pickler.dump(obj)
        self.data = buf.getvalue()
        self.refs = pickler.main_refs
        self.names = pickler.main_refs | pickler.main_names

    def _offer(self, buffer):
        """pickle's buffer_callback: a large contiguous buffer out of band (a false return)."""
        try:
            view = buffer.raw()
        except BufferError:
            return True
        if view.nbytes < _OUT_OF_BAND:
            return True
        self.views.append(view)
        return False


def _main_definitions(main):
    """__main__'s functions and classes, for a __main__ without a file (a notebook, python -c):
    what multiprocessing's queues later pickle by reference to __main__ resolves."""
    return {name for name, obj in list(vars(main).items()) if _main_name(main, obj) == name}


def _main_state(main, names, process):
    """([(name, _Pickled)], [(name, why)]): the __main__ globals ``names`` and those they refer
    to, each by value, in an order where what one refers to by name is installed before it; and
    those that cannot be pickled, with why: the child gets a stand-in that names it at its first
    use (_guard_child._NotCarried). An error here, as it was when it travelled inside the Process:
    a function or class the Process refers to by name, or an unnamed semaphore (_CannotTravel)
    the Process refers to or its functions read."""
    pickled = {}
    why = {}
    todo = sorted(names, reverse=True)
    while todo:
        name = todo.pop()
        if name in pickled or name not in vars(main):
            continue
        value = vars(main)[name]
        try:
            pickled[name] = part = _Pickled(value, main, root=value)
        except _CannotTravel as e:
            if name in process.names:
                raise
            pickled[name], why[name] = None, str(e)
            continue
        except Exception as e:  # noqa: BLE001 - named in the child, but as said above
            if name in process.refs:
                raise _CannotTravel(f"__main__.{name} cannot be pickled by value: "
                                    f"{type(e).__name__}: {e}") from e
            pickled[name], why[name] = None, f"it cannot be pickled: {type(e).__name__}: {e}"
            continue
        todo.extend(sorted(part.names - pickled.keys(), reverse=True))
    order, placed = [], set()
    for first in sorted(pickled):
        if first in placed:
            continue
        stack = [(first, iter(sorted(pickled[first].names if pickled[first] else ())))]
        placed.add(first)
        while stack:
            name, deps = stack[-1]
            dep = next((d for d in deps if d in pickled and d not in placed), None)
            if dep is None:
                stack.pop()
                order.append(name)
            else:
                placed.add(dep)
                stack.append((dep, iter(sorted(pickled[dep].names if pickled[dep] else ()))))
    return ([(name, pickled[name]) for name in order if pickled[name] is not None],
            sorted(why.items()))


def _write_payload(fd, parts, **plain):
    """Writes ``parts`` ({key: _Pickled or [(name, _Pickled)]}) and ``plain`` (plain data) to the
    memfd: the buffers from offset 0, each page-aligned, then the parts' pickle, where the fd's
    offset is left."""
    table, offset = [], 0

    def place(part):
        nonlocal offset
        indexes = []
        for view in part.views:
            indexes.append(len(table))
            table.append((offset, view.nbytes, view.readonly))
            done = 0
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], offset + done)
            offset += -(-view.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        return part.data, indexes

    out = {key: [(name, place(p)) for name, p in part] if isinstance(part, list) else place(part)
           for key, part in parts.items()}
    out.update(plain, buffers=table)
    data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)
    os.lseek(fd, offset, os.SEEK_SET)  # the child reads from this fd's offset


class ReroutedPopen:
    """popen_fork.Popen's interface over a child of the interpreter fork server."""

    method = "fork"
    DupFd = popen_forkserver._DupFd  # the child finds its fds where a forkserver child does

    def __init__(self, process_obj, dirty):
        util._flush_std_streams()
        self.returncode: Optional[int] = None
        self.finalizer = None
        self._child = None  # _native._ServerChild, once started
        self._fds = []
        self._launch(process_obj, dirty)

    def duplicate_for_child(self, fd):
        self._fds.append(fd)
        return len(self._fds) - 1

    def _launch(self, process_obj, dirty):
        prep = spawn.get_preparation_data(process_obj._name)
        main = sys.modules.get("__main__")
        resource_tracker.ensure_running()
        context.set_spawning_popen(self)
        try:
            parts = {"prep": _Pickled(prep), "environ": _Pickled(dict(os.environ))}
            not_carried = []
            parts["process"] = _Pickled(process_obj, main)
            if main is not None:
                # The child's __main__ is not the script run again (_guard_child._fresh_main):
                # what the Process refers to, and every function and class of __main__ (what a
                # Queue's items name by reference), reach it by value.
                names = parts["process"].names | _main_definitions(main)
                parts["main"], not_carried = _main_state(main, names, parts["process"])
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
            _write_payload(memfd, parts, not_carried=not_carried)
            del parts
            with _launch._lock:
                server = _server()
            fds = [memfd, sentinel_w, alive_r, 1, 2, resource_tracker.getfd()] + self._fds
            try:
                # Its handle: the pidfd the server opened before it could reap it, so a signal
                # reaches this child or nothing, never a later process with its PID.
                self._child = server.start_child(["guard_start", process_obj.name], fds, 60.0)
            except Error as e:
                if not server.alive():
                    raise
                raise Error(f"forkguard.guard(): the fork server could not start "
                            f"{process_obj.name}: {e}") from None
        except BaseException:
            os.close(sentinel_r)
            os.close(alive_w)
            raise
        finally:
            for f in (memfd, sentinel_w, alive_r):
                os.close(f)
        self.pid = self._child.pid
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
            except Error:
                # The server is gone and no report will come. Its children die with it
                # (PR_SET_PDEATHSIG, SIGKILL): that is the status, once the sentinel says it died.
                if connection.wait([self.sentinel],
                                   min(max(0.0, deadline - time.monotonic()), 60.0)):
                    return signal.SIGKILL  # the wait status of a process killed by SIGKILL
                return None
            except (OSError, ValueError):
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
            self._child.signal(sig)  # by its pidfd: nothing once it has exited

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


