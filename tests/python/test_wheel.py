"""forkguard as a pip user installs it: the wheel (built from the sdist by the python_wheel_build
test, tests/python/wheel_build.sh, and repaired by auditwheel) installed into a fresh venv of this
test's torch, and everything it gives used from outside the source tree, with nothing of the build
tree on the path: the `forkguard` and `forkguard-bench` commands and `python -m forkguard`, the
version, doctor, run, trace (a dirty fork reported with its Python line), `python -m
forkguard.guard` and FORKGUARD_GUARD's start-up hook, DataLoader, notebook_launch; a torch-free
venv; a broken installation named; and an uninstall that leaves the venv as it was.

The venvs are made from Debian's /usr/bin/python3: for torch 1.13 with its site-packages (Debian's
torch, cloudpickle), for torch 2.14 without, and a .pth naming the torch-2.14 venv's; the torch-free
one sees only build/wheel-tools (cloudpickle, no torch). pip installs with --no-index: the
dependencies are checked against what is there, nothing is downloaded.
"""
import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("FORKGUARD_BUILD_DIR", ROOT / "build" / "release")).resolve()
OUT = BUILD / "wheel"
TORCH = os.environ.get("FORKGUARD_TEST_TORCH", "")
FAKE_CUDA = BUILD / "lib" / "fake_cuda" / "libcuda.so.1"
PLAIN_DRIVER = BUILD / "lib" / "trace_fake_cuda" / "libcuda.so.1"  # uninstrumented, for trace


def project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(forkguard VERSION ([0-9.]+)", text).group(1)


def files_under(root):
    return {str(p.relative_to(root)) for p in pathlib.Path(root).rglob("*")}


def purelib(python):
    """The site-packages directory of the interpreter ``python``."""
    return pathlib.Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())


def clean_env(**extra):
    """This process's environment without anything that points into the build tree."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "FORKGUARD_BUILD_DIR", "FORKGUARD_CUDA_DRIVER",
                        "FORKGUARD_NVML_LIBRARY", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheel():
    found = sorted((OUT / "repaired").glob("forkguard-*.whl"))
    assert found, (f"no repaired wheel in {OUT / 'repaired'}: the python_wheel_build test makes "
                   f"it (ctest -R python_wheel)")
    return found[0]


class Venv:
    def __init__(self, path, extra_site=None, system_site=False):
        self.path = pathlib.Path(path)
        cmd = ["/usr/bin/python3", "-m", "venv", str(self.path)]
        if system_site:
            cmd.insert(3, "--system-site-packages")
        subprocess.run(cmd, check=True)
        self.python = self.path / "bin" / "python"
        self.site = purelib(self.python)
        if extra_site:
            (self.site / "forkguard-test-extra.pth").write_text(f"{extra_site}\n")
        self.before = files_under(self.path)

    def bin(self, name):
        return str(self.path / "bin" / name)

    def pip(self, *args):
        return subprocess.run([str(self.python), "-m", "pip", "--disable-pip-version-check",
                               *args], capture_output=True, text=True, env=clean_env())

    def run(self, args, cwd, timeout=120, **env):
        return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, env=clean_env(**env))


def install(venv, wheel):
    r = venv.pip("install", "--no-index", str(wheel))
    assert r.returncode == 0, r.stdout + r.stderr
    return venv


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel):
    """A fresh venv of this test's torch with the wheel installed."""
    root = tmp_path_factory.mktemp("venv")
    if TORCH.startswith("1."):
        v = Venv(root / "v", system_site=True)  # Debian's torch 1.13 and cloudpickle
    else:
        v = Venv(root / "v", extra_site=sysconfig.get_paths()["purelib"])  # the torch-2.14 venv's
    return install(v, wheel)


@pytest.fixture()
def work(tmp_path):
    """A working directory outside the source and build trees."""
    return tmp_path


def test_the_wheel_is_manylinux_and_carries_the_commands_the_trace_library_and_the_hook(wheel):
    assert re.fullmatch(r"forkguard-[0-9.]+-cp3\d+-cp3\d+-manylinux_2_\d+_x86_64\.whl",
                        wheel.name), wheel.name
    show = (OUT / "auditwheel-show.txt").read_text()
    assert "manylinux_2_" in show, show
    with zipfile.ZipFile(wheel) as z:
        infos = {i.filename: i for i in z.infolist()}
        meta = z.read(next(n for n in infos if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in infos if n.endswith("entry_points.txt"))).decode()
    for name in ("forkguard/bin/forkguard", "forkguard/bin/forkguard-bench"):
        assert (infos[name].external_attr >> 16) & stat.S_IXUSR, f"{name} is not executable"
    assert "forkguard/lib/libforkguard_trace.so" in infos
    assert any(re.fullmatch(r"forkguard/_native\.cpython-3\d+-x86_64-linux-gnu\.so", n)
               for n in infos)
    assert {"forkguard/py.typed", "forkguard/_native.pyi", "forkguard-guard.pth"} <= set(infos)
    # Nothing of the C++ library's development install (headers, CMake package, libforkguard.so).
    assert not [n for n in infos if n.endswith((".hpp", ".cmake", ".a", ".pc"))]
    assert f"Version: {project_version()}" in meta
    assert re.search(r"^Requires-Python: (<3\.14,>=3\.9|>=3\.9,<3\.14)$", meta, re.M), meta
    assert re.search(r"^Requires-Dist: cloudpickle>=2\.2$", meta, re.M)
    assert re.search(r"^Provides-Extra: torch$", meta, re.M)
    assert re.search(r"^Provides-Extra: accelerate$", meta, re.M)
    assert "forkguard = forkguard.__main__:main" in entry_points
    assert "forkguard-bench = forkguard.__main__:bench" in entry_points


def test_one_version_from_the_command_the_module_and_the_package(venv, work):
    want = project_version()
    assert venv.run([venv.bin("forkguard"), "--version"], work).stdout.strip() == want
    assert venv.run([venv.python, "-m", "forkguard", "--version"], work).stdout.strip() == want
    r = venv.run([venv.python, "-c", "import forkguard; print(forkguard.__version__); "
                  "print(forkguard.__file__)"], work)
    version, where = r.stdout.split()
    assert version == want
    assert pathlib.Path(where).resolve().is_relative_to(venv.site.resolve()), where


def test_doctor_json_describes_a_clean_process(venv, work):
    r = venv.run([venv.bin("forkguard"), "doctor", "--json"], work)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["verdict"] == "clean" and doc["fork_safe"] is True


def test_run_starts_two_ranks_with_torchruns_environment(venv, work):
    r = venv.run([venv.bin("forkguard"), "run", "--nproc-per-node", "2", "--", venv.python, "-c",
                  "import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])"],
                 work)
    assert r.returncode == 0, r.stderr
    assert "rank 0 of 2" in r.stdout and "rank 1 of 2" in r.stdout, r.stdout


def test_bench_is_found_beside_the_command(venv, work):
    for cmd in ([venv.bin("forkguard-bench"), "--help"], [venv.bin("forkguard"), "bench", "--help"]):
        r = venv.run(cmd, work)
        assert r.returncode == 0, r.stderr
        assert "loader" in r.stdout, r.stdout


DIRTY_FORK = '''\
import ctypes, multiprocessing, os, sys

DRIVER = ctypes.CDLL(os.environ["DRIVER"])


def init_cuda():
    return DRIVER.cuInit(0)  # marker: init


def worker():
    sys.exit(DRIVER.cuInit(0))


if __name__ == "__main__":
    print("parent cuInit =", init_cuda(), flush=True)
    p = multiprocessing.get_context("fork").Process(target=worker)
    p.start()
    p.join()
    print("child cuInit =", p.exitcode, flush=True)
'''


def test_trace_reports_the_dirty_fork_with_its_python_line(venv, work):
    script = work / "dirty_fork.py"
    script.write_text(DIRTY_FORK)
    line = DIRTY_FORK.splitlines().index("    return DRIVER.cuInit(0)  # marker: init") + 1
    r = venv.run([venv.bin("forkguard"), "trace", "--json", work / "events.json", "--",
                  venv.python, script], work, DRIVER=str(PLAIN_DRIVER),
                 FORKGUARD_CUDA_DRIVER=str(PLAIN_DRIVER))
    assert r.returncode == 0, r.stderr
    assert "child cuInit = 3" in r.stdout  # the test driver's answer in a bad fork, as CUDA's
    assert f"{script}:{line}" in r.stderr, r.stderr  # the report names the init's line
    events = json.loads((work / "events.json").read_text())["events"]
    init = [e for e in events if e["event"] == "cuda_init"]
    assert init and init[0]["python_frames"][0]["file"] == str(script), init
    assert init[0]["python_frames"][0]["line"] == line


def guard_env(work):
    dev = work / "dev"
    dev.mkdir(exist_ok=True)
    return {"DRIVER": str(FAKE_CUDA), "FORKGUARD_CUDA_DRIVER": str(FAKE_CUDA),
            "FAKE_CUDA_DEV_DIR": str(dev)}


def test_the_guard_module_and_the_start_up_hook_reroute_the_dirty_fork(venv, work):
    script = work / "dirty_fork.py"
    script.write_text(DIRTY_FORK)  # never imports forkguard
    env = guard_env(work)
    plain = venv.run([venv.python, script], work, **env)
    assert "child cuInit = 3" in plain.stdout, plain.stdout + plain.stderr  # the failure
    for cmd, extra in (([venv.python, "-m", "forkguard.guard", script], {}),
                       ([venv.python, script], {"FORKGUARD_GUARD": "reroute"})):
        r = venv.run(cmd, work, **env, **extra)
        assert r.returncode == 0, r.stderr
        assert "parent cuInit = 0" in r.stdout and "child cuInit = 0" in r.stdout, \
            (cmd, extra, r.stdout, r.stderr)


def test_dataloader_with_two_workers_and_notebook_launch_of_two_ranks(venv, work):
    script = work / "train.py"
    script.write_text(textwrap.dedent('''\
        import json, os
        import torch
        import forkguard


        class Squares(torch.utils.data.Dataset):
            def __len__(self):
                return 10

            def __getitem__(self, i):
                return i * i


        def rank():
            return int(os.environ["RANK"])


        if __name__ == "__main__":
            loader = forkguard.DataLoader(Squares(), batch_size=4, num_workers=2)
            batches = [b.tolist() for b in loader]
            print(json.dumps({"torch": torch.__version__.split("+")[0], "batches": batches,
                              "ranks": forkguard.notebook_launch(rank, nproc=2)}))
        '''))
    r = venv.run([venv.python, script], work, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the venv's torch is the one this test runs under (1.13: Debian's reports 1.13.0a0)
    assert out["torch"].split(".")[:2] == TORCH.split(".")[:2], out
    assert out["batches"] == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    assert out["ranks"] == [0, 1]


def test_a_torch_free_venv_imports_probes_launches_and_names_what_needs_torch(wheel, tmp_path):
    tools = ROOT / "build" / "wheel-tools"  # scripts/install-deps
    v = install(Venv(tmp_path / "v", extra_site=purelib(tools / "bin" / "python")), wheel)
    script = tmp_path / "no_torch.py"
    script.write_text(textwrap.dedent('''\
        import importlib.util, os, sys
        import forkguard

        assert importlib.util.find_spec("torch") is None
        print("verdict", forkguard.probe().verdict)


        def rank():
            return int(os.environ["RANK"]) * 10


        if __name__ == "__main__":
            print("ranks", forkguard.notebook_launch(rank, nproc=2))
            try:
                forkguard.DataLoader
            except ImportError as e:
                print("error", e)
        '''))
    r = v.run([v.python, script], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "verdict clean" in r.stdout and "ranks [0, 10]" in r.stdout, r.stdout
    assert "forkguard.DataLoader is torch's DataLoader and needs PyTorch" in r.stdout, r.stdout
    assert "pip install 'forkguard[torch]'" in r.stdout


def test_a_missing_or_not_executable_command_is_named_with_its_path(venv, work):
    exe = venv.site / "forkguard" / "bin" / "forkguard"
    mode = exe.stat().st_mode
    try:
        exe.chmod(mode & ~(stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH))
        r = venv.run([venv.bin("forkguard"), "--version"], work)
        assert r.returncode != 0
        assert f"the forkguard executable is not executable: {exe}" in r.stderr, r.stderr
        exe.chmod(mode)
        exe.rename(exe.with_name("forkguard.moved"))
        r = venv.run([venv.python, "-m", "forkguard", "--version"], work)
        assert r.returncode != 0
        assert f"the forkguard executable is missing from this installation: {exe}" in r.stderr
    finally:
        if exe.with_name("forkguard.moved").exists():
            exe.with_name("forkguard.moved").rename(exe)
        exe.chmod(mode)
    assert venv.run([venv.bin("forkguard"), "--version"], work).returncode == 0


def test_uninstall_leaves_the_venv_as_it_was(venv):
    # last in this file: the venv is the module's
    r = venv.pip("uninstall", "--yes", "forkguard")
    assert r.returncode == 0, r.stderr
    assert files_under(venv.path) == venv.before, sorted(files_under(venv.path) ^ venv.before)


def test_a_build_for_another_system_is_refused_saying_why(tmp_path):
    # pip builds an sdist with CMake: elsewhere than Linux it stops at once, with the reason
    cmake = shutil.which("cmake", path="/usr/bin") or shutil.which("cmake")
    r = subprocess.run([cmake, "-S", str(ROOT), "-B", str(tmp_path / "b"),
                        "-DCMAKE_SYSTEM_NAME=Darwin", "-DFORKGUARD_BUILD_TESTS=OFF"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "forkguard builds and runs on Linux only" in r.stderr and "not on Darwin" in r.stderr, \
        r.stderr
