#!/usr/bin/python3
"""A real torch.distributed all-reduce over gloo, started by forkguard run through torchrun's
environment contract (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):

    forkguard run --standalone --nproc-per-node 2 -- /usr/bin/python3 examples/ddp_gloo.py
"""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env:// rendezvous from the launcher's variables
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
print(f"rank {rank}/{world}: all_reduce = {t.item():g} (expected {expected:g})", flush=True)
dist.destroy_process_group()
raise SystemExit(0 if t.item() == expected else 1)
