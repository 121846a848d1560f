"""forkguard.DataLoader: torch.utils.data.DataLoader whose workers never meet "Cannot re-initialize
CUDA in forked subprocess".

torch's class does everything but the workers: the constructor and its checks, the samplers (so
the same order for the same generator), collation, len(), the single-process iterator. With
num_workers > 0 the iterator is forkguard's: the loader core (src/data/job_workers.hpp, through
_native._JobQueue) starts the workers, hands them the batches' indices round-robin with
prefetch_factor batches in flight per worker, moves each collated batch through the worker's
memfd slot (tensors and arrays written once, viewed here without a copy; nothing in /dev/shm) and
delivers the batches in order, reporting a worker that died with its PID, signal and the samples
it held. The workers are forks of this process (nothing pickled, as torch does), even after it
initialized CUDA: a forked worker that then tries CUDA is caught, and the loader moves to children
of forkguard's clean interpreter fork server, which receive the dataset, collate_fn and
worker_init_fn by value (cloudpickle). See NOTE [ CUDA in a forked worker ].

NOTE [ CUDA in a forked worker ]
A parent that initialized CUDA (or, with torch's CUDA build, merely asked
torch.cuda.is_available(): torch's fork poison) cannot give a forked child CUDA. Most workers
never touch it, and for them fork is what users chose: milliseconds to start, the parent's pages
and objects shared (open files, connections, locks, lambdas), nothing pickled. So "auto" forks
them anyway, and each such worker watches for its first CUDA attempt (_dataloader_worker.ForkWatch):
torch's lazy init (which raises "Cannot re-initialize CUDA in forked subprocess" there) and, where
the parent's driver is initialized, the driver's cuInit (forkguard's tripwire answers it with the
driver's own CUDA_ERROR_NOT_INITIALIZED and counts it: src/cuda/fork_tripwire.hpp). Whoever
catches the error (the dataset may swallow it), the worker's batch is replaced by a "cuda_in_fork"
note; the loader discards every batch in flight, starts its workers from the clean fork server
and asks them for those batches first (an IterableDataset's pass is replayed up to where it was),
and keeps clean workers for its later passes. No batch the loop receives was made by a worker in
which CUDA could not start. The cost: a sample in flight at that moment is fetched twice (once in
the fork, once in the clean worker), which a dataset with side effects sees (docs/python.md).
Where the driver's cuInit cannot be watched (fork_tripwire_unavailable), "auto" starts clean
workers from the start, as before. worker_start="fork" is watched too, but keeps its workers:
it says so once and the batch goes on.

NOTE [ One clean process per loader ]
Clean workers (after a forked worker's CUDA attempt, worker_start="server", a spawn or forkserver
multiprocessing_context) cannot share this process's pages: the dataset, collate_fn and
worker_init_fn must travel. They travel once per loader, not once per worker: the interpreter
fork server forks the loader's own fork server (_server.py's _dataloader_zygote_main), which
loads the spec from a memfd, imports what its pickle refers to, puts the result out of the
collector's reach (gc.freeze) and then forks each worker, which shares those pages as forks of
one process do. The installed libraries the spec imported (library_modules: torchvision, PIL...;
never the user's own modules) are preloaded into the interpreter server for the loaders after it,
so that a non-persistent loader's later passes do not import them again. A spec that cannot be
loaded there is an error naming that process, with its traceback on stderr.
"""
import atexit
import collections
import gc
import itertools
import json
import multiprocessing
import operator
import os
import pickle
import signal
import socket
import sys
import warnings
import weakref
from typing import TypeVar

import torch
from torch.utils.data import IterDataPipe, MapDataPipe
from torch.utils.data import dataloader as _torch_dl
from torch.utils.data.dataloader import DataLoader as _TorchDataLoader

from . import _accelerate_prepare
from . import _batch_codec, _dataloader_worker, _native, _torch_compat, _torch_fork
from ._probe import OPENMP_POOL, probe_if_fork_unsafe

T_co = TypeVar("T_co", covariant=True)

_WORKER_STARTS = ("auto", "fork", "server")
_CUDA_POLICIES = ("warn", "error", "allow")
_BAD_SAMPLE = ("error", "skip")
_WORKER_NAME = "fg-dl-worker"  # the workers' process name prefix (ps): fg-dl-worker-W
_said = set()


class CudaInWorkerError(RuntimeError):
    """A DataLoader worker initialized CUDA, and cuda_in_workers="error"."""


class CudaInWorkerWarning(UserWarning):
    """A DataLoader worker initialized CUDA (cuda_in_workers="warn", said once per loader)."""


class DataLoader(_TorchDataLoader[T_co]):
    """torch.utils.data.DataLoader, with forkguard's workers. Keyword-only extras:

    worker_start: "auto" forks the workers, as torch does, even after this process initialized
        CUDA; a forked worker that then tries CUDA (which cannot start in it) is caught, its
        batches are made again by workers from forkguard's clean fork server, and the loader
        keeps those (NOTE [ CUDA in a forked worker ]). "server" starts them clean at once;
        "fork" forks them whatever happens (the environment variable FORKGUARD_WORKER_START
        overrides "auto").
    cuda_in_workers: what a worker that initialized CUDA gets: "warn" (once), "error"
        (CudaInWorkerError naming the stage), "allow".
    seed: every sample's random state (Python's, numpy's, torch's) derives from (seed, epoch,
        index): the same batches for any num_workers and worker_start.
    bad_sample: "error" re-raises a sample's exception (torch's behaviour); "skip" replaces the
        sample by another, chosen deterministically, counted and said once per index (an
        IterableDataset's failing element is dropped, counted and said).

    Also: state_dict() / load_state_dict() (torchdata's StatefulDataLoader names) resume mid-epoch
    (an IterableDataset with its own state_dict/load_state_dict goes on from each worker's state;
    one without is replayed up to there);
    set_epoch(e) numbers the next pass (for seed); `stats` has, per pass, the batches, the samples
    skipped, and the Pss of this process and of the workers.
    """

    def __init__(self, dataset, *args, worker_start="auto", cuda_in_workers="warn", seed=None,
                 bad_sample="error", **kwargs):
        # torch's own parameters (its signature is this class's: see below) go to torch's
        # constructor as given, so their defaults, checks and messages are the installed torch's.
        for name, value, allowed in (("worker_start", worker_start, _WORKER_STARTS),
                                     ("cuda_in_workers", cuda_in_workers, _CUDA_POLICIES),
                                     ("bad_sample", bad_sample, _BAD_SAMPLE)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, "
                                 f"not {value!r}")
        if seed is not None and not isinstance(seed, int):
            raise ValueError(f"seed must be an int or None, not {seed!r}")
        self.worker_start = worker_start
        self.cuda_in_workers = cuda_in_workers
        self.seed = seed
        self.bad_sample = bad_sample
        self._next_epoch = 0  # the number of the next pass
        self._resume = None  # a state to resume from, at the next pass's start
        self._live = None  # weak reference to the iterator of the current pass
        self.stats = {"epochs": []}
        super().__init__(dataset, *args, **kwargs)
        if self.num_workers > 0:
            # torch takes a float for either and fails in iter() (range(2.5)): said here
            for name in ("num_workers", "prefetch_factor"):
                value = getattr(self, name)
                try:
                    operator.index(value)
                except TypeError as e:
                    raise TypeError(f"{name} must be an integer, not {value!r} (torch: {e})") \
                        from None
        _accelerate_prepare.install_if_loaded()  # prepare() keeps forkguard's workers

    def _get_iterator(self):
        if self.num_workers == 0:
            return _SingleIter(self)
        self.check_worker_number_rationality()
        return _Iter(self)

    def __getstate__(self):
        # torch's DataLoader pickles (accelerate's GradientState holds every prepared loader):
        # the weak reference to a live pass does not, and means nothing in another process
        state = dict(self.__dict__)
        state["_live"] = None
        return state

    def set_epoch(self, epoch):
        """The number of the next pass (with `seed`, each sample's random state depends on it)."""
        self._next_epoch = int(epoch)

    def state_dict(self):
        """Where this loader is: after the batches the current pass has yielded so far (or at the
        next pass's start). A loader given it by load_state_dict() yields what this one would."""
        it = self._live() if self._live is not None else None
        if it is None or it._fg_done:
            return {"epoch": self._next_epoch, "yielded": 0, "rng": _rng_state(self),
                    "base_seed": None}
        state = {"epoch": it._fg_epoch, "yielded": it._num_yielded, "rng": it._fg_rng,
                 "base_seed": it._base_seed, "num_workers": self.num_workers}
        if it._fg_stateful:  # an IterableDataset that says where it is: each worker's copy's
            state.update(dataset_states=dict(it._fg_states), next_worker=it._fg_next_worker)
        return state

    def load_state_dict(self, state):
        """The next pass resumes where `state` (from state_dict()) was taken."""
        for key in ("epoch", "yielded", "rng", "base_seed"):
            if key not in state:
                raise ValueError(f"load_state_dict: the state has no {key!r} (keys: "
                                 f"{sorted(state)}): not a forkguard.DataLoader state")
        self._check_state(state)
        if "dataset_states" in state and state["num_workers"] != self.num_workers:
            raise ValueError(
                f"load_state_dict: the state holds the IterableDataset states of "
                f"{state['num_workers']} workers (each resumes its own copy's iteration) and "
                f"this loader has num_workers={self.num_workers}: resume with as many workers")
        if self._dataset_kind == _torch_dl._DatasetKind.Iterable and state["yielded"] and \
                "dataset_states" not in state and \
                state.get("num_workers", self.num_workers) != self.num_workers:
            # each worker iterates its own copy (sharded by get_worker_info()) and the batches
            # come from them in turn: another count replays other batches
            raise ValueError(
                f"load_state_dict: the state was taken after {state['yielded']} batches of an "
                f"IterableDataset without state_dict()/load_state_dict(), which a resumed pass "
                f"replays, with num_workers={state['num_workers']} (its batches depend on the "
                f"worker count), and this loader has num_workers={self.num_workers}: resume "
                f"with as many workers")
        self._resume = dict(state)
        self._next_epoch = state["epoch"]
        if self._iterator is not None:  # persistent workers: the next pass restarts its iterator
            self._iterator._shutdown_workers()
            self._iterator = None


    def _check_state(self, state):
        """A ValueError naming what in `state` no state_dict() gives."""
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        yielded, rng = state["yielded"], state["rng"]
        if not is_int(state["epoch"]):
            raise ValueError(f"load_state_dict: epoch={state['epoch']!r}: the pass's number must "
                             f"be an int")
        if not is_int(yielded) or yielded < 0:
            raise ValueError(f"load_state_dict: yielded={yielded!r}: the count of batches the "
                             f"pass yielded must be an int, 0 or more")
        if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8):
            raise ValueError(f"load_state_dict: rng is a {type(rng).__name__}, not a generator's "
                             f"state (a uint8 tensor)")
        if state["base_seed"] is not None and not is_int(state["base_seed"]):
            raise ValueError(f"load_state_dict: base_seed={state['base_seed']!r}: the workers' "
                             f"base seed must be an int or None")
        if "num_workers" in state and (not is_int(state["num_workers"]) or
                                       state["num_workers"] < 0):
            raise ValueError(f"load_state_dict: num_workers={state['num_workers']!r} must be an "
                             f"int, 0 or more")
        if self._dataset_kind == _torch_dl._DatasetKind.Map:
            try:
                batches = len(self)
            except TypeError:  # a sampler without a length
                return
            if yielded > batches:
                raise ValueError(f"load_state_dict: yielded={yielded}: a pass of this loader "
                                 f"has {batches} batches")


DataLoader.__init__.__signature__ = _torch_compat.loader_signature(_TorchDataLoader.__init__,
                                                                 DataLoader.__init__)

_live_iterators = weakref.WeakSet()
_frozen_by = 0  # iterators with forked workers running


def _freeze():
    """Before forking workers: the objects that exist now out of the collector's reach, so that a
    worker's collections do not write to every page of the dataset's objects it shares."""
    global _frozen_by
    _frozen_by += 1
    gc.freeze()


def _unfreeze():
    """Once the last iterator with forked workers stopped: back in reach (cycles made before a
    fork would otherwise never be collected)."""
    global _frozen_by
    _frozen_by -= 1
    if _frozen_by == 0:
        gc.unfreeze()


@atexit.register
def _stop_workers_at_exit():
    # Before the fork servers are stopped (registered earlier, so run later): a worker that
    # still holds a copy of a server's socket would keep that server waiting for EOF, and the
    # interpreter's exit waiting for the server. torch's workers notice the exit by a watchdog.
    for it in list(_live_iterators):
        it._shutdown_workers()


def _rng_state(loader):
    return loader.generator.get_state() if loader.generator is not None else torch.get_rng_state()


def _set_rng_state(loader, state):
    if loader.generator is not None:
        loader.generator.set_state(state)
    else:
        torch.set_rng_state(state)


class _Pass:
    """What forkguard adds to both iterators: the pass's number and where it resumes."""

    def _begin_pass(self, loader):
        """At the start of a pass, before any index is drawn: restores a state to resume from,
        or records this one."""
        state, loader._resume = loader._resume, None
        if state is not None:
            _set_rng_state(loader, state["rng"])
            self._fg_epoch = state["epoch"]
        else:
            self._fg_epoch = loader._next_epoch
        loader._next_epoch = self._fg_epoch + 1
        self._fg_rng = _rng_state(loader)
        if loader.seed is not None and loader.generator is None and \
                self._dataset_kind == _torch_dl._DatasetKind.Map:
            self._seed_order(loader.seed)
        self._fg_done = False
        self._fg_batches = 0
        self._fg_skipped = 0
        self._fg_discard = 0
        # An IterableDataset with state_dict()/load_state_dict(): after each batch yielded, the
        # state of the dataset copy that made it (by worker), and the worker the next one is
        # asked of; a resumed pass starts there instead of replaying.
        self._fg_stateful = _dataloader_worker.stateful(self._dataset_kind, self._dataset)
        self._fg_states = {}
        self._fg_next_worker = 0
        self._fg_first_worker = -1
        loader._live = weakref.ref(self)
        if state is not None and self._fg_stateful and "dataset_states" in state:
            self._fg_states = dict(state["dataset_states"])
            self._fg_next_worker = self._fg_first_worker = state["next_worker"]
            self._num_yielded = state["yielded"]
        elif state is not None and state["yielded"]:
            if self._dataset_kind == _torch_dl._DatasetKind.Map:
                for _ in range(state["yielded"]):  # the sampler's indices of what was yielded
                    try:
                        next(self._sampler_iter)
                    except StopIteration:
                        break
            else:  # an iterable is replayed: its batches up to there are made and dropped
                self._fg_discard = state["yielded"]
            self._num_yielded = state["yielded"]

    def _seed_order(self, seed):
        """seed= without a generator: the sampler's order a function of (seed, epoch), whatever
        num_workers (torch's samplers draw their order's seed from the global generator at their
        first index, which the training loop and, with num_workers=0, the samples move): that
        first index drawn with the generator seeded for the pass, then the caller's state put
        back."""
        it = self._sampler_iter
        kept = torch.default_generator.get_state()
        torch.default_generator.manual_seed(
            _dataloader_worker.sample_seed(seed, self._fg_epoch, "sampler order"))
        try:
            first = [next(it)]
        except StopIteration:
            first = []
        finally:
            torch.default_generator.set_state(kept)
        self._sampler_iter = itertools.chain(first, it)

    def _drop_replayed(self, next_batch):
        """An iterable resumed mid-pass: the batches before the state's are made and dropped."""
        while self._fg_discard:
            try:
                next_batch()
            except StopIteration:
                made = self._num_yielded - self._fg_discard
                self._fg_discard = 0
                raise ValueError(
                    f"load_state_dict: the state was taken after {self._num_yielded} batches of "
                    f"the pass, and the IterableDataset, replayed, ended after {made}: it does "
                    f"not yield what it yielded then") from None
            self._fg_discard -= 1

    def _end_pass(self, loader_stats, pids):
        if self._fg_done:
            return
        self._fg_done = True
        loader_stats["epochs"].append({
            "epoch": self._fg_epoch, "batches": self._fg_batches, "skipped": self._fg_skipped,
            "main_pss": _pss(os.getpid()), "workers_pss": sum(_pss(p) for p in pids)})


def _pss(pid):
    """The proportional set size of a process, in bytes (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class _SingleIter(_Pass, _torch_dl._SingleProcessDataLoaderIter):
    """torch's single-process iterator, with seed, bad_sample and resumption."""

    def __init__(self, loader):
        super().__init__(loader)
        self._fg_stats = loader.stats
        self._begin_pass(loader)
        spec = {"dataset_kind": self._dataset_kind, "seed": loader.seed,
                "bad_sample": loader.bad_sample, "auto_collation": self._auto_collation,
                "collate_fn": self._collate_fn, "drop_last": self._drop_last}
        self._fg_reseeds = (loader.seed is not None and
                            self._dataset_kind == _torch_dl._DatasetKind.Map)
        resumed = self._fg_states.get(0)
        if resumed is not None:  # the dataset goes on from its state: its iterator made anew
            self._dataset.load_state_dict(resumed)
        if spec["seed"] is not None or spec["bad_sample"] == "skip":
            self._dataset_fetcher, self._fg_guard = _dataloader_worker.fetcher(
                spec, self._dataset, self._fg_epoch, in_main=True)
        else:
            self._fg_guard = None
            if resumed is not None:
                self._dataset_fetcher = _torch_dl._DatasetKind.create_fetcher(
                    self._dataset_kind, self._dataset, self._auto_collation, self._collate_fn,
                    self._drop_last)

    def _next_data(self):
        # seed=: the samples seed this process's generators, which are the training loop's:
        # their states are put back after each batch
        kept = _dataloader_worker.generator_states() if self._fg_reseeds else None
        try:
            self._drop_replayed(super()._next_data)
            data = super()._next_data()
        except StopIteration:
            self._end_pass(self._fg_stats, [])
            raise
        finally:
            if kept is not None:
                _dataloader_worker.restore_generators(kept)
        if self._fg_stateful:
            self._fg_states[0] = self._dataset.state_dict()
        self._fg_batches += 1
        if self._fg_guard is not None and self._fg_guard.skipped:
            self._fg_skipped += len(self._fg_guard.skipped)
            self._fg_guard.skipped = []
        return data


def _pin_ordinal(device):
    """The visible CUDA device whose driver page-locks the slots for pin_memory (torch's current
    one unless `pin_memory_device` names one), or -1 where the pinning is another backend's (then
    torch's pin_memory copies each batch, as it does for torch)."""
    if device:
        d = torch.device(device)
        if d.type != "cuda":
            return -1
        if d.index is not None:
            return d.index
    try:
        return torch.cuda.current_device()
    except Exception:  # a PyTorch without CUDA told that it is available (a test driver)
        return 0


def _start_method(loader):
    """(start, why, watch): how this loader's workers start ("fork" or "server"), why, and what
    forked workers of a process that is not fork-safe watch ({"driver": the driver's cuInit too,
    "reroute": a worker's CUDA use moves the loader to clean workers}; None for the others).
    NOTE [ CUDA in a forked worker ] says why "auto" forks there too."""
    choice = loader.worker_start
    if choice == "auto":
        choice = os.environ.get("FORKGUARD_WORKER_START", "auto")
        if choice not in _WORKER_STARTS:
            raise ValueError(f"FORKGUARD_WORKER_START must be one of "
                             f"{', '.join(_WORKER_STARTS)}, not {choice!r}")
    why = f"worker_start={choice!r}"
    ctx = loader.multiprocessing_context
    if choice == "auto" and ctx is not None:
        method = ctx.get_start_method()
        if method in ("spawn", "forkserver"):
            # A clean interpreter is what was asked for: the fork server gives one, faster.
            return "server", f"multiprocessing_context={method!r}", None
        if method == "fork":
            choice, why = "fork", "multiprocessing_context='fork'"
    if choice == "auto" and getattr(loader, "_fg_clean_workers", False):
        return "server", "a worker of this loader tried CUDA in a fork", None
    if choice == "server":
        return "server", why, None
    dirty = probe_if_fork_unsafe()  # the driver's state, torch's fork poison, thread pools
    if dirty is None:
        return "fork", why if choice == "fork" else "this process is fork-safe", None
    if dirty.verdict == OPENMP_POOL:
        # A live GNU OpenMP pool hangs a forked child at its first parallel region with more
        # than one thread; a worker runs torch with one (torch.set_num_threads(1) before any
        # user code, as torch's own workers), so it never waits for the parent's pool.
        return "fork", (f"this process (PID {os.getpid()}) has a live GNU OpenMP pool; the "
                        "workers run torch with one thread"), None
    state = f"this process (PID {os.getpid()}) is {dirty.verdict}"
    watch = {"driver": dirty.verdict not in _torch_fork.SUMMARIES, "reroute": choice == "auto"}
    unwatched = _native.cuda_tripwire_unavailable() if watch["driver"] else ""
    if unwatched and choice == "auto":
        # A swallowed driver error could not be seen in a fork: clean workers from the start.
        key = ("server", dirty.verdict)
        if key not in _said:
            _said.add(key)
            print(f"forkguard.DataLoader: {state} ({dirty.summary}), and a forked worker's CUDA "
                  f"use could not be seen here ({unwatched}), so its workers start from "
                  "forkguard's clean fork server (the dataset, collate_fn and worker_init_fn "
                  "travel by value).", file=sys.stderr, flush=True)
        return "server", f"{state}, unwatched", None
    watch["driver"] = watch["driver"] and not unwatched
    return "fork", state, watch


def _dumps(spec):
    """The workers' spec pickled to travel (a _travel.Parcel: functions and classes of __main__
    by value, multiprocessing's objects as to a forkserver child); an error names the attribute
    that cannot travel."""
    from . import _travel

    try:
        return _travel.pack(spec)
    except Exception as e:  # noqa: BLE001 - re-raised with the path to what failed
        path = _unpicklable_path(spec, "", set())
        raise TypeError(
            f"forkguard.DataLoader: the workers start from the clean fork server, so the "
            f"dataset, collate_fn and worker_init_fn travel by value, and "
            f"{path or 'the dataset'} cannot ({type(e).__name__}: {e}). Give that object "
            f"__getstate__/__setstate__ (open it again in the worker, e.g. in worker_init_fn), "
            f"or keep this process fork-safe so that workers are forked.") from e


def _unpicklable_path(obj, path, seen):
    """The deepest attribute path under obj that cannot travel (_travel.check), or ""."""
    from . import _travel

    if id(obj) in seen:
        return ""
    seen.add(id(obj))
    children = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]" if path else str(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    for child_path, child in children:
        try:
            _travel.check(child)
        except Exception:  # noqa: BLE001 - this one fails: look deeper, but not into a library
            name = f"{child_path} ({type(child).__module__}.{type(child).__qualname__})"
            if type(child).__module__.split(".")[0] in ("multiprocessing", "torch", "socket",
                                                         "sqlite3", "threading", "_io", "io"):
                return name
            return _unpicklable_path(child, child_path, seen) or name
    return ""


_hold_keys = itertools.count()
# The installed libraries the loaders' specs imported in their fork servers (library_modules):
# the interpreter server preloads them before the next loader's, so that a torchvision dataset's
# pass does not import torchvision again (non-persistent workers: at every pass).
_learned_preload = set()


class _ServerJobQueue(_native._JobQueue):
    """The job queue of clean workers: NOTE [ One clean process per loader ]. The spec (a
    _travel.Parcel) goes once, in a memfd, to the loader's own fork server, a child of the clean
    interpreter fork server that loads it and forks the workers; the fds the spec refers to are
    held by the interpreter server while it forks that process, which the workers inherit them
    from; the semaphore twins live as long as the workers (a persistent loader's, across passes)
    and are given back once they stopped."""

    def __init__(self, server, parcel, workers, prefetch, pin_device):
        self._zygote = self._link = None
        self._server = server
        key = None
        if parcel.fds:
            key = f"{os.getpid()}-{next(_hold_keys)}"
            self._ask(server, ["dataloader_hold", key], parcel.fds, "held")
        try:
            try:
                self._start_zygote(server, key, parcel.data)
                parcel.data = None  # loaded there: this process keeps only the twins to give back
            finally:
                if key is not None:  # its fork server has been forked: it holds its own copies
                    self._ask(server, ["dataloader_release", key], [], "released")
            super().__init__(workers=workers, prefetch=prefetch, start=_native._JobStart.SERVER,
                             server_pid=self._zygote.pid, server_sock=self._link.fd(),
                             server_function="forkguard.dataloader_worker", setup=b"",
                             pin_device=pin_device, name=_WORKER_NAME)
        except BaseException:
            self._stop_zygote()
            parcel.give_back()
            raise
        self._parcel = parcel

    def _start_zygote(self, server, key, data):
        memfd = os.memfd_create("forkguard-dataloader-spec", os.MFD_CLOEXEC)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with os.fdopen(os.dup(memfd), "wb") as f:  # _dataloader_worker.load_spec reads it
                head = json.dumps(key).encode()
                f.write(len(head).to_bytes(4, "little"))
                f.write(head)
                f.write(data)
            self._zygote = server.start_child(["call", "forkguard.dataloader_zygote"],
                                              [1, 2, theirs.fileno(), memfd])
        finally:
            theirs.close()
            os.close(memfd)
        try:
            self._link = _native._ServerLink(self._zygote.pid, ours.fileno())
        finally:
            ours.close()
        try:
            ready = self._link.exchange([], [], None)
        except _native.Error as e:
            raise RuntimeError(
                f"forkguard.DataLoader: the clean process that loads the dataset, collate_fn and "
                f"worker_init_fn for the workers (PID {self._zygote.pid}, a child of forkguard's "
                f"fork server) could not load them: {e}; its traceback is on stderr above") \
                from None
        _learned_preload.update(json.loads(ready[2]))

    @staticmethod
    def _ask(server, fields, fds, expect):
        from . import _launch

        _launch._exchange(server, fields, fds, expect, who="forkguard.DataLoader")

    def _stop_zygote(self):
        """Once its workers stopped: the loader's fork server killed, its exit report taken."""
        zygote, self._zygote = self._zygote, None
        if zygote is None:
            return
        if self._link is not None:
            self._link.close()
        zygote.signal(signal.SIGKILL)
        try:
            self._server.link.wait_exit(zygote.pid, 10.0)
        except _native.Error:  # the interpreter server is gone, and it with it
            pass

    def ended(self):
        """Why the workers died with their fork server: the interpreter server's end where it
        ended (the loader's fork server dies with it), else the loader's fork server's."""
        status = self._server.proc.exit_status
        if status is None:
            return None
        return f"the fork server (PID {self._server.pid}) ended ({status})"

    def stop(self, now=False):
        try:
            super().stop(now)
        finally:
            try:
                self._stop_zygote()
            finally:
                self._parcel.give_back()


class _Restarted(Exception):
    """The iterator's workers were replaced by clean ones mid-pass: ask the next batch again."""


class _WorkerProcess:
    """torch's iterator lists its workers as multiprocessing.Process objects: the same answers."""

    def __init__(self, queue, worker):
        self._queue, self._worker = queue, worker
        self.pid = queue.pid(worker)

    def _status(self, timeout=0.0):
        return self._queue.exit_status(self._worker, timeout)

    def is_alive(self):
        return self._status() is None

    def join(self, timeout=None):
        self._status(3600.0 * 24 if timeout is None else timeout)

    @property
    def exitcode(self):
        s = self._status()
        if s is None:
            return None
        return -s.signal if s.signal else s.code

    def terminate(self):
        self._signal(signal.SIGTERM)

    def kill(self):
        self._signal(signal.SIGKILL)

    def _signal(self, sig):
        # Through the worker's handle in the queue (a pidfd): once it has exited this sends
        # nothing, even when its PID is another process's by then.
        self._queue.signal(worker=self._worker, sig=sig)


class _Iter(_Pass, _torch_dl._BaseDataLoaderIter):
    def __init__(self, loader):
        self._shutdown = True  # until the workers started
        super().__init__(loader)
        self._prefetch_factor, self._in_order = _torch_compat.worker_settings(loader)
        if self._prefetch_factor <= 0:  # torch 1.13's constructor says so already, 2.x's here
            raise AssertionError(
                "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")
        if multiprocessing.current_process().daemon:
            # torch's workers are multiprocessing's daemonic processes, which refuse to start
            # children (so does a worker of forkguard's: see _dataloader_worker.Worker)
            raise AssertionError("daemonic processes are not allowed to have children")
        self._frozen = False
        # (exception class, text) of what stopped the workers mid-pass: every later pass of
        # persistent workers raises it (torch's iterator, once a worker died, raises "exited
        # unexpectedly" at each iter(): never a pass with no batch and no error)
        self._fg_stopped_by = None
        self._fg_stats = loader.stats
        if loader._resume is not None and loader._resume["base_seed"] is not None:
            self._base_seed = loader._resume["base_seed"]  # the workers' seeds, as they were
        epoch = loader._resume["epoch"] if loader._resume is not None else loader._next_epoch
        self._cuda_policy = loader.cuda_in_workers
        # CudaInWorkerWarning is said once per loader (the clean workers a forked worker's
        # CUDA use moved it to then use CUDA as expected)
        self._cuda_said = getattr(loader, "_fg_cuda_said", False)
        worker_init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            import functools

            worker_init_fn = functools.partial(_torch_dl._sharding_worker_init_fn,
                                               worker_init_fn, self._world_size, self._rank)
        start, self._why, watch = _start_method(loader)
        self._fg_loader = weakref.ref(loader)
        # pin_memory: the slots page-locked once, here, so the batches that view them are pinned
        # as they are (torch's pin_memory returns a pinned tensor itself: no copy, no thread).
        self._fg_pin_device = _pin_ordinal(self._pin_memory_device) if self._pin_memory else -1
        self._fg_redo = collections.deque()  # indices to fetch again, before the sampler's
        self._fg_spec = {
            "dataset_kind": self._dataset_kind, "dataset": self._dataset,
            "auto_collation": self._auto_collation, "collate_fn": self._collate_fn,
            "drop_last": self._drop_last, "base_seed": self._base_seed,
            "worker_init_fn": worker_init_fn, "num_workers": self._num_workers,
            "shared_seed": self._shared_seed, "seed": loader.seed, "epoch": epoch,
            "cuda_in_workers": loader.cuda_in_workers, "bad_sample": loader.bad_sample,
            # a resumed IterableDataset: each worker's copy loads its own state first
            "dataset_states": (loader._resume or {}).get("dataset_states"),
            # forked workers of a process that is not fork-safe: what they watch (ForkWatch)
            "fork_watch": watch,
        }
        self._start_workers(start)
        self._reset(loader, first_iter=True)

    def _start_workers(self, start):
        """Starts the workers ("fork" or "server") on self._fg_spec."""
        from . import _launch

        spec = self._fg_spec
        if start == "fork":
            # The dataset's objects out of the collector's reach: a forked worker's reference
            # counting alone then dirties their pages, not a collection walking all of them.
            _freeze()
            self._frozen = True
            server = _launch._server  # its socket: the Python fork server's EOF is its exit
            queue = _native._JobQueue(
                workers=self._num_workers, prefetch=self._prefetch_factor,
                start=_native._JobStart.FORK, body=_dataloader_worker.make(spec),
                close_in_child=[server.fd()] if server is not None else [],
                pin_device=self._fg_pin_device, name=_WORKER_NAME)
        else:
            parcel = _dumps(dict(spec, cwd=os.getcwd(), sys_path=list(sys.path),
                                 argv=list(sys.argv), by_value=True, fork_watch=None))
            # The worker module (and forkguard's extension) loaded once in the server, not in
            # each loader's fork server; and the libraries earlier loaders' specs imported.
            _launch.start_server(
                preload=_launch.default_preload() + ["cloudpickle", "forkguard._dataloader_worker"]
                + sorted(_learned_preload), wait=True)
            queue = _ServerJobQueue(_launch._server, parcel, self._num_workers,
                                    self._prefetch_factor, self._fg_pin_device)
        self._queue = queue
        self._shutdown = False
        _live_iterators.add(self)
        self._workers = [_WorkerProcess(queue, w) for w in range(self._num_workers)]
        try:
            queue.await_started()
        except Exception:
            self._shutdown_workers()
            raise

    def _reset(self, loader, first_iter=False):
        if not first_iter and self._shutdown:
            kind, text = self._fg_stopped_by or (
                RuntimeError, "DataLoader's persistent workers were stopped")
            raise kind(text)
        super()._reset(loader, first_iter)
        self._task_info = {}  # job -> the sampler's index (or indices) it fetches
        if not first_iter and loader.seed is not None:
            # what a new iterator draws from the generator (torch's base seed), so that with
            # seed= the generator (and so the next pass's order) goes as with num_workers=0 or
            # workers that are not persistent, whose every pass is a new iterator
            torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
        self._begin_pass(loader)
        if not first_iter:
            # What the last pass left in flight is dropped; a worker that died meanwhile is not.
            while (r := self._queue.next(None)) is not None:
                self._check(r)
            self._queue.reactivate()
            resumed = set()
            request = pickle.dumps(("resume", self._shared_seed, self._fg_epoch))
            for w in range(self._num_workers):
                resumed.add(self._queue.submit(request, w))
            while resumed:
                r = self._queue.next(None)
                if r is None:
                    break
                self._check(r)
                resumed.discard(r.job)
        self._fill()

    def _fill(self):
        while self._queue.wants_job():
            if self._fg_redo:
                index = self._fg_redo.popleft()
            else:
                try:
                    index = self._next_index()
                except StopIteration:
                    return
            job = self._queue.submit(pickle.dumps(("fetch", index), protocol=5),
                                     self._fg_first_worker, in_order=self._in_order)
            self._fg_first_worker = -1  # then round-robin from there
            self._task_info[job] = index

    def _check(self, r):
        """Raises for a timeout or a dead worker."""
        if r.kind == _native._JobResult.TIMEOUT:
            raise RuntimeError("DataLoader timed out after {} seconds".format(self._timeout))
        if r.kind == _native._JobResult.DIED:
            pid, sig, code = r.pid, r.status.signal, r.status.code
            indices = [self._task_info[j] for j in r.held if j in self._task_info]
            self._shutdown_workers()
            self._fg_stopped_by = (
                RuntimeError, "DataLoader worker (pid(s) {}) exited unexpectedly".format(pid))
            if r.message:  # its fork server ended, and took it along
                ended = getattr(self._queue, "ended", lambda: None)() or \
                    bytes(r.message).decode(errors="replace")
                text = "DataLoader worker (pid {}) exited unexpectedly: {}, and its workers " \
                    "with it. ".format(pid, ended)
            elif sig:
                text = "DataLoader worker (pid {}) is killed by signal: {}. ".format(
                    pid, signal.strsignal(sig))
            else:
                text = "DataLoader worker (pid {}) exited unexpectedly with exit code {}. ".format(
                    pid, code)
            if indices:
                text += "It held the samples {}.".format(
                    ", ".join(_dataloader_worker._short(i) for i in indices))
            raise RuntimeError(text)

    def _next_data(self):
        while True:
            try:
                self._drop_replayed(self._next_batch)
                data = self._next_batch()
                break
            except _Restarted:  # on clean workers now: what was in flight is asked of them
                continue
        self._fg_batches += 1
        return data

    def _next_batch(self):
        while True:
            if self._shutdown:
                raise StopIteration
            self._fill()
            r = self._queue.next(self._timeout if self._timeout > 0 else None,
                                 in_order=self._in_order)
            if r is None:
                self._end_pass(self._fg_stats, self._queue.pids())
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            self._check(r)
            worker, pid, kind, buf, message = r.worker, r.pid, r.job_kind, r.buffer, r.message
            index = self._task_info.pop(r.job, None)
            if kind == _native._JobKind.ERROR and len(buf) == 0:
                # the worker's body itself failed (the batch could not be written): its text
                raise RuntimeError("DataLoader worker {} (pid {}) could not return the batch of "
                                   "the samples {}: {}".format(
                                       worker, pid, _dataloader_worker._short(index),
                                       message.decode(errors="replace")))
            data, meta = _batch_codec.decode(buf, memoryview(buf))
            del buf
            if meta is not None and "cuda_in_fork" in meta:
                self._cuda_in_fork(meta["cuda_in_fork"], index)  # raises _Restarted to reroute
            if meta is not None and "ended" in meta:
                self._worker_ended(worker, pid, index, meta["ended"], data)
            if meta is not None and "skipped" in meta:
                self._fg_skipped += len(meta["skipped"])
            if meta is not None and "state" in meta:
                self._fg_states[worker] = meta["state"]
            self._fg_next_worker = (worker + 1) % self._num_workers
            self._fill()
            if kind == _native._JobKind.CUDA:
                self._cuda_found(message.decode(errors="replace"))
            if kind == _native._JobKind.ERROR:
                data.reraise()
            if self._pin_memory:
                data = torch.utils.data._utils.pin_memory.pin_memory(data, self._pin_memory_device)
            return data

    def _worker_ended(self, worker, pid, index, what, wrapper):
        """A sample raised what is not an Exception (SystemExit, KeyboardInterrupt,
        GeneratorExit): it ends a worker of torch's, whose loader then raises "exited
        unexpectedly". The workers are stopped, and the error names it, with its traceback."""
        self._shutdown_workers()
        self._fg_stopped_by = (
            RuntimeError, "DataLoader worker (pid(s) {}) exited unexpectedly".format(pid))
        raise RuntimeError(
            "DataLoader worker (pid {}) exited unexpectedly: {} raised in DataLoader worker "
            "process {} for the samples {} (what is not an Exception ends a worker, as it ends "
            "torch's).\nOriginal {}".format(pid, what, worker, _dataloader_worker._short(index),
                                            wrapper.exc_msg))

    def _cuda_in_fork(self, found, index):
        """A forked worker tried CUDA, which cannot start in a fork of this process (NOTE [ CUDA
        in a forked worker ]). worker_start="auto": the batches in flight, `index`'s first, are
        asked again of workers from the clean fork server, which this loader keeps from now on
        (_Restarted is raised once they started); said once (cuda_in_workers="warn"), or
        CudaInWorkerError ("error"). worker_start="fork": said once, the batch goes on."""
        reroute = self._fg_spec["fork_watch"]["reroute"]
        text = (f"DataLoader worker {found['worker']} (PID {found['pid']}) tried to initialize "
                f"CUDA in {found['stage']}, in a fork of this process, where CUDA cannot start "
                f"({self._why}: \"Cannot re-initialize CUDA in forked subprocess\", "
                f"CUDA_ERROR_NOT_INITIALIZED). ")
        if reroute:
            text += ("Its batches and every batch in flight are discarded and made again by "
                     "workers started from forkguard's clean fork server, where CUDA can start; "
                     "this loader's workers start there from now on (the dataset, collate_fn "
                     "and worker_init_fn travel by value). ")
        else:
            text += ("worker_start='fork' keeps the forked workers: the batch is what the "
                     "dataset made of the error. worker_start='auto' would remake it on clean "
                     "workers. ")
        text += ("Cure: return CPU tensors from the Dataset and collate_fn and move each batch "
                 "to the GPU in the training loop (pin_memory=True makes that copy fast); or, "
                 "where the workers must use CUDA, worker_start='server' starts them clean at "
                 "once.")
        self._cuda_found(text)
        self._said_cuda()  # the clean workers' CUDA is this same use: said once
        if not reroute:
            return
        outstanding = [index] + [self._task_info[j] for j in sorted(self._task_info)]
        self._shutdown_workers()
        loader = self._fg_loader()
        if loader is not None:
            loader._fg_clean_workers = True
        self._fg_spec.update(epoch=self._fg_epoch, shared_seed=self._shared_seed,
                             dataset_states=None, fork_watch=None)
        self._task_info = {}
        self._start_workers("server")
        if self._dataset_kind == _torch_dl._DatasetKind.Map:
            self._fg_redo.extend(outstanding)
        else:
            # each clean worker's copy iterates from the pass's start: the batches already
            # yielded are made again and dropped (as a resumed pass replays them)
            self._fg_discard = self._num_yielded
        raise _Restarted

    def _said_cuda(self):
        self._cuda_said = True
        loader = self._fg_loader()
        if loader is not None:
            loader._fg_cuda_said = True

    def _cuda_found(self, text):
        if self._cuda_policy == "error":
            self._shutdown_workers()
            self._fg_stopped_by = (CudaInWorkerError, text)
            raise CudaInWorkerError(text)
        if self._cuda_policy == "warn" and not self._cuda_said:
            self._said_cuda()
            warnings.warn(text, CudaInWorkerWarning, stacklevel=3)

    def _shutdown_workers(self):
        if not getattr(self, "_shutdown", True):
            self._shutdown = True
            self._queue.stop()
        if getattr(self, "_frozen", False):  # also when the workers could not be started
            self._frozen = False
            _unfreeze()

    def __del__(self):
        self._shutdown_workers()
