# The fork server's side of forkguard.guard()'s "guard_start" request (see _guard_reroute.py for
# the parent's side). Loaded by _server.py by path, never imported by the caller; the server
# starts the child through the native layer (its _start_child), and stays CUDA-clean.
#
#   caller -> server  guard_start NAME
#                     + fds [payload, sentinel_w, parent_alive_r, stdout, stderr, tracker_w,
#                            *inherited]
#   server -> caller  started PID + its pidfd | error MESSAGE  (then exit PID STATUS, as for a rank)
#
# payload (a memfd, read from its offset; see _guard_reroute.py): a plain pickle of the parts,
# each a pickle and the indexes of its out-of-band buffers ("buffers": offset, size, read-only in
# the memfd before the offset, mapped copy-on-write): multiprocessing's preparation data, the
# caller's environment, the caller's values of __main__ globals ("main": [(name, part)], in the
# order they are installed), the Process object; and, plain, the __main__ globals that could not
# be pickled ("not_carried": [(name, why)]). The child prepares itself as multiprocessing's spawn
# and forkserver children do (spawn.prepare: sys.path, argv, cwd, authkey, start method) but for
# __main__: not the caller's script run again, as spawn would, but a fresh module holding the
# caller's values (a fork child's semantics: _fresh_main), where a global that did not travel
# names itself at its first use (_NotCarried). It finds ``inherited`` where a forkserver child
# finds its fds, uses the caller's resource tracker (tracker_w) as a spawn child does, and runs
# Process._bootstrap with parent_alive_r as its parent sentinel, exit handlers as a forked child
# of this Python runs them (_python_compat). It keeps sentinel_w open until it exits, so the
# caller's Process.sentinel turns readable then, as for a fork.
# It stays in the caller's process group (Ctrl-C reaches it as it reaches a forked child) and
# dies with the fork server (PR_SET_PDEATHSIG), which exits when the caller does.
import mmap
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
from multiprocessing import process, resource_tracker, spawn


def start(fds, close_in_child, start_child):
    """Starts the child with the server's start_child (the native layer's, in the caller's process
    group); its handle, or why it could not start. ``close_in_child``: the server's own fds."""
    payload_fd, sentinel_w, parent_alive_r, out_fd, err_fd, *rest = fds
    kept = [payload_fd, sentinel_w, parent_alive_r, *rest]
    try:
        return start_child(lambda: _child_main(kept), out_fd, err_fd, close_in_child,
                           new_group=False, name="a rerouted Process")
    finally:
        for f in kept:
            os.close(f)


def _child_main(fds):
    """Runs in the forked child; never returns."""
    code = 1
    try:
        # start_child made it die with the server (PR_SET_PDEATHSIG) and put its stdout and
        # stderr on the caller's.
        payload_fd, sentinel_w, parent_alive_r, tracker_w, *inherited = fds
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.set_inheritable(sentinel_w, False)
        resource_tracker._resource_tracker._fd = tracker_w
        with os.fdopen(payload_fd, "rb") as f:
            payload = pickle.load(f)
            buffers = _mapped(f.fileno(), payload["buffers"])

            def load(part):
                data, indexes = part
                return pickle.loads(data, buffers=[buffers[i] for i in indexes])

        prep = load(payload["prep"])
        environ = load(payload["environ"])
        os.environ.clear()
        os.environ.update(environ)
        multiprocessing.forkserver._forkserver._inherited_fds = inherited
        process.current_process()._inheriting = True
        try:
            main_name = prep.pop("init_main_from_name", None)
            main_path = prep.pop("init_main_from_path", None)
            spawn.prepare(prep)
            main = _fresh_main(main_name, main_path)
            for name, part in payload.get("main", ()):
                try:
                    main[name] = load(part)
                except Exception as e:  # noqa: BLE001 - named where the child uses it
                    main[name] = _NotCarried(name, f"its value could not be rebuilt here: "
                                                   f"{type(e).__name__}: {e}")
            for name, why in payload.get("not_carried", ()):
                main[name] = _NotCarried(name, why)
            self = load(payload["process"])
        finally:
            del process.current_process()._inheriting
        del payload, buffers
        code = _bootstrap(self, parent_alive_r)
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


def _fresh_main(name, path):
    """The child's __main__: a fresh module standing for the caller's, never executed. A fork
    child has its parent's __main__; this one gets the caller's values of the globals it refers
    to (installed by _child_main). Running the script again, as spawn does, would run its top
    level in every child: a fork-style script without ``if __name__ == "__main__":`` would start
    children from its children, and whatever it does before its fork (load data, train) would
    happen again; a script read from stdin, ``python -c`` and a notebook have no file to run.
    The module keeps the caller's file name (tracebacks, a spawn grandchild's preparation)."""
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    if name is not None:
        import importlib.util

        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            main.__dict__.update(__spec__=spec, __file__=spec.origin, __cached__=spec.cached,
                                 __loader__=spec.loader, __package__=spec.parent)
    elif path is not None:
        main.__dict__.update(__spec__=None, __file__=path, __cached__=None, __loader__=None,
                             __package__=None)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main
    return main.__dict__


def _not_carried_error(message):
    try:
        from forkguard._guard import NotCarriedError
    except Exception:  # noqa: BLE001 - the package cannot be imported here: a plain one
        return RuntimeError(message)
    return NotCarriedError(message)


class _NotCarried:
    """Stands for a __main__ global of the caller that did not reach this child: any use of it
    raises forkguard.NotCarriedError naming it and why (where a fork would have shared it)."""

    __slots__ = ("_fg_message",)

    def __init__(self, name, why):
        object.__setattr__(self, "_fg_message", (
            f"__main__.{name} did not reach this child (PID {os.getpid()}), which "
            f"forkguard.guard() started from its clean fork server instead of a fork: {why}. "
            "A forked child would have shared it; make it picklable, or create it in the child "
            "(in the Process's target, or a Pool's initializer)"))

    def _fail(self, *args, **kwargs):
        raise _not_carried_error(object.__getattribute__(self, "_fg_message"))

    def __getattr__(self, attr):
        self._fail()

    def __repr__(self):
        return f"<not carried: {object.__getattribute__(self, '_fg_message')}>"

    __setattr__ = __delattr__ = __call__ = __iter__ = __len__ = __getitem__ = _fail
    __setitem__ = __delitem__ = __contains__ = __enter__ = __bool__ = __index__ = _fail
    __int__ = __float__ = __add__ = __sub__ = __mul__ = __truediv__ = __eq__ = _fail
    __hash__ = None


def _bootstrap(process_obj, parent_sentinel):
    """Process._bootstrap as a forked child runs it, whatever the Python (see
    forkguard._python_compat)."""
    from forkguard import _python_compat

    return _python_compat.bootstrap_child(process_obj, parent_sentinel)


def _mapped(fd, table):
    """The payload's out-of-band buffers, mapped copy-on-write (a child's writes are its own, as
    in a fork); views of one mapping, which lives as long as they do."""
    if not table:
        return []
    size = max(offset + length for offset, length, _ in table)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = memoryview(mapping)
    return [whole[offset:offset + length].toreadonly() if readonly else
            whole[offset:offset + length] for offset, length, readonly in table]
