"""forkguard._batch_codec: a collated batch written into a slot and rebuilt as views of it."""
import collections
import contextlib
import dataclasses
import gc
import importlib.util
import mmap
import os
import pathlib
import random
import struct
import time
import warnings
import weakref

import numpy as np
import pytest
import torch

# Loaded from its file: importing the forkguard package needs the built _native module and
# starts the fork server, and this module needs neither.
_PATH = pathlib.Path(__file__).resolve().parents[2] / "python" / "forkguard" / "_batch_codec.py"
_spec = importlib.util.spec_from_file_location("forkguard_batch_codec", _PATH)
codec = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(codec)

# torch.frombuffer warns on a read-only buffer: none of ours is, so no warning may appear.
pytestmark = pytest.mark.filterwarnings("error")

Pair = collections.namedtuple("Pair", "image label")


@dataclasses.dataclass
class Sample:
    name: str
    pixels: torch.Tensor


class Owner(bytearray):
    """A slot's memory that can be weakly referenced."""


class Slot:
    def __init__(self):
        self.owner = Owner()
        self.reserved = []

    def reserve(self, n):
        self.reserved.append(n)
        if len(self.owner) < n:
            self.owner = Owner(n)   # grows as a new buffer, as a remapped memfd would
        return memoryview(self.owner)


def encode(batch, slot=None):
    slot = slot or Slot()
    n = codec.encode(batch, slot.reserve)
    assert slot.reserved == [n]
    return slot, n


def round_trip(batch):
    slot, n = encode(batch)
    return slot, codec.decode(slot.owner, memoryview(slot.owner)[:n])


def base_address(owner):
    return np.frombuffer(owner, np.uint8).ctypes.data


def in_slot(leaf, owner):
    address = leaf.data_ptr() if isinstance(leaf, torch.Tensor) else leaf.ctypes.data
    offset = address - base_address(owner)
    return 0 <= offset < len(owner) and offset % 64 == 0


TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                torch.complex128]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (2, 3, 5)]


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_tensor_dtypes_and_shapes(dtype, shape):
    t = (torch.randn(shape, dtype=torch.float64) * 50).to(dtype)
    slot, out = round_trip([t, 1])
    got = out[0]
    assert type(got) is torch.Tensor and got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got, t)
    assert got.is_contiguous() and not got.requires_grad
    assert in_slot(got, slot.owner) == (t.numel() > 0)


NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.uint16, np.int32, np.int64, np.uint64,
                np.float16, np.float32, np.float64, np.complex64, np.complex128, "U5",
                "datetime64[ms]", np.dtype([("a", np.int16), ("b", np.float64, (2,))])]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_array_dtypes_and_shapes(dtype, shape):
    a = np.frombuffer(np.random.default_rng(0).bytes(int(np.prod(shape)) * np.dtype(dtype)
                                                     .itemsize), dtype).reshape(shape)
    if a.dtype.kind in "UM" or a.dtype.names:   # no NaT, no invalid code points
        a = np.zeros(shape, dtype)
    slot, out = round_trip({"a": a})
    got = out["a"]
    assert type(got) is np.ndarray and got.dtype == a.dtype and got.shape == a.shape
    assert got.tobytes() == a.tobytes()
    assert got.flags.c_contiguous and got.flags.writeable
    assert in_slot(got, slot.owner) == (a.size > 0)


def test_non_contiguous_leaves_become_contiguous_payloads():
    t = torch.arange(24.0).reshape(2, 3, 4)
    c = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    a = np.arange(24).reshape(4, 6)
    leaves = [t.transpose(0, 2), t[:, ::2, 1:], torch.tensor(5.0).expand(3, 4), c.conj(),
              a[::-1, ::2], np.asfortranarray(a), a.T[2]]
    slot, out = round_trip(leaves)
    for got, want in zip(out, leaves):
        assert in_slot(got, slot.owner)
        if isinstance(want, torch.Tensor):
            assert got.is_contiguous() and torch.equal(got, want.resolve_conj())
        else:
            assert got.flags.c_contiguous and np.array_equal(got, want)


@contextlib.contextmanager
def made_quietly():
    """Where a test makes its input, torch's own warnings about that input are not the codec's
    (the codec's own still fail the test: it runs outside)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield


def test_leaves_a_view_cannot_carry_travel_in_the_skeleton():
    grad = torch.randn(3, requires_grad=True)
    with made_quietly():  # torch 2.x warns once that it does not check a sparse tensor's indices
        sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    param = torch.nn.Parameter(torch.ones(2))
    objects = np.array([1, "two", None], dtype=object)
    swapped = np.arange(5, dtype=">i4")
    batch = {"grad": grad, "sparse": sparse, "param": param, "objects": objects,
             "swapped": swapped, "plain": torch.ones(3)}
    slot, out = round_trip(batch)
    assert out["grad"].requires_grad and torch.equal(out["grad"], grad)
    assert out["sparse"].is_sparse and torch.equal(out["sparse"].to_dense(), sparse.to_dense())
    assert type(out["param"]) is torch.nn.Parameter and torch.equal(out["param"], param)
    assert out["objects"].tolist() == [1, "two", None]
    assert out["swapped"].dtype == np.dtype(">i4") and out["swapped"].tolist() == [0, 1, 2, 3, 4]
    assert not any(in_slot(out[k], slot.owner) for k in ("grad", "objects", "swapped"))
    assert in_slot(out["plain"], slot.owner)


def test_quantized_tensor_travels_in_the_skeleton():
    try:
        with made_quietly():  # deprecated in torch 2.14 (still there: it must still travel)
            q = torch.quantize_per_tensor(torch.tensor([0.5, 1.0]), 0.1, 0, torch.quint8)
    except RuntimeError as e:
        pytest.skip(f"no quantized CPU backend: {e}")
    with warnings.catch_warnings():
        # torch 2.x's own unpickling of a quantized tensor warns that TypedStorage is deprecated
        # (plain pickle.loads does too): torch's warning, not the codec's, which still fail.
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        _, out = round_trip([q])
    assert out[0].is_quantized and torch.equal(out[0].dequantize(), q.dequantize())


def test_python_structure_round_trips():
    batch = {
        "pair": Pair(torch.zeros(2, 2), 3),
        "sample": Sample("x", torch.arange(3)),
        "ordered": collections.OrderedDict([("b", np.ones(2)), ("a", [None, True, 1.5])]),
        "nested": [(1, [2, {"deep": (torch.tensor(7),)}]), ()],
        "text": "héllo", "raw": b"\x00\xff", "none": None, "big": 2 ** 100 + 1, "neg": -2 ** 70,
        "flag": False, "scalar": np.float32(2.5),
    }
    _, out = round_trip(batch)
    assert type(out["pair"]) is Pair and out["pair"].label == 3
    assert torch.equal(out["pair"].image, torch.zeros(2, 2))
    assert type(out["sample"]) is Sample and out["sample"].name == "x"
    assert torch.equal(out["sample"].pixels, torch.arange(3))
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["b", "a"]
    assert np.array_equal(out["ordered"]["b"], np.ones(2))
    assert out["ordered"]["a"] == [None, True, 1.5]
    assert out["nested"][0][1][1]["deep"][0].item() == 7 and out["nested"][1] == ()
    for key in ("text", "raw", "none", "big", "neg", "flag", "scalar"):
        assert out[key] == batch[key] and type(out[key]) is type(batch[key])


def test_no_leaves_and_bare_leaf():
    assert round_trip(None)[1] is None
    assert round_trip({"a": [1, "b"]})[1] == {"a": [1, "b"]}
    assert torch.equal(round_trip(torch.ones(4))[1], torch.ones(4))


def test_leaves_share_the_slot_both_ways():
    t, a = torch.arange(6, dtype=torch.int32).reshape(2, 3), np.arange(4.0)
    slot, (got_t, got_a) = round_trip((t, a))
    slot.owner[64:] = bytes(len(slot.owner) - 64)   # the payloads, and the skeleton: no matter
    assert not got_t.any() and not got_a.any()
    got_t[1, 2], got_a[3] = 9, 1.5
    base = base_address(slot.owner)
    assert np.frombuffer(slot.owner, np.int32, 1, got_t.data_ptr() - base + 20)[0] == 9
    assert np.frombuffer(slot.owner, np.float64, 1, got_a.ctypes.data - base + 24)[0] == 1.5


def test_a_leaf_met_twice_is_stored_once():
    t, a = torch.ones(1000), np.ones(1000)
    slot, n = encode([t, t, a, {"again": a}])
    assert n < 64 + 4096 + 8192 + 512
    out = codec.decode(slot.owner, memoryview(slot.owner)[:n])
    assert out[0] is out[1] and out[2] is out[3]["again"]


def test_leaves_keep_the_owner_alive_until_the_last_goes():
    slot, n = encode({"t": torch.ones(3), "a": np.ones(2), "e": torch.ones(0), "i": 1})
    owner = slot.owner
    batch = codec.decode(owner, memoryview(owner)[:n])
    alive = weakref.ref(owner)
    del slot, owner
    t, a = batch.pop("t"), batch.pop("a")
    del batch
    gc.collect()
    assert alive() is not None
    del t
    gc.collect()
    assert alive() is not None
    a += 1
    del a
    gc.collect()
    assert alive() is None


def test_decode_keeps_no_reference_of_its_own():
    slot, n = encode([torch.ones(3), np.ones(3), Pair(torch.ones(1), np.ones(1))])
    owner = slot.owner
    view = memoryview(owner)[:n]
    batch = codec.decode(owner, view)
    alive = weakref.ref(owner)
    del slot, owner, view, batch
    gc.collect()
    assert alive() is None


def test_memfd_slot_cannot_be_unmapped_under_its_leaves():
    fd = os.memfd_create("batch")
    maps = []

    def reserve(n):
        os.ftruncate(fd, n)
        maps.append(mmap.mmap(fd, n))
        return memoryview(maps[-1])

    try:
        n = codec.encode({"x": torch.arange(10.0), "y": np.arange(3)}, reserve)
        slot = maps[-1]
        out = codec.decode(slot, memoryview(slot)[:n])
        assert torch.equal(out["x"], torch.arange(10.0)) and out["y"].tolist() == [0, 1, 2]
        with pytest.raises(BufferError):
            slot.close()
        del out
        gc.collect()
        slot.close()
    finally:
        os.close(fd)


def corrupt(view, message):
    with pytest.raises(ValueError, match=message):
        codec.decode(bytearray(view), memoryview(bytearray(view)))


def test_errors_name_what_is_wrong():
    slot, n = encode([torch.ones(4)])
    good = bytes(slot.owner[:n])
    corrupt(good[:10], "batch slot: 10 bytes, shorter than the 24-byte header")
    corrupt(b"FGBATCH2" + good[8:], "batch slot: bad magic b'FGBATCH2'")
    length, offset = struct.unpack_from("<QQ", good, 8)
    corrupt(good[:-1], f"batch slot: skeleton at offset {offset} of {length} bytes runs past "
                       f"the {n - 1}-byte view")
    for bad in (2 ** 64 - 1, n + 1, n - offset + 1):
        corrupt(good[:8] + struct.pack("<Q", bad) + good[16:], "runs past the")
    for bad in (2 ** 64 - 1, n + 1, n - length + 1):
        corrupt(good[:16] + struct.pack("<Q", bad) + good[24:], "runs past the")
    corrupt(good[:16] + struct.pack("<Q", 3) + good[24:],
            "batch slot: skeleton at offset 3 overlaps the 24-byte header")
    with pytest.raises(ValueError, match="the owner has 8 bytes"):
        codec.decode(bytearray(8), memoryview(bytearray(good)))
    with pytest.raises(ValueError, match=r"reserve\(\d+\) returned only 10 bytes"):
        codec.encode([torch.ones(4)], lambda n: memoryview(bytearray(10)))


def test_garbage_raises_and_never_crashes():
    rng = random.Random(1)
    slot, n = encode({"x": torch.arange(100.0), "y": [np.arange(7), "label"]})
    good = bytes(slot.owner[:n])
    length, offset = struct.unpack_from("<QQ", good, 8)
    for _ in range(2000):
        garbage = rng.randbytes(rng.choice([0, 1, 23, 24, 25, 64, 300, 5000]))
        if rng.random() < 0.5 and len(garbage) >= 8:
            garbage = b"FGBATCH1" + garbage[8:]
        with pytest.raises(ValueError):
            codec.decode(bytearray(garbage), memoryview(bytearray(garbage)))
    # A skeleton cut short anywhere is refused by the unpickler.
    for cut in range(length):
        slot = bytearray(good[:8] + struct.pack("<Q", cut) + good[16:])
        with pytest.raises(Exception):
            codec.decode(slot, memoryview(slot))
    # Payload bytes are data: any value decodes.
    for _ in range(100):
        slot = bytearray(good)
        slot[64:offset] = rng.randbytes(offset - 64)
        codec.decode(slot, memoryview(slot))


def best_of(runs, fn):
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def test_timing_prints_only(capsys):
    """Prints encode and decode costs beside a plain copy; asserts nothing about time."""
    images = torch.randn(64, 3, 224, 224)
    slot, n = encode(images)   # the slot's pages are touched once, as a reused slot's are
    view = memoryview(slot.owner)[:n]
    copy = torch.empty_like(images)
    memcpy = best_of(10, lambda: copy.copy_(images))
    enc = best_of(10, lambda: codec.encode(images, slot.reserve))
    dec = best_of(10, lambda: codec.decode(slot.owner, view))
    small = {f"field{i}": torch.randn(8) for i in range(256)}
    small_slot, small_n = encode(small)
    small_view = memoryview(small_slot.owner)[:small_n]
    small_enc = best_of(20, lambda: codec.encode(small, small_slot.reserve))
    small_dec = best_of(20, lambda: codec.decode(small_slot.owner, small_view))
    with capsys.disabled():
        print(f"\n64x3x224x224 float32 ({n / 1e6:.1f} MB slot): copy_ {memcpy * 1e3:.2f} ms,"
              f" encode {enc * 1e3:.2f} ms, decode {dec * 1e6:.0f} us")
        print(f"dict of 256 float32[8] ({small_n} bytes): encode {small_enc * 1e6:.0f} us, "
              f"decode {small_dec * 1e6:.0f} us")
