"""Precision as a run option ([precision.NAME] in a sweep file, `sweep --precision`), a changed space
starting its own study, and `lab prune` (knob values the results do not support)."""
from __future__ import annotations

import json

import pytest

from lab.devices import LabError
from tests.test_sweep_engine import SimRunner, _request, present_h100

PRECISE_SPACE = """
[params]
MODE = ["ok", "slow"]
SMEM_KB = [16, 64]
[restrictions]
rules = ["SPEED == 1 or ESTIMATE_BIAS_KB == 0"]
[precision.exact]
SPEED = 2
ESTIMATE_BIAS_KB = 0
"""


def _write_space(env, text):
    (env.sweeps / "gemm" / "sim.toml").write_text(text)


def test_precision_fixes_its_table_in_every_trial_and_rows_say_so(lab_env):
    from lab import results, space, sweep
    _write_space(lab_env, PRECISE_SPACE)
    sp = space.load_space("gemm", "sim", ("MODE", "SMEM_KB", "SPEED", "ESTIMATE_BIAS_KB"))
    assert "SPEED" not in sp.params and sp.fixed_names == ("ESTIMATE_BIAS_KB", "SPEED")
    with pytest.raises(LabError, match=r"declares no \[precision.fast\]"):
        space.load_space("gemm", "sim", ("MODE", "SMEM_KB", "SPEED", "ESTIMATE_BIAS_KB"), "fast")

    runner = SimRunner()
    sweep.run(_request(lab_env, precision="exact"), present_h100(), runner=runner)
    assert runner.seen and all(c["SPEED"] == 2 for c in runner.seen)
    df = results.load(lab_env.results)
    assert set(df["precision"]) == {"exact"}
    assert all(json.loads(c)["SPEED"] == 2 for c in df["config_json"])
    # Not what the lane ships: the gate and the export leave such rows out.
    from lab import gate
    assert gate.ok_rows(df).empty

    runner = SimRunner()
    sweep.run(_request(lab_env), present_h100(), runner=runner)
    assert runner.seen and all(c["SPEED"] == 1 for c in runner.seen)
    df = results.load(lab_env.results)
    assert len(set(df["study"])) == 2 and not gate.ok_rows(df).empty


def test_precision_table_errors_are_one_line(lab_env):
    from lab import space
    tun = ("MODE", "SMEM_KB", "SPEED", "ESTIMATE_BIAS_KB")
    _write_space(lab_env, PRECISE_SPACE.replace("SPEED = 2", "SPEEED = 2"))
    with pytest.raises(LabError, match="unknown config key 'SPEEED' in \\[precision.exact\\]"):
        space.load_space("gemm", "sim", tun)
    _write_space(lab_env, PRECISE_SPACE.replace("SMEM_KB = [16, 64]", "SMEM_KB = [16, 64]\nSPEED = [1, 3]"))
    with pytest.raises(LabError, match="SPEED=2 is not in params.SPEED"):
        space.load_space("gemm", "sim", tun)
    _write_space(lab_env, PRECISE_SPACE.replace("[restrictions]\nrules = [\"SPEED == 1 or ESTIMATE_BIAS_KB == 0\"]",
                                                "[restrictions]\nrules = [\"SPEDE == 1\"]"))
    with pytest.raises(LabError, match="names unknown param 'SPEDE'"):
        space.load_space("gemm", "sim", tun)


def test_cli_precision_unknown_for_a_lane_fails_before_the_gpu(lab_env, capsys):
    from lab.cli import main
    assert main(["sweep", "gemm", "--device", "h100", "--dsl", "sim", "--precision", "exact"]) == 2
    assert "no [precision.exact] in the sweep file of sim" in capsys.readouterr().err


def test_a_changed_space_resumes_in_a_study_of_its_own(lab_env):
    """Optuna cannot resume a study whose categorical choices changed: a pruned sweep file must not
    crash the next sweep."""
    from lab import results, sweep
    sweep.run(_request(lab_env, trials=3, sampler="tpe"), present_h100(), runner=SimRunner())
    text = (lab_env.sweeps / "gemm" / "sim.toml").read_text().replace('"refused"]', ']').replace(
        "SMEM_KB = [16, 64, 200]", "SMEM_KB = [16, 64]")
    _write_space(lab_env, text)
    sweep.run(_request(lab_env, trials=3, sampler="tpe"), present_h100(), runner=SimRunner())
    df = results.load(lab_env.results)
    assert len(set(df["study"])) == 2


def test_prune_flags_values_never_within_the_margin(lab_env):
    from lab import prune, results, sweep
    _write_space(lab_env, '[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [16, 64, 200]\nSPEED = [1, 2]\n'
                          'ESTIMATE_BIAS_KB = [0]\n')
    sweep.run(_request(lab_env, shapes=["tiny", "tiny_fp16"]), present_h100(), runner=SimRunner())
    df = results.load(lab_env.results)
    by = {(e.knob, json.dumps(e.value)): e for e in prune.support(df, "gemm", "sim")}
    # SimRunner: time = (1, or 2 for slow) * SPEED + SMEM_KB / 1000 ms
    assert by[("MODE", '"ok"')].verdict(0.05) == "keep"
    assert by[("MODE", '"slow"')].verdict(0.05) == "slower" and by[("MODE", '"slow"')].best_ratio == pytest.approx(2.0, rel=0.01)
    assert by[("SPEED", "2")].verdict(0.05) == "slower"
    assert by[("SMEM_KB", "64")].verdict(0.05) == "keep"        # 1.064 / 1.016 = 1.047
    assert by[("SMEM_KB", "200")].verdict(0.05) == "slower"     # 1.2 / 1.016
    text = prune.report(df, "gemm", ["sim"], 0.05)
    assert 'slower: 3 value(s) of the sweep file: MODE="slow", SMEM_KB=200, SPEED=2' in text
    assert by[("SMEM_KB", "200")].verdict(0.05, min_rows=10**6) == "thin"    # too few rows to judge
    with pytest.raises(LabError):
        prune.report(df, "gemm", ["sim"], 1.5)


def test_run_ids_of_one_process_never_repeat(monkeypatch):
    """Two sweeps started in the same second by one process (gate --run) keep separate rows files."""
    import datetime as dt
    from lab import results

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime(2026, 11, 25, 12, 0, 0, tzinfo=tz)
    monkeypatch.setattr(results, "datetime", Frozen)
    ids = [results.new_run_id("gemm-h100") for _ in range(3)]
    assert ids[0].startswith("20261125T120000Z-gemm-h100-")
    assert ids[1:] == [ids[0] + "-2", ids[0] + "-3"]
