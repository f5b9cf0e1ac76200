"""Result rows (schema, atomic per-row writes, load) and the report built from them."""
from __future__ import annotations

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
    w.add(_row(dsl="torch", baseline=True, config_json="{}", time_ms=1.0, time_q1_ms=0.98, time_q3_ms=1.02, tflops=100.0))
    w.add(_row(time_ms=0.8, time_q1_ms=0.79, time_q3_ms=0.81, tflops=125.0, config_json='{"BLOCK_M": 64}'))
    w.add(_row(time_ms=0.9, time_q1_ms=0.89, time_q3_ms=0.91, config_json='{"BLOCK_M": 128}'))
    w.add(_row(time_ms=None, status="timeout", config_json='{"BLOCK_M": 256}'))
    best = with_ratios(best_per_dsl(pd.read_parquet(w.path)))
    tri = best[best["dsl"] == "triton"].iloc[0]
    assert json.loads(tri["config_json"]) == {"BLOCK_M": 64}
    assert tri["ratio_to_baseline"] == pytest.approx(1.25) and tri["vs_baseline"] == "FASTER"
    md = write(tmp_path).read_text()
    assert "| triton | 0.8000 |" in md and "FASTER" in md and "timeout 1" in md
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
