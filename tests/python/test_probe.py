"""forkguard.probe() and ensure_fork_safe(): a clean process, then one whose driver (the test
driver) was initialized through ctypes, in a child interpreter so this one stays clean."""
import json
import os
import subprocess
import sys
import textwrap

import forkguard


def test_this_process_is_fork_safe():
    r = forkguard.probe()
    assert r.pid == os.getpid()
    assert r.fork_safe and r.verdict in ("clean", "driver_loaded", "nvml_open")
    assert forkguard.ensure_fork_safe().fork_safe
    assert all(isinstance(e, forkguard.Evidence) for e in r.evidence)


def test_the_fork_server_started_at_import():
    assert forkguard._native.owns_fork_server()
    pid = forkguard._native.fork_server_pid()
    assert pid and os.path.exists(f"/proc/{pid}")


def _child(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120, env=os.environ)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_initialized_driver_is_fork_unsafe_with_evidence_and_cures(fake_cuda_env):
    r = _child("""
        import ctypes, json, os
        import forkguard
        before = forkguard.probe()
        cuda = ctypes.CDLL(os.environ["FORKGUARD_TEST_FAKE_CUDA"])
        loaded = forkguard.probe()
        rc = cuda.cuInit(0)
        after = forkguard.probe()
        try:
            forkguard.ensure_fork_safe()
            message = None
        except forkguard.ForkUnsafeError as e:
            message = str(e)
            assert e.result.verdict == after.verdict
        print(json.dumps({"before": before.verdict, "loaded": loaded.verdict, "rc": rc,
                          "after": after.verdict, "safe": after.fork_safe,
                          "evidence": [list(e) for e in after.evidence], "message": message}))
    """)
    assert r["before"] == "clean"
    assert r["loaded"] == "driver_loaded"
    assert r["rc"] == 0
    assert r["after"] in ("initialized", "context_active") and not r["safe"]
    kinds = {e[0] for e in r["evidence"]}
    assert "library_mapped" in kinds and "device_file_open" in kinds
    m = r["message"]
    assert m and "fork is not safe" in m and "evidence:" in m and "cures:" in m
    assert "nvidia-uvm" in m and "notebook_launch" in m


def test_probe_of_another_process():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
    try:
        r = forkguard.probe(p.pid)
        assert r.pid == p.pid and r.verdict == "clean"
    finally:
        p.stdin.close()
        p.wait()
