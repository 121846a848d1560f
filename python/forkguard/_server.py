# forkguard's Python fork server: run as a script by a freshly executed interpreter (never
# imported by the caller), so it is CUDA-clean whatever the caller did. It preloads the modules it
# is told (torch by default), then forks one process per rank on request.
#
#   python3 _server.py FD PRELOAD_JSON SYS_PATH_JSON
#
# Protocol on FD (an AF_UNIX SOCK_SEQPACKET socket the caller holds the other end of); each
# message is a pickled dict, file descriptors travel with SCM_RIGHTS:
#   server -> caller  {"op": "ready", "pid", "preloaded", "errors"}
#   caller -> server  {"op": "start", "rank", "env", "cwd", "path"} + fds [payload, out, err, result]
#   server -> caller  {"op": "started", "rank", "pid"} | {"op": "error", "rank", "message"}
#   caller -> server  {"op": "kill", "pids", "signal"}      (a rank's whole process group)
#   caller -> server  {"op": "preload", "modules"}          -> {"op": "preloaded", ...}
#   caller -> server  {"op": "guard_start", ...} + fds     (forkguard.guard(): _guard_child.py)
#   server -> caller  {"op": "exit", "pid", "status"}       (the raw wait status, once per rank)
# EOF on FD (the caller exited or closed it): every rank's group is killed, the server exits.
#
# A rank: its own session (so the group can be killed with whatever it started), the caller's
# environment, working directory and sys.path, stdout/stderr on the caller's pipes, the function
# loaded with cloudpickle from the payload memfd; the outcome is pickled to the result pipe:
# ("ok", value) or ("error", type name, message, traceback text, pickled exception or None).
import os
import pickle
import select
import signal
import socket
import sys

_MAX_FDS = 253  # SCM_MAX_FD: a guard_start request carries its child's DupFds


def _send(sock, msg):
    sock.sendmsg([pickle.dumps(msg)])


def _preload(modules):
    done, errors = [], {}
    for name in modules:
        try:
            __import__(name)
            done.append(name)
        except BaseException as e:  # noqa: BLE001 - reported to the caller, never swallowed
            errors[name] = f"{type(e).__name__}: {e}"
    return done, errors


_guard_module = None


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


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _rank_main(msg, fds):
    """Runs in the forked rank; never returns."""
    payload_fd, out_fd, err_fd, result_fd = fds
    code = 1
    try:
        os.setsid()
        try:
            import ctypes

            ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the server
        except Exception:  # noqa: BLE001 - best effort; the server also kills on its own exit
            pass
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        os.environ.clear()
        os.environ.update(msg["env"])
        os.chdir(msg["cwd"])
        sys.path[:] = msg["path"]
        size = os.fstat(payload_fd).st_size
        payload = os.pread(payload_fd, size, 0)
        os.close(payload_fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import cloudpickle

        try:
            fn, args, kwargs = cloudpickle.loads(payload)
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
            data = cloudpickle.dumps(outcome)
        except Exception as e:  # noqa: BLE001 - an unpicklable return value is an error
            data = pickle.dumps(("error", type(e).__name__,
                                 f"the return value could not be pickled: {e}", "", None))
            code = code or 1
        _write_all(result_fd, data)
        os.close(result_fd)
    except BaseException as e:  # noqa: BLE001 - the rank's setup failed: say so on its stderr
        try:
            os.write(2, f"forkguard rank setup failed: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def main():
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.set_inheritable(sock.fileno(), False)
    import json

    preload = json.loads(sys.argv[2])
    caller_path = json.loads(sys.argv[3])
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # our own directory would shadow module names
    for p in caller_path:
        if p not in sys.path:
            sys.path.append(p)
    # Ctrl-C in a terminal reaches the whole foreground group: the caller decides, not us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import cloudpickle  # noqa: F401 - every rank needs it: load it once here

    done, errors = _preload(preload)
    _send(sock, {"op": "ready", "pid": os.getpid(), "preloaded": done, "errors": errors})
    ranks = set()
    guard_pids = set()  # forkguard.guard()'s children: in the caller's group, not their own
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    try:
        while True:
            for fd, _ in poller.poll():
                if fd == wake_r:
                    try:
                        while os.read(wake_r, 256):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                data, fds, _, _ = socket.recv_fds(sock, 1 << 20, _MAX_FDS)
                if not data:
                    return
                msg = pickle.loads(data)
                op = msg["op"]
                if op == "start":
                    try:
                        pid = os.fork()
                    except OSError as e:
                        for f in fds:
                            os.close(f)
                        _send(sock, {"op": "error", "rank": msg["rank"], "message": str(e)})
                        continue
                    if pid == 0:
                        sock.close()
                        os.close(wake_r)
                        os.close(wake_w)
                        _rank_main(msg, fds)
                    for f in fds:
                        os.close(f)
                    ranks.add(pid)
                    _send(sock, {"op": "started", "rank": msg["rank"], "pid": pid})
                elif op == "kill":
                    for pid in msg["pids"]:
                        if pid in ranks:
                            try:
                                os.killpg(pid, msg["signal"])
                            except ProcessLookupError:
                                pass
                elif op == "guard_start":  # forkguard.guard(): see _guard_child.py
                    reply = _guard_child().start(fds, (sock.fileno(), wake_r, wake_w))
                    if "pid" in reply:
                        ranks.add(reply["pid"])
                        guard_pids.add(reply["pid"])
                    _send(sock, reply)
                elif op == "preload":
                    done, errors = _preload(msg["modules"])
                    _send(sock, {"op": "preloaded", "preloaded": done, "errors": errors})
            # Reap after every wake-up: SIGCHLD only says "at least one".
            while ranks:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                ranks.discard(pid)
                guard_pids.discard(pid)
                try:
                    _send(sock, {"op": "exit", "pid": pid, "status": status})
                except OSError:
                    return
    finally:
        for pid in ranks:
            try:
                (os.kill if pid in guard_pids else os.killpg)(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in list(ranks):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


if __name__ == "__main__":
    main()
