"""forkguard.notebook_launcher: accelerate's ``notebook_launcher``, on forkguard's notebook_launch.

accelerate starts its ranks with ``torch.multiprocessing`` by fork (through torch.distributed's
elastic agent), so a notebook that touched CUDA first (``torch.cuda.is_available()``, a model moved
to the GPU "to check") gets "Cannot re-initialize CUDA in forked subprocess" from every rank.
This one takes the same arguments, refuses what accelerate refuses with accelerate's words, gives
each rank the environment accelerate's path gives it (accelerate's variables and torch's elastic
agent's: docs/accelerate.md lists them) and raises torch's ChildFailedError where accelerate does,
but forks the ranks from forkguard's clean interpreter fork server, so switching is one import::

    from forkguard import notebook_launcher      # was: from accelerate import notebook_launcher
    notebook_launcher(training_function, args=(model_name,), num_processes=2)

accelerate 1.11 to 1.16 (tests/python/test_accelerate.py checks each against this module) differ
in two things only, kept in ``_Peer``, this module's version seam: the variable that carries
``mixed_precision`` to the ranks and the words for an unknown one.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple

from ._launch import RankError, notebook_launch, whole
from ._native import visible_gpu_count

# accelerate.utils.PrecisionType's values, in its order.
_PRECISIONS = ["no", "fp8", "fp16", "bf16"]
# What accelerate prints for its device: get_current_device_type()'s "cuda", upper-cased.
_DEVICE = "CUDA"
# torch's elastic launch as accelerate configures it: LaunchConfig's role and signals, the
# rendezvous timeout LaunchConfig adds, the c10d backend's default port.
_ROLE = "default_role"
_SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
_RDZV_TIMEOUT = 900
_C10D_DEFAULT_PORT = 29400
_EXIT_BARRIER_TIMEOUT = 300  # seconds: torch's agent waits as long for the other nodes
# accelerate's check_cuda_p2p_ib_support: consumer GPUs whose P2P/IB need a newer driver.
_P2P_IB_UNSUPPORTED = ("RTX 40",)
_P2P_IB_DRIVER = "550.40.07"


class _Peer(NamedTuple):
    """What the installed accelerate's notebook_launcher does that its releases do differently."""

    version: Optional[Tuple[int, int]]  # (major, minor); None: accelerate is not installed
    precision_variable: str  # the ranks' variable for mixed_precision
    precision_as_given: bool  # an unknown mixed_precision is named as the caller spelled it


@functools.lru_cache(maxsize=None)
def _peer() -> _Peer:
    """The installed accelerate's ways, read once; without accelerate, 1.11-1.15's (forkguard's
    before 1.16: what a notebook written for it reads).

    accelerate 1.16 gives the ranks ACCELERATE_MIXED_PRECISION, the variable its Accelerator reads
    (1.11-1.15: MIXED_PRECISION, which accelerate does not read), and raises its ValueError for an
    unknown mixed_precision with the caller's spelling (1.11-1.15 meant it lower-cased, but their
    message reads ``args.mixed_precision`` and raises AttributeError: docs/accelerate.md)."""
    version = _accelerate_version()
    since_1_16 = version is not None and version >= (1, 16)
    return _Peer(version=version,
                 precision_variable="ACCELERATE_MIXED_PRECISION" if since_1_16 else
                 "MIXED_PRECISION",
                 precision_as_given=since_1_16)


def _accelerate_version() -> Optional[Tuple[int, int]]:
    """(major, minor) of the accelerate this interpreter imports, or would: the imported module's
    ``__version__``, else the metadata beside the package ``import accelerate`` would find (the
    first on sys.path: a PYTHONPATH entry before the venv's own), without importing it."""
    module = sys.modules.get("accelerate")
    text = getattr(module, "__version__", None)
    if text is None:
        spec = importlib.util.find_spec("accelerate")
        if spec is None:
            return None
        found = []
        if spec.origin and os.path.basename(spec.origin) == "__init__.py":
            entry = os.path.dirname(os.path.dirname(spec.origin))
            found = list(importlib.metadata.distributions(name="accelerate", path=[entry]))
        try:
            text = found[0].version if found else importlib.metadata.version("accelerate")
        except importlib.metadata.PackageNotFoundError:
            return None
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def notebook_launcher(function: Callable[..., Any], args: Sequence[Any] = (),
                      num_processes: Optional[int] = None, mixed_precision: str = "no",
                      use_port: str = "29500", master_addr: str = "127.0.0.1", node_rank: int = 0,
                      num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: Optional[Dict[str, Any]] = None, rdzv_id: str = "none",
                      max_restarts: int = 0, monitor_interval: float = 0.1,
                      log_line_prefix_template: Optional[str] = None) -> None:
    """Runs ``function(*args)`` in ``num_processes`` ranks, as ``accelerate.notebook_launcher``.

    ``num_processes`` is required (accelerate's ValueError); one (or fewer) runs ``function`` in
    this process, as accelerate does. More are forked from forkguard's clean interpreter, so CUDA
    use in the notebook before the call does not break them. Each rank sees torch's elastic
    agent's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ROLE_NAME,
    TORCHELASTIC_*, TORCH_NCCL_ASYNC_ERROR_HANDLING, ...) and accelerate's
    (ACCELERATE_MIXED_PRECISION, before 1.16 MIXED_PRECISION; NPROC, NODE_RANK,
    NCCL_P2P_DISABLE/NCCL_IB_DISABLE where accelerate sets them); as under the
    agent, the rendezvous store (TORCHELASTIC_USE_AGENT_STORE) is this process's. A failing rank
    raises ``ChildFailedRankError``: torch's ChildFailedError (what accelerate raises) and
    :class:`forkguard.RankError` (the rank, its traceback, forkguard's report).

    ``num_nodes`` above 1: run the same call on each node with its ``node_rank``, as with
    accelerate; rendezvous "static" (node 0 listens at ``master_addr``:``use_port`` or
    ``rdzv_endpoint``). Not supported (a ValueError says so): "c10d" across nodes and the etcd
    backends. Restarts (``max_restarts``) are per node. ``monitor_interval``: the other ranks
    run on that long after one fails, as under torch's agent, which looks at its workers that
    often. ``log_line_prefix_template`` is not applied (each line is prefixed ``[rankN]:``).
    """
    # accelerate's checks, in its order and words (an unknown mixed_precision: see
    # docs/accelerate.md, before 1.16 accelerate's own message is lost to a typo there).
    precision = mixed_precision.lower()
    if precision not in _PRECISIONS:
        shown = mixed_precision if _peer().precision_as_given else precision
        raise ValueError(f"Unknown mixed_precision mode: {shown}. Choose between "
                         f"{_PRECISIONS}.")
    if num_processes is None:
        raise ValueError("You have to specify the number of devices you would like to use, add "
                         "`num_processes=...` to your call.")
    if node_rank >= num_nodes:
        raise ValueError("The node_rank must be less than the number of nodes.")
    if num_processes > 1:
        # A count that compares as a number but is not an integer fails here, before "Launching
        # training on 2.5 GPUs." (accelerate's own launch fails later, in torch's elastic agent);
        # what does not compare failed above or on the line before, with accelerate's TypeError.
        num_processes, num_nodes, node_rank, max_restarts = (
            whole(name, value) for name, value in (("num_processes", num_processes),
                                                   ("num_nodes", num_nodes),
                                                   ("node_rank", node_rank),
                                                   ("max_restarts", max_restarts)))
        _launch(function, tuple(args), num_processes, precision, use_port, master_addr,
                node_rank, num_nodes, rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id,
                max_restarts, monitor_interval)
    else:
        # accelerate runs a single process here, in the notebook itself.
        print("Launching training on one GPU." if visible_gpu_count() else
              "Launching training on CPU.")
        function(*args)


def _launch(function, args, num_processes, precision, use_port, master_addr, node_rank,
            num_nodes, rdzv_backend, rdzv_endpoint, rdzv_conf, rdzv_id, max_restarts,
            monitor_interval):
    if _accelerator_initialized():
        raise ValueError(
            "To launch a multi-device training from your notebook, the `Accelerator` should only "
            "be initialized inside your training function. Restart your notebook and make sure "
            "no cells initializes an `Accelerator`.")
    # accelerate also refuses once bitsandbytes is imported here: its ranks are forks of this
    # process, forkguard's are not (docs/accelerate.md).
    env = {"NPROC": str(num_processes), "NODE_RANK": str(node_rank),
           _peer().precision_variable: precision,
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                                                              "1"),
           "TORCHELASTIC_SIGNALS_TO_HANDLE": _SIGNALS_TO_HANDLE}
    if not _cuda_p2p_ib_supported():
        env["NCCL_P2P_DISABLE"] = env["NCCL_IB_DISABLE"] = "1"
    print(f"Launching training on {num_processes} {_DEVICE}s.")
    rendezvous = _Rendezvous(rdzv_backend, rdzv_endpoint, dict(rdzv_conf or {}), rdzv_id,
                             master_addr, use_port, node_rank, num_nodes)
    env["TORCHELASTIC_USE_AGENT_STORE"] = str(rendezvous.use_agent_store)
    # Laid out as the agent's: a run directory, then attempt_N/LOCAL_RANK/error.json.
    root = tempfile.mkdtemp(prefix="torchelastic_")
    errors = tempfile.mkdtemp(prefix=f"{rdzv_id}_", dir=root)
    try:
        try:
            worker = _as_elastic_worker(function, rdzv_id, errors, monitor_interval)
            notebook_launch(worker, args=args, nproc=num_processes,
                            master_addr=rendezvous.master_addr,
                            master_port=rendezvous.master_port, max_restarts=max_restarts,
                            env=env, nnodes=num_nodes, node_rank=node_rank)
        except RankError as e:
            raise _child_failed(e, function, errors) from e.__cause__
        rendezvous.exit_barrier()
    finally:
        rendezvous.close()
        shutil.rmtree(root, ignore_errors=True)


def _accelerator_initialized() -> bool:
    """accelerate's own check: an Accelerator made in the notebook cannot travel to the ranks."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "AcceleratorState", None), "_shared_state", None)
    return bool(shared)


def _cuda_p2p_ib_supported() -> bool:
    """accelerate's check_cuda_p2p_ib_support, asked of nvidia-smi as accelerate asks it (CUDA
    untouched): False for more than one RTX 40 GPU under a driver older than 550.40.07."""
    def smi(query):
        out = subprocess.check_output(["nvidia-smi", f"--query-gpu={query}",
                                       "--format=csv,noheader"], universal_newlines=True,
                                      stderr=subprocess.DEVNULL)
        return out.strip().split(os.linesep)

    def version(v):
        return tuple(int(x) for x in v.split("."))

    try:
        gpus = smi("count,name")
        names = [g.split(",")[1].strip() for g in gpus]
        if len(gpus) > 1 and any(u in n for n in names for u in _P2P_IB_UNSUPPORTED):
            return version(smi("driver_version")[0]) >= version(_P2P_IB_DRIVER)
    except Exception:  # noqa: BLE001 - no nvidia-smi, no GPU: accelerate says "supported"
        pass
    return True


class _Rendezvous:
    """What torch's elastic agent does for accelerate before it starts the ranks: the rendezvous
    (torch's own checks and messages for the backend and endpoint) and the store the ranks share
    (TORCHELASTIC_USE_AGENT_STORE), held here for the launch: on node 0 at the static endpoint,
    or, for c10d, at a free port of this host."""

    def __init__(self, backend, endpoint, conf, run_id, master_addr, use_port, node_rank,
                 num_nodes):
        import datetime

        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous import (RendezvousParameters,
                                                          rendezvous_handler_registry)
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
        from torch.distributed.launcher.api import _get_addr_and_port

        self.num_nodes = num_nodes
        self.node_rank = node_rank
        self.run_id = run_id
        self.store = None
        # What accelerate hands torch's elastic launch, and torch's checks of it, in its order.
        if backend == "static":
            conf["rank"] = node_rank
            endpoint = endpoint or f"{master_addr}:{use_port}"
        conf.setdefault("timeout", _RDZV_TIMEOUT)
        params = RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id,
                                      min_nodes=num_nodes, max_nodes=num_nodes, **conf)
        _get_addr_and_port(params)
        self.timeout = datetime.timedelta(seconds=int(conf["timeout"]))
        if backend == "static":
            handler = rendezvous_handler_registry.create_handler(params)  # no store yet
            self.master_addr, self.master_port = handler.master_addr, handler.master_port
            self.use_agent_store = True
            self.store = dist.TCPStore(self.master_addr, self.master_port, num_nodes,
                                       node_rank == 0, self.timeout, multi_tenant=True)
        elif backend == "c10d":
            parse_rendezvous_endpoint(endpoint, default_port=_C10D_DEFAULT_PORT)
            if num_nodes > 1:
                raise ValueError(
                    f"forkguard.notebook_launcher: rdzv_backend='c10d' with num_nodes={num_nodes}"
                    " is not supported (its nodes take their ranks in the order they join); use "
                    "rdzv_backend='static' with each node's node_rank")
            self.master_addr = socket.getfqdn()
            self.use_agent_store = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                                                  "0") != "1"
            if self.use_agent_store:
                self.store = dist.TCPStore(self.master_addr, 0, None, True, self.timeout,
                                           multi_tenant=True)
                self.master_port = self.store.port
            else:
                self.master_port = _free_port()
        else:
            registered = getattr(rendezvous_handler_registry, "_registry", {})
            if backend not in registered:  # torch's message for a backend it does not know
                rendezvous_handler_registry.create_handler(params)
            raise ValueError(f"forkguard.notebook_launcher: rdzv_backend={backend!r} is not "
                             "supported (static or c10d)")

    def exit_barrier(self):
        """Every node's ranks are done before node 0's store goes (torch's agent waits so)."""
        if self.num_nodes < 2 or self.store is None:
            return
        import datetime

        prefix = f"/forkguard/{self.run_id}/exit"
        if self.store.add(prefix + "/count", 1) == self.num_nodes:
            self.store.set(prefix + "/done", "1")
        self.store.wait([prefix + "/done"],
                        datetime.timedelta(seconds=_EXIT_BARRIER_TIMEOUT))
        # Node 0 hosts the store: it stays until every node's wait has returned (a node still
        # waiting when the store went got "Broken pipe").
        left = self.store.add(prefix + "/left", 1)
        deadline = time.monotonic() + _EXIT_BARRIER_TIMEOUT
        while self.node_rank == 0 and left < self.num_nodes and time.monotonic() < deadline:
            time.sleep(0.01)
            left = self.store.add(prefix + "/left", 0)

    def close(self):
        self.store = None  # a TCPStore server stops with its last reference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _as_elastic_worker(function, run_id, errors, monitor_interval):
    """``function`` as a worker of torch's elastic agent runs: with the variables the agent gives
    it that forkguard's launcher names otherwise (its role is torchrun's "default") or per rank
    (the error file torch's @record writes), with the signal handlers a fork of the agent
    inherits (torch's, which raise SignalException: a rank stopped while it holds a Queue's lock
    unwinds and releases it), and a failure seen when the agent would see it: it looks at its
    workers every ``monitor_interval`` seconds, so the other ranks run on that long (forkguard's
    supervisor is woken at once: the failing rank waits as long before it exits). A closure,
    sent by value: the rank need not import forkguard."""
    role = _ROLE

    def elastic_worker(*args):
        import os
        import signal
        import time

        from torch.distributed.elastic.multiprocessing import api

        env = os.environ
        env["ROLE_NAME"] = role
        env["TORCHELASTIC_RUN_ID"] = run_id
        attempt = os.path.join(errors, f"attempt_{env['TORCHELASTIC_RESTART_COUNT']}",
                               env["LOCAL_RANK"])
        os.makedirs(attempt, exist_ok=True)
        env["TORCHELASTIC_ERROR_FILE"] = os.path.join(attempt, "error.json")
        for name in env["TORCHELASTIC_SIGNALS_TO_HANDLE"].split(","):
            signal.signal(getattr(signal, name.strip()), api._terminate_process_handler)
        try:
            return function(*args)
        except api.SignalException:
            raise  # stopped by the launcher: at once
        except Exception:
            time.sleep(monitor_interval)
            raise

    return elastic_worker


_CHILD_FAILED = None


def _child_failed_class():
    """ChildFailedRankError: RankError and torch's ChildFailedError (made on first use: forkguard
    imports without torch)."""
    global _CHILD_FAILED
    if _CHILD_FAILED is None:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        class ChildFailedRankError(RankError, ChildFailedError):
            """A rank of forkguard.notebook_launcher failed: torch's ChildFailedError (``name``,
            ``failures`` by global rank, ``get_first_failure()``, ``format_msg()``), as accelerate
            raises it, and forkguard's RankError (``rank``, ``exc_type``, ``traceback``,
            ``report``); its message is RankError's, its ``__cause__`` the rank's exception."""

        ChildFailedRankError.__module__ = __name__
        ChildFailedRankError.__qualname__ = "ChildFailedRankError"
        _CHILD_FAILED = ChildFailedRankError
    return _CHILD_FAILED


def _child_failed(e: RankError, function, errors) -> RankError:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    cls = _child_failed_class()
    err = cls(str(e), rank=e.rank, exc_type=e.exc_type, traceback=e.traceback,
              exit_code=e.exit_code, signal=e.signal, report=e.report, restarts=e.restarts,
              json=e.json)
    err.name = getattr(function, "__name__", repr(function))
    err.failures = {}
    ranks = json.loads(e.json)["ranks"] if e.json else []
    for r in ranks:
        failed = (r["status"] == "signaled" or r["status"] == "exited" and r["exit_code"] != 0)
        if not failed or r["stopped_by_launcher"]:
            continue
        path = os.path.join(errors, f"attempt_{e.restarts}", str(r["local_rank"]), "error.json")
        if r["rank"] == e.rank and not os.path.exists(path) and e.exc_type:
            # What torch's @record writes in a worker, from the outcome forkguard carried back.
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump({"message": {"message": f"{e.exc_type}: {_first_message(e)}",
                                       "extraInfo": {"py_callstack": e.traceback,
                                                     "timestamp": str(int(time.time()))}}}, f)
        code = -r["signal"] if r["status"] == "signaled" else r["exit_code"]
        err.failures[r["rank"]] = ProcessFailure(local_rank=r["local_rank"], pid=r["pid"],
                                                 exitcode=code, error_file=path)
    return err


def _first_message(e: RankError) -> str:
    """The rank's exception text, as RankError's first line holds it."""
    head = str(e).split("\n\n", 1)[0]
    marker = f"{e.exc_type}: "
    return head.split(marker, 1)[1] if marker in head else head


def __getattr__(name):
    # forkguard._accelerate.ChildFailedRankError (pickle's path to it) imports torch on demand.
    if name == "ChildFailedRankError":
        return _child_failed_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
