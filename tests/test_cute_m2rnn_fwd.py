"""The CuTe DSL M2RNN forward lane on the CPU: ahead-of-time compiles for sm_90a and sm_121a at the
default shapes and their parity shapes (plus ragged_h0 and fp32), shared memory equal to the analytic
estimate, no local memory (spills), the MMA / tanh / cp.async instructions present in the PTX, the sweep
file's seeds valid, and the typed refusals."""
from __future__ import annotations

import os
import re
import tempfile

import pytest

from kernels._targets import smem_optin

from kernels.cute import m2rnn_fwd as lane
from lab import space
from lab.problems import get
from tests.test_space_values import harness_reason

TARGETS = ("sm_90a", "sm_121a")
PROBLEM = get("m2rnn_fwd")
DEFAULT_SHAPES = ("b2_n8", "b4_n44", "b8_n84")


def shape(name, **kw):
    return {**space.get_shape("m2rnn_fwd", name), **kw}


def parity(name):
    (p,) = PROBLEM.parity_shapes(shape(name))
    return p


def check(got, config, shp, target):
    assert got["smem_bytes"] == lane.smem_estimate(config, shp, target), (config, shp, got)
    assert got["smem_bytes"] == got["smem_dynamic"] + got["smem_static"]
    assert got["smem_bytes"] <= smem_optin(target)
    assert 0 < got["registers"] <= 255 and got["stack"] == 0, got   # stack > 0: spills / local arrays
    assert got["compile_s"] > 0 and got["binary"] == "cubin"


@pytest.mark.parametrize("target", TARGETS)
def test_default_config_compiles_at_every_default_and_parity_shape(target, compiled):
    shapes = [shape(n) for n in DEFAULT_SHAPES] + [parity(n) for n in DEFAULT_SHAPES] + [shape("ragged_h0")]
    for shp in shapes:    # b4_n44 and b8_n84 have the same parity shape: compiled once
        assert lane.config_reason({}, shp) is None, shp
        check(compiled(lane, {}, shp, target), lane.DEFAULTS, shp, target)


_SWEEP = [
    {"ROWS_PER_WARP": 32, "HEADS_PER_CTA": 2, "CHUNK": 16, "UNROLL": 4},
    {"ROWS_PER_WARP": 16, "HEADS_PER_CTA": 4, "CHUNK": 16, "STAGES": 3, "UNROLL": 1, "FAST_TANH": False},
    {"PRODUCT": "fma_fp32", "CHUNK": 16},
]


@pytest.mark.parametrize("target", TARGETS)
def test_sweep_configs_compile(target):
    for cfg in _SWEEP:
        c = {**lane.DEFAULTS, **cfg}
        for shp in (shape("b4_n44"), parity("b4_n44")):
            assert lane.config_reason(c, shp) is None, (c, shp)
            check(lane.compile_for(c, shp, target), c, shp, target)


def test_one_warp_per_head_compiles_without_spills():
    c = {**lane.DEFAULTS, "ROWS_PER_WARP": 64, "CHUNK": 64, "STAGES": 3}
    check(lane.compile_for(c, shape("b2_n8"), "sm_90a"), c, shape("b2_n8"), "sm_90a")


@pytest.mark.parametrize("target", TARGETS)
def test_fp32_parity_shape_takes_the_fma_path(target):
    shp = parity("b2_n8") | {"dtype": "float32"}
    assert lane.config_reason({}, shp) is None
    check(lane.compile_for({}, shp, target), lane.DEFAULTS, shp, target)


def _ptx(config, shp, target):
    with tempfile.TemporaryDirectory() as d:
        lane._compile({**lane.DEFAULTS, **config}, shp, target, f"--keep-ptx --dump-dir {d}")
        (name,) = [f for f in os.listdir(d) if f.endswith(".ptx")]
        with open(os.path.join(d, name)) as f:
            return f.read()


@pytest.mark.slow    # pins instruction counts of the generated PTX; the compiles above cover the code paths
def test_ptx_has_the_designed_instructions():
    """bf16: two m16n8k16 MMAs and eight tanh.approx per step and warp tile (UNROLL=1: one step per
    loop body), 16-byte cp.async, no local memory; exact tanh and the fp32 path have no MMA."""
    ptx = _ptx({"UNROLL": 1}, shape("b2_n8"), "sm_90a")
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", ptx)) == 2
    assert len(re.findall(r"tanh\.approx\.f32", ptx)) == 8
    assert "cp.async.cg.shared.global" in ptx and ", 16, 16;" in ptx
    assert ".local" not in ptx
    exact = _ptx({"UNROLL": 1, "FAST_TANH": False}, shape("b2_n8"), "sm_90a")
    assert "tanh.approx" not in exact
    fp32 = _ptx({"UNROLL": 1}, parity("b2_n8") | {"dtype": "float32"}, "sm_121a")
    assert "mma.sync" not in fp32 and len(re.findall(r"fma\.rn\.f32", fp32)) >= 128


def test_refusals():
    b2 = shape("b2_n8")
    fp32 = b2 | {"dtype": "float32"}
    assert "fp32 tolerance" in lane.config_reason({"PRODUCT": "mma_bf16"}, fp32)
    assert "V=64" in lane.config_reason({}, shape("fp32_k64_v64"))
    assert "V=24" in lane.config_reason({}, b2 | {"V": 24})
    assert "multiple of ROWS_PER_WARP" in lane.config_reason({"ROWS_PER_WARP": 32}, b2 | {"K": 48})
    assert "HEADS_PER_CTA" in lane.config_reason({"HEADS_PER_CTA": 4}, b2 | {"N": 6})
    assert "1024" in lane.config_reason({"HEADS_PER_CTA": 4}, b2 | {"K": 512})
    assert "UNROLL" in harness_reason("m2rnn_fwd", "cute", {"UNROLL": 3}, b2)
    assert "CHUNK" in harness_reason("m2rnn_fwd", "cute", {"CHUNK": 24}, b2)
    assert "STAGES" in harness_reason("m2rnn_fwd", "cute", {"STAGES": 1}, b2)
    assert "PRODUCT" in harness_reason("m2rnn_fwd", "cute", {"PRODUCT": "tf32"}, b2)
    assert "FAST_TANH" in harness_reason("m2rnn_fwd", "cute", {"FAST_TANH": 1}, b2)
    assert "float16" in lane.config_reason({}, b2 | {"dtype": "float16"})
    with pytest.raises(ValueError, match="cannot compile"):
        lane.compile_for({"PRODUCT": "mma_bf16"}, fp32, "sm_90a")


def test_eligibility_sweep_file_and_registry():
    assert lane.eligibility("sm_90a") is None and lane.eligibility("sm_121a") is None
    assert "no path" in lane.eligibility("sm_80")
    sp = space.load_space("m2rnn_fwd", "cute", lane.TUNABLES)
    assert set(sp.params) | set(sp.fixed_names) == set(lane.TUNABLES) == set(lane.DEFAULTS)
    assert sp.seeds and all(v in sp.params[k] for k, v in lane.DEFAULTS.items() if k in sp.params)
    for seed in sp.seeds:
        assert sp.rule_reason(seed) is None
        for n in DEFAULT_SHAPES:
            assert lane.config_reason(seed, shape(n)) is None and lane.config_reason(seed, parity(n)) is None
    from lab import registry
    lr = registry.get("cute", "m2rnn_fwd")
    assert lr.eligibility("sm_90a").ok and not lr.eligibility("sm_80").ok
