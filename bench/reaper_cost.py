#!/usr/bin/env python3
# CPU (user+sys of every process) of `forkguard run --nproc-per-node 8 -- /bin/true`, mean of 30:
# the per-rank cost of starting and reaping ranks, steadier than wall time on a loaded machine.
#   python3 bench/reaper_cost.py build/release/bin/forkguard LABEL
import resource, subprocess, sys, time
exe = sys.argv[1]; reps = 30
def run():
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.perf_counter()
    for _ in range(reps):
        subprocess.run([exe, "run", "--quiet", "--nproc-per-node", "8", "--", "/bin/true"], check=True)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return cpu / reps * 1e3, (time.perf_counter() - t0) / reps * 1e3
print(sys.argv[2], "cpu ms per 8-rank run %.2f, wall %.1f" % run())
