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

    PYTHONPATH=build/release/python /usr/bin/python3 python/bench/dataloader_vs_torch.py \
        [--quick] [--only 1,3] [--repeats N]

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


# ------------------------------------------------------------------ main
SCENARIOS = {1: scenario_first_batch, 2: scenario_transport, 3: scenario_small,
             4: scenario_images, 5: scenario_memory}


def main():
    import argparse
    import datetime
    import platform
    import shutil

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one repeat and smaller epochs (a smoke test)")
    ap.add_argument("--only", default="",
                    help="comma-separated scenario numbers (1-5), default all")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measured rounds per scenario (default 3, 1 with --quick)")
    a = ap.parse_args()
    a.repeats = a.repeats or (1 if a.quick else 3)
    only = sorted({int(s) for s in a.only.split(",") if s.strip()}) or sorted(SCENARIOS)
    bad = [s for s in only if s not in SCENARIOS]
    if bad:
        ap.error(f"--only: no scenario {bad}")

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
        rows.append((str(scenario), what, t, f, f"{ratio:.2f}x", target or "-",
                     "" if met is None else ("met" if met else "MISSED"),
                     "" if cpu_ratio is None else f"{cpu_ratio:.2f}x"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        say("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main()
