"""A collated batch in a shared-memory slot: written by a DataLoader worker, rebuilt in the main
process with tensors and arrays that view the slot (no copy on the way out).

Slot layout (offsets from the start of the slot, little-endian):

    0   header: magic b"FGBATCH1", u64 skeleton length, u64 skeleton offset
    64  the tensor and array payloads, each C-contiguous and starting on a 64-byte boundary
        (any dtype's alignment, and what torch.frombuffer and SIMD loads like)
    ..  the skeleton: a protocol 5 pickle of the batch in which each plain CPU tensor and
        numpy array is a persistent id (kind, dtype, shape, payload offset)

Everything else (ints, strings, dicts, namedtuples, dataclasses, any picklable object, and the
tensors and arrays a view cannot carry: sparse, quantized, requiring grad, tensor subclasses,
object or byte-swapped arrays) travels inside the skeleton, as pickle would send it anyway.

The skeleton is unpickled, so a slot must come from a trusted writer (our own worker), as with
any multiprocessing queue.
"""
import io
import math
import pickle
import struct

import torch

try:  # torch needs no numpy, nor does a batch without arrays
    import numpy as np
except ImportError:
    np = None

_MAGIC = b"FGBATCH1"
_HEADER = struct.Struct("<8sQQ")
_ALIGN = 64


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _SkeletonPickler(pickle.Pickler):
    """Pickles the skeleton and lays out the payloads as it meets the leaves."""

    def __init__(self, file):
        super().__init__(file, protocol=5)
        self.leaves = []   # (leaf, offset, nbytes), copied in once the slot is reserved
        self.pids = {}     # id(leaf) -> persistent id: a leaf met twice is stored once
        self.end = _align(_HEADER.size)

    def persistent_id(self, obj):
        # Called for every object pickled (the persistent ids' parts too), so it is one frame.
        # Exact types: a subclass (nn.Parameter, np.matrix, a masked array) would come back as
        # the base class, so pickle keeps it whole, as it does what a view cannot carry.
        if type(obj) is torch.Tensor:
            if (obj.layout != torch.strided or obj.is_quantized or obj.requires_grad
                    or not obj.is_cpu):
                return None
            kind, nbytes = "torch", obj.numel() * obj.element_size()
        elif np is not None and type(obj) is np.ndarray:
            if obj.dtype.hasobject or not obj.dtype.isnative:
                return None
            kind, nbytes = "numpy", obj.nbytes
        else:
            return None
        pid = self.pids.get(id(obj))   # self.leaves keeps obj alive, so its id stays its own
        if pid is None:
            pid = self.pids[id(obj)] = (kind, obj.dtype, tuple(obj.shape), self.end)
            self.leaves.append((obj, self.end, nbytes))
            self.end = _align(self.end + nbytes)
        return pid


_cloud_pickler = None


def _cloud_skeleton_pickler():
    """_SkeletonPickler with cloudpickle's reducers: classes and functions of a __main__ the
    worker does not share (a fork-server worker's) travel by value, not by a name only the
    loader's process can resolve."""
    global _cloud_pickler
    if _cloud_pickler is None:
        from . import _by_value

        class CloudSkeletonPickler(_SkeletonPickler, _by_value.Pickler):
            pass

        _cloud_pickler = CloudSkeletonPickler
    return _cloud_pickler


def encode(batch, reserve, by_value=False):
    """Writes `batch` into a slot. `reserve(n)` returns a writable memoryview (format 'B') of at
    least n bytes of the slot, starting at slot offset 0 (it may grow the slot; a new call may
    return a different memoryview: use only the latest). `by_value`: pickle the skeleton with
    cloudpickle (see _cloud_skeleton_pickler). Returns the number of bytes used."""
    file = io.BytesIO()
    pickler = (_cloud_skeleton_pickler() if by_value else _SkeletonPickler)(file)
    pickler.dump(batch)
    skeleton = file.getbuffer()
    total = pickler.end + len(skeleton)
    view = reserve(total)
    if view.nbytes < total:
        raise ValueError(f"batch slot: reserve({total}) returned only {view.nbytes} bytes")
    _HEADER.pack_into(view, 0, _MAGIC, len(skeleton), pickler.end)
    view[pickler.end:total] = skeleton
    # One copy per leaf, straight from the leaf's own strides into the contiguous payload.
    for leaf, offset, nbytes in pickler.leaves:
        if nbytes == 0:
            continue
        if isinstance(leaf, torch.Tensor):
            dst = torch.frombuffer(view, dtype=leaf.dtype, count=leaf.numel(), offset=offset)
            if leaf.dim() != 1:   # view() costs twice frombuffer: skip it where it is a no-op
                dst = dst.view(leaf.shape)
            dst.copy_(leaf)
        else:
            dst = np.frombuffer(view, dtype=leaf.dtype, count=leaf.size, offset=offset)
            dst.reshape(leaf.shape)[...] = leaf
    return total


class _SkeletonUnpickler(pickle.Unpickler):
    """Unpickles the skeleton, each leaf a view of the payload."""

    def __init__(self, file, payload):
        super().__init__(file)
        self.payload = payload
        self.leaves = {}   # pid -> leaf: a leaf stored once comes back as one object

    def persistent_load(self, pid):
        leaf = self.leaves.get(pid)
        if leaf is not None:
            return leaf
        kind, dtype, shape, offset = pid
        count = math.prod(shape)
        # frombuffer refuses an empty view (torch) or a zero itemsize (numpy): an empty leaf
        # needs no memory anyway.
        if kind == "torch":
            if count == 0:
                leaf = torch.empty(shape, dtype=dtype)
            else:
                leaf = torch.frombuffer(self.payload, dtype=dtype, count=count, offset=offset)
                if len(shape) != 1:   # as in encode
                    leaf = leaf.view(shape)
        elif kind == "numpy":
            if count * dtype.itemsize == 0:
                leaf = np.empty(shape, dtype)
            else:
                leaf = np.frombuffer(self.payload, dtype, count, offset).reshape(shape)
        else:
            raise pickle.UnpicklingError(f"batch slot: unknown leaf kind {kind!r}")
        self.leaves[pid] = leaf
        return leaf


def decode(owner, view):
    """`view`: a memoryview (format 'B') of the slot's used bytes; `owner`: the object whose
    lifetime keeps the slot (pass it so tensors/arrays keep it alive; it exports the buffer
    protocol itself — `view` is memoryview(owner)[:n] in practice). Returns the batch."""
    n = view.nbytes
    if n < _HEADER.size:
        raise ValueError(f"batch slot: {n} bytes, shorter than the {_HEADER.size}-byte header")
    magic, length, offset = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise ValueError(f"batch slot: bad magic {magic!r}, expected {_MAGIC!r}")
    if offset < _HEADER.size:
        raise ValueError(f"batch slot: skeleton at offset {offset} overlaps the "
                         f"{_HEADER.size}-byte header")
    if offset > n or length > n - offset:
        raise ValueError(f"batch slot: skeleton at offset {offset} of {length} bytes runs past "
                         f"the {n}-byte view")
    # The leaves view a memoryview of our own, not the caller's `view`: torch.frombuffer keeps
    # a reference to the object it is given but lets go of its buffer, and a memoryview holds
    # its export of `owner` until it dies. So whatever the caller does with `view`, the slot is
    # neither freed nor unmapped (mmap.close() raises BufferError) while a tensor or array views
    # it. Cut at the skeleton, it also bounds every leaf to the payload. (`view` gives the used
    # length, the header and the skeleton: it must start where `owner` starts.)
    memory = memoryview(owner).cast("B")
    if memory.nbytes < n:
        raise ValueError(f"batch slot: the owner has {memory.nbytes} bytes, the view {n}")
    unpickler = _SkeletonUnpickler(io.BytesIO(view[offset:offset + length]), memory[:offset])
    return unpickler.load()
