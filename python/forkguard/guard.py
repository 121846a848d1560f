"""python3 -m forkguard.guard [--refuse|--warn] script.py args...

Runs script.py as __main__ (as ``python3 -m cProfile`` and ``-m trace`` do) with
forkguard.guard() in force: multiprocessing's fork children are plain forks while this process
is fork-safe, and come from forkguard's clean interpreter fork server (default), are refused
(--refuse) or warned about (--warn) once it is not.

``import forkguard.guard`` would shadow the function forkguard.guard with this module: the module
is made callable, so ``forkguard.guard(...)`` keeps working either way.
"""
import os
import runpy
import sys
import types

from . import _guard

USAGE = "usage: python3 -m forkguard.guard [--refuse|--warn|--reroute] script.py [args...]"


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    policy = "reroute"
    while argv and argv[0].startswith("-"):
        flag = argv.pop(0)
        if flag in ("--refuse", "--warn", "--reroute"):
            policy = flag[2:]
        elif flag in ("-h", "--help"):
            print(USAGE)
            print(__doc__.split("\n\n")[1])
            sys.exit(0)
        elif flag == "--":
            break
        else:
            sys.exit(f"{USAGE}\nforkguard.guard: unknown option {flag}")
    if not argv:
        sys.exit(USAGE)
    script = argv[0]
    if not os.path.exists(script):
        sys.exit(f"forkguard.guard: {script}: no such file")
    _guard.guard(policy)
    sys.argv[:] = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


class _CallableModule(types.ModuleType):
    def __call__(self, on_dirty_fork: str = "reroute") -> None:
        _guard.guard(on_dirty_fork)


if __name__ == "__main__":
    main()
else:
    sys.modules[__name__].__class__ = _CallableModule
