"""forkguard.DataLoader as a user meets it, with real processes. Each scenario runs in a child
interpreter (the `script` fixture) with the test driver, so this process stays clean, and each
checks that nothing is left behind (processes tagged by this test's marker, /dev/shm files):

  - the field failure: the parent initialized CUDA, the dataset (or worker_init_fn) uses CUDA:
    torch's DataLoader fails with "CUDA error: initialization error", forkguard's loads every
    batch from the clean fork server, says so once, and warns once (or raises) naming the stage;
  - the same from a Jupyter notebook whose Dataset class is defined in a cell;
  - failures: a worker killed mid-epoch, a sample that raises, a timeout, a loader or iterator
    dropped mid-epoch, the interpreter's exit with a live or a failed iterator;
  - transport: the batches view the worker's memfd slot, nothing goes through /dev/shm (even a
    small or read-only one, where torch's loader dies of a bus error);
  - determinism with seed= for any num_workers and worker_start; the per-sample seeds and
    bad_sample="skip"'s substitutes the C++ loader's (forkguard.ImageLoader's) for the same seed;
  - pin_memory: slots page-locked once by the driver, the batch handed out is the slot;
  - an IterableDataset sharded by get_worker_info() with persistent workers;
  - resume from state_dict() mid-pass, map-style and iterable (stateful or replayed).
"""
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from conftest import in_private_shm, make_images, marked_pids, private_shm_allowed

import forkguard

pytest.importorskip("torch")

STARTS = ["fork", "server"]

PRELUDE = '''\
import ctypes, gc, hashlib, json, os, random, signal, sys, time, warnings
import numpy as np
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info
import forkguard
from forkguard import _launch, _native

MARKER = os.environ["FORKGUARD_DL_TEST"]


def cuinit():
    return ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def servers():
    """forkguard's two fork servers: the C++ one (started at import), the Python one."""
    srv = _launch._server
    return {_native.fork_server_pid()} | ({srv.pid} if srv is not None else set())


def children():
    """[(pid, state)] of this process's children, zombies included, but the fork servers."""
    kids = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids |= {int(k) for k in f.read().split()}
        except FileNotFoundError:
            pass
    out = []
    for pid in sorted(kids - servers()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                out.append((pid, f.read().rsplit(")", 1)[1].split()[0]))
        except FileNotFoundError:
            pass
    return out


def workers():
    """[(pid, name, state)] of the live fg-dl-worker processes of this test, whatever their
    parent (a fork of this process, or a child of the fork server)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            if not name.startswith("fg-dl-worker"):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if MARKER.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        found.append((int(pid), name, state))
    return found


def fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own
            pass
    return out


def slot_maps():
    """[(start, end)] of this process's mappings of a forkguard-batch memfd."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "/memfd:forkguard-batch" in line:
                lo, hi = line.split()[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def storage_ptr(t):
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
    return s.data_ptr()


def in_slot(t):
    p, n = storage_ptr(t), t.numel() * t.element_size()
    return any(lo <= p and p + n <= hi for lo, hi in slot_maps())


def shm():
    return set(os.listdir("/dev/shm"))


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()
'''


def _shm():
    return set(os.listdir("/dev/shm"))


def _package_parent():
    return os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))


def _leftover_shm(before, prefixes=("sem.", "torch_", "forkguard", "fg")):
    return {f for f in _shm() - before if f.startswith(prefixes)}


def _no_process_left(marker):
    # The fork server exits once its caller has: wait on that event, bounded.
    deadline = time.monotonic() + 30
    while marked_pids(f"FORKGUARD_DL_TEST={marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    return marked_pids(f"FORKGUARD_DL_TEST={marker}")


@pytest.fixture()
def script(fake_cuda_env, tmp_path, monkeypatch):
    """Runs a script (PRELUDE + body) in a child interpreter and returns (CompletedProcess, the
    RESULT it printed); checks nothing is left behind. Where permitted the script runs in a
    private mount namespace with its own tmpfs on /dev/shm (`shm`: its mount options), whose
    files once it exited are exactly the ones it left (other tests and programs running beside
    it make files in the host's); a test that needs a particular /dev/shm skips elsewhere."""
    shm_before = _shm()
    marker = uuid.uuid4().hex
    monkeypatch.setenv("FORKGUARD_DL_TEST", marker)
    monkeypatch.setenv("PYTHONPATH", _package_parent())
    monkeypatch.delenv("FORKGUARD_WORKER_START", raising=False)
    runs = []
    left_in_private_shm = []

    def run(body, args=(), expect_rc=0, shm=None, timeout=120, exit_within=None,
            peer_may_leave=None):
        """`peer_may_leave`: a pattern of the file names a peer (PyTorch's own DataLoader) is
        known to leave in the private /dev/shm in this run; they are the peer's result, not held
        against forkguard. Everything else still fails."""
        path = tmp_path / f"script{len(runs)}.py"
        path.write_text(PRELUDE + textwrap.dedent(body))
        cmd = [sys.executable, str(path), *map(str, args)]
        listing = tmp_path / f"script{len(runs)}.shm"
        ok, why = private_shm_allowed()
        if shm is not None and not ok:
            pytest.skip(f"a private /dev/shm ({shm}) is not permitted here: {why}")
        if ok:
            cmd = in_private_shm(cmd, listing, shm or "size=1g")
        err_path = tmp_path / f"script{len(runs)}.stderr"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    cwd=tmp_path, start_new_session=True)
        try:
            if exit_within is None:
                stdout, _ = proc.communicate(timeout=timeout)
            else:
                # from its line "LEAVING", it has `exit_within` seconds to exit
                lines = []
                for line in proc.stdout:
                    lines.append(line)
                    if line.startswith("LEAVING"):
                        break
                proc.wait(exit_within)
                stdout = "".join(lines) + proc.stdout.read()
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        out = subprocess.CompletedProcess(cmd, proc.returncode, stdout, err_path.read_text())
        runs.append(out)
        if listing.exists():
            left_in_private_shm.extend(
                name for name in listing.read_text().split()
                if peer_may_leave is None or not re.fullmatch(peer_may_leave, name))
        if expect_rc is not None:
            assert out.returncode == expect_rc, out.stdout + out.stderr
        found = [line[len("RESULT "):] for line in out.stdout.splitlines()
                 if line.startswith("RESULT ")]
        return out, (json.loads(found[-1]) if found else None)

    yield run
    assert _no_process_left(marker) == []
    assert left_in_private_shm == []
    if not private_shm_allowed()[0]:
        assert _leftover_shm(shm_before) == set()


# --- 1. The field failure ---------------------------------------------------------------------

FIELD = '''
class Plain(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((2,), float(i)), i


class CudaDataset(Plain):  # what users write: "just check the GPU" in __getitem__
    def __getitem__(self, i):
        if cuinit() != 0:
            raise RuntimeError("CUDA error: initialization error")
        return super().__getitem__(i)


def cuda_init_fn(worker_id):
    if cuinit() != 0:
        raise RuntimeError("CUDA error: initialization error")


def batches(loader):
    return [[x.tolist(), y.tolist()] for x, y in loader]


def main(where):
    dataset = CudaDataset() if where == "__getitem__" else Plain()
    init_fn = cuda_init_fn if where == "worker_init_fn" else None
    expected = batches(forkguard.DataLoader(Plain(), batch_size=4, num_workers=0))
    print("parent cuInit:", cuinit(), flush=True)

    it = iter(TorchDataLoader(dataset, batch_size=4, num_workers=2, worker_init_fn=init_fn))
    try:
        next(it)
        torch_error = None
    except RuntimeError as e:
        torch_error = str(e)
    finally:
        it._shutdown_workers()  # torch's, at once: a collection of it waits 5 s a worker
        del it

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = batches(forkguard.DataLoader(dataset, batch_size=4, num_workers=2,
                                           worker_init_fn=init_fn))
    said = [str(w.message) for w in caught if issubclass(w.category, forkguard.CudaInWorkerWarning)]

    try:
        batches(forkguard.DataLoader(dataset, batch_size=4, num_workers=2,
                                     worker_init_fn=init_fn, cuda_in_workers="error"))
        error = None
    except forkguard.CudaInWorkerError as e:
        error = str(e)
    wait_for(lambda: not workers())
    result(torch_error=torch_error, expected=expected, got=got, warnings=said, error=error,
           workers=workers(), children=children())


main(sys.argv[1])
'''


@pytest.mark.parametrize("where", ["__getitem__", "worker_init_fn"])
def test_field_cuda_parent_torch_fails_forkguard_loads_every_batch(script, where):
    out, r = script(FIELD, args=[where])
    assert "parent cuInit: 0" in out.stdout
    # torch's loader: its forked workers meet the driver's initialization error.
    assert r["torch_error"] is not None and "CUDA error: initialization error" in r["torch_error"]
    assert "Caught RuntimeError in DataLoader worker process" in r["torch_error"]
    # forkguard's: every batch, the same as the single-process loader's: the workers were
    # forked, the first one's cuInit was caught (the tripwire), and the batches were made again
    # by workers from the clean fork server. Nothing on stderr: one warning says it all.
    assert r["got"] == r["expected"] and len(r["got"]) == 4
    assert "forkguard.DataLoader: this process (PID" not in out.stderr, out.stderr
    # warned once, naming the stage, what made the fork unfit and where the batches come from
    assert len(r["warnings"]) == 1, r["warnings"]
    assert f"tried to initialize CUDA in {where}" in r["warnings"][0]
    assert "is initialized" in r["warnings"][0]
    assert "forkguard's clean fork server" in r["warnings"][0]
    # cuda_in_workers="error": CudaInWorkerError naming the stage (and the batch's indices)
    assert r["error"] is not None and f"tried to initialize CUDA in {where}" in r["error"], \
        r["error"]
    if where == "__getitem__":
        assert "__getitem__ of the batch of indices [0, 1, 2, 3]" in r["error"]
        assert "of the batch of indices [0, 1, 2, 3]" in r["warnings"][0]
    assert r["workers"] == [] and r["children"] == []


# --- 1b. Fork's cost and semantics after CUDA (issue 34) -----------------------------------

FORK_AFTER_CUDA = '''
import sqlite3, threading

def make_dirty(how):
    """The parent's CUDA step: torch's own device count (torch 2.x's CUDA build sets its fork
    poison, even with no GPU), or the driver's cuInit (the test driver)."""
    if how == "is_available":
        print("is_available:", torch.cuda.is_available(), flush=True)
    else:
        print("parent cuInit:", cuinit(), flush=True)


COUNTER = {"made_before_the_loader": 0}


class Unpicklable(Dataset):
    """What torch's fork loader loads every day and no pickle carries: a connection, an open
    file, a lock, a lambda, module-level state changed after import."""

    def __init__(self, path):
        self.db = sqlite3.connect(":memory:")
        self.db.execute("create table t (i integer, sq integer)")
        self.db.executemany("insert into t values (?, ?)", [(i, i * i) for i in range(24)])
        self.file = open(path)
        self.lock = threading.Lock()
        self.scale = lambda x: x * 10

    def __len__(self):
        return 24

    def __getitem__(self, i):
        with self.lock:
            (sq,) = self.db.execute("select sq from t where i = ?", (i,)).fetchone()
        # pread: the workers share the file's offset (one open file description, as forks do)
        return torch.tensor([i, sq, self.scale(i), int(os.pread(self.file.fileno(), 16, 0)),
                             COUNTER["made_before_the_loader"], os.getppid()])


def main(how, start):
    make_dirty(how)
    with open("value.txt", "w") as f:
        f.write("7")
    COUNTER["made_before_the_loader"] = 42
    kw = {} if start == "auto" else {"worker_start": start}
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = forkguard.DataLoader(Unpicklable("value.txt"), batch_size=4, num_workers=2, **kw)
        for epoch in range(2):
            rows.append([r for b in loader for r in b.tolist()])
    result(rows=rows, pid=os.getpid(), warnings=[str(w.message) for w in caught])


main(sys.argv[1], sys.argv[2])
'''


def _dirty_kinds():
    """How a parent gets dirty here: the driver's cuInit (test driver, either torch), and torch's
    own is_available() where torch is a CUDA build (its fork poison; torch 2.14's wheel)."""
    import torch

    kinds = ["cuInit"]
    if hasattr(torch._C, "_cuda_getDeviceCount"):
        kinds.append("is_available")
    return kinds


DIRTY = _dirty_kinds()


@pytest.mark.parametrize("start", ["auto", "fork"])
@pytest.mark.parametrize("how", DIRTY)
def test_after_cuda_auto_forks_the_workers_and_loads_what_torchs_fork_loader_loads(script, how,
                                                                                  start):
    out, r = script(FORK_AFTER_CUDA, args=[how, start])
    expected = [[i, i * i, 10 * i, 7, 42, r["pid"]] for i in range(24)]
    # every row made by a fork of this process (its parent is us), with the parent's objects
    assert r["rows"] == [expected, expected], r["rows"]
    assert r["warnings"] == []
    assert "forkguard.DataLoader" not in out.stderr, out.stderr


def test_after_cuda_server_workers_name_what_cannot_travel(script):
    out, r = script(FORK_AFTER_CUDA, args=["cuInit", "server"], expect_rc=1)
    # the clean workers asked for cannot have the connection: the error names it
    assert "TypeError: forkguard.DataLoader: the workers start from the clean fork server" in \
        out.stderr, out.stderr
    assert "dataset.db" in out.stderr and "sqlite3.Connection" in out.stderr, out.stderr


SWALLOWED = '''
class Swallows(Dataset):
    """Tries CUDA in `where` and keeps what it got: a dataset that swallows the error."""

    def __init__(self, how, where):
        self.how, self.where = how, where

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return [i, try_cuda(self.how) if self.where == "__getitem__" else "", os.getpid()]


def try_cuda(how):
    if how == "cuInit":
        rc = cuinit()
        return "ok" if rc == 0 else f"CUDA error: initialization error ({rc})"
    try:
        torch.zeros(1, device="cuda")
        return "ok"
    except Exception as e:  # noqa: BLE001 - swallowed, as such datasets do
        return f"{type(e).__name__}: {e}"


INIT = {"got": ""}


def init_fn(how):
    def init(worker_id):
        INIT["got"] = try_cuda(how)
    return init


def collate(how, where):
    def fn(samples):
        extra = try_cuda(how) if where == "collate_fn" else INIT["got"]
        return [s[:1] + [s[1] or extra] + s[2:] for s in samples]
    return fn


def main(how, where, kind, policy):
    if how == "is_available":
        print("is_available:", torch.cuda.is_available(), flush=True)
    else:
        print("parent cuInit:", cuinit(), flush=True)
    dataset = Swallows(how, where)
    if kind == "iterable":
        class Iter(IterableDataset):
            def __iter__(self):
                info = get_worker_info()
                for i in range(info.id, 16, info.num_workers):
                    yield dataset[i]
        dataset_used = Iter()
    else:
        dataset_used = dataset
    kw = dict(batch_size=2, num_workers=2, collate_fn=collate(how, where),
              worker_init_fn=init_fn(how) if where == "worker_init_fn" else None,
              cuda_in_workers=policy)
    if kind == "torch":
        loader = TorchDataLoader(dataset_used, batch_size=2, num_workers=2,
                                 collate_fn=collate(how, where),
                                 worker_init_fn=kw["worker_init_fn"])
    else:
        loader = forkguard.DataLoader(dataset_used, **kw)
    rows, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for epoch in range(2):
                rows.append([r for b in loader for r in b])
        except forkguard.CudaInWorkerError as e:
            error = str(e)
    said = [str(w.message) for w in caught if issubclass(w.category, forkguard.CudaInWorkerWarning)]
    wait_for(lambda: not workers())
    result(rows=rows, pid=os.getpid(), warnings=said, error=error, workers=workers())


main(*sys.argv[1:])
'''

FORKED = "Cannot re-initialize CUDA in forked subprocess"


def _poisoned(row, how):
    text = row[1]
    return (FORKED in text) if how == "is_available" else ("initialization error" in text)


@pytest.mark.parametrize("how", DIRTY)
@pytest.mark.parametrize("where", ["__getitem__", "worker_init_fn", "collate_fn"])
def test_a_swallowed_cuda_error_in_a_forked_worker_never_reaches_the_loop(script, how, where):
    out, r = script(SWALLOWED, args=[how, where, "map", "warn"])
    for epoch in r["rows"]:
        assert [row[0] for row in epoch] == list(range(16))
        bad = [row for row in epoch if _poisoned(row, how)]
        assert bad == [], bad
        # made by clean workers: children of the fork server, not of this process
        assert r["pid"] not in [row[2] for row in epoch]
    assert len(r["warnings"]) == 1, r["warnings"]
    assert f"tried to initialize CUDA in {where}" in r["warnings"][0]
    assert "forkguard's clean fork server" in r["warnings"][0]
    assert "Cure:" in r["warnings"][0]
    assert r["workers"] == []


@pytest.mark.parametrize("how", DIRTY)
def test_torchs_own_loader_gives_every_sample_the_forked_subprocess_error(script, how):
    out, r = script(SWALLOWED, args=[how, "__getitem__", "torch", "warn"])
    for epoch in r["rows"]:
        assert all(_poisoned(row, how) for row in epoch), epoch


@pytest.mark.parametrize("how", DIRTY)
def test_an_iterable_that_swallows_the_cuda_error_is_replayed_on_clean_workers(script, how):
    out, r = script(SWALLOWED, args=[how, "__getitem__", "iterable", "warn"])
    for epoch in r["rows"]:
        assert sorted(row[0] for row in epoch) == list(range(16)), epoch
        assert [row for row in epoch if _poisoned(row, how)] == []
    assert len(r["warnings"]) == 1, r["warnings"]


def test_cuda_in_workers_error_refuses_a_forked_workers_cuda_naming_the_stage(script):
    out, r = script(SWALLOWED, args=["cuInit", "__getitem__", "map", "error"])
    assert r["rows"] == [] and r["error"] is not None
    assert "tried to initialize CUDA in __getitem__ of the batch of indices [0, 1]" in r["error"]
    assert r["workers"] == []


def test_worker_start_fork_keeps_its_forks_and_says_so_once(script):
    out, r = script(SWALLOWED.replace("cuda_in_workers=policy)",
                                      "cuda_in_workers=policy, worker_start='fork')"),
                    args=["cuInit", "__getitem__", "map", "warn"])
    for epoch in r["rows"]:
        assert [row[0] for row in epoch] == list(range(16))
        assert all(_poisoned(row, "cuInit") for row in epoch)  # what the dataset made of it
    assert len(r["warnings"]) == 1, r["warnings"]
    assert "worker_start='fork' keeps the forked workers" in r["warnings"][0]


NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # a Python where `pip install torch` brought no numpy
import os, torch, forkguard
from torch.utils.data import Dataset

class Squares(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.tensor([i, i * i])

for start in ("fork", "server"):
    rows = [r for b in forkguard.DataLoader(Squares(), batch_size=4, num_workers=2,
                                            worker_start=start) for r in b.tolist()]
    assert rows == [[i, i * i] for i in range(8)], rows
print("numpy" in sys.modules and sys.modules["numpy"] is not None, "ok")
"""


def test_the_loader_needs_no_numpy(fake_cuda_env, tmp_path, monkeypatch):
    marker = uuid.uuid4().hex
    monkeypatch.setenv("FORKGUARD_DL_TEST", marker)
    monkeypatch.setenv("PYTHONPATH", _package_parent())
    out = subprocess.run([sys.executable, "-c", NO_NUMPY], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "False ok"
    assert _no_process_left(marker) == []


ONE_REBUILD = '''
MB = 1 << 20


class Big(Dataset):
    """80 MB of bytes (pages written, so they count), and a note of every rebuild."""

    def __init__(self, size):
        self.blob = bytes(range(256)) * (size // 256)

    def __setstate__(self, state):
        self.__dict__.update(state)
        with open("rebuilt.txt", "a") as f:
            f.write(f"{os.getpid()}\\n")

    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([i, self.blob[i * 1000], os.getpid()])


def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("Pss:"))


def run(size):
    """(rows, the loader's fork server, the workers' parents, Pss of it and its workers)."""
    loader = forkguard.DataLoader(Big(size), batch_size=4, num_workers=4, worker_start="server",
                                  persistent_workers=True)
    it = iter(loader)
    rows = [r for r in next(it).tolist()]
    workers = [w.pid for w in it._workers]
    zygote = it._queue._zygote.pid
    parents = {int(open(f"/proc/{w}/stat").read().rsplit(")", 1)[1].split()[1]) for w in workers}
    total = sum(pss(p) for p in workers + [zygote])
    rows += [r for b in it for r in b.tolist()]
    it._shutdown_workers()
    return rows, zygote, sorted(parents), total


def main():
    _, _, _, small = run(256 * 1024)  # the interpreters alone: the baseline
    os.remove("rebuilt.txt")
    rows, zygote, parents, big = run(80 * MB)
    with open("rebuilt.txt") as f:
        rebuilt = [int(x) for x in f.read().split()]
    result(rows=[r[:2] for r in rows], rebuilt=rebuilt, zygote=zygote, parents=parents,
           workers=4, dataset_pss_mb=(big - small) / MB)


main()
'''


def test_clean_workers_share_one_rebuild_of_the_dataset_per_loader(script):
    _, r = script(ONE_REBUILD)
    blob = bytes(range(256))
    assert r["rows"] == [[i, blob[(i * 1000) % 256]] for i in range(64)]
    # rebuilt once, in the loader's own fork server, which forked the 4 workers
    assert r["rebuilt"] == [r["zygote"]], r
    assert r["parents"] == [r["zygote"]] and r["workers"] == 4
    # the 80 MB are one copy shared by the loader's fork server and its 4 workers (not 4 or 5)
    assert 60 < r["dataset_pss_mb"] < 2 * 80, r["dataset_pss_mb"]


# --- 2. A notebook ----------------------------------------------------------------------------

NB_CELL_CUDA = """\
import ctypes, os, sys
print("notebook cuInit:", ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0))
import torch
import forkguard
"""

NB_CELL_LOAD = """\
from torch.utils.data import Dataset

class Squares(Dataset):  # a class of the notebook's __main__: travels by value
    def __len__(self):
        return 22

    def __getitem__(self, i):
        rc = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)
        return torch.tensor([i, i * i, rc, os.getpid()])

loader = forkguard.DataLoader(Squares(), batch_size=4, num_workers=2, cuda_in_workers="allow")
rows = [r for b in loader for r in b.tolist()]
print("rows:", [r[:3] for r in rows] == [[i, i * i, 0] for i in range(22)])
print("batches:", len(loader), "workers:", len({r[3] for r in rows}))
print("notebook pid in rows:", os.getpid() in {r[3] for r in rows})
"""


def _cell_text(cell, name="stdout"):
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.get("output_type") == "stream" and o.get("name") == name)


def test_notebook_dataset_class_after_cuinit_loads_every_batch(fake_cuda_env, tmp_path,
                                                              monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("cloudpickle")
    shm_before = _shm()
    marker = uuid.uuid4().hex
    monkeypatch.setenv("FORKGUARD_DL_TEST", marker)
    monkeypatch.setenv("PYTHONPATH", _package_parent())
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    monkeypatch.delenv("FORKGUARD_WORKER_START", raising=False)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (NB_CELL_CUDA, NB_CELL_LOAD)]
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    c1, c2 = nb.cells
    assert "notebook cuInit: 0" in _cell_text(c1)
    text = _cell_text(c2)
    assert "rows: True" in text, text + _cell_text(c2, "stderr")
    assert "batches: 6 workers: 2" in text
    # the rows come from clean workers (cuInit 0), not from the forks that tried first
    assert "notebook pid in rows: False" in text
    assert _no_process_left(marker) == []
    # not "sem.": no semaphore is made here, and other programs' multiprocessing leaves them
    assert _leftover_shm(shm_before, ("torch_", "forkguard", "fg")) == set()


# --- 3. Failures ------------------------------------------------------------------------------

KILLED = '''
class Killer(Dataset):
    """Index 21 kills its worker (SIGKILL), saying when and which."""
    def __init__(self, path):
        self.path = path

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 21:
            with open(self.path, "w") as f:
                f.write(f"{os.getpid()} {time.time()}")
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((2,), float(i))


class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.full((2,), float(i))


def main(start):
    loader = forkguard.DataLoader(Killer("killed.txt"), batch_size=4, num_workers=2,
                                  worker_start=start)
    it = iter(loader)
    pids = [w.pid for w in it._workers]
    n = 0
    try:
        for _ in it:
            n += 1
        own = None
    except RuntimeError as e:
        own = {"error": str(e), "at": time.time()}
    pid, when = open("killed.txt").read().split()
    own.update(pid=int(pid), delay=own["at"] - float(when), pids=pids, batches=n,
               exitcodes=[w.exitcode for w in it._workers])
    del it, loader

    # killed from outside, mid-epoch, by the PID the iterator lists
    it = iter(forkguard.DataLoader(Slow(), batch_size=4, num_workers=2, worker_start=start))
    next(it)
    next(it)
    victim = it._workers[1].pid
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    try:
        for _ in it:
            pass
        outside = None
    except RuntimeError as e:
        outside = {"error": str(e), "delay": time.time() - killed_at}
    outside.update(pid=victim, exitcode=it._workers[1].exitcode)
    del it
    wait_for(lambda: not workers())
    result(own=own, outside=outside, workers=workers(), children=children())


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_a_killed_worker_is_named_with_its_samples_within_a_second(script, start):
    _, r = script(KILLED, args=[start])
    own = r["own"]
    assert own["pid"] in own["pids"]
    assert own["error"].startswith(
        f"DataLoader worker (pid {own['pid']}) is killed by signal: Killed."), own["error"]
    assert "It held the samples" in own["error"] and "[20, 21, 22, 23]" in own["error"]
    assert own["delay"] < 1.0, own
    assert own["batches"] == 5  # in order: the batches before the one that died
    assert own["exitcodes"][own["pids"].index(own["pid"])] == -9
    out = r["outside"]
    assert out is not None, "killing a worker went unnoticed"
    assert f"DataLoader worker (pid {out['pid']}) is killed by signal: Killed." in out["error"]
    assert "It held the samples" in out["error"]
    assert out["delay"] < 1.0 and out["exitcode"] == -9, out
    assert r["workers"] == [] and r["children"] == []


KILLED_PERSISTENT = '''
class Ints(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return i


def epochs(loader, n, kill_after=None, kill_between=False):
    """Per pass: [batches, error, where it was raised ("iter" or "next")]; the worker 1 is
    SIGKILLed after batch `kill_after` of the first pass, or once the first pass ended."""
    out, victim = [], None
    for e in range(n):
        batches, error, where = 0, None, "iter"
        try:
            it = iter(loader)
            where = "next"
            for _ in it:
                batches += 1
                if e == 0 and batches == kill_after:
                    victim = it._workers[1].pid
                    os.kill(victim, signal.SIGKILL)
        except RuntimeError as ex:
            error = str(ex)
        out.append([batches, error, where])
        if e == 0 and kill_between:
            victim = loader._iterator._workers[1].pid
            os.kill(victim, signal.SIGKILL)
    return out, victim


def main(start):
    def ours():
        return forkguard.DataLoader(Ints(), batch_size=4, num_workers=2, persistent_workers=True,
                                    worker_start=start)
    mid = epochs(ours(), 5, kill_after=3)
    between = epochs(ours(), 4, kill_between=True)
    gc.collect()
    wait_for(lambda: not workers())
    result(mid=mid, between=between, workers=workers(), children=children())


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_persistent_workers_after_a_worker_died_every_later_pass_raises_as_torchs(script,
                                                                                 start):
    # torch (1.13.1 and 2.14.1 alike): the pass a worker dies in raises "is killed by signal",
    # and every later iter() of the loader raises "DataLoader worker (pid(s) N) exited
    # unexpectedly" (its _reset waits for the worker's answer 5 s, then checks the workers):
    # never an empty pass. (torch's own loader is not run here: in 1.13 its SIGCHLD handler
    # raises wherever the main thread is, and its batches' fd passing from the killed worker
    # fails with ECONNREFUSED.)
    _, r = script(KILLED_PERSISTENT, args=[start])
    mid, victim = r["mid"]
    later = f"DataLoader worker (pid(s) {victim}) exited unexpectedly"
    assert mid[0][1].startswith(f"DataLoader worker (pid {victim}) is killed by signal: "
                                "Killed."), mid
    # the batches the dead worker had finished (some, none) are delivered first, as in torch's
    assert 3 <= mid[0][0] < 10 and mid[0][2] == "next", mid
    assert mid[1:] == [[0, later, "iter"]] * 4, mid
    # killed between two passes: the next iter() says which and how, the later ones as torch's
    between, victim = r["between"]
    assert between[0] == [10, None, "next"], between
    assert between[1][0] == 0 and between[1][2] == "iter", between
    assert between[1][1].startswith(f"DataLoader worker (pid {victim}) is killed by signal: "
                                    "Killed."), between
    assert between[2:] == [[0, f"DataLoader worker (pid(s) {victim}) exited unexpectedly",
                            "iter"]] * 2, between
    assert r["workers"] == [] and r["children"] == []


KILLED_SERVER = '''
class Slow(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(0.005)
        return i


def main():
    loader = forkguard.DataLoader(Slow(), batch_size=4, num_workers=2, worker_start="server")
    it = iter(loader)
    next(it)
    server = _launch._server.pid
    os.kill(server, signal.SIGKILL)
    t0 = time.monotonic()
    error = None
    try:
        for _ in it:
            pass
    except RuntimeError as e:
        error = str(e)
    seconds = time.monotonic() - t0
    del it
    # the next server-mode loader gets a new fork server
    again = sum(len(b) for b in forkguard.DataLoader(Slow(), batch_size=100, num_workers=2,
                                                     worker_start="server"))
    result(server=server, error=error, seconds=seconds, again=again, new=_launch._server.pid)


main()
'''


def test_a_killed_fork_server_is_named_by_its_loader_at_once(script):
    # Server workers die with their fork server. The loader used to stall 32 s per worker, then
    # say "exited unexpectedly with exit code -1" without naming the server.
    _, r = script(KILLED_SERVER)
    assert r["seconds"] < 2.0, r
    assert r["error"].startswith("DataLoader worker (pid "), r
    assert (f"exited unexpectedly: the fork server (PID {r['server']}) ended (killed by signal 9 "
            f"(SIGKILL)), and its workers with it. It held the samples ") in r["error"], r
    assert r["again"] == 400 and r["new"] != r["server"], r


RAISES = '''
class Bad(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5:
            raise ValueError(f"bad sample {i}")
        return torch.full((2,), float(i))


def run(loader):
    out, it = [], iter(loader)
    while True:
        try:
            b = next(it)
        except StopIteration:
            return out
        except Exception as e:
            out.append(["error", type(e).__name__, str(e)])
        else:
            out.append(b[:, 0].tolist())


def main(start):
    theirs = run(TorchDataLoader(Bad(), batch_size=4, num_workers=2))
    ours = run(forkguard.DataLoader(Bad(), batch_size=4, num_workers=2, worker_start=start))
    gc.collect()  # the re-raised exception's traceback cycle held the iterator: see AT_EXIT
    wait_for(lambda: not workers())
    result(theirs=theirs, ours=ours, workers=workers(), children=children())


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_a_sample_that_raises_is_reraised_with_its_traceback_then_iteration_goes_on(script,
                                                                                     start):
    _, r = script(RAISES, args=[start])
    theirs, ours = r["theirs"], r["ours"]
    assert len(ours) == len(theirs) == 4
    assert ours[0] == theirs[0] == [0.0, 1.0, 2.0, 3.0]
    assert ours[2:] == theirs[2:] == [[8.0, 9.0, 10.0, 11.0], [12.0, 13.0, 14.0, 15.0]]
    kind, name, text = ours[1]
    assert (kind, name) == ("error", "ValueError")
    assert text.splitlines()[0] == theirs[1][2].splitlines()[0] == \
        "Caught ValueError in DataLoader worker process 1."
    assert "Original Traceback (most recent call last):" in text
    assert 'raise ValueError(f"bad sample {i}")' in text and "ValueError: bad sample 5" in text
    assert "script0.py" in text
    assert r["workers"] == [] and r["children"] == []


NOT_AN_EXCEPTION = '''
class Ends(Dataset):
    """Sample 5 raises what is not an Exception: it ends a worker of torch's."""
    def __init__(self, what):
        self.what = what

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 5:
            raise {"SystemExit": SystemExit(3), "KeyboardInterrupt": KeyboardInterrupt(),
                   "GeneratorExit": GeneratorExit("closed")}[self.what]
        return i


def run(loader):
    out = []
    try:
        for b in loader:
            out.append(b.tolist())
    except BaseException as e:  # noqa - whatever it is, it must not end this script
        out.append([type(e).__name__, str(e)])
    return out


def main(what, start):
    loader = forkguard.DataLoader(Ends(what), batch_size=4, num_workers=2, worker_start=start,
                                  persistent_workers=True)
    it = iter(loader)
    pids = [w.pid for w in it._workers]
    ours = run(it)
    later = run(loader)
    del it, loader
    gc.collect()
    wait_for(lambda: not workers())
    result(ours=ours, later=later, pids=pids, workers=workers(), children=children())


main(*sys.argv[1:])
'''


@pytest.mark.parametrize("what", ["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
@pytest.mark.parametrize("start", STARTS)
def test_an_exception_that_is_not_an_Exception_ends_the_worker_as_in_torch(script, start, what):
    # torch's worker loop catches Exception only: SystemExit, KeyboardInterrupt or GeneratorExit
    # in __getitem__ ends the worker, and the loader raises RuntimeError "DataLoader worker
    # (pid(s) N) exited unexpectedly" (torch 1.13.1 and 2.14.1 alike; after 5 s where the exit
    # code is 0). forkguard's says so too, naming the exception, the worker and its batch (never
    # a slot it could not decode), then stops the workers.
    _, r = script(NOT_AN_EXCEPTION, args=[what, start])
    ours = r["ours"]
    assert ours[0] == [0, 1, 2, 3] and len(ours) == 2, ours
    kind, text = ours[1]
    pid = r["pids"][1]
    assert kind == "RuntimeError", ours
    raised = {"SystemExit": "SystemExit: 3", "KeyboardInterrupt": "KeyboardInterrupt",
              "GeneratorExit": "GeneratorExit: closed"}[what]
    assert text.startswith(f"DataLoader worker (pid {pid}) exited unexpectedly: {raised} "
                           "raised in DataLoader worker process 1 for the samples [4, 5, 6, 7]"
                           ), text
    assert "Original Traceback (most recent call last):" in text and "__getitem__" in text
    assert "batch slot" not in text
    # the workers were stopped: a later pass of the persistent loader raises as torch's does
    assert r["later"] == [["RuntimeError",
                           f"DataLoader worker (pid(s) {pid}) exited unexpectedly"]], r["later"]
    assert r["workers"] == [] and r["children"] == []


UNWRITABLE = '''
import threading


class Locks(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return threading.Lock() if i == 5 else i


try:
    got = [b for b in forkguard.DataLoader(Locks(), batch_size=4, num_workers=2,
                                           collate_fn=list, worker_start=sys.argv[1])]
    result(error=None)
except Exception as e:
    result(error=[type(e).__name__, str(e)])
'''


@pytest.mark.parametrize("start", STARTS)
def test_a_batch_the_worker_cannot_write_is_an_error_naming_it(script, start):
    _, r = script(UNWRITABLE, args=[start])
    kind, text = r["error"]
    assert kind == "RuntimeError" and re.match(
        r"DataLoader worker 1 \(pid \d+\) could not return the batch of the samples "
        r"\[4, 5, 6, 7\]: TypeError: cannot pickle '_thread.lock' object", text), r


NESTED = '''
import multiprocessing


class Inner(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i


class Outer(Dataset):
    """Each sample iterates a loader of its own, with workers (or without)."""
    def __init__(self, inner, num_workers):
        self.inner, self.num_workers = inner, num_workers

    def __len__(self):
        return 2

    def __getitem__(self, i):
        loader = {"torch": TorchDataLoader, "forkguard": forkguard.DataLoader}[self.inner]
        return sum(int(b.sum()) for b in loader(Inner(), batch_size=2,
                                                num_workers=self.num_workers))


def run(outer, inner, num_workers, start):
    kw = {"worker_start": start} if outer == "forkguard" else {}
    loader = {"torch": TorchDataLoader, "forkguard": forkguard.DataLoader}[outer]
    try:
        return [b.tolist() for b in loader(Outer(inner, num_workers), batch_size=2,
                                           num_workers=2, **kw)]
    except Exception as e:
        lines = str(e).strip().splitlines()
        return [type(e).__name__, lines[0], lines[-1]]


def in_daemonic_process(conn):
    """What a loader with workers gives in a daemonic multiprocessing process (torch's workers
    are such)."""
    try:
        conn.send([b.tolist() for b in forkguard.DataLoader(Inner(), batch_size=2,
                                                            num_workers=2)])
    except Exception as e:
        conn.send([type(e).__name__, str(e)])


def main(start):
    out = {}
    pairs = [("forkguard", "forkguard"), ("forkguard", "torch")]
    if start == "fork" and int(torch.__version__.split(".")[0]) >= 2:
        # torch's outer loader (the same for either start; 5 s to stop its stuck worker);
        # torch 1.13's is unreliable around its failed nested iterator (EBADF in its fd
        # passing, zombies, hangs): there, its workers' case is the daemonic process's, below
        pairs += [("torch", "forkguard"), ("torch", "torch")]
    for o, i in pairs:
        out[f"{o}/{i}"] = run(o, i, 2, start)
        # the re-raised exception's traceback cycle holds the iterator (see RAISES): gone
        # before the next loader's forked workers start (gc.freeze() would keep it)
        gc.collect()
    out["without workers"] = run("forkguard", "forkguard", 0, start)
    ctx = multiprocessing.get_context("fork")
    theirs, mine = ctx.Pipe(duplex=False)
    p = ctx.Process(target=in_daemonic_process, args=(mine,), daemon=True)
    p.start()
    out["daemonic process"] = theirs.recv()
    p.join()
    gc.collect()
    wait_for(lambda: not workers())
    result(out=out, workers=workers(), children=children())


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_a_loader_with_workers_in_a_worker_is_refused_as_torchs(script, start):
    # torch's workers are daemonic processes, which may not have children: a DataLoader with
    # workers in one raises AssertionError. forkguard's workers are the same to either loader.
    _, r = script(NESTED, args=[start])
    refused = ["AssertionError", "Caught AssertionError in DataLoader worker process 0.",
               "AssertionError: daemonic processes are not allowed to have children"]
    out = r["out"]
    for pair in ("torch/torch", "torch/forkguard"):
        assert out.pop(pair, refused) == refused, (pair, r["out"])
    assert out == {"forkguard/torch": refused, "forkguard/forkguard": refused,
                   "without workers": [[6, 6]],
                   "daemonic process": ["AssertionError",
                                        "daemonic processes are not allowed to have children"]
                   }, r["out"]
    assert r["workers"] == [] and r["children"] == []


ARGUMENTS = '''
class Ints(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return i


def attempt(cls, kw):
    """[where it failed ("constructor" or "iter"), the exception's type, its text], or "ok"."""
    where = "constructor"
    try:
        loader = cls(Ints(), batch_size=4, **kw)
        where = "iter"
        it = iter(loader)
        del it
        return "ok"
    except Exception as e:
        return [where, type(e).__name__, str(e)]


cases = [{"num_workers": 2.5}, {"num_workers": 2.0}, {"num_workers": 2, "prefetch_factor": 2.5},
         {"num_workers": -1}, {"num_workers": "2"}, {"num_workers": 2, "prefetch_factor": -1},
         {"num_workers": 2, "prefetch_factor": 0}, {"num_workers": 0, "prefetch_factor": 3},
         {"num_workers": True}, {"num_workers": 0.0}, {"num_workers": np.int64(1)}]
result(cases=[[repr(kw), attempt(TorchDataLoader, kw), attempt(forkguard.DataLoader, kw)]
              for kw in cases])
'''


def test_num_workers_and_prefetch_factor_are_checked_as_torch_does(script):
    # torch checks num_workers and prefetch_factor in its constructor (its messages, which
    # differ between releases) and fails on a float one in iter() (range(2.5): TypeError);
    # forkguard's gives torch's errors, and the float's TypeError at construction, naming it.
    _, r = script(ARGUMENTS)
    for kw, theirs, ours in r["cases"]:
        if theirs == "ok" or ours == "ok":
            assert theirs == ours, (kw, theirs, ours)
        elif theirs[2] == "'float' object cannot be interpreted as an integer":
            name = "num_workers" if "prefetch" not in kw else "prefetch_factor"
            assert theirs[:2] == ["iter", "TypeError"], (kw, theirs)
            value = re.search(rf"'{name}': ([^,}}]+)", kw).group(1)
            assert ours == ["constructor", "TypeError",
                            f"{name} must be an integer, not {value} (torch: 'float' object "
                            "cannot be interpreted as an integer)"], (kw, ours)
        else:  # torch's own check, where torch makes it (its constructor, or iter())
            assert ours == theirs, (kw, theirs, ours)
    floats = [kw for kw, theirs, _ in r["cases"] if theirs != "ok" and "float" in theirs[2]]
    assert len(floats) == 3, r["cases"]


TIMEOUT = '''
class Sleepy(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 4:
            time.sleep(60)
        return torch.full((2,), float(i))


def main(start):
    it = iter(forkguard.DataLoader(Sleepy(), batch_size=2, num_workers=2, timeout=1,
                                   worker_start=start))
    first = [next(it)[:, 0].tolist() for _ in range(2)]
    t = time.monotonic()
    try:
        next(it)
        error = None
    except RuntimeError as e:
        error = str(e)
    waited = time.monotonic() - t
    del it
    gone = wait_for(lambda: not workers(), 5)
    result(first=first, error=error, waited=waited, gone=gone, workers=workers(),
           children=children())


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_timeout_raises_torchs_message_and_the_stuck_worker_goes(script, start):
    _, r = script(TIMEOUT, args=[start])
    assert r["first"] == [[0.0, 1.0], [2.0, 3.0]]
    assert r["error"] == "DataLoader timed out after 1 seconds"
    assert 0.9 <= r["waited"] < 2.5, r["waited"]
    assert r["gone"] and r["workers"] == [] and r["children"] == []


DROPPED = '''
class Images(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((3, 32, 32), float(i))


def loader(start, **kw):
    return forkguard.DataLoader(Images(), batch_size=4, num_workers=2, worker_start=start, **kw)


def drop_iterator(start):
    it = iter(loader(start))
    b1, b2 = next(it), next(it)
    pids = [w.pid for w in it._workers]
    viewed = in_slot(b1) and in_slot(b2)
    del it
    # the batches outlive their iterator, unchanged
    kept = b1[:, 0, 0, 0].tolist() == [0, 1, 2, 3] and b2[:, 0, 0, 0].tolist() == [4, 5, 6, 7]
    del b1, b2
    return pids, viewed, kept


def drop_loader(start):
    ld = loader(start, persistent_workers=True)
    it = iter(ld)
    b = next(it)
    pids = [w.pid for w in it._workers]
    del it, b
    del ld  # its iterator lives on in it (persistent workers) until now
    return pids


def state():
    return {"fds": fds(), "maps": len(slot_maps()), "shm": sorted(shm())}


def main(start):
    for _ in loader(start):  # a full epoch first: the fork server started, lazy fds opened
        pass
    gc.collect()
    before = state()
    pids1, viewed, kept = drop_iterator(start)
    pids2 = drop_loader(start)
    pids = pids1 + pids2
    def clean():
        return not workers() and not children() and not any(os.path.exists(f"/proc/{p}")
                                                           for p in pids)
    gone = wait_for(clean, 5)
    after = state()
    result(viewed=viewed, kept=kept, gone=gone, workers=workers(), children=children(),
           before=before, after=after, pids=pids)


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_dropping_a_loader_or_iterator_mid_epoch_leaves_nothing(script, start):
    _, r = script(DROPPED, args=[start])
    assert r["viewed"] and r["kept"]
    assert r["workers"] == [], r["workers"]  # no fg-dl-worker anywhere
    assert r["children"] == [], r["children"]  # no child, no zombie
    assert r["gone"], r["pids"]
    before, after = r["before"], r["after"]
    new_fds = {fd: t for fd, t in after["fds"].items() if before["fds"].get(fd) != t}
    assert new_fds == {}
    assert after["maps"] <= before["maps"], (before["maps"], after["maps"])
    assert set(after["shm"]) - set(before["shm"]) == set()


THREADS = '''
import threading


class Numbers(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.tensor(i)


# Each epoch iterated in a thread of its own (the BackgroundGenerator pattern of prefetching
# libraries), the persistent workers kept from one thread to the next, then the main thread.
ld = forkguard.DataLoader(Numbers(), batch_size=2, num_workers=2, persistent_workers=True,
                          worker_start=sys.argv[1])
epochs, errors, pids = [], [], []


def epoch():
    try:
        epochs.append([b.tolist() for b in ld])
        pids.append(sorted(w.pid for w in ld._iterator._workers))
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")


for _ in range(2):
    t = threading.Thread(target=epoch)
    t.start()
    t.join()
    time.sleep(0.3)  # the thread is gone: its children, when they die with it, are dead by now
epoch()
result(epochs=epochs, errors=errors, pids=pids)
'''


@pytest.mark.parametrize("start", STARTS)
def test_persistent_workers_outlive_the_thread_that_started_them(script, start):
    # The parent-death signal comes when the thread that forked ends: forked workers died with
    # the first epoch's thread ("DataLoader worker (pid N) is killed by signal: Killed").
    _, r = script(THREADS, args=[start])
    assert r["errors"] == []
    assert r["epochs"] == [[[0, 1], [2, 3], [4, 5], [6, 7]]] * 3
    assert r["pids"][0] == r["pids"][1] == r["pids"][2]  # the same workers all along


AT_EXIT = '''
class Images(Dataset):
    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError("bad sample")
        return torch.full((3, 32, 32), float(i))


loader = forkguard.DataLoader(Images(5 if sys.argv[2] == "after-error" else None),
                              batch_size=4, num_workers=2, worker_start=sys.argv[1])
if sys.argv[2] == "live":  # a module global, mid-epoch
    it = iter(loader)
    batch = next(it)
else:  # a pass to its end, one of its batches raised (caught, kept): nothing left running
    def epoch():
        out, it = [], iter(loader)
        while True:
            try:
                out.append(next(it))
            except StopIteration:
                return out
            except ValueError as e:  # kept, to report at the end: with its traceback
                out.append(e)

    batches = epoch()
    assert [type(b).__name__ for b in batches] == ["Tensor", "ValueError", "Tensor", "Tensor"]
print("LEAVING", sys.argv[2], flush=True)
'''

# An iterator still in memory at exit (a module global, a persistent loader, one a kept
# exception's traceback holds): its workers are stopped, and a fork-server one's copy of the
# server's socket is closed with them, so the server sees EOF when the interpreter closes its own.
@pytest.mark.parametrize("start, case", [
    ("fork", "live"), ("server", "live"), ("fork", "after-error"), ("server", "after-error"),
])
def test_the_interpreter_exits_at_once(script, start, case):
    try:
        out, _ = script(AT_EXIT, args=[start, case], exit_within=5)
    except subprocess.TimeoutExpired:
        pytest.fail("the interpreter did not exit within 5 s of the script's end")
    assert f"LEAVING {case}" in out.stdout


# --- 4. Transport -----------------------------------------------------------------------------

TRANSPORT = '''
class Images(Dataset):
    def __len__(self):
        return 64 * 3

    def __getitem__(self, i):
        return torch.full((3, 224, 224), float(i)), i


def main(which):
    shm_before = shm()
    if which == "torch":
        it = iter(TorchDataLoader(Images(), batch_size=64, num_workers=2))
    else:
        it = iter(forkguard.DataLoader(Images(), batch_size=64, num_workers=2,
                                       worker_start=which))
    # Every batch is kept until the end (as `list(loader)` would), so two of them (38.5 MB each)
    # exist at once whatever the timing of the workers.
    n, viewed, right, error, kept = 0, [], [], None, []
    try:
        for x, y in it:
            kept.append(x)
            viewed.append(in_slot(x))
            right.append(x.shape == (64, 3, 224, 224) and x.dtype == torch.float32
                         and x[:, 0, 0, 0].tolist() == list(range(64 * n, 64 * n + 64))
                         and x[:, 2, 223, 223].tolist() == x[:, 0, 0, 0].tolist()
                         and y.tolist() == list(range(64 * n, 64 * n + 64)))
            n += 1
            del x, y
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    del kept
    it._shutdown_workers()
    del it
    gc.collect()  # a re-raised exception's traceback cycle holds the iterator: see AT_EXIT
    result(batches=n, viewed=viewed, right=right, error=error,
           new_shm=sorted(shm() - shm_before))


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_batches_of_images_view_the_slot_and_nothing_goes_through_dev_shm(script, start):
    # Where permitted, under a read-only /dev/shm: nothing can be written there (torch's
    # default_collate in a worker, get_worker_info() set, would stack each batch into a new
    # shared-memory file, only for it to be copied into the slot); elsewhere, none appears.
    _, r = script(TRANSPORT, args=[start],
                  shm="ro,size=64m" if private_shm_allowed()[0] else None)
    assert r["error"] is None, r["error"]
    assert r["batches"] == 3 and r["right"] == [True] * 3
    assert r["viewed"] == [True] * 3  # the tensor's storage lies in a forkguard-batch memfd
    assert r["new_shm"] == []


@pytest.mark.parametrize("which", ["torch", *STARTS])
def test_a_small_dev_shm(script, which):
    # torch's worker, killed by SIGBUS mid-write, may leave the segment it was filling (libshm
    # names them torch_<pid>_<random>_<n>): that is PyTorch's behaviour, not a leak of ours, so
    # only in the torch run are such names allowed; every forkguard run stays strict.
    out, r = script(TRANSPORT, args=[which], shm="size=64m",
                    peer_may_leave=r"torch_\d+_\d+_\d+" if which == "torch" else None)
    if which == "torch":
        # torch's loader fails: how (its worker dies of SIGBUS writing a batch into the full
        # /dev/shm, or its allocation of the next segment fails first with ENOSPC, re-raised as
        # the worker's RuntimeError, or another race between its workers' writes) and after how
        # many batches is the peer's business, and varies with the load; that it fails is the
        # point.
        assert r["error"] is not None and r["batches"] < 3, r
    else:
        assert r["error"] is None, r["error"]
        assert r["batches"] == 3 and r["right"] == [True] * 3 and r["viewed"] == [True] * 3


PINNED = '''
class Rows(Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        # from index 32 on, rows 64 times wider: those batches (8 MB) outgrow their worker's slot
        return torch.full((4096 if i < 32 else 4096 * 64,), float(i))


os.environ["FAKE_CUDA_LOG"] = os.path.abspath("driver.log")
drv = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"])


def page_locked(t):
    """What the driver says of the tensor's memory (cudaPointerGetAttributes asks the same)."""
    kind = ctypes.c_uint(0)
    return drv.cuPointerGetAttribute(ctypes.byref(kind), 2, ctypes.c_void_p(t.data_ptr())) == 0 \
        and kind.value == 1


def calls(name):
    """How many times this process called `name` and it succeeded."""
    if not os.path.exists("driver.log"):
        return 0
    with open("driver.log") as f:
        return sum(1 for line in f if line.split() == [str(os.getpid()), name, "0"])


copies = []
if sys.argv[2] == "cuda":
    # A PyTorch built with CUDA, as far as a DataLoader asks: torch.cuda.is_available(), and
    # Tensor.pin_memory() returning the tensor itself where the driver says its memory is
    # page-locked, else a copy into pinned memory (here a plain one, counted).
    torch.cuda.is_available = lambda: True

    def pin_memory(self, device=None):
        if page_locked(self):
            return self
        copies.append(self.numel())
        return self.clone()

    torch.Tensor.pin_memory = pin_memory


def main(start):
    loader = forkguard.DataLoader(Rows(), batch_size=8, num_workers=2, pin_memory=True,
                                  persistent_workers=True, worker_start=start)
    right, pinned, viewed = [], [], []
    for epoch in range(3):
        for n, b in enumerate(loader):
            right.append(b[:, 0].tolist() == [float(i) for i in range(8 * n, 8 * n + 8)])
            pinned.append(page_locked(b))
            viewed.append(in_slot(b))
    kept = b
    del loader, b
    gc.collect()
    kept_pinned = page_locked(kept)  # a batch outliving its loader keeps its slot, pinned
    registered = calls("cuMemHostRegister_v2")
    del kept
    gc.collect()
    result(right=right, pinned=pinned, viewed=viewed, copies=copies, kept_pinned=kept_pinned,
           registered=registered, unregistered=calls("cuMemHostUnregister"),
           initialized=calls("cuInit"))


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_pin_memory_page_locks_each_slot_once_and_hands_out_the_slot_itself(script, start):
    _, r = script(PINNED, args=[start, "cuda"])
    assert r["right"] == [True] * 18
    # every batch pinned where it lies: no copy into pinned memory, no pinning thread
    assert r["pinned"] == [True] * 18 and r["viewed"] == [True] * 18 and r["copies"] == []
    assert r["kept_pinned"]
    # once per slot, not per batch: 2 workers x prefetch 2, a slot or two more while the
    # consumer holds a batch, and a new registration for each slot a wide batch outgrew
    assert 4 <= r["registered"] <= 12, r
    assert r["unregistered"] == r["registered"]  # each undone before its memory is unmapped
    assert r["initialized"] == 1


PIN_FAILS = '''
class Rows(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.full((8,), float(i))


torch.cuda.is_available = lambda: True  # as in PINNED: a PyTorch with CUDA, as far as asked
if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9):
    # torch 2.9 ignores pin_memory_device (deprecated): the pinning is for the current device
    torch.cuda.current_device = lambda: 5
    device = {}
else:
    device = {"pin_memory_device": "cuda:5"}
try:
    for b in forkguard.DataLoader(Rows(), batch_size=4, num_workers=2, pin_memory=True,
                                  worker_start=sys.argv[1], **device):
        pass
    result(error=None)
except Exception as e:
    result(error=f"{type(e).__name__}: {e}")
gc.collect()
result(workers=wait_for(lambda: not workers()) and workers(), children=children())
'''


@pytest.mark.parametrize("start", STARTS)
def test_pin_memory_for_a_device_that_does_not_exist_is_an_error_naming_it(script, start):
    out, _ = script(PIN_FAILS, args=[start])
    first, last = [json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines()
                   if line.startswith("RESULT ")]
    assert first["error"].startswith("Error: pin_memory: cannot page-lock a batch slot of "
                                     "worker 0"), first
    assert "for CUDA device 5: CUDA device 5 does not exist (2 visible)" in first["error"], first
    assert last["workers"] == [] and last["children"] == []


@pytest.mark.parametrize("start", STARTS)
def test_pin_memory_without_cuda_changes_nothing_and_leaves_the_driver_alone(script, start):
    _, r = script(PINNED, args=[start, "cpu"])
    assert r["right"] == [True] * 18 and r["viewed"] == [True] * 18
    assert r["pinned"] == [False] * 18 and r["registered"] == 0 and r["initialized"] == 0


# --- 5. Determinism ---------------------------------------------------------------------------

SEEDED = '''
class Noisy(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i), random.random(), float(np.random.rand()),
                             torch.rand(1).item()], dtype=torch.float64)


def digest(num_workers, start="fork", seed=1234, epochs=3, persistent=False):
    kw = {} if num_workers == 0 else {"worker_start": start, "persistent_workers": persistent}
    loader = forkguard.DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers,
                                  generator=torch.Generator().manual_seed(0), seed=seed, **kw)
    h, orders, rows = hashlib.sha256(), [], []
    for _ in range(epochs):
        order = []
        for b in loader:
            h.update(b.numpy().tobytes())
            order += b[:, 0].tolist()
            rows += b.tolist()
        orders.append(order)
    return h.hexdigest(), orders, rows


def main():
    runs = {f"{start}-{n}": digest(n, start) for start in ("fork", "server") for n in (1, 2, 4)}
    runs["single-process"] = digest(0)
    got = {k: v[0] for k, v in runs.items()}
    # persistent workers (torch draws the workers' base seed from the generator once, not at
    # each pass: with seed=, each pass draws it as a new iterator would, so the next pass's
    # order is the same)
    kept = {start: digest(3, start, persistent=True)[0] for start in ("fork", "server")}
    _, orders, rows = runs["fork-2"]
    unseeded = [digest(n, seed=None, epochs=1)[0] for n in (1, 2)]
    result(got=got, kept=kept, orders=orders, rows=rows, unseeded=unseeded)


main()
'''


def test_seed_gives_the_same_epochs_for_any_worker_count_and_start(script):
    _, r = script(SEEDED)
    # num_workers 0 (the single-process iterator), 1, 2, 4; forked or from the fork server
    assert len(set(r["got"].values())) == 1, r["got"]
    assert set(r["kept"].values()) == set(r["got"].values()), r["kept"]
    orders = r["orders"]
    assert all(sorted(o) == list(range(24)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # shuffled anew each epoch
    rows = r["rows"]
    for e in range(3):  # in a pass, each index its own random numbers
        assert len({tuple(row[1:]) for row in rows[24 * e:24 * e + 24]}) == 24
    # without seed= the numbers depend on which worker drew them, as in torch's
    assert r["unseeded"][0] != r["unseeded"][1]


SEEDED_MAIN = '''
class Noisy(Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.tensor([float(i), random.random(), float(np.random.rand()),
                             torch.rand(1).item()], dtype=torch.float64)


class Plain(Noisy):
    def __getitem__(self, i):
        return torch.tensor([float(i), 0.0, 0.0, 0.0], dtype=torch.float64)


def train(dataset, user_seed, num_workers, persistent=False, epochs=3):
    """(the batches, and what the training loop draws from each generator after each batch)"""
    torch.manual_seed(user_seed)
    random.seed(user_seed)
    np.random.seed(user_seed)
    kw = {} if num_workers == 0 else {"worker_start": "fork", "persistent_workers": persistent}
    loader = forkguard.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=num_workers,
                                  seed=5, **kw)
    batches, draws = [], []
    for _ in range(epochs):
        for b in loader:
            batches.append(b.tolist())
            draws.append([torch.rand(1).item(), random.random(), float(np.random.rand())])
    return batches, draws


def main():
    runs = {}
    for user_seed in (0, 1):
        for n, persistent in ((0, False), (1, False), (3, False), (3, True)):
            runs[f"{user_seed}-{n}{'p' if persistent else ''}"] = train(Noisy(), user_seed, n,
                                                                        persistent)
    plain = train(Plain(), 0, 0)
    # what the training loop draws with no loader at all, from Python's and numpy's generators
    random.seed(0)
    np.random.seed(0)
    alone = [[random.random(), float(np.random.rand())] for _ in range(18)]
    result(runs=runs, plain=plain, alone=alone)


main()
'''


def test_seed_leaves_the_training_loops_generators_alone_and_orders_by_seed_and_epoch(script):
    # seed= with num_workers=0: the samples are seeded in this process, and then the caller's
    # generators are as they were (torch's, Python's, numpy's); the sampler's order with seed=
    # and no generator is a function of (seed, epoch): the same batches for any num_workers,
    # whatever the training loop drew.
    _, r = script(SEEDED_MAIN)
    runs = r["runs"]
    batches = {k: v[0] for k, v in runs.items()}
    assert len({json.dumps(b) for b in batches.values()}) == 1, {
        k: [row[0] for row in b[0]] + [row[0] for row in b[6]] for k, b in batches.items()}
    first = batches["0-0"]
    assert sorted(row[0] for b in first[:6] for row in b) == list(range(24))
    assert len({tuple(row[0] for b in first[6 * e:6 * e + 6] for row in b)
                for e in range(3)}) == 3  # each epoch its own order
    draws0, draws1 = runs["0-0"][1], runs["1-0"][1]
    assert draws0 != draws1  # the user's seed decides what the training loop draws
    # ... and the samples' random numbers took none of them: the same as over a dataset that
    # draws nothing, and Python's and numpy's exactly those of a loop without a loader
    assert draws0 == r["plain"][1]
    assert [d[1:] for d in draws0] == r["alone"]
    assert runs["0-0"][1] == runs["0-1"][1] == runs["0-3"][1] == runs["0-3p"][1]


def test_seed_and_substitutes_are_the_cpp_loaders():
    # The same literals as tests/data/rng_test.cpp pins for sample_key and substitute_index: one
    # definition, in C++, which forkguard.DataLoader calls.
    import numpy as np

    from forkguard import _dataloader_worker as w
    from forkguard import _native

    for (seed, epoch, index), key in {(0, 0, 0): 0x2130748AAAC80268,
                                      (1, 2, 3): 0x12588D809DCE88A7,
                                      (1234, 5, 17): 0xA8D5176972F214D3,
                                      (2**64 - 1, 7, 2**40): 0xE254A2F289F68412}.items():
        assert w.sample_seed(seed, epoch, index) == _native.sample_key(seed, epoch, index) == key
    # a user's seed (or index) taken modulo 2**64, as the C++ loader's uint64_t takes it
    assert w.sample_seed(-1, 7, 2**40) == 0xE254A2F289F68412
    assert w.sample_seed(2**64 + 1, 2, 3 - 2**64) == 0x12588D809DCE88A7
    # an integer of another type is that integer; anything else goes by the blake2b of its repr
    assert w.sample_seed(1, 2, np.int64(3)) == 0x12588D809DCE88A7
    assert w.sample_seed(5, 1, "sampler order") == _native.sample_key(5, 1, int.from_bytes(
        hashlib.blake2b(b"'sampler order'", digest_size=8).digest(), "little"))
    # seed 3, epoch 0, sample 13 of 40: the sixth draw is 13 itself, passed over
    assert [w.substitute_index(3, 0, 13, a, 40) for a in range(6)] == [32, 27, 21, 18, 4, 33]
    assert w.MAX_SUBSTITUTES == _native.MAX_SUBSTITUTES == 16


BAD_SAMPLES = '''
class Bad(Dataset):
    def __init__(self, bad):
        self.bad = bad

    def __len__(self):
        return 26

    def __getitem__(self, i):
        if i in self.bad:
            raise ValueError(f"sample {i} is corrupt")
        return i


def main(seed, epoch, bad):
    seed, epoch, bad = int(seed), int(epoch), set(json.loads(bad))
    got = {}
    for n, start in ((0, ""), (2, "fork"), (2, "server")):
        kw = {"worker_start": start} if n else {}
        loader = forkguard.DataLoader(Bad(bad), batch_size=13, num_workers=n, seed=seed,
                                      bad_sample="skip", **kw)
        loader.set_epoch(epoch)
        got[f"{n}{start}"] = ([x for b in loader for x in b.tolist()],
                              loader.stats["epochs"][-1]["skipped"])
    try:
        next(iter(forkguard.DataLoader(Bad(set(range(26))), batch_size=2, seed=seed,
                                       bad_sample="skip")))
        error = None
    except RuntimeError as e:
        error = str(e)
    result(got=got, error=error)


main(*sys.argv[1:])
'''


def test_bad_sample_skip_picks_the_cpp_loaders_substitutes(script, tmp_path):
    # An ImageFolder of 26 (3 classes of 8, and a corrupt file in each of the first two: samples 8
    # and 17), and a seed whose first substitute for sample 8 is the other bad one: the C++
    # loader goes on to the second, and so must forkguard.DataLoader over a dataset of 26 whose
    # samples 8 and 17 raise.
    from forkguard import _dataloader_worker as w

    root = make_images(tmp_path / "images", corrupt=True)
    (root / "class0" / "img98_bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    epoch, bad = 3, [8, 17]
    seed = next(s for s in range(10**4) if w.substitute_index(s, epoch, 8, 0, 26) == 17 and
                w.substitute_index(s, epoch, 8, 1, 26) != 17 and
                w.substitute_index(s, epoch, 17, 0, 26) != 8)
    with forkguard.ImageLoader(root, batch_size=13, workers=2, train=False, size=16, resize=16,
                               dtype="uint8", bad_sample="skip", seed=seed) as loader:
        loader.set_epoch(epoch)
        skipped = [s for images, _ in loader for s in images.skipped]
        assert loader.stats()["skipped"] == 2
    assert [(s["index"], s["key"].endswith("_bad.jpg")) for s in skipped] == [(8, True),
                                                                             (17, True)]
    cpp = {s["index"]: s["substitute"] for s in skipped}
    assert cpp == {8: w.substitute_index(seed, epoch, 8, 1, 26),
                   17: w.substitute_index(seed, epoch, 17, 0, 26)}

    out, r = script(BAD_SAMPLES, args=[seed, epoch, json.dumps(bad)])
    expected = [cpp.get(i, i) for i in range(26)]
    # one skip record per failure: sample 8's first substitute failed too
    assert r["got"] == {"0": [expected, 3], "2fork": [expected, 3], "2server": [expected, 3]}
    assert (f"forkguard.DataLoader: sample 8 failed (ValueError: sample 8 is corrupt); replaced "
            f"by sample 17 (bad_sample='skip')") in out.stderr, out.stderr
    assert r["error"] == ("forkguard.DataLoader: sample 0 and 16 substitutes for it all failed "
                          "(bad_sample='skip'); the last: ValueError: sample "
                          f"{w.substitute_index(seed, 0, 0, 15, 26)} is corrupt")


# --- 6. IterableDataset -----------------------------------------------------------------------

SHARDED = '''
class Shards(IterableDataset):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(wid, self.n, nw))


def main(start):
    loader = forkguard.DataLoader(Shards(37), batch_size=4, num_workers=3,
                                  persistent_workers=True, worker_start=start)
    epochs, pids = [], []
    for _ in range(3):
        seen = [x for b in loader for x in b.tolist()]
        epochs.append(seen)
        pids.append([w.pid for w in loader._iterator._workers])
    del loader
    wait_for(lambda: not workers())
    result(epochs=epochs, pids=pids, workers=workers(), children=children())


main(sys.argv[1])
'''


@pytest.mark.parametrize("start", STARTS)
def test_iterable_dataset_sharded_persistent_workers_each_element_once_per_epoch(script,
                                                                                start):
    _, r = script(SHARDED, args=[start])
    assert len(r["epochs"]) == 3
    for seen in r["epochs"]:
        assert sorted(seen) == list(range(37)), seen
    assert r["pids"][0] == r["pids"][1] == r["pids"][2]  # the same workers, persistent
    assert r["workers"] == [] and r["children"] == []


FLAKY = '''
class Elements:
    """An iterator over some numbers whose every element 3 mod 7 fails to be made."""
    def __init__(self, items):
        self.items, self.k = items, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.k == len(self.items):
            raise StopIteration
        x = self.items[self.k]
        self.k += 1
        if x % 7 == 3:
            raise ValueError(f"element {x} is corrupt")
        return x


class Flaky(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        return Elements(list(range(wid, 40, nw)))


def main(num_workers, start):
    num_workers = int(num_workers)
    kw = {"worker_start": start} if num_workers else {}
    loader = forkguard.DataLoader(Flaky(), batch_size=4, num_workers=num_workers,
                                  bad_sample="skip", **kw)
    got = sorted(x for b in loader for x in b.tolist())
    result(got=got, skipped=loader.stats["epochs"][-1]["skipped"])


main(*sys.argv[1:])
'''


@pytest.mark.parametrize("num_workers,start", [(0, ""), (2, "fork"), (2, "server")])
def test_bad_sample_skip_drops_an_iterables_failing_elements_and_goes_on(script, num_workers,
                                                                         start):
    out, r = script(FLAKY, args=[num_workers, start])
    bad = [x for x in range(40) if x % 7 == 3]
    assert r["got"] == [x for x in range(40) if x not in bad]
    assert r["skipped"] == len(bad)
    for x in bad:
        assert f"failed (ValueError: element {x} is corrupt); skipped (bad_sample='skip')" \
            in out.stderr, out.stderr


# --- 7. Resume --------------------------------------------------------------------------------

RESUME = '''
class Noisy(Dataset):
    """Map-style with a random augmentation (seeded per sample by seed=)."""
    def __len__(self):
        return 26

    def __getitem__(self, i):
        return torch.tensor([float(i), torch.rand(1).item()])


class Replayed(IterableDataset):
    """range(26) sharded by worker (9, 9, 8 elements for 3 workers: the last ends a batch early);
    each element made is logged to made.log."""
    def __init__(self):
        self.pos = 0         # how many of this copy's elements the current pass made
        self.resumed = None  # where a loaded state says the next pass goes on

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        mine = range(wid, 26, nw)
        self.pos, self.resumed = self.resumed or 0, None
        for k in range(self.pos, len(mine)):
            self.pos = k + 1
            with open("made.log", "a") as f:
                f.write(f"{mine[k]}\\n")
            yield torch.tensor([float(mine[k]), 0.0])


class Stateful(Replayed):
    """The same, saying where its iteration is; __iter__ goes on from a loaded state."""
    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.resumed = state["pos"]


def made():
    with open("made.log") as f:
        return sorted(int(x) for x in f.read().split())


def main(kind, num_workers, start):
    num_workers = int(num_workers)

    def make():
        kw = {"worker_start": start} if num_workers else {}
        return forkguard.DataLoader({"map": Noisy, "stateful": Stateful, "replayed": Replayed}[kind](),
                                    batch_size=4, shuffle=kind == "map", num_workers=num_workers,
                                    seed=7, generator=torch.Generator().manual_seed(3), **kw)

    loader = make()
    ref = [[b.tolist() for b in loader] for _ in range(2)]  # two passes, uninterrupted
    out = {"batches": len(ref[0])}
    for k in (1, 6, 7):
        a = make()
        it = iter(a)
        first = [next(it).tolist() for _ in range(k)]
        state = a.state_dict()
        del it, a
        gc.collect()
        open("made.log", "w").close()
        b = make()
        b.load_state_dict(state)
        rest = [x.tolist() for x in b]
        remade = made() if kind != "map" else []
        following = [x.tolist() for x in b]
        out[str(k)] = {"first": first == ref[0][:k], "rest": rest == ref[0][k:],
                  "following": following == ref[1],
                  "remade_of_first": sorted({int(r[0]) for x in first for r in x} & set(remade))}
    result(**out)


main(*sys.argv[1:])
'''


@pytest.mark.parametrize("kind,num_workers,start", [
    ("map", 0, ""), ("map", 2, "fork"), ("map", 2, "server"),
    ("stateful", 0, ""), ("stateful", 3, "fork"), ("stateful", 3, "server"),
    ("replayed", 3, "fork")])
def test_resume_from_a_state_yields_what_an_uninterrupted_run_yields(script, kind, num_workers,
                                                                     start):
    # A state after batch k (1; 6; 7: the 3-worker iterable's last worker has ended by then);
    # a new loader given it yields the rest of that pass and the next pass as an uninterrupted
    # run does. An IterableDataset with state_dict/load_state_dict goes on from each worker's
    # state (none of the first k batches' elements is made again); one without is replayed.
    _, r = script(RESUME, args=[kind, num_workers, start])
    assert r["batches"] == (7 if kind == "map" else 8 if num_workers == 3 else 7)
    for k in ("1", "6", "7"):
        assert (r[k]["first"], r[k]["rest"], r[k]["following"]) == (True, True, True), (k, r)
        if kind == "stateful":
            assert r[k]["remade_of_first"] == [], (k, r)
        elif kind == "replayed":
            assert r[k]["remade_of_first"] != [], (k, r)


def test_a_state_of_other_worker_count_is_refused_for_a_stateful_iterable(script):
    _, r = script(RESUME.replace("main(*sys.argv[1:])", """
a = forkguard.DataLoader(Stateful(), batch_size=4, num_workers=3)
it = iter(a)
next(it)
state = a.state_dict()
del it, a
try:
    forkguard.DataLoader(Stateful(), batch_size=4, num_workers=2).load_state_dict(state)
    result(error=None)
except ValueError as e:
    result(error=str(e))
"""))
    assert "states of 3 workers" in r["error"] and "num_workers=2" in r["error"], r


def test_a_replayed_iterables_state_needs_its_worker_count_and_a_state_is_checked(script):
    # An IterableDataset without state_dict() is replayed up to the state's batch: its batches
    # depend on the worker count (sharding by get_worker_info(), round-robin), so another count
    # would yield some elements twice and miss others: refused, as for a stateful one. A state
    # that is not one (a negative count, a batch past the pass) is refused, naming what is wrong.
    _, r = script(RESUME.replace("main(*sys.argv[1:])", """
def state_after(dataset, num_workers, k):
    kw = {"worker_start": "fork"} if num_workers else {}
    a = forkguard.DataLoader(dataset, batch_size=4, num_workers=num_workers, **kw)
    it = iter(a)
    for _ in range(k):
        next(it)
    state = a.state_dict()
    del it, a
    gc.collect()
    return state


def load(dataset, state, num_workers, **changes):
    try:
        loader = forkguard.DataLoader(dataset, batch_size=4, num_workers=num_workers)
        loader.load_state_dict(dict(state, **changes))
    except ValueError as e:
        return str(e)
    try:
        return [x for b in loader for x in b[:, 0].tolist()]
    except ValueError as e:
        return "while iterating: " + str(e)


two, none, mapped = state_after(Replayed(), 2, 3), state_after(Replayed(), 0, 3), \
    state_after(Noisy(), 0, 2)
got = {"2->3": load(Replayed(), two, 3), "2->0": load(Replayed(), two, 0),
       "0->2": load(Replayed(), none, 2), "2->2": load(Replayed(), two, 2),
       "yielded=-5": load(Replayed(), two, 2, yielded=-5),
       "yielded=1.5": load(Replayed(), two, 2, yielded=1.5),
       "epoch=None": load(Replayed(), two, 2, epoch=None),
       "rng": load(Replayed(), two, 2, rng=[1, 2]),
       "iterable yielded=50": load(Replayed(), two, 2, yielded=50),
       "map yielded=8": load(Noisy(), mapped, 0, yielded=8),
       "map yielded=7": load(Noisy(), mapped, 0, yielded=7)}
result(**got)
"""))
    refused = ("load_state_dict: the state was taken after 3 batches of an IterableDataset "
               "without state_dict()/load_state_dict(), which a resumed pass replays, with "
               "num_workers={} (its batches depend on the worker count), and this loader has "
               "num_workers={}: resume with as many workers")
    assert r["2->3"] == refused.format(2, 3), r
    assert r["2->0"] == refused.format(2, 0), r
    assert r["0->2"] == refused.format(0, 2), r
    # the same count resumes exactly: the first 3 batches were worker 0's 0 2 4 6 and 8 10 12
    # 14, worker 1's 1 3 5 7
    assert sorted(r["2->2"]) == [x for x in range(26) if x > 8 and not (x < 16 and x % 2 == 0)
                                 ], r
    assert r["yielded=-5"] == ("load_state_dict: yielded=-5: the count of batches the pass "
                               "yielded must be an int, 0 or more"), r
    assert r["yielded=1.5"] == ("load_state_dict: yielded=1.5: the count of batches the pass "
                                "yielded must be an int, 0 or more"), r
    assert r["epoch=None"] == "load_state_dict: epoch=None: the pass's number must be an int", r
    assert r["rng"] == ("load_state_dict: rng is a list, not a generator's state (a uint8 "
                        "tensor)"), r
    assert r["iterable yielded=50"] == (
        "while iterating: load_state_dict: the state was taken after 50 batches of the pass, "
        "and the IterableDataset, replayed, ended after 8: it does not yield what it yielded "
        "then"), r
    assert r["map yielded=8"] == ("load_state_dict: yielded=8: a pass of this loader has 7 "
                                  "batches"), r
    assert r["map yielded=7"] == [], r  # after the pass's last batch: nothing left of it


# --- 8. multiprocessing's objects in the dataset, spawn ranks ---------------------------------

SHARED = '''
import multiprocessing as mp


class Counted(Dataset):
    """What torch's own test_worker_seed relies on, as a user writes it: a counter every worker
    adds to (mp.Value with its lock), an Event the last worker to arrive sets while the others
    wait for it (so the workers share it as they run), a Queue each sample reports on."""
    def __init__(self, n, num_workers):
        self.n, self.num_workers = n, num_workers
        self.count = mp.Value("i", 0, lock=True)
        self.arrived = mp.Value("i", 0, lock=True)
        self.all_here = mp.Event()
        self.log = mp.Queue()
        self.wid = None  # set by init_fn in the worker's copy
        self.met = False

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not self.met:
            with self.arrived.get_lock():
                self.arrived.value += 1
                if self.arrived.value % self.num_workers == 0:
                    self.all_here.set()
            if not self.all_here.wait(60):
                raise RuntimeError(f"worker {self.wid} waited 60 s for the others")
            self.met = True
        with self.count.get_lock():
            self.count.value += 1
        self.log.put((i, self.wid, os.getpid()))
        return i


def init_fn(worker_id):
    info = get_worker_info()
    info.dataset.wid = (info.id, info.num_workers, info.seed == torch.initial_seed())


def main(start, persistent, private_shm):
    sems = lambda: {f for f in shm() if f.startswith("sem.")}
    before = sems()
    ds = Counted(16, 2)
    loader = forkguard.DataLoader(ds, batch_size=2, num_workers=2, worker_init_fn=init_fn,
                                  worker_start=start, persistent_workers=persistent == "1")
    epochs = [sorted(int(x) for b in loader for x in b) for _ in range(2)]
    del loader
    gc.collect()
    logged = [ds.log.get(timeout=60) for _ in range(32)]
    result(epochs=epochs, count=ds.count.value, arrived=ds.arrived.value,
           all_here=ds.all_here.is_set(), logged=sorted(i for i, _, _ in logged),
           wids=sorted({tuple(w) for _, w, _ in logged}),
           in_parent=sum(p == os.getpid() for _, _, p in logged), wid_here=ds.wid,
           sems_left=sorted(sems() - before) if private_shm == "1" else [])


main(*sys.argv[1:])
'''


@pytest.mark.parametrize("persistent", ["0", "1"])
def test_a_datasets_mp_value_event_and_queue_are_shared_with_server_workers(script, persistent):
    # A fork-context mp.Value (its memory travels as its fd), Event and Queue (their unnamed
    # semaphores as named twins the workers share, given back here once they stopped, then
    # unlinked; the Queue's pipe as its fds): the workers wait for each other on the Event, add
    # to the counter and report on the Queue, read here once they stopped, as forked ones share
    # them. (Forked workers are left out: one may exit before its Queue's feeder thread wrote
    # what it put, as the worker's loop holds the GIL between jobs and a forked worker does not
    # run multiprocessing's exit function; a fork-server worker does.)
    out, r = script(SHARED, args=["server", persistent, int(private_shm_allowed()[0])])
    assert r["epochs"] == [list(range(16))] * 2
    assert r["count"] == 32
    assert r["arrived"] == (2 if persistent == "1" else 4)
    assert r["all_here"] is True
    assert r["logged"] == sorted(list(range(16)) * 2)
    assert r["wids"] == [[0, 2, True], [1, 2, True]]
    assert r["in_parent"] == 0 and r["wid_here"] is None
    assert r["sems_left"] == []
    assert "leaked semaphore" not in out.stderr, out.stderr


SPAWN_RANKS = '''
import torch.multiprocessing


class DS(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return twice(i)


def twice(i):
    return torch.tensor([2 * i])


def add_one(batch):
    return torch.stack(batch) + 1


def rank_fn(rank, out):
    status = cuinit()  # the rank touches CUDA (its "auto" workers would still be forks)
    theirs = [b.flatten().tolist() for b in TorchDataLoader(DS(), batch_size=4, num_workers=2)]
    ours = [b.flatten().tolist() for b in forkguard.DataLoader(DS(), batch_size=4, num_workers=2,
                                                               worker_start="server")]
    collated = [b.flatten().tolist() for b in forkguard.DataLoader(
        DS(), batch_size=4, num_workers=2, collate_fn=add_one, worker_start="server")]
    auto = [b.flatten().tolist() for b in forkguard.DataLoader(DS(), batch_size=4, num_workers=2)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"cuinit": status, "theirs": theirs, "ours": ours, "collated": collated,
                   "auto": auto, "module": __name__}, f)


if __name__ == "__main__":
    torch.multiprocessing.spawn(rank_fn, args=(os.getcwd(),), nprocs=2)
    ranks = []
    for r in range(2):
        with open(f"rank{r}.json") as f:
            ranks.append(json.load(f))
    result(ranks=ranks)
'''


def test_torch_multiprocessing_spawn_ranks_send_their_scripts_classes_to_server_workers(script):
    # In a rank of torch.multiprocessing.spawn the script runs as module __mp_main__: its
    # Dataset class, the function it calls and a collate_fn travel by value, as __main__'s do.
    out, r = script(SPAWN_RANKS)
    for rank in r["ranks"]:
        assert rank["module"] == "__mp_main__" and rank["cuinit"] == 0
        assert rank["theirs"] == [[0, 2, 4, 6], [8, 10, 12, 14]]
        assert rank["ours"] == rank["theirs"]
        assert rank["collated"] == [[1, 3, 5, 7], [9, 11, 13, 15]]
        assert rank["auto"] == rank["theirs"]  # forked (nothing travels), as torch's
    assert "forkguard.DataLoader" not in out.stderr, out.stderr


THREADED_LOADERS = '''
import threading


def shared_sockets():
    """The sockets this worker holds that its loader's process holds too: a loader's end of some
    worker's socket (its own worker's end is another socket)."""
    def sockets(pid):
        out = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if target.startswith("socket:"):
                out.add(target)
        return out
    return len(sockets("self") & sockets(os.getppid()))


class Numbers(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.tensor([float(i), float(shared_sockets())])


def three_threads(make, passes=5):
    """Three loaders, each iterated from a thread of its own: every pass's time, the shared
    sockets the workers saw, errors."""
    times, shared, errors = [], [], []

    def run(loader):
        try:
            for _ in range(passes):
                t0 = time.monotonic()
                for b in loader:
                    shared.extend(int(n) for n in b[:, 1])
                times.append(time.monotonic() - t0)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(make(),)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"slowest": max(times, default=None), "shared": sum(shared), "errors": errors}


theirs = three_threads(lambda: TorchDataLoader(Numbers(), batch_size=4, num_workers=2))
ours = three_threads(lambda: forkguard.DataLoader(Numbers(), batch_size=4, num_workers=2,
                                                  worker_start=sys.argv[1]))
result(theirs=theirs, ours=ours, children=children(), torch=torch.__version__)
'''


@pytest.mark.parametrize("start", ["fork"])
def test_three_loaders_in_three_threads_pass_as_fast_as_torchs(script, start):
    # A worker one loader forked while another thread's loader had a socket the fork did not close
    # held that loader's end of its workers' sockets: those workers saw EOF only when it exited,
    # so the loader stopped them after the 2 s grace, by SIGKILL (2-4 s more at the end of a
    # pass; torch's: 0.13 s). The limit stays under that grace, generous to a loaded machine.
    _, r = script(THREADED_LOADERS, args=[start])
    theirs, ours = r["theirs"], r["ours"]
    assert theirs["errors"] == [] and ours["errors"] == [], (theirs, ours)
    assert ours["shared"] == 0, "forkguard's workers held a loader's end of another worker's socket"
    assert ours["slowest"] < max(1.5, 3 * theirs["slowest"]), (
        f"torch {r['torch']}: forkguard's slowest pass {ours['slowest']:.2f} s, "
        f"torch's {theirs['slowest']:.2f} s")
    assert r["children"] == []


SIGNALLED = '''
class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.full((2,), float(i))


def by_pid(pid, sig):
    raise AssertionError(f"os.kill({pid}, {sig}): a worker signalled by PID")


it = iter(forkguard.DataLoader(Slow(), batch_size=4, num_workers=2, worker_start=sys.argv[1]))
next(it)
a, b = it._workers
kill, os.kill = os.kill, by_pid
try:
    a.terminate()
    b.kill()
    a.join(30)
    b.join(30)
    codes = [a.exitcode, b.exitcode]
    # collected (reaped): their PIDs may be other processes' now, and nothing is sent
    a.kill()
    b.terminate()
    after = [a.exitcode, b.exitcode, a.is_alive(), b.is_alive()]
finally:
    os.kill = kill
try:
    for _ in it:
        pass
    error = None
except RuntimeError as e:
    error = str(e)
del it
wait_for(lambda: not workers())
result(codes=codes, after=after, error=error, workers=workers(), children=children())
'''


@pytest.mark.parametrize("start", STARTS)
def test_terminate_and_kill_of_a_worker_go_through_its_handle_and_report_15_and_9(script, start):
    # torch's iterator lists its workers as Processes: terminate()/kill() reach a worker through
    # its handle (its Child, or the pidfd the fork server opened before it could reap it), never
    # by PID (os.kill fails here), and once it was collected send nothing and raise nothing.
    # (A forked worker, a copy of this interpreter, catches SIGTERM and exits 0, by PID too.)
    term = -15 if start == "server" else 0
    _, r = script(SIGNALLED, args=[start])
    assert r["codes"] == [term, -9], r
    assert r["after"] == [term, -9, False, False], r
    assert r["error"] is not None and "DataLoader worker (pid" in r["error"], r
    assert r["workers"] == [] and r["children"] == []
