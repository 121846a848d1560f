"""forkguard.probe(): this process's (or another's) CUDA state and other fork hazards (a live GNU
OpenMP pool), and ensure_fork_safe()."""
from __future__ import annotations

import os
from typing import List, NamedTuple, Optional

from . import _native, _torch_fork
from ._native import Error


class Evidence(NamedTuple):
    """One observation: ``kind`` (library_mapped, device_file_open, driver_thread, openmp_pool,
    live_thread, ...), ``detail`` (what was seen) and ``source`` (where: /proc/PID/fd/7,
    dl_iterate_phdr, /proc/PID/task/*/syscall, ...). live_thread entries (other threads, with the
    library each is blocked in) are a note only: they never make fork unsafe."""

    kind: str
    detail: str
    source: str


class ProbeResult:
    """The probe's answer: ``verdict`` (clean, driver_loaded, nvml_open: fork is safe;
    initialized, context_active, poisoned: it is not; openmp_pool: GNU OpenMP's thread pool is
    live, so a forked child hangs at its first parallel CPU op (given where CUDA's verdict is
    fork-safe; otherwise CUDA's stands and the pool is evidence); for this process also torch's
    own flag: torch_fork_poisoned, torch_bad_fork: not safe either), ``fork_safe``,
    ``evidence``, ``notes`` (what could not be checked), ``summary`` and ``cures`` (the doctor's
    advice), ``pid``."""

    def __init__(self, native, torch: Optional[_torch_fork.TorchForkState] = None):
        self.pid: int = native.pid
        self.parent_pid: int = native.parent_pid
        self.verdict: str = native.verdict
        self.fork_safe: bool = native.fork_safe
        self.evidence: List[Evidence] = [Evidence(*e) for e in native.evidence]
        self.notes: List[str] = list(native.notes)
        self.summary: str = native.summary
        self.cures: List[str] = list(native.cures)
        if self.verdict == OPENMP_POOL:  # what decided first
            self.evidence.sort(key=lambda e: e.kind != OPENMP_POOL)
        if torch is not None:
            self._add_torch(torch)

    def _add_torch(self, torch: _torch_fork.TorchForkState) -> None:
        """torch's fork poison (seen only from inside this process: _torch_fork.py). The driver's
        verdict stands when it is already unsafe; torch's evidence is added either way."""
        evidence = [Evidence(*e) for e in torch.evidence]
        self.notes += torch.notes
        # A live OpenMP pool is the verdict only while CUDA is fork-safe: torch's poison, a CUDA
        # state, comes first (the pool stays in the evidence and its cures).
        cuda_unsafe = not self.fork_safe and self.verdict != OPENMP_POOL
        if torch.verdict is None or cuda_unsafe:
            self.evidence += evidence
        else:
            self.evidence = evidence + self.evidence  # what decided first
        if torch.verdict is None:
            return
        if not cuda_unsafe:
            self.verdict = torch.verdict
            self.fork_safe = False
            self.summary = _torch_fork.SUMMARIES[torch.verdict]
            self.cures = list(_torch_fork.CURES) + [c for c in self.cures
                                                    if c not in _torch_fork.CURES]
        else:
            self.cures += [c for c in _torch_fork.CURES if c not in self.cures]

    def __bool__(self) -> bool:
        return self.fork_safe

    def __repr__(self) -> str:
        return (f"ProbeResult(pid={self.pid}, verdict={self.verdict!r}, "
                f"fork_safe={self.fork_safe}, evidence={len(self.evidence)} items)")

    def __str__(self) -> str:
        lines = [f"PID {self.pid}: {self.verdict} ({'fork-safe' if self.fork_safe else 'NOT fork-safe'})"]
        if self.summary:
            lines.append(self.summary)
        for e in self.evidence:
            lines.append(f"  - {e.kind}: {e.detail} [{e.source}]")
        for n in self.notes:
            lines.append(f"  note: {n}")
        return "\n".join(lines)


# The cures that fit Python, before the doctor's general ones.
PYTHON_CURES = [
    "forkguard.notebook_launch(fn, nproc=N): ranks from a freshly executed interpreter, "
    "whatever this process did with CUDA",
    "multiprocessing.get_context('spawn') or 'forkserver' (and DataLoader(..., "
    "multiprocessing_context='spawn')) instead of fork",
    "forkguard.ImageLoader with worker_kind='thread' (no fork), or 'process' (workers from "
    "forkguard's fork server, started at import while this process was clean)",
    "move the first CUDA call (torch.cuda.*, .cuda(), .to('cuda')) after the fork",
]


# The cures for a live GNU OpenMP pool, in Python's words (the doctor's follow them).
OPENMP_CURES = [
    "torch.set_num_threads(1) (or OMP_NUM_THREADS=1 in the environment) before the first "
    "parallel CPU op of a process that will fork: one thread starts no pool",
    "multiprocessing.get_context('spawn') or 'forkserver' instead of fork",
    "forkguard.guard(): forks that would hang are rerouted (or refused) with the evidence",
]

OPENMP_POOL = "openmp_pool"


class ForkUnsafeError(Error):
    """This process holds state a fork()ed child cannot use: CUDA's (the child could not use
    CUDA) or a live GNU OpenMP pool (the child hangs at its first parallel CPU op).
    ``result`` is the ProbeResult; the message lists the evidence and the cures."""

    def __init__(self, result: ProbeResult):
        cures = PYTHON_CURES + result.cures
        if result.verdict == OPENMP_POOL:
            why = ("; a forked child hangs at its first parallel CPU op (GNU OpenMP's thread pool "
                   "does not survive fork: the child waits for ever for workers it does not "
                   "have), with no error and no GPU involved.")
            cures = OPENMP_CURES + [c for c in result.cures if c not in OPENMP_CURES]
        elif result.verdict in _torch_fork.SUMMARIES:
            why = (f"; {result.summary[0].lower()}{result.summary[1:]}"
                   if result.verdict == _torch_fork.BAD_FORK else
                   ": torch's fork poison is registered here (torch's flag, not the driver's), "
                   "so a forked child fails at its first torch CUDA use (\"Cannot re-initialize "
                   "CUDA in forked subprocess\"), even with no GPU or driver.")
        else:
            why = ("; CUDA state does not survive fork, so a forked child fails at its first "
                   "CUDA call (\"Cannot re-initialize CUDA in forked subprocess\", "
                   "CUDA_ERROR_NOT_INITIALIZED = 3).")
        lines = [f"fork is not safe here: this process (PID {result.pid}) is "
                 f"{result.verdict}{why}", "evidence:"]
        lines += [f"  - {e.kind}: {e.detail} [{e.source}]" for e in result.evidence]
        lines.append("cures:")
        lines += [f"  - {c}" for c in cures]
        super().__init__("\n".join(lines))
        self.result = result


def probe(pid: Optional[int] = None) -> ProbeResult:
    """The CUDA state of this process, or of ``pid``, and its other fork hazards. Never
    initializes CUDA: it reads /proc, the loaded libraries, and asks the driver only calls that
    initialize nothing. A live GNU OpenMP pool (torch's CPU ops after one parallel op, unless
    torch.set_num_threads(1) / OMP_NUM_THREADS=1) is verdict openmp_pool, not fork-safe. For this
    process it also reads torch's own fork poison (torch_fork_poison, torch_bad_fork evidence);
    for another process that flag cannot be seen (a note says so where libtorch_cuda is mapped),
    nor the OpenMP pool where its threads cannot be read (a note)."""
    if pid is not None and pid != os.getpid():
        return ProbeResult(_native.probe(pid))
    return ProbeResult(_native.probe(None), _torch_fork.state())


def probe_if_fork_unsafe() -> Optional[ProbeResult]:
    """None when this process is fork-safe, else its probe: the fast check at each start (the
    native one, microseconds without a driver or libgomp, tens of microseconds reading the
    threads where libgomp is mapped; then torch's flag, a byte read once resolved)."""
    native = _native.probe_if_fork_unsafe()
    if native is not None:
        return ProbeResult(native, _torch_fork.state())
    torch = _torch_fork.state()
    if torch.verdict is None:
        return None
    return ProbeResult(_native.probe(None), torch)


def ensure_fork_safe() -> ProbeResult:
    """Raises ForkUnsafeError (evidence and cures) unless fork is safe here; returns the probe.
    The automatic form of a hand-kept "cuda_touched" flag: call it before forking."""
    result = probe()
    if not result.fork_safe:
        raise ForkUnsafeError(result)
    return result
