"""forkguard.notebook_launcher: accelerate's signature, environment and messages on
notebook_launch; a notebook that initialized CUDA (the test driver) switches one import and runs
a two-rank gloo all-reduce whose ranks initialize CUDA."""
import json
import os
import socket

import pytest
from conftest import open_fds, server_children

import forkguard

ENV_KEYS = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "ACCELERATE_MIXED_PRECISION", "NPROC",
            "NODE_RANK", "FORK_LAUNCHED"]


@pytest.fixture(scope="module", autouse=True)
def server():
    forkguard.start_server(wait=True)
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


def test_ranks_see_accelerate_and_torchrun_environment(tmp_path, capfd):
    port = free_port()
    assert forkguard.notebook_launcher(write_env, args=(str(tmp_path),), num_processes=2,
                                       mixed_precision="BF16", use_port=str(port)) is None
    for r, e in enumerate(read_envs(tmp_path, 2)):
        assert (e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) == (str(r), str(r), "0")
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", str(port))
        assert e["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert e["ACCELERATE_MIXED_PRECISION"] == "bf16"
        assert (e["NPROC"], e["NODE_RANK"], e["FORK_LAUNCHED"]) == ("2", "0", "1")
    assert "Launching training on 2 GPUs." in capfd.readouterr().out


def test_a_static_rendezvous_endpoint_is_the_master(tmp_path):
    port = free_port()
    forkguard.notebook_launcher(write_env, args=(str(tmp_path),), num_processes=2,
                                rdzv_endpoint=f"127.0.0.1:{port}")
    assert {e["MASTER_PORT"] for e in read_envs(tmp_path, 2)} == {str(port)}


def test_num_processes_none_is_one_rank_per_visible_gpu(fake_cuda, tmp_path, monkeypatch, capfd):
    # The test driver's NVML shows 3 GPUs; counting them initializes nothing.
    monkeypatch.setenv("FORKGUARD_NVML_LIBRARY",
                       os.path.join(os.path.dirname(fake_cuda), "libnvidia-ml.so.1"))
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "3")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert forkguard._native.visible_gpu_count() == 3
    forkguard.notebook_launcher(write_env, args=(str(tmp_path),), use_port=str(free_port()))
    assert [e["RANK"] for e in read_envs(tmp_path, 3)] == ["0", "1", "2"]
    assert "Launching training on 3 GPUs." in capfd.readouterr().out
    # One visible GPU: one process, this one, as accelerate does.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    seen = []
    forkguard.notebook_launcher(lambda: seen.append(os.getpid()))
    assert seen == [os.getpid()]
    assert "Launching training on one GPU." in capfd.readouterr().out
    assert forkguard.probe().fork_safe


def test_one_process_runs_in_this_process_as_accelerate_does(capfd, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    seen = []
    forkguard.notebook_launcher(lambda a, b: seen.append((os.getpid(), a + b)), args=(1, 2))
    assert seen == [(os.getpid(), 3)]
    assert "Launching training on CPU." in capfd.readouterr().out


def fail_on_rank_1():
    if os.environ["RANK"] == "1":
        raise KeyError("rank 1 has no data")


def test_a_failing_rank_is_a_rank_error():
    with pytest.raises(forkguard.RankError) as info:
        forkguard.notebook_launcher(fail_on_rank_1, num_processes=2, use_port=str(free_port()))
    assert info.value.rank == 1 and info.value.exc_type == "KeyError"


@pytest.mark.parametrize("kwargs, message", [
    ({"mixed_precision": "fp32"},
     "Unknown mixed_precision mode: fp32. Choose between ['no', 'fp8', 'fp16', 'bf16']."),
    ({"num_nodes": 2}, "num_nodes=2 is not supported"),
    ({"rdzv_backend": "etcd"}, "rdzv_backend='etcd' is not supported"),
    ({"log_line_prefix_template": "${rank}:"}, "log_line_prefix_template is not supported"),
    ({"use_port": "http"}, "port 'http' is not a number"),
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
          f"cuInit={rc} sum={t.item()} precision={os.environ['ACCELERATE_MIXED_PRECISION']}")
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
    assert "Launching training on 2 GPUs." in text[1]
    for r in range(2):
        assert f"[rank{r}]:rank {r}/2 local {r}: cuInit=0 sum=30.0 precision=fp16" in text[1]
