# The fork server's side of forkguard.guard()'s "guard_start" request (see _guard_reroute.py for
# the parent's side). Loaded by _server.py by path, never imported by the caller, and it imports
# nothing of forkguard: the fork server stays a plain, CUDA-clean interpreter.
#
#   caller -> server  guard_start NAME
#                     + fds [payload, sentinel_w, parent_alive_r, stdout, stderr, *inherited]
#   server -> caller  guard_started PID | error MESSAGE    (then exit PID STATUS, as for a rank)
#
# payload (a memfd): four pickles, read in order: multiprocessing's preparation data, __main__'s
# functions and classes by value ({} when __main__ has a file: it is imported by path), the
# caller's environment, the Process object. The child prepares itself as multiprocessing's spawn
# and forkserver children do (spawn.prepare: sys.path, argv, cwd, authkey, start method, the
# caller's __main__ as __mp_main__), finds ``inherited`` where a forkserver child finds its fds,
# and runs Process._bootstrap with parent_alive_r as its parent sentinel. It keeps sentinel_w
# open until it exits, so the caller's Process.sentinel turns readable then, as for a fork.
# It stays in the caller's process group (Ctrl-C reaches it as it reaches a forked child) and
# dies with the fork server (PR_SET_PDEATHSIG), which exits when the caller does.
import ctypes
import os
import pickle
import signal
import sys

# Imported once here, in the fork server, instead of by every child: what a child needs to
# unpickle multiprocessing's objects and to run as a multiprocessing child.
import multiprocessing.connection  # noqa: F401
import multiprocessing.forkserver
import multiprocessing.heap  # noqa: F401
import multiprocessing.popen_forkserver  # noqa: F401
import multiprocessing.queues  # noqa: F401
import multiprocessing.resource_sharer  # noqa: F401
import multiprocessing.sharedctypes  # noqa: F401
import multiprocessing.synchronize  # noqa: F401
from multiprocessing import process, spawn


def start(fds, close_in_child):
    """Forks the child; the reply for the caller. ``close_in_child``: the server's own fds."""
    try:
        pid = os.fork()
    except OSError as e:
        for f in fds:
            os.close(f)
        return ["error", f"fork: {e}"]
    if pid == 0:
        for f in close_in_child:
            os.close(f)
        _child_main(fds)
    for f in fds:
        os.close(f)
    return ["guard_started", pid]


def _child_main(fds):
    """Runs in the forked child; never returns."""
    code = 1
    try:
        payload_fd, sentinel_w, parent_alive_r, out_fd, err_fd, *inherited = fds
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
        except Exception:  # noqa: BLE001 - best effort: the server also kills it when it exits
            pass
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        os.set_inheritable(sentinel_w, False)
        with os.fdopen(payload_fd, "rb") as f:
            prep = pickle.load(f)
            by_value = pickle.load(f)
            environ = pickle.load(f)
            os.environ.clear()
            os.environ.update(environ)
            multiprocessing.forkserver._forkserver._inherited_fds = inherited
            process.current_process()._inheriting = True
            # The caller's __main__ importing forkguard starts no C++ fork server here: this
            # child is a multiprocessing child, as a fork of the caller would be.
            os.environ.setdefault("FORKGUARD_NO_FORK_SERVER", "1")
            try:
                spawn.prepare(prep)
                if "FORKGUARD_NO_FORK_SERVER" not in environ:
                    del os.environ["FORKGUARD_NO_FORK_SERVER"]
                if "init_main_from_path" not in prep and "init_main_from_name" not in prep:
                    _main_from_values(by_value)
                self = pickle.load(f)
            finally:
                del process.current_process()._inheriting
        code = self._bootstrap(parent_sentinel=parent_alive_r)
    except BaseException:  # noqa: BLE001 - the child's setup failed: say so on its stderr
        try:
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)


def _main_from_values(by_value):
    """A __main__ without a file (notebook, python -c): a fresh __mp_main__ holding its functions
    and classes, so what later arrives by reference to __main__ resolves."""
    import types

    main = types.ModuleType("__mp_main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    for name, data in by_value.items():
        try:
            main.__dict__[name] = pickle.loads(data)
        except Exception:  # noqa: BLE001 - as in spawn: what cannot be rebuilt is looked up in vain
            pass
