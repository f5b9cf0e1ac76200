"""The CuTe DSL M2RNN backward lane on the CPU: ahead-of-time compiles of both kernels (checkpointing
forward, BPTT) for sm_90a and sm_121a at the default shapes and their parity shape, shared memory held
to the analytic estimate, registers without spills, and the typed refusals."""
from __future__ import annotations

import pytest

from kernels._targets import smem_optin

from kernels.cute import m2rnn_bwd as lane
from lab import space
from tests.test_space_values import harness_reason

BASE = {"B": 2, "S": 4096, "N": 8, "Nq": 8, "Nk": 8, "Nw": 8, "Nf": 8, "K": 64, "V": 16, "h0": False,
        "dtype": "bfloat16"}
SHAPES = {
    "b2_n8": BASE,
    "b4_n44": {**BASE, "B": 4, "N": 44, "Nq": 1, "Nk": 1, "Nw": 44, "Nf": 44},
    "b8_n84": {**BASE, "B": 8, "N": 84, "Nq": 1, "Nk": 1, "Nw": 84, "Nf": 84},
    "ragged_h0": {**BASE, "B": 4, "S": 977, "Nk": 4, "Nw": 1, "h0": True},
    "parity": {**BASE, "B": 2, "S": 977, "N": 4, "Nq": 1, "Nk": 1, "Nw": 4, "Nf": 4, "h0": True},
}
CONFIGS = [{}, {"CKPT": 8, "K_SPLIT": 2}, {"CKPT": 4, "K_SPLIT": 4, "FAST_TANH": False}]


def _check(got, config, shape, target):
    assert got["binary"] == "cubin" and got["compile_s"] > 0
    for name in ("forward", "backward"):
        k = got["kernels"][name]
        assert k["smem_bytes"] == k["smem_dynamic"] + k["smem_static"]
        assert 0 < k["registers"] <= 255, k
        assert (k["stack"] or 0) <= 16, k            # no spill frames
    assert got["smem_bytes"] == lane.smem_estimate(config, shape, target)
    assert got["smem_bytes"] <= smem_optin(target)


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_default_config_compiles(target, name):
    shape = SHAPES[name]
    assert lane.config_reason({}, shape) is None and lane.eligibility(target) is None
    _check(lane.compile_for({}, shape, target), lane.DEFAULTS, shape, target)


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("config", CONFIGS[1:], ids=["ckpt8_ks2", "ckpt4_ks4_exact"])
def test_sweep_configs_compile(target, config):
    for name in ("b8_n84", "parity"):
        shape = SHAPES[name]
        assert lane.config_reason(config, shape) is None
        _check(lane.compile_for(config, shape, target), {**lane.DEFAULTS, **config}, shape, target)


def test_big_checkpoint_fits_hopper_only():
    c = {"CKPT": 32}
    assert lane.smem_estimate(c, BASE, "sm_90a") <= smem_optin("sm_90a")
    assert lane.smem_estimate(c, BASE, "sm_121a") > smem_optin("sm_121a")
    assert lane.smem_estimate({}, BASE, "sm_121a") <= smem_optin("sm_121a")


def test_refusals():
    assert "float32" in lane.config_reason({}, {**BASE, "dtype": "float32"})
    assert "V=64" in lane.config_reason({}, {**BASE, "V": 64})
    assert "CKPT" in harness_reason("m2rnn_bwd", "cute", {"CKPT": 12}, BASE)
    assert "K_SPLIT" in harness_reason("m2rnn_bwd", "cute", {"K_SPLIT": 3}, BASE)
    assert "FAST_TANH" in harness_reason("m2rnn_bwd", "cute", {"FAST_TANH": 1}, BASE)
    assert "K=16" in lane.config_reason({"K_SPLIT": 2}, {**BASE, "K": 16})
    assert "K=40" in lane.config_reason({}, {**BASE, "K": 40})
    assert lane.config_reason({}, {**BASE, "K": 256}) is not None          # 16 warps
    assert lane.config_reason({"K_SPLIT": 2}, {**BASE, "K": 256}) is None
    with pytest.raises(ValueError, match="float32"):
        lane.compile_for({}, {**BASE, "dtype": "float32"}, "sm_90a")
    for target in ("sm_80", "sm_100a"):
        assert "no path" in lane.eligibility(target)


def test_registry_and_sweep_file():
    from lab import registry
    ln = registry.get("cute", "m2rnn_bwd")
    assert ln.eligibility("sm_90a").ok and ln.eligibility("sm_121a").ok and not ln.eligibility("sm_80").ok
    assert set(ln.module.DEFAULTS) == set(ln.module.TUNABLES)
    sp = space.load_space("m2rnn_bwd", "cute", lane.TUNABLES)
    assert sp.seeds
    for seed in sp.seeds:
        assert lane.config_reason(seed, BASE) is None
