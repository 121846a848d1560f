"""The CLI's start-up beside its peers, in one run (issue 19's figures; docs/performance.md):

  forkguard --version                                   beside  /bin/true
  forkguard run --quiet --nproc-per-node 2 -- /bin/true  beside  sh -c '/bin/true & /bin/true & wait'

Each command is started with posix_spawn (stdout and stderr to /dev/null) and waited for; the four
commands take turns, REPS times; medians. Prints the difference and the ratio.

    /usr/bin/python3 bench/startup_vs_true.py [build/release/bin/forkguard] [REPS]
"""
import os
import statistics
import sys
import time


def elapsed_ms(argv):
    null = [(os.POSIX_SPAWN_OPEN, fd, "/dev/null", os.O_WRONLY, 0) for fd in (1, 2)]
    start = time.perf_counter_ns()
    pid = os.posix_spawn(argv[0], argv, os.environ, file_actions=null)
    os.waitpid(pid, 0)
    return (time.perf_counter_ns() - start) / 1e6


def main():
    fg = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "build/release/bin/forkguard")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    commands = {
        "/bin/true": ["/bin/true"],
        "forkguard --version": [fg, "--version"],
        "sh: two /bin/true": ["/bin/sh", "-c", "/bin/true & /bin/true & wait"],
        "forkguard run, 2 ranks of /bin/true":
            [fg, "run", "--quiet", "--nproc-per-node", "2", "--", "/bin/true"],
    }
    times = {name: [] for name in commands}
    for _ in range(reps):
        for name, argv in commands.items():
            times[name].append(elapsed_ms(argv))
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, m in med.items():
        print(f"{m:8.3f} ms  {name} (median of {reps})")
    print(f"forkguard --version - /bin/true: {med['forkguard --version'] - med['/bin/true']:+.3f} ms "
          "(target: within 1 ms)")
    ratio = med["forkguard run, 2 ranks of /bin/true"] / med["sh: two /bin/true"]
    print(f"forkguard run / sh: {ratio:.2f}x (target: <= 1.3x)")


if __name__ == "__main__":
    main()
