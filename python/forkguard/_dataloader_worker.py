"""A forkguard.DataLoader worker: the body the loader core (src/data/job_workers.hpp) runs for each
job, in a fork of the loader's process or in a child of the clean Python fork server.

A job's input is a pickled request: ("fetch", index) fetches and collates one batch (the index or
indices the sampler gave), ("resume", shared_seed) starts a new pass (persistent workers). The
output replaces it in the slot: the batch through _batch_codec (tensors and arrays raw, the rest
pickled), or the ExceptionWrapper of what the user's code raised. The worker prepares itself as
torch's own worker loop does (torch/utils/data/_utils/worker.py): one intra-op thread, Python's,
numpy's and torch's generators seeded from the base seed and the worker id, get_worker_info(), the
worker_init_fn, the dataset's fetcher; with forkguard's `seed`, every sample is instead seeded
from (seed, epoch, index), whatever worker makes it.
"""
import hashlib
import multiprocessing
import operator
import os
import pickle
import random
import sys

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, _DatasetKind, get_worker_info
from torch.utils.data._utils import signal_handling
from torch.utils.data._utils import worker as _torch_worker

from . import _batch_codec, _native, _torch_compat
from ._native import _JobBodyResult, _JobKind


MAX_SUBSTITUTES = _native.MAX_SUBSTITUTES  # the C++ loader's default
_MASK = (1 << 64) - 1


def _key(index):
    """A sample's index as the 64-bit integer the C++ functions take: an integer (anything with
    __index__) modulo 2**64, anything else the blake2b of its repr (not hash(), which is salted
    per process for strings)."""
    try:
        return operator.index(index) & _MASK
    except TypeError:
        return int.from_bytes(hashlib.blake2b(repr(index).encode(), digest_size=8).digest(),
                              "little")


def sample_seed(seed, epoch, index):
    """The seed of one sample under DataLoader(seed=...): a function of (seed, epoch, index) only,
    the same in every process, and the C++ loader's (sample_key in forkguard/data/rng.hpp) for
    the same seed, epoch and integer index."""
    return _native.sample_key(seed & _MASK, epoch & _MASK, _key(index))


def substitute_index(seed, epoch, index, attempt, size):
    """bad_sample="skip": the attempt-th sample (from 0) that replaces the failed sample `index`
    of a dataset of `size` samples; the C++ loader's (substitute_index in rng.hpp)."""
    return _native.substitute_index(seed & _MASK, epoch & _MASK, _key(index), attempt, size)


def seed_everything(s, cpu_only=False):
    """Python's, numpy's and torch's generators from `s`. torch.manual_seed also seeds the CUDA
    generators (queued until CUDA is initialized); `cpu_only`: torch's CPU generator alone (the
    same CPU state), for the loader's own process, whose CUDA generators are its user's."""
    random.seed(s)
    if cpu_only:
        torch.default_generator.manual_seed(s)
    else:
        torch.manual_seed(s)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(s & 0xFFFFFFFF)


def generator_states():
    """Python's, numpy's and torch's (CPU) generator states, for restore_generators()."""
    try:
        import numpy as np
    except ImportError:
        np = None
    return (random.getstate(), torch.default_generator.get_state(),
            np.random.get_state() if np is not None else None)


def restore_generators(states):
    py, cpu, numpy_state = states
    random.setstate(py)
    torch.default_generator.set_state(cpu)
    if numpy_state is not None:
        import numpy as np

        np.random.set_state(numpy_state)


class SampleGuard:
    """A map-style dataset as DataLoader(seed=, bad_sample=) sees it: the generators seeded before
    each sample from (seed, epoch, index); a sample that raises replaced (bad_sample="skip") by
    the substitutes the C++ loader would try for the same (seed, epoch, index), one after another
    until one loads, each failure said once per index on stderr and recorded in `skipped` (index,
    substitute, reason) for the loader's stats. `cpu_only`: see seed_everything."""

    def __init__(self, dataset, seed, epoch, bad_sample, cpu_only=False):
        self.dataset, self.seed, self.epoch, self.bad_sample = dataset, seed, epoch, bad_sample
        self.cpu_only = cpu_only
        self.skipped = []
        self.said = set()

    def __getitem__(self, index):
        chosen, size = index, None
        for attempt in range(MAX_SUBSTITUTES + 1):
            if self.seed is not None:
                seed_everything(sample_seed(self.seed, self.epoch, chosen), self.cpu_only)
            try:
                return self.dataset[chosen]
            except Exception as e:  # noqa: BLE001 - a bad sample, under the skip policy
                if self.bad_sample != "skip":
                    raise
                reason = f"{type(e).__name__}: {e}"
                if size is None:
                    size = len(self.dataset)
                if attempt == MAX_SUBSTITUTES or size < 2:
                    break
                # every substitute from the failed index (not from the last substitute), as in C++
                substitute = substitute_index(self.seed or 0, self.epoch, index, attempt, size)
                self.skipped.append((index, substitute, reason))
                if chosen not in self.said:
                    self.said.add(chosen)
                    print(f"forkguard.DataLoader: sample {chosen!r} failed ({reason}); "
                          f"replaced by sample {substitute} (bad_sample='skip')",
                          file=sys.stderr, flush=True)
                chosen = substitute
        if size < 2:
            raise RuntimeError(f"forkguard.DataLoader: sample {index!r} failed and the dataset has "
                               f"no other sample to replace it (bad_sample='skip'): {reason}")
        raise RuntimeError(f"forkguard.DataLoader: sample {index!r} and {MAX_SUBSTITUTES} "
                           f"substitutes for it all failed (bad_sample='skip'); the last: "
                           f"{reason}")

    def __len__(self):
        return len(self.dataset)


class IterGuard:
    """An IterableDataset as DataLoader(bad_sample="skip") sees it: an element whose making
    raises is dropped, said on stderr and recorded in `skipped` (position, None, reason), and the
    iteration goes on where the iterator can (a generator that raised has ended: so has the
    pass). MAX_SUBSTITUTES failures in a row end it with an error instead (an iterator that
    fails at every step)."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.skipped = []

    def __iter__(self):
        info = get_worker_info()
        who = "" if info is None else f" of worker {info.id}"
        it = iter(self.dataset)
        position, failed = 0, 0
        while True:
            try:
                x = next(it)
            except StopIteration:
                return
            except Exception as e:  # noqa: BLE001 - a bad element, under the skip policy
                reason = f"{type(e).__name__}: {e}"
                self.skipped.append((position, None, reason))
                print(f"forkguard.DataLoader: element {position}{who} failed ({reason}); "
                      "skipped (bad_sample='skip')", file=sys.stderr, flush=True)
                position, failed = position + 1, failed + 1
                if failed > MAX_SUBSTITUTES:
                    raise RuntimeError(
                        f"forkguard.DataLoader: {failed} elements in a row{who} failed "
                        f"(bad_sample='skip'); the last: {reason}") from e
                continue
            position, failed = position + 1, 0
            yield x


def fetcher(spec, dataset, epoch, in_main=False):
    """torch's fetcher for the dataset (map-style ones through a SampleGuard when seed or
    bad_sample asks for it, iterable ones through an IterGuard for bad_sample="skip");
    (fetcher, guard or None). `in_main`: for the loader's own process (num_workers=0)."""
    guard = None
    if spec["dataset_kind"] == _DatasetKind.Map and (spec["seed"] is not None or
                                                     spec["bad_sample"] == "skip"):
        dataset = guard = SampleGuard(dataset, spec["seed"], epoch, spec["bad_sample"],
                                      cpu_only=in_main)
    elif spec["dataset_kind"] == _DatasetKind.Iterable and spec["bad_sample"] == "skip":
        dataset = guard = IterGuard(dataset)
    return _DatasetKind.create_fetcher(spec["dataset_kind"], dataset, spec["auto_collation"],
                                       spec["collate_fn"], spec["drop_last"]), guard


class StackBuffers:
    """torch's collate_tensor_fn, in a worker, stacks each batch into a new shared-memory file
    (a page fault per 4 KiB: 110-200 ms for 64x3x224x224 float32), which here would only be
    copied into the slot and thrown away. Instead: torch.stack into buffers reused from one batch
    to the next (a batch is in its slot before the next is made); those of the shapes the last
    batch used are kept, no more."""

    def __init__(self):
        self.free = {}
        self.used = []
        self.torch_collate = _torch_compat.torch_collate_tensor_fn()

    def collate(self, batch, *, collate_fn_map=None):
        elem = batch[0]
        if elem.layout != torch.strided or elem.is_nested or elem.device.type != "cpu" or \
                any(x.requires_grad for x in batch):
            # torch's own, with its errors for what default_collate cannot batch (nested and
            # sparse tensors)
            return self.torch_collate(batch, collate_fn_map=collate_fn_map)
        key = ((len(batch),) + tuple(elem.shape), elem.dtype)
        spare = self.free.get(key)
        out = spare.pop() if spare else torch.empty(key[0], dtype=elem.dtype)
        self.used.append((key, out))
        return torch.stack(batch, 0, out=out)

    def recycle(self):
        self.free = {}
        for key, out in self.used:
            self.free.setdefault(key, []).append(out)
        self.used = []


def stateful(dataset_kind, dataset):
    """An IterableDataset that can say where its iteration is and go on from there."""
    return dataset_kind == _DatasetKind.Iterable and all(
        callable(getattr(dataset, name, None)) for name in ("state_dict", "load_state_dict"))


class ForkWatch:
    """A worker forked from a process that initialized CUDA or set torch's fork poison: CUDA
    cannot start in it. The stage of its first attempt is recorded, whoever catches the error it
    gets: torch's lazy init is watched (_torch_compat.watch_bad_fork), and where the parent's
    driver is initialized, the driver's cuInit answers through forkguard's tripwire
    (src/cuda/fork_tripwire.hpp), which counts the call. See NOTE [ CUDA in a forked worker ] in
    _dataloader.py."""

    def __init__(self, driver):
        self.stage = "the worker's start"
        self.used = None  # the stage of the first attempt
        self.said = False  # reported to the loader (worker_start="fork": once)
        self.driver = driver
        if driver:
            _native.arm_cuda_tripwire()
        _torch_compat.watch_bad_fork(self._attempt)

    def _attempt(self):
        if self.used is None:
            self.used = self.stage

    def check(self):
        """The stage where this worker first tried CUDA, or None."""
        if self.used is None and self.driver and _native.cuda_tripwire_trips():
            self.used = self.stage
        return self.used

    def enter(self, stage):
        """`stage` begins (what came before it is checked first)."""
        self.check()
        self.stage = stage

    def collate(self, collate_fn):
        """collate_fn, its calls a stage of their own."""
        def watched(data):
            self.enter("collate_fn")
            return collate_fn(data)

        return watched


class Worker:
    """Called by the core for each job: a _JobBodyResult (its kind, the bytes written, a
    message)."""

    def __init__(self, spec, worker_id):
        # torch's workers are daemonic processes: a DataLoader with workers (or any
        # multiprocessing child) started in one raises "daemonic processes are not allowed to
        # have children". The same here, for either loader.
        multiprocessing.current_process().daemon = True
        self.spec = spec
        self.worker_id = worker_id
        self.cuda_said = False
        signal_handling._set_worker_signal_handlers()
        torch.set_num_threads(1)
        self.stacks = StackBuffers()
        from torch.utils.data._utils import collate

        collate.default_collate_fn_map[torch.Tensor] = self.stacks.collate
        seed = spec["base_seed"] + worker_id
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            import numpy as np

            np.random.seed(_torch_worker._generate_state(spec["base_seed"], worker_id))
        except ImportError:
            pass
        self.shared_rng = torch.Generator()
        self.dataset = self._seeded(spec["dataset"], spec["shared_seed"])
        _torch_worker._worker_info = _torch_compat.worker_info(
            id=worker_id, num_workers=spec["num_workers"], seed=seed, dataset=self.dataset)
        self.init_exception = None
        self.guard = None
        self.iteration_end = False
        self.epoch = spec["epoch"]
        self.stateful = stateful(spec["dataset_kind"], self.dataset)
        watch = spec.get("fork_watch")
        self.watch = ForkWatch(watch["driver"]) if watch is not None else None
        try:
            if spec["worker_init_fn"] is not None:
                self._enter("worker_init_fn")
                spec["worker_init_fn"](worker_id)
            resumed = (spec.get("dataset_states") or {}).get(worker_id)
            if self.stateful and resumed is not None:
                self.dataset.load_state_dict(resumed)  # before its iterator is made
            self._enter("__iter__" if spec["dataset_kind"] == _DatasetKind.Iterable else
                        "worker_init_fn")
            self._fetcher()
        except Exception:
            self.init_exception = ExceptionWrapper(
                where="in DataLoader worker process {}".format(worker_id))
        self.pending_cuda = self._cuda_after("worker_init_fn")

    def _seeded(self, dataset, shared_seed):
        """A DataPipe with its shuffling seeded for the pass (torch's worker does the same)."""
        if not isinstance(dataset, IterDataPipe):
            return dataset
        from torch.utils.data.graph_settings import apply_random_seed

        self.shared_rng.manual_seed(shared_seed)
        return apply_random_seed(dataset, self.shared_rng)

    def _fetcher(self):
        spec = self.spec
        if self.watch is not None:
            spec = dict(spec, collate_fn=self.watch.collate(spec["collate_fn"]))
        self.fetcher, self.guard = fetcher(spec, self.dataset, self.epoch)

    def _enter(self, stage):
        if self.watch is not None:
            self.watch.enter(stage)

    def _cuda_after(self, stage):
        """What CUDA state this worker has now, said about `stage`, or None."""
        if self.spec["cuda_in_workers"] == "allow" or self.cuda_said or self.watch is not None:
            # (a watched worker's attempts are the watch's: the probe would find the driver
            # state it inherited)
            return None
        found = _native.probe_if_fork_unsafe()
        if found is None:
            return None
        self.cuda_said = True
        return (f"DataLoader worker {self.worker_id} (PID {os.getpid()}) initialized CUDA in "
                f"{stage}: {found.summary}. Each worker that does so holds its own CUDA context "
                "(hundreds of MB of GPU memory, seconds to create). Cure: return CPU tensors "
                "from the Dataset and collate_fn, and move each batch to the GPU in the training "
                "loop (pin_memory=True makes that copy fast).")

    def __call__(self, job, slot):
        request = pickle.loads(slot.input())
        if request[0] == "resume":
            self.iteration_end = False
            self.epoch = request[2]
            self.dataset = self._seeded(self.dataset, request[1])
            _torch_worker._worker_info = _torch_compat.worker_info_with(
                _torch_worker._worker_info, dataset=self.dataset)
            if self.init_exception is None:
                self._fetcher()
            return _JobBodyResult(kind=_JobKind.OK,
                                  bytes=_batch_codec.encode((None, None), slot.reserve))
        if self.iteration_end:
            return _JobBodyResult(kind=_JobKind.END)
        index = request[1]
        self._enter("__iter__" if self.spec["dataset_kind"] == _DatasetKind.Iterable else
                    f"__getitem__ of the batch of indices {_short(index)}")
        if self.init_exception is not None:
            data, self.init_exception = self.init_exception, None
        else:
            try:
                data = self.fetcher.fetch(index)
                state = self.dataset.state_dict() if self.stateful else None
            except StopIteration:
                if self.spec["dataset_kind"] == _DatasetKind.Iterable:
                    self.iteration_end = True
                    return _JobBodyResult(kind=_JobKind.END)
                data = ExceptionWrapper(where="in DataLoader worker process {}".format(
                    self.worker_id))
            except Exception:
                data = ExceptionWrapper(where="in DataLoader worker process {}".format(
                    self.worker_id))
            except BaseException as e:
                # SystemExit, KeyboardInterrupt, GeneratorExit: torch's worker loop catches
                # Exception only, so these end its worker. Said to the loader, which stops the
                # workers and raises, naming it.
                data = ExceptionWrapper(where="in DataLoader worker process {}".format(
                    self.worker_id))
                ended = type(e).__name__ + (f": {e}" if str(e) else "")
                return _JobBodyResult(kind=_JobKind.ERROR, bytes=_batch_codec.encode(
                    (data, {"ended": ended}), slot.reserve, self.spec.get("by_value", False)))
        kind = _JobKind.ERROR if isinstance(data, ExceptionWrapper) else _JobKind.OK
        forked_cuda = self._forked_cuda()
        if forked_cuda is not None and self.spec["fork_watch"]["reroute"]:
            # what this worker made is not to be trusted: the loader makes it again elsewhere
            return _JobBodyResult(kind=_JobKind.OK, bytes=_batch_codec.encode(
                (None, {"cuda_in_fork": forked_cuda}), slot.reserve))
        found = self.pending_cuda
        self.pending_cuda = None
        if found is None:
            stage = ("__iter__" if self.spec["dataset_kind"] == _DatasetKind.Iterable
                     else f"__getitem__ or collate_fn of the batch of indices {_short(index)}")
            found = self._cuda_after(stage)
        meta = None
        if self.guard is not None and self.guard.skipped:
            meta = {"skipped": self.guard.skipped}
            self.guard.skipped = []
        if kind == _JobKind.OK and self.stateful:  # where this copy is once the batch is yielded
            meta = dict(meta or {}, state=state)
        if forked_cuda is not None:  # worker_start="fork": the batch, and what it tried, once
            meta = dict(meta or {}, cuda_in_fork=forked_cuda)
        n = _batch_codec.encode((data, meta), slot.reserve, self.spec.get("by_value", False))
        self.stacks.recycle()  # the batch is in the slot: its buffers may take the next one
        if found is not None:
            return _JobBodyResult(kind=_JobKind.CUDA, bytes=n, message=found)
        return _JobBodyResult(kind=kind, bytes=n)

    def _forked_cuda(self):
        """In a watched worker (ForkWatch) that tried CUDA: where, for the loader ({"stage",
        "worker", "pid"}), with every job after it where the loader reroutes (none of them is
        to be trusted), once where it does not; else None."""
        watch = self.watch
        if watch is None or watch.check() is None or watch.said:
            return None
        watch.said = not self.spec["fork_watch"]["reroute"]
        return {"stage": self.watch.used, "worker": self.worker_id, "pid": os.getpid()}

    def close(self):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or replaced stream: nothing to flush
                pass


def _short(index):
    text = repr(index)
    return text if len(text) <= 80 else text[:77] + "..."


def make(spec):
    """The body factory of a forked worker: the spec is this process's own objects."""
    return lambda worker_id: Worker(spec, worker_id)


def load_spec(memfd, held):
    """In a loader's own fork server (_server.py's _dataloader_zygote_main): its workers' spec
    from the memfd, loaded once for all of them; returns make(worker_id) -> Worker. The memfd holds
    KEY (a u32 length, then JSON: _dataloader._ServerJobQueue writes it), then the spec pickled to
    travel (_travel.pack), unpickled from the mapping itself (no copy of the pickle); `held` is
    what the interpreter server held for the loaders as it forked this process (dataloader_hold:
    KEY -> fds). KEY's are the fds the spec's multiprocessing objects refer to (found where a
    forkserver child finds them), and the workers forked from here inherit them; the other
    loaders' are closed."""
    import json
    import mmap

    with mmap.mmap(memfd, 0, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:
        size = int.from_bytes(view[:4], "little")
        key = json.loads(bytes(view[4:4 + size]))
        for other, fds in held.items():
            if other != key:
                for f in fds:
                    os.close(f)
        if key is not None:  # before the spec's objects are rebuilt: they look there
            import multiprocessing.forkserver

            if key not in held:
                raise RuntimeError(f"the fork server held no fds for this loader ({key}) as it "
                                   "forked its process")
            multiprocessing.forkserver._forkserver._inherited_fds = list(held[key])
        with view[4 + size:] as pickled:
            spec = pickle.loads(pickled)
    os.chdir(spec["cwd"])
    sys.path[:] = spec["sys_path"]
    sys.argv[:] = spec["argv"]
    return lambda worker_id: Worker(spec, worker_id)


def library_modules(names):
    """The top-level packages among the modules `names` that are installed libraries (their
    file under a site-packages or dist-packages folder, or the standard library's), sorted:
    what a loader's spec imported that the interpreter server may preload for the next loaders.
    Not the user's own modules (the script's folder, the working directory), whose import may do
    anything (initialize CUDA, say) in a server that must stay clean."""
    import sysconfig

    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep
    found = set()
    for name in names:
        top = name.partition(".")[0]
        module = sys.modules.get(top)
        path = getattr(module, "__file__", None)
        if top in found or path is None or top == "__main__":
            continue
        path = os.path.realpath(path)
        parts = path.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts or path.startswith(stdlib):
            found.add(top)
    return sorted(found)
