"""The commands the package carries: ``forkguard ...`` and ``python -m forkguard ...`` run the
``forkguard`` executable (run, doctor, trace, bench), ``forkguard-bench ...`` the benchmarks.

They lie in the package itself, ``forkguard/bin/`` (with the trace library in
``forkguard/lib/``, where the executable looks for it), in a wheel as in the build tree; the
console scripts pip writes on the environment's PATH come here, and this process becomes the
executable (``execv``: its exit status, signals and output are the command's own).
"""
import os
import sys


def _run(name: str) -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", name)
    if not os.path.isfile(path):
        sys.exit(f"forkguard: the {name} executable is missing from this installation: {path} "
                 "(reinstall forkguard: pip install --force-reinstall forkguard)")
    if not os.access(path, os.X_OK):
        sys.exit(f"forkguard: the {name} executable is not executable: {path} "
                 "(reinstall forkguard, or chmod +x it)")
    # `import forkguard` started the C++ fork server, a child this process would leave unreaped
    # (a zombie under the command) once it becomes the executable.
    from . import _native

    _native.stop_fork_server()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(path, [path, *sys.argv[1:]])
    except OSError as e:
        sys.exit(f"forkguard: cannot run {path}: {e.strerror}")


def main() -> None:
    _run("forkguard")


def bench() -> None:
    _run("forkguard-bench")


if __name__ == "__main__":
    main()
