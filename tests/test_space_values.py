"""The harness's check that a config's values are in its lane's sweep file (``Space.value_reason`` via
``Lane.space_reason``): [params] values, non-param tunables (the lane's default or a [precision.NAME]
value), restrictions; applied where a config enters from outside a sweep (``lab check`` / ``profile``,
the preflight's cheap checks), while the gate's previous bests still re-run."""
from __future__ import annotations

import json

import pytest

from lab import registry, space
from lab.devices import get_profile

KERNELS = ("gemm", "m2rnn_fwd", "m2rnn_bwd", "mamba_bwd_bwd")
LANES = [(k, d) for k in KERNELS for d in ("cute", "cutile", "tilelang", "torch", "triton")
         if (space.sweeps_dir() / k / f"{d}.toml").exists()]

SPACE = """
[params]
MODE = ["ok", "slow", "wrong"]
SMEM_KB = [16, 64]
[restrictions]
rules = ["SMEM_KB == 16 or MODE == 'ok'"]
[precision.exact]
SPEED = 2
"""


def _lane(kernel, dsl):
    lane = registry.get(dsl, kernel)
    try:
        lane.module
    except Exception as exc:  # a DSL not installed here
        pytest.skip(str(exc))
    return lane


@pytest.mark.parametrize("kernel,dsl", LANES)
def test_every_lane_default_and_seed_is_in_its_space(kernel, dsl):
    lane = _lane(kernel, dsl)
    sp = space.load_space(kernel, dsl, tuple(lane.module.TUNABLES))
    assert lane.space_reason(sp, lane.full_config({})) is None
    for seed in sp.seeds:
        assert lane.space_reason(sp, lane.full_config(seed)) is None, seed
    for name in sp.precisions:  # a precision table's values pass too
        assert lane.space_reason(sp, lane.full_config(sp.precisions[name])) is None, name


@pytest.mark.parametrize("kernel,dsl", [(k, d) for k, d in LANES if d != "torch"])
def test_every_lane_refuses_a_value_its_file_does_not_list(kernel, dsl):
    lane = _lane(kernel, dsl)
    sp = space.load_space(kernel, dsl, tuple(lane.module.TUNABLES))
    key = next(iter(sp.params))
    bad = lane.full_config({key: 12345})
    why = lane.space_reason(sp, bad)
    assert why == f"{key}=12345 is not in sweeps/{kernel}/{dsl}.toml (allowed: " \
                  f"{', '.join(json.dumps(v) for v in sp.params[key])})", why
    # The preflight's cheap checks refuse it as a rule, before the lane's own (which may not expect it).
    shape = space.get_shape(kernel, space.load_shapes(kernel)[1][0])
    from lab import preflight
    v = preflight.cheap_checks(lane, sp, bad, shape, get_profile("h100"))
    assert not v.feasible and v.stage == "rules" and v.reason == why


def test_value_reason_params_fixed_and_rules(lab_env):
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(SPACE)
    lane = registry.get("sim", "gemm")
    sp = space.load_space("gemm", "sim", tuple(lane.module.TUNABLES))
    ok = lane.full_config({"MODE": "slow"})
    assert lane.space_reason(sp, ok) is None
    assert lane.space_reason(sp, lane.full_config({"SPEED": 2})) is None  # a [precision.exact] value
    assert lane.space_reason(sp, lane.full_config({"MODE": "crash"})) == \
        'MODE="crash" is not in sweeps/gemm/sim.toml (allowed: "ok", "slow", "wrong")'
    assert lane.space_reason(sp, lane.full_config({"SPEED": 3})) == (
        "SPEED=3 is not in sweeps/gemm/sim.toml (allowed: 1, 2; not a param: the lane's default or a "
        "[precision.NAME] value)")
    # A non-param tunable no table names: only the lane's default.
    assert "allowed: 0;" in lane.space_reason(sp, lane.full_config({"ESTIMATE_BIAS_KB": 4}))
    # Values compare with their type: true is not 1, 16.0 is not 16.
    assert lane.space_reason(sp, lane.full_config({"SPEED": True})).startswith("SPEED=true is not in")
    assert lane.space_reason(sp, lane.full_config({"SMEM_KB": 16.0})).startswith("SMEM_KB=16.0 is not in")
    assert lane.space_reason(sp, lane.full_config({"MODE": "slow", "SMEM_KB": 64})) == \
        "restriction: SMEM_KB == 16 or MODE == 'ok'"
    # Retired knobs are the lane's: skipped here.
    assert sp.value_reason({**ok, "SPEED": 9}, lane.module.DEFAULTS, retired=("SPEED",)) is None


def test_lab_check_refuses_a_config_outside_the_space_before_the_gpu(lab_env):
    from tests.test_cli import assert_one_line_error, lab
    # No --device: the refusal comes before the GPU check (this machine has none).
    p = lab("check", "gemm", "--dsl", "triton", "--shape", "sq4096_bf16", "--config", '{"BLOCK_M": 48}')
    assert_one_line_error(p, "refused: BLOCK_M=48 is not in sweeps/gemm/triton.toml (allowed: 64, 128, 256)")
    p = lab("profile", "m2rnn_fwd", "--dsl", "triton", "--shape", "b2_n8", "--config", '{"FAST_TANH": 1}')
    assert_one_line_error(p, "refused: FAST_TANH=1 is not in sweeps/m2rnn_fwd/triton.toml")
    p = lab("check", "gemm", "--dsl", "triton", "--shape", "sq4096_bf16", "--config",
            '{"BLOCK_M": 256, "num_warps": 4}')
    assert_one_line_error(p, "refused: restriction: BLOCK_M * BLOCK_N <= 128 * num_warps * 32")


def test_gate_seed_outside_a_pruned_space_is_still_timed(lab_env):
    """A previous best whose value the sweep file no longer lists cannot be a trial of the re-sweep's
    study (its choices are the file's): the sweep says so and goes on, and the gate's A/B still times it
    with the code it was measured with."""
    from lab import gate_run, identity
    from tests.test_gate_and_tuned import SIM_BEST, ABRunner, _committed_sim_row
    from tests.test_sweep_engine import present_h100
    registry._LANES.clear()
    files = dict(identity.lane_identity("tests.fake_lanes.sim.gemm")["lane_files"])
    files["tests/fake_lanes/sim/gemm.py"] = "edited-since"
    (lab_env.sweeps / "gemm" / "sim.toml").write_text('[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [64]\n')
    df = _committed_sim_row(lab_env, SIM_BEST, files)  # SMEM_KB 16: pruned from the file
    lines, runner = [], ABRunner(1.0)
    rc = gate_run.refresh(df, present_h100(), kernels=["gemm"], dsls=["sim"], trials=2, results_dir=lab_env.results,
                          runner=runner, out=lines.append)
    text = "\n".join(lines)
    assert "seed not in sweeps/gemm/sim.toml (SMEM_KB=16): not a trial of this sweep" in text, text
    assert rc == 0 and "gemm sim h100 tiny: previous" in text and ": SAME" in text, text
    assert runner.ab_lanes and runner.ab_lanes[0][0].startswith("sim_at_")


def harness_reason(kernel: str, dsl: str, config: dict, shape: dict) -> str | None:
    """What the preflight refuses a config for before any target rule: the sweep file's values and
    restrictions, then the lane's ``config_reason`` (for lane tests of refusals the file now holds)."""
    lane = registry.get(dsl, kernel)
    full = lane.full_config(config)
    sp = space.load_space(kernel, dsl, tuple(lane.module.TUNABLES))
    return lane.space_reason(sp, full) or lane.module.config_reason(full, shape)
