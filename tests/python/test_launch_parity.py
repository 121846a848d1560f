"""A command rank (`forkguard run`) and a notebook rank (`notebook_launch`) are supervised by the
same C++ supervisor: the same environment (every torchrun variable and everything else forkguard
sets), and the same report, text and JSON, for the same failure."""
import json
import os
import re
import subprocess
import sys

import pytest

import forkguard

# Every variable torchrun's contract names, and OMP_NUM_THREADS (the launcher's default).
TORCHRUN = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
            "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS"]
PORT = "29517"
DUMP = "import json, os; print('ENV' + json.dumps(dict(os.environ)), flush=True)"


@pytest.fixture(scope="module")
def cli(build_dir):
    path = build_dir / "bin" / "forkguard"
    if not path.exists():
        pytest.skip(f"the CLI is not built ({path})")
    forkguard.start_server(wait=True)
    yield str(path)
    forkguard.stop_server()


def set_by_launcher(env):
    """What the launcher set or changed in a rank's environment (the rest is inherited)."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def command_envs(cli, nproc):
    out = subprocess.run(
        [cli, "run", "--quiet", "--nproc-per-node", str(nproc), "--master-port", PORT,
         "--max-restarts", "1", "--", sys.executable, "-c", DUMP],
        capture_output=True, text=True, check=True, timeout=120).stdout
    envs = {}
    for line in out.splitlines():
        m = re.match(r"\[rank(\d+)\]:ENV(.*)", line)
        if m:
            envs[int(m.group(1))] = json.loads(m.group(2))
    return [envs[r] for r in range(nproc)]


def notebook_env():
    return dict(os.environ)


@pytest.mark.parametrize("nproc", [1, 3])
def test_a_notebook_rank_gets_the_environment_of_a_command_rank(cli, nproc):
    commands = command_envs(cli, nproc)
    notebooks = forkguard.notebook_launch(notebook_env, nproc=nproc, master_port=int(PORT),
                                          max_restarts=1)
    for rank, (c, n) in enumerate(zip(commands, notebooks)):
        for k in TORCHRUN:
            assert (k, c.get(k)) == (k, n.get(k)), f"rank {rank}"
        assert c["RANK"] == str(rank) and c["ROLE_NAME"] == "default"
        assert set_by_launcher(c) == set_by_launcher(n), f"rank {rank}"


def exit_3_in_rank_1():
    if os.environ["RANK"] == "1":
        sys.exit(3)


def normalized_report(text):
    """The report without what differs from run to run: PIDs and seconds."""
    text = re.sub(r"PID \d+", "PID N", text)
    return re.sub(r"^( +\d+) +\d+ +\d+\.\d+  ", r"\1 PID SECONDS  ", text, flags=re.M)


def normalized_json(text):
    j = json.loads(text)
    for r in j["ranks"]:
        r["pid"] = r["seconds"] = None
    return j


def test_the_same_failure_gives_the_same_report_text_and_json(cli, tmp_path):
    report = tmp_path / "report.json"
    script = "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"
    cmd = subprocess.run(
        [cli, "run", "--quiet", "--nproc-per-node", "2", "--start-method", "forkserver",
         "--json-report", str(report), "--", sys.executable, "-c", script],
        capture_output=True, text=True, timeout=120)
    assert cmd.returncode == 3, cmd.stderr
    command_report = cmd.stderr[cmd.stderr.rindex("forkguard run: ") + len("forkguard run: "):]
    with pytest.raises(forkguard.RankError) as info:
        forkguard.notebook_launch(exit_3_in_rank_1, nproc=2)
    e = info.value
    assert e.rank == 1 and e.exit_code == 3
    assert normalized_report(e.report) == normalized_report(command_report)
    assert e.report.startswith("rank 1 (local rank 1, PID ")
    assert normalized_json(e.json) == normalized_json(report.read_text())
