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
# order they are installed), the Process object. The child prepares itself as multiprocessing's
# spawn and forkserver children do (spawn.prepare: sys.path, argv, cwd, authkey, start method,
# the caller's __main__ as __mp_main__; a fresh __main__ when the caller's has no file), installs
# the __main__ globals over it, finds ``inherited`` where a forkserver child finds its fds, uses
# the caller's resource tracker (tracker_w) as a spawn child does, and runs Process._bootstrap
# with parent_alive_r as its parent sentinel. It keeps sentinel_w open until it exits, so the
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
        # The caller's __main__ importing forkguard starts no C++ fork server here: this
        # child is a multiprocessing child, as a fork of the caller would be.
        os.environ.setdefault("FORKGUARD_NO_FORK_SERVER", "1")
        try:
            main_name = prep.pop("init_main_from_name", None)
            main_path = prep.pop("init_main_from_path", None)
            spawn.prepare(prep)
            _import_main(main_name, main_path)
            if "FORKGUARD_NO_FORK_SERVER" not in environ:
                del os.environ["FORKGUARD_NO_FORK_SERVER"]
            main = vars(sys.modules["__main__"])
            for name, part in payload.get("main", ()):
                try:
                    main[name] = load(part)
                except Exception:  # noqa: BLE001 - as in spawn: the child's own import's value
                    pass
            self = load(payload["process"])
        finally:
            del process.current_process()._inheriting
        del payload, buffers
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


def _import_main(name, path):
    """The caller's __main__ imported as __mp_main__, as spawn.prepare does (by module name or
    by path; not a package's __main__, nor ipython's script, whose code is main-only), but run in
    the module's own namespace: spawn runs it in a temporary one and copies that into the
    module, so its functions' globals are not the module's, and a value given to the module (the
    caller's, by _child_main) would not be what they read. Without a file (a notebook, python -c)
    a fresh __mp_main__ holds what the caller sends of its __main__."""
    import types

    main = types.ModuleType("__mp_main__")
    main.__dict__["__builtins__"] = __builtins__
    code = None
    if name is not None and name != "__main__" and not name.endswith(".__main__"):
        import importlib.util

        spec = importlib.util.find_spec(name)
        code = spec.loader.get_code(name)
        main.__dict__.update(__spec__=spec, __file__=spec.origin, __cached__=spec.cached,
                             __loader__=spec.loader, __package__=spec.parent)
    elif path is not None and os.path.splitext(os.path.basename(path))[0] != "ipython":
        import io

        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec")
        main.__dict__.update(__spec__=None, __file__=path, __cached__=None, __loader__=None,
                             __package__="")
    sys.modules["__mp_main__"] = main  # as runpy has it while the code runs
    if code is not None:
        exec(code, main.__dict__)
    sys.modules["__main__"] = main


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
