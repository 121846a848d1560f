"""forkguard.guard(): multiprocessing's "fork" start method, checked at every Process.start().

    import forkguard
    forkguard.guard()              # or FORKGUARD_GUARD=reroute, or python3 -m forkguard.guard x.py
    loader = DataLoader(ds, num_workers=4)   # unchanged code, after something initialized CUDA

At each start of a fork-method Process (the default context on Linux, get_context("fork"),
torch.multiprocessing, DataLoader workers, Pool and ProcessPoolExecutor workers) the fast probe
asks whether this process is fork-safe: CUDA initialized, torch's fork poison, a live GNU OpenMP
thread pool (a forked child hangs at its first parallel op) make it not. Fork-safe: the plain fork, exactly as without the guard.
Not fork-safe, by policy:
  reroute  the child is forked by the interpreter fork server notebook_launch uses (a freshly
           executed interpreter, clean of CUDA and of thread pools) and keeps a fork child's
           semantics: the script is not run again; the Process travels by value (cloudpickle),
           multiprocessing's objects in its arguments as the forkserver passes them (fds over
           SCM_RIGHTS, semaphores by name), the __main__ globals it refers to and __main__'s
           functions and classes with this process's values; one that cannot travel raises
           NotCarriedError in the child, naming it, at its first use (_guard_reroute.py);
  refuse   ForkUnsafeError with the evidence and the cures, before any child exists;
  warn     one warning with the evidence, then the plain fork.
Under the guard a dirty os.fork() (which cannot be rerouted without changing its meaning) is
warned about once, naming the Python line that called it.

Thread-safety: guard()/unguard() may be called from any thread; starts from several threads are
serialized on the fork server's socket only when rerouted.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Optional

from . import _torch_fork
from ._native import Error
from ._probe import (OPENMP_POOL, PYTHON_CURES, ForkUnsafeError, ProbeResult,
                     probe_if_fork_unsafe)

POLICIES = ("reroute", "refuse", "warn")

_lock = threading.Lock()
_policy: Optional[str] = None  # None: not guarded
_original_popen = None  # ForkProcess._Popen before guard()
_original_semlock_init = None
_at_fork_registered = False
_said = set()  # what was said once per process: "reroute", "warn", "os.fork"
_in_start = threading.local()  # our own plain fork: the os.fork hook stays quiet


class DirtyForkWarning(RuntimeWarning):
    """A fork in a process that is not fork-safe (policy "warn", or os.fork() under the guard)."""


class RerouteError(ForkUnsafeError):
    """guard() could not send a child to the clean fork server: the message names the object
    that cannot travel and why. Raised in the parent before any child exists."""

    def __init__(self, result: ProbeResult, process_name: str, what: str):
        Error.__init__(self, (
            f"forkguard.guard(): this process (PID {result.pid}) is {result.verdict}, so "
            f"{process_name} would be rerouted to the clean fork server, but {what}.\n"
            "cures:\n" + "\n".join(f"  - {c}" for c in PYTHON_CURES)))
        self.result = result


class NotCarriedError(Error):
    """Raised in a rerouted child at the first use of a __main__ global of its parent that could
    not reach it (it cannot be pickled, or could not be rebuilt there): the message names it and
    why. A forked child would have shared it."""


_seen_dirty = False  # CUDA, once initialized here, stays so: semaphores need not ask again


def _dirty() -> Optional[ProbeResult]:
    """The probe when this process is not fork-safe: CUDA initialized (the driver's state),
    torch's fork poison registered (torch.cuda.is_available() on a CUDA build, even without a GPU:
    its children would be in torch's bad fork), or a live GNU OpenMP pool (they would hang)."""
    global _seen_dirty
    result = probe_if_fork_unsafe()
    if result is None:
        return None
    _seen_dirty = True
    return result


def _failure(result: ProbeResult, whose: str = "its") -> str:
    """How a plain fork child of this process fails: the driver's error, torch's, or a hang."""
    if result.verdict == OPENMP_POOL:
        return ("the child hangs at its first parallel CPU op: GNU OpenMP's thread pool, alive "
                "here, does not survive fork")
    if result.verdict in _torch_fork.SUMMARIES:
        return (f"{whose} CUDA calls will fail (torch's \"Cannot re-initialize CUDA in forked "
                "subprocess\": torch's fork poison)")
    return f"{whose} CUDA calls will fail (CUDA_ERROR_NOT_INITIALIZED = 3)"


def _evidence_lines(result: ProbeResult, n: int = 3):
    lines = [f"  - {e.kind}: {e.detail} [{e.source}]" for e in result.evidence[:n]]
    if len(result.evidence) > n:
        lines.append(f"  ... {len(result.evidence) - n} more (forkguard.probe() lists them)")
    return lines


def _say_once(key: str, text: str) -> None:
    if key in _said:
        return
    _said.add(key)
    print(text, file=sys.stderr, flush=True)


def _guarded_popen(process_obj):
    """ForkProcess._Popen under the guard."""
    policy = _policy
    original = _original_popen
    if policy is None or original is None:  # unguard() raced with this start
        return (original or _stock_fork_popen)(process_obj)
    dirty = _dirty()
    if dirty is None:
        return _plain_fork(original, process_obj)
    if policy == "refuse":
        raise ForkUnsafeError(dirty)
    if policy == "warn":
        if "warn" not in _said:
            _said.add("warn")
            frame = _caller_frame()
            warnings.warn_explicit(
                "\n".join([f"forkguard.guard(): starting {process_obj.name} with a plain fork, "
                           f"but this process (PID {dirty.pid}) is {dirty.verdict}: "
                           f"{_failure(dirty)}."]
                          + _evidence_lines(dirty)), DirtyForkWarning,
                frame.f_code.co_filename if frame else "<unknown>",
                frame.f_lineno if frame else 0)
        return _plain_fork(original, process_obj)
    from ._guard_reroute import ReroutedPopen

    popen = ReroutedPopen(process_obj, dirty)
    _say_once("reroute", "\n".join(
        [f"forkguard.guard(): this process (PID {dirty.pid}) is {dirty.verdict}, not fork-safe:"]
        + _evidence_lines(dirty)
        + ["  multiprocessing's fork children are started from forkguard's clean interpreter "
           f"fork server instead (first: {process_obj.name}, PID {popen.pid}); said once."]))
    return popen


def _caller_frame():
    """The first frame outside multiprocessing and forkguard: the line that started the child."""
    import multiprocessing

    skip = (os.path.dirname(multiprocessing.__file__), os.path.dirname(__file__))
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return frame


def _stock_fork_popen(process_obj):
    from multiprocessing.popen_fork import Popen

    return Popen(process_obj)


def _plain_fork(original, process_obj):
    _in_start.active = True
    try:
        return original(process_obj)
    finally:
        _in_start.active = False


def _before_os_fork():
    """os.register_at_fork(before=...): a dirty os.fork() under the guard, said once."""
    if _policy is None or "os.fork" in _said or getattr(_in_start, "active", False):
        return
    dirty = _dirty()
    if dirty is None:
        return
    _said.add("os.fork")
    frame = sys._getframe(1)
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame else "an unknown line"
    failure = _failure(dirty, "the child's")
    warnings.warn_explicit(
        "\n".join([f"forkguard.guard(): os.fork() at {where} in a process (PID {dirty.pid}) that "
                   f"is {dirty.verdict}: {failure}; "
                   "os.fork() is not rerouted."]
                  + _evidence_lines(dirty)),
        DirtyForkWarning, frame.f_code.co_filename if frame else "<unknown>",
        frame.f_lineno if frame else 0)


class _NotForkContext:
    """What SemLock.__init__ reads of its context: a start method other than fork, so the
    semaphore keeps its name (and is registered with the resource tracker) and can be reopened
    by a rerouted child, as multiprocessing's forkserver children reopen theirs."""

    @staticmethod
    def get_start_method():
        return "forkserver"


def _guarded_semlock_init(self, kind, value, maxvalue, *, ctx):
    if _policy == "reroute":
        from multiprocessing import context as mp_context

        method = (ctx or mp_context._default_context.get_context()).get_start_method()
        if method == "fork" and (_seen_dirty or _dirty() is not None):
            ctx = _NotForkContext()
    _original_semlock_init(self, kind, value, maxvalue, ctx=ctx)


def guard(on_dirty_fork: str = "reroute") -> None:
    """Guards multiprocessing's "fork" start method in this process (see the module text).
    Idempotent; a second call changes the policy. Undone by unguard()."""
    global _policy, _original_popen, _original_semlock_init, _at_fork_registered
    if on_dirty_fork not in POLICIES:
        raise ValueError(f"forkguard.guard(on_dirty_fork={on_dirty_fork!r}): expected one of "
                         f"{', '.join(POLICIES)}")
    from multiprocessing import context as mp_context
    from multiprocessing import synchronize

    with _lock:
        if _original_popen is None:
            _original_popen = mp_context.ForkProcess.__dict__["_Popen"].__func__
            mp_context.ForkProcess._Popen = staticmethod(_guarded_popen)
            _original_semlock_init = synchronize.SemLock.__init__
            synchronize.SemLock.__init__ = _guarded_semlock_init
        if not _at_fork_registered:
            os.register_at_fork(before=_before_os_fork)
            _at_fork_registered = True
        _policy = on_dirty_fork


def unguard() -> None:
    """Restores multiprocessing's own fork start. Children already started are not affected."""
    global _policy, _original_popen, _original_semlock_init
    from multiprocessing import context as mp_context
    from multiprocessing import synchronize

    with _lock:
        _policy = None
        if _original_popen is not None:
            mp_context.ForkProcess._Popen = staticmethod(_original_popen)
            synchronize.SemLock.__init__ = _original_semlock_init
            _original_popen = _original_semlock_init = None


def guarded() -> Optional[str]:
    """The policy in force, or None when not guarded."""
    return _policy


def guard_from_environment() -> None:
    """FORKGUARD_GUARD=reroute|refuse|warn (read at `import forkguard`); 0/empty: nothing."""
    value = os.environ.get("FORKGUARD_GUARD", "").strip()
    if value in ("", "0"):
        return
    if value == "1":
        value = "reroute"
    if value not in POLICIES:
        print(f"forkguard: FORKGUARD_GUARD={value!r} ignored: expected one of "
              f"{', '.join(POLICIES)}", file=sys.stderr)
        return
    guard(value)
