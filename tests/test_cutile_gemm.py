"""The cuTile GEMM lane on the CPU: ahead-of-time compiles (tileiras) for sm_90a and sm_121a, the
shared memory read from the cubin against the analytic bound, and the lane's refusals.

No GPU is needed: cuTile exports cubins for an explicit target (``export_kernel(gpu_code=...)``)."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

import pytest

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.cutile import gemm
from tests.test_space_values import harness_reason

SQ = {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"}
D = gemm.DEFAULTS


def cfg(**kw):
    return {**D, **kw}


# Typical configs: the Hopper seeds, a compiler-default layout, a persistent and a latency-hinted one.
_AOT = [cfg(), cfg(BLOCK_M=256, BLOCK_N=128), cfg(BLOCK_N=128, num_worker_warps=0, occupancy=0, num_ctas=0),
        cfg(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, occupancy=2), cfg(PERSISTENT=1, LATENCY=5),
        cfg(num_ctas=2)]


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_aot_smem_within_estimate(target, compiled):
    limit = {"sm_90a": 232_448, "sm_121a": 101_376}[target]
    for c in _AOT:
        got = compiled(gemm, c, SQ, target)
        est = gemm.smem_estimate(c, SQ, target)
        assert got["binary"] == "cubin" and got["compile_s"] > 0
        assert est == limit
        # The bound: tileiras sizes its pipeline to the target; a real kernel uses most of it.
        assert limit // 8 < got["smem_bytes"] <= est, (c, got)
        assert got["registers"] and got["registers"] <= 255


def test_targets_give_different_binaries(compiled):
    """Same config, two targets: sm_121a gets a pipeline sized for 99 KiB, sm_90a for 227 KiB."""
    h = compiled(gemm, D, SQ, "sm_90a")
    g = compiled(gemm, D, SQ, "sm_121a")
    assert g["smem_bytes"] <= 101_376 < h["smem_bytes"] <= 232_448


def test_hopper_default_has_no_spills(compiled):
    """The default (8 worker warps) compiles for sm_90a to two math warp groups without spilling;
    leaving the warp count to the compiler makes a 128 x 256 tile spill (the sweep rules forbid it)."""
    good = compiled(gemm, D, SQ, "sm_90a")
    assert good["stack_bytes"] == 0 and good["registers"] <= 168, good
    bad = gemm.compile_for(cfg(num_worker_warps=0), SQ, "sm_90a")
    assert bad["stack_bytes"] > 0, bad


@pytest.mark.parametrize("shape", [{"M": 3001, "N": 2056, "K": 1000, "dtype": "bfloat16"},
                                   {"M": 197, "N": 136, "K": 264, "dtype": "float16"},
                                   {"M": 1531, "N": 1023, "K": 777, "dtype": "float16"}])
def test_ragged_shapes_accepted_and_compile(shape):
    # Zero-padded loads and bounds-checked stores: any M, N, K (unaligned rows just lose TMA).
    assert gemm.config_reason(D, shape) is None
    got = gemm.compile_for(cfg(BLOCK_N=128), shape, "sm_90a")
    assert 0 < got["smem_bytes"] <= gemm.smem_estimate(D, shape, "sm_90a")


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton  # Triton wheels bundle one
    hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    return hits[0] if hits else None


def test_cubin_parser_agrees_with_cuobjdump(tmp_path):
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump on PATH or in the Triton wheel to cross-check the ELF reader")
    cubin = gemm._compile_cubin(D, SQ, "sm_90")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([tool, "--dump-resource-usage", str(path)], capture_output=True, text=True,
                         check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    assert m, out
    mine = gemm.cubin_resources(cubin, "sm_90")
    assert (mine["registers"], mine["stack_bytes"], mine["smem_section"]) == tuple(map(int, m.groups()))
    assert mine["smem_static"] == mine["smem_section"] - 1024  # the sm_90 reservation the driver leaves out


def test_target_rules():
    assert gemm.eligibility("sm_90a") is None and gemm.eligibility("sm_121a") is None
    assert gemm.eligibility("sm_100a") is None and gemm.eligibility("sm_120a") is None
    reason = gemm.eligibility("sm_75")
    assert reason and "no code generation for sm_75" in reason
    assert gemm.target_reason(cfg(num_ctas=2), "sm_80")
    assert gemm.target_reason(cfg(num_ctas=2), "sm_90a") is None
    with pytest.raises(ValueError, match="sm_75"):
        gemm.compile_for(D, SQ, "sm_75")


def test_config_rules():
    assert "BLOCK_K=48" in harness_reason("gemm", "cutile", cfg(BLOCK_K=48), SQ)
    assert "num_ctas" in harness_reason("gemm", "cutile", cfg(num_ctas=3), SQ)
    assert "LATENCY" in harness_reason("gemm", "cutile", cfg(LATENCY=11), SQ)
    assert "num_worker_warps" in harness_reason("gemm", "cutile", cfg(num_worker_warps=3), SQ)
    assert "dtype" in gemm.config_reason(D, {**SQ, "dtype": "int8"})
    assert gemm.config_reason(D, SQ) is None
    assert set(gemm.DEFAULTS) == set(gemm.TUNABLES)
