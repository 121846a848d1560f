# A PyTorch program that runs one parallel CPU op (GNU OpenMP starts its thread pool there), then
# os.fork()s a child that exits at once: a child that ran a parallel op would hang for ever. Run by
# tests/trace/trace_test.cpp under forkguard trace with torch 2.14, which checks that the report
# names the lines marked below.
#
#   python_openmp.py
import os
import threading
import time

import torch


def warm_up():
    return (torch.randn(2_000_000) + 1).sum()  # marker: parallel op


def wait_for_workers_to_block():
    # The probe sees a pool by its workers blocked in libgomp. After an op they spin a while first
    # (GOMP_SPINCOUNT), longer on a loaded machine: wait, up to 30 s, until none of them runs.
    me = str(threading.get_native_id())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = False
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            running = running or (tid != me and state == "R")
        if not running:
            return
        time.sleep(0.001)
    raise SystemExit("GNU OpenMP's workers still run after 30 s")


def main():
    warm_up()
    wait_for_workers_to_block()
    pid = os.fork()  # marker: fork
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    print(f"torch {torch.__version__}: child exited {code}", flush=True)


if __name__ == "__main__":
    main()
