# A Python program that initializes CUDA (the test driver, through ctypes) in a function of its
# own, then starts a multiprocessing worker with the start method named on the command line; the
# worker calls cuInit too and exits with its result. Run by tests/trace/trace_test.cpp under
# forkguard trace, which checks that the reports name the lines marked below.
#
#   python_fork.py fork|spawn|forkserver
import ctypes
import multiprocessing
import os
import sys

DRIVER = ctypes.CDLL(os.environ["FORKGUARD_CUDA_DRIVER"])


def init_cuda():
    return DRIVER.cuInit(0)  # marker: init


def worker():
    sys.exit(DRIVER.cuInit(0))  # marker: worker


def main(method):
    print(f"parent cuInit = {init_cuda()}", flush=True)
    ctx = multiprocessing.get_context(method)
    p = ctx.Process(target=worker)
    p.start()  # marker: start
    p.join()
    print(f"child exited {p.exitcode}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
