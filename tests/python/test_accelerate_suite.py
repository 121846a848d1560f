"""accelerate's own test_notebook.py, from each accelerate of the matrix (accelerate_matrix.py),
unedited, with ACCELERATE_NUM_PROCESSES=2 on CPU: once on accelerate's notebook_launcher (the
baseline), once with forkguard's substituted for it. forkguard's passes every test accelerate's
passes, and the whole script where accelerate's got through it or was caught in the race of its
fault-tolerance test (accelerate_matrix.RACE: with either launcher, told from the stacks of the
stopped run; forkguard's gets a second run, then the rest of the script runs without that test,
and a warning says so). docs/accelerate.md has the table (accelerate_matrix.py suite).

Skipped where accelerate is not installed (Debian's torch 1.13.1: accelerate 1.x needs torch 2).
"""
import sys
import warnings

import pytest

import accelerate_matrix as matrix

matrix.skip_module_without_accelerate()


@pytest.mark.parametrize("version", matrix.pinned_versions())
def test_forkguard_passes_what_accelerate_passes(version):
    installed = matrix.installed()
    if version not in installed:
        pytest.fail(f"accelerate {version} is pinned (python/requirements/) but not installed "
                    f"beside {sys.prefix}: run scripts/install-torch-venv")
    acc = installed[version]
    theirs = matrix.run_suite(acc, "accelerate")
    ours = matrix.run_suite(acc, "forkguard")
    print(f"accelerate {version}: accelerate's launcher: {summary(theirs)}; forkguard's: "
          f"{summary(ours)}")
    assert theirs.passed, theirs.output[-4000:]  # the baseline ran: the comparison means something
    # The baseline may be caught in its test's race (then the rest of the script ran without it),
    # and in nothing else: a hang elsewhere means the baseline itself is broken here.
    assert not (theirs.returncode is None and theirs.race is None), \
        f"accelerate's own launcher hung in {theirs.failed!r}:\n{theirs.output[-6000:]}"
    if theirs.race is not None:
        warnings.warn(f"accelerate {version}: accelerate's own launcher was caught in its "
                      f"test_notebook.py's {matrix.RACE!r} race ({theirs.race}): that test has "
                      f"no baseline; forkguard's launcher is held to the whole script")
    if ours.race is not None:  # in each of its runs: the race, told by the stacks, not a failure
        warnings.warn(f"accelerate {version}: forkguard's launcher was caught in "
                      f"test_notebook.py's {matrix.RACE!r} race ({ours.race}) in "
                      f"{ours.tries - 1} runs; the rest of the script ran without it")
    exempt = [matrix.RACE] if ours.race is not None else []
    missing = [t for t in theirs.passed if t not in ours.passed and t not in exempt]
    assert not missing, f"forkguard's launcher fails {missing}:\n{ours.output[-6000:]}"
    if theirs.failed is None or theirs.race is not None:
        assert ours.failed is None and ours.returncode == 0, ours.output[-6000:]
    assert "Launching training on 2 CUDAs." in ours.output


def summary(o):
    text = f"{len(o.passed)} passed in {o.tries} run(s), {o.seconds:.0f} s"
    if o.race is not None:
        text += f", caught in {matrix.RACE!r}'s race ({o.race})"
    if o.failed is not None:
        how = "timed out" if o.returncode is None else f"exit {o.returncode}"
        text += f", stopped in {o.failed!r} ({how})"
    return text
