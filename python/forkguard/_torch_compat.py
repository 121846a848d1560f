"""Where torch releases differ, as forkguard.DataLoader meets them: the one place that knows.

forkguard is tested on torch 1.13 (Debian 12's PyTorch 1.13.1) and torch 2.14 (2.14.1); the rest of
the package reads as if there were one torch. What differs between them, as a DataLoader subclass
sees it:

- the constructor: `prefetch_factor` defaults to None (2.0) and must be None without workers;
  `in_order` (2.6); `pin_memory_device` deprecated and ignored with a warning (2.9). forkguard's
  DataLoader takes torch's own parameters and passes them to torch's constructor unchanged, so
  the defaults, checks and messages are whichever torch is installed (`loader_signature` gives
  the combined signature for introspection);
- the iterator: `_prefetch_factor` and `_in_order` are set by torch's multiprocessing iterator
  only (2.0), not by the base iterator forkguard's extends (`worker_settings`);
- `WorkerInfo` became a frozen slots dataclass (2.x): made and changed through `worker_info` and
  `worker_info_with`;
- the tensor collate function torch's default_collate calls (`torch_collate_tensor_fn`), whose
  errors for nested and sparse tensors forkguard's keeps;
- torch's CUDA lazy init, which raises "Cannot re-initialize CUDA in forked subprocess" in a child
  forked after torch's fork poison (`watch_bad_fork`).
"""
import dataclasses
import importlib.util
import inspect
import os
import re
import sys
import warnings

# The torch releases forkguard's tests run on (python/requirements, tests/python/CMakeLists.txt).
TESTED = ((1, 13), (2, 14))
_warned = False


def parse_version(text):
    """(major, minor) of a torch version string ("2.14.1+cu130", "1.13.0a0+gitunknown"), or None."""
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def untested_version_message(text):
    """The warning for a torch release outside the tested range, or None inside it."""
    version = parse_version(text)
    if version is None or TESTED[0] <= version <= TESTED[1]:
        return None
    low, high = (f"{a}.{b}" for a, b in TESTED)
    return (f"forkguard is tested with torch {low} to {high}; this is torch {text}. "
            f"forkguard.DataLoader extends torch's DataLoader internals, which change between "
            f"releases: check its behaviour here, or install torch {low}-{high}.")


def installed_version():
    """The installed torch's version string, without importing torch (its torch/version.py, read:
    importlib.metadata costs 45-70 ms at every `import forkguard`), or None without torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(torch, "__version__", None)
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        try:
            with open(os.path.join(folder, "version.py")) as f:
                m = re.search(r"^__version__\s*(?::\s*str)?\s*=\s*['\"]([^'\"]+)", f.read(), re.M)
        except OSError:
            continue
        if m:
            return m.group(1)
    return None


def warn_if_untested(text=None):
    """Says once per process (at import) when the installed torch is outside the tested range."""
    global _warned
    if _warned:
        return
    text = installed_version() if text is None else text
    message = untested_version_message(text)
    if message is not None:
        _warned = True
        warnings.warn(message, UserWarning, stacklevel=3)


def loader_signature(torch_init, extra_init):
    """The signature of forkguard.DataLoader(...): torch's DataLoader parameters as the installed
    torch has them, then forkguard's keyword-only ones."""
    ours = [p for p in inspect.signature(extra_init).parameters.values()
            if p.kind == inspect.Parameter.KEYWORD_ONLY]
    theirs = list(inspect.signature(torch_init).parameters.values())
    return inspect.Signature(theirs + ours)


def worker_settings(loader):
    """(prefetch_factor, in_order) of a loader with workers, as torch's multiprocessing iterator
    reads them (torch < 2.6 has no in_order: its batches always come in order)."""
    return loader.prefetch_factor, getattr(loader, "in_order", True)


def worker_info(**fields):
    """torch's WorkerInfo for this worker process (what get_worker_info() returns)."""
    from torch.utils.data._utils import worker

    return worker.WorkerInfo(**fields)


def worker_info_with(info, **changes):
    """`info` with some fields changed: a new WorkerInfo where it is a frozen dataclass (torch 2),
    the same object changed in place where it refuses attribute writes only (torch 1.13)."""
    if dataclasses.is_dataclass(info):
        return dataclasses.replace(info, **changes)
    info.__dict__.update(changes)
    return info


def torch_collate_tensor_fn():
    """torch's own collate function for a batch of tensors (default_collate's), with its checks."""
    from torch.utils.data._utils import collate

    return collate.collate_tensor_fn


def watch_bad_fork(on_use):
    """In a process in torch's bad fork (forked after its parent set torch's CUDA fork poison):
    `on_use()` runs before each of torch's CUDA lazy inits, every one of which raises "Cannot
    re-initialize CUDA in forked subprocess" there, whoever catches that error. The C++ side
    (torch::utils::device_lazy_init: a tensor made on or moved to the GPU) looks `_lazy_init` up
    on torch.cuda at each call; torch.cuda's submodules (memory, random, ...) imported it by
    name, so each module holding torch's function gets the watched one. True where this process
    is in the bad fork (and now watched), False elsewhere (torch without CUDA, or no poison)."""
    cuda = sys.modules.get("torch.cuda")
    if cuda is None or not getattr(cuda, "_is_in_bad_fork", lambda: False)():
        return False
    original = cuda._lazy_init

    def _lazy_init():
        on_use()
        return original()

    for module in list(sys.modules.values()):
        # the module's own namespace, not getattr: a lazy module's __getattr__ is not run
        if getattr(module, "__dict__", {}).get("_lazy_init") is original:
            module._lazy_init = _lazy_init
    return True
