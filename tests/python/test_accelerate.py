"""forkguard.notebook_launcher against accelerate's own, on every accelerate of the matrix
(accelerate_matrix.py: 1.11 to 1.16 on the torch 2.14 venv, each selected by PYTHONPATH):

- the regression in a real Jupyter kernel: which launcher's ranks start in torch's bad fork, on a
  notebook that touched nothing and after `torch.cuda.is_available()` (docs/accelerate.md's table);
- a rank's environment, key by key, under both launchers for the same arguments;
- bad input: accelerate's error text from forkguard's launcher.

Skipped where accelerate is not installed (Debian's torch 1.13.1: accelerate 1.x needs torch 2).
"""
import json
import os
import re
import subprocess
import sys

import pytest

import accelerate_matrix as matrix

matrix.skip_module_without_accelerate()

VERSIONS = matrix.pinned_versions()
NEWEST = VERSIONS[-1]


@pytest.fixture(scope="module")
def installed():
    return matrix.installed()


def accelerate(installed, version):
    if version not in installed:
        pytest.fail(f"accelerate {version} is pinned (python/requirements/) but not installed "
                    f"beside {sys.prefix}: run scripts/install-torch-venv")
    return installed[version]


# --- the regression ---------------------------------------------------------------------------

# Measured (docs/accelerate.md): on torch 2.14, accelerate 1.11 to 1.13 poison the notebook
# themselves before they fork: 1.12 and 1.13 call torch.cuda.is_available() to pick the device,
# and every version before 1.14 builds torch's LaunchConfig without numa_options, whose
# __post_init__ (torch >= 2.9) asks torch.accelerator.is_available(): torch's fork poison too.
# 1.14 (accelerate PR #4059) passes numa_options and asks nothing; 1.16 neither.
POISONS_ITSELF = {"1.11.0": True, "1.12.0": True, "1.13.0": True, "1.14.0": False,
                  "1.15.0": False, "1.16.0": False}


def measured(table, version):
    if version not in table:
        pytest.fail(f"accelerate {version} is in the matrix but not in this test's table of "
                    f"what was measured on it: measure it and add it")
    return table[version]


def assert_ranks(outcome, bad_fork):
    assert outcome.error is None, outcome
    assert len(outcome.ranks) == 2, outcome
    for r in outcome.ranks:
        assert r.bad_fork is bad_fork, outcome
        if bad_fork:
            assert "Cannot re-initialize CUDA in forked subprocess" in r.init, outcome
        else:
            assert "Cannot re-initialize CUDA" not in r.init, outcome


@pytest.mark.parametrize("version", VERSIONS)
def test_regression_in_a_jupyter_kernel(installed, version, tmp_path):
    pytest.importorskip("nbclient")
    res = matrix.run_regression(accelerate(installed, version), str(tmp_path))
    # A notebook that touched nothing.
    assert not res["forkguard"].parent_poisoned
    assert_ranks(res["forkguard"], bad_fork=False)
    assert not res["accelerate"].parent_poisoned
    assert_ranks(res["accelerate"], bad_fork=measured(POISONS_ITSELF, version))
    # After torch.cuda.is_available() in a cell: accelerate's ranks are forks of a poisoned
    # notebook on every version; forkguard's (either way) are not.
    for label in ("accelerate after is_available", "forkguard after is_available",
                  "guard after is_available"):
        assert res[label].parent_poisoned, (label, res[label])
    assert_ranks(res["accelerate after is_available"], bad_fork=True)
    assert_ranks(res["forkguard after is_available"], bad_fork=False)
    assert_ranks(res["guard after is_available"], bad_fork=False)


# --- a rank's environment ---------------------------------------------------------------------

LAUNCH = """\
import json, os, sys
launcher, out, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])

def dump_environment(out):
    import json, os
    with open(os.path.join(out, "rank%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(dict(os.environ), f)

if launcher == "accelerate":
    from accelerate import notebook_launcher
else:
    from forkguard import notebook_launcher
notebook_launcher(dump_environment, args=(out,), **kwargs)
"""


def launch(acc, launcher, out, kwargs, env=None):
    """A new interpreter (a notebook's stand-in) calling `launcher`'s notebook_launcher."""
    os.makedirs(out, exist_ok=True)
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, launcher, out, json.dumps(kwargs)],
        env=dict(env or os.environ, PYTHONPATH=matrix.pythonpath(acc)), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def environments(acc, launcher, out, kwargs, env=None, nodes=1):
    """Each rank's os.environ: {RANK: env}; `nodes` processes run the same call, node_rank i."""
    procs = [launch(acc, launcher, out, dict(kwargs, node_rank=i) if nodes > 1 else kwargs, env)
             for i in range(nodes)]
    for p in procs:
        output, _ = p.communicate(timeout=300)
        assert p.returncode == 0, output
    return {int(f[4:-5]): json.loads(open(os.path.join(out, f)).read())
            for f in os.listdir(out) if f.startswith("rank")}


# Keys whose value is one run's own: compared by form.
PER_RUN = {
    "TORCHELASTIC_ERROR_FILE":
        r".*/torchelastic_[^/]+/{run_id}_[^/]+/attempt_0/{local_rank}/error\.json",
}
# The one deliberate difference (docs/accelerate.md): forkguard's launcher sets OMP_NUM_THREADS=1
# for more than one rank when it is unset (and says so), torch's elastic_launch does not.
FORKGUARD_ONLY = {"OMP_NUM_THREADS": "1"}

CASES = {
    "static": dict(num_processes=2, mixed_precision="fp16", rdzv_id="run-7", max_restarts=1),
    "c10d": dict(num_processes=2, rdzv_backend="c10d"),
    "endpoint": dict(num_processes=2, rdzv_endpoint="127.0.0.1:PORT", mixed_precision="BF16"),
    "rtx40": dict(num_processes=2),  # nvidia-smi shows two RTX 4090s under driver 535
    "nccl_async_0": dict(num_processes=2),  # TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in the notebook
    "two_nodes": dict(num_processes=2, num_nodes=2, master_addr="127.0.0.1"),
}

FAKE_NVIDIA_SMI = """\
#!/bin/sh
case "$*" in
  *count,name*) printf '2, NVIDIA GeForce RTX 4090\\n2, NVIDIA GeForce RTX 4090\\n' ;;
  *driver_version*) printf '535.104.05\\n535.104.05\\n' ;;
  *) exit 1 ;;
esac
"""


def case_environment(case, tmp_path):
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if case == "rtx40":
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
        (bin_dir / "nvidia-smi").chmod(0o755)
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    if case == "nccl_async_0":
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    return env


def compare(ours, theirs, kwargs):
    """Every key of accelerate's rank environment, and no other, with its value (or form)."""
    assert sorted(ours) == sorted(theirs)
    for rank in theirs:
        a, f = theirs[rank], ours[rank]
        extra = {k: f[k] for k in set(f) - set(a)}
        assert extra == FORKGUARD_ONLY, f"rank {rank}: only forkguard's has {extra}"
        assert set(a) <= set(f), f"rank {rank}: only accelerate's has {set(a) - set(f)}"
        for key, value in a.items():
            if key in PER_RUN:
                pattern = PER_RUN[key].format(run_id=re.escape(kwargs.get("rdzv_id", "none")),
                                              local_rank=a["LOCAL_RANK"])
                assert re.fullmatch(pattern, value), (key, value)
                assert re.fullmatch(pattern, f[key]), (key, f[key])
            elif key == "MASTER_PORT" and kwargs.get("rdzv_backend") == "c10d":
                assert f[key].isdigit() and value.isdigit()  # a free port of this host, each run
            else:
                assert f[key] == value, f"rank {rank}: {key}: forkguard {f[key]!r}, " \
                                        f"accelerate {value!r}"


# The variable that carries mixed_precision to the ranks: 1.16 gives them the one its Accelerator
# reads; before, a name accelerate does not read (docs/accelerate.md).
PRECISION_VARIABLE = {"1.11.0": "MIXED_PRECISION", "1.12.0": "MIXED_PRECISION",
                      "1.13.0": "MIXED_PRECISION", "1.14.0": "MIXED_PRECISION",
                      "1.15.0": "MIXED_PRECISION", "1.16.0": "ACCELERATE_MIXED_PRECISION"}


@pytest.mark.parametrize("version", VERSIONS)
def test_a_rank_environment_is_accelerates(installed, version, tmp_path):
    acc = accelerate(installed, version)
    kwargs = dict(CASES["static"], use_port=str(matrix.free_port()))
    env = case_environment("static", tmp_path)
    theirs = environments(acc, "accelerate", str(tmp_path / "accelerate"), kwargs, env)
    ours = environments(acc, "forkguard", str(tmp_path / "forkguard"), kwargs, env)
    compare(ours, theirs, kwargs)
    variable = measured(PRECISION_VARIABLE, version)
    other = ({"MIXED_PRECISION", "ACCELERATE_MIXED_PRECISION"} - {variable}).pop()
    assert theirs[1][variable] == ours[1][variable] == "fp16"
    assert other not in theirs[1] and other not in ours[1]
    assert "FORK_LAUNCHED" not in ours[1]
    assert ours[1]["TORCHELASTIC_RUN_ID"] == "run-7"


@pytest.mark.parametrize("case", ["c10d", "endpoint", "rtx40", "nccl_async_0", "two_nodes"])
def test_a_rank_environment_is_accelerates_for(installed, case, tmp_path):
    acc = accelerate(installed, NEWEST)
    port = str(matrix.free_port())
    kwargs = {k: v.replace("PORT", port) if isinstance(v, str) else v
              for k, v in CASES[case].items()}
    if "rdzv_endpoint" not in kwargs:
        kwargs["use_port"] = port
    env = case_environment(case, tmp_path)
    nodes = kwargs.get("num_nodes", 1)
    theirs = environments(acc, "accelerate", str(tmp_path / "accelerate"), kwargs, env, nodes)
    ours = environments(acc, "forkguard", str(tmp_path / "forkguard"), kwargs, env, nodes)
    compare(ours, theirs, kwargs)
    if case == "rtx40":
        assert ours[0]["NCCL_P2P_DISABLE"] == ours[0]["NCCL_IB_DISABLE"] == "1"
    if case == "two_nodes":
        assert sorted(ours) == [0, 1, 2, 3]
        assert (ours[3]["GROUP_RANK"], ours[3]["LOCAL_RANK"], ours[3]["WORLD_SIZE"]) == \
            ("1", "1", "4")


# --- bad input ------------------------------------------------------------------------------------

BAD_INPUT = """\
import json, sys
launcher = sys.argv[1]
if launcher == "accelerate":
    from accelerate import notebook_launcher
else:
    from forkguard import notebook_launcher

def f(*args):
    pass

out = []
for args, kwargs in json.loads(sys.argv[2]):
    try:
        notebook_launcher(f, *args, **kwargs)
        out.append(None)
    except Exception as e:
        out.append([type(e).__name__, str(e)])
print("RESULT", json.dumps(out))
"""

BAD = [
    ([], {}),  # num_processes=None
    ([], {"num_processes": 2, "mixed_precision": None}),
    ([], {"num_processes": 2, "node_rank": 1}),
    ([], {"num_processes": 2, "num_nodes": 2, "node_rank": 5}),
    ([], {"num_processes": "2"}),
    ([], {"num_processes": 2, "rdzv_backend": "foo"}),
    ([], {"num_processes": 2, "use_port": "http"}),
    ([], {"num_processes": 2, "rdzv_endpoint": "127.0.0.1"}),
    ([], {"num_processes": 2, "rdzv_endpoint": "127.0.0.1:99999"}),
    ([], {"num_processes": 2, "rdzv_backend": "c10d", "rdzv_endpoint": "localhost:x"}),
    ([], {"num_processes": 2, "bogus": 1}),
    ([(), 2, "no", "29500", "127.0.0.1", 0, 1, "static", "", None, "none", 0, 0.1, None, "x"], {}),
    ([], {"num_processes": 0}),  # accepted: one process, this one
    ([], {"num_processes": 1, "mixed_precision": "FP16"}),
]


def bad_input(acc, launcher, cases):
    p = subprocess.run([sys.executable, "-c", BAD_INPUT, launcher, json.dumps(cases)],
                       env=dict(os.environ, PYTHONPATH=matrix.pythonpath(acc)),
                       capture_output=True, text=True, timeout=300)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, p.stdout + p.stderr
    return json.loads(line[-1][len("RESULT "):])


@pytest.mark.parametrize("version", VERSIONS)
def test_bad_input_gets_accelerates_error(installed, version):
    acc = accelerate(installed, version)
    theirs = bad_input(acc, "accelerate", BAD)
    ours = bad_input(acc, "forkguard", BAD)
    for case, a, f in zip(BAD, theirs, ours):
        assert f == a, f"{case}: forkguard {f}, accelerate {a}"


UNKNOWN_PRECISION = [([], {"num_processes": 2, "mixed_precision": "FP32"})]
CHOICES = "Choose between ['no', 'fp8', 'fp16', 'bf16']."
# What accelerate raises for it. 1.11-1.15 mean a ValueError, but their message reads
# `args.mixed_precision` (their args is the tuple of arguments); 1.16 raises it, with the caller's
# spelling. forkguard raises the ValueError on every version (docs/accelerate.md).
UNKNOWN_PRECISION_RAISES = {
    v: ["AttributeError", "'tuple' object has no attribute 'mixed_precision'"]
    for v in ("1.11.0", "1.12.0", "1.13.0", "1.14.0", "1.15.0")}
UNKNOWN_PRECISION_RAISES["1.16.0"] = ["ValueError",
                                      f"Unknown mixed_precision mode: FP32. {CHOICES}"]


@pytest.mark.parametrize("version", VERSIONS)
def test_an_unknown_mixed_precision_is_the_error_accelerate_means(installed, version):
    acc = accelerate(installed, version)
    [theirs] = bad_input(acc, "accelerate", UNKNOWN_PRECISION)
    [ours] = bad_input(acc, "forkguard", UNKNOWN_PRECISION)
    assert theirs == measured(UNKNOWN_PRECISION_RAISES, version)
    if theirs[0] == "ValueError":
        assert ours == theirs
    else:  # what the line that failed meant: the lower-cased value
        assert ours == ["ValueError", f"Unknown mixed_precision mode: fp32. {CHOICES}"]
