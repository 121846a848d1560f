"""Shared fixtures: the build tree (FORKGUARD_BUILD_DIR, set by ctest), the test driver, and a
small ImageFolder of JPEGs and PNGs made with Pillow; and the helpers that check nothing is left
behind (processes carrying a test's marker, the fork server's children, this process's fds)."""
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def build_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FORKGUARD_BUILD_DIR", ROOT / "build" / "release")).resolve()


@pytest.fixture(scope="session")
def fake_cuda(build_dir) -> str:
    path = build_dir / "lib" / "fake_cuda" / "libcuda.so.1"
    if not path.exists():
        pytest.skip(f"the test driver is not built ({path})")
    return str(path)


@pytest.fixture()
def fake_cuda_env(fake_cuda, tmp_path, monkeypatch):
    """The test driver for this test's processes: device files under a temporary directory."""
    dev = tmp_path / "dev"
    dev.mkdir()
    monkeypatch.setenv("FAKE_CUDA_DEV_DIR", str(dev))
    monkeypatch.setenv("FORKGUARD_CUDA_DRIVER", fake_cuda)
    monkeypatch.setenv("FORKGUARD_TEST_FAKE_CUDA", fake_cuda)
    return fake_cuda


def make_images(root: pathlib.Path, classes=3, per_class=8, seed=1, corrupt=False):
    from PIL import Image

    rng = random.Random(seed)
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            w, h = rng.randint(60, 300), rng.randint(60, 300)
            img = Image.new("RGB", (w, h), (rng.randrange(256), rng.randrange(256), 40 * c))
            for _ in range(20):
                x, y = rng.randrange(w), rng.randrange(h)
                img.paste((rng.randrange(256), rng.randrange(256), rng.randrange(256)),
                          (x, y, min(w, x + 15), min(h, y + 15)))
            if i % 4 == 3:
                img.save(d / f"img{i:02d}.png")
            else:
                img.save(d / f"img{i:02d}.jpg", quality=90)
    if corrupt:
        (root / "class1" / "img99_bad.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return root


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> pathlib.Path:
    return make_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def bad_images(tmp_path_factory) -> pathlib.Path:
    return make_images(tmp_path_factory.mktemp("bad_images"), corrupt=True)


def marked_pids(marker: str):
    """PIDs of live processes whose environment carries `marker` (a "NAME=VALUE" entry); zombies
    count as gone (gVisor's PID 1 reaps orphans late)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in env and state != "Z":
            found.append(int(pid))
    return found


def pid_gone(pid: int) -> bool:
    """Whether `pid` has exited: no such process, or a zombie not yet reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def server_children():
    """The PIDs of the interpreter fork server's children (notebook_launch's ranks...)."""
    import forkguard

    srv = forkguard._launch._server
    if srv is None or not srv.alive():
        return []
    kids = []
    for tid in os.listdir(f"/proc/{srv.pid}/task"):
        with open(f"/proc/{srv.pid}/task/{tid}/children") as f:
            kids += f.read().split()
    return kids


def open_fds():
    """{fd: what it refers to} of this process."""
    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own
            pass
    return fds


@pytest.fixture(scope="session")
def torch_build():
    """"cuda" (a CUDA build of torch: its device count registers torch's fork poison, with or
    without a GPU), "cpu" (no CUDA in it: Debian's 1.13.1), or None (no torch) under this
    interpreter; asked of a child interpreter, so this one does not import torch."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c",
         "import torch; print('cuda' if hasattr(torch._C, '_cuda_getDeviceCount') else 'cpu')"],
        capture_output=True, text=True, timeout=300)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 else None


def need_torch_build(build: str, found):
    """Skips, naming the torch found, unless this interpreter's torch is `build`."""
    if found != build:
        pytest.skip(f"needs a {build} build of torch; this interpreter's torch is "
                    f"{found or 'absent'} ({sys.executable})")


_PRIVATE_SHM = {}


def private_shm_allowed():
    """Whether this process may run a command in a private mount namespace with its own tmpfs on
    /dev/shm (root, or a user namespace): (True, "") or (False, why)."""
    if "ok" not in _PRIVATE_SHM:
        unshare = shutil.which("unshare")
        if unshare is None:
            _PRIVATE_SHM.update(ok=False, why="no unshare(1)")
        else:
            probe = subprocess.run([unshare, "-m", "sh", "-c",
                                    "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                                   capture_output=True, text=True)
            _PRIVATE_SHM.update(ok=probe.returncode == 0, why=probe.stderr.strip())
    return _PRIVATE_SHM["ok"], _PRIVATE_SHM["why"]


def in_private_shm(cmd, listing, options="size=1g"):
    """`cmd` run in a private mount namespace with a tmpfs of its own on /dev/shm (`options`: its
    mount options), whose files, once the command and the fork server it started (which exits
    after it: waited on, bounded) are gone, are listed into the file `listing`: exactly what the
    command left there, whatever other programs on the machine make in the host's /dev/shm. The
    command must run in a session of its own (start_new_session=True). The exit code is cmd's."""
    return [shutil.which("unshare"), "-m", "sh", "-c",
            f'mount -t tmpfs -o {options} tmpfs /dev/shm || exit 99; '
            '"$@"; rc=$?; for i in $(seq 100); do '
            'pgrep -s 0 -f "forkguard/[_]server.py" >/dev/null || break; sleep 0.05; '
            f'done; ls -A /dev/shm > {listing}; exit $rc', "sh", *cmd]


@pytest.fixture()
def guarded_site_python(tmp_path):
    """A Python whose site-packages holds forkguard's start-up hook (forkguard-guard.pth) and a
    path entry to the build's package, as an installed forkguard has them: a venv over this
    interpreter (its own packages too, after the build's: the torch venv's). FORKGUARD_GUARD set,
    every script it runs is guarded without importing forkguard; unset, nothing is imported."""
    import site

    import forkguard

    build_python = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    hook = os.path.join(build_python, "forkguard-guard.pth")
    assert os.path.exists(hook), "the build places the start-up hook beside the package"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    site_packages = subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
        capture_output=True, text=True, timeout=60).stdout.strip()
    paths = [build_python] + [p for p in site.getsitepackages() if os.path.isdir(p)]
    with open(os.path.join(site_packages, "forkguard-build.pth"), "w") as f:
        f.write("\n".join(paths) + "\n")
    with open(hook) as src, open(os.path.join(site_packages, "forkguard-guard.pth"), "w") as f:
        f.write(src.read())
    return python


def run_bounded(cmd, timeout, input=None, **kwargs):
    """Runs ``cmd`` in a session of its own, ``input`` on its stdin (else /dev/null), its output
    captured as text: a CompletedProcess, whose returncode is "hung" when it had not ended within
    ``timeout`` seconds; its process group (its children included) was then killed, so a hang
    leaves nothing running behind the test."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = "hung"
    return subprocess.CompletedProcess(cmd, rc, out, err)
