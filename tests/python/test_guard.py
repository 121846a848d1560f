"""forkguard.guard(): multiprocessing's fork start method after the process initialized CUDA (the
test driver, through ctypes, in a child interpreter so this one stays clean): refused with the
evidence, warned about, or rerouted to the clean interpreter fork server, whose children's cuInit
returns 0 and whose results come back through multiprocessing's own objects; on a clean parent a
plain fork. Each test checks that nothing is left behind: processes, fds, files in /dev/shm."""
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from conftest import (in_private_shm, marked_pids, need_torch_build, private_shm_allowed,
                      run_bounded)

import forkguard

PRELUDE = """\
import ctypes, os, sys
import multiprocessing as mp
import forkguard

def cuinit():
    return ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)

def children():
    # this process's children but the C++ fork server started at import
    with open(f"/proc/self/task/{os.getpid()}/children") as f:
        kids = [int(k) for k in f.read().split()]
    return [k for k in kids if k != forkguard._native.fork_server_pid()]
"""


def _shm():
    return set(os.listdir("/dev/shm"))


@pytest.fixture()
def script(fake_cuda_env, tmp_path):
    """Runs a script (PRELUDE + body) in a child interpreter; checks nothing is left behind.
    Where permitted the script runs with a /dev/shm of its own (conftest.in_private_shm), whose
    files once it exited are exactly the ones it left: other tests and programs make semaphores
    in the host's meanwhile."""
    shm_before = _shm()
    marker = f"FORKGUARD_GUARD_TEST={uuid.uuid4().hex}"
    runs = []
    left = []
    private = private_shm_allowed()[0]

    def run(body, args=(), expect_rc=0, prelude=PRELUDE, runner=()):
        path = tmp_path / f"script{len(runs)}.py"
        path.write_text(prelude + textwrap.dedent(body))
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
        env = dict(os.environ, FORKGUARD_GUARD_TEST=marker.split("=")[1],
                   PYTHONPATH=package_parent)
        cmd = [sys.executable, *runner, str(path), *args]
        listing = tmp_path / f"script{len(runs)}.shm"
        if private:
            cmd = in_private_shm(cmd, listing)
        out = run_bounded(cmd, 300, env=env, cwd=tmp_path)
        runs.append(out)
        if listing.exists():
            left.extend(f for f in listing.read_text().split() if f.startswith(("sem.", "torch_")))
        assert out.returncode == expect_rc, out.stdout + out.stderr
        return out

    yield run
    # The fork server exits once its caller has: wait on that event, bounded.
    deadline = time.monotonic() + 30
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_pids(marker) == []
    assert left == []
    if not private:
        assert {f for f in _shm() - shm_before if f.startswith(("sem.", "torch_"))} == set()


def test_refuse_raises_with_the_evidence_before_any_child_exists(script):
    out = script("""
        print("parent cuInit:", cuinit())
        forkguard.guard("refuse")
        p = mp.Process(target=cuinit)
        try:
            p.start()
        except forkguard.ForkUnsafeError as e:
            print("refused:", e)
        print("children:", mp.active_children(), children())
    """)
    assert "parent cuInit: 0" in out.stdout
    assert "refused: fork is not safe here" in out.stdout and "nvidia-uvm" in out.stdout
    assert "cures:" in out.stdout
    assert "children: [] []" in out.stdout


def test_warn_warns_once_with_the_evidence_then_forks(script, tmp_path):
    out = script("""
        def child(q):
            q.put(cuinit())
        cuinit()
        forkguard.guard("warn")
        q = mp.SimpleQueue()
        ps = [mp.Process(target=child, args=(q,)) for _ in range(2)]
        for p in ps:
            p.start()  # the line named
        print("children cuInit:", [q.get() for _ in ps])
        for p in ps:
            p.join()
            assert p.exitcode == 0
    """)
    assert "children cuInit: [3, 3]" in out.stdout  # a plain fork: the child's CUDA is broken
    assert out.stderr.count("DirtyForkWarning") == 1, out.stderr
    assert "with a plain fork" in out.stderr and "nvidia-uvm" in out.stderr
    lines = (tmp_path / "script0.py").read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "# the line named" in text)
    assert f"script0.py:{line}" in out.stderr


def test_os_fork_under_the_guard_warns_once_naming_the_line(script, tmp_path):
    out = script("""
        cuinit()
        forkguard.guard()
        for _ in range(2):
            pid = os.fork()  # the line named
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
    """)
    assert out.stderr.count("DirtyForkWarning") == 1, out.stderr
    lines = (tmp_path / "script0.py").read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "# the line named" in text)
    assert f"script0.py:{line}" in out.stderr and "os.fork() is not rerouted" in out.stderr


def test_reroute_process_with_queue_child_cuinit_succeeds_results_back(script):
    out = script("""
        def work(q, i, scale):
            q.put((i, cuinit() * scale, os.getppid(), mp.parent_process().pid, mp.current_process().name))

        if __name__ == "__main__":
            print("parent cuInit:", cuinit())
            forkguard.guard()
            q = mp.Queue()
            ps = [mp.Process(target=work, args=(q, i), kwargs={"scale": 10}, name=f"w{i}") for i in range(2)]
            for p in ps:
                p.start()
            got = sorted(q.get(timeout=60) for _ in ps)
            for p in ps:
                p.join()
            me = os.getpid()
            server = forkguard._launch._server.pid
            assert [g[1] for g in got] == [0, 0], got
            assert {g[2] for g in got} == {server} and {g[3] for g in got} == {me}, (got, me, server)
            assert [g[4] for g in got] == ["w0", "w1"]
            assert [p.exitcode for p in ps] == [0, 0] and not any(p.is_alive() for p in ps)
            q.close(); q.join_thread()
            print("ok")
    """)
    assert "ok" in out.stdout
    assert out.stderr.count("forkguard.guard(): this process") == 1, out.stderr
    assert "initialized" in out.stderr and "clean interpreter fork server" in out.stderr


def test_reroute_carries_multiprocessing_objects(script):
    out = script("""
        class Point:  # a class of __main__: by path, as spawn does
            def __init__(self, x):
                self.x = x

        def work(q, conn, ev, lock, val, arr, sem, pt):
            with lock:
                val.value += 1
            arr[0] = 42
            with sem:
                conn.send(("pipe", cuinit(), pt.x))
            ev.wait(60)
            q.put(("after event", ev.is_set()))

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            q, (a, b), ev = mp.Queue(), mp.Pipe(), mp.Event()
            lock, val, arr, sem = mp.Lock(), mp.Value("i", 1), mp.Array("i", 3), mp.Semaphore(1)
            p = mp.Process(target=work, args=(q, b, ev, lock, val, arr, sem, Point(7)))
            p.start()
            print(a.recv())
            ev.set()
            print(q.get(timeout=60))
            p.join()
            print("value", val.value, "array", arr[:], "exit", p.exitcode)
    """)
    assert "('pipe', 0, 7)" in out.stdout
    assert "('after event', True)" in out.stdout
    assert "value 2 array [42, 0, 0] exit 0" in out.stdout


def test_reroute_exit_codes_terminate_kill_and_sentinel(script):
    out = script("""
        import signal, time
        from multiprocessing.connection import wait

        def fail():
            raise ValueError("boom in the child")

        def code():
            sys.exit(7)

        def forever():
            time.sleep(600)

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            a, b, c, d = (mp.Process(target=t) for t in (fail, code, forever, forever))
            for p in (a, b, c, d):
                p.start()
            assert wait([a.sentinel, b.sentinel], 60)
            a.join(); b.join()
            assert c.is_alive() and c.exitcode is None
            assert wait([c.sentinel], 0) == []
            c.terminate(); d.kill()
            c.join(); d.join()
            print("codes", a.exitcode, b.exitcode, c.exitcode, d.exitcode)
            assert wait([c.sentinel, d.sentinel], 10)
            for p in (a, b, c, d):
                p.close()
    """)
    assert f"codes 1 7 -{15} -{9}" in out.stdout
    assert "ValueError: boom in the child" in out.stderr


def test_exit_reports_reach_their_owner_whoever_reads_the_servers_socket(script):
    # The interpreter fork server reports every child's exit on its one socket. A rerouted
    # Process, a DataLoader's server workers and a notebook_launch share it: a launch reading
    # the socket meanwhile must not swallow the others' reports (they were lost: the Process's
    # exit code became 255 after 5 s, the killed worker's death "unknown" after 2 s).
    out = script("""
        import signal, time
        import torch
        from torch.utils.data import Dataset

        def code():
            sys.exit(7)

        def rank():
            import time
            time.sleep(1.0)
            return 1

        class Items(Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                return i

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            # server workers: "auto" forks them (this process's children, reaped by the loader)
            loader = forkguard.DataLoader(Items(), batch_size=4, num_workers=2,
                                          persistent_workers=True, worker_start="server")
            it = iter(loader)
            next(it)
            victim = loader._iterator._workers[1].pid
            p = mp.Process(target=code)
            p.start()
            os.kill(victim, signal.SIGKILL)
            while os.path.exists(f"/proc/{victim}"):  # reaped by the server: reported
                time.sleep(0.01)
            while os.path.exists(f"/proc/{p.pid}"):
                time.sleep(0.01)
            print("ranks", forkguard.notebook_launch(rank, nproc=2))  # reads the socket
            t0 = time.monotonic()
            p.join(30)
            print("exitcode", p.exitcode, "after", round(time.monotonic() - t0, 1))
            t0 = time.monotonic()
            try:
                for _ in it:
                    pass
            except RuntimeError as e:
                print("loader:", e, "after", round(time.monotonic() - t0, 1))
    """)
    assert "ranks [1, 1]" in out.stdout
    assert "exitcode 7 after 0.0" in out.stdout, out.stdout + out.stderr
    assert "is killed by signal: Killed" in out.stdout and "after 0.0" in \
        out.stdout.split("loader:")[1], out.stdout + out.stderr


def test_reroute_process_pool_executor_fork_context(script):
    out = script("""
        import concurrent.futures

        def square(x):
            assert cuinit() == 0
            return x * x

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            ctx = mp.get_context("fork")
            with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as ex:
                print("results", list(ex.map(square, range(6))))
    """)
    assert "results [0, 1, 4, 9, 16, 25]" in out.stdout


def test_reroute_pool_initializer_sets_a_main_global_the_tasks_see(script):
    # As under spawn and fork: the initializer and the tasks share the child's __main__.
    out = script("""
        import concurrent.futures

        STATE = None

        def init(value):
            global STATE
            STATE = value

        def task(x):
            return (STATE, x, cuinit())

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            with mp.Pool(2, initializer=init, initargs=("pool",)) as pool:
                print("pool", pool.map(task, range(3)))
            with concurrent.futures.ProcessPoolExecutor(
                    2, mp_context=mp.get_context("fork"), initializer=init,
                    initargs=("executor",)) as ex:
                print("executor", list(ex.map(task, range(3))))
    """)
    assert "pool [('pool', 0, 0), ('pool', 1, 0), ('pool', 2, 0)]" in out.stdout, out.stderr
    assert "executor [('executor', 0, 0), ('executor', 1, 0), ('executor', 2, 0)]" in \
        out.stdout, out.stderr
    assert "clean interpreter fork server" in out.stderr


def test_reroute_children_attach_to_shared_memory_and_leave_it_to_its_owner(script):
    # A child that attaches registers the segment with its parent's resource tracker, as a spawn
    # child does: its exit unlinks nothing (it did: the next child got FileNotFoundError).
    out = script("""
        from multiprocessing import shared_memory

        def attach(name, i):
            shm = shared_memory.SharedMemory(name)
            shm.buf[i] = i + 1 + cuinit()
            shm.close()

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            shm = shared_memory.SharedMemory(create=True, size=4)
            codes = []
            for i in range(3):
                p = mp.Process(target=attach, args=(shm.name, i))
                p.start()
                p.join()
                codes.append(p.exitcode)
            print("codes", codes, "buf", bytes(shm.buf[:3]))
            print("exists", os.path.exists("/dev/shm/" + shm.name.lstrip("/")))
            shm.close()
            shm.unlink()
            print("unlinked", not os.path.exists("/dev/shm/" + shm.name.lstrip("/")))
    """)
    assert "codes [0, 0, 0] buf b'\\x01\\x02\\x03'" in out.stdout, out.stdout + out.stderr
    assert "exists True" in out.stdout and "unlinked True" in out.stdout
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_reroute_child_puts_main_class_instances_and_maps_main_functions(script):
    # The by-value copies are the child's __main__ objects: what it sends by reference to
    # __main__ pickles (it raised PicklingError "not the same object as __main__.Point" in the
    # child, and the parent's get() blocked forever).
    out = script("""
        import torch.multiprocessing as tmp

        class Point:
            def __init__(self, x):
                self.x = x

        def double(p):
            return Point(p.x * 2)

        def work(q):
            q.put(Point(cuinit() + 5))
            with mp.Pool(2) as pool:  # a fork of this clean child
                q.put([p.x for p in pool.map(double, [Point(1), Point(2)])])

        def rank(i, q):
            q.put(Point(i))

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            q = mp.Queue()
            p = mp.Process(target=work, args=(q,))
            p.start()
            p.join()  # its feeder thread wrote what it could before it exited: no wait on get
            got = []
            while not q.empty():
                got.append(q.get_nowait())
            print("queue", type(got[0]).__name__ if got else None, [getattr(g, "x", g) for g in got])
            print("exit", p.exitcode)
            sq = tmp.get_context("fork").SimpleQueue()
            ctx = tmp.start_processes(rank, args=(sq,), nprocs=2, start_method="fork",
                                      join=False)
            while not ctx.join():
                pass
            got = []
            while not sq.empty():
                got.append(sq.get().x)
            print("ranks", sorted(got))
            q.close(); q.join_thread()
    """)
    assert "queue Point [5, [2, 4]]" in out.stdout, out.stdout + out.stderr
    assert "exit 0" in out.stdout and "ranks [0, 1]" in out.stdout, out.stdout + out.stderr
    assert "PicklingError" not in out.stderr, out.stderr


def test_reroute_a_main_global_that_cannot_travel_is_named_at_its_first_use_in_the_child(script):
    # The child is not the script run again (spawn's way): a __main__ global whose parent's value
    # cannot be pickled, or cannot be rebuilt in the child, has no value of the child's own to
    # fall back on. Its first use raises NotCarriedError naming it and why; what did travel works,
    # and the parent's get() does not wait forever.
    out = script("""
        import sqlite3

        def _rebuild(pid):
            if os.getpid() != pid:
                raise RuntimeError("only in the process that made it")
            return Handle()

        class Handle:
            def __init__(self):
                self.pid = os.getpid()

            def __reduce__(self):
                return _rebuild, (self.pid,)

        HANDLE = Handle()
        DB = sqlite3.connect(":memory:")
        FINE = 41

        def work(q):
            q.put(("fine", FINE + 1))
            for what, use in (("HANDLE", lambda: HANDLE.pid), ("DB", lambda: DB.execute("1"))):
                try:
                    use()
                except forkguard.NotCarriedError as e:
                    q.put((what, str(e)))

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            q = mp.SimpleQueue()
            p = mp.Process(target=work, args=(q,))
            p.start()
            p.join()
            while not q.empty():
                print("child", q.get())
            print("exit", p.exitcode)
    """)
    assert "child ('fine', 42)" in out.stdout and "exit 0" in out.stdout, out.stdout + out.stderr
    assert ("__main__.HANDLE did not reach this child" in out.stdout and
            "could not be rebuilt here: RuntimeError: only in the process that made it"
            in out.stdout), out.stdout
    assert "__main__.DB did not reach this child" in out.stdout and "sqlite3.Connection" in \
        out.stdout, out.stdout


def test_reroute_keeps_fork_semantics_the_script_is_not_run_again(script, tmp_path):
    # A fork-style script (no `if __name__ == "__main__":`) whose top level does work before it
    # starts children: a rerouted child must not run it again, as spawn's children do (each would
    # count, load, and start children of its own: "An attempt has been made to start a new
    # process before the current process has finished its bootstrapping phase").
    runs = tmp_path / "top-level-runs"
    out = script(f"""
        with open({str(runs)!r}, "a") as f:
            f.write("run\\n")
        TABLE = {{"loaded": os.getpid()}}

        def work(q, i):
            q.put((i, TABLE["loaded"], __name__))

        cuinit()
        forkguard.guard()
        q = mp.SimpleQueue()
        ps = [mp.Process(target=work, args=(q, i)) for i in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        got = sorted(q.get() for _ in ps)
        print("got", [(i, loaded == os.getpid(), name) for i, loaded, name in got])
        print("exits", [p.exitcode for p in ps])
    """)
    assert "got [(0, True, '__main__'), (1, True, '__main__')]" in out.stdout, \
        out.stdout + out.stderr
    assert "exits [0, 0]" in out.stdout, out.stdout + out.stderr
    assert runs.read_text() == "run\n"
    assert "bootstrapping phase" not in out.stderr, out.stderr


def test_reroute_a_script_from_standard_input_and_python_c(script, fake_cuda_env, tmp_path):
    # No file to run again: a rerouted child of `python - < script` (it failed with
    # FileNotFoundError: '<stdin>') or of `python -c` gets __main__'s values all the same.
    body = PRELUDE + textwrap.dedent("""
        SCALE = 3

        def work(q):
            q.put(SCALE * cuinit() + SCALE)

        cuinit()
        forkguard.guard()
        q = mp.SimpleQueue()
        p = mp.Process(target=work, args=(q,))
        p.start()
        p.join()
        print("got", q.get(), "exit", p.exitcode)
    """)
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    env = dict(os.environ, PYTHONPATH=package_parent)
    for how in (dict(args=["-"], input=body), dict(args=["-c", body], input="")):
        out = run_bounded([sys.executable, *how["args"]], 300, input=how["input"], env=env,
                          cwd=tmp_path)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "got 3 exit 0" in out.stdout, out.stdout + out.stderr
        assert "FileNotFoundError" not in out.stderr, out.stderr


def test_reroute_a_large_main_global_is_not_copied_in_the_parent(script):
    # A 256 MB array of __main__ that the children read: each child gets the parent's value at
    # its start (as a fork does: the parent's change between starts is seen, the child's own
    # writes are its own), without a pickled copy of it in the parent (its peak RSS grew by
    # 256-512 MB).
    pytest.importorskip("numpy")
    out = script("""
        import numpy as np

        BIG = np.zeros(32 * 2**20)  # 256 MB

        def hwm():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) * 1024

        def work(q, i):
            first = float(BIG[0])
            BIG[1] = -1.0  # its own copy
            q.put((i, first, float(BIG[2:].sum()), BIG.shape, cuinit()))

        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            BIG[2:] = 1.0
            q = mp.SimpleQueue()
            before = hwm()
            got = []
            for i in range(4):
                BIG[0] = i  # seen by child i
                p = mp.Process(target=work, args=(q, i))
                p.start()
                got.append(q.get())
                p.join()
            grew = hwm() - before
            print("got", got)
            print("parent", BIG[0], BIG[1])
            print("grew MB", grew // 2**20, "ok" if grew < 64 * 2**20 else "too much")
    """)
    n = 32 * 2**20 - 2
    assert "got " + repr([(i, float(i), float(n), (n + 2,), 0) for i in range(4)]) in \
        out.stdout, out.stdout + out.stderr
    assert "parent 3.0 0.0" in out.stdout
    assert "ok" in out.stdout, out.stdout


DATALOADER = """
import torch
from torch.utils.data import DataLoader, Dataset

class Squares(Dataset):  # calls cuInit as a Dataset doing .cuda() would
    def __len__(self):
        return 8
    def __getitem__(self, i):
        rc = cuinit()
        if rc != 0:
            raise RuntimeError(f"CUDA error: initialization error (cuInit returned {rc})")
        return torch.tensor([i, i * i])

def batches(workers):
    return [b.tolist() for b in DataLoader(Squares(), batch_size=3, num_workers=workers)]

if __name__ == "__main__":
    cuinit()
    policy = sys.argv[1]
    if policy != "none":
        forkguard.guard(policy)
    try:
        print("equal:", batches(2) == batches(0))
    except forkguard.ForkUnsafeError as e:
        print("refused:", str(e).splitlines()[0])
        print("children:", children())
    except RuntimeError as e:
        print("failed:", e)
"""


def test_dataloader_default_context_unguarded_fails_guarded_matches_refuse_raises(script):
    pytest.importorskip("torch")
    out = script(DATALOADER, args=("none",))
    assert "cuInit returned 3" in out.stdout, out.stdout + out.stderr
    out = script(DATALOADER, args=("reroute",))
    assert "equal: True" in out.stdout, out.stdout + out.stderr
    out = script(DATALOADER, args=("refuse",))
    assert "refused: fork is not safe here" in out.stdout and "children: []" in out.stdout


def test_python_m_forkguard_guard_and_the_environment_variable(script):
    body = """
        def work(q):
            q.put(cuinit())

        if __name__ == "__main__":
            cuinit()
            q = mp.SimpleQueue()
            p = mp.Process(target=work, args=(q,))
            try:
                p.start()
                print("child cuInit:", q.get())
                p.join()
            except forkguard.ForkUnsafeError:
                print("refused")
    """
    out = script(body, runner=("-m", "forkguard.guard"))
    assert "child cuInit: 0" in out.stdout, out.stderr
    out = script(body, runner=("-m", "forkguard.guard", "--refuse"))
    assert "refused" in out.stdout
    os.environ["FORKGUARD_GUARD"] = "reroute"
    try:
        out = script(body)
    finally:
        del os.environ["FORKGUARD_GUARD"]
    assert "child cuInit: 0" in out.stdout, out.stderr


def test_a_fork_context_lock_made_while_clean_is_refused_by_name(script):
    out = script("""
        def work(lock):
            pass

        if __name__ == "__main__":
            forkguard.guard()
            lock = mp.Lock()  # clean here: a plain fork's unnamed semaphore
            cuinit()
            try:
                mp.Process(target=work, args=(lock,)).start()
            except forkguard.RerouteError as e:
                print("refused:", e)
    """)
    assert "refused:" in out.stdout and "Lock" in out.stdout and "has no name" in out.stdout


TORCH_REPORT = """
    import torch

    def report(q):
        q.put((os.getppid(), torch._C._cuda_isInBadFork()
               if hasattr(torch._C, "_cuda_isInBadFork") else None))
"""


def test_torch_fork_poison_plain_fork_is_in_a_bad_fork_guard_reroutes_refuse_raises(
        script, torch_build):
    need_torch_build("cuda", torch_build)
    out = script(TORCH_REPORT + """
    if __name__ == "__main__":
        available = torch.cuda.is_available()  # torch's fork poison, GPU or not
        print("available:", available)
        q = mp.Queue()
        p = mp.Process(target=report, args=(q,))
        p.start()  # multiprocessing's plain fork, unguarded
        ppid, bad = q.get(timeout=60)
        p.join()
        print("plain:", ppid == os.getpid(), bad)
        q.close(); q.join_thread()
        forkguard.guard("refuse")
        try:
            mp.Process(target=report, args=(None,)).start()
            print("refused: no")
        except forkguard.ForkUnsafeError as e:
            print("refused:", str(e).splitlines()[0])
            print("children:", mp.active_children(), children())
        forkguard.guard()
        q = mp.Queue()  # made under the guard: it can travel to the fork server's child
        p = mp.Process(target=report, args=(q,))
        p.start()
        ppid, bad = q.get(timeout=120)
        p.join()
        print("guarded:", ppid == forkguard._launch._server.pid, bad, p.exitcode)
        q.close(); q.join_thread()
    """)
    assert "plain: True True" in out.stdout, out.stdout  # the child is in torch's bad fork
    assert "guarded: True False 0" in out.stdout, out.stdout + out.stderr  # rerouted: clean
    assert "refused: fork is not safe here" in out.stdout and "children: [] []" in out.stdout
    assert out.stderr.count("forkguard.guard(): this process") == 1, out.stderr
    if "available: False" in out.stdout:  # no GPU: torch's flag alone decided
        assert "is torch_fork_poisoned" in out.stdout and "torch_fork_poison:" in out.stderr


def test_a_cpu_build_of_torch_forks_plainly_after_is_available(script, torch_build):
    need_torch_build("cpu", torch_build)
    out = script(TORCH_REPORT + """
    if __name__ == "__main__":
        print("available:", torch.cuda.is_available(), torch.cuda.device_count())
        forkguard.guard("refuse")
        q = mp.Queue()
        p = mp.Process(target=report, args=(q,))
        p.start()
        ppid, bad = q.get(timeout=60)
        p.join()
        print("plain:", ppid == os.getpid(), bad, p.exitcode)
        q.close(); q.join_thread()
    """)
    assert "available: False 0" in out.stdout
    assert "plain: True None 0" in out.stdout, out.stdout + out.stderr
    assert "forkguard" not in out.stderr, out.stderr


def _child_ppid(q):
    q.put(os.getppid())


def test_clean_parent_under_the_guard_forks_plainly(capfd):
    fds_before = sorted(os.listdir("/proc/self/fd"))
    forkguard.guard()
    try:
        assert forkguard._guard.guarded() == "reroute"
        forkguard.guard()  # idempotent
        q = multiprocessing.get_context("fork").SimpleQueue()
        p = multiprocessing.get_context("fork").Process(target=_child_ppid, args=(q,))
        p.start()
        assert q.get() == os.getpid()  # a fork of this process, not of the fork server
        p.join()
        assert p.exitcode == 0
        p.close()
        q.close()
    finally:
        forkguard.unguard()
    assert forkguard._guard.guarded() is None
    assert "forkguard" not in capfd.readouterr().err
    assert forkguard._launch._server is None  # the fork server was never needed
    assert sorted(os.listdir("/proc/self/fd")) == fds_before
    assert multiprocessing.active_children() == []


def test_guard_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="reroute, refuse, warn"):
        forkguard.guard("sometimes")


NB_CELL1 = """\
import ctypes, os
cuda = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"])
print("notebook cuInit:", cuda.cuInit(0))
import forkguard
forkguard.guard()
"""

NB_CELL2 = """\
import torch
import torch.multiprocessing as tmp

def fn(rank, q, t, done):
    rc = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)
    t[rank] = rank + 100  # the notebook's shared-memory tensor
    q.put((rank, rc, torch.full((2,), rank)))
    done.wait()  # the tensor's fd is served from here until the notebook has it

ctx = tmp.get_context("fork")
q, done = ctx.SimpleQueue(), ctx.Event()
shared = torch.zeros(2).share_memory_()
procs = tmp.start_processes(fn, args=(q, shared, done), nprocs=2, start_method="fork",
                            join=False)
results = sorted((r, rc, x.tolist()) for r, rc, x in (q.get() for _ in range(2)))
done.set()
while not procs.join():
    pass
print("results:", results, "shared:", shared.tolist())
"""


def test_notebook_start_processes_fork_after_cuinit_rerouted(fake_cuda_env, tmp_path,
                                                             monkeypatch):
    pytest.importorskip("torch")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    monkeypatch.setenv("PYTHONPATH", package_parent)
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    marker = uuid.uuid4().hex
    monkeypatch.setenv("FORKGUARD_GUARD_TEST", marker)
    shm_before = _shm()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (NB_CELL1, NB_CELL2)]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    c1, c2 = ("".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream")
              for c in nb.cells)
    assert "notebook cuInit: 0" in c1
    assert "results: [(0, 0, [0, 0]), (1, 0, [1, 1])] shared: [100.0, 101.0]" in c2, c2
    assert "clean interpreter fork server" in c2
    deadline = time.monotonic() + 30
    while marked_pids(f"FORKGUARD_GUARD_TEST={marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_pids(f"FORKGUARD_GUARD_TEST={marker}") == []
    assert {f for f in _shm() - shm_before if f.startswith(("sem.", "torch_"))} == set()


def test_importing_the_cli_module_keeps_forkguard_guard_callable():
    import forkguard.guard  # noqa: F401 - the module behind python3 -m forkguard.guard

    forkguard.guard("refuse")
    try:
        assert forkguard._guard.guarded() == "refuse"
    finally:
        forkguard.unguard()
    assert forkguard._guard.guarded() is None


@pytest.mark.parametrize("script_name", ["plain.py", "_server_train.py"])
def test_the_environment_variable_guards_a_script_that_never_imports_forkguard(
        fake_cuda_env, tmp_path, guarded_site_python, script_name):
    # forkguard installed in a site-packages directory (conftest.guarded_site_python):
    # FORKGUARD_GUARD=reroute guards unchanged code; unset, forkguard is not even imported. A
    # script whose name begins with "_server" is guarded too (forkguard took it for its own fork
    # server by that name, and guarded nothing).
    python = guarded_site_python
    script = tmp_path / script_name
    script.write_text(textwrap.dedent("""
        import ctypes, os, sys
        import multiprocessing as mp

        def cuinit():
            return ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)

        def work(q):
            q.put(cuinit())

        if __name__ == "__main__":
            print("imported:", "forkguard" in sys.modules)
            cuinit()
            q = mp.SimpleQueue()
            p = mp.Process(target=work, args=(q,))
            p.start()
            p.join()
            print("child cuInit:", q.get())
    """))
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FORKGUARD_GUARD")}
    env["FORKGUARD_GUARD_TEST"] = marker
    runs = {}
    for value in (None, "reroute"):
        run_env = dict(env, **({"FORKGUARD_GUARD": value} if value else {}))
        runs[value] = subprocess.run([python, str(script)], capture_output=True, text=True,
                                     timeout=300, env=run_env, cwd=tmp_path)
    out = runs[None]
    assert out.returncode == 0 and "imported: False" in out.stdout, out.stdout + out.stderr
    assert "child cuInit: 3" in out.stdout, out.stdout + out.stderr  # a plain fork
    out = runs["reroute"]
    assert out.returncode == 0 and "imported: True" in out.stdout, out.stdout + out.stderr
    assert "child cuInit: 0" in out.stdout, out.stdout + out.stderr
    assert out.stderr.count("clean interpreter fork server") == 1, out.stderr
    deadline = time.monotonic() + 30
    while marked_pids(f"FORKGUARD_GUARD_TEST={marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_pids(f"FORKGUARD_GUARD_TEST={marker}") == []


def test_reroute_a_killed_fork_server_gives_its_children_the_real_status_at_once(script):
    # The interpreter fork server SIGKILLed under two rerouted Processes: their children die
    # with it (its parent-death signal), and join() says so at once with their real status, -9.
    # It used to take 5 s per join and say 255.
    out = script("""
        import signal, time
        from forkguard import _launch
        def sleeper():
            time.sleep(60)
        cuinit()
        forkguard.guard()
        ps = [mp.Process(target=sleeper) for _ in range(2)]
        for p in ps:
            p.start()
        os.kill(_launch._server.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for p in ps:
            p.join()
        print("joined in", round(time.monotonic() - t0, 2), "exit codes", [p.exitcode for p in ps])
        assert time.monotonic() - t0 < 2.0
        print("children:", mp.active_children())
    """)
    assert "exit codes [-9, -9]" in out.stdout, out.stdout + out.stderr
    assert "children: []" in out.stdout



def test_reroute_terminate_and_kill_go_through_the_childs_pidfd_never_a_pid(script):
    # A rerouted Process is a child of the fork server, signalled through the pidfd the server
    # opened before it could reap it, never by PID (os.kill fails here). Once it has exited and
    # was reaped, terminate()/kill() send nothing and raise nothing.
    out = script("""
        import signal, time
        def forever():
            time.sleep(600)
        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            a, b, c = (mp.Process(target=forever) for _ in range(3))
            for p in (a, b, c):
                p.start()
            handles = [p._popen._child for p in (a, b, c)]
            print("handles", [h.pid == p.pid for h, p in zip(handles, (a, b, c))])
            def by_pid(pid, sig):
                raise AssertionError(f"os.kill({pid}, {sig}): a child signalled by PID")
            os.kill = by_pid
            a.terminate(); b.kill()
            a.join(); b.join()
            print("codes", a.exitcode, b.exitcode)
            print("exited", [h.exited() for h in handles])
            a.terminate(); a.kill(); b.terminate(); b.kill()
            print("stale", handles[0].signal(signal.SIGKILL), handles[1].signal(0))
            print("live", handles[2].signal(0))
            c.kill(); c.join()
            print("third", c.exitcode)
            for p in (a, b, c):
                p.close()
    """)
    assert "handles [True, True, True]" in out.stdout, out.stdout + out.stderr
    assert "codes -15 -9" in out.stdout
    assert "exited [True, True, False]" in out.stdout
    assert "stale False False" in out.stdout
    assert "live True" in out.stdout
    assert "third -9" in out.stdout


def _pid_namespace_allowed():
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "-Urpf", "--mount-proc", "sh", "-c",
                            "echo 100 > /proc/sys/kernel/ns_last_pid"],
                           capture_output=True, text=True)
    return unshare if probe.returncode == 0 else None


def test_reroute_a_stale_handle_never_signals_the_process_that_got_its_pid(fake_cuda_env,
                                                                           tmp_path):
    # In a PID namespace of its own (whose next PID can be chosen): a rerouted Process exits,
    # the fork server reaps it, a decoy gets its PID. Its handle sends nothing to the decoy,
    # where a kill by PID (os.kill(p.pid, ...)) would have killed it.
    unshare = _pid_namespace_allowed()
    if unshare is None:
        pytest.skip("no PID namespace with a writable ns_last_pid here (unshare -Urpf)")
    path = tmp_path / "reuse.py"
    path.write_text(PRELUDE + textwrap.dedent("""
        import signal, subprocess
        def quick():
            pass
        if __name__ == "__main__":
            cuinit()
            forkguard.guard()
            p = mp.Process(target=quick)
            p.start()
            handle, pid = p._popen._child, p.pid
            p.join()
            print("exit", p.exitcode, handle.exited())
            # The next PID handed out is ns_last_pid + 1; a thread started meanwhile may take
            # it first: try again.
            for _ in range(100):
                with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                    f.write(str(pid - 1))
                decoy = subprocess.Popen(["sleep", "60"])
                if decoy.pid == pid:
                    break
                decoy.kill()
                decoy.wait()
            print("decoy has its PID", decoy.pid == pid)
            print("sent", handle.signal(signal.SIGKILL))
            p.kill()
            try:
                decoy.wait(timeout=1.0)
                print("decoy killed")
            except subprocess.TimeoutExpired:
                print("decoy alive")
            decoy.kill()
            decoy.wait()
            p.close()
    """))
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    out = subprocess.run([unshare, "-Urpf", "--mount-proc", sys.executable, str(path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=package_parent))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exit 0 True" in out.stdout, out.stdout + out.stderr
    assert "decoy has its PID True" in out.stdout
    assert "sent False" in out.stdout
    assert "decoy alive" in out.stdout


def test_a_rerouted_childs_exit_handlers_run_as_python_3_13_needs(tmp_path):
    # Python 3.13 no longer flushes a child's Queue from Process._bootstrap (util._exit_function
    # moved to the forking code's atexit): a rerouted child's item was lost there (queue.Empty, 3
    # leaked semaphores). The rerouted child runs _python_compat.bootstrap_child; here its 3.13
    # path runs on this Python, in a hand-made fork child, and the item arrives.
    script = tmp_path / "exit_handlers.py"
    script.write_text(textwrap.dedent("""
        import os, queue
        import multiprocessing as mp
        from forkguard import _python_compat

        def put(q):
            q.put("delivered")

        if __name__ == "__main__":
            q = mp.Queue()
            p = mp.Process(target=put, args=(q,))
            pid = os.fork()
            if pid == 0:
                os._exit(_python_compat.bootstrap_child(p, None, runs_exit_function=False))
            _, status = os.waitpid(pid, 0)
            try:
                print(q.get(timeout=30), os.waitstatus_to_exitcode(status))
            except queue.Empty:
                print("lost", os.waitstatus_to_exitcode(status))
    """))
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=package_parent))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["delivered", "0"], out.stdout + out.stderr


def test_reroute_a_ctypes_library_global_is_loaded_again_in_the_child(script):
    # `DRIVER = ctypes.CDLL(path)` at a script's top level (test_wheel's script, and the seeds'):
    # a fork child has it mapped; a rerouted child loads the same library by its name.
    out = script("""
        DRIVER = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"])

        def work():
            sys.exit(DRIVER.cuInit(0))

        if __name__ == "__main__":
            print("parent", DRIVER.cuInit(0))
            forkguard.guard()
            p = mp.Process(target=work)
            p.start()
            p.join()
            print("child", p.exitcode)
    """)
    assert "parent 0" in out.stdout and "child 0" in out.stdout, out.stdout + out.stderr
