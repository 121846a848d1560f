"""forkguard.ImageLoader: the C++ loader's image pipeline, batches as DLPack tensors."""
from __future__ import annotations

import os
from typing import Dict, Iterator, Optional, Sequence, Tuple, Union

from . import _native
from ._native import DLTensor


def _device_ordinal(device: Union[None, str, int]) -> int:
    if device is None or device == "cpu":
        return -1
    if isinstance(device, int):
        return device
    if device == "cuda":
        return 0
    if isinstance(device, str) and device.startswith("cuda:"):
        return int(device[5:])
    # torch.device and the like
    if getattr(device, "type", None) == "cuda":
        return device.index or 0
    if getattr(device, "type", None) == "cpu":
        return -1
    raise ValueError(f"device: None, 'cpu', 'cuda' or 'cuda:N', not {device!r}")


class ImageLoader:
    """Images from an ImageFolder tree, a file list or WebDataset tar shards, decoded and
    transformed by the C++ loader's workers (which hold no GIL), delivered in order as
    ``(images, labels)`` DLTensors that ``torch.from_dlpack`` (or numpy) takes without a copy.

    ``format``: "imagefolder" (root/<class>/<file>, torchvision's order), "filelist" (a "path
    label" file) or "wds" (a .tar, a brace pattern of them, or a directory of them).
    ``train``: RandomResizedCrop(size) + flip + normalize (shuffled), else Resize(resize) +
    CenterCrop(size) + normalize (in order); ``shuffle`` overrides the order.
    ``dtype``: "float32" or "float16" (normalized NCHW), "uint8" (NCHW, or NHWC with
    ``layout="nhwc"``). ``workers``: threads or processes (``worker_kind``); 0 works in the
    consumer's thread. ``device="cuda"``: batches copied to the GPU by the loader (pinned,
    asynchronous) before they are yielded. ``bad_sample``: "error" raises DataError naming the
    file; "skip" substitutes another sample and records it (``images.skipped``, stats).
    ``distributed``: shard by RANK/WORLD_SIZE like DistributedSampler. ``allow_empty``
    (imagefolder): accept class folders without a valid file, as torchvision's ImageFolder
    ``allow_empty``; else they raise DataError ("Found no valid file for the classes ...").

    Randomness depends only on (seed, epoch, index): the same batches for any worker count or
    kind. Each ``for`` loop is one epoch (the next epoch unless ``set_epoch`` says otherwise).
    A batch's memory stays valid while its DLTensor or any tensor made from it lives.
    """

    def __init__(self, root: str, format: str = "imagefolder", batch_size: int = 64,
                 workers: int = 2, worker_kind: str = "thread", train: bool = True,
                 dtype: str = "float32", device: Union[None, str, int] = None, seed: int = 0,
                 drop_last: bool = False, bad_sample: str = "error", *, size: int = 224,
                 resize: int = 256, layout: str = "nchw", shuffle: Optional[bool] = None,
                 distributed: bool = False, prefetch: int = 2, timeout: Optional[float] = None,
                 scale: Tuple[float, float] = (0.08, 1.0),
                 ratio: Tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0), flip: float = 0.5,
                 mean: Sequence[float] = (0.485, 0.456, 0.406),
                 std: Sequence[float] = (0.229, 0.224, 0.225), allow_empty: bool = False):
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if workers < 0:
            raise ValueError("workers must be 0 or more")
        a = _native._ImageLoaderArgs()
        a.root = os.fsencode(root)  # bytes: a name that is not UTF-8 is passed as it is
        a.format = format
        a.batch_size = batch_size
        a.workers = workers
        a.worker_kind = worker_kind
        a.train = train
        a.size = size
        a.resize = resize
        a.dtype = dtype
        a.layout = layout
        a.device = _device_ordinal(device)
        a.seed = seed
        a.shuffle = train if shuffle is None else shuffle
        a.drop_last = drop_last
        a.distributed = distributed
        a.bad_sample = bad_sample
        a.allow_empty = allow_empty
        a.prefetch = prefetch
        a.timeout = float(timeout or 0)
        a.scale_min, a.scale_max = scale
        a.ratio_min, a.ratio_max = ratio
        a.flip = flip
        a.mean = [float(x) for x in mean]
        a.std = [float(x) for x in std]
        self._loader = _native._ImageLoader(a)
        self._iterators = 0  # iterators made; only the latest one yields

    def __iter__(self) -> Iterator[Tuple[DLTensor, DLTensor]]:
        """One epoch. As DataLoader(persistent_workers=True) resets its one iterator, a new
        iterator supersedes the previous one: a loop left early (or still running) ends there,
        the new one starts the next epoch afresh, and the old one raises ``forkguard.Error`` on
        its next ``next()`` instead of sharing the stream of batches with the new one.

        A ``DataError`` (a bad sample, under ``bad_sample="error"``) leaves the iterator usable,
        as torch's DataLoader iterator: ``next(it)`` after it goes on with the epoch's next batch,
        so a loop that catches it and carries on finishes the epoch. After any other error (a
        worker died, a timeout) the epoch is over and the iterator is exhausted."""
        if self._loader.in_epoch():
            self._loader.set_epoch(self._loader.epoch() + 1)
        self._iterators += 1
        return _Epoch(self, self._iterators, self._loader.epoch())

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._loader.size()

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next loop runs (its shuffle and crops); as DistributedSampler.set_epoch."""
        self._loader.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self._loader.epoch()

    @property
    def dataset_size(self) -> int:
        return self._loader.dataset_size()

    def worker_pids(self):
        """Process workers now running (empty for threads)."""
        return self._loader.worker_pids()

    def stats(self) -> Dict[str, float]:
        """Per-stage times (read, transform, slot wait, consumer wait, copy; seconds summed over
        workers) and counts (batches, samples, skipped, worker starts and restarts, slots)."""
        return self._loader.stats()

    def close(self) -> None:
        """Stops the workers now (also done when the loader is garbage-collected). Batches
        already delivered stay valid; anything else afterwards raises ValueError ("the
        ImageLoader is closed"), as a closed file does."""
        self._loader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Epoch:
    """One epoch's iterator (not a generator: a generator that raised is finished, so a loop
    catching DataError and calling next() again would end the epoch silently at the bad batch)."""

    def __init__(self, owner: ImageLoader, number: int, epoch: int):
        self._owner = owner
        self._number = number
        self._epoch = epoch
        self._done = False

    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> Tuple[DLTensor, DLTensor]:
        if self._done:
            raise StopIteration
        owner = self._owner
        if self._number != owner._iterators:
            self._done = True
            raise _native.Error(
                f"this iterator over the ImageLoader (epoch {self._epoch}) was superseded by a "
                f"newer one: iter() was called again, which ended this epoch and started "
                f"epoch {owner._loader.epoch()}; use one loop at a time")
        try:
            batch = owner._loader.next()
        except _native.DataError:
            raise  # the epoch goes on: the next call returns its next batch
        except BaseException:
            self._done = True  # a worker error or timeout ended the epoch
            raise
        if batch is None:
            self._done = True
            raise StopIteration
        return batch
