"""Fork hazards beyond CUDA, as users meet them: a parallel CPU op in the parent starts GNU
OpenMP's thread pool (torch 2.14's libgomp), and a forked child hangs for ever at its first
parallel op. The plain fork, accelerate's notebook_launcher and Lightning's ddp_notebook hang;
under forkguard.guard() (and FORKGUARD_GUARD=1) their children come from the clean fork server and
run, with a fork child's semantics (the script is not run again). Debian's torch 1.13 runs with
one OpenMP thread here: no pool, no hang, and the guard forks plainly.

Every script runs in its own session, bounded: a hang is killed with its whole group and
reported as "hung", never left behind.
"""
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
from conftest import marked_pids, run_bounded

import forkguard

HANG_AFTER = 25  # seconds: a child op that takes ms, not finished by then, hangs for ever

PARALLEL_OP = "(torch.randn(2_000_000) + 1).sum()"


@pytest.fixture(scope="module")
def has_pool():
    """Whether a parallel op leaves a live GNU OpenMP pool under this interpreter's torch (torch
    2.14's PyPI build: yes; Debian's 1.13, one thread here: no), asked of a child interpreter."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import time, torch
        {PARALLEL_OP}
        time.sleep(0.2)
        import forkguard
        print(forkguard.probe().verdict)
    """)], capture_output=True, text=True, timeout=300, env=_env())
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1] == "openmp_pool"


def _env(**extra):
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("FORKGUARD_GUARD", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in (extra.pop("PYTHONPATH_FIRST", None), package_parent) if p])
    env.update(extra)
    return env


def run(tmp_path, body, *args, timeout=HANG_AFTER, **env):
    """Runs the script; (returncode or "hung", stdout, stderr). A hung run is killed with its
    process group (its children included) and nothing of it outlives this call."""
    marker = uuid.uuid4().hex
    path = tmp_path / f"s{marker[:8]}.py"
    path.write_text(textwrap.dedent(body))
    done = run_bounded([sys.executable, str(path), *args], timeout, cwd=tmp_path,
                       env=_env(FORKGUARD_HAZARD_TEST=marker, **env))
    # Children that left the group (an elastic agent's) are found by the marker.
    for pid in marked_pids(f"FORKGUARD_HAZARD_TEST={marker}"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while marked_pids(f"FORKGUARD_HAZARD_TEST={marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_pids(f"FORKGUARD_HAZARD_TEST={marker}") == []
    return done.returncode, done.stdout, done.stderr


PLAIN_FORK = f"""
import sys, torch
import multiprocessing as mp
import forkguard

def op(q):
    q.put(float({PARALLEL_OP}) > 0)

if __name__ == "__main__":
    {PARALLEL_OP}
    if sys.argv[1] == "guard":
        forkguard.guard()
    q = mp.SimpleQueue()
    p = mp.Process(target=op, args=(q,))
    p.start()
    p.join()
    print("child", q.get(), p.exitcode, flush=True)
"""


def test_a_parallel_op_then_a_fork_hangs_the_child_the_guard_reroutes_it(tmp_path, has_pool):
    plain = run(tmp_path, PLAIN_FORK, "plain")
    guarded = run(tmp_path, PLAIN_FORK, "guard", timeout=300)
    assert guarded[0] == 0 and "child True 0" in guarded[1], guarded
    if not has_pool:  # Debian's 1.13: one thread, nothing to hang on, nothing rerouted
        assert plain[0] == 0 and "child True 0" in plain[1], plain
        assert "clean interpreter fork server" not in guarded[2], guarded[2]
        return
    assert plain[0] == "hung", plain
    assert "openmp_pool" in guarded[2] and "clean interpreter fork server" in guarded[2], \
        guarded[2]


def test_one_openmp_thread_leaves_no_pool_and_the_guard_forks_plainly(tmp_path):
    out = run(tmp_path, PLAIN_FORK, "guard", timeout=300, OMP_NUM_THREADS="1")
    assert out[0] == 0 and "child True 0" in out[1], out
    assert "clean interpreter fork server" not in out[2], out[2]


ACCELERATE = f"""
import os, sys, torch
import accelerate
from accelerate import notebook_launcher

def rank(out):
    {PARALLEL_OP}
    with open(os.path.join(out, "rank" + os.environ["RANK"]), "w") as f:
        f.write(str(torch._C._cuda_isInBadFork()))

torch.cuda.is_available()
{PARALLEL_OP}
if sys.argv[1] == "guard":
    import forkguard
    forkguard.guard()
print("forkguard imported:", "forkguard" in sys.modules, flush=True)
notebook_launcher(rank, args=(sys.argv[2],), num_processes=2, use_port=sys.argv[3])
print("ranks", sorted(os.listdir(sys.argv[2])),
      sorted(open(os.path.join(sys.argv[2], f)).read() for f in os.listdir(sys.argv[2])))
"""


@pytest.fixture(scope="module")
def accelerates():
    import accelerate_matrix as matrix

    matrix.skip_module_without_accelerate()
    return matrix


def test_accelerate_notebook_launcher_after_a_parallel_op_hangs_under_guard_runs(
        tmp_path, has_pool, accelerates):
    if not has_pool:
        pytest.skip("no GNU OpenMP pool under this torch: nothing hangs")
    matrix = accelerates
    installed = matrix.installed()
    newest = max(installed, key=lambda v: tuple(int(x) for x in v.split(".")))
    for version, acc in installed.items():
        modes = ("plain", "guard") if version == newest else ("guard",)
        for mode in modes:
            out_dir = tmp_path / f"{version}-{mode}"
            out_dir.mkdir()
            rc, out, err = run(tmp_path, ACCELERATE, mode, str(out_dir), str(matrix.free_port()),
                               timeout=HANG_AFTER if mode == "plain" else 300,
                               PYTHONPATH_FIRST=acc.path)
            if mode == "plain":
                assert rc == "hung", (version, rc, out, err)
                continue
            assert rc == 0, (version, out, err)
            assert "ranks ['rank0', 'rank1'] ['False', 'False']" in out, (version, out, err)


def test_accelerate_notebook_launcher_under_the_environment_variable(
        tmp_path, has_pool, accelerates, guarded_site_python):
    if not has_pool:
        pytest.skip("no GNU OpenMP pool under this torch: nothing hangs")
    matrix = accelerates
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    env = _env(FORKGUARD_GUARD="1")
    env.pop("PYTHONPATH")
    path = tmp_path / "launch.py"
    path.write_text(textwrap.dedent(ACCELERATE))
    out = run_bounded([guarded_site_python, str(path), "plain", str(out_dir),
                       str(matrix.free_port())], 300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "forkguard imported: True" in out.stdout, out.stdout
    assert "ranks ['rank0', 'rank1'] ['False', 'False']" in out.stdout, out.stdout + out.stderr


# Fork-style, as in a notebook cell: no `if __name__ == "__main__":`. A rerouted child that ran
# the script again would launch again from inside a rank ("An attempt has been made to start a
# new process before the current process has finished its bootstrapping phase").
LIGHTNING = f"""
import os, sys, torch
from lightning_fabric import Fabric

def train(fabric, out):
    {PARALLEL_OP}
    fabric.barrier()
    with open(os.path.join(out, f"rank{{fabric.global_rank}}"), "w") as f:
        f.write(str(torch._C._cuda_isInBadFork()))

if "is_available" in sys.argv[2]:
    torch.cuda.is_available()
if "op" in sys.argv[2]:
    {PARALLEL_OP}
if sys.argv[1] == "guard":
    import forkguard
    forkguard.guard()
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook")
fabric.launch(train, sys.argv[3])
if fabric.global_rank == 0:
    print("ranks", sorted(os.listdir(sys.argv[3])),
          sorted(open(os.path.join(sys.argv[3], f)).read() for f in os.listdir(sys.argv[3])))
"""


@pytest.fixture(scope="module")
def lightning():
    import importlib.util

    if importlib.util.find_spec("lightning_fabric") is None:
        pytest.skip("Lightning is not installed under this interpreter (the torch 2.14 venv's "
                    "lock pins pytorch-lightning; Debian's torch 1.13 has none)")


def test_lightning_ddp_notebook_after_a_parallel_op_hangs_under_guard_runs(
        tmp_path, has_pool, lightning):
    if not has_pool:
        pytest.skip("no GNU OpenMP pool under this torch: nothing hangs")
    for mode in ("plain", "guard"):
        out_dir = tmp_path / mode
        out_dir.mkdir()
        rc, out, err = run(tmp_path, LIGHTNING, mode, "op", str(out_dir),
                           timeout=HANG_AFTER if mode == "plain" else 300, OMP_NUM_THREADS="2")
        if mode == "plain":
            assert rc == "hung", (rc, out, err)
            continue
        assert rc == 0, (out, err)
        assert "ranks ['rank0', 'rank1'] ['False', 'False']" in out, (out, err)


def test_lightning_ddp_notebook_of_a_script_without_a_main_guard_after_is_available(
        tmp_path, lightning):
    # The seed: under guard() it failed in every rank with "bootstrapping phase" (exit 1).
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    rc, out, err = run(tmp_path, LIGHTNING, "guard", "is_available", str(out_dir), timeout=300)
    assert rc == 0, (out, err)
    assert "bootstrapping phase" not in err, err
    assert "ranks ['rank0', 'rank1'] ['False', 'False']" in out, (out, err)


DATALOADER = f"""
import sys, time, torch
import forkguard

class Sums(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return (torch.randn(2_000_000) + i).sum() * 0 + i  # a parallel op, were threads > 1

{PARALLEL_OP}
loader = forkguard.DataLoader(Sums(), batch_size=2, num_workers=2)
it = iter(loader)
print("batches", [b.tolist() for b in it], flush=True)
print("why", it._why, flush=True)
"""


def test_dataloader_workers_after_a_parallel_op_fork_and_run(tmp_path):
    # Its workers run torch with one thread (as torch's own): forked, they never wait for the
    # parent's pool, so the loader keeps fork's cost and delivers every batch.
    rc, out, err = run(tmp_path, DATALOADER, timeout=300)
    assert rc == 0, (out, err)
    assert "batches [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]" in out, (out, err)
    assert "clean fork server" not in err, err
    if "GNU OpenMP" not in out:  # no pool under this torch (Debian's 1.13): fork-safe
        assert "why this process is fork-safe" in out, out


def test_torchs_fork_poison_comes_before_the_pool_in_the_verdict(tmp_path, has_pool,
                                                                torch_build):
    # Both at once (the notebook seed: is_available(), then a parallel op): the verdict is the
    # CUDA one, which decides how a DataLoader watches its workers; the pool stays in evidence.
    if not has_pool or torch_build != "cuda":
        pytest.skip("needs torch 2.14's poison and pool")
    rc, out, err = run(tmp_path, f"""
        import time, torch, forkguard
        torch.cuda.is_available()
        {PARALLEL_OP}
        time.sleep(0.2)
        r = forkguard.probe()
        print(r.verdict, r.fork_safe, r.evidence[0].kind, "openmp_pool" in [e.kind for e in r.evidence])
    """, timeout=300)
    assert rc == 0, err
    assert out.split() == ["torch_fork_poisoned", "False", "torch_fork_poison", "True"], out


def test_forkguard_notebook_launcher_after_a_parallel_op_runs_its_ranks(tmp_path, has_pool):
    # Its ranks come from the interpreter fork server, started while this process was clean:
    # neither the pool nor torch's poison reaches them (on both torches).
    rc, out, err = run(tmp_path, f"""
        import os, sys, torch
        import forkguard

        def rank():
            {PARALLEL_OP}
            return int(os.environ["RANK"])

        torch.cuda.is_available()
        {PARALLEL_OP}
        print("ranks", sorted(forkguard.notebook_launch(rank, nproc=2)))
    """, timeout=300)
    assert rc == 0, (out, err)
    assert "ranks [0, 1]" in out, (out, err)
