"""Result rows (schema, atomic per-row writes, load) and the report built from them."""
from __future__ import annotations

import functools
import json

import pandas as pd
import pytest


def _row(**kw):
    from lab.results import COLUMNS
    row = {c: None for c in COLUMNS}
    row.update(run_id="r1", kernel="gemm", dsl="triton", shape="s", shape_json=json.dumps({"M": 8, "N": 8, "K": 8, "dtype": "float16"}),
               config_json=json.dumps({"BLOCK_M": 64}), status="ok", phase="sweep", time_ms=1.0, emulated=False,
               baseline=False, requested_profile="h100", actual_gpu="H100", samples_ms=[1.0, 1.1])
    row.update(kw)
    return row


@functools.lru_cache(maxsize=None)
def _today(kernel="gemm", dsl="triton") -> str:
    """versions_json of a row that measured the checkout's lane code with today's harness (``gate.Freshness``)."""
    import lab
    from lab import identity, registry
    return json.dumps({"lab": lab.__version__, **identity.lane_identity(registry.get(dsl, kernel).module_name)})


@functools.lru_cache(maxsize=None)
def _older(kernel="gemm", dsl="triton") -> str:
    """versions_json of a row that measured an older version of the lane's code (one file differs)."""
    v = json.loads(_today(kernel, dsl))
    first = sorted(v["lane_files"])[0]
    v["lane_files"][first] = "0" * 16
    return json.dumps(v)


def test_writer_rewrites_atomically_and_load_concats(tmp_path):
    from lab.results import COLUMNS, RunWriter, load
    w = RunWriter(tmp_path / "h100" / "gemm", "run-a")
    w.add(_row())
    assert len(pd.read_parquet(w.path)) == 1
    w.add(_row(status="wrong_result", time_ms=None, error="bad"))
    w2 = RunWriter(tmp_path / "gb10" / "gemm", "run-b")
    w2.add(_row(run_id="r2", dsl="torch", config_json="{}"))
    df = load(tmp_path)
    assert len(df) == 3 and set(COLUMNS) <= set(df.columns)
    assert "cfg.BLOCK_M" in df.columns and "shape.M" in df.columns
    assert df["time_ms"].dtype == "float64" and list(df["samples_ms"].iloc[0]) == [1.0, 1.1]
    assert not list(tmp_path.rglob("*.tmp"))


def test_row_missing_a_column_is_refused(tmp_path):
    from lab.results import RunWriter
    row = _row()
    del row["parity_rel_l2"]
    with pytest.raises(ValueError, match="parity_rel_l2"):
        RunWriter(tmp_path, "x").add(row)


def test_load_of_empty_folder_has_schema(tmp_path):
    from lab.results import COLUMNS, load
    assert list(load(tmp_path).columns)[: len(COLUMNS)] == list(COLUMNS)


def test_report_best_per_dsl_ratio_and_verdict(tmp_path):
    from lab.report import best_per_dsl, with_ratios, write
    from lab.results import RunWriter
    w = RunWriter(tmp_path / "h100" / "gemm", "run")
    w.add(_row(dsl="torch", baseline=True, config_json="{}", time_ms=1.0, time_q1_ms=0.98, time_q3_ms=1.02, tflops=100.0,
               versions_json=_today("gemm", "torch")))
    w.add(_row(time_ms=0.8, time_q1_ms=0.79, time_q3_ms=0.81, tflops=125.0, config_json='{"BLOCK_M": 64}', versions_json=_today()))
    w.add(_row(time_ms=0.9, time_q1_ms=0.89, time_q3_ms=0.91, config_json='{"BLOCK_M": 128}', versions_json=_today()))
    w.add(_row(time_ms=None, status="timeout", config_json='{"BLOCK_M": 256}', versions_json=_today()))
    best = with_ratios(best_per_dsl(pd.read_parquet(w.path)))
    tri = best[best["dsl"] == "triton"].iloc[0]
    assert json.loads(tri["config_json"]) == {"BLOCK_M": 64}
    assert tri["ratio_to_baseline"] == pytest.approx(1.25) and tri["vs_baseline"] == "FASTER"
    md = write(tmp_path).read_text()
    assert "| triton | 0.8000 |" in md and "FASTER" in md and "timeout 1" in md and "older code" not in md
    assert (tmp_path / "report" / "gemm_h100_tflops.png").stat().st_size > 1000
    assert (tmp_path / "report" / "gemm_h100_ratio.png").exists()


def test_report_marks_emulated(tmp_path):
    from lab.report import write
    from lab.results import RunWriter
    w = RunWriter(tmp_path / "gb10" / "gemm", "run")
    w.add(_row(requested_profile="gb10", emulated=True, actual_gpu="NVIDIA H100 80GB HBM3",
               smem_limit_bytes=101_376, smem_compiled_bytes=98_320, smem_launched_bytes=147_480))
    md = write(tmp_path).read_text()
    assert "EMULATED on NVIDIA H100 80GB HBM3" in md
    assert "1 of 1 ok trials launched a binary using more shared memory" in md


def _write(tmp_path, rows, run="run", device="h100", kernel="gemm"):
    """Rows of one run; each measured today's lane code unless it sets ``versions_json`` (see _older)."""
    from lab.results import RunWriter
    w = RunWriter(tmp_path / device / kernel, run)
    for r in rows:
        w.add(_row(run_id=run, kernel=kernel, **{"versions_json": _today(kernel, r.get("dsl", "triton")), **r}))
    return w.path


def _m2(**kw):
    """A row of m2rnn_fwd, whose torch lane declares itself a slow reference (BASELINE_KIND)."""
    return {"shape_json": json.dumps({"B": 1, "dtype": "bfloat16"}), **kw}


def test_lane_declares_reference_baseline():
    from lab import registry
    assert registry.get("torch", "gemm").baseline_kind == "library"  # cuBLAS: a real baseline
    for kernel in ("m2rnn_fwd", "m2rnn_bwd", "mamba_bwd_bwd"):
        assert registry.get("torch", kernel).baseline_kind == "reference"
    assert registry.baseline_kind("no_such_dsl", "gemm") == "library"


def test_report_compares_with_fastest_lane_when_baseline_is_a_reference(tmp_path):
    from lab.report import best_per_dsl, with_ratios, write
    q = lambda t: {"time_ms": t, "time_q1_ms": t * 0.99, "time_q3_ms": t * 1.01}  # noqa: E731
    _write(tmp_path, [_m2(dsl="torch", baseline=True, config_json="{}", **q(100.0)),
                      _m2(dsl="triton", **q(1.0)), _m2(dsl="cute", config_json='{"CHUNK": 16}', **q(0.8))],
           kernel="m2rnn_fwd")
    from lab.results import load
    best = with_ratios(best_per_dsl(load(tmp_path))).set_index("dsl")
    assert set(best["ratio_kind"]) == {"fastest"} and set(best["ratio_ref"]) == {"cute"}
    assert best.loc["cute", "vs_baseline"] == "fastest" and best.loc["cute", "ratio_to_baseline"] == 1.0
    assert best.loc["triton", "ratio_to_baseline"] == pytest.approx(0.8) and best.loc["triton", "vs_baseline"] == "SLOWER"
    assert best.loc["torch", "is_reference"] and best.loc["torch", "vs_baseline"] == "SLOWER"
    md = write(tmp_path).read_text()
    assert "vs fastest (cute)" in md and "FASTER" not in md and "vs baseline" not in md
    assert "| torch (reference) |" in md and "the torch lane is a slow reference" in md


def test_report_lists_an_unavailable_lane_only_where_it_never_ran(tmp_path):
    from lab.report import write
    gone = "unavailable: ModuleNotFoundError: No module named 'cutlass'"
    never = "unavailable: ModuleNotFoundError: No module named 'tilelang'"
    idle = dict(status="infeasible", phase="eligibility", time_ms=None, config_json="{}")
    _write(tmp_path, [_m2(dsl="torch", baseline=True, config_json="{}", time_ms=50.0, shape=s) for s in ("s1", "s2")]
           + [_m2(dsl="cute", error=gone, shape=s, **idle) for s in ("s1", "s2")]
           + [_m2(dsl="tilelang", error=never, shape="s1", **idle)], run="old", kernel="m2rnn_fwd")
    _write(tmp_path, [_m2(dsl="cute", time_ms=1.0, shape="s1")], run="new", kernel="m2rnn_fwd")
    md = write(tmp_path).read_text()
    s1, s2 = md.split("### s1")[1].split("### s2")
    assert gone not in s1 and "| cute | 1.0000 |" in s1 and never in s1  # cute ran at s1 in another run
    assert gone in s2  # no run of cute succeeded at s2
    assert s1.count("| cute |") == 1


def test_report_headline_is_the_best_confirmed_config_and_parity_skips_failures(tmp_path):
    from lab.report import best_per_dsl, with_ratios, write
    from lab.results import load
    a, b = '{"BLOCK_M": 64}', '{"BLOCK_M": 128}'
    conf = dict(phase="confirm", trial=-1)
    t = lambda ms: {"time_ms": ms, "time_q1_ms": ms * 0.995, "time_q3_ms": ms * 1.005}  # noqa: E731
    _write(tmp_path, [dict(dsl="torch", baseline=True, config_json="{}", time_utc="2026-01-01T00:00:00Z", **t(1.0)),
                      dict(config_json=a, time_utc="2026-01-01T00:00:01Z", **t(0.95)),
                      dict(dsl="torch", baseline=True, config_json="{}", time_utc="2026-01-01T00:01:00Z", **conf, **t(1.0)),
                      dict(config_json=a, time_utc="2026-01-01T00:01:00Z", **conf, **t(0.9))], run="r1")
    # A newer run confirms another, slower config: the older, faster confirmed one stays the headline.
    _write(tmp_path, [dict(dsl="torch", baseline=True, config_json="{}", time_utc="2026-02-01T00:00:00Z", **t(1.02)),
                      dict(config_json=b, time_utc="2026-02-01T00:00:01Z", **t(0.93)),
                      dict(dsl="torch", baseline=True, config_json="{}", time_utc="2026-02-01T00:01:00Z", **conf, **t(1.05)),
                      dict(config_json=b, time_utc="2026-02-01T00:01:00Z", **conf, **t(1.1))], run="r2")
    best = with_ratios(best_per_dsl(load(tmp_path))).set_index("dsl")
    tri = best.loc["triton"]
    assert tri["config_json"] == a and tri["head_ms"] == pytest.approx(0.9) and tri["confirm_run"] == "r1"
    assert tri["sweep_best_ms"] == pytest.approx(0.93) and tri["timing_source"] == "A/B confirm"
    assert best.loc["torch", "head_ms"] == pytest.approx(1.0)
    assert tri["ratio_to_baseline"] == pytest.approx(1.0 / 0.9) and tri["vs_baseline"] == "FASTER"
    # Parity: a wrong_result trial's errors stay out of the worst-error table; ok trials' are in it.
    err = lambda e: json.dumps({"y": {"rel_l2": e, "rel_max": e, "nonfinite": 0},  # noqa: E731
                                "h_final": {"rel_l2": e / 2, "rel_max": e / 2, "nonfinite": 0}})
    _write(tmp_path / "m2", [_m2(dsl="triton", parity_json=err(1e-3)),
                             _m2(dsl="triton", status="wrong_result", time_ms=None, parity_json=err(0.5),
                                 config_json='{"BLOCK_M": 32}')], kernel="m2rnn_fwd")
    md = write(tmp_path / "m2").read_text()
    assert "| triton | 1 | 1.0e-03 / 1.0e-03 | 5.0e-04 / 5.0e-04 |" in md and "5.0e-01" not in md


def test_report_headline_columns_come_from_the_confirmed_run(tmp_path):
    """SMEM, registers and parity beside a confirmed headline come from the confirm run's own sweep row
    of that config, not from a later run that measured the same config on other code."""
    from lab.report import best_per_dsl
    from lab.results import load
    conf = dict(phase="confirm", trial=-1)
    _write(tmp_path, [dict(time_ms=2.0, smem_compiled_bytes=70_000.0, registers=242.0, time_utc="2026-01-01T00:00:00Z"),
                      dict(time_ms=2.0, time_utc="2026-01-01T00:01:00Z", **conf)], run="r1")
    _write(tmp_path, [dict(time_ms=1.5, smem_compiled_bytes=40_000.0, registers=255.0, time_utc="2026-02-01T00:00:00Z",
                           git_commit="later")], run="r2")
    tri = best_per_dsl(load(tmp_path)).set_index("dsl").loc["triton"]
    assert tri["confirm_run"] == "r1" and tri["confirm_ms"] == pytest.approx(2.0)
    assert tri["smem_compiled_bytes"] == 70_000 and tri["registers"] == 242 and tri["run_id"] == "r1"
    assert tri["sweep_best_ms"] == pytest.approx(1.5)
    # A confirm run that resumed its study measured no sweep row of its own: the newest row before it.
    _write(tmp_path, [dict(time_ms=1.8, time_utc="2026-01-15T00:01:00Z", **conf)], run="r3")
    tri = best_per_dsl(load(tmp_path)).set_index("dsl").loc["triton"]
    assert tri["confirm_run"] == "r3" and tri["run_id"] == "r1" and tri["registers"] == 242


def _t(ms):
    return {"time_ms": ms, "time_q1_ms": ms * 0.995, "time_q3_ms": ms * 1.005}


CONFIRM = dict(phase="confirm", trial=-1)


def test_report_lane_without_a_confirm_shows_its_sweep_best_beside_the_others_confirms(tmp_path):
    """One lane has no A/B confirm: it shows its best sweep trial, marked "sweep"; the lanes with a confirm
    keep it (the table is not switched to sweep timings), and the note says which is which."""
    from lab.report import best_per_dsl, with_ratios, write
    from lab.results import load
    _write(tmp_path, [dict(dsl="torch", baseline=True, config_json="{}", **_t(4.0)),
                      dict(dsl="torch", baseline=True, config_json="{}", **CONFIRM, **_t(4.0)),
                      dict(config_json='{"BLOCK_M": 64}', **_t(3.0)),
                      dict(config_json='{"BLOCK_M": 64}', **CONFIRM, **_t(3.0)),
                      dict(config_json='{"BLOCK_M": 128}', **_t(2.9)),
                      dict(dsl="cute", config_json="{}", **_t(2.0))], run="r1")
    best = with_ratios(best_per_dsl(load(tmp_path))).set_index("dsl")
    tri, cute = best.loc["triton"], best.loc["cute"]
    assert tri["timing_source"] == "A/B confirm" and tri["head_ms"] == pytest.approx(3.0)
    assert tri["config_json"] == '{"BLOCK_M": 64}' and tri["sweep_best_ms"] == pytest.approx(2.9)
    assert cute["timing_source"] == "sweep" and cute["head_ms"] == pytest.approx(2.0) and pd.isna(cute["confirm_ms"])
    assert best.loc["torch", "timing_source"] == "A/B confirm"
    assert tri["ratio_to_baseline"] == pytest.approx(4.0 / 3.0) and cute["ratio_to_baseline"] == pytest.approx(2.0)
    md = write(tmp_path).read_text()
    assert "| cute | 2.0000 | 0.0200 | - | sweep | 2.0000 |" in md
    assert "| triton | 3.0000 | 0.0300 | - | A/B confirm | 2.9000 |" in md
    assert "A/B confirm, each lane's best: torch, triton in run r1; sweep, each lane's best trial" in md
    assert "(no A/B confirm among its rows): cute;" in md


def test_report_confirm_superseded_by_a_clearly_faster_config_found_later(tmp_path):
    """A later sweep's config more than lab.headline.SUPERSEDE faster than the confirmed config's fastest
    sweep trial takes the headline (timing "sweep"); within that margin the confirm stands."""
    from lab import headline
    from lab.report import best_per_dsl, with_ratios
    from lab.results import load
    _write(tmp_path, [dict(dsl="torch", baseline=True, config_json="{}", **_t(40.0)),
                      dict(dsl="torch", baseline=True, config_json="{}", **CONFIRM, **_t(40.0)),
                      dict(config_json='{"BLOCK_M": 64}', **_t(23.0)),
                      dict(config_json='{"BLOCK_M": 64}', **CONFIRM, **_t(23.4))], run="r1")
    _write(tmp_path, [dict(config_json='{"BLOCK_M": 128}', time_utc="2026-02-01T00:00:00Z", **_t(9.0))], run="r2")
    best = with_ratios(best_per_dsl(load(tmp_path))).set_index("dsl")
    tri = best.loc["triton"]
    assert tri["timing_source"] == "sweep" and tri["head_ms"] == pytest.approx(9.0) and tri["run_id"] == "r2"
    assert tri["config_json"] == '{"BLOCK_M": 128}' and pd.isna(tri["confirm_ms"])
    assert best.loc["torch", "timing_source"] == "A/B confirm"
    # Just inside the margin the confirm stands.
    near = 23.0 * (1 - headline.SUPERSEDE) + 0.01
    _write(tmp_path / "b", [dict(config_json='{"BLOCK_M": 64}', **_t(23.0)),
                            dict(config_json='{"BLOCK_M": 64}', **CONFIRM, **_t(23.4)),
                            dict(config_json='{"BLOCK_M": 128}', **_t(near))], run="r1")
    tri = best_per_dsl(load(tmp_path / "b")).set_index("dsl").loc["triton"]
    assert tri["confirm_ms"] == pytest.approx(23.4) and tri["sweep_best_ms"] == pytest.approx(near)


def test_report_headline_is_todays_code_not_a_faster_confirm_of_older_code(tmp_path):
    """A faster confirm of an older version of the lane's code does not stand for today's lane: the
    headline and the sweep best come from the rows of today's code."""
    from lab.report import best_per_dsl, with_ratios, write
    from lab.results import load
    base = dict(dsl="torch", baseline=True, config_json="{}")
    _write(tmp_path, [dict(**base, time_utc="2026-01-01T00:00:00Z", **_t(1.0)),
                      dict(time_utc="2026-01-01T00:00:01Z", versions_json=_older(), **_t(0.4)),
                      dict(**base, time_utc="2026-01-01T00:01:00Z", **CONFIRM, **_t(1.0)),
                      dict(time_utc="2026-01-01T00:01:00Z", versions_json=_older(), **CONFIRM, **_t(0.5))], run="old")
    _write(tmp_path, [dict(time_utc="2026-02-01T00:00:01Z", **_t(0.8)),
                      dict(**base, time_utc="2026-02-01T00:01:00Z", **CONFIRM, **_t(1.0)),
                      dict(time_utc="2026-02-01T00:01:00Z", **CONFIRM, **_t(0.9))], run="new")
    best = with_ratios(best_per_dsl(load(tmp_path))).set_index("dsl")
    tri = best.loc["triton"]
    assert tri["head_ms"] == pytest.approx(0.9) and tri["confirm_run"] == "new" and tri["fresh"]
    assert tri["sweep_best_ms"] == pytest.approx(0.8) and tri["run_id"] == "new"
    md = write(tmp_path).read_text()
    assert "| triton | 0.9000 |" in md and "older code" not in md


def test_report_lane_with_only_older_code_rows_shows_them_marked(tmp_path):
    """A lane with no row of today's code is judged on all its rows, and its table row says so."""
    from lab.report import best_per_dsl, with_ratios, write
    from lab.results import load
    _write(tmp_path, [dict(dsl="torch", baseline=True, config_json="{}", **_t(1.0)),
                      dict(dsl="torch", baseline=True, config_json="{}", **CONFIRM, **_t(1.0)),
                      dict(versions_json=_older(), **_t(0.7)),
                      dict(versions_json=_older(), **CONFIRM, **_t(0.8))])
    best = with_ratios(best_per_dsl(load(tmp_path))).set_index("dsl")
    tri = best.loc["triton"]
    assert not tri["fresh"] and best.loc["torch", "fresh"]
    assert tri["head_ms"] == pytest.approx(0.8) and tri["timing_source"] == "A/B confirm"
    assert tri["sweep_best_ms"] == pytest.approx(0.7)
    md = write(tmp_path).read_text()
    assert "| triton (older code) | 0.8000 |" in md and "| torch | 1.0000 |" in md
    assert "(marked older code: triton)" in md


def test_report_of_a_compile_only_sweep(tmp_path):
    """Rows of --compile-only runs have no timings: the report says what compiled and what fits."""
    from lab.report import compile_summary, write
    from lab.results import load
    limit = 101_376
    co = dict(compile_only=True, requested_profile="gb10", actual_gpu="none (CPU only)", preflight_target="sm_121a",
              smem_limit_bytes=limit, time_ms=None, samples_ms=None)
    _write(tmp_path, [
        dict(status="compiled", smem_estimate_bytes=65_536, smem_compiled_bytes=65_536, config_json='{"BLOCK_M": 64}', **co),
        dict(status="compiled", smem_estimate_bytes=98_304, smem_compiled_bytes=98_304, config_json='{"BLOCK_M": 128}', **co),
        dict(status="infeasible", smem_estimate_bytes=98_000, smem_compiled_bytes=140_000, config_json='{"BLOCK_M": 256}',
             error=f"compiled shared memory 140000 B > gb10 limit {limit} B", **co),
        dict(status="infeasible", smem_estimate_bytes=200_000, config_json='{"BLOCK_M": 512}',
             error=f"estimated shared memory 200000 B > gb10 limit {limit} B", **co),
        dict(status="compile_error", config_json='{"BLOCK_M": 32}', error="RuntimeError: simulated", **co),
        dict(dsl="torch", baseline=True, status="infeasible", config_json="{}",
             error="compile-only: nothing to compile ahead of time (cuBLAS)", **co),
        dict(dsl="cute", phase="eligibility", status="infeasible", config_json="{}",
             error="unavailable: ModuleNotFoundError: No module named 'cutlass'", **co),
    ], run="co", device="gb10")
    _write(tmp_path, [dict(dsl="torch", baseline=True, config_json="{}", time_ms=1.0)], run="timed")  # an h100 run beside it
    s = compile_summary(load(tmp_path)).set_index("dsl")
    tri = s.loc["triton"]
    assert (tri["proposed"], tri["rejected_before_compile"], tri["compiled"], tri["fit"], tri["compile_errors"]) == (5, 1, 3, 2, 1)
    assert tri["min_compiled_smem"] == 65_536 and tri["first_error"] == "RuntimeError: simulated"
    assert s.loc["torch", "proposed"] == 0 and "nothing to compile ahead" in s.loc["torch", "note"]
    assert "cutlass" in s.loc["cute", "note"]
    md = write(tmp_path).read_text()
    assert "## Compile-only runs" in md and "### gemm for gb10 (sm_121a, limit 101,376 B)" in md
    assert "| s | triton | 5 | 1 | 3 | 2 | 65,536 | 1 (first: RuntimeError: simulated) |" in md
    assert "## gemm on h100" in md and "## gemm on gb10" not in md  # compile-only rows get no timing table
    assert "| co |" in md and "compile-only" in md


def test_a_test_lanes_rows_stay_out_of_report_gate_and_export(tmp_path):
    """The fault campaign's rows (dsl "faults", a lane only tests register) are kept under results/ but
    are no lane's report table, gate entry or tuned config."""
    from lab import gate, tuned
    from lab.report import write
    from lab.results import RunWriter, load
    w = RunWriter(tmp_path / "h200" / "gemm", "run")
    w.add(_row(requested_profile="h200", time_ms=0.8, time_q1_ms=0.79, time_q3_ms=0.81, versions_json=_today()))
    w.add(_row(requested_profile="h200", dsl="faults", time_ms=0.1, config_json='{"FAULT": "none"}'))
    df = load(tmp_path)
    assert set(gate.ok_rows(df)["dsl"]) == {"triton"}
    assert [e["dsl"] for e in tuned.entries(df, "h200")] == ["triton"]
    md = write(tmp_path).read_text()
    assert "| triton |" in md and "faults" not in md


def _capture_sweep_requests(monkeypatch, tmp_path) -> dict:
    """Replaces ``sweep.run`` so that ``cli.main(["sweep", ...])`` runs nothing: the returned dict's
    "req" is the last SweepRequest the CLI built."""
    from lab import sweep
    got = {}

    class Done:
        class writer:
            path, rows = tmp_path / "x.parquet", []

    def fake_run(req, present, **kw):
        got["req"] = req
        return Done, {}
    monkeypatch.setattr(sweep, "run", fake_run)
    return got


def test_headline_configs_and_sweep_seed_best(tmp_path, monkeypatch, capsys):
    """``sweep --seed-best`` seeds each tuned lane's report headline config on the requested profile and
    emulation (no baseline lane), and counts --trials as new configs after it."""
    from lab import cli, report
    from lab.results import load
    s = "sq4096_bf16"
    _write(tmp_path, [dict(dsl="torch", baseline=True, config_json="{}", shape=s, **CONFIRM, **_t(4.0)),
                      dict(config_json='{"BLOCK_M": 64}', shape=s, **_t(3.0)),
                      dict(config_json='{"BLOCK_M": 64}', shape=s, **CONFIRM, **_t(3.0)),
                      dict(config_json='{"BLOCK_M": 128}', shape=s, **_t(2.95))], run="r1")
    _write(tmp_path, [dict(config_json='{"BLOCK_M": 32}', shape=s, emulated=True, requested_profile="gb10",
                           **_t(5.0))], run="r2", device="gb10")
    df = load(tmp_path)
    assert report.headline_configs(df, "gemm", "h100", False) == {("triton", s): {"BLOCK_M": 64}}
    assert report.headline_configs(df, "gemm", "gb10", True) == {("triton", s): {"BLOCK_M": 32}}
    assert report.headline_configs(df, "gemm", "gb10", False) == {}
    got = _capture_sweep_requests(monkeypatch, tmp_path)
    assert cli.main(["sweep", "gemm", "--device", "h100", "--dsl", "triton", "--shape", s, "--trials", "0",
                     "--seed-best", "--results", str(tmp_path)]) == 0
    req = got["req"]
    assert req.seeds == {("triton", s): [{"BLOCK_M": 64}]} and req.new_trials and req.trials == 0
    assert cli.main(["sweep", "gemm", "--device", "h100", "--dsl", "triton", "--shape", s,
                     "--results", str(tmp_path)]) == 0
    assert got["req"].seeds == {} and not got["req"].new_trials
    # --seed-from: another profile's native best where the requested one has none (gb10 native has none)
    assert cli.main(["sweep", "gemm", "--device", "gb10", "--dsl", "triton", "--shape", s, "--trials", "0",
                     "--seed-best", "--seed-from", "h100", "--results", str(tmp_path)]) == 0
    assert got["req"].seeds == {("triton", s): [{"BLOCK_M": 64}]}
    # ... and the requested profile's own best where it has one
    assert cli.main(["sweep", "gemm", "--device", "gb10", "--emulate", "--dsl", "triton", "--shape", s, "--trials",
                     "0", "--seed-best", "--seed-from", "h100", "--results", str(tmp_path)]) == 0
    assert got["req"].seeds == {("triton", s): [{"BLOCK_M": 32}]}
    assert cli.main(["sweep", "gemm", "--device", "gb10", "--shape", s, "--seed-from", "h100",
                     "--results", str(tmp_path)]) == 2
    assert "--seed-from needs --seed-best" in capsys.readouterr().err
    assert cli.main(["sweep", "gemm", "--device", "gb10", "--shape", s, "--seed-best", "--seed-from", "h300",
                     "--results", str(tmp_path)]) == 2
    assert "unknown device 'h300'" in capsys.readouterr().err


def test_a_profile_emulated_on_two_gpus_gives_two_tables(tmp_path):
    """GB10 emulated on an H100 and on an H200: each GPU's rows are their own table, ratios and plots, and
    ``--seed-best --emulate`` takes the best timed on the GPU present."""
    from lab import report
    from lab.results import RunWriter, load
    emu = dict(requested_profile="gb10", emulated=True, phase="confirm")
    w = RunWriter(tmp_path / "gb10" / "gemm", "run")
    # On the H100, triton is the fastest (1.0 vs 2.0 ms); on the H200 torch (0.5 vs 0.9 ms).
    w.add(_row(dsl="torch", baseline=True, config_json="{}", time_ms=2.0, actual_gpu="NVIDIA H100 80GB HBM3", **emu))
    w.add(_row(config_json='{"BLOCK_M": 64}', time_ms=1.0, actual_gpu="NVIDIA H100 80GB HBM3", **emu))
    w.add(_row(dsl="torch", baseline=True, config_json="{}", time_ms=0.5, actual_gpu="NVIDIA H200", **emu))
    w.add(_row(config_json='{"BLOCK_M": 128}', time_ms=0.9, actual_gpu="NVIDIA H200", **emu))
    df = load(tmp_path)
    best = report.with_ratios(report.best_per_dsl(df))
    assert len(best) == 4
    ratio = {(r.actual_gpu, r.dsl): r.ratio_to_baseline for r in best.itertuples()}
    assert ratio[("NVIDIA H100 80GB HBM3", "triton")] == pytest.approx(2.0)
    assert ratio[("NVIDIA H200", "triton")] == pytest.approx(0.5 / 0.9)
    md = report.markdown(df)
    assert "## gemm on gb10 (EMULATED on NVIDIA H100 80GB HBM3)" in md and "## gemm on gb10 (EMULATED on NVIDIA H200)" in md
    assert "H100 80GB HBM3, NVIDIA H200" not in md
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "gemm_gb10_emulated_ratio.png").write_bytes(b"")   # a plot an older report drew
    report.write(tmp_path)
    names = {p.name for p in (tmp_path / "report").glob("*.png")}
    assert {"gemm_gb10_emulated_on_h100_ratio.png", "gemm_gb10_emulated_on_h200_ratio.png"} <= names
    assert "gemm_gb10_emulated_ratio.png" not in names
    assert report.headline_configs(df, "gemm", "gb10", True, "NVIDIA H200") == {("triton", "s"): {"BLOCK_M": 128}}
    assert report.headline_configs(df, "gemm", "gb10", True, "NVIDIA H100 80GB HBM3") == {("triton", "s"): {"BLOCK_M": 64}}
    assert report.headline_configs(df, "gemm", "gb10", True) == {("triton", "s"): {"BLOCK_M": 128}}   # the fastest
    # sweep --seed-best --emulate: the best timed on the GPU present, else another GPU's
    from lab import cli
    from lab.devices import PresentGPU
    args = ["sweep", "gemm", "--device", "gb10", "--emulate", "--dsl", "triton", "--trials", "0", "--seed-best",
            "--results", str(tmp_path)]
    for gpu, want in (("NVIDIA H100 80GB HBM3", 64), ("NVIDIA H200", 128), ("NVIDIA B200", 128)):
        with pytest.MonkeyPatch.context() as mp:
            got = _capture_sweep_requests(mp, tmp_path)
            mp.setattr(cli, "detect", lambda: PresentGPU(gpu, (9, 0), 132, 0, None))
            assert cli.main(args) == 0
        assert got["req"].seeds == {("triton", "s"): [{"BLOCK_M": want}]}, gpu
