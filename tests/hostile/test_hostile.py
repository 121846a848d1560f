"""The hostile-input suite, from Python: forkguard.ImageLoader over a tree of what real machines
hold (a FIFO, a socket, a symlink loop, a 0-byte file, a sparse 2 GB file, names with a newline or
bytes that are not UTF-8, hard links), and `forkguard doctor` on a process whose name,
environment and open files are hostile. Each: a named error or a counted skip, within a bounded
time, with nothing left behind (fds, processes)."""
import gc
import io
import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

import forkguard

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOUND = 30.0  # seconds for one epoch over the hostile tree


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FORKGUARD_BUILD_DIR", ROOT / "build" / "release")).resolve()


def jpeg(seed: int) -> bytes:
    from PIL import Image

    img = Image.new("RGB", (40, 30), (seed * 37 % 256, seed * 91 % 256, 60))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=90)
    return out.getvalue()


# Good files (12 in a, 4 in b) and every hostile entry; bytes paths throughout (os.fsencode).
NEWLINE = b"a/new\nline.jpg"
NOT_UTF8 = b"b/caf\xe9.jpg"
LINK = b"b/twin.jpg"
BAD = {b"a/fifo.jpg": "not a regular file (a FIFO)",
       b"a/sock.jpg": "not a regular file (a socket)",
       b"a/loop.jpg": "Too many levels of symbolic links",
       b"a/empty.jpg": "empty file (0 bytes)",
       b"b/sparse.jpg": "a sparse file (2000000000 bytes"}


@pytest.fixture()
def hostile_tree(tmp_path):
    root = os.fsencode(tmp_path / "tree")
    for cls, n in ((b"a", 12), (b"b", 4)):
        os.makedirs(os.path.join(root, cls))
        for i in range(n):
            with open(os.path.join(root, cls, b"%02d.jpg" % i), "wb") as f:
                f.write(jpeg(i + 50 * (cls == b"b")))
    for name, seed in ((NEWLINE, 90), (NOT_UTF8, 91)):
        with open(os.path.join(root, name), "wb") as f:
            f.write(jpeg(seed))
    os.link(os.path.join(root, b"a/00.jpg"), os.path.join(root, LINK))
    os.mkfifo(os.path.join(root, b"a/fifo.jpg"))
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(root, b"a/sock.jpg"))
    sock.close()
    os.symlink(b"loop.jpg", os.path.join(root, b"a/loop.jpg"))
    open(os.path.join(root, b"a/empty.jpg"), "wb").close()
    with open(os.path.join(root, b"b/sparse.jpg"), "wb") as f:
        f.write(jpeg(1))
        f.truncate(2_000_000_000)
    return root


def holdings():
    """Open fds, memfd mappings, and /dev/shm files that are ours (/dev/shm is the machine's:
    other programs' files come and go there; ours would be named forkguard*, or mapped or open
    here)."""
    fds = sorted(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    memfds = sum("/memfd:" in line for line in maps)
    shm = {n for n in os.listdir("/dev/shm") if n.startswith("forkguard")}
    shm |= {line[line.index("/dev/shm/"):] for line in maps if "/dev/shm/" in line}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            shm.add(target)
    return fds, memfds, sorted(shm)


GOOD = 12 + 4 + 3  # the good files, the two odd names and the hard link


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_catching_data_error_and_carrying_on_finishes_the_epoch(hostile_tree, kind):
    before = holdings()
    loader = forkguard.ImageLoader(hostile_tree, batch_size=1, workers=2, worker_kind=kind,
                                   train=False, size=16, resize=16, dtype="uint8", timeout=10)
    start = time.monotonic()
    keys, errors = [], []
    it = iter(loader)
    while time.monotonic() - start < 3 * BOUND:
        try:
            images, _ = next(it)
        except StopIteration:
            break
        except forkguard.DataError as e:
            errors.append(e)
            continue
        keys += images.keys
    seconds = time.monotonic() - start
    pids = loader.worker_pids()
    loader.close()
    del images, _, loader  # the last batch holds its slot
    gc.collect()
    assert seconds < BOUND
    # Every bad entry once, named, with its reason; every good file once.
    assert len(errors) == len(BAD)
    for e in errors:
        name = os.fsencode(e.key)
        rel = os.path.relpath(name, hostile_tree)
        assert rel in BAD, e.key
        assert BAD[rel] in str(e), str(e)
        assert os.fsdecode(name) in str(e)
    assert len(keys) == GOOD == len(set(keys))
    # Names come back as os.fsdecode gives them: open() takes them.
    for name in (NEWLINE, NOT_UTF8, LINK):
        full = os.fsdecode(os.path.join(hostile_tree, name))
        assert full in keys
        with open(full, "rb") as f:
            assert f.read(2) == b"\xff\xd8"
    # The iterator is exhausted, not rolled into the next epoch.
    with pytest.raises(StopIteration):
        next(it)
    assert all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids)
    assert holdings() == before


def _zombie(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_skip_counts_each_bad_entry_and_names_it(hostile_tree, kind):
    before = holdings()
    with forkguard.ImageLoader(hostile_tree, batch_size=4, workers=2, worker_kind=kind,
                               train=False, size=16, resize=16, dtype="uint8",
                               bad_sample="skip", timeout=10) as loader:
        start = time.monotonic()
        skipped, samples = [], 0
        for images, labels in loader:
            skipped += images.skipped
            samples += len(images.keys)
        assert time.monotonic() - start < BOUND
        assert samples == GOOD + len(BAD)  # each bad one replaced by a good one
        assert sorted(os.path.relpath(os.fsencode(s["key"]), hostile_tree) for s in skipped) == \
            sorted(BAD)
        for s in skipped:
            assert BAD[os.path.relpath(os.fsencode(s["key"]), hostile_tree)] in s["reason"]
        assert loader.stats()["skipped"] == len(BAD)
    del images, labels, loader  # the last batch holds its slot
    gc.collect()
    assert holdings() == before


def doctor(build_dir, *args):
    return subprocess.run([str(build_dir / "bin" / "forkguard"), "doctor", *args],
                          capture_output=True, timeout=60)


# A target whose name holds ") R 1 (" (a /proc/PID/stat parser that looks for the first ')'
# misreads it), whose environment holds a newline and bytes that are not UTF-8, and that holds
# files open whose names do too.
def test_doctor_reads_a_hostile_process_and_prints_json(build_dir, tmp_path):
    weird = os.fsencode(tmp_path) + b"/x\n\xff) R 1 (.jpg"
    open(weird, "wb").close()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "HOSTILE": "a\nb"}
    env = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    env[b"HOSTILE_BYTES"] = b"\xff\xfe\n"
    code = ("import ctypes, os, sys\n"
            "ctypes.CDLL(None).prctl(15, b') R 1 (\\n\\xff', 0, 0, 0)\n"
            f"f = open({weird!r}, 'rb')\n"
            "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()\n")
    target = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    try:
        assert target.stdout.readline() == b"ready\n"
        with open(f"/proc/{target.pid}/comm", "rb") as f:
            assert f.read().startswith(b") R 1 (")
        r = doctor(build_dir, "--pid", str(target.pid), "--json")
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout)
        assert report["verdict"] == "clean", report
        assert report["pid"] == target.pid
        text = doctor(build_dir, "--pid", str(target.pid))
        assert text.returncode == 0, text.stderr
        assert b"clean" in text.stdout
    finally:
        target.stdin.close()
        target.wait(timeout=30)


@pytest.mark.parametrize("pid", ["abc", "-1", "0", "1e3", "99999999999999999999", " 1", "1\n"])
def test_doctor_hostile_pids_are_short_json_errors(build_dir, pid):
    r = doctor(build_dir, "--json", "--pid", pid)
    assert r.returncode == 2, (pid, r.stdout, r.stderr)
    err = json.loads(r.stdout)
    assert err["exit_code"] == 2 and err["error"]
    assert len(err["error"]) < 300, err["error"]
