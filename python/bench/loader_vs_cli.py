"""forkguard.ImageLoader from Python against the C++ `forkguard bench loader` on the same files,
alternating in one run (medians of ROUNDS): the binding's cost in images/s.

    PYTHONPATH=build/release/python /usr/bin/python3 python/bench/loader_vs_cli.py \
        --cli build/release/bin/forkguard --data /tmp/peer-data/imagefolder

Both measure as the CLI does: the standard training pipeline (RandomResizedCrop 224, flip,
normalize), images/s after the first batch, workers threads unless --worker-kind process. The
Python side also turns every batch into torch tensors (torch.from_dlpack) when torch is there.
"""
import argparse
import json
import statistics
import subprocess
import time

import forkguard


def python_run(a):
    try:
        import torch
    except ImportError:
        torch = None
    t0 = time.perf_counter()
    loader = forkguard.ImageLoader(a.data, batch_size=a.batch_size, workers=a.workers,
                                   worker_kind=a.worker_kind, dtype=a.dtype, seed=0)
    images = after_first = 0
    first = None
    for _ in range(a.epochs):
        for x, y in loader:
            if torch is not None:
                x, y = torch.from_dlpack(x), torch.from_dlpack(y)
            if first is None:
                first = time.perf_counter()
                first_batch = first - t0
            else:
                after_first += len(y)
            images += len(y)
    steady = time.perf_counter() - first
    loader.close()
    return {"images_per_second": after_first / steady, "first_batch_seconds": first_batch,
            "images": images}


def cli_run(a):
    out = subprocess.run([a.cli, "bench", "loader", "--data", a.data, "--workers", str(a.workers),
                          "--worker-kind", a.worker_kind, "--batch-size", str(a.batch_size),
                          "--epochs", str(a.epochs), "--dtype", a.dtype, "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cli", default="build/release/bin/forkguard")
    p.add_argument("--data", default="/tmp/peer-data/imagefolder")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker-kind", default="thread", choices=["thread", "process"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "uint8"])
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    cli, py = [], []
    for r in range(a.rounds):
        cli.append(cli_run(a))
        py.append(python_run(a))
        print(f"round {r + 1}: C++ {cli[-1]['images_per_second']:.1f} images/s, "
              f"Python {py[-1]['images_per_second']:.1f} images/s", flush=True)
    c = statistics.median(x["images_per_second"] for x in cli)
    q = statistics.median(x["images_per_second"] for x in py)
    print(json.dumps({"cpp_images_per_second": round(c, 1), "python_images_per_second": round(q, 1),
                      "ratio": round(q / c, 3),
                      "cpp_first_batch_s": round(statistics.median(x["first_batch_seconds"] for x in cli), 3),
                      "python_first_batch_s": round(statistics.median(x["first_batch_seconds"] for x in py), 3),
                      "workers": a.workers, "worker_kind": a.worker_kind, "batch_size": a.batch_size,
                      "dtype": a.dtype, "epochs": a.epochs, "rounds": a.rounds}))


if __name__ == "__main__":
    main()
