"""forkguard.DataLoader against torch.utils.data.DataLoader: the same Dataset objects, on the same
machine, in one run; medians over repeats. Every ratio is written so that > 1 means forkguard
is better (torch / forkguard for times and memory, forkguard / torch for rates).

1. First batch, 2 workers, a dataset from a module that imports torch and numpy: forkguard with
   worker_start="server" (the clean fork server already started; the cold figure, which includes
   starting it, is printed too) against torch with multiprocessing_context "spawn" and
   "forkserver" (what a parent that initialized CUDA must use). Target >= 10x both.
2. Transport: a preallocated 3x224x224 float32 tensor per sample, batch 64, 2 fork workers,
   persistent, 30 batches an epoch: images/s. Target >= 1.5x.
3. Small samples: 256-float vectors, batch 256, 2 fork workers, persistent: batches/s.
   Target >= 1.0x.
4. The standard image pipeline in a Python Dataset (PIL decode of JPEGs generated here, 500x375,
   torchvision RandomResizedCrop(224) + ToTensor + Normalize), batch 64, 2 fork workers,
   persistent: images/s (reported only).
5. Memory: a dataset holding a list of 2 million (path, label) tuples, 2 fork workers, persistent,
   3 epochs of random samples: the sum of Pss (/proc/PID/smaps_rollup) of this process and the
   workers at the end of each epoch, and the same without file-backed pages (Pss_Anon +
   Pss_Shmem), which the kernel may drop at any time. Target <= torch's.

6-9 (A-D, issue 34): after torch.cuda.is_available() in this process (on torch 2.x's CUDA build
it sets torch's fork poison, GPU or not; see NOTE [after is_available()]), torch's DataLoader
with its default fork start against forkguard.DataLoader with its default worker_start="auto",
same dataset object, alternating. For each: the first batch (build + iter + next), each epoch
(iter() to the end), the Pss (smaps_rollup) of this process + the workers at the first batch and
once every worker delivered one, and how much MemAvailable (/proc/meminfo) dropped from before
the build to the first batch; ratios forkguard / torch (< 1: forkguard better). They run after
1-5, which the call would change.
6. A. big list: 2 million (path, label) tuples, 4 workers, persistent, batch 64, 200 random
   batches an epoch, 2 epochs.
7. B. CIFAR-style preloaded: a 400 MB numpy uint8 array of 32x32x3 images and a 200 MB uint8
   torch tensor, 4 workers, batch 128, 100 batches an epoch spread over the arrays, not
   persistent, 2 epochs.
8. C. torchvision FakeData (512, 3x64x64) through transforms.v2 (ToImage, ToDtype float scaled,
   RandomResizedCrop(32)), 4 workers, batch 32, not persistent, 2 epochs. Skipped without
   torchvision; transforms v1 where v2 is missing.
9. D. unpicklable: a sqlite3.Connection, an open file and a threading.Lock in the dataset,
   2 workers, batch 64, not persistent, 2 epochs; every item checked. A loader that raises is
   printed FAILED with its error, and the bench goes on.
--quick: A 200,000 tuples and 50 batches, B a quarter of the arrays and 25 batches, C 128
images, D 1024 rows.

    PYTHONPATH=build/release/python /usr/bin/python3 python/bench/dataloader_vs_torch.py \
        [--quick] [--only 1,3] [--repeats N]
    PYTHONPATH=build/release/python build/torch-2.14/bin/python \
        python/bench/dataloader_vs_torch.py --only A,B,C,D   # the same as --only 6,7,8,9

The datasets live in a module written to a temporary directory put on sys.path, so that spawn,
forkserver and fork server workers import it by name.
"""
# The top level is what spawn and forkserver children import again as __mp_main__: nothing but
# the standard library; torch and forkguard are imported in main().
import os
import sys
import time

DATASETS_MODULE = "fg_bench_datasets"
DATASETS_SOURCE = '''\
"""forkguard's dataloader_vs_torch bench: the datasets (written by the bench, imported by name)."""
import os

import numpy as np
import torch
from torch.utils.data import Dataset


class TinyDataset(Dataset):
    """1: what a first batch costs beyond starting the workers."""

    def __init__(self, n=1024):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.from_numpy(np.full(16, i, dtype=np.float32)), i


class FixedImageDataset(Dataset):
    """2: one preallocated 3x224x224 float32 image for every sample (the loader's transport)."""

    def __init__(self, n):
        self.n = n
        self.image = torch.rand(3, 224, 224)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.image


class VectorDataset(Dataset):
    """3: 256-float vectors (rows of one tensor)."""

    def __init__(self, n, dim=256):
        self.data = torch.rand(n, dim)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i]


class JpegDataset(Dataset):
    """4: PIL decode + RandomResizedCrop(224) + ToTensor + Normalize, `n` samples over `files`."""

    def __init__(self, files, n):
        from torchvision import transforms as T

        self.files, self.n = list(files), n
        self.transform = T.Compose([T.RandomResizedCrop(224), T.ToTensor(),
                                    T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        from PIL import Image

        with Image.open(self.files[i % len(self.files)]) as im:
            return self.transform(im.convert("RGB")), i % 1000


class ObjectListDataset(Dataset):
    """5: a list of `n` (path, label) tuples, as a file-list dataset holds them."""

    def __init__(self, n):
        self.items = [(f"/data/train/n{i % 1000:08d}/img_{i:08d}.JPEG", i % 1000)
                      for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        path, label = self.items[i]
        return label, len(path)


class PreloadedDataset(Dataset):
    """7: CIFAR-style, everything in memory: `n` 32x32x3 uint8 images in one numpy array and
    `n` rows of `features` uint8 in one torch tensor."""

    def __init__(self, n, features):
        rng = np.random.default_rng(0)
        self.images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        self.features = torch.randint(0, 256, (n, features), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        image = torch.from_numpy(self.images[i]).permute(2, 0, 1).float().div_(255)
        return image, self.features[i], i


def fake_images(n):
    """8: torchvision's FakeData (PIL images made per item) through transforms.v2 (ToImage,
    ToDtype float scaled, RandomResizedCrop(32)); transforms v1 where v2 is missing (torchvision
    < 0.15). Returns (dataset, the transforms' description)."""
    import torchvision
    try:
        from torchvision.transforms import v2 as T
        transform = T.Compose([T.ToImage(), T.ToDtype(torch.float32, scale=True),
                               T.RandomResizedCrop(32, antialias=True)])
        what = "transforms.v2: ToImage, ToDtype(float32, scale=True), RandomResizedCrop(32)"
    except ImportError:
        from torchvision import transforms as T
        transform = T.Compose([T.ToTensor(), T.RandomResizedCrop(32)])
        what = "transforms (no v2 in this torchvision): ToTensor, RandomResizedCrop(32)"
    ds = torchvision.datasets.FakeData(size=n, image_size=(3, 64, 64), num_classes=10,
                                       transform=transform, random_offset=0)
    return ds, what


class UnpicklableDataset(Dataset):
    """9: what pickle refuses: a sqlite3.Connection (an in-memory database of `n` rows), an open
    file (`n` 16-byte lines, read with pread: forked workers share its offset) and a
    threading.Lock. Item i is (i, 7 * i % 1000 from the database, 3 * i from the file)."""

    def __init__(self, n, path):
        import sqlite3
        import threading

        with open(path, "w") as f:
            f.writelines(f"{3 * i:15d}\\n" for i in range(n))
        self.n = n
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, value INTEGER)")
        self.db.executemany("INSERT INTO t VALUES (?, ?)", ((i, 7 * i % 1000) for i in range(n)))
        self.db.commit()
        self.file = open(path, "rb")
        self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.lock:
            (value,) = self.db.execute("SELECT value FROM t WHERE id = ?", (i,)).fetchone()
        line = os.pread(self.file.fileno(), 16, 16 * i)
        return i, value, int(line)
'''

# (scenario, what, torch figure, forkguard figure, ratio, target text, met or None, CPU ratio)
RESULTS = []


def say(text=""):
    print(text, flush=True)


def median(values):
    import statistics

    return statistics.median(values)


def fmt_list(values, scale=1.0, digits=1):
    return "[" + ", ".join(f"{v * scale:.{digits}f}" for v in values) + "]"


def record(scenario, what, torch_fig, fg_fig, ratio, target=None, met=None, cpu_ratio=None):
    RESULTS.append((scenario, what, torch_fig, fg_fig, ratio, target, met, cpu_ratio))


def write_datasets_module():
    import tempfile

    d = tempfile.mkdtemp(prefix="fg-bench-datasets-")
    with open(os.path.join(d, DATASETS_MODULE + ".py"), "w") as f:
        f.write(DATASETS_SOURCE)
    sys.path.insert(0, d)
    return d


# ------------------------------------------------------------------ 1: first batch
def first_batch_seconds(make):
    """Seconds from building the loader to holding its first batch; the workers are then
    stopped (not timed)."""
    t0 = time.perf_counter()
    loader = make()
    it = iter(loader)
    next(it)
    seconds = time.perf_counter() - t0
    it._shutdown_workers()
    del it, loader
    return seconds


def scenario_first_batch(a):
    import torch

    import forkguard
    from fg_bench_datasets import TinyDataset

    ds = TinyDataset()
    kw = dict(batch_size=32, num_workers=2)

    def fg():
        return forkguard.DataLoader(ds, worker_start="server", **kw)

    def torch_ctx(ctx):
        return lambda: torch.utils.data.DataLoader(ds, multiprocessing_context=ctx, **kw)

    say("## 1. first batch, 2 workers, dataset module importing torch and numpy "
        "(build + iter + next)")
    forkguard.stop_server()
    t0 = time.perf_counter()
    forkguard.start_server(wait=True)
    server_start = time.perf_counter() - t0
    cold_batch = first_batch_seconds(fg)
    say(f"forkguard server, cold: {server_start + cold_batch:.3f} s "
        f"(start_server(wait=True) {server_start:.3f} s + first batch {cold_batch:.3f} s)")
    fs_cold = first_batch_seconds(torch_ctx("forkserver"))
    say(f"torch forkserver, cold (multiprocessing's forkserver starts): {fs_cold:.3f} s")
    times = {"fg": [], "spawn": [], "forkserver": []}
    for _ in range(a.repeats):  # interleaved: the machine's drift falls on all alike
        for _ in range(3):
            times["fg"].append(first_batch_seconds(fg))
        times["spawn"].append(first_batch_seconds(torch_ctx("spawn")))
        times["forkserver"].append(first_batch_seconds(torch_ctx("forkserver")))
    fg_s = median(times["fg"])
    say(f"forkguard, worker_start='server' (server warm): median {fg_s * 1e3:.1f} ms of "
        f"{len(times['fg'])} {fmt_list(times['fg'], 1e3, 0)} ms")
    for ctx in ("spawn", "forkserver"):
        s = median(times[ctx])
        say(f"torch, multiprocessing_context={ctx!r}: median {s * 1e3:.1f} ms of "
            f"{len(times[ctx])} {fmt_list(times[ctx], 1e3, 0)} ms -> torch / forkguard "
            f"{s / fg_s:.1f}x (target >= 10x)")
        record(1, f"first batch vs {ctx}", f"{s * 1e3:.0f} ms", f"{fg_s * 1e3:.0f} ms",
               s / fg_s, ">= 10x", s / fg_s >= 10)
    cold = server_start + cold_batch
    record(1, "first batch, cold (server start included) vs spawn",
           f"{median(times['spawn']) * 1e3:.0f} ms", f"{cold * 1e3:.0f} ms",
           median(times["spawn"]) / cold)
    forkguard.stop_server()


# ------------------------------------------------------------------ 2-4: throughput
def cpu_seconds(pids):
    """User + system CPU seconds of the processes (all their threads), from /proc/PID/stat."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def epoch_seconds(loader):
    """(wall seconds, CPU seconds of this process and the workers, samples) for one whole epoch,
    iter() included. The loader is persistent and already ran an epoch, so its workers exist."""
    pids = [os.getpid()] + [w.pid for w in loader._iterator._workers]
    c0 = cpu_seconds(pids)
    t0 = time.perf_counter()
    n = 0
    for batch in loader:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        n += len(x)
    wall = time.perf_counter() - t0
    return wall, cpu_seconds(pids) - c0, n


def compare_rates(scenario, title, make_torch, make_fg, unit, per_epoch, a, target=None):
    """Both loaders persistent, one warm-up epoch each, then measured epochs alternating. Beside
    the rate, the CPU time (main + workers) per batch: what the rate would be on idle cores,
    and steadier than wall time on a shared machine."""
    say(f"## {scenario}. {title}")
    loaders = {"torch": make_torch(), "forkguard": make_fg()}
    for loader in loaders.values():
        for _ in loader:  # warm-up: the workers start, slots and caches fill
            pass
    rates = {"torch": [], "forkguard": []}
    cpu = {"torch": [], "forkguard": []}
    batch_size = None
    for _ in range(a.repeats):
        for name, loader in loaders.items():
            wall, used, n = epoch_seconds(loader)
            batch_size = loader.batch_size
            rates[name].append(per_epoch(n) / wall)
            cpu[name].append(used / (n / batch_size))
    for name in loaders:
        say(f"{name:10s} median {median(rates[name]):9.1f} {unit} of {len(rates[name])} epochs "
            f"{fmt_list(rates[name])}; CPU per batch (main + workers) median "
            f"{median(cpu[name]) * 1e3:.1f} ms {fmt_list(cpu[name], 1e3)}")
    t, f = median(rates["torch"]), median(rates["forkguard"])
    ratio = f / t
    cpu_ratio = median(cpu["torch"]) / median(cpu["forkguard"])
    say(f"forkguard / torch: {ratio:.2f}x" + (f" (target {target})" if target else "") +
        f"; CPU per batch torch / forkguard: {cpu_ratio:.2f}x")
    met = ratio >= float(target.split()[-1].rstrip("x")) if target else None
    record(scenario, title.split(":")[0], f"{t:.1f} {unit}", f"{f:.1f} {unit}", ratio, target, met,
           cpu_ratio)
    for loader in loaders.values():
        loader._iterator._shutdown_workers()
    del loaders


def scenario_transport(a):
    import torch

    import forkguard
    from fg_bench_datasets import FixedImageDataset

    batches = 10 if a.quick else 30
    ds = FixedImageDataset(64 * batches)
    kw = dict(batch_size=64, num_workers=2, persistent_workers=True)
    compare_rates(
        2, f"transport: 3x224x224 float32 samples, batch 64, 2 fork workers, {batches} batches "
           "an epoch",
        lambda: torch.utils.data.DataLoader(ds, multiprocessing_context="fork", **kw),
        lambda: forkguard.DataLoader(ds, worker_start="fork", **kw),
        "images/s", lambda n: n, a, ">= 1.5x")


def scenario_small(a):
    import torch

    import forkguard
    from fg_bench_datasets import VectorDataset

    batches = 40 if a.quick else 200
    ds = VectorDataset(256 * batches)
    kw = dict(batch_size=256, num_workers=2, persistent_workers=True)
    compare_rates(
        3, f"small samples: 256-float vectors, batch 256, 2 fork workers, {batches} batches an "
           "epoch",
        lambda: torch.utils.data.DataLoader(ds, multiprocessing_context="fork", **kw),
        lambda: forkguard.DataLoader(ds, worker_start="fork", **kw),
        "batches/s", lambda n: n / 256, a, ">= 1.0x")


def make_jpegs(directory, count):
    """`count` 500x375 JPEGs (quality 90) with some structure, so that they decode like photos."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:375, 0:500].astype(np.float32)
    files = []
    for k in range(count):
        fx, fy, phase = rng.uniform(0.005, 0.05, 2).tolist() + [rng.uniform(0, 6.28)]
        base = np.stack([np.sin(x * fx + phase), np.cos(y * fy - phase),
                         np.sin((x + y) * (fx + fy) / 2)], axis=-1)
        noise = rng.normal(0, 0.15, (375, 500, 3))
        pixels = ((base + noise) * 0.5 + 0.5).clip(0, 1) * 255
        path = os.path.join(directory, f"img_{k:04d}.jpg")
        Image.fromarray(pixels.astype(np.uint8)).save(path, quality=90)
        files.append(path)
    return files


def scenario_images(a):
    import tempfile

    import torch

    import forkguard
    from fg_bench_datasets import JpegDataset

    count = 64 if a.quick else 256
    directory = tempfile.mkdtemp(prefix="fg-bench-jpegs-")
    t0 = time.perf_counter()
    files = make_jpegs(directory, count)
    say(f"(generated {count} JPEGs 500x375 in {directory}, {time.perf_counter() - t0:.1f} s)")
    ds = JpegDataset(files, count)
    kw = dict(batch_size=64, num_workers=2, persistent_workers=True)
    compare_rates(
        4, f"image pipeline: PIL decode + RandomResizedCrop(224) + ToTensor + Normalize, "
           f"batch 64, 2 fork workers, {count} samples an epoch",
        lambda: torch.utils.data.DataLoader(ds, multiprocessing_context="fork", **kw),
        lambda: forkguard.DataLoader(ds, worker_start="fork", **kw),
        "images/s", lambda n: n, a)
    for f in files:
        os.unlink(f)
    os.rmdir(directory)


# ------------------------------------------------------------------ 5: memory
def pss_kb(pid):
    """(Pss, Pss_Anon + Pss_Shmem) of the process in kB, from /proc/PID/smaps_rollup. The
    second leaves out file-backed pages (the libraries' text), which the kernel may drop and
    read again at its own pace (this VM runs DAMON's pageout), so it is the steadier figure."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Pss_Shmem"):
                fields[key] = int(rest.split()[0])
    return fields["Pss"], fields.get("Pss_Anon", 0) + fields.get("Pss_Shmem", 0)


def epochs_pss(loader, epochs):
    """[(main, workers)] at the end of each epoch (the workers kept alive), each a pss_kb pair."""
    out = []
    it = iter(loader)
    for epoch in range(epochs):
        if epoch:
            it = iter(loader)  # persistent: the same iterator, reset
        for _ in it:
            pass
        workers = [pss_kb(w.pid) for w in it._workers]
        out.append((pss_kb(os.getpid()), tuple(map(sum, zip(*workers)))))
    it._shutdown_workers()
    return out


def scenario_memory(a):
    import gc

    import torch

    import forkguard
    from fg_bench_datasets import ObjectListDataset

    n = 200_000 if a.quick else 2_000_000
    samples = 8192 if a.quick else 65536
    say(f"## 5. memory: a list of {n} (path, label) tuples, 2 fork workers, persistent, "
        f"{samples} random samples an epoch, batch 256, 3 epochs: Pss of main + workers")
    t0 = time.perf_counter()
    ds = ObjectListDataset(n)
    gc.collect()
    pss, anon = pss_kb(os.getpid())
    say(f"(dataset built in {time.perf_counter() - t0:.1f} s; this process's Pss now "
        f"{pss / 1024:.1f} MB, anon + shmem {anon / 1024:.1f} MB)")

    def loader(cls, **extra):
        sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=samples,
                                                 generator=torch.Generator().manual_seed(0))
        return cls(ds, batch_size=256, sampler=sampler, num_workers=2, persistent_workers=True,
                   **extra)

    # torch first: forkguard's fork start calls gc.freeze() in this process, which its
    # children (and torch's, if they came after) would inherit.
    result = {}
    for name, make in (("torch", lambda: loader(torch.utils.data.DataLoader,
                                                multiprocessing_context="fork")),
                       ("forkguard", lambda: loader(forkguard.DataLoader, worker_start="fork"))):
        gc.collect()
        result[name] = epochs_pss(make(), 3)
        for k, what in ((0, "Pss"), (1, "Pss anon + shmem")):
            say(f"{name:10s} {what} main + workers at each epoch's end (MB): " + ", ".join(
                f"{(m[k] + w[k]) / 1024:.1f} ({m[k] / 1024:.1f} + {w[k] / 1024:.1f})"
                for m, w in result[name]))
    for k, what in ((0, "Pss"), (1, "Pss anon + shmem")):
        t = (result["torch"][-1][0][k] + result["torch"][-1][1][k]) / 1024
        f = (result["forkguard"][-1][0][k] + result["forkguard"][-1][1][k]) / 1024
        say(f"{what} after 3 epochs: torch {t:.1f} MB, forkguard {f:.1f} MB: torch / forkguard "
            f"{t / f:.2f}x (target: forkguard <= torch)")
        record(5, f"{what}, main + 2 workers, after 3 epochs", f"{t:.1f} MB", f"{f:.1f} MB",
               t / f, "<= torch", f <= t)


# ------------------------------------------------------------------ 6-9: after is_available()
# NOTE [after is_available()]: on a CUDA build of torch 2.x, torch.cuda.is_available() counts
# the devices through the runtime, which registers torch's at-fork "poison" handler (with or
# without a GPU): a forked child that touches CUDA then raises "Cannot re-initialize CUDA in
# forked subprocess". torch's own DataLoader still forks its workers (they do not touch CUDA);
# forkguard.DataLoader's worker_start="auto" decides from this process's state. Scenarios 6-9
# put both loaders after that call, on the same dataset object, and compare what a user sees:
# the first batch, the epochs, the memory. The call cannot be undone, hence 6-9 run last.
RUN_MARKER = "FG_BENCH_DL_RUN"


def cuda_state():
    """What torch.cuda.is_available() returned, torch's CUDA version, and whether a fork of
    this process is poisoned (a child asks torch.cuda._is_in_bad_fork())."""
    import warnings

    import torch

    available = torch.cuda.is_available()
    with warnings.catch_warnings():  # Python 3.12's "fork() of a multi-threaded process"
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(3 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    poisoned = os.waitstatus_to_exitcode(status) == 3
    return (f"torch.cuda.is_available() = {available}, torch.version.cuda = "
            f"{torch.version.cuda}, a fork of this process is {'' if poisoned else 'not '}"
            "in torch's bad fork")


def descendants(pid):
    """PIDs of the processes under `pid` (children of any of its threads, recursively)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def marked_fg_workers():
    """PIDs of live fg-dl-worker processes started for this run wherever their parent is: their
    environment (as their interpreter was executed: the fork server's) holds RUN_MARKER."""
    marker = f"{RUN_MARKER}={os.environ[RUN_MARKER]}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("fg-dl-worker"):
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker not in f.read().split(b"\0"):
                    continue
        except OSError:
            continue
        found.append(int(pid))
    return found


def run_processes():
    """{pid: comm} of this run's processes beside this one: its descendants (torch's workers,
    forkguard's forked workers, the fork server and its workers) and marked fg-dl-workers."""
    out = {}
    for pid in set(descendants(os.getpid())) | set(marked_fg_workers()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()[0]
        if state != "Z":
            out[pid] = name
    return out


def pss_or_zero(pid):
    try:
        return pss_kb(pid)
    except (OSError, KeyError):  # gone meanwhile
        return 0, 0


def mem_available_kb():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def wait_workers_gone(pids, timeout=30.0):
    """Waits (on each process's pidfd) until the processes exited, at most `timeout` seconds in
    all; returns those still alive."""
    import select

    deadline = time.monotonic() + timeout
    alive = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already
            continue
        try:
            p = select.poll()
            p.register(fd, select.POLLIN)
            if not p.poll(max(0, deadline - time.monotonic()) * 1e3):
                alive.append(pid)
        finally:
            os.close(fd)
    return alive


def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def memory_sample(workers):
    """(main + workers Pss kB, main Pss kB, workers Pss kB, others: {name: Pss kB}) now. The
    workers' own parent where it is not this process (forkguard's clean workers: the loader's own
    fork server, which holds the dataset they share) counts with them; the others are this run's
    other processes (the interpreter fork server, the C++ zygote, a leftover worker), which both
    columns have or which no loader owns."""
    main = pss_or_zero(os.getpid())[0]
    owners = {parent_of(pid) for pid in workers} - {os.getpid(), None}
    counted = set(workers) | owners
    w = sum(pss_or_zero(pid)[0] for pid in counted)
    others = {}
    for pid, name in run_processes().items():
        if pid not in counted:
            others[f"{name}[{pid}]"] = pss_or_zero(pid)[0]
    return main + w, main, w, others


def started_by(workers, why):
    """How the workers started: forked from this process or children of another (the fork
    server), and forkguard's reason (its iterator's _why) where it gives one."""
    parents = set()
    for pid in workers:
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{ppid}/comm") as f:
                parents.add("this process" if ppid == os.getpid() else
                            f"{f.read().strip()} (PID {ppid})")
        except OSError:
            continue
    return (f"children of {', '.join(sorted(parents)) or '?'}" +
            (f"; forkguard says: {why}" if why else ""))


def measure_loader(make, epochs, check, persistent):
    """One loader from `make()`, in this process after is_available(): a dict of
    first (s: build + iter + next), epochs ([s] each, iter() to exhaustion; the first includes
    the first batch), pss_first and pss_all (memory_sample after the first batch and once every
    worker delivered one), avail_drop (kB of MemAvailable from before make() to after the first
    batch), why (forkguard's start and its reason), batches ([n] per epoch). `check(batch)` raises
    if a batch is wrong. The workers are stopped and waited for before it returns."""
    import gc

    gc.collect()
    avail0 = mem_available_kb()
    out = {"epochs": [], "batches": []}
    workers = set()
    loader = it = None
    try:
        t0 = time.perf_counter()
        loader = make()
        it = iter(loader)
        batch = next(it)
        out["first"] = time.perf_counter() - t0
        out["avail_drop"] = avail0 - mem_available_kb()
        workers = {w.pid for w in it._workers}
        out["pss_first"] = memory_sample(workers)
        out["why"] = started_by(workers, getattr(it, "_why", ""))
        check(batch)
        n = 1
        for batch in it:
            check(batch)
            n += 1
            if n == len(workers):
                out["pss_all"] = memory_sample(workers)
        out["pss_all"] = out.get("pss_all", out["pss_first"])
        out["epochs"].append(time.perf_counter() - t0)
        out["batches"].append(n)
        for _ in range(1, epochs):
            t0 = time.perf_counter()
            it = iter(loader)  # persistent: the same workers, reset; otherwise new ones
            workers |= {w.pid for w in it._workers}
            n = 0
            for batch in it:
                check(batch)
                n += 1
            out["epochs"].append(time.perf_counter() - t0)
            out["batches"].append(n)
    finally:
        if it is not None:
            workers |= {w.pid for w in getattr(it, "_workers", [])}
            if hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()  # persistent ones, or a pass cut short
        del it, loader
        gc.collect()
        # forkguard's workers wherever they were started (a fork server's are not in _workers
        # if iter() failed half-way); the fork server itself stays
        workers |= {pid for pid, name in run_processes().items()
                    if name.startswith("fg-dl-worker")}
        left = wait_workers_gone(sorted(workers))
        if left:
            say(f"  !! still alive 30 s after the loader stopped: {left}")
    return out


def compare_after_cuda(scenario, title, ds, kw, epochs, check, a):
    """torch's DataLoader (fork, its default here) and forkguard.DataLoader (worker_start
    "auto") on `ds` with the same `kw`, alternating, `a.repeats` times each; prints a table of
    medians and records the ratios."""
    import torch

    import forkguard

    persistent = kw.get("persistent_workers", False)
    say(f"## {scenario}. {title}")
    override = os.environ.get("FORKGUARD_WORKER_START")
    say(f"({cuda_state()}" + (f"; FORKGUARD_WORKER_START={override}" if override else "") + ")")
    forkguard.stop_server()  # each scenario's first forkguard loader finds none (as a user's)
    makers = {"torch": lambda: torch.utils.data.DataLoader(ds, **kw),
              "forkguard": lambda: forkguard.DataLoader(ds, **kw)}
    runs = {"torch": [], "forkguard": []}
    failed = {}
    for _ in range(a.repeats):
        for name, make in makers.items():
            if name in failed:
                continue
            try:
                runs[name].append(measure_loader(make, epochs, check, persistent))
            except Exception as e:  # noqa: BLE001 (printed below, the bench goes on)
                failed[name] = f"{type(e).__name__}: {e}"
    for name in runs:
        for r in runs[name]:
            if r.get("why"):
                say(f"{name}: the workers are {r['why']}")
                break
    rows = [("figure (medians; each run in [])", "torch", "forkguard",
             "forkguard / torch (< 1: forkguard better)")]

    def row(what, get, unit, scale, digits, summary=None, floor=0):
        cells, meds = [], {}
        for name in ("torch", "forkguard"):
            if name in failed and not runs[name]:
                cells.append("FAILED")
                continue
            values = [get(r) for r in runs[name]]
            meds[name] = median(values)
            cells.append(f"{meds[name] * scale:.{digits}f} {unit} "
                         f"{fmt_list(values, scale, digits)}")
        ratio = meds["forkguard"] / meds["torch"] if len(meds) == 2 and meds["torch"] else None
        if ratio is not None and max(meds.values()) < floor:
            ratio = None
            cells.append(f"- (both under {floor * scale:.0f} {unit}: noise)")
        rows.append((what, *cells[:2], cells[2] if len(cells) > 2 else
                     "-" if ratio is None else f"{ratio:.2f}x"))
        if summary and ratio:
            record(scenario, summary, f"{meds['torch'] * scale:.{digits}f} {unit}",
                   f"{meds['forkguard'] * scale:.{digits}f} {unit}", 1 / ratio)

    row("first batch (build + iter + next)", lambda r: r["first"], "ms", 1e3, 0,
        "first batch after is_available()")
    for e in range(epochs):
        what = "epoch 1 (iter() to the end; start included)" if e == 0 else (
            f"epoch {e + 1} ({'the same workers' if persistent else 'new iter(): new workers'})")
        row(what, lambda r, e=e: r["epochs"][e], "s", 1, 2, f"epoch {e + 1}")
    nw = kw["num_workers"]
    row(f"Pss main + {nw} workers (+ their fork server) at the first batch",
        lambda r: r["pss_first"][0], "MB", 1 / 1024, 0, "Pss main + workers, first batch")
    row(f"  of which the {nw} workers", lambda r: r["pss_first"][2], "MB", 1 / 1024, 0)
    row("Pss main + workers once each delivered a batch", lambda r: r["pss_all"][0], "MB",
        1 / 1024, 0)
    # MemAvailable is the whole machine's: the page cache and other processes move it by tens of
    # MB between two readings, so a ratio of two small drops says nothing.
    row("MemAvailable drop, before build to first batch", lambda r: r["avail_drop"], "MB",
        1 / 1024, 0, "MemAvailable drop to first batch", floor=64 * 1024)
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    for r in rows:
        say("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for name in runs:
        others = [r["pss_first"][3] for r in runs[name] if r["pss_first"][3]]
        if others:
            say(f"{name}: other processes of this run at the first batch (Pss MB, not in the "
                "sums above): " + "; ".join(", ".join(f"{k} {v / 1024:.0f}" for k, v in o.items())
                                            for o in others))
        if runs[name]:
            done = {tuple(r["batches"]) for r in runs[name]}
            say(f"{name}: batches per epoch {sorted(done)}, every batch checked")
    for name, text in failed.items():
        say(f"{name} FAILED: {text}")
        record(scenario, f"{name} FAILED", "", "", float("nan"))


def scenario_big_list(a):
    import torch

    from fg_bench_datasets import ObjectListDataset

    n = 200_000 if a.quick else 2_000_000
    batches = 50 if a.quick else 200
    t0 = time.perf_counter()
    ds = ObjectListDataset(n)
    say(f"(the dataset: {n} (path, label) tuples, built in {time.perf_counter() - t0:.1f} s)")
    sampler = torch.utils.data.RandomSampler(ds, replacement=True, num_samples=64 * batches,
                                             generator=torch.Generator().manual_seed(0))

    def check(batch):
        labels, lengths = batch
        assert len(labels) == 64 and bool((lengths == 39).all()), batch

    compare_after_cuda(
        6, f"A. big list: {n} (path, label) tuples, 4 workers, persistent, batch 64, {batches} "
           "random batches an epoch", ds,
        dict(batch_size=64, sampler=sampler, num_workers=4, persistent_workers=True), 2, check, a)


def scenario_preloaded(a):
    from fg_bench_datasets import PreloadedDataset

    n = 32_500 if a.quick else 130_000  # 32x32x3 uint8: 400 MB (100 MB quick) in numpy
    features = 1536  # uint8 per row: 200 MB (50 MB quick) in torch
    batches = 25 if a.quick else 100
    t0 = time.perf_counter()
    ds = PreloadedDataset(n, features)
    say(f"(the dataset: numpy {tuple(ds.images.shape)} uint8 {ds.images.nbytes / 2**20:.0f} MB + "
        f"torch {tuple(ds.features.shape)} uint8 "
        f"{ds.features.numel() / 2**20:.0f} MB, built in {time.perf_counter() - t0:.1f} s)")
    indices = list(range(0, n, n // (128 * batches)))[:128 * batches]  # spread over the arrays

    def check(batch):
        image, feature, index = batch
        assert image.shape == (128, 3, 32, 32) and feature.shape == (128, features), batch
        assert bool((feature[0] == ds.features[int(index[0])]).all())

    compare_after_cuda(
        7, f"B. CIFAR-style preloaded: numpy {ds.images.nbytes / 2**20:.0f} MB + torch "
           f"{ds.features.numel() / 2**20:.0f} MB, 4 workers, batch 128, {batches} batches an "
           "epoch (a sampler over the whole array), not persistent", ds,
        dict(batch_size=128, sampler=indices, num_workers=4), 2, check, a)


def scenario_torchvision(a):
    try:
        import torchvision  # noqa: F401
    except ImportError as e:
        say(f"## 8. C. torchvision: skipped, torchvision is not importable ({e})")
        return
    from fg_bench_datasets import fake_images

    n = 128 if a.quick else 512
    ds, what = fake_images(n)

    def check(batch):
        images, labels = batch
        assert images.shape[1:] == (3, 32, 32) and images.dtype.is_floating_point, images.shape

    compare_after_cuda(
        8, f"C. torchvision {torchvision.__version__}: FakeData({n}, 3x64x64), {what}, 4 workers, "
           "batch 32, not persistent", ds, dict(batch_size=32, num_workers=4), 2, check, a)


def scenario_unpicklable(a):
    import tempfile

    from fg_bench_datasets import UnpicklableDataset

    n = 1024 if a.quick else 4096
    fd, path = tempfile.mkstemp(prefix="fg-bench-lines-")
    os.close(fd)
    ds = UnpicklableDataset(n, path)

    def check(batch):
        index, value, tripled = batch
        assert bool((value == 7 * index % 1000).all()) and bool((tripled == 3 * index).all())

    try:
        compare_after_cuda(
            9, f"D. unpicklable: a sqlite3.Connection ({n} rows in memory), an open file, a "
               "threading.Lock; 2 workers, batch 64, not persistent", ds,
            dict(batch_size=64, num_workers=2), 2, check, a)
    finally:
        ds.file.close()
        os.unlink(path)


# ------------------------------------------------------------------ main
SCENARIOS = {1: scenario_first_batch, 2: scenario_transport, 3: scenario_small,
             4: scenario_images, 5: scenario_memory, 6: scenario_big_list,
             7: scenario_preloaded, 8: scenario_torchvision, 9: scenario_unpicklable}
AFTER_CUDA = "ABCD"  # --only's names for 6-9, as issue 34's table names them


def scenario_number(text):
    text = text.strip()
    if text.upper() in AFTER_CUDA:
        return 6 + AFTER_CUDA.index(text.upper())
    return int(text)


def main():
    import argparse
    import datetime
    import platform
    import shutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one repeat and smaller epochs (a smoke test)")
    ap.add_argument("--only", default="",
                    help="comma-separated scenario numbers (1-9; A-D are 6-9), default all")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measured rounds per scenario (default 3, 1 with --quick)")
    a = ap.parse_args()
    a.repeats = a.repeats or (1 if a.quick else 3)
    # 6-9 run 4 workers on whatever cores there are: torch's advice about it is not news.
    import warnings

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    try:
        only = sorted({scenario_number(s) for s in a.only.split(",") if s.strip()})
    except ValueError:
        ap.error(f"--only: {a.only!r} is not a list of 1-9 or A-D")
    only = only or sorted(SCENARIOS)
    bad = [s for s in only if s not in SCENARIOS]
    if bad:
        ap.error(f"--only: no scenario {bad}")

    # Before anything starts: what forkguard's fork server executes carries it (6-9 find their
    # workers by it).
    os.environ[RUN_MARKER] = f"{os.getpid()}-{time.time_ns()}"
    import torch

    import forkguard

    torch.set_num_threads(1)  # the main loop's own work: torch's workers run one thread too
    datasets_dir = write_datasets_module()
    say(f"# forkguard.DataLoader vs torch.utils.data.DataLoader, "
        f"{datetime.datetime.now().isoformat(timespec='seconds')}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, torch {torch.__version__}, forkguard "
        f"{forkguard.__version__}, repeats {a.repeats}{', quick' if a.quick else ''}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    t_all = time.perf_counter()
    for s in only:
        t0 = time.perf_counter()
        SCENARIOS[s](a)
        say(f"({time.perf_counter() - t0:.1f} s)\n")
    shutil.rmtree(datasets_dir, ignore_errors=True)

    say(f"# summary, {time.perf_counter() - t_all:.0f} s in all. ratio > 1: forkguard better "
        "(rates: forkguard / torch; times, memory: torch / forkguard); CPU ratio: torch's CPU "
        "seconds (main + workers) per batch / forkguard's; load average now "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = [("", "", "torch", "forkguard", "ratio", "target", "", "CPU ratio")]
    for scenario, what, t, f, ratio, target, met, cpu_ratio in RESULTS:
        rows.append((str(scenario), what, t, f, "-" if ratio != ratio else f"{ratio:.2f}x",
                     target or "-",
                     "" if met is None else ("met" if met else "MISSED"),
                     "" if cpu_ratio is None else f"{cpu_ratio:.2f}x"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        say("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main()
