"""The Python package against a CUDA driver (tests/gpu/run.sh runs it; --fake: the test driver).

1. forkguard.ImageLoader(device="cuda") after this process initialized CUDA: every batch's images
   and labels are on the device (DLPack device (kDLCUDA, 0)) and, copied back with
   cuMemcpyDtoH, equal the host loader's batches byte for byte (process workers from the fork
   server and thread workers).
2. __dlpack__(stream=s) records s: each batch is copied back on a stream of ours, behind a large
   copy that keeps the stream busy, and dropped at once; the loader's later copies into the same
   device buffer must wait for that work (the bytes read back equal the host loader's). Streams
   0 and -2 are refused (DLPack).
3. forkguard.notebook_launch after this process initialized CUDA: every rank's cuInit succeeds;
   with forkguard preloaded in the server, a rank that initialized CUDA reads batches onto the
   device with process workers (from the rank's own fork server).
4. forkguard.DataLoader after this process initialized CUDA, over a Dataset whose __getitem__
   calls cuInit: the workers are forked, the real driver's cuInit can carry the fork tripwire
   (src/cuda/fork_tripwire.hpp: its symbol is large enough), the forked worker's cuInit is caught
   and the batches are made again by workers from the clean fork server: every cuInit the loop
   sees returns 0, one CudaInWorkerWarning names __getitem__; with cuda_in_workers="error",
   CudaInWorkerError does.
5. forkguard.DataLoader(pin_memory=True): the driver says every batch's memory is page-locked
   host memory (cuPointerGetAttribute), and the batch handed out is the slot itself: with a
   PyTorch built with CUDA, Tensor.is_pinned() is True; with a CPU build (told that CUDA is
   there), pin_memory() is never asked for a copy.
Prints "python-gpu ok" or "python-gpu FAIL: ...". Needs PYTHONPATH=BUILD/python.
Run: /usr/bin/python3 python_gpu_check.py"""
import ctypes
import os
import sys
import tempfile

import forkguard

DRIVER = os.environ.get("FORKGUARD_CUDA_DRIVER", "libcuda.so.1")


def cuda():
    lib = ctypes.CDLL(DRIVER)
    assert lib.cuInit(0) == 0, "cuInit failed in the parent"
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    return lib


def images(root, n=48):
    from PIL import Image
    for i in range(n):
        d = os.path.join(root, f"class_{i % 3}")
        os.makedirs(d, exist_ok=True)
        w, h = 160 + 7 * i, 120 + 5 * i
        Image.frombytes("RGB", (w, h), bytes((x * 7 + i) % 256 for x in range(w * h * 3))).save(
            os.path.join(d, f"{i}.jpg"), quality=90)


def to_host(lib, t):
    t.__dlpack__()  # waits for the loader's copy
    buf = ctypes.create_string_buffer(t.nbytes)
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    assert lib.cuMemcpyDtoH_v2(buf, t.data_ptr, t.nbytes) == 0, "cuMemcpyDtoH failed"
    return buf.raw


def host_bytes(t):
    return ctypes.string_at(t.data_ptr, t.nbytes)


def record_stream_check(lib, root, failures):
    vp, u64, sz = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t
    lib.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
    lib.cuStreamSynchronize.argtypes = [vp]
    lib.cuStreamDestroy_v2.argtypes = [vp]
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), sz]
    lib.cuMemFree_v2.argtypes = [u64]
    lib.cuMemHostRegister_v2.argtypes = [vp, sz, ctypes.c_uint]
    lib.cuMemHostUnregister.argtypes = [vp]
    lib.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, sz, vp]
    mine = vp()
    assert lib.cuStreamCreate(ctypes.byref(mine), 1) == 0, "cuStreamCreate failed"
    big = 64 << 20  # a copy of 64 MiB in front of each read-back keeps our stream busy
    dbig, hbig = u64(), ctypes.create_string_buffer(big)
    assert lib.cuMemAlloc_v2(ctypes.byref(dbig), big) == 0, "cuMemAlloc failed"
    assert lib.cuMemHostRegister_v2(hbig, big, 0) == 0, "cuMemHostRegister failed"
    kw = dict(batch_size=4, workers=2, seed=5)
    host = [host_bytes(x) for x, _ in forkguard.ImageLoader(root, **kw)]
    dev = forkguard.ImageLoader(root, device="cuda", **kw)
    back = []
    for x, _ in dev:
        for bad in (0, -2):
            try:
                x.__dlpack__(stream=bad)
                failures.append(f"__dlpack__(stream={bad}) was accepted")
            except ValueError:
                pass
        x.__dlpack__(stream=mine.value)  # waits for the loader's copy, records our stream
        buf = ctypes.create_string_buffer(x.nbytes)
        assert lib.cuMemHostRegister_v2(buf, x.nbytes, 0) == 0, "cuMemHostRegister failed"
        assert lib.cuMemcpyDtoHAsync_v2(hbig, dbig.value, big, mine) == 0, "cuMemcpyDtoHAsync"
        assert lib.cuMemcpyDtoHAsync_v2(buf, x.data_ptr, x.nbytes, mine) == 0, "cuMemcpyDtoHAsync"
        back.append(buf)  # the batch is released when the loop moves on, our copies queued
    del x, _  # the last batch too: a recorded stream must outlive the batches that name it
    assert lib.cuStreamSynchronize(mine) == 0, "cuStreamSynchronize failed"
    dev.close()
    for b in back + [hbig]:
        lib.cuMemHostUnregister(b)
    lib.cuMemFree_v2(dbig)
    lib.cuStreamDestroy_v2(mine)
    got = [b.raw for b in back]
    if got != host:
        bad = sum(g != h for g, h in zip(got, host))
        failures.append(f"record_stream: {bad} of {len(host)} batches read back on our stream "
                        "differ (a device buffer was reused under our copy)")
    print(f"  __dlpack__(stream=ours): {len(got)} batches read back on our stream compared")


def rank_init():
    import ctypes as c
    import os as o
    return c.CDLL(o.environ.get("FORKGUARD_CUDA_DRIVER", "libcuda.so.1")).cuInit(0)


def rank_process_loader(root):
    """In a rank: CUDA first, then a device loader with process workers; (batches, cuInit)."""
    import ctypes as c
    import os as o

    import forkguard as fg
    rc = c.CDLL(o.environ.get("FORKGUARD_CUDA_DRIVER", "libcuda.so.1")).cuInit(0)
    loader = fg.ImageLoader(root, batch_size=16, workers=2, worker_kind="process", seed=5,
                            device="cuda")
    n = sum(1 for x, _ in loader if x.__dlpack_device__() == (2, 0))
    loader.close()
    return n, rc


class CudaTouching:
    """A Dataset whose samples initialize CUDA in the worker (as `.cuda()` in __getitem__)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import ctypes as c
        import os as o
        return c.CDLL(o.environ.get("FORKGUARD_CUDA_DRIVER", "libcuda.so.1")).cuInit(0)


def dataloader_check(failures):
    import warnings

    unwatched = forkguard._native.cuda_tripwire_unavailable()
    print(f"  CUDA fork tripwire on this driver: {unwatched or 'can be armed'}")
    if unwatched:
        failures.append(f"the CUDA fork tripwire cannot be armed on this driver: {unwatched}")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [int(x) for b in forkguard.DataLoader(CudaTouching(), batch_size=2, num_workers=2)
               for x in b]
    said = [w for w in seen if issubclass(w.category, forkguard.CudaInWorkerWarning)]
    print(f"  DataLoader after the parent's cuInit: workers' cuInit returned {got}, "
          f"{len(said)} CudaInWorkerWarning")
    if got != [0] * 8:
        failures.append(f"DataLoader workers' cuInit returned {got}")
    if len(said) != 1 or "__getitem__" not in str(said[0].message):
        failures.append(f"DataLoader CUDA warnings: {[str(w.message) for w in said]}")
    try:
        list(forkguard.DataLoader(CudaTouching(), batch_size=2, num_workers=2,
                                  cuda_in_workers="error"))
        failures.append("DataLoader(cuda_in_workers='error') did not raise")
    except forkguard.CudaInWorkerError as e:
        if "__getitem__" not in str(e):
            failures.append(f"CudaInWorkerError does not name __getitem__: {e}")


class Floats:
    def __len__(self):
        return 16

    def __getitem__(self, i):
        import torch
        return torch.full((1024,), float(i))


def pin_memory_check(lib, failures):
    import torch

    lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]

    def page_locked(t):
        kind = ctypes.c_uint(0)
        return lib.cuPointerGetAttribute(ctypes.byref(kind), 2, t.data_ptr()) == 0 \
            and kind.value == 1  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_MEMORYTYPE_HOST

    real = torch.cuda.is_available()
    saved = torch.cuda.is_available, torch.Tensor.pin_memory
    copied = []
    if not real:
        def pin_memory(self, device=None):
            if not page_locked(self):
                copied.append(self.numel())
            return self
        torch.cuda.is_available = lambda: True
        torch.Tensor.pin_memory = pin_memory
    try:
        batches = list(forkguard.DataLoader(Floats(), batch_size=4, num_workers=2,
                                            pin_memory=True))
    finally:
        torch.cuda.is_available, torch.Tensor.pin_memory = saved
    locked = [page_locked(b) for b in batches]
    print(f"  DataLoader pin_memory=True ({'CUDA' if real else 'CPU'} PyTorch): "
          f"{sum(locked)} of {len(batches)} batches page-locked")
    if not all(locked) or len(batches) != 4:
        failures.append(f"DataLoader pin_memory: page-locked {locked}")
    if real and not all(b.is_pinned() for b in batches):
        failures.append("DataLoader pin_memory: Tensor.is_pinned() is False")
    if copied:
        failures.append(f"DataLoader pin_memory: {len(copied)} tensors were copied to be pinned")


def main():
    failures = []
    lib = cuda()
    with tempfile.TemporaryDirectory() as root:
        images(root)
        for kind in ("thread", "process"):
            kw = dict(batch_size=16, workers=2, worker_kind=kind, seed=5)
            host = [(host_bytes(x), host_bytes(y)) for x, y in forkguard.ImageLoader(root, **kw)]
            dev = forkguard.ImageLoader(root, device="cuda", **kw)
            got = []
            for x, y in dev:
                if x.__dlpack_device__() != (2, 0):
                    failures.append(f"{kind}: images on {x.__dlpack_device__()}, not (2, 0)")
                got.append((to_host(lib, x), to_host(lib, y)))
            dev.close()
            if got != host:
                failures.append(f"{kind}: device batches differ from the host batches")
            print(f"  ImageLoader device='cuda', {kind} workers: {len(got)} batches compared")
        record_stream_check(lib, root, failures)
        ranks = forkguard.notebook_launch(rank_init, nproc=2)
        print(f"  notebook_launch after the parent's cuInit: ranks' cuInit returned {ranks}")
        if ranks != [0, 0]:
            failures.append(f"notebook_launch ranks' cuInit returned {ranks}")
        forkguard.start_server(preload=["forkguard"], wait=True)
        ranks = forkguard.notebook_launch(rank_process_loader, args=(root,), nproc=2)
        print(f"  notebook_launch, forkguard preloaded: (device batches, cuInit) {ranks}")
        if ranks != [(3, 0), (3, 0)]:
            failures.append(f"notebook_launch process loader on the device: {ranks}")
    dataloader_check(failures)
    pin_memory_check(lib, failures)
    forkguard.stop_server()
    print("python-gpu ok" if not failures else "python-gpu FAIL: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
