# forkguard's Python fork server: run as a script by a freshly executed interpreter (never
# imported by the caller), so it is CUDA-clean whatever the caller did. It preloads the modules it
# is told (torch by default), then forks one process per rank on request.
#
#   python3 _server.py FD PRELOAD_JSON SYS_PATH_JSON
#
# FD is an AF_UNIX SOCK_SEQPACKET socket whose other end the caller holds. Once the modules are
# preloaded, the native layer serves it (_native.serve_zygote, python/src/process.cpp): it
# receives and decodes every request (src/detail/seqpacket.hpp; `entry` and `call` typed, as
# src/launch/zygote_protocol.hpp defines them), calls the handler of that name here (_HANDLERS),
# holds and reaps the child a handler started, and encodes every reply. What each request is:
#   caller -> server  entry notebook RANK LOCAL WORLD LOCAL_WORLD NODE RESTART 2 CWD SYS_PATH_JSON
#                     ENV... + fds [stdout, stderr, memfd]   (the supervisor: a notebook rank)
#   server -> caller  ready PID PRELOADED_JSON ERRORS_JSON   (first, once)
#   caller -> server  preload MODULES_JSON  ->  preloaded PRELOADED_JSON ERRORS_JSON
#   caller -> server  hold_fds + fds  ->  held COUNT     (the fds a launch's arguments carry:
#                     multiprocessing's Connections, Queues' pipes; every rank forked until
#                     release_fds inherits them and finds them where a forkserver child does)
#   caller -> server  release_fds  ->  released
# and from forkguard.DataLoader (_dataloader.py; the loader core sends the call):
#   caller -> server  dataloader_hold KEY + fds  ->  held COUNT   (the fds the workers' spec
#                     refers to: every worker forked until dataloader_release KEY has them, and
#                     finds them where a forkserver child does; the spec names KEY)
#   caller -> server  dataloader_release KEY  ->  released
#   caller -> server  call forkguard.dataloader_zygote + fds [stdout, stderr, socket, memfd]
#                     (a loader's own fork server: it loads the workers' spec from the memfd
#                     once, then serves the socket: `call forkguard.dataloader_worker` + fds
#                     [stdout, stderr, the worker's socket] forks a worker of that spec)
# and from forkguard.guard() (_guard_child.py, _guard_reroute.py):
#   caller -> server  guard_start NAME + fds
# A request that starts a child is answered `started PID` with the child's pidfd attached (opened
# before the child could be reaped), or `error MESSAGE`; `exit PID STATUS` (the raw wait status)
# follows once it exited. EOF on FD (the caller exited or closed it): every child is killed (a
# rank with its group), the server exits.
#
# Every child is started by the native layer (_native.start_python_child: launch/child.cpp's
# start_child, forkguard's one fork site): it dies with the server (PR_SET_PDEATHSIG), its stop
# signals are at their defaults. A DataLoader worker and a rerouted Process stay in the caller's
# process group (as forked ones would).
#
# A rank: its own process group (killed as a group when the server exits), the environment
# the supervisor built (the same as a command rank's), the caller's working directory and
# sys.path, stdout/stderr on the supervisor's pipes, the function loaded with cloudpickle from the
# memfd; its outcome replaces the payload in the memfd: RESULT_MAGIC, the u64 length, then the
# pickled ("ok", value) or ("error", type name, message, traceback text, pickled exception or
# None) or ("exit", code). The header is written last; a length the bytes do not reach is an
# outcome cut short.
import json
import os
import pickle
import signal
import struct
import sys

RESULT_MAGIC = b"FGRESULT"
_HEADER = struct.Struct("=8sQ")


def _preload(modules):
    done, errors = [], {}
    for name in modules:
        # forkguard's package starts a C++ fork server at import: not in this one (the ranks and
        # workers it forks import it again for themselves, with the environment they are given).
        saved = os.environ.get("FORKGUARD_NO_FORK_SERVER")
        os.environ["FORKGUARD_NO_FORK_SERVER"] = "1"
        try:
            __import__(name)
            done.append(name)
            _preloaded.add(name)
        except BaseException as e:  # noqa: BLE001 - reported to the caller, never swallowed
            errors[name] = f"{type(e).__name__}: {e}"
        finally:
            if saved is None:
                del os.environ["FORKGUARD_NO_FORK_SERVER"]
            else:
                os.environ["FORKGUARD_NO_FORK_SERVER"] = saved
    return done, errors


_guard_module = None
_preloaded = set()  # what _preload imported
_held_fds = []  # hold_fds: inherited by the ranks of the launch in progress, closed elsewhere
_dataloader_fds = {}  # dataloader_hold: KEY -> fds, inherited by that loader's workers only


def _dataloader_held():
    return [f for fds in _dataloader_fds.values() for f in fds]


def _guard_child():
    """forkguard.guard()'s child code (_guard_child.py), loaded by path on first use."""
    global _guard_module
    if _guard_module is None:
        import importlib.util

        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard_child.py")
        spec = importlib.util.spec_from_file_location("_forkguard_guard_child", path)
        _guard_module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_guard_module)
    return _guard_module


def _write_outcome(fd, outcome):
    """Pickles the outcome straight into the memfd, past the header (a large return value is not
    first copied into a bytes object), then writes the header: a rank that dies before the end
    leaves none, and the caller sees no outcome."""
    import cloudpickle

    os.ftruncate(fd, 0)
    with os.fdopen(os.dup(fd), "wb") as f:  # buffered: every write is whole
        f.seek(_HEADER.size)
        cloudpickle.dump(outcome, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        length = f.tell() - _HEADER.size
    os.pwrite(fd, _HEADER.pack(RESULT_MAGIC, length), 0)


def _child_setup():
    """A child's first steps in Python. The native layer's set-up (start_child) already made it
    die with the server (PR_SET_PDEATHSIG), put the stop signals back to their defaults with none
    blocked and its stdout and stderr on the caller's; here Python learns of it (the server
    ignores SIGINT)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


_native = None  # forkguard._native, once main() imported it


def _start_child(fn, out_fd, err_fd, close, **options):
    """fn() in a child of this server, started by the native layer (start_child: forkguard's one
    fork site, its set-up, a handle on the child's pidfd) with stdout and stderr on out_fd and
    err_fd, which are closed here either way. The child closes `close` (what it must not hold);
    it keeps every other fd, as a fork does. Its ChildProcess, or why it could not start."""

    def child():
        os.close(out_fd)  # its stdout and stderr now (start_child's plan): not twice
        os.close(err_fd)
        return fn()

    try:
        return _native.start_python_child(child, stdout_fd=out_fd, stderr_fd=err_fd,
                                          close_fds=list(close), **options)
    except Exception as e:  # noqa: BLE001 - the caller's reply says why
        return f"{type(e).__name__}: {e}"
    finally:
        os.close(out_fd)
        os.close(err_fd)


def _rank_main(args, env, memfd):
    """Runs in the forked rank; never returns. `args`: [cwd, sys.path as JSON]; `env`: the
    rank's whole environment ("K=V")."""
    code = 1
    try:
        _child_setup()
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        cwd, path = args[0], json.loads(args[1])
        env = dict(kv.split("=", 1) for kv in env if "=" in kv)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path
        fg = sys.modules.get("forkguard") if "forkguard" in _preloaded else None
        if fg is not None and not os.environ.get("FORKGUARD_NO_FORK_SERVER"):
            # forkguard was preloaded (without its C++ fork server: see _preload), so the rank's
            # `import forkguard` does nothing. What that import does, now, while the rank is
            # clean: its process workers stay CUDA-clean after the function initializes CUDA.
            fg._native.start_fork_server()
        payload = os.pread(memfd, os.fstat(memfd).st_size, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if _held_fds:
            # multiprocessing's objects in the arguments (pickled as for a forkserver child:
            # _launch._payload) find their fds here.
            import multiprocessing.forkserver

            multiprocessing.forkserver._forkserver._inherited_fds = list(_held_fds)
        import cloudpickle

        try:
            fn, args, kwargs = cloudpickle.loads(payload)
            del payload
            value = fn(*args, **kwargs)
            outcome = ("ok", value)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            outcome = ("exit", code)
        except BaseException as e:  # noqa: BLE001 - sent to the caller with its traceback
            import traceback

            try:
                exc = cloudpickle.dumps(e)
            except Exception:  # noqa: BLE001 - an unpicklable exception still has its text
                exc = None
            outcome = ("error", type(e).__name__, str(e), traceback.format_exc(), exc)
        try:
            _write_outcome(memfd, outcome)
        except Exception as e:  # noqa: BLE001 - an unpicklable return value is an error
            _write_outcome(memfd, ("error", type(e).__name__,
                                   f"the return value could not be pickled: {e}", "", None))
            code = code or 1
        os.close(memfd)
    except BaseException as e:  # noqa: BLE001 - the rank's setup failed: say so on its stderr
        try:
            os.write(2, f"forkguard rank setup failed: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    finally:
        _multiprocessing_exit()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            if "forkguard" in sys.modules:  # what exit would do: its fork server stopped, reaped
                sys.modules["forkguard"]._native.stop_fork_server()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def _multiprocessing_exit():
    """What a multiprocessing child runs at its end, for a rank or a DataLoader worker (as torch's
    workers do): what it put on a Queue reaches the pipe (the feeder threads are joined), and its
    own children are joined. Best effort: the child exits next whatever happens here."""
    try:
        util = sys.modules.get("multiprocessing.util")
        if util is not None:
            util._exit_function()
    except Exception:  # noqa: BLE001 - the exit that follows is the child's report
        pass


def _child_main(body):
    """Runs body() in a child of a fork server (after _child_setup) and never returns: the exit
    code is body's, 1 where it raised (its traceback on the child's stderr, the caller's)."""
    code = 1
    try:
        _child_setup()
        code = body()
    except BaseException:  # noqa: BLE001 - a child never returns into its server's loop
        import traceback

        traceback.print_exc()
    finally:
        _multiprocessing_exit()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _dataloader_zygote_main(sock, memfd):
    """Runs in a DataLoader's own fork server (a child of this one): loads the loader's workers'
    spec once (_dataloader_worker.load_spec: the fds held for the loader are found where a
    forkserver child finds them), puts what it made out of the collector's reach (the workers
    share those pages as forks of one process do), says `ready` with the modules the spec's
    pickle imported beyond this server's (the caller asks this server to preload them for the
    loaders after it), then forks each worker asked of it on `sock`. The loader names its failure;
    the traceback is on the loader's stderr."""
    import gc

    os.environ["FORKGUARD_NO_FORK_SERVER"] = "1"  # the package's import starts none here
    from forkguard import _dataloader_worker

    del os.environ["FORKGUARD_NO_FORK_SERVER"]
    known = set(sys.modules)
    make = _dataloader_worker.load_spec(memfd, dict(_dataloader_fds))
    os.close(memfd)
    imported = _dataloader_worker.library_modules(set(sys.modules) - known)
    gc.freeze()

    def start_worker(fds, own, *, function):
        if len(fds) != 3:
            for f in fds:
                os.close(f)
            return f"{function}: it takes stdout, stderr and the worker's socket"
        out_fd, err_fd, job_fd = fds

        def worker():  # a DataLoader worker, a fork of this process
            return _native._serve_jobs_after_setup(job_fd, lambda setup, w: make(w))

        try:
            return _start_child(lambda: _child_main(worker), out_fd, err_fd, own,
                                new_group=False, name="a DataLoader worker")
        finally:
            os.close(job_fd)

    _native.serve_zygote(sock, {"pid": os.getpid(), "preloaded": json.dumps(imported),
                                "errors": "{}"}, {"forkguard.dataloader_worker": start_worker})
    return 0


def _release_held():
    while _held_fds:
        os.close(_held_fds.pop())


def _notebook_rank(fds, own, *, name, args, env, **context):
    """An `entry notebook` request (args: [cwd, sys.path as JSON]): a rank in its own process
    group. Not under a reaper as a rank of the C++ fork server is (what it started would end
    with it): the reaper is another fork of this interpreter, 22 ms a rank with torch 2.14
    preloaded."""
    if name != "notebook" or len(fds) != 3 or len(args) != 2:
        for f in fds:
            os.close(f)
        return (f"the Python fork server cannot start entry {name!r} (it starts notebook_launch "
                f"ranks only)")
    out_fd, err_fd, memfd = fds
    try:
        return _start_child(lambda: _rank_main(args, env, memfd), out_fd, err_fd,
                            (*own, *_dataloader_held()), name="a notebook rank")
    finally:
        os.close(memfd)


def _dataloader_zygote(fds, own, *, function):
    """A DataLoader's own fork server (_dataloader_zygote_main), in the caller's process group
    (as its workers are). It inherits every loader's held fds (dataloader_hold): the spec names
    its own, and it closes the others'."""
    if len(fds) != 4:
        for f in fds:
            os.close(f)
        return f"{function}: it takes stdout, stderr, the loader's socket and the spec's memfd"
    out_fd, err_fd, sock, memfd = fds
    try:
        return _start_child(lambda: _child_main(lambda: _dataloader_zygote_main(sock, memfd)),
                            out_fd, err_fd, (*own, *_held_fds), new_group=False,
                            name="a DataLoader's fork server")
    finally:
        os.close(sock)
        os.close(memfd)


def _guard_start(fds, own, *, name):  # forkguard.guard(): see _guard_child.py
    return _guard_child().start(fds, (*own, *_held_fds, *_dataloader_held()), _start_child)


def _hold_fds(fds, own):
    _release_held()
    _held_fds.extend(fds)
    return "held", {"count": len(fds)}


def _release_fds(fds, own):
    _release_held()
    return "released", {}


def _dataloader_hold(fds, own, *, key):
    for f in _dataloader_fds.pop(key, ()):
        os.close(f)
    _dataloader_fds[key] = list(fds)
    return "held", {"count": len(fds)}


def _dataloader_release(fds, own, *, key):
    for f in _dataloader_fds.pop(key, ()):
        os.close(f)
    return "released", {}


def _preload_request(fds, own, *, modules):
    done, errors = _preload(json.loads(modules))
    return "preloaded", {"preloaded": json.dumps(done), "errors": json.dumps(errors)}


# The requests this server serves, by their kind (a `call`: by its function). The native loop
# decodes each (typed: zygote_protocol.hpp) and calls handler(fds, own, **its fields): `fds` came
# with it (the handler closes them), `own` are the loop's fds, which no child may keep. A handler
# returns the ChildProcess it started (the loop holds and reaps it, and replies), a str (the
# error reply), or a reply as (kind, {fields}).
_HANDLERS = {
    "entry": _notebook_rank,
    "forkguard.dataloader_zygote": _dataloader_zygote,
    "guard_start": _guard_start,
    "hold_fds": _hold_fds,
    "release_fds": _release_fds,
    "dataloader_hold": _dataloader_hold,
    "dataloader_release": _dataloader_release,
    "preload": _preload_request,
}


def main():
    sock = int(sys.argv[1])
    os.set_inheritable(sock, False)
    preload = json.loads(sys.argv[2])
    caller_path = json.loads(sys.argv[3])
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # our own directory would shadow module names
    for p in caller_path:
        if p not in sys.path:
            sys.path.append(p)
    # Ctrl-C in a terminal reaches the whole foreground group: the caller decides, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import cloudpickle  # noqa: F401 - every rank needs it: load it once here

    done, errors = _preload(preload)
    global _native
    from forkguard import _native as native  # the package skips its start-up here

    _native = native
    _native.serve_zygote(sock, {"pid": os.getpid(), "preloaded": json.dumps(done),
                                "errors": json.dumps(errors)}, _HANDLERS)


if __name__ == "__main__":
    main()
