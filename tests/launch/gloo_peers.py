#!/usr/bin/python3
"""A rank of a real gloo world for the multi-node launcher tests: it prints what the launcher gave
it and the all-reduce of (rank + 1) over the world.

    gloo_peers.py          one all-reduce, then exit 0 if the sum is right
    gloo_peers.py --hold   after the first all-reduce, say "ready", then keep all-reducing until a
                           peer is lost (gloo raises; the rank exits 1 with the error)
"""
import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env:// from the launcher's MASTER_ADDR/MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
expected = world * (world + 1) // 2
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
env = " ".join(f"{k}={os.environ[k]}" for k in
               ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT"))
print(f"rank {rank}/{world} pid {os.getpid()}: sum {t.item():g} (expected {expected}) {env}",
      flush=True)
if t.item() != expected:
    raise SystemExit(1)
if "--hold" in sys.argv:
    print(f"ready {rank} {os.getpid()}", flush=True)
    while True:  # ends by gloo's error when a peer goes
        dist.all_reduce(t)
        time.sleep(0.05)
dist.destroy_process_group()
