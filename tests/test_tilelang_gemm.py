"""The TileLang GEMM lane on the CPU: lowering for explicit targets (what the generated CUDA does),
ahead-of-time cubin compiles for sm_90a, sm_121a and sm_100a held to the analytic shared-memory
estimate, and the config / target rules. Each nvcc compile costs a few seconds on two cores, so
the compile list is kept short."""
from __future__ import annotations

import pytest

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.tilelang import _common as tl
from kernels.tilelang import gemm
from tests.test_space_values import harness_reason

SQ = {"M": 4096, "N": 4096, "K": 4096, "dtype": "bfloat16"}
PARITY = {"M": 197, "N": 136, "K": 264, "dtype": "bfloat16"}    # the harness's ragged parity shape
ODD = {"M": 1531, "N": 1023, "K": 777, "dtype": "float16"}      # rows not 16-byte aligned: no TMA
D = gemm.DEFAULTS


def _lower(config, shape, target):
    return tl.lower(gemm._program(config, shape), target, gemm._pass_configs(config))


def _src(config, shape, target):
    return _lower({**D, **config}, shape, target).kernel_source


@pytest.mark.slow    # pins the generated CUDA text; the compiles below cover the code paths
def test_sm90a_lowers_to_wgmma_tma_warp_specialized():
    src = _src({}, SQ, "sm_90a")
    assert "wgmma" in src and "tl::tma_load" in src and "tma_store" in src
    assert "warpgroup_reg_alloc" in src                       # producer / consumer warpgroups
    assert "__launch_bounds__(384" in src                     # 256 MMA threads + 128 producer threads
    assert "rasterization2DRow<10>" in src                    # T.use_swizzle(panel_size=10)
    # The pass configs are real knobs: each changes the generated code.
    no_ws = _src({"warp_specialized": False}, SQ, "sm_90a")
    assert "tl::tma_load" not in no_ws and "cp_async" in no_ws and "__launch_bounds__(256" in no_ws
    assert "tma_store" not in _src({"tma": False}, SQ, "sm_90a")
    assert "rasterization2D" not in _src({"panel_size": 0}, SQ, "sm_90a")


@pytest.mark.slow    # pins the generated CUDA text; the compiles below cover the code paths
def test_sm121a_uses_mma_sync_not_wgmma():
    src = _src({"block_N": 128, "num_stages": 2}, SQ, "sm_121a")
    assert "mma_sync" in src and "wgmma" not in src


def test_ragged_shapes_are_guarded():
    # M, N, K ragged for every tile: the C store is guarded by the true bounds; TMA zero-fills loads.
    src = _src({"epilogue": "direct"}, PARITY, "sm_90a")
    assert "< 197)" in src and "tl::tma_load" in src
    # K = 777 halves are not 16-byte aligned rows: TileLang drops TMA for guarded cp.async itself.
    odd = _src({}, ODD, "sm_90a")
    assert "tl::tma_load" not in odd and "cp_async" in odd and "< 1531)" in odd and "< 1023)" in odd
    assert gemm.config_reason(D, ODD) is None and gemm.config_reason(D, PARITY) is None


# (target, config overrides, shape): a handful of compiles covering the static-smem cases
# (warp-specialized TMA pipeline, no warp specialization, no TMA-able operand) and the epilogues.
_AOT = [
    ("sm_90a", {}, SQ),
    ("sm_90a", {"warp_specialized": False, "epilogue": "direct", "num_stages": 4, "block_N": 128}, SQ),
    ("sm_90a", {"block_M": 256, "block_N": 256, "block_K": 32, "num_stages": 2}, ODD),   # C tile > operands
    ("sm_121a", {"block_N": 128, "num_stages": 2, "threads": 128}, SQ),
    ("sm_121a", {"block_N": 128, "block_K": 32, "num_stages": 3, "warp_specialized": False}, PARITY),
    ("sm_100a", {}, SQ),
    # Aggressive merge on sm_121a keeps the C tile apart from the operands (sum, not max).
    ("sm_121a", {"block_M": 256, "block_N": 64, "block_K": 32, "num_stages": 2, "threads": 128,
                 "aggressive_smem_merge": True}, SQ),
]


@pytest.mark.parametrize("target,over,shape", _AOT, ids=[f"{t}-{i}" for i, (t, _, _) in enumerate(_AOT)])
def test_aot_smem_matches_estimate(target, over, shape):
    cfg = {**D, **over}
    got = gemm.compile_for(cfg, shape, target)
    assert got["binary"] == "cubin" and got["compile_s"] > 0 and got["registers"] > 0
    assert got["smem_bytes"] == gemm.smem_estimate(cfg, shape, target), got


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_lowered_dynamic_smem_matches_model(target):
    """Lowering only (no nvcc): the dynamic size over epilogue x merge x warp specialization x tiles."""
    import itertools
    bad = []
    for (bm, bn), ep, merge, ws in itertools.product([(128, 256), (256, 64)], ["smem", "direct"], [True, False], [True, False]):
        cfg = {**D, "block_M": bm, "block_N": bn, "block_K": 32, "num_stages": 2, "epilogue": ep,
               "aggressive_smem_merge": merge, "warp_specialized": ws}
        dyn = tl.dynamic_smem(_lower(cfg, SQ, target))
        if dyn != gemm.smem_estimate(cfg, SQ, target) - gemm._static_smem(cfg, SQ, target):
            bad.append((cfg, dyn))
    assert not bad, bad


def test_aot_default_sizes_and_gb10_limit():
    # Default Hopper config: 3 x (128x64 + 64x256) bf16 operands + 1 KiB of static mbarriers.
    assert gemm.smem_estimate(D, SQ, "sm_90a") == 3 * (128 * 64 + 64 * 256) * 2 + 1024
    # Too big for GB10 (preflight refuses it there), while a 2-stage 128x128 tile fits.
    assert gemm.smem_estimate(D, SQ, "sm_121a") > 101_376
    assert gemm.smem_estimate({**D, "block_N": 128, "num_stages": 2}, SQ, "sm_121a") <= 101_376
    # No static barriers without warp specialization, nor before sm_90.
    assert gemm.smem_estimate({**D, "warp_specialized": False}, SQ, "sm_90a") == 3 * (128 * 64 + 64 * 256) * 2
    assert gemm.smem_estimate(D, SQ, "sm_80") == 3 * (128 * 64 + 64 * 256) * 2


def test_compile_failure_raises():
    # A 128-thread CTA cannot tile a 16x16 C block with wgmma/mma: TileLang must refuse, and
    # compile_for must raise rather than return a figure.
    with pytest.raises(Exception):
        gemm.compile_for({**D, "block_M": 16, "block_N": 16, "threads": 256}, SQ, "sm_90a")


def test_config_rules():
    assert "dtype" in gemm.config_reason(D, {**SQ, "dtype": "float32"})
    assert "block_N=96" in harness_reason("gemm", "tilelang", {**D, "block_N": 96}, SQ)
    assert "threads" in harness_reason("gemm", "tilelang", {**D, "threads": 192}, SQ)
    assert "policy" in harness_reason("gemm", "tilelang", {**D, "policy": "Diagonal"}, SQ)
    assert "epilogue" in harness_reason("gemm", "tilelang", {**D, "epilogue": "tma"}, SQ)
    assert "too small" in gemm.config_reason({**D, "block_M": 16, "block_N": 16}, SQ)
    assert gemm.config_reason(D, SQ) is None


def test_target_rules():
    assert gemm.eligibility("sm_75") and "no path" in gemm.eligibility("sm_75")
    for t in ("sm_80", "sm_90a", "sm_100a", "sm_120a", "sm_121a"):
        assert gemm.eligibility(t) is None
    assert gemm.target_reason({**D, "warp_specialized": False}, "sm_80")
    assert gemm.target_reason(D, "sm_80") is None and gemm.target_reason({**D, "tma": False}, "sm_90a") is None


def test_sweep_file_seeds_are_valid():
    from lab.space import load_space
    space = load_space("gemm", "tilelang", gemm.TUNABLES)
    assert set(space.params) == set(gemm.TUNABLES) and len(space.seeds) >= 2
    for seed in space.seeds:
        assert gemm.config_reason(seed, SQ) is None
        assert gemm.smem_estimate(seed, SQ, "sm_90a") <= 232_448


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_resource_usage_reads_what_cuobjdump_reports(target):
    """The one cubin reader (kernels/_cubin.py) gives the TileLang lanes the figures cuobjdump's
    --dump-resource-usage prints: registers, SHARED less the 1 KiB sm_90+ reservation, STACK + LOCAL."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    config = {**gemm.DEFAULTS}
    art = tl.lower(gemm._program(config, SQ), target, gemm._pass_configs(config))
    cubin = tl.cubin_of(art.kernel_source, target, gemm._pass_configs(config), use_cache=False)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True,
                             check=True).stdout
    (name, reg, stack, shared, local), = re.findall(
        r"Function ([^\s:]+):\s*\n?\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    assert tl.resource_usage(cubin, target) == {"name": name, "registers": int(reg),
                                                 "static_smem": max(0, int(shared) - 1024),
                                                 "spill_bytes": int(stack) + int(local)}
