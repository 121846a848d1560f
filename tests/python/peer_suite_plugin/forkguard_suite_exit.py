"""A pytest plugin for the runs of PyTorch's DataLoader suite (torch_dataloader_suite.sh): as
pytest's interpreter exits, after every other exit handler, it stops the standard library's
multiprocessing resource tracker and waits for it (10 s at most).

The suite's own ErrorTrackingProcess (a spawn-context Process) starts that tracker in pytest. Left
alone it exits on EOF only after pytest has, and the harness, which lists every process of the
run still alive once pytest exited, can catch it in its last milliseconds (seen: gone 12 ms after
pytest), with torch's class as with ours. Waiting for it here leaves that check to the processes
a DataLoader starts; nothing of forkguard is touched or exempted.

It must run last: every process forked or spawned from pytest holds the tracker's pipe, so it
sees EOF only once persistent workers (stopped by forkguard's exit handler) and daemonic
processes (multiprocessing's) are gone. Exit handlers run in the reverse order of registration,
and this module is imported with pytest's plugins, before torch, forkguard or multiprocessing."""
import atexit
import os
import sys
import time


def _stop_resource_tracker():
    module = sys.modules.get("multiprocessing.resource_tracker")
    tracker = getattr(module, "_resource_tracker", None)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if fd is None or pid is None:
        return  # never started in this process
    os.close(fd)  # its only pipe from us: EOF once every process holding a copy is gone
    tracker._fd = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            tracker._pid = None
            return
        time.sleep(0.005)


assert "multiprocessing" not in sys.modules, "imported too late to run after its exit handler"
atexit.register(_stop_resource_tracker)
