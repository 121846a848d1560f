"""A launch's function and arguments, pickled for ranks forked by the interpreter fork server.

cloudpickle (functions and classes of a notebook by value) with multiprocessing's own reducers,
pickled as for a forkserver child: a Connection, a Queue's pipe, a socket travels as an fd
(``duplicate_for_child``: the fds are sent once to the fork server, whose ranks inherit them and
find them where a forkserver child does: _server.py, "hold_fds"), a named semaphore by its name.

A fork context's semaphores (a Queue, Lock, Event made by ``get_context("fork")``, the Linux
default) have no name: only a fork of their process can reach them. Each travels as a named twin
made here with its value; the ranks share the twin, and when the launch is over the original is
given the twin's value (a Queue's items counted as the ranks left them) and the twin is unlinked.
While the launch runs this process's own users of such an object (other threads) do not see the
ranks' acquisitions.

torch's reducers (tensors through shared memory) are left out: a tensor travels by value, a copy
per rank, as a fork gives each rank a copy-on-write one.
"""
from __future__ import annotations

import contextlib
import copyreg
import io
import pickle
from typing import Any, Dict, Iterator, List, Tuple

from multiprocessing import context, popen_forkserver, reduction, synchronize

_STDLIB = ("multiprocessing", "_multiprocessing", "socket", "_socket")


class _NamedContext:
    """What SemLock.__init__ reads of its context: not fork, so the semaphore gets a name (and
    multiprocessing's resource tracker unlinks it should this process die first)."""

    @staticmethod
    def get_start_method():
        return "forkserver"


class _Collector:
    """The "spawning popen" multiprocessing's reducers ask while the payload is pickled."""

    DupFd = popen_forkserver._DupFd

    def __init__(self):
        self.fds: List[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1


def _pickler_class():
    from . import _by_value  # cloudpickle, keeping the code's file names for tracebacks

    base = _by_value.Pickler
    stdlib = {t: r for t, r in reduction.ForkingPickler._extra_reducers.items()
              if t.__module__.split(".")[0] in _STDLIB}

    class LaunchPickler(base):
        dispatch_table = {**base.dispatch_table, **stdlib}

        def __init__(self, file, twins):
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.twins = twins  # id(original) -> (original, twin)

        def reducer_override(self, obj):
            if isinstance(obj, synchronize.SemLock) and obj._semlock.name is None:
                pair = self.twins.get(id(obj))
                if pair is None:
                    sl = obj._semlock
                    twin = synchronize.SemLock(sl.kind, sl._get_value(), sl.maxvalue,
                                               ctx=_NamedContext())
                    pair = self.twins[id(obj)] = (obj, twin)
                sl = pair[1]._semlock
                # What SemLock.__setstate__ rebuilds from: the handle is unused where the name is.
                return copyreg.__newobj__, (type(obj),), (0, sl.kind, sl.maxvalue, sl.name)
            return super().reducer_override(obj)

    return LaunchPickler


_pickler = None


@contextlib.contextmanager
def payload(fn, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Iterator[Tuple[bytes, List[int]]]:
    """Yields the pickled (fn, args, kwargs) and the fds it refers to (this process's own: keep
    the arguments alive until the launch is over); gives the twins' values back on exit."""
    global _pickler
    if _pickler is None:
        _pickler = _pickler_class()
    buf = io.BytesIO()
    collector = _Collector()
    twins: Dict[int, Tuple[Any, Any]] = {}
    context.set_spawning_popen(collector)
    try:
        _pickler(buf, twins).dump((fn, args, kwargs))
    finally:
        context.set_spawning_popen(None)
    try:
        yield buf.getvalue(), collector.fds
    finally:
        for original, twin in twins.values():
            _give_back(original._semlock, twin._semlock)


def _give_back(original, twin) -> None:
    """The original semaphore takes the twin's value, as if the ranks had used it (a recursive
    lock belongs to a thread: it keeps its own)."""
    if original.kind == synchronize.RECURSIVE_MUTEX:
        return
    want, have = twin._get_value(), original._get_value()
    for _ in range(max(0, want - have)):
        original.release()
    for _ in range(max(0, have - want)):
        if not original.acquire(False):
            break
