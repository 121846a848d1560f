"""The accelerate matrix (docs/accelerate.md): every pinned minor of accelerate on the torch 2.14
venv, each selected by PYTHONPATH, and the runs test_accelerate.py checks and the docs' tables
come from.

    PYTHONPATH=build/release/python build/torch-2.14/bin/python \
        tests/python/accelerate_matrix.py regression|suite   # the fork table | test_notebook.py

The versions: the venv's own accelerate (python/requirements/torch-2.14.txt) and each minor
scripts/install-torch-venv put in build/torch-2.14/accelerate/VERSION
(python/requirements/accelerate-matrix.txt). Every run is a new interpreter (a Jupyter kernel or
a python3 process) with one of them first on its PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, NamedTuple, Optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
MATRIX = ROOT / "python" / "requirements" / "accelerate-matrix.txt"
VENV_LOCK = ROOT / "python" / "requirements" / "torch-2.14.txt"


class Accelerate(NamedTuple):
    version: str
    path: Optional[str]  # the directory to put first on PYTHONPATH; None: the venv's own


def skip_module_without_accelerate():
    """At a test module's top: skips the module where this interpreter has no accelerate
    (Debian's torch 1.13: accelerate 1.x needs torch 2); ctest reads pytest's exit code 5."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("accelerate is not installed under this interpreter (Debian's torch 1.13: "
                    "accelerate 1.x needs torch 2); the matrix runs on the torch 2.14 venv",
                    allow_module_level=True)


def _pinned(path: pathlib.Path) -> List[str]:
    return [m.group(1) for m in re.finditer(r"^accelerate==([0-9.]+)", path.read_text(), re.M)]


def pinned_versions() -> List[str]:
    """Every accelerate of the matrix, oldest first, as the tree pins them."""
    return sorted(set(_pinned(MATRIX) + _pinned(VENV_LOCK)),
                  key=lambda v: tuple(int(x) for x in v.split(".")))


def installed() -> Dict[str, Accelerate]:
    """The pinned accelerates this interpreter (the torch 2.14 venv) can run: {version: ...}."""
    found = {}
    own = subprocess.run([sys.executable, "-c", "import accelerate; print(accelerate.__version__)"],
                         capture_output=True, text=True, env=_without_pythonpath())
    if own.returncode == 0:
        found[own.stdout.strip()] = Accelerate(own.stdout.strip(), None)
    for version in _pinned(MATRIX):
        d = pathlib.Path(sys.prefix) / "accelerate" / version
        if (d / "accelerate" / "__init__.py").exists():
            found[version] = Accelerate(version, str(d))
    return {v: found[v] for v in pinned_versions() if v in found}


def _without_pythonpath():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def forkguard_path() -> str:
    """The directory holding the forkguard package this process imports."""
    import forkguard

    return os.path.dirname(os.path.dirname(os.path.abspath(forkguard.__file__)))


def pythonpath(acc: Accelerate) -> str:
    parts = ([acc.path] if acc.path else []) + [forkguard_path()]
    return os.pathsep.join(parts)


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (ip_local_port_range). A port from
    bind(("", 0)) is in that range, where any socket bound to port 0 (gloo's, torch's store
    clients', other tests') may take it between this pick and the launcher's listen: seen as
    EADDRINUSE in a fresh clone's make test, beside the other tests. Below the range only an
    explicit pick can take it. torch's and accelerate's fixed defaults (29400, 29500) are
    avoided."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    picks = random.Random()
    for _ in range(500) if low > 12000 else ():
        port = picks.randrange(10000, low)
        if 29000 <= port < 30000:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the range here: the kernel's pick
        s.bind(("", 0))
        return s.getsockname()[1]


# --- the regression, in a Jupyter kernel ------------------------------------------------------

# One kernel per accelerate, its cells in this order: (label, launcher). forkguard's launcher
# first (it leaves the notebook as it found it), then accelerate's on a notebook that touched
# nothing (its own poison), then the cell, `torch.cuda.is_available()`, and the three
# launchers after it; "guard" is forkguard.guard() left on accelerate's own launcher.
SEQUENCE = [("forkguard", "forkguard"), ("accelerate", "accelerate"), "is_available",
            ("accelerate after is_available", "accelerate"),
            ("forkguard after is_available", "forkguard"),
            ("guard after is_available", "guard")]

CELL_SETUP = """\
import json, os
import torch
OUT = {out!r}

def parent_poisoned():
    # Whether a fork child of this notebook starts in torch's bad fork, asked of a throwaway child.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1" if torch._C._cuda_isInBadFork() else b"0")
        os._exit(0)
    os.close(w)
    flag = os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    return flag

def report(out):
    import json, os
    import torch
    rec = {{"rank": int(os.environ["RANK"]), "bad_fork": bool(torch._C._cuda_isInBadFork())}}
    try:
        torch.cuda.init()
        rec["init"] = "ok"
    except Exception as e:
        rec["init"] = f"{{type(e).__name__}}: {{str(e).splitlines()[0]}}"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{{rec['rank']}}.json"), "w") as f:
        json.dump(rec, f)

def launched(label, launch, port):
    before = parent_poisoned()
    try:
        launch(report, args=(os.path.join(OUT, label),), num_processes=2, use_port=str(port))
        error = None
    except BaseException as e:
        error = f"{{type(e).__name__}}: {{str(e).splitlines()[0] if str(e) else ''}}"
    with open(os.path.join(OUT, label + ".json"), "w") as f:
        json.dump({{"parent_poisoned": before, "error": error}}, f)
"""

CELL_IS_AVAILABLE = "print('torch.cuda.is_available():', torch.cuda.is_available())"

CELL_LAUNCH = {
    "forkguard": "from forkguard import notebook_launcher\n"
                 "launched({label!r}, notebook_launcher, {port})",
    "accelerate": "import accelerate\n"
                  "launched({label!r}, accelerate.notebook_launcher, {port})",
    "guard": "import accelerate, forkguard\nforkguard.guard()\n"
             "launched({label!r}, accelerate.notebook_launcher, {port})",
}

# torch's elastic agent leaves its SIGTERM handler (it raises) in the kernel: a quiet shutdown.
CELL_LAST = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_DFL)"


class RankOutcome(NamedTuple):
    bad_fork: bool
    init: str  # "ok" or the exception torch.cuda.init() raised, its first line


class LaunchOutcome(NamedTuple):
    parent_poisoned: bool  # a fork of the notebook just before the launch was in a bad fork
    error: Optional[str]  # the launch's exception, its first line
    ranks: List[RankOutcome]

    @property
    def verdict(self) -> str:
        if self.error and not self.ranks:
            return "error"
        return "bad fork" if any(r.bad_fork for r in self.ranks) else "clean"


def run_regression(acc: Accelerate, workdir: str) -> Dict[str, LaunchOutcome]:
    """One Jupyter kernel running SEQUENCE with `acc`: {label: outcome}."""
    import nbclient
    import nbformat

    out = tempfile.mkdtemp(prefix=f"accelerate-{acc.version}-", dir=workdir)
    cells = [CELL_SETUP.format(out=out)]
    labels = []
    for step in SEQUENCE:
        if step == "is_available":
            cells.append(CELL_IS_AVAILABLE)
            continue
        label, launcher = step
        labels.append(label)
        cells.append(CELL_LAUNCH[launcher].format(label=label, port=free_port()))
    cells.append(CELL_LAST)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath(acc)
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": out}}).execute()
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    results = {}
    for label in labels:
        meta = json.loads(pathlib.Path(out, label + ".json").read_text())
        ranks = []
        for r in range(2):
            p = pathlib.Path(out, label, f"rank{r}.json")
            if p.exists():
                rec = json.loads(p.read_text())
                ranks.append(RankOutcome(rec["bad_fork"], rec["init"]))
        results[label] = LaunchOutcome(meta["parent_poisoned"], meta["error"], ranks)
    return results


def regression_table(workdir: str) -> str:
    labels = [step[0] for step in SEQUENCE if step != "is_available"]
    rows = ["| accelerate | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    errors = set()
    for acc in installed().values():
        res = run_regression(acc, workdir)
        cells = []
        for label in labels:
            o = res[label]
            errors.update(r.init for r in o.ranks)
            note = " (notebook already poisoned)" if o.parent_poisoned else ""
            cells.append(o.verdict + note + (f"; raised {o.error}" if o.error else ""))
        rows.append(f"| {acc.version} | " + " | ".join(cells) + " |")
    rows.append("")
    rows.append("`torch.cuda.init()` in the ranks raised: " +
                "; ".join(f"`{e}`" for e in sorted(errors)))
    return "\n".join(rows)


# --- accelerate's own test_notebook.py -----------------------------------------------------------

SUITE_RUNNER = """\
import os, resource, runpy, sys
launcher, resume = sys.argv[1], sys.argv[2:] == ["resume"]
# A run that times out is stopped by SIGABRT, each process printing its stack (PYTHONFAULTHANDLER):
# no core files.
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
import accelerate
script = os.path.join(os.path.dirname(accelerate.__file__), "test_utils", "scripts",
                      "test_notebook.py")
if launcher == "forkguard":
    # The script does `from accelerate import notebook_launcher`: it finds forkguard's.
    import forkguard
    accelerate.notebook_launcher = forkguard.notebook_launcher
print("accelerate", accelerate.__version__, "launcher", launcher, "script", script, flush=True)
if resume:
    # After a run caught in the fault-tolerance test's race: main() again, without that test.
    main = runpy.run_path(script, run_name="test_notebook")["main"]
    main.__globals__["test_fault_tolerant"] = lambda: print("(left out)", flush=True)
    main()
else:
    runpy.run_path(script, run_name="__main__")
print("test_notebook.py: main() returned", flush=True)
"""


class SuiteOutcome(NamedTuple):
    returncode: Optional[int]  # None: timed out
    passed: List[str]  # the tests main() announced and got past ("basic notebook can be ran")
    failed: Optional[str]  # the test it stopped in, if any
    output: str
    seconds: float
    tries: int = 1  # runs of the script: those caught in RACE, then the one that counts
    # Where a rank waited in the last run caught in RACE ("Queue.get()", "PartialState()"): then
    # every run with RACE was caught and the outcome is the run without it, but for `passed`,
    # which holds what the runs with RACE passed too; None: the outcome's run got past RACE.
    race: Optional[str] = None


# accelerate's test_fault_tolerant has a race of its own, with either launcher (docs/accelerate.md):
# its function takes an item from a fork context's Queue (3 at first) and, while it is above 0,
# puts it back less one and raises, so the group is restarted; with 0 it calls PartialState(),
# whose init_process_group needs both ranks. A rank that finds the queue empty returns. Whether a
# group starts with 0 left depends on the ranks' timing (a rank stopped before it reached the
# queue, or that found it empty while its peer held the item): then one rank takes the 0 and
# waits in PartialState() for its peer, which returned (gloo's 30 min), or both saw the item and
# one waits in Queue.get() for ever; the launcher waits for that rank (how often: the docs). Such
# a run is stopped at its timeout with every process's stack; the race is told from those stacks,
# not from the timeout alone.
RACE = "fault tolerant"
# (file, function) that tough_nut_function calls where a caught rank waits, as its stack shows.
RACE_WAITS = {("multiprocessing/queues.py", "get"): "Queue.get()",
              ("accelerate/state.py", "__init__"): "PartialState()"}
# Runs of the script per launcher while each is caught in RACE; after the last, the rest of the
# script runs without RACE. accelerate's launcher is the baseline: its one run is what it is.
# forkguard's is the subject: one more run, for a run of RACE that says something.
RACE_RUNS = {"accelerate": 1, "forkguard": 2}
# Seconds a run of the script may take, per launcher: about three times what it takes here on two
# busy cores (accelerate's launcher: 36 s, 30 of them in RACE's pass, waiting for a rank to end on
# SIGTERM; forkguard's: 11 s), so that a run stopped in RACE is not one still on its way.
RUN_TIMEOUT = {"accelerate": 90, "forkguard": 40}
STACK_TIMEOUT = 10  # seconds for a stopped process to print its stack and end


def run_suite(acc: Accelerate, launcher: str, timeout: Optional[float] = None) -> SuiteOutcome:
    """accelerate's own test_notebook.py (its main(), as accelerate's CI runs it) from `acc`'s
    wheel, unedited, with ACCELERATE_NUM_PROCESSES=2 on CPU, on accelerate's launcher or on
    forkguard's substituted for it. A run caught in RACE is run again while RACE_RUNS allows,
    then the tests after RACE in a run without it; the outcome says so (`race`, `tries`)."""
    start = time.monotonic()
    timeout = timeout or RUN_TIMEOUT[launcher]
    for tries in range(1, RACE_RUNS[launcher] + 1):
        o = _run_suite_once(acc, launcher, timeout)
        if o.race is None:
            return o._replace(tries=tries, seconds=time.monotonic() - start)
    rest = _run_suite_once(acc, launcher, timeout, resume=True)
    passed = o.passed + [t for t in rest.passed if t != RACE and t not in o.passed]
    return rest._replace(passed=passed, output=o.output + "\n--- without RACE:\n" + rest.output,
                         seconds=time.monotonic() - start, tries=tries + 1, race=o.race)


def _run_suite_once(acc, launcher, timeout, resume=False):
    env = dict(os.environ, PYTHONPATH=pythonpath(acc), ACCELERATE_NUM_PROCESSES="2",
               CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")
    start = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", SUITE_RUNNER, launcher] +
                         (["resume"] if resume else []), env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        code = p.returncode
    except subprocess.TimeoutExpired:
        # The script, its launcher and ranks print their stacks, one at a time, and end; the
        # output is read meanwhile.
        stopper = threading.Thread(target=_stop_with_stacks, args=(p.pid,))
        stopper.start()
        out, _ = p.communicate()
        stopper.join()
        code = None
    announced = [line[len("Test "):] for line in out.splitlines() if line.startswith("Test ")]
    done = "test_notebook.py: main() returned" in out
    passed = announced if done else announced[:-1]
    failed = None if done else (announced[-1] if announced else "(before the first test)")
    race = _race_wait(out) if code is None and failed == RACE else None
    return SuiteOutcome(code, passed, failed, out, time.monotonic() - start, race=race)


def _stop_with_stacks(pid):
    """Ends the processes of a run that timed out: each descendant of `pid` (deepest first, then
    `pid`) gets SIGABRT, prints its Python stack (PYTHONFAULTHANDLER) and ends before the next
    gets it, so that their stacks do not interleave; then SIGKILL to `pid`'s group for what is
    left."""
    for q in _descendants(pid) + [pid]:
        try:
            fd = os.pidfd_open(q)
        except ProcessLookupError:
            continue
        try:
            signal.pidfd_send_signal(fd, signal.SIGABRT)
            select.select([fd], [], [], STACK_TIMEOUT)  # readable: it ended
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _descendants(pid) -> List[int]:
    """The descendants of `pid` now, deepest first (from /proc's parent links)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # ended meanwhile
            children.setdefault(ppid, []).append(int(entry))
    order = []
    level = children.get(pid, [])
    while level:
        order = level + order
        level = [c for q in level for c in children.get(q, [])]
    return order


_FRAME = re.compile(r'File "([^"]+)", line \d+ in (\S+)')


def _race_wait(output: str) -> Optional[str]:
    """Where a rank of tough_nut_function waits, in the stacks of a stopped run (faulthandler's,
    innermost frame first), if it is one of RACE_WAITS."""
    inner = None
    for line in output.splitlines():
        m = _FRAME.search(line)
        if m and m.group(2) == "tough_nut_function" and inner is not None:
            for (path, function), wait in RACE_WAITS.items():
                if inner[0].endswith("/" + path) and inner[1] == function:
                    return wait
        inner = m.groups() if m else None
    return None


def suite_table() -> str:
    rows = ["| accelerate | accelerate's launcher | forkguard's launcher |", "|---|---|---|"]
    for acc in installed().values():
        cells = []
        for launcher in ("accelerate", "forkguard"):
            o = run_suite(acc, launcher)
            text = f"{len(o.passed)} passed ({o.seconds:.0f} s)"
            if o.race is not None:
                text += (f"; caught in \"{RACE}\"'s race ({o.race}) in {o.tries - 1} run(s), "
                         f"the rest run without it")
            elif o.tries > 1:
                text += f"; run {o.tries} times (the first caught in \"{RACE}\"'s race)"
            if o.failed is not None:
                how = "timed out" if o.returncode is None else f"exit {o.returncode}"
                text += f", stopped in \"{o.failed}\" ({how})"
            cells.append(text)
        rows.append(f"| {acc.version} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv):
    what = argv[1] if len(argv) > 1 else "regression"
    if what == "regression":
        with tempfile.TemporaryDirectory() as d:
            print(regression_table(d))
    elif what == "suite":
        print(suite_table())
    else:
        raise SystemExit(f"usage: {argv[0]} regression|suite")


if __name__ == "__main__":
    main(sys.argv)
