"""The CuTe DSL GEMM lane on the CPU: ahead-of-time compiles for sm_90a (wgmma path) and sm_121a
(warp-MMA path) against the analytic shared-memory estimate, and the typed refusals."""
from __future__ import annotations

import pytest

from kernels._targets import smem_optin

from kernels.cute import gemm
from tests.test_space_values import harness_reason

SQ = {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"}
RAGGED = {"M": 3001, "N": 2056, "K": 1000, "dtype": "bfloat16"}
PARITY = {"M": 197, "N": 136, "K": 264, "dtype": "float16"}


def cfg(**kw):
    return {**gemm.DEFAULTS, **kw}


# (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CLUSTER_M, CLUSTER_N, PATH) typical of each target.
_AOT = {
    "sm_90a": [(128, 256, 64, 4, 1, 1, "wgmma"), (128, 128, 64, 6, 1, 2, "wgmma"), (64, 128, 64, 4, 1, 1, "wgmma"),
               (128, 256, 64, 3, 2, 1, "wgmma"), (64, 256, 32, 6, 1, 1, "wgmma"), (128, 128, 32, 4, 1, 1, "mma_sync")],
    "sm_121a": [(128, 128, 64, 2, 1, 1, "mma_sync"), (128, 128, 32, 5, 1, 1, "mma_sync"), (64, 128, 64, 4, 1, 1, "mma_sync"),
                (64, 64, 64, 3, 1, 1, "mma_sync"), (128, 64, 32, 3, 1, 1, "mma_sync")],
}


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_aot_smem_matches_estimate(target, compiled):
    mismatches = []
    for bm, bn, bk, st, cm, cn, path in _AOT[target]:
        c = cfg(PATH=path, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=st, CLUSTER_M=cm, CLUSTER_N=cn)
        assert gemm.config_reason(c, SQ) is None and gemm.target_reason(c, target) is None, c
        got = compiled(gemm, c, SQ, target)
        assert got["smem_bytes"] > 0 and got["compile_s"] > 0 and got["registers"]
        assert got["smem_bytes"] == got["smem_dynamic"] + got["smem_static"]
        assert got["smem_bytes"] <= smem_optin(target)
        est = gemm.smem_estimate(c, SQ, target)
        if est != got["smem_bytes"]:
            mismatches.append((c, est, got["smem_bytes"]))
    assert not mismatches, mismatches


def test_path_is_what_the_config_names(compiled):
    """PATH names the kernel that runs, whatever the target: mma_sync compiles the warp-MMA kernel for
    sm_90a as for sm_121a (so a GB10 profile emulated on an H100 runs GB10's path), wgmma the warpgroup
    kernel; the same config asks for 64 B more static shared memory on sm_121a (its reserved window).
    PATH "auto" (chosen by the GPU present until 2026-11-27) is refused with its reason."""
    c = cfg(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=2)
    w = compiled(gemm, c | {"PATH": "wgmma"}, SQ, "sm_90a")
    h, g = (compiled(gemm, c | {"PATH": "mma_sync"}, SQ, t) for t in ("sm_90a", "sm_121a"))
    assert "kernel_wgmma" in w["kernel"] and "kernel_mma" in h["kernel"] and "kernel_mma" in g["kernel"]
    ring = 2 * (128 * 64 + 128 * 64) * 2
    assert w["smem_dynamic"] == h["smem_dynamic"] == g["smem_dynamic"] == 1024 + ring
    assert g["smem_static"] == h["smem_static"] + 64
    for target in ("sm_90a", "sm_121a"):
        assert "'auto' is not a path" in gemm.target_reason(c | {"PATH": "auto"}, target)


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("shape", [RAGGED, PARITY], ids=["ragged", "parity_fp16"])
def test_ragged_shapes_compile(target, shape):
    c = cfg(PATH="wgmma" if target == "sm_90a" else "mma_sync", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=2)
    assert gemm.config_reason(c, shape) is None
    got = gemm.compile_for(c, shape, target)
    assert got["smem_bytes"] == gemm.smem_estimate(c, shape, target)


def test_hopper_path_refused_on_consumer_blackwell():
    c = cfg(PATH="wgmma")
    for target in ("sm_121a", "sm_120a"):
        reason = gemm.target_reason(c, target)
        assert reason and reason.startswith("ineligible:") and "requires sm_90a" in reason and target in reason
        with pytest.raises(ValueError, match="requires sm_90a"):
            gemm.compile_for(c, SQ, target)
    assert gemm.target_reason(c, "sm_90a") is None
    # Clusters need multicast, absent on sm_12x; 128x256 tiles spill on the warp-MMA path.
    assert "ineligible" in gemm.target_reason(cfg(PATH="mma_sync", CLUSTER_M=2), "sm_121a")
    assert gemm.target_reason(cfg(PATH="mma_sync", BLOCK_N=256), "sm_121a")
    assert gemm.target_reason(cfg(BLOCK_N=256), "sm_90a") is None


def test_oversized_config_is_caught_by_the_estimate_on_sm121a():
    c = cfg(PATH="mma_sync", BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, STAGES=4)
    assert gemm.target_reason(c, "sm_121a") is None
    assert gemm.smem_estimate(c, SQ, "sm_121a") > smem_optin("sm_121a")
    assert gemm.smem_estimate(c, SQ, "sm_90a") <= smem_optin("sm_90a")


def test_eligibility_and_config_rules():
    assert gemm.eligibility("sm_90a") is None and gemm.eligibility("sm_121a") is None
    for target in ("sm_80", "sm_100a"):
        assert "no path" in gemm.eligibility(target)
        assert gemm.target_reason(cfg(), target)
    assert "16-byte aligned" in gemm.config_reason(cfg(), {"M": 64, "N": 100, "K": 64, "dtype": "bfloat16"})
    assert "16-byte aligned" in gemm.config_reason(cfg(), {"M": 64, "N": 64, "K": 777, "dtype": "float16"})
    assert "float32" in gemm.config_reason(cfg(), {"M": 64, "N": 64, "K": 64, "dtype": "float32"})
    assert gemm.config_reason(cfg(PATH="mma_sync", BLOCK_N=256), SQ)
    assert gemm.config_reason(cfg(PATH="mma_sync", CLUSTER_N=2), SQ)
    assert harness_reason("gemm", "cute", cfg(BLOCK_M=256), SQ)
    assert harness_reason("gemm", "cute", cfg(PATH="tcgen05"), SQ)


def test_registry_sees_the_lane():
    from lab import registry
    lane = registry.get("cute", "gemm")
    assert lane.eligibility("sm_90a").ok and lane.eligibility("sm_121a").ok
    assert not lane.eligibility("sm_80").ok
    assert set(lane.module.DEFAULTS) == set(lane.module.TUNABLES)
