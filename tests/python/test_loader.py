"""forkguard.ImageLoader through torch.from_dlpack: the C++ loader's values (the CLI's digest),
no copy (the batch's own pointer), memory kept while a tensor lives and released after."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import forkguard

torch = pytest.importorskip("torch")

FNV_OFFSET, FNV_PRIME, MASK = 1469598103934665603, 1099511628211, (1 << 64) - 1


def fnv(data: bytes, h: int) -> int:
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


def cli_digest(build_dir, root, workers=2, kind="thread", batch=8):
    out = subprocess.run(
        [str(build_dir / "bin" / "forkguard"), "bench", "loader", "--data", str(root),
         "--workers", str(workers), "--worker-kind", kind, "--batch-size", str(batch),
         "--epochs", "1", "--dtype", "uint8", "--digest", "--json"],
        capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)["digest"]


def python_digest(loader):
    h = FNV_OFFSET
    for images, labels in loader:
        x = torch.from_dlpack(images)
        y = torch.from_dlpack(labels)
        assert x.data_ptr() == images.data_ptr  # no copy
        h = fnv(x.contiguous().numpy().tobytes(), h)
        h = fnv(y.numpy().tobytes(), h)
    return f"{h:016x}"


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_batches_equal_the_cpp_loader(build_dir, images, kind):
    expected = cli_digest(build_dir, images)
    loader = forkguard.ImageLoader(images, batch_size=8, workers=2, worker_kind=kind,
                                   dtype="uint8", seed=0)
    assert python_digest(loader) == expected
    if kind == "process":
        assert len(loader.worker_pids()) == 2


def test_tensor_shapes_labels_and_no_copy(images):
    loader = forkguard.ImageLoader(images, batch_size=8, workers=2, size=64, train=False)
    assert len(loader) == 3 and loader.dataset_size == 24
    seen = []
    for images_t, labels_t in loader:
        assert images_t.__dlpack_device__() == (1, 0)
        x = torch.from_dlpack(images_t)
        y = torch.from_dlpack(labels_t)
        assert x.shape == (8, 3, 64, 64) and x.dtype == torch.float32
        assert y.dtype == torch.int64
        assert x.data_ptr() == images_t.data_ptr and y.data_ptr() == labels_t.data_ptr
        x2 = torch.from_dlpack(images_t.__dlpack__())  # the raw capsule, as torch 1.13 takes
        assert x2.data_ptr() == images_t.data_ptr and torch.equal(x, x2)
        images_t.__dlpack__()  # a capsule nobody consumed releases its reference when it dies
        a = np.asarray(images_t)  # numpy through __array_interface__, also no copy
        assert a.ctypes.data == images_t.data_ptr and a.shape == tuple(x.shape)
        assert [int(k.split("/")[-2][-1]) for k in images_t.keys] == y.tolist()
        seen += y.tolist()
    assert seen == sorted(seen)  # eval order: ImageFolder's, classes in order


def test_memory_lives_with_the_tensor_and_returns_after(images):
    loader = forkguard.ImageLoader(images, batch_size=2, workers=2, size=32, dtype="uint8")
    # Drop every batch at once: a handful of slots serve the whole epoch.
    for images_t, labels_t in loader:
        torch.from_dlpack(images_t).sum()
    released_slots = loader.stats()["slots"]
    # Keep only the torch tensors (the DLTensors die): their slots must stay theirs.
    held, copies = [], []
    for images_t, labels_t in loader:
        x = torch.from_dlpack(images_t)
        held.append(x)
        copies.append(x.clone())
        del images_t, labels_t
    assert loader.stats()["slots"] >= len(held) > released_slots
    for x, c in zip(held, copies):
        assert torch.equal(x, c)  # nothing reused memory a tensor still holds
    slots = loader.stats()["slots"]
    del held, x
    for images_t, labels_t in loader:
        torch.from_dlpack(images_t).sum()
    assert loader.stats()["slots"] == slots  # released slots were reused, none added


def test_set_epoch_replays_and_worker_count_does_not_matter(images):
    def epoch_digest(workers, epoch):
        loader = forkguard.ImageLoader(images, batch_size=8, workers=workers, size=32,
                                       dtype="uint8", seed=5)
        loader.set_epoch(epoch)
        return python_digest(loader)

    assert epoch_digest(1, 3) == epoch_digest(3, 3) == epoch_digest(0, 3)
    assert epoch_digest(2, 3) != epoch_digest(2, 4)


def test_bad_sample_error_names_the_file_and_skip_records_it(bad_images):
    loader = forkguard.ImageLoader(bad_images, batch_size=25, workers=2, size=32)
    with pytest.raises(forkguard.DataError, match="img99_bad.jpg") as raised:
        for _ in loader:
            pass
    assert raised.value.key.endswith("img99_bad.jpg")
    assert isinstance(raised.value.index, int)
    loader = forkguard.ImageLoader(bad_images, batch_size=25, workers=2, size=32,
                                   bad_sample="skip")
    skipped = []
    for images_t, _ in loader:
        skipped += images_t.skipped
    assert [s["key"].endswith("img99_bad.jpg") for s in skipped] == [True]
    assert loader.stats()["skipped"] == 1


def test_killed_worker_raises_worker_error_with_its_pid(images):
    loader = forkguard.ImageLoader(images, batch_size=4, workers=2, worker_kind="process", size=32)
    it = iter(loader)
    next(it)
    victim = loader.worker_pids()[1]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(forkguard.WorkerError, match="SIGKILL") as raised:
        for _ in it:
            pass
    assert raised.value.pid == victim and raised.value.worker == 1
    assert raised.value.indices and all(isinstance(i, int) for i in raised.value.indices)


def test_stats_and_errors(images):
    loader = forkguard.ImageLoader(images, batch_size=8, workers=2, size=32)
    for _ in loader:
        pass
    s = loader.stats()
    assert s["batches"] == 3 and s["samples"] == 24 and s["transform_seconds"] > 0
    with pytest.raises(ValueError, match="worker_kind"):
        forkguard.ImageLoader(images, worker_kind="green")
    with pytest.raises(forkguard.DataError, match="nowhere"):
        forkguard.ImageLoader("/nowhere/at/all")


def test_empty_class_folders_raise_unless_allowed(tmp_path):
    from conftest import make_images

    root = make_images(tmp_path / "imgs", classes=2, per_class=4)
    (root / "class9_empty").mkdir()
    with pytest.raises(forkguard.DataError,
                       match="Found no valid file for the classes class9_empty. Supported "
                             "extensions are: .jpg, .jpeg, .png"):
        forkguard.ImageLoader(root, batch_size=4, workers=1, size=32)
    loader = forkguard.ImageLoader(root, batch_size=4, workers=1, size=32, allow_empty=True)
    assert loader.dataset_size == 8
    labels = set()
    for _, y in loader:
        labels |= set(torch.from_dlpack(y).tolist())
    assert labels == {0, 1}


def test_a_new_iterator_supersedes_the_live_one(images):
    # As DataLoader(persistent_workers=True) resets its one iterator: the newer loop runs the next
    # epoch; the older one raises instead of silently sharing its stream of batches.
    loader = forkguard.ImageLoader(images, batch_size=4, workers=2, size=32, dtype="uint8")
    first = iter(loader)
    assert next(first)[0].epoch == 0
    second = iter(loader)
    with pytest.raises(forkguard.Error, match=r"iterator over the ImageLoader \(epoch 0\) was "
                                              r"superseded by a newer one.*started epoch 1"):
        next(first)
    assert [images_t.epoch for images_t, _ in second] == [1] * len(loader)
    with pytest.raises(StopIteration):
        next(first)


def test_epoch_advances_once_after_a_worker_error(images):
    loader = forkguard.ImageLoader(images, batch_size=4, workers=2, worker_kind="process", size=32)
    it = iter(loader)
    next(it)
    os.kill(loader.worker_pids()[0], signal.SIGKILL)
    with pytest.raises(forkguard.WorkerError):
        for _ in it:
            pass
    assert loader.epoch == 1
    assert {images_t.epoch for images_t, _ in loader} == {1}, "epoch 1 was skipped"
    assert {images_t.epoch for images_t, _ in loader} == {2}


def test_use_after_close_is_a_value_error(images):
    loader = forkguard.ImageLoader(images, batch_size=4, workers=1, size=32)
    it = iter(loader)
    next(it)
    loader.close()
    for use in (lambda: next(it), lambda: iter(loader), lambda: len(loader), loader.stats,
                lambda: loader.set_epoch(3)):
        with pytest.raises(ValueError, match="the ImageLoader is closed"):
            use()


def test_file_names_that_are_not_utf8_come_back_as_os_functions_give_them(tmp_path):
    from conftest import make_images

    root = make_images(tmp_path / os.fsdecode(b"imgs\xfe"), classes=2, per_class=2)
    cls = root / "class0"
    (cls / "img00.jpg").rename(cls / os.fsdecode(b"caf\xe9.jpg"))  # Latin-1 'café'
    (cls / os.fsdecode(b"bad\xff.jpg")).write_bytes(b"not a jpeg")
    loader = forkguard.ImageLoader(root, batch_size=8, workers=1, size=32, shuffle=False,
                                   bad_sample="skip")
    keys = [k for images_t, _ in loader for k in images_t.keys]
    assert os.fsdecode(bytes(cls) + b"/caf\xe9.jpg") in keys
    assert all(os.path.exists(k) for k in keys)
    loader = forkguard.ImageLoader(os.fsencode(root), batch_size=8, workers=1, size=32,
                                   shuffle=False)
    with pytest.raises(forkguard.DataError, match=r"bad\\xff\.jpg") as raised:
        for _ in loader:
            pass
    assert raised.value.key == os.fsdecode(bytes(cls) + b"/bad\xff.jpg")


# <linux/wait.h> __WALL: a wait that finds clone children too, as the fork server is (a wait for any
# child does not).
_WALL = 0x40000000


def test_the_fork_server_is_no_child_a_reap_all_loop_waits_for(tmp_path):
    # `import forkguard` starts the C++ fork server. The common reap-all idiom used to block on it
    # for ever; it ends at once now, and the fork server still serves process workers.
    script = tmp_path / "reap_all.py"
    script.write_text(
        "import os, forkguard\n"
        "server = forkguard._native.fork_server_pid()\n"
        "assert server is not None\n"
        "while True:\n"
        "    try:\n"
        "        os.wait()\n"
        "    except ChildProcessError:\n"
        "        break\n"
        "os.kill(server, 0)\n"
        "print('ended; the fork server runs')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ended; the fork server runs\n"


def test_a_dead_fork_server_is_reaped_and_replaced(images, capfd):
    def first_batch_labels():
        loader = forkguard.ImageLoader(images, batch_size=4, workers=2, worker_kind="process",
                                       size=32, dtype="uint8", train=False)
        try:
            return torch.from_dlpack(next(iter(loader))[1]).tolist()
        finally:
            loader.close()

    reference = first_batch_labels()
    old = forkguard._native.fork_server_pid()
    assert old is not None
    os.kill(old, signal.SIGKILL)
    os.waitid(os.P_PID, old, os.WEXITED | os.WNOWAIT | _WALL)  # dead, not yet reaped
    assert first_batch_labels() == reference  # was: SpawnError "Broken pipe"
    new = forkguard._native.fork_server_pid()
    assert new not in (None, old)
    with pytest.raises(ChildProcessError):
        os.waitpid(old, os.WNOHANG | _WALL)  # reaped: no zombie left
    assert f"the fork server (PID {old}) died (killed by signal 9 (SIGKILL)); started a new " \
           f"one (PID {new})" in capfd.readouterr().err


def test_process_workers_refused_after_cuinit_say_how_a_python_program_gets_them(images,
                                                                                 fake_cuda_env):
    # No fork server (disabled here; elsewhere: forkguard imported after CUDA was initialized):
    # a guarded fork refuses, with the evidence and what to do in Python, not only in C++.
    script = (
        "import ctypes, os, sys\n"
        "import forkguard\n"
        "assert ctypes.CDLL(os.environ['FORKGUARD_TEST_FAKE_CUDA']).cuInit(0) == 0\n"
        "try:\n"
        "    loader = forkguard.ImageLoader(sys.argv[1], batch_size=4, workers=2,\n"
        "                                   worker_kind='process', size=32)\n"
        "    next(iter(loader))\n"
        "except forkguard.DataError as e:\n"
        "    print(e)\n")
    out = subprocess.run(["/usr/bin/python3", "-c", script, str(images)], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "FORKGUARD_NO_FORK_SERVER": "1"})
    assert out.returncode == 0, out.stderr
    assert "refusing to fork process workers: this process (PID" in out.stdout
    assert "holds CUDA state (initialized" in out.stdout
    assert "Python: import forkguard before anything initializes CUDA" in out.stdout
