"""forkguard.notebook_launcher: accelerate's signature, environment and messages on
notebook_launch; a notebook that initialized CUDA (the test driver) switches one import and runs
a two-rank gloo all-reduce whose ranks initialize CUDA. Without accelerate (its comparison with
accelerate's own launcher is test_accelerate.py's, on the torch 2.14 venv)."""
import json
import multiprocessing
import os
import socket
import subprocess
import sys

import pytest
from conftest import open_fds, server_children

import forkguard

ENV_KEYS = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "MIXED_PRECISION", "NPROC",
            "NODE_RANK", "FORK_LAUNCHED", "ACCELERATE_MIXED_PRECISION", "ROLE_NAME",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE"]


@pytest.fixture(scope="module", autouse=True)
def server():
    forkguard.start_server(wait=True)
    # The rendezvous store is this process's (a TCPStore); torch's first one opens a pipe it keeps
    # for the life of the process: opened here, before the tests count fds.
    import datetime

    import torch.distributed as dist

    dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10))
    # Likewise multiprocessing's resource tracker (a pipe to it), which the named twins of a fork
    # context's semaphores register with, as any spawn or forkserver semaphore does.
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    yield


@pytest.fixture(autouse=True)
def nothing_left_behind(server, request):
    """After each test: no rank left under the fork server, no new fd here (but in the notebook
    test, where the launch is the kernel's and nbclient's ZeroMQ keeps its own), no /dev/shm file."""
    fds, shm = open_fds(), set(os.listdir("/dev/shm"))
    yield
    assert server_children() == []
    if "notebook" not in request.node.name:
        assert open_fds().items() <= fds.items()
    assert set(os.listdir("/dev/shm")) <= shm


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_env(out_dir):
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in ENV_KEYS}, f)


def read_envs(out_dir, n):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


def test_ranks_see_accelerates_and_the_elastic_agents_environment(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    port = free_port()
    assert forkguard.notebook_launcher(write_env, args=(str(tmp_path),), num_processes=2,
                                       mixed_precision="BF16", use_port=str(port),
                                       rdzv_id="job-3") is None
    for r, e in enumerate(read_envs(tmp_path, 2)):
        assert (e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) == (str(r), str(r), "0")
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        # accelerate's path: MIXED_PRECISION (not ACCELERATE_MIXED_PRECISION), no FORK_LAUNCHED
        assert (e["MIXED_PRECISION"], e["ACCELERATE_MIXED_PRECISION"]) == ("bf16", None)
        assert (e["NPROC"], e["NODE_RANK"], e["FORK_LAUNCHED"]) == ("2", "0", None)
        # torch's elastic agent's
        assert (e["ROLE_NAME"], e["TORCHELASTIC_RUN_ID"]) == ("default_role", "job-3")
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert e["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert e["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{r}/error.json")
    assert "Launching training on 2 CUDAs." in capfd.readouterr().out


def all_reduce(out_dir):
    import torch
    import torch.distributed as dist

    # TORCHELASTIC_USE_AGENT_STORE: the store is the launcher's, as under torch's elastic agent.
    dist.init_process_group("gloo")
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"sum{dist.get_rank()}"), "w") as f:
        f.write(f"{t.item()} {dist.get_world_size()}")
    dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_ranks_rendezvous_through_the_launchers_store(tmp_path, backend):
    forkguard.notebook_launcher(all_reduce, args=(str(tmp_path),), num_processes=2,
                                rdzv_backend=backend, use_port=str(free_port()))
    assert [(tmp_path / f"sum{r}").read_text() for r in range(2)] == ["3.0 2"] * 2


NODE = """\
import sys, forkguard
sys.path.insert(0, {here!r})
from test_notebook_launcher import all_reduce
forkguard.notebook_launcher(all_reduce, args=({out!r},), num_processes=2, num_nodes=2,
                            node_rank=int(sys.argv[1]), use_port={port!r})
"""


def test_two_nodes_make_one_world(tmp_path):
    # Two notebooks, nodes 0 and 1 of a static rendezvous on loopback: four ranks, one all-reduce.
    script = NODE.format(here=os.path.dirname(__file__), out=str(tmp_path), port=str(free_port()))
    nodes = [subprocess.Popen([sys.executable, "-c", script, str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for n in (1, 0)]
    for p in nodes:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
    assert [(tmp_path / f"sum{r}").read_text() for r in range(4)] == ["10.0 4"] * 4


def test_a_static_rendezvous_endpoint_is_the_master(tmp_path):
    port = free_port()
    forkguard.notebook_launcher(write_env, args=(str(tmp_path),), num_processes=2,
                                rdzv_endpoint=f"127.0.0.1:{port}")
    assert {e["MASTER_PORT"] for e in read_envs(tmp_path, 2)} == {str(port)}


def test_num_processes_is_required_as_accelerate_requires_it():
    with pytest.raises(ValueError) as info:
        forkguard.notebook_launcher(write_env)
    assert str(info.value) == ("You have to specify the number of devices you would like to use, "
                               "add `num_processes=...` to your call.")


@pytest.mark.parametrize("kwargs, message", [
    ({"num_processes": 2.5}, "num_processes must be an integer, not float (2.5)"),
    ({"num_processes": 2, "num_nodes": 2.0}, "num_nodes must be an integer, not float (2.0)"),
    ({"num_processes": 2, "max_restarts": 1.0}, "max_restarts must be an integer, not float (1.0)"),
])
def test_a_count_that_is_not_an_integer_is_refused_before_anything_starts(kwargs, message,
                                                                          capfd):
    with pytest.raises(TypeError) as info:
        forkguard.notebook_launcher(write_env, **kwargs)
    assert str(info.value) == message
    # Before accelerate's "Launching training on 2.5 GPUs." line, and before any rank.
    assert capfd.readouterr().out == ""


def test_one_visible_gpu_one_process_this_one(fake_cuda, monkeypatch, capfd):
    # The test driver's NVML shows 3 GPUs, one of them visible; counting initializes nothing.
    monkeypatch.setenv("FORKGUARD_NVML_LIBRARY",
                       os.path.join(os.path.dirname(fake_cuda), "libnvidia-ml.so.1"))
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    seen = []
    forkguard.notebook_launcher(lambda: seen.append(os.getpid()), num_processes=1)
    assert seen == [os.getpid()]
    assert "Launching training on one GPU." in capfd.readouterr().out
    assert forkguard.probe().fork_safe


def test_one_process_runs_in_this_process_as_accelerate_does(capfd, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    seen = []
    forkguard.notebook_launcher(lambda a, b: seen.append((os.getpid(), a + b)), args=(1, 2),
                                num_processes=1)
    assert seen == [(os.getpid(), 3)]
    assert "Launching training on CPU." in capfd.readouterr().out


def fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 has no data")


def test_a_failing_rank_is_torchs_child_failed_error_and_a_rank_error():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    with pytest.raises(ChildFailedError) as info:
        forkguard.notebook_launcher(fail_on_rank_1, num_processes=2, use_port=str(free_port()))
    e = info.value
    assert isinstance(e, forkguard.RankError)
    assert e.rank == 1 and e.exc_type == "KeyError" and "rank 1 has no data" in str(e)
    assert isinstance(e.__cause__, KeyError)
    # torch's side, as accelerate's ChildFailedError carries it: the failed rank, its error file.
    assert e.name == "fail_on_rank_1" and list(e.failures) == [1]
    failure = e.get_first_failure()[1]
    assert (failure.local_rank, failure.exitcode) == (1, 1)
    assert "KeyError: 'rank 1 has no data'" in str(failure.message)  # torch: its error file
    assert "fail_on_rank_1" in e.format_msg()


def tough_nut(queue, seen):
    # accelerate's fault-tolerance test, without its race (both ranks reading): a fork context's
    # Queue shared across restarts; what a rank puts just before it fails reaches the next one.
    if os.environ["RANK"] != "0":
        return
    trial = queue.get(timeout=60)
    if trial > 0:
        queue.put(trial - 1)
        raise RuntimeError("The nut hasn't cracked yet! Try again.")
    seen.put(os.environ["TORCHELASTIC_RESTART_COUNT"])


def test_a_fork_context_queue_travels_across_restarts(capfd):
    ctx = multiprocessing.get_context("fork")
    queue, seen = ctx.Queue(), ctx.Queue()
    queue.put(2)
    forkguard.notebook_launcher(tough_nut, (queue, seen), num_processes=2, max_restarts=3,
                                use_port=str(free_port()))
    assert seen.get(timeout=10) == "2"
    assert queue.empty()
    assert "restarting the group" in capfd.readouterr().err
    queue.put(7)  # this process's own Queue still works, its count given back
    assert queue.get(timeout=10) == 7
    for q in (queue, seen):
        q.close()
        q.join_thread()


@pytest.mark.parametrize("kwargs, message", [
    ({"mixed_precision": "fp32"},
     "Unknown mixed_precision mode: fp32. Choose between ['no', 'fp8', 'fp16', 'bf16']."),
    ({"num_nodes": 2, "rdzv_backend": "c10d"}, "rdzv_backend='c10d' with num_nodes=2 is not "
                                               "supported"),
    ({"rdzv_backend": "etcd"}, "rdzv_backend='etcd' is not supported"),
    # torch's own words, as accelerate's launch gets them
    ({"rdzv_backend": "foo"}, "The rendezvous backend 'foo' is not registered."),
    ({"use_port": "http"}, "The port number of the rendezvous endpoint '127.0.0.1:http' must be "
                           "an integer between 0 and 65536."),
])
def test_arguments_it_cannot_honour_are_named(kwargs, message):
    with pytest.raises(ValueError) as info:
        forkguard.notebook_launcher(print, num_processes=2, **kwargs)
    assert message in str(info.value)


CELL_DIRTY = """\
import ctypes, os
print("notebook cuInit:", ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0))
from forkguard import notebook_launcher   # was: from accelerate import notebook_launcher
"""

CELL_TRAIN = """\
def train(scale):
    import ctypes, os
    import torch
    import torch.distributed as dist
    rc = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)
    dist.init_process_group("gloo")
    t = torch.tensor([scale * (dist.get_rank() + 1.0)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()}/{dist.get_world_size()} local {os.environ['LOCAL_RANK']}: "
          f"cuInit={rc} sum={t.item()} precision={os.environ['MIXED_PRECISION']}")
    dist.destroy_process_group()

notebook_launcher(train, args=(10.0,), num_processes=2, mixed_precision="fp16", use_port="PORT")
"""


def test_a_notebook_that_touched_cuda_runs_a_gloo_all_reduce(fake_cuda_env, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    monkeypatch.setenv("PYTHONPATH", package_parent)
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c)
                for c in (CELL_DIRTY, CELL_TRAIN.replace("PORT", str(free_port())))]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = ["".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream")
            for c in nb.cells]
    assert "notebook cuInit: 0" in text[0]
    assert "Launching training on 2 CUDAs." in text[1]
    for r in range(2):
        assert f"[rank{r}]:rank {r}/2 local {r}: cuInit=0 sum=30.0 precision=fp16" in text[1]
