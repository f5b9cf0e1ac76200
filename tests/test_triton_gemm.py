"""The Triton GEMM lane on the CPU: interpreter parity (through the harness's own parity path) and
ahead-of-time compiles for sm_90a and sm_121a against the analytic shared-memory estimate."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_INTERPRET = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from lab.worker import execute
    cases = json.loads(sys.argv[2])
    out = []
    for shape, cfg in cases:
        r = execute({"kind": "trial", "kernel": "gemm", "dsl": "triton", "config": cfg, "shape": shape,
                     "seed": 5, "device": "cpu", "no_timing": True})
        out.append({k: r.get(k) for k in ("status", "error", "parity_rel_l2", "parity_shapes")})
    print("RESULT " + json.dumps(out))
""")

BASE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 2}


def _interpret(cases):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", _INTERPRET, ROOT, json.dumps(cases)], env=env,
                       capture_output=True, text=True, timeout=900)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    return json.loads(line[0][7:])


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_interpreter_parity_all_load_paths(dtype):
    # 67 x 40 x 48: M ragged for every tile; the harness also checks its ragged 197 x 136 x 264 shape.
    shape = {"M": 67, "N": 40, "K": 48, "dtype": dtype}
    cases = [(shape, {**BASE, "LOAD": load}) for load in ("ptr", "tma", "tma_persistent")]
    for (shape, cfg), r in zip(cases, _interpret(cases)):
        assert r["status"] == "ok", (cfg, r)
        assert r["parity_rel_l2"] < (1e-3 if dtype == "float16" else 1e-5)
        assert len(r["parity_shapes"]) == 2  # the timed shape and the ragged one


def test_interpreter_odd_shape_pointer_path_and_tma_refusal():
    from kernels.triton import gemm
    odd = {"M": 45, "N": 37, "K": 29, "dtype": "float16"}
    r, = _interpret([(odd, {**BASE, "LOAD": "ptr"})])
    assert r["status"] == "ok", r
    reason = gemm.config_reason({**BASE, "LOAD": "tma"}, odd)
    assert reason and "16-byte aligned" in reason


# Configs typical of each target; the estimate must equal the compiler's figure for these.
_AOT = [(bm, bn, bk, st, w, load)
        for (bm, bn, bk, st, w) in [(128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (64, 64, 32, 4, 4), (256, 128, 64, 2, 8),
                                    (64, 128, 32, 5, 4)]
        for load in ("ptr", "tma", "tma_persistent")]


def _target_cache(monkeypatch, session_cache, target):
    """Triton's cache for ``target`` shared by this session's tests (the lane's own per-target folder)."""
    from kernels.triton import gemm
    for name, value in gemm.cache_env(session_cache / "dsl" / "triton" / target, target).items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_aot_smem_matches_estimate(target, monkeypatch, session_cache):
    _target_cache(monkeypatch, session_cache, target)
    from kernels.triton import gemm
    shape = {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"}
    mismatches = []
    for bm, bn, bk, st, w, load in _AOT:
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": w, "num_stages": st, "LOAD": load}
        got = gemm.compile_for(cfg, shape, target)
        assert got["smem_bytes"] > 0 and got["compile_s"] > 0
        est = gemm.smem_estimate(cfg, shape, target)
        if est != got["smem_bytes"]:
            mismatches.append((cfg, est, got["smem_bytes"]))
    assert not mismatches, mismatches


def test_aot_sm121a_differs_from_sm90a(monkeypatch, session_cache):
    """The same config asks for less shared memory on sm_121a (one stage fewer): targets matter."""
    from kernels.triton import gemm
    shape = {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"}
    cfg = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "LOAD": "tma"}
    _target_cache(monkeypatch, session_cache, "sm_90a")
    h = gemm.compile_for(cfg, shape, "sm_90a")["smem_bytes"]
    _target_cache(monkeypatch, session_cache, "sm_121a")
    g = gemm.compile_for(cfg, shape, "sm_121a")["smem_bytes"]
    assert h == 3 * (128 * 64 + 64 * 256) * 2 + 24
    assert g == 2 * (128 * 64 + 64 * 256) * 2 + 16 and g <= 101_376 < h


def test_target_rules():
    from kernels.triton import gemm
    assert gemm.eligibility("sm_75") and "no path" in gemm.eligibility("sm_75")
    assert gemm.target_reason({**BASE, "LOAD": "tma"}, "sm_80")
    assert gemm.target_reason({**BASE, "LOAD": "ptr"}, "sm_80") is None
