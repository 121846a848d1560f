"""forkguard.notebook_launcher: accelerate's ``notebook_launcher``, on forkguard's notebook_launch.

accelerate starts its ranks with ``torch.multiprocessing`` by fork (through torch.distributed's
elastic agent), so a notebook that touched CUDA first (``torch.cuda.is_available()``, a model moved
to the GPU "to check") gets "Cannot re-initialize CUDA in forked subprocess" from every rank, or
accelerate's own refusal. This one takes the same arguments, sets the same environment and
prints the same lines, but forks the ranks from forkguard's clean interpreter fork server, so
switching is one import::

    from forkguard import notebook_launcher      # was: from accelerate import notebook_launcher
    notebook_launcher(training_function, args=(model_name,), num_processes=2)
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Sequence

from ._launch import notebook_launch
from ._native import visible_gpu_count

# accelerate.utils.PrecisionType's values, in its order.
_PRECISIONS = ["no", "fp8", "fp16", "bf16"]


def _accelerator_initialized() -> bool:
    """accelerate's own check: an Accelerator made in the notebook cannot travel to the ranks."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
    return bool(shared)


def _endpoint(rdzv_endpoint: str, master_addr: str, use_port: str):
    """The master address and port: rdzv_endpoint ("host:port") when given, as accelerate's
    static rendezvous uses it, else master_addr and use_port."""
    if not rdzv_endpoint:
        return master_addr, use_port
    host, sep, port = rdzv_endpoint.rpartition(":")
    if not sep or not host:
        return rdzv_endpoint, use_port
    return host.strip("[]"), port


def notebook_launcher(function: Callable[..., Any], args: Sequence[Any] = (),
                      num_processes: Optional[int] = None, mixed_precision: str = "no",
                      use_port: str = "29500", master_addr: str = "127.0.0.1", node_rank: int = 0,
                      num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: Optional[Dict[str, Any]] = None, rdzv_id: str = "none",
                      max_restarts: int = 0, monitor_interval: float = 0.1,
                      log_line_prefix_template: Optional[str] = None) -> None:
    """Runs ``function(*args)`` in ``num_processes`` ranks, as ``accelerate.notebook_launcher``.

    ``num_processes=None`` is one rank per visible GPU (NVML or the driver's /proc entries,
    CUDA_VISIBLE_DEVICES applied: counted without initializing CUDA), or one where there is none. One rank runs
    in this process, as accelerate does; more are forked from forkguard's clean interpreter, so
    CUDA use in the notebook before the call does not break them (accelerate refuses it). Each
    rank sees torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...)
    and accelerate's (ACCELERATE_MIXED_PRECISION, NPROC, NODE_RANK, FORK_LAUNCHED). A failing
    rank raises :class:`forkguard.RankError` (accelerate raises torch's ChildFailedError).

    Not supported (a ValueError names the argument): ``num_nodes`` above 1 (use ``forkguard run``
    on each node), rendezvous backends other than ``static`` and ``c10d``, and
    ``log_line_prefix_template`` (each line is prefixed ``[rankN]:``, torchrun's default).
    ``monitor_interval``, ``rdzv_id`` and ``rdzv_conf`` are accepted and have nothing to tune:
    forkguard's supervisor is woken by the ranks' exits, not by polling.
    """
    precision = str(mixed_precision).lower()
    if precision not in _PRECISIONS:
        raise ValueError(f"Unknown mixed_precision mode: {precision}. Choose between "
                         f"{_PRECISIONS}.")
    if num_nodes != 1:
        raise ValueError(f"forkguard.notebook_launcher: num_nodes={num_nodes} is not supported "
                         "(one node per notebook); run `forkguard run --nnodes N` on each node")
    if node_rank != 0:
        raise ValueError(f"forkguard.notebook_launcher: node_rank={node_rank} with one node")
    if rdzv_backend not in ("static", "c10d"):
        raise ValueError(f"forkguard.notebook_launcher: rdzv_backend={rdzv_backend!r} is not "
                         "supported (static or c10d: one node, a master address and port)")
    if log_line_prefix_template is not None:
        raise ValueError("forkguard.notebook_launcher: log_line_prefix_template is not supported "
                         "(lines are prefixed '[rankN]:', torchrun's default)")
    del rdzv_conf, rdzv_id, monitor_interval  # nothing to tune here: see the docstring

    gpus = visible_gpu_count()
    if num_processes is None:
        num_processes = max(1, gpus)
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, not {num_processes}")
    if num_processes == 1:
        # accelerate runs a single process here, in the notebook itself.
        print("Launching training on one GPU." if gpus else "Launching training on CPU.")
        function(*args)
        return None
    if _accelerator_initialized():
        raise ValueError(
            "To launch a multi-GPU training from your notebook, the `Accelerator` should only be "
            "initialized inside your training function. Restart your notebook and make sure no "
            "cells initializes an `Accelerator`.")
    addr, port = _endpoint(rdzv_endpoint, master_addr, use_port)
    try:
        port_number = int(port)
    except ValueError:
        raise ValueError(f"forkguard.notebook_launcher: port {port!r} is not a number") from None
    env = {
        "ACCELERATE_MIXED_PRECISION": precision,
        "NPROC": str(num_processes),
        "NODE_RANK": str(node_rank),
        "FORK_LAUNCHED": "1",
    }
    print(f"Launching training on {num_processes} GPUs.")
    notebook_launch(function, args=tuple(args), nproc=num_processes, master_addr=addr,
                    master_port=port_number, max_restarts=max_restarts, env=env)
    return None
