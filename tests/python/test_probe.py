"""forkguard.probe() and ensure_fork_safe(): a clean process, then one whose driver (the test
driver) was initialized through ctypes, in a child interpreter so this one stays clean; torch's own
fork poison (a CUDA build's torch.cuda.is_available(), no GPU needed) seen in the parent and in a
bad-fork child, and nothing of it on a CPU build."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types

import pytest
from conftest import need_torch_build

import forkguard
from forkguard import _torch_fork


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


TORCH_KINDS = ("torch_fork_poison", "torch_bad_fork")


def test_torch_fork_poison_is_seen_in_the_parent_and_in_a_bad_fork_child(torch_build):
    need_torch_build("cuda", torch_build)
    r = _child("""
        import json, os, time
        import torch
        import forkguard
        from forkguard import _probe
        before = forkguard.probe()
        available = torch.cuda.is_available()  # torch's device count: registers its fork poison
        after = forkguard.probe()
        t = time.perf_counter()
        for _ in range(100):
            _probe._torch_fork.state()
        per_check = (time.perf_counter() - t) / 100
        try:
            forkguard.ensure_fork_safe()
            message = None
        except forkguard.ForkUnsafeError as e:
            message = str(e)
        r, w = os.pipe()
        pid = os.fork()  # a plain fork: the child is in torch's bad fork
        if pid == 0:
            child = forkguard.probe()
            os.write(w, json.dumps({"bad": torch._C._cuda_isInBadFork(), "verdict": child.verdict,
                                    "safe": child.fork_safe,
                                    "kinds": [e.kind for e in child.evidence]}).encode())
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 65536):
            data += chunk
        os.waitpid(pid, 0)
        print(json.dumps({"available": available, "before": before.verdict,
                          "before_safe": before.fork_safe,
                          "before_kinds": [e.kind for e in before.evidence],
                          "after": after.verdict, "safe": after.fork_safe,
                          "kinds": [e.kind for e in after.evidence], "notes": after.notes,
                          "cures": after.cures, "per_check": per_check, "message": message,
                          "child": json.loads(data)}))
    """)
    # Importing a CUDA build of torch is not the poison: its libraries mapped, fork is safe.
    assert r["before_safe"] and r["before"] in ("clean", "driver_loaded", "nvml_open"), r
    assert not set(TORCH_KINDS) & set(r["before_kinds"])
    assert not r["safe"] and "torch_fork_poison" in r["kinds"], r
    assert not any("cannot be read" in n for n in r["notes"]), r["notes"]
    assert r["per_check"] < 0.005, r["per_check"]  # a byte read once resolved (us, not ms)
    m = r["message"]
    assert m and "torch_fork_poison" in m and "Cannot re-initialize CUDA in forked subprocess" in m
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in m and "forkguard.guard()" in m
    assert r["child"]["bad"] is True and not r["child"]["safe"]
    assert "torch_bad_fork" in r["child"]["kinds"]
    if not r["available"]:  # no GPU: the driver never loaded, torch's flag is the only evidence
        assert r["after"] == "torch_fork_poisoned" and r["kinds"][0] == "torch_fork_poison"
        assert r["child"]["verdict"] == "torch_bad_fork"
    else:  # a GPU: is_available() also ran cuInit, the driver's verdict stands
        assert r["after"] in ("initialized", "context_active")


def test_a_cpu_build_of_torch_changes_nothing(torch_build):
    need_torch_build("cpu", torch_build)
    r = _child("""
        import json, os
        import torch
        import forkguard
        from forkguard import _probe
        before = forkguard.probe()
        available = torch.cuda.is_available(), torch.cuda.device_count()
        after = forkguard.probe()
        print(json.dumps({"available": available, "before": before.verdict,
                          "after": after.verdict, "safe": after.fork_safe,
                          "same": [list(e) for e in before.evidence] == [list(e) for e in after.evidence],
                          "notes": after.notes, "fast": _probe.probe_if_fork_unsafe() is None,
                          "ensure": forkguard.ensure_fork_safe().fork_safe}))
    """)
    assert r["available"] == [False, 0]
    assert r["before"] == r["after"] and r["safe"] and r["same"] and r["fast"] and r["ensure"], r
    assert not any("torch" in n for n in r["notes"]), r["notes"]


def test_an_unreadable_torch_flag_is_a_note_and_torch_lazy_init_still_counts(monkeypatch):
    # A stand-in torch with a CUDA build's bindings whose flag cannot be read (as with a stripped
    # libtorch_python): that is said; torch.cuda._initialized still tells.
    bad_fork = [False]
    monkeypatch.setitem(sys.modules, "torch._C", types.SimpleNamespace(
        _cuda_getDeviceCount=lambda: 0, _cuda_isInBadFork=lambda: bad_fork[0]))
    cuda = types.SimpleNamespace(_initialized=False)
    monkeypatch.setitem(sys.modules, "torch.cuda", cuda)
    for name, value in (("_resolved", False), ("_flags", None), ("_unreadable", None)):
        monkeypatch.setattr(_torch_fork, name, value)

    def unreadable():
        raise _torch_fork._Unreadable("libtorch_python.so has no symbol table (a stand-in)")

    monkeypatch.setattr(_torch_fork, "_read_flags", unreadable)
    s = _torch_fork.state()
    assert s.verdict is None and s.evidence == []
    assert s.notes and "cannot be read here: libtorch_python.so has no symbol" in s.notes[0]
    assert forkguard.probe().fork_safe
    cuda._initialized = True
    r = forkguard.probe()
    assert r.verdict == "torch_fork_poisoned" and not r.fork_safe
    assert r.evidence[0].kind == "torch_fork_poison"
    assert r.evidence[0].source == "torch.cuda._initialized"
    bad_fork[0] = True
    r = forkguard.probe()
    assert r.verdict == "torch_bad_fork" and "torch_bad_fork" in {e.kind for e in r.evidence}
    with pytest.raises(forkguard.ForkUnsafeError, match="Cannot re-initialize CUDA"):
        forkguard.ensure_fork_safe()


def test_a_stripped_library_has_no_flag_to_read(fake_cuda, tmp_path):
    objcopy = shutil.which("objcopy")
    if objcopy is None:
        pytest.skip("no objcopy to make a stripped library")
    stripped = tmp_path / "libstripped.so"
    subprocess.run([objcopy, "--strip-all", fake_cuda, str(stripped)], check=True)
    with pytest.raises(_torch_fork._Unreadable, match="no symbol table"):
        _torch_fork._elf(str(stripped), (_torch_fork._REGISTERED,))
    found, writable = _torch_fork._elf(fake_cuda, ("cuInit",))  # not stripped: found
    assert "cuInit" in found and writable


def test_another_process_with_a_cuda_build_of_torch_carries_the_blind_spot_note(torch_build):
    need_torch_build("cuda", torch_build)
    p = subprocess.Popen([sys.executable, "-c", "import sys, torch; torch.cuda.is_available(); "
                          "print('ready', flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        r = forkguard.probe(p.pid)
        if r.fork_safe:  # no GPU: what /proc shows is fork-safe, and the note says what is not
            assert any("torch's own fork poison is not visible from another process" in n
                       for n in r.notes), r.notes
        assert not {e.kind for e in r.evidence} & set(TORCH_KINDS)
    finally:
        p.stdin.close()
        p.wait()


_OPENMP_CHILD = """
    import json, os
    import torch
    import forkguard
    from forkguard import _probe
    before = forkguard.probe()
    (torch.randn(2_000_000) + 1).sum()  # one parallel CPU op: GNU OpenMP starts its pool
    after = forkguard.probe()
    try:
        forkguard.ensure_fork_safe()
        message = None
    except forkguard.ForkUnsafeError as e:
        message = str(e)
    with open("/proc/self/maps") as f:
        libgomp = any(os.path.basename(line.split()[-1]).startswith("libgomp")
                      for line in f if "/" in line)
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "libgomp": libgomp, "before": before.verdict,
                      "after": after.verdict, "safe": after.fork_safe,
                      "evidence": [list(e) for e in after.evidence], "notes": after.notes,
                      "fast": _probe.probe_if_fork_unsafe() is None, "message": message}))
"""


def _openmp_child(env: dict) -> dict:
    """_OPENMP_CHILD's report; a variable set to None in ``env`` is removed."""
    child_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_OPENMP_CHILD)],
                         capture_output=True, text=True, timeout=300, env=child_env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_live_openmp_pool_is_not_fork_safe(torch_build):
    if torch_build is None:
        pytest.skip(f"no torch under {sys.executable}")
    r = _openmp_child({"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": None})
    if r["threads"] == 1 or not r["libgomp"]:
        # No pool (Debian's torch 1.13 runs one OpenMP thread on this machine): nothing changes.
        assert r["safe"] and r["after"] == r["before"] and r["fast"], r
        assert "openmp_pool" not in {e[0] for e in r["evidence"]}
        pytest.skip(f"torch {r['torch']} starts no GNU OpenMP pool here ({r['threads']} thread(s), "
                    f"libgomp mapped: {r['libgomp']}); checked that the probe says nothing of one")
    assert r["after"] == "openmp_pool" and not r["safe"], r
    assert r["before"] != "openmp_pool"
    pool = [e for e in r["evidence"] if e[0] == "openmp_pool"]
    assert pool and "libgomp" in pool[0][1] and "hangs at its first parallel region" in pool[0][1]
    assert not r["fast"]
    m = r["message"]
    assert m and "a forked child hangs at its first parallel CPU op" in m, m
    assert "GNU OpenMP's thread pool does not survive fork" in m
    assert "Cannot re-initialize CUDA" not in m
    for cure in ("torch.set_num_threads(1)", "OMP_NUM_THREADS=1", "spawn", "forkserver",
                 "forkguard.guard()"):
        assert cure in m, (cure, m)


def test_one_openmp_thread_is_fork_safe(torch_build):
    if torch_build is None:
        pytest.skip(f"no torch under {sys.executable}")
    r = _openmp_child({"OMP_NUM_THREADS": "1"})
    assert r["threads"] == 1
    assert r["safe"] and r["after"] == r["before"] and r["fast"] and r["message"] is None, r
    assert "openmp_pool" not in {e[0] for e in r["evidence"]}
