"""accelerate's own test_notebook.py, from each accelerate of the matrix (accelerate_matrix.py),
unedited, with ACCELERATE_NUM_PROCESSES=2 on CPU: once on accelerate's notebook_launcher (the
baseline), once with forkguard's substituted for it. forkguard's passes every test accelerate's
passes. docs/accelerate.md has the table (accelerate_matrix.py suite).

Skipped where accelerate is not installed (Debian's torch 1.13.1: accelerate 1.x needs torch 2).
"""
import importlib.util
import sys

import pytest

if importlib.util.find_spec("accelerate") is None:
    pytest.skip("accelerate is not installed under this interpreter (Debian's torch 1.13: "
                "accelerate 1.x needs torch 2); the matrix runs on the torch 2.14 venv",
                allow_module_level=True)

import accelerate_matrix as matrix  # noqa: E402


@pytest.mark.parametrize("version", matrix.pinned_versions())
def test_forkguard_passes_what_accelerate_passes(version):
    installed = matrix.installed()
    if version not in installed:
        pytest.fail(f"accelerate {version} is pinned (python/requirements/) but not installed "
                    f"beside {sys.prefix}: run scripts/install-torch-venv")
    acc = installed[version]
    theirs = matrix.run_suite(acc, "accelerate")
    ours = matrix.run_suite(acc, "forkguard")
    assert theirs.passed, theirs.output[-4000:]  # the baseline ran: the comparison means something
    missing = [t for t in theirs.passed if t not in ours.passed]
    assert not missing, f"forkguard's launcher fails {missing}:\n{ours.output[-6000:]}"
    if theirs.failed is None:
        assert ours.failed is None and ours.returncode == 0, ours.output[-6000:]
    assert "Launching training on 2 CUDAs." in ours.output
