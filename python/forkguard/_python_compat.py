"""What differs between the Pythons forkguard supports in the multiprocessing internals it uses:
one place, as _torch_compat.py is for torch.

Exit handlers of a multiprocessing child. Up to 3.12, ``BaseProcess._bootstrap`` itself calls
``multiprocessing.util._exit_function()`` after the target: it runs the child's finalizers, and a
Queue's finalizer is what flushes the items its feeder thread still holds. 3.13 moved that call
out (gh-114220): ``popen_fork`` and the forkserver now clear ``atexit``, register
``_exit_function`` there and run the handlers after ``_bootstrap`` returns. A child that runs
``_bootstrap`` itself (a rerouted child of forkguard.guard()) must do the same on 3.13, or an item
it put on a Queue is lost (the parent gets queue.Empty) and its semaphores leak.
"""
from __future__ import annotations

import atexit
import sys

# True where _bootstrap runs util._exit_function() itself (3.9-3.12).
BOOTSTRAP_RUNS_EXIT_FUNCTION = sys.version_info < (3, 13)


def bootstrap_child(process_obj, parent_sentinel, *, runs_exit_function=None) -> int:
    """Runs ``process_obj._bootstrap(parent_sentinel)`` as a forked multiprocessing child does on
    this Python, exit handlers included; returns the exit code. ``runs_exit_function`` overrides
    the version check (a test runs 3.13's path on any Python)."""
    from multiprocessing import util

    if runs_exit_function is None:
        runs_exit_function = BOOTSTRAP_RUNS_EXIT_FUNCTION
    if runs_exit_function:
        return process_obj._bootstrap(parent_sentinel=parent_sentinel)
    code = 1
    atexit._clear()
    atexit.register(util._exit_function)
    try:
        code = process_obj._bootstrap(parent_sentinel=parent_sentinel)
    finally:
        atexit._run_exitfuncs()
    return code
