"""forkguard.guard()'s cost, in one run:

1. On a clean parent (torch imported, so the probe walks a realistic list of mapped libraries):
   multiprocessing Process.start() with the fork start method, unguarded and guarded, and the
   guard's own check at each start (the fast probe, timed alone over many calls).
2. On a dirty parent (cuInit called on the test driver, or a real driver with --driver): the
   time from Process.start() to a torch-importing child's first message, for a start rerouted by
   the guard (the interpreter fork server, torch preloaded, warm) beside get_context("spawn") and
   get_context("forkserver") starting the same child.

    PYTHONPATH=build/release/python /usr/bin/python3 bench/guard_overhead.py [--driver PATH]
        [--starts 200] [--slow-starts 3]

The driver defaults to the test driver built in build/release/lib/fake_cuda/libcuda.so.1.
"""
# The top level is what every child of every start method imports again as __mp_main__ (spawn,
# forkserver, and a rerouted start alike): torch and little else; the rest is imported in main().
import multiprocessing as mp
import os
import sys
import time

import torch  # noqa: F401 - the clean parent maps what a training script maps; spawn children import it


def noop():
    pass


def torch_child(q):
    import torch  # noqa: F401 - already imported when the process was forked from a warm interpreter

    q.put(time.perf_counter())  # CLOCK_MONOTONIC: comparable with the parent's


def time_starts(n):
    import statistics

    import forkguard

    """Median seconds per Process.start() of a no-op fork child, unguarded and guarded,
    interleaved so that the machine's drift falls on both alike."""
    ctx = mp.get_context("fork")
    times = {False: [], True: []}
    for i in range(2 * n):
        guarded = bool(i % 2)
        if guarded:
            forkguard.guard()
        p = ctx.Process(target=noop)
        t0 = time.perf_counter()
        p.start()
        times[guarded].append(time.perf_counter() - t0)
        forkguard.unguard()
        p.join()
        p.close()
    return statistics.median(times[False]), statistics.median(times[True])


def time_hook(n):
    """Seconds the guard adds to one start: its hook, with the fork itself stubbed out."""
    from multiprocessing import context

    import forkguard

    forkguard.guard()
    real = forkguard._guard._original_popen
    forkguard._guard._original_popen = noop_popen = lambda process_obj: None  # noqa: E731
    try:
        hook = context.ForkProcess._Popen
        p = mp.get_context("fork").Process(target=noop)
        t0 = time.perf_counter()
        for _ in range(n):
            noop_popen(p)
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            hook(p)
        hooked = time.perf_counter() - t0
    finally:
        forkguard._guard._original_popen = real
        forkguard.unguard()
    return (hooked - bare) / n


def time_child(ctx, n):
    """Seconds from Process.start() to the torch-importing child's first message."""
    import statistics

    out = []
    for _ in range(n):
        q = ctx.SimpleQueue()
        p = ctx.Process(target=torch_child, args=(q,))
        t0 = time.perf_counter()
        p.start()
        t1 = q.get()
        out.append(t1 - t0)
        p.join()
        p.close()
        q.close()
    return statistics.median(out)


def main():
    import argparse
    import ctypes
    import tempfile

    import forkguard
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--driver", default=os.environ.get(
        "FORKGUARD_TEST_FAKE_CUDA",
        os.path.join(here, "..", "build", "release", "lib", "fake_cuda", "libcuda.so.1")))
    ap.add_argument("--starts", type=int, default=200)
    ap.add_argument("--slow-starts", type=int, default=3)
    a = ap.parse_args()

    print(f"# clean parent (PID {os.getpid()}, torch {torch.__version__}): "
          f"Process.start() with the fork start method, {a.starts} starts each")
    time_starts(5)  # warm-up
    plain, guarded = time_starts(a.starts)
    hook = time_hook(100 * a.starts)
    print(f"unguarded start   median {plain * 1e6:9.1f} us")
    print(f"guarded start     median {guarded * 1e6:9.1f} us  (difference "
          f"{(guarded - plain) * 1e6:+.1f} us: the fork's own noise)")
    print(f"added per start          {hook * 1e6:9.1f} us  (the guard's hook, fork stubbed out; "
          "target < 50 us)")

    os.environ.setdefault("FAKE_CUDA_DEV_DIR", tempfile.mkdtemp(prefix="forkguard-bench-dev-"))
    os.environ.setdefault("FORKGUARD_CUDA_DRIVER", a.driver)
    rc = ctypes.CDLL(a.driver).cuInit(0)
    verdict = forkguard.probe().verdict
    print(f"\n# dirty parent: cuInit = {rc} ({a.driver}), probe: {verdict}; "
          "start() to a torch-importing child's first message (median)")
    forkguard.guard()
    t0 = time.perf_counter()
    time_child(mp.get_context("fork"), 1)  # starts the interpreter fork server (torch preloaded)
    cold = time.perf_counter() - t0
    rerouted = time_child(mp.get_context("fork"), max(5, a.slow_starts))
    forkguard.unguard()
    forkserver = time_child(mp.get_context("forkserver"), a.slow_starts)
    spawn = time_child(mp.get_context("spawn"), a.slow_starts)
    print(f"guard() reroute   {rerouted * 1e3:8.1f} ms  (the first, starting the fork server: "
          f"{cold * 1e3:.0f} ms)")
    print(f"forkserver        {forkserver * 1e3:8.1f} ms  ({forkserver / rerouted:.0f}x the reroute)")
    print(f"spawn             {spawn * 1e3:8.1f} ms  ({spawn / rerouted:.0f}x the reroute; "
          "target >= 10x)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
