#!/usr/bin/python3
"""A rank for tests/launch/slurm_test.sh, started by `srun forkguard run`:

    slurm_rank.py             a gloo all-reduce of (rank + 1); prints one line
                              "slurm_rank node=N job=J sum=S RANK=... MASTER_PORT=..."
                              with the Slurm node it runs on and what the launcher gave it
    slurm_rank.py --hold DIR  writes DIR/rankR.pid, then sleeps until a signal ends it; a SIGTERM
                              is first noted in DIR/rankR.signal (so the test can tell a graceful
                              stop from a SIGKILL)
"""
import os
import signal
import sys
import time

rank = os.environ["RANK"]

if len(sys.argv) >= 3 and sys.argv[1] == "--hold":
    out = sys.argv[2]

    def on_term(signum, frame):
        with open(f"{out}/rank{rank}.signal", "a") as f:
            f.write(f"{signal.Signals(signum).name} {time.time():.3f}\n")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)
    # Written whole, then renamed: the test never reads a half-written PID.
    with open(f"{out}/rank{rank}.pid.tmp", "w") as f:
        f.write(f"{os.getpid()}\n")
    os.rename(f"{out}/rank{rank}.pid.tmp", f"{out}/rank{rank}.pid")
    time.sleep(300)
    raise SystemExit(1)  # the test cancels the job long before this

import torch  # noqa: E402 (not needed by --hold, and slow to import)
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")  # env:// from the launcher's MASTER_ADDR / MASTER_PORT
world = dist.get_world_size()
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
env = " ".join(f"{k}={os.environ.get(k, '')}" for k in
               ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT"))
print(f"slurm_rank node={os.environ.get('SLURMD_NODENAME', '')} "
      f"job={os.environ.get('SLURM_JOB_ID', '')} sum={t.item():g} {env}", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if t.item() == world * (world + 1) / 2 else 1)
