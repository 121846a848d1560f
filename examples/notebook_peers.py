"""`make demo`'s Python part: the notebook scenarios, side by side, in real Jupyter kernels.

    PYTHONPATH=build/release/python build/torch-2.14/bin/python examples/notebook_peers.py

Each kernel is ipykernel under this interpreter (the torch 2.14.1 venv that scripts/install-deps
makes; jupyter_client puts sys.executable in the "python3" kernel spec) and runs the notebook's
first cell, which needs no GPU to do harm on torch's CUDA build:

    import torch; torch.cuda.is_available(); (torch.randn(2_000_000) + 1).sum()

is_available() registers torch's fork poison (a forked child's first CUDA use raises "Cannot
re-initialize CUDA in forked subprocess"), and the parallel sum starts GNU OpenMP's thread pool (a
forked child hangs at its first parallel op). Then each scenario in a cell of its own, timed:

- accelerate's notebook_launcher (2 ranks, fork), for the venv's newest accelerate and 1.13
  (build/torch-2.14/accelerate/VERSION, installed beside the venv by scripts/install-torch-venv),
  against forkguard.notebook_launcher on the same function: each rank asks CUDA for a tensor
  (torch.zeros(1, device="cuda")), then does the parallel sum.
- torch.utils.data.DataLoader(num_workers=2) over a Dataset whose __getitem__ asks CUDA for a
  tensor (falling back to the CPU, as such datasets do, and recording what CUDA said), against
  forkguard.DataLoader on the same Dataset.

Each launcher runs in a fresh kernel (cell 1, then its own cells); the two DataLoaders share one.
Every cell is bounded (--timeout): a cell still running then is reported "hung (killed after N
s)", the kernel is interrupted, then killed with every process of its session (a later cell would
get a fresh kernel that runs cell 1 again). This process is the child subreaper of everything the
kernels start, so no rank outlives the demo: what is left of a kernel 10 s after it ended is
named and killed. The peers' failures and hangs are the expected outcome, printed in the table; the exit
code is 1 when a forkguard side did not deliver (or a process was left over), else 0.

OMP_NUM_THREADS is removed from the kernels' environment: the hang needs OpenMP's pool of more
than one thread, which is what a notebook gets by default on a machine with several cores.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import pathlib
import queue
import signal
import sys
import tempfile
import time
from typing import Dict, List, NamedTuple, Optional, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARK = "@@notebook_peers "  # a cell's result line: MARK + JSON
PR_SET_CHILD_SUBREAPER = 36

# The notebook's first cell, as the issue has it; the last line reports to this process.
CELL_POISON = """\
import torch
available = torch.cuda.is_available()
(torch.randn(2_000_000) + 1).sum()
import json, sys
print({mark!r} + json.dumps({{"available": available, "threads": torch.get_num_threads(),
      "python": sys.executable, "torch": torch.__version__}}), flush=True)
"""

# The function the launchers run, defined in the notebook as users do. Each rank writes what it
# reached to OUT/rank<R>.json: a rank that hangs in the parallel sum leaves {"started": ...}.
CELL_RANK_FUNCTION = """\
OUT = {out!r}

def rank_function():
    import json, os, time, torch
    rank = int(os.environ["RANK"])
    path = os.path.join(OUT, f"rank{{rank}}.json")
    rec = {{"pid": os.getpid(), "bad_fork": bool(torch._C._cuda_isInBadFork())}}
    try:
        torch.zeros(1, device="cuda")
        rec["cuda"] = "ok"
    except Exception as e:
        rec["cuda"] = f"{{type(e).__name__}}: {{str(e).splitlines()[0]}}"
    with open(path, "w") as f:
        json.dump(dict(rec, stage="parallel sum"), f)
    t = time.monotonic()
    rec["sum"] = float((torch.randn(2_000_000) + 1).sum())
    rec["sum_seconds"] = time.monotonic() - t
    rec["stage"] = "done"
    with open(path, "w") as f:
        json.dump(rec, f)
    print(f"rank {{rank}}: CUDA: {{rec['cuda']}}; parallel sum {{rec['sum']:.0f}} in "
          f"{{rec['sum_seconds']:.2f}} s", flush=True)
"""

CELL_LAUNCH = """\
import glob, json, os, time
{imports}
t = time.monotonic()
try:
    {launcher}(rank_function, num_processes=2, use_port={port!r})
    error = None
except BaseException as e:
    error = f"{{type(e).__name__}}: {{str(e).strip().splitlines()[0] if str(e).strip() else ''}}"
seconds = time.monotonic() - t
ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(OUT, "rank*.json")))]
print({mark!r} + json.dumps({{"seconds": seconds, "error": error, "ranks": ranks}}), flush=True)
"""

# Kernel output not worth showing: tqdm (imported by accelerate) without ipywidgets.
NOISE = ("TqdmWarning: IProgress not found", "from .autonotebook import tqdm")

LAUNCHERS = {
    "accelerate": ("import accelerate", "accelerate.notebook_launcher"),
    "forkguard": ("import forkguard", "forkguard.notebook_launcher"),
}

CELL_DATASET = """\
import torch

class CudaInWorker(torch.utils.data.Dataset):
    # A sample made on the GPU where CUDA starts, on the CPU where it does not, with what CUDA said.
    def __len__(self):
        return 16

    def __getitem__(self, i):
        try:
            x = torch.full((4,), float(i), device="cuda").cpu()
            said = "ok"
        except RuntimeError as e:
            x = torch.full((4,), float(i))
            said = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        return x, said

dataset = CudaInWorker()
"""

CELL_LOAD = """\
import collections, json, time, warnings
{imports}
t = time.monotonic()
said = collections.Counter()
batches, error = 0, None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        for x, cuda in {loader}(dataset, batch_size=4, num_workers=2):
            batches += 1
            said.update(cuda)
    except BaseException as e:
        error = f"{{type(e).__name__}}: " + " / ".join(
            line.strip() for line in str(e).strip().splitlines()
            if "Error" in line or "CUDA" in line)[:300]
warned = sorted({{w.category.__name__ for w in caught if "CUDA" in str(w.message)}})
print({mark!r} + json.dumps({{"seconds": time.monotonic() - t, "error": error, "batches": batches,
                             "said": dict(said), "warned": warned}}), flush=True)
"""

LOADERS = {
    "torch": ("import torch.utils.data", "torch.utils.data.DataLoader"),
    "forkguard": ("import forkguard", "forkguard.DataLoader"),
}


class CellResult(NamedTuple):
    hung: bool
    seconds: float  # wall time of the cell, as this process saw it
    result: Optional[dict]  # the cell's MARK line
    error: Optional[str]  # an exception the cell raised (not the scenario's: the cell's own)
    output: str


def _stat(pid: int) -> Optional[List[str]]:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, session, ...)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


# This process's own children before the first kernel (`import forkguard` starts its fork server
# here): not a kernel's.
_OWN: List[int] = []


def _related(sid: int) -> List[int]:
    """Live processes of session `sid` (a kernel's: jupyter_client starts it with setsid) and this
    process's children but its own (orphans are reparented to it, the subreaper)."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields and fields[0] != "Z" and int(entry) not in _OWN and (
                int(fields[3]) == sid or int(fields[1]) == os.getpid()):
            found.append(int(entry))
    return found


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = "?"
    return f"PID {pid} ({_first(cmd, 80)})"


def _reap():
    """Reaps this process's ended children (orphans reparented to it included)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_all(sid: int, grace: float) -> List[str]:
    """Waits up to `grace` seconds for what is left of a kernel (its session, orphans) to end on
    its own (forkguard's fork server ends on its socket's EOF); kills what is left then and returns
    its descriptions."""
    deadline = time.monotonic() + grace
    while True:
        _reap()
        left = _related(sid)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    named = [_describe(pid) for pid in left]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    while _related(sid) and time.monotonic() < deadline + 10:
        _reap()
        time.sleep(0.05)
    _reap()
    return named


class Kernel:
    """One ipykernel under this interpreter, in a session of its own."""

    def __init__(self, env: Dict[str, str], cwd: str):
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        # The kernel's own stdout/stderr (ipykernel's notices) to a file: its cells' output comes
        # over the iopub channel.
        self.log_path = os.path.join(cwd, f"kernel-{time.monotonic_ns()}.log")
        with open(self.log_path, "w") as log:
            self.km.start_kernel(env=env, cwd=cwd, stdout=log, stderr=log)
        self.pid = self.km.provisioner.process.pid
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code: str, timeout: float) -> CellResult:
        start = time.monotonic()
        msg_id = self.kc.execute(code, store_history=False)
        out, error = [], None
        while True:
            left = start + timeout - time.monotonic()
            if left <= 0:
                return CellResult(True, time.monotonic() - start, None, None, "".join(out))
            try:
                msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
            elif kind == "status" and content["execution_state"] == "idle":
                break
        text = "".join(out)
        result = None
        for line in text.splitlines():
            if line.startswith(MARK):
                result = json.loads(line[len(MARK):])
        return CellResult(False, time.monotonic() - start, result, error, text)

    def close(self, hung: bool) -> List[str]:
        """Ends the kernel (a hung one: interrupted first, then killed with its process group, as
        Jupyter's "restart" does) and waits for every process it started to end; returns those
        that had to be killed after that."""
        if hung:
            self.km.interrupt_kernel()  # SIGINT to the kernel's process group, as Jupyter does
        self.kc.stop_channels()
        try:
            self.km.shutdown_kernel(now=hung)
        except Exception:  # a kernel that does not answer: killed below with its session
            pass
        return _end_all(self.pid, grace=10)


def _first(text: str, width: int = 90) -> str:
    """The first sentence of `text`, at most `width` characters."""
    text = text.split(". ")[0]
    return text if len(text) <= width else text[:width - 3] + "..."


def launch_summary(cell: CellResult, ranks: List[dict], timeout: float) -> Tuple[str, bool]:
    """(what a launch cell got, whether both ranks ran to the end outside a bad fork)."""
    parts = []
    bad = sum(x["bad_fork"] for x in ranks)
    parts.append(f"{len(ranks)} ranks started" + (f", {bad} in a bad fork" if bad else ""))
    cuda = sorted({x["cuda"] for x in ranks})
    if cuda:
        parts.append("CUDA: " + "; ".join(_first(c) for c in cuda))
    done = [x for x in ranks if x["stage"] == "done"]
    stuck = [x for x in ranks if x["stage"] != "done"]
    if done:
        parts.append(f"{len(done)} finished the parallel sum")
    if cell.hung:
        if stuck:
            parts.append(f"{len(stuck)} stuck in the {stuck[0]['stage']}")
        return ", ".join(parts) + f": hung (killed after {timeout:.0f} s)", False
    if cell.result is None:
        return f"cell failed: {cell.error or cell.output.strip()[-200:]}", False
    r = cell.result
    if r["error"]:
        parts.append("raised " + _first(r["error"]))
    ok = len(done) == 2 and not bad and not r["error"]
    return ", ".join(parts) + f" ({r['seconds']:.1f} s)", ok


def load_summary(cell: CellResult, timeout: float) -> Tuple[str, bool]:
    if cell.hung:
        return f"hung (killed after {timeout:.0f} s)", False
    if cell.result is None:
        return f"cell failed: {cell.error or cell.output.strip()[-200:]}", False
    r = cell.result
    parts = [f"{r['batches']}/4 batches"]
    if r["said"]:
        parts.append("the workers' CUDA call: " + "; ".join(
            f"{_first(k)} (x{v})" for k, v in sorted(r["said"].items())))
    if r["warned"]:
        parts.append("warned " + ", ".join(r["warned"]))
    if r["error"]:
        parts.append("raised " + _first(r["error"], 200))
    ok = r["batches"] == 4 and not r["error"] and not any(
        "re-initialize" in k for k in r["said"])
    return ", ".join(parts) + f" ({r['seconds']:.1f} s)", ok


class Notebook:
    """A poisoned notebook: a kernel that ran the first cell; a fresh one after a hang."""

    def __init__(self, env, workdir, timeout, log):
        self.env, self.workdir, self.timeout, self.log = env, workdir, timeout, log
        self.kernel = None
        self.left_over: List[str] = []

    def cell(self, code: str) -> CellResult:
        if self.kernel is None:
            self.kernel = Kernel(self.env, self.workdir)
            first = self.kernel.run(CELL_POISON.format(mark=MARK), self.timeout)
            if first.result is None:
                with open(self.kernel.log_path) as f:
                    log = f.read()[-2000:]
                raise SystemExit(f"notebook_peers: the first cell failed: {first.error}\n"
                                 f"{first.output}\nthe kernel's log:\n{log}")
            self.log("  cell 1 (kernel {python}, torch {torch}): torch.cuda.is_available() = "
                     "{available}, the parallel sum on {threads} threads".format(**first.result))
        result = self.kernel.run(code, self.timeout)
        if result.hung:
            self.close(hung=True)
        return result

    def close(self, hung=False):
        if self.kernel is not None:
            self.left_over += self.kernel.close(hung)
            self.kernel = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=60, help="seconds per cell (default 60)")
    ap.add_argument("--accelerate", nargs="*", default=None,
                    help="accelerate versions to show (default: the newest installed and 1.13.0)")
    args = ap.parse_args(argv)

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit(f"notebook_peers: prctl(PR_SET_CHILD_SUBREAPER): "
                         f"{os.strerror(ctypes.get_errno())}")
    import forkguard

    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import accelerate_matrix  # the pinned accelerates, each a PYTHONPATH entry

    installed = accelerate_matrix.installed()
    wanted = args.accelerate
    if wanted is None:
        wanted = [max(installed, key=lambda v: tuple(map(int, v.split("."))))] + \
            (["1.13.0"] if "1.13.0" in installed else [])
    missing = [v for v in wanted if v not in installed]
    if missing:
        raise SystemExit(f"notebook_peers: accelerate {', '.join(missing)} not installed beside "
                         f"{sys.prefix} (scripts/install-torch-venv); installed: "
                         f"{', '.join(installed)}")

    import torch

    def log(line):
        print(line, flush=True)

    log(f"=== Jupyter kernels on {sys.executable} (torch {torch.__version__}), forkguard "
        f"{forkguard.__version__}; every cell bounded by {args.timeout:.0f} s ===")
    rows, failures = [], []
    _OWN.extend(_related(-1))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="notebook-peers-") as work:
        base = dict(os.environ, PYDEVD_DISABLE_FILE_VALIDATION="1")
        for name in ("OMP_NUM_THREADS", "FORKGUARD_GUARD", "PYTHONPATH"):
            base.pop(name, None)

        def notebook(acc):
            env = dict(base, PYTHONPATH=accelerate_matrix.pythonpath(acc))
            return Notebook(env, work, args.timeout, log)

        def show(cell):
            for line in cell.output.splitlines():
                if not line.startswith(MARK) and not any(n in line for n in NOISE):
                    log("  | " + line)
            if cell.hung:
                log(f"  (hung: interrupted and killed with its kernel after {args.timeout:.0f} s)")

        def summed(side, summary, nb):
            """A side's summary with what its kernels left behind (killed); forkguard's fails
            for it."""
            text, ok = summary
            if nb.left_over:
                text += f"; left {len(nb.left_over)} process(es) behind, killed"
                log(f"  left behind by the {side} side's kernel: {', '.join(nb.left_over)}")
                ok = False
            return text, ok

        for version in wanted:
            acc = installed[version]
            cells = {}
            for side in ("accelerate", "forkguard"):
                # Each side in a fresh notebook: accelerate's launch may leave the kernel hung.
                nb = notebook(acc)
                out = tempfile.mkdtemp(prefix=f"{side}-{version}-", dir=work)
                imports, launcher = LAUNCHERS[side]
                log(f"--- {launcher}(rank_function, num_processes=2), accelerate {version}")
                try:
                    nb.cell(CELL_RANK_FUNCTION.format(out=out))
                    cell = nb.cell(CELL_LAUNCH.format(imports=imports, launcher=launcher,
                                                      port=str(accelerate_matrix.free_port()),
                                                      mark=MARK))
                    show(cell)
                finally:
                    nb.close()
                ranks = [json.loads(p.read_text()) for p in sorted(pathlib.Path(out).glob("rank*"))]
                cells[side] = summed(side, launch_summary(cell, ranks, args.timeout), nb)
            rows.append((f"notebook_launcher, accelerate {version}'s vs forkguard's (2 ranks: a CUDA "
                         "tensor, then a parallel sum)", cells))

        nb = notebook(installed[wanted[0]])
        cells = {}
        try:
            nb.cell(CELL_DATASET)
            for side in ("torch", "forkguard"):
                imports, loader = LOADERS[side]
                log(f"--- for x, said in {loader}(dataset, batch_size=4, num_workers=2)")
                cell = nb.cell(CELL_LOAD.format(imports=imports, loader=loader, mark=MARK))
                show(cell)
                cells[side] = load_summary(cell, args.timeout)
                if cell.hung:
                    nb.cell(CELL_DATASET)
        finally:
            nb.close()
        cells = {"accelerate": cells["torch"],
                 "forkguard": summed("forkguard", cells["forkguard"], nb)}
        rows.append(("DataLoader, torch's vs forkguard's (2 workers, 16 samples; __getitem__ "
                     "makes a CUDA tensor, a CPU one if CUDA fails)", cells))

    # Every kernel ended, and what it started with it: a process alive now escaped all of that.
    escaped = _end_all(-1, grace=10)
    if escaped:
        failures.append("processes left after every kernel ended (killed): " + ", ".join(escaped))

    print()
    print("| scenario (in a kernel that ran cell 1) | torch / accelerate | forkguard |")
    print("|---|---|---|")
    for scenario, cells in rows:
        print(f"| {scenario} | {cells['accelerate'][0]} | {cells['forkguard'][0]} |")
        if not cells["forkguard"][1]:
            failures.append(f"{scenario}: forkguard: {cells['forkguard'][0]}")
    print()
    print(f"notebook_peers: {len(rows)} scenarios in {time.monotonic() - started:.0f} s; "
          f"{len(escaped)} process(es) left over at the end")
    for f in failures:
        print(f"notebook_peers: FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
