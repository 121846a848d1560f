"""The notebook test: a real .ipynb executed by nbclient on Debian's ipykernel. Cell 1
initializes CUDA (the test driver, through ctypes); cell 2 shows multiprocessing's fork children
failing at cuInit with error 3, as users see it; cell 3 runs notebook_launch(train, nproc=2) and
each rank's cuInit succeeds."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELL1 = """\
import ctypes, os
cuda = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"])
print("notebook cuInit:", cuda.cuInit(0))
import forkguard
print("probe:", forkguard.probe().verdict)
"""

CELL2 = """\
import multiprocessing

def child_init(i):
    rc = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)
    if rc != 0:
        raise RuntimeError(f"CUDA error: initialization error (cuInit returned {rc}, "
                           "CUDA_ERROR_NOT_INITIALIZED)")
    return rc

try:
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(child_init, range(2))
    fork_error = None
except RuntimeError as e:
    fork_error = e
    print("multiprocessing fork:", e)
assert fork_error is not None and "cuInit returned 3" in str(fork_error)
"""

CELL3 = """\
def train():
    import ctypes, os
    rc = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"]).cuInit(0)
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: cuInit = {rc}")
    assert rc == 0, rc
    return rc

results = forkguard.notebook_launch(train, nproc=2)
print("results:", results)
assert results == [0, 0]
"""


def cell_text(cell):
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def test_notebook(fake_cuda_env, tmp_path, monkeypatch):
    import forkguard

    # The kernel runs in tmp_path: it finds this forkguard through an absolute PYTHONPATH.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))
    monkeypatch.setenv("PYTHONPATH", package_parent)
    monkeypatch.setenv("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (CELL1, CELL2, CELL3)]
    nbformat.write(nb, tmp_path / "forkguard_notebook.ipynb")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    c1, c2, c3 = (cell_text(c) for c in nb.cells)
    assert "notebook cuInit: 0" in c1 and "probe: initialized" in c1
    assert "cuInit returned 3" in c2
    assert "[rank0]:rank 0 of 2: cuInit = 0" in c3
    assert "[rank1]:rank 1 of 2: cuInit = 0" in c3
    assert "results: [0, 0]" in c3
