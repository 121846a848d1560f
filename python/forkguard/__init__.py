"""forkguard: multi-process GPU work that survives fork.

    import forkguard
    forkguard.probe()                          # this process's CUDA state, never initializing it
    forkguard.ensure_fork_safe()               # raises ForkUnsafeError with evidence and cures
    forkguard.notebook_launch(train, nproc=2)  # ranks from a clean interpreter, torchrun's env
    forkguard.guard()                          # multiprocessing's fork: plain when fork-safe,
                                               # else from the clean interpreter fork server
    forkguard.notebook_launcher(train, num_processes=2)  # accelerate's, same arguments
    loader = forkguard.DataLoader(my_dataset, batch_size=32, num_workers=4)  # torch's, with
                                               # workers that survive a CUDA-touching parent
    for images, labels in forkguard.ImageLoader("/data/train", batch_size=64, workers=4):
        x = torch.from_dlpack(images)          # no copy

At import, while this process is still fork-safe, forkguard starts its C++ fork server (a small
fork of this process that forks ImageLoader's process workers, so they stay CUDA-clean even
after this process initializes CUDA). FORKGUARD_NO_FORK_SERVER=1 turns that off; process
workers then come from a guarded fork, refused once CUDA is initialized here.
FORKGUARD_GUARD=reroute|refuse|warn calls guard() with that policy at import, and with the
start-up hook installed (forkguard-guard.pth beside the package) at every interpreter's start.
"""
import os as _os
import sys as _sys

from . import _native
from . import _guard, _torch_compat
from ._guard import DirtyForkWarning, NotCarriedError, RerouteError, guard, unguard
from ._accelerate import notebook_launcher
from ._launch import RankError, default_preload, notebook_launch, start_server, stop_server
from ._loader import ImageLoader
from ._native import DataError, DLTensor, Error, LoaderTimeoutError, ProbeError, WorkerError
from ._probe import Evidence, ForkUnsafeError, ProbeResult, ensure_fork_safe, probe

__version__ = _native.__version__

__all__ = [
    "CudaInWorkerError", "CudaInWorkerWarning", "DLTensor", "DataError", "DataLoader", "DirtyForkWarning", "Error", "Evidence", "ForkUnsafeError",
    "ImageLoader", "LoaderTimeoutError", "NotCarriedError", "ProbeError", "ProbeResult", "RankError", "RerouteError",
    "WorkerError", "default_preload", "ensure_fork_safe", "guard", "notebook_launch",
    "notebook_launcher", "probe", "start_server", "stop_server", "unguard",
]

# forkguard's own Python fork server (_server.py) imports this package to preload it, or from
# FORKGUARD_GUARD's start-up hook (forkguard-guard.pth): no C++ fork server, guard or torch check
# there (its children are forks of it). It is told by the script it runs being this package's
# own _server.py (the same file), not by a name a user's script could also have.
def _runs_our_server() -> bool:
    argv = getattr(_sys, "argv", None)
    if not argv or not argv[0]:
        return False
    ours = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "_server.py")
    try:
        return _os.path.samefile(argv[0], ours)
    except OSError:
        return False


_in_server = _runs_our_server()

if not _os.environ.get("FORKGUARD_NO_FORK_SERVER") and not _in_server:
    _native.start_fork_server()

if not _in_server:
    _guard.guard_from_environment()
    _torch_compat.warn_if_untested()  # once, here, not in forkguard's own fork server


def __getattr__(name):
    # forkguard.DataLoader and its exceptions import torch: only when asked for.
    if name in ("DataLoader", "CudaInWorkerError", "CudaInWorkerWarning"):
        try:
            from . import _dataloader
        except ModuleNotFoundError as e:
            if e.name != "torch":
                raise
            raise ImportError(
                f"forkguard.{name} is torch's DataLoader and needs PyTorch, which this Python "
                f"({_sys.executable}) cannot import: pip install 'forkguard[torch]'") from e

        return getattr(_dataloader, name)
    raise AttributeError(f"module 'forkguard' has no attribute {name!r}")
