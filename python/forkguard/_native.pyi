"""Typed stubs of forkguard's native layer (pybind11). Use the `forkguard` package instead."""
from typing import Any, Dict, List, Optional, Tuple, Union

__version__: str

class Error(RuntimeError):
    """The root of every exception forkguard raises."""

class DataError(Error):
    """A sample could not be read or transformed (names the index and the file), or misuse."""
    index: Optional[int]  # the sample's index in the dataset; None when no one sample is at fault
    key: Optional[str]  # its key (the file's path); None likewise

class WorkerError(Error):
    """A loader worker died or stopped itself (names the worker, its PID, the samples it held)."""
    worker: Optional[int]  # the worker's number; None when no single worker is at fault
    pid: Optional[int]  # its process (None for thread workers and failures before one existed)
    indices: List[int]  # the samples it held

class LoaderTimeoutError(Error):
    """A batch was not ready within the loader's timeout."""

class ProbeError(Error):
    """No such process, or not allowed to inspect it."""

class _ServerChild:
    """A child of the interpreter fork server (a rerouted Process), held by the pidfd the server
    opened before it could reap it."""

    @property
    def pid(self) -> int: ...
    def signal(self, sig: int) -> bool:
        """Sends sig unless it has exited (then nothing, whichever process has its PID now)."""
    def exited(self) -> bool: ...
    def close(self) -> None: ...

class _NotebookResult:
    json: str  # the result as `forkguard run --json-report` writes it
    report: str  # the launcher's report
    memfds: List[int]  # each rank's outcome by local rank (-1: none); the caller closes them

def _supervise_notebook(*, server_pid: int, server_sock: int, payload: bytes, nproc: int,
                        args: List[str], grace: float, bind_gpus: bool = ...,
                        max_restarts: int = ..., master_addr: str = ...,
                        master_port: Optional[int] = ..., env: Dict[str, str] = ...,
                        timeout: Optional[float] = ..., nnodes: int = ...,
                        node_rank: int = ...) -> _NotebookResult:
    """notebook_launch's ranks under the C++ supervisor."""

class _ProbeResult:
    pid: int
    parent_pid: int
    verdict: str
    fork_safe: bool
    evidence: List[Tuple[str, str, str]]
    notes: List[str]
    summary: str
    cures: List[str]

def visible_gpu_count() -> int: ...
def probe(pid: Optional[int] = ...) -> _ProbeResult:
    """The CUDA state of this process (or of pid); never initializes CUDA."""

def probe_if_fork_unsafe() -> Optional[_ProbeResult]: ...
def cuda_tripwire_unavailable() -> str:
    """'' where the CUDA fork tripwire can be armed in a fork of this process, else why not."""
def arm_cuda_tripwire() -> None:
    """Arms the CUDA fork tripwire in this process (a fork child); raises Error where it cannot."""
def cuda_tripwire_trips() -> int:
    """The cuInit calls the tripwire caught in this process."""

def start_fork_server() -> bool:
    """Starts the C++ fork server process workers come from, if this process is fork-safe and
    owns none; returns whether it owns one now."""

def stop_fork_server() -> None:
    """Stops this process's fork server and reaps it, as exit does (for a process that leaves
    by ``os._exit``)."""

def owns_fork_server() -> bool: ...
def fork_server_pid() -> Optional[int]:
    """The C++ fork server's PID. It is a clone child: a wait for any child (os.wait()) never
    finds it; os.waitpid(pid, 0x40000000) (__WALL) does."""

class Process:
    """A program started by the native layer (launch/child.hpp), held by its pidfd."""

    @property
    def pid(self) -> int: ...
    def poll(self) -> Optional[int]:
        """None while it runs, else its return code (minus the signal that killed it)."""
    @property
    def exit_status(self) -> Optional[Any]:
        """None while it runs, else how it ended (an _ExitStatus: str() says it)."""
    def wait(self, timeout: Optional[float] = ...) -> Optional[int]:
        """Its return code, or None when it still runs after `timeout` seconds."""
    def kill(self) -> None: ...

def start_process(argv: List[str], *, pass_fds: List[int] = ...,
                  name: Optional[str] = ...) -> Process:
    """Starts argv with this process's environment, stdin /dev/null, stdout and stderr
    inherited, `pass_fds` at their numbers and every other fd closed."""

class DLTensor:
    """A batch's images or labels: a DLPack producer over the loader's shared memory.

    torch.from_dlpack(t) and numpy.from_dlpack(t) take it without a copy (numpy.asarray too,
    through __array_interface__, for host tensors). The memory stays valid while this object or
    any tensor made from it lives."""

    def __dlpack__(self, stream: Optional[int] = ...) -> Any:
        """A new "dltensor" capsule over the same memory (device batches: after their copy; the
        consumer's `stream` is recorded, so the buffer is reused only after work queued there)."""
    def __dlpack_device__(self) -> Tuple[int, int]:
        """(1, 0) on the host (kDLCPU), (2, ordinal) on a GPU (kDLCUDA)."""
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str:
        """"float32", "float16", "uint8" or "int64" (labels)."""
    @property
    def device(self) -> str:
        """"cpu" or "cuda:N"."""
    @property
    def data_ptr(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def __array_interface__(self) -> Dict[str, Any]: ...
    @property
    def skipped(self) -> List[Dict[str, Any]]:
        """Samples the skip policy replaced in this batch: position, index, key, reason,
        substitute."""
    @property
    def keys(self) -> List[str]:
        """Each sample's key (its path), as os.fsdecode gives it: bytes that are not UTF-8 as
        lone surrogates (surrogateescape), so open() and os.fsencode() get the name back."""
    @property
    def epoch(self) -> int: ...
    @property
    def batch_number(self) -> int: ...
    @property
    def indices(self) -> List[int]:
        """The dataset indices, in batch order."""
    def __len__(self) -> int: ...

class _ImageLoaderArgs:
    root: Union[str, bytes]
    format: str
    batch_size: int
    workers: int
    worker_kind: str
    train: bool
    size: int
    resize: int
    dtype: str
    layout: str
    device: int
    seed: int
    shuffle: bool
    drop_last: bool
    distributed: bool
    bad_sample: str
    allow_empty: bool
    prefetch: int
    timeout: float
    scale_min: float
    scale_max: float
    ratio_min: float
    ratio_max: float
    flip: float
    mean: List[float]
    std: List[float]
    def __init__(self) -> None: ...

class _ImageLoader:
    def __init__(self, args: _ImageLoaderArgs) -> None: ...
    def next(self) -> Optional[Tuple[DLTensor, DLTensor]]:
        """The next batch, or None at the end of the epoch (the GIL is released while waiting)."""
    def set_epoch(self, epoch: int) -> None: ...
    def epoch(self) -> int: ...
    def in_epoch(self) -> bool:
        """An epoch is under way (started, not ended, not abandoned by an error or set_epoch)."""
    def size(self) -> int: ...
    def dataset_size(self) -> int: ...
    def worker_pids(self) -> List[int]: ...
    def stats(self) -> Dict[str, float]: ...
    def close(self) -> None: ...
