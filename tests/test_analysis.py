"""lab/analysis.py (the tables behind results/analysis.ipynb) on small fixture frames."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from lab import analysis


def _row(**kw):
    from lab.results import COLUMNS, flatten
    row = {c: None for c in COLUMNS}
    row.update(run_id="r1", time_utc="2026-01-01T00:00:00Z", kernel="gemm", dsl="triton", shape="s",
               shape_json=json.dumps({"M": 8, "dtype": "float16"}), config_json=json.dumps({"BLOCK_M": 64}),
               status="ok", phase="sweep", trial=0, time_ms=1.0, emulated=False, compile_only=False, baseline=False,
               requested_profile="h100", actual_gpu="H100")
    row.update(kw)
    return flatten(row)


def _frame(rows):
    from lab.results import frame
    return frame(rows)


def _timed(ms, **kw):
    return _row(time_ms=ms, time_q1_ms=ms * 0.9, time_q3_ms=ms * 1.2, time_ci_half_ms=ms * 0.05, **kw)


@pytest.mark.parametrize("fn", [analysis.best_lanes, analysis.relative_speed, analysis.device_comparison,
                                analysis.parity_errors, analysis.convergence, analysis.smem_points])
def test_empty_input_gives_empty_tables_with_columns(fn):
    from lab.results import frame
    out = fn(frame([]))
    assert out.empty and len(out.columns) > 3
    assert analysis.device_winners(analysis.device_comparison(frame([]))).empty


def test_best_lanes_picks_the_fastest_and_the_runner_up():
    df = _frame([_timed(2.0, dsl="torch", baseline=True, config_json="{}"), _timed(1.0), _timed(1.5, dsl="cute"),
                 _timed(9.0, shape="t", dsl="cute")])
    best = analysis.best_lanes(df).set_index("shape")
    assert best.loc["s", "best_dsl"] == "triton" and best.loc["s", "runner_up"] == "cute"
    assert best.loc["s", "margin"] == pytest.approx(1.5) and best.loc["s", "lanes"] == 3
    assert best.loc["t", "runner_up"] == "" and pd.isna(best.loc["t", "margin"])


def test_relative_speed_and_its_intervals():
    df = _frame([_timed(1.0), _timed(2.0, dsl="cute")])
    rel = analysis.relative_speed(df).set_index("dsl")
    assert rel.loc["triton", "speed"] == 1.0 and rel.loc["cute", "speed"] == pytest.approx(0.5)
    assert (rel["fastest_dsl"] == "triton").all()
    cute = rel.loc["cute"]  # 2 ms, CI half 0.1 ms, quartiles 1.8 / 2.4 ms; the fastest is 1 ms
    assert cute["speed_lo"] == pytest.approx(1 / 2.1) and cute["speed_hi"] == pytest.approx(1 / 1.9)
    assert cute["speed_q_lo"] == pytest.approx(1 / 2.4) and cute["speed_q_hi"] == pytest.approx(1 / 1.8)


def test_device_comparison_names_changed_keys_ranks_and_winners():
    gb = dict(requested_profile="gb10", emulated=True)
    df = _frame([_timed(1.0, config_json='{"BLOCK_M": 128, "STAGES": 4}'), _timed(1.2, dsl="cute", config_json="{}"),
                 _timed(1.5, config_json='{"BLOCK_M": 64, "STAGES": 4}', **gb), _timed(1.3, dsl="cute", config_json="{}", **gb),
                 _timed(0.1, dsl="cute", requested_profile="gb10", emulated=False)])  # native gb10: not the emulated side
    cmp = analysis.device_comparison(df).set_index("dsl")
    tri = cmp.loc["triton"]
    assert tri["config_changed"] and tri["changes"] == "BLOCK_M 128->64" and tri["slowdown"] == pytest.approx(1.5)
    assert (tri["native_rank"], tri["emulated_rank"]) == (1, 2)
    assert not cmp.loc["cute", "config_changed"] and cmp.loc["cute", "emulated_ms"] == pytest.approx(1.3)
    w = analysis.device_winners(analysis.device_comparison(df)).iloc[0]
    assert (w["native_winner"], w["emulated_winner"], w["same_winner"]) == ("triton", "cute", False)


def test_parity_errors_worst_per_output_over_ok_trials_only():
    err = lambda a, b: json.dumps({"y": {"rel_l2": a, "rel_max": a, "nonfinite": 0},  # noqa: E731
                                   "h": {"rel_l2": b, "rel_max": 2 * b, "nonfinite": 0}})
    df = _frame([_row(parity_json=err(1e-3, 2e-3)), _row(parity_json=err(3e-3, 1e-3), trial=1),
                 _row(parity_json=err(0.9, 0.9), status="wrong_result", time_ms=None, trial=2),
                 _row(parity_json="not json", trial=3)])
    par = analysis.parity_errors(df).set_index("output")
    assert par.loc["y", "rel_l2"] == pytest.approx(3e-3) and par.loc["h", "rel_max"] == pytest.approx(4e-3)
    assert (par["n"] == 2).all()


def test_convergence_is_best_so_far_in_run_order():
    df = _frame([_row(time_ms=3.0, trial=0, time_utc="2026-01-01T00:00:01Z"),
                 _row(time_ms=5.0, trial=1, time_utc="2026-01-01T00:00:02Z"),
                 _row(time_ms=2.0, trial=0, time_utc="2026-01-02T00:00:00Z", run_id="r2"),  # a later run, new study
                 _row(time_ms=None, status="timeout", trial=2, time_utc="2026-01-01T00:00:03Z"),
                 _row(time_ms=0.1, phase="confirm", trial=-1)])
    conv = analysis.convergence(df)
    assert list(conv["n"]) == [1, 2, 3] and list(conv["best_ms"]) == [3.0, 3.0, 2.0]


def test_smem_points_once_per_config_and_target_with_wrong_side():
    kw = dict(smem_limit_bytes=100.0, preflight_target="sm_121a")
    df = _frame([_row(smem_estimate_bytes=90.0, smem_compiled_bytes=90.0, **kw),
                 _row(smem_estimate_bytes=90.0, smem_compiled_bytes=90.0, trial=1, **kw),  # same config again
                 _row(smem_estimate_bytes=96.0, smem_compiled_bytes=110.0, config_json='{"BLOCK_M": 128}', **kw),
                 _row(smem_estimate_bytes=96.0, config_json='{"BLOCK_M": 256}', **kw)])  # never compiled
    pts = analysis.smem_points(df).set_index("config_json")
    assert len(pts) == 2
    assert pts.loc['{"BLOCK_M": 128}', "error"] == -14 and pts.loc['{"BLOCK_M": 128}', "wrong_side"]
    assert not pts.loc['{"BLOCK_M": 64}', "wrong_side"]


def test_compare_runs_prefers_confirm_counts_twice_and_judges_noise():
    cfg = lambda b: json.dumps({"BLOCK_M": b})  # noqa: E731
    one = _frame([_row(config_json=cfg(64), time_ms=1.00), _row(config_json=cfg(128), time_ms=0.90),
                  _row(config_json=cfg(128), time_ms=0.95, phase="confirm"),
                  _row(dsl="cute", config_json=cfg(64), time_ms=2.0)])
    many = _frame([_row(run_id="r2", config_json=cfg(64), time_ms=0.97), _row(run_id="r3", config_json=cfg(64),
                   time_ms=0.96), _row(run_id="r2", dsl="cute", config_json=cfg(128), time_ms=2.5),
                   _row(run_id="r3", dsl="tilelang", status="compile_error", time_ms=None),
                   # each worker's preflight rejection of one config: not a measurement, not "twice"
                   _row(run_id="r2", config_json=cfg(512), status="infeasible", time_ms=None),
                   _row(run_id="r3", config_json=cfg(512), status="infeasible", time_ms=None)])
    out = analysis.compare_runs(one, many).set_index("dsl")
    tri = out.loc["triton"]
    # one side's best is its confirm median (0.95 of BLOCK_M 128), the other's its sweep best (0.96, 64).
    assert tri["ms_a"] == 0.95 and tri["ms_b"] == 0.96 and tri["twice"] == 1 and tri["verdict"] == "within noise"
    assert out.loc["cute", "verdict"] == "differs" and out.loc["cute", "ratio"] == 1.25
    assert out.loc["tilelang", "ms_b"] is None or pd.isna(out.loc["tilelang", "ms_b"])
    assert analysis.measured_twice(many) == 1 and tri["configs_b"] == 2
    assert out.loc["tilelang", "configs_a"] == 0 and out.loc["tilelang", "verdict"] == "differs"
    same = analysis.compare_runs(one, one).set_index("dsl")
    assert same.loc["triton", "verdict"] == "same config" and same.loc["triton", "twice"] == 0
