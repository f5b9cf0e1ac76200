"""The TileLang m2rnn_bwd lane on the CPU: both kernels compile to cubins for sm_90a and sm_121a at a
default shape (shared memory equal to the estimate, registers without spills), every default shape and
the parity shapes lower, the serial step loops carry no __syncthreads, ragged steps are guarded, and the
config rules refuse what the lane cannot run."""
from __future__ import annotations

import re

import pytest

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.tilelang import _common as tl
from kernels.tilelang import m2rnn_bwd as lane
from lab import space
from lab.devices import get_profile
from lab.problems import get
from tests.test_space_values import harness_reason

D = lane.DEFAULTS
PROBLEM = get("m2rnn_bwd")
B2 = space.get_shape("m2rnn_bwd", "b2_n8")


def _loop_body(src: str, var: str) -> str:
    """The brace-matched body of the first ``for (int <var> = ...`` loop of a CUDA source."""
    start = src.index(f"for (int {var} = ")
    i = src.index("{", start)
    depth = 0
    for j in range(i, len(src)):
        depth += {"{": 1, "}": -1}.get(src[j], 0)
        if depth == 0:
            return src[i:j]
    raise AssertionError(f"unbalanced loop {var}")


def _lower(name: str, config: dict, shape: dict, target: str) -> str:
    config = {**D, **config}
    return tl.lower(lane._PROGRAMS[name](config, shape), target, lane._pass_configs(config)).kernel_source


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_default_compiles_without_spills(target):
    res = lane.compile_for(D, B2, target)
    assert set(res["kernels"]) == {"fwd", "bwd"}
    assert res["smem_bytes"] == res["kernels"]["bwd"]["smem_bytes"] == lane.smem_estimate(D, B2, target)
    assert res["smem_bytes"] <= get_profile("gb10").smem_optin_bytes          # 50,752 B: fits both
    # min_blocks = 3 caps the backward at 170 registers; it must fit there without spilling.
    assert res["registers"] <= 65536 // (D["min_blocks"] * D["threads"])
    assert all(k["spill_bytes"] == 0 for k in res["kernels"].values()), res["kernels"]


SHORT = {**D, "CKPT": 4, "min_blocks": 4}   # the sweep file's many-CTAs seed


def test_sweep_config_compiles_sm90_within_its_register_cap():
    res = lane.compile_for(SHORT, B2, "sm_90a")
    assert res["smem_bytes"] == lane.smem_estimate(SHORT, B2, "sm_90a")
    assert res["registers"] <= 128 and all(k["spill_bytes"] == 0 for k in res["kernels"].values())


@pytest.mark.slow    # pins the generated CUDA text (a second lowering of the config compiled above)
def test_products_are_mma_sync_on_sm90a():
    src = _lower("bwd", SHORT, B2, "sm_90a")
    assert "mma_sync" in src and "wgmma" not in src


def test_default_and_parity_shapes_are_accepted():
    for name in ("b2_n8", "b4_n44", "b8_n84", "ragged_h0"):
        shape = space.get_shape("m2rnn_bwd", name)
        for sh in [shape] + PROBLEM.parity_shapes(shape):
            assert lane.config_reason(D, sh) is None, (name, sh)


# b8_n84 only pins the generated text (no __syncthreads in the step loops): slow; ragged_h0 also checks
# that the ragged steps are guarded.
@pytest.mark.parametrize("name", [pytest.param("b8_n84", marks=pytest.mark.slow), "ragged_h0"])
def test_step_loops_are_barrier_free(name):
    """The backward's recompute (ir) and walk (ii) loops and the forward's step loop (istep) hold no
    __syncthreads (a shared store in them would put one on every step), at a shape with shared q / k
    heads and at the ragged parity shape (b2_n8 is compiled above)."""
    shape = space.get_shape("m2rnn_bwd", name)
    sh = PROBLEM.parity_shapes(shape)[0] if name == "ragged_h0" else shape
    bwd = _lower("bwd", D, sh, "sm_90a")
    for var in ("ir", "ii"):
        body = _loop_body(bwd, var)
        assert "mma_sync" in body and "__syncthreads" not in body, (name, var)
    fwd = _lower("fwd", D, sh, "sm_90a")
    assert "__syncthreads" not in _loop_body(fwd, "istep")
    if name == "ragged_h0":
        # S = 977: input copies past S zero-fill (cp.async src-size 0); per-step stores are guarded.
        assert sh["S"] == 977 and sh["h0"]
        assert "cp_async_gs_conditional" in bwd and "cp_async_gs_conditional" in fwd
        for out in ("DK", "DV", "DF", "DQ"):
            stores = [m.start() for m in re.finditer(rf"\b{out}(\[| \+)", bwd)]
            assert any("if (" in bwd[max(0, p - 200):p] for p in stores), out


@pytest.mark.parametrize("config,shape,msg", [
    ({}, space.get_shape("m2rnn_bwd", "fp32_k64_v64"), "dtype float32"),
    ({}, {**B2, "V": 64}, "V=64"),
    ({"threads": 256}, B2, "too many"),
    ({"CKPT": 12}, B2, "CKPT"),
    ({"CHUNK": 48}, B2, "CHUNK=48"),
    ({"CHUNK": 16, "CKPT": 32}, B2, "multiple of CKPT"),
    ({"num_stages": 4}, B2, "num_stages"),
    ({"min_blocks": 0}, B2, "min_blocks"),
    ({"FAST_TANH": 1}, B2, "FAST_TANH=1"),
])
def test_config_rules(config, shape, msg):
    """Each refusal comes from the lane (what depends on the shape or on combinations) or, for a value
    the sweep file does not list, from the harness's check of the file (``harness_reason``)."""
    cfg = {**D, **config}
    assert msg in (lane.config_reason(cfg, shape) or "") or msg in (harness_reason("m2rnn_bwd", "tilelang", cfg, shape) or "")


def test_target_rules_and_estimate():
    assert lane.eligibility("sm_75") and lane.eligibility("sm_121a") is None
    # CKPT = 32 holds 176,896 B: over GB10's opt-in limit, under H100's.
    big = lane.smem_estimate({**D, "CKPT": 32}, B2, "sm_121a")
    assert get_profile("gb10").smem_optin_bytes < big <= get_profile("h100").smem_optin_bytes
    # A 128-step, 3-stage forward chunk (62,976 B of k / v / f buffers + W) outgrows a CKPT = 4 backward.
    cfg = {**D, "CKPT": 4, "CHUNK": 128, "num_stages": 3}
    assert lane.smem_estimate(cfg, B2, "sm_90a") == 63488
