"""forkguard.ImageLoader against torch.utils.data.DataLoader + torchvision, from Python, on the same
files in one run: the same pipeline (RandomResizedCrop 224, horizontal flip, ToTensor + Normalize,
float32 NCHW), batch 64, 2 workers (DataLoader: fork workers, persistent; ImageLoader: process
workers), images/s after the first batch of each epoch (median over the measured epochs, after a
warm-up epoch), and the ratio.

    PYTHONPATH=build/release/python /usr/bin/python3 python/bench/compare_torch.py \
        --data /tmp/peer-data/imagefolder
"""
import argparse
import statistics
import time

import torch
from torchvision import datasets, transforms as T

import forkguard

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def epoch_rate(batches):
    """Images/s after the first batch, and the time to that first batch."""
    t0 = time.perf_counter()
    it = iter(batches)
    next(it)
    t1 = time.perf_counter()
    n = 0
    for _, y in it:
        n += len(y)
    return n / (time.perf_counter() - t1), t1 - t0


def torch_loader(a):
    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(MEAN, STD)])
    return torch.utils.data.DataLoader(
        datasets.ImageFolder(a.data, tf), batch_size=a.batch_size, shuffle=True,
        num_workers=a.workers, multiprocessing_context="fork", persistent_workers=True,
        generator=torch.Generator().manual_seed(0))


class Tensors:
    """forkguard batches as torch tensors (no copy), as a training loop takes them."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        for x, y in self.loader:
            yield torch.from_dlpack(x), torch.from_dlpack(y)


def measure(name, batches, epochs):
    epoch_rate(batches)  # warm-up: worker start, page cache
    runs = [epoch_rate(batches) for _ in range(epochs)]
    ips = statistics.median(r[0] for r in runs)
    print(f"{name:44s} {ips:7.1f} img/s (median of {epochs} epochs: "
          f"{[round(r[0], 1) for r in runs]}), first batch of an epoch "
          f"{statistics.median(r[1] for r in runs) * 1e3:.0f} ms", flush=True)
    return ips


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="/tmp/peer-data/imagefolder")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    peer = measure(f"DataLoader, {a.workers} fork workers (persistent)", torch_loader(a), a.epochs)
    fg = forkguard.ImageLoader(a.data, batch_size=a.batch_size, workers=a.workers,
                               worker_kind="process", seed=0)
    ours = measure(f"forkguard.ImageLoader, {a.workers} process workers", Tensors(fg), a.epochs)
    fg.close()
    print(f"forkguard.ImageLoader / DataLoader: {ours / peer:.2f}x")


if __name__ == "__main__":
    main()
