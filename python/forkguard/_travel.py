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

Shared ctypes (mp.Value, mp.Array) travel as their arena's fd: the memory is shared, as with a
fork.

torch's reducers (tensors through shared memory) are left out: a tensor travels by value, a copy
per rank, as a fork gives each rank a copy-on-write one.

forkguard.DataLoader's fork-server workers receive their spec the same way (``pack``; the fds
held by the server as "dataloader_hold" while it forks them): the twins live as long as the
workers, across a persistent loader's passes, and are given back once they stopped.
"""
from __future__ import annotations

import contextlib
import copyreg
import io
import pickle
from typing import Any, Dict, Iterator, List, Optional, Tuple

from multiprocessing import context, popen_forkserver, reduction, sharedctypes, synchronize

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


def _multiprocessing_reducers():
    """multiprocessing's own reducers in ForkingPickler's table as it is now: the stdlib's types',
    and the shared ctypes' (sharedctypes registers a ctypes type when the first Value or Array of
    it is made)."""
    return {t: r for t, r in list(reduction.ForkingPickler._extra_reducers.items())
            if t.__module__.split(".")[0] in _STDLIB or r is sharedctypes.reduce_ctype}


def _pickler_class():
    from . import _by_value  # cloudpickle, keeping the code's file names for tracebacks

    base = _by_value.Pickler

    class LaunchPickler(base):
        def __init__(self, file, twins):
            # Read by the pickler's __init__: the reducers registered up to now.
            self.dispatch_table = {**base.dispatch_table, **_multiprocessing_reducers()}
            super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
            self.twins = twins  # id(original) -> (original, twin); None: a trial, makes none

        def reducer_override(self, obj):
            if isinstance(obj, synchronize.SemLock) and obj._semlock.name is None:
                if self.twins is None:
                    return int, ()
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


class Parcel:
    """An object pickled to travel: ``data``, the fds it refers to (this process's own: keep the
    object alive until they were sent), and the twins it made. ``give_back()`` once the
    receivers stopped: each original takes its twin's value, and the twins are dropped (their
    names unlinked)."""

    def __init__(self, data: bytes, fds: List[int], twins: Dict[int, Tuple[Any, Any]]):
        self.data, self.fds, self._twins = data, fds, twins

    def give_back(self) -> None:
        twins, self._twins = self._twins, {}
        for original, twin in twins.values():
            _give_back(original._semlock, twin._semlock)


def _dump(obj, twins: Optional[Dict[int, Tuple[Any, Any]]]) -> Tuple[bytes, List[int]]:
    global _pickler
    if _pickler is None:
        _pickler = _pickler_class()
    buf = io.BytesIO()
    collector = _Collector()
    context.set_spawning_popen(collector)
    try:
        _pickler(buf, twins).dump(obj)
    finally:
        context.set_spawning_popen(None)
    return buf.getvalue(), collector.fds


def pack(obj) -> Parcel:
    """`obj` pickled to travel to children of the fork server; raises what pickling raised (the
    twins it made so far are dropped)."""
    twins: Dict[int, Tuple[Any, Any]] = {}
    data, fds = _dump(obj, twins)
    return Parcel(data, fds, twins)


def check(obj) -> None:
    """Raises what pack(obj) would, without making twins."""
    _dump(obj, None)


@contextlib.contextmanager
def payload(fn, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Iterator[Tuple[bytes, List[int]]]:
    """Yields the pickled (fn, args, kwargs) and the fds it refers to (this process's own: keep
    the arguments alive until the launch is over); gives the twins' values back on exit."""
    parcel = pack((fn, args, kwargs))
    try:
        yield parcel.data, parcel.fds
    finally:
        parcel.give_back()


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
