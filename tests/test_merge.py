"""lab merge: several GPU calls' results/ brought back into one checkout without losing a run table, a
study or a finished trial (each call returns its own copy of the study databases)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import optuna
import pytest
from optuna.distributions import IntDistribution
from optuna.trial import TrialState, create_trial

from lab import merge
from lab.devices import LabError
from lab.results import RunWriter, load
from tests.test_results_and_report import _row

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _trial(value: float, x: int, state=TrialState.COMPLETE):
    return create_trial(state=state, value=value if state == TrialState.COMPLETE else None, params={"x": x},
                        distributions={"x": IntDistribution(0, 100)})


def _study(db: Path, name: str, *trials):
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{db}", load_if_exists=True)
    for t in trials:
        study.add_trial(t)
    return study


def _run(folder: Path, run_id: str, n: int = 1):
    w = RunWriter(folder / "h100" / "gemm", run_id)
    for i in range(n):
        w.add(_row(run_id=run_id, trial=i, time_ms=1.0 + i))
    return w.path


def _call(base: Path, tmp: Path, name: str, log: str | None) -> Path:
    """A GPU call's output folder: results.tgz of a copy of ``base`` (what the call started from and
    added to), and its log."""
    out = tmp / name
    out.mkdir()
    with tarfile.open(out / "results.tgz", "w:gz") as tar:
        tar.add(base, arcname="results")
    if log is not None:
        (out / "env.txt").write_text("2026-11-26T08:26:28Z\nNVIDIA H100 80GB HBM3\n")
        (out / "log.txt").write_text(log)
    return out


def _trials(db: Path, name: str) -> list:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{db}").get_trials()


def test_two_calls_from_one_checkout_merge_without_losing_anything(tmp_path):
    local = tmp_path / "results"
    db = local / "h100" / "gemm" / "optuna.db"
    _run(local, "run-a")
    db.parent.mkdir(parents=True, exist_ok=True)
    _study(db, "s1", _trial(1.0, 1))
    (local / "report").mkdir()
    (local / "report" / "report.md").write_text("local report\n")
    (local / "notes.txt").write_text("local\n")

    # Each call starts from a copy of the checkout and adds its own run, trials and study.
    calls = []
    for k, (run, x, other) in enumerate([("run-b", 2, "s2"), ("run-c", 3, "s3")]):
        base = tmp_path / f"base{k}" / "results"
        shutil.copytree(local, base)
        _run(base, run, n=2)
        cdb = base / "h100" / "gemm" / "optuna.db"
        _study(cdb, "s1", _trial(float(x), x), _trial(0.0, 99, TrialState.RUNNING))
        _study(cdb, other, _trial(5.0, 5)).enqueue_trial({"x": 7})   # a seed that call queued, never ran
        (base / "report" / "report.md").write_text(f"report of {run}\n")
        if k == 1:
            (base / "notes.txt").write_text("changed there\n")
        calls.append(_call(base, tmp_path, f"call{k}", f"=== [1] python3 -m lab sweep gemm\nrun {run}: rows in x\n"))
    # A third call that ran no sweep: its log is named by the call's start.
    calls.append(_call(local, tmp_path, "call2", "=== [1] python3 scripts/check.py\nok\n"))

    out = merge.merge(calls, local)
    assert sorted(p.name for p in (local / "h100" / "gemm").glob("*.parquet")) == \
        ["run-a.parquet", "run-b.parquet", "run-c.parquet"]
    assert len(load(local)) == 5
    s1 = _trials(db, "s1")
    assert sorted(t.params["x"] for t in s1) == [1, 2, 3]              # the running trials are not copied
    assert all(t.state == TrialState.COMPLETE for t in s1)
    # A study new here takes only the finished trials: the waiting seed would run first in a later sweep.
    assert [t.params["x"] for t in _trials(db, "s2")] == [5] and [t.params["x"] for t in _trials(db, "s3")] == [5]
    assert (local / "logs" / "run-b-log.txt").read_text().startswith("2026-11-26T08:26:28Z\n")
    assert "run run-c: rows in" in (local / "logs" / "run-c-log.txt").read_text()
    assert (local / "logs" / "20261126T082628Z-call-log.txt").exists()
    assert (local / "report" / "report.md").read_text() == "local report\n"    # regenerated, not merged
    assert (local / "notes.txt").read_text() == "local\n"
    assert out.conflicts == ["notes.txt: differs from the checkout's copy"]
    assert out.n_trials == 2 and len(out.studies) == 2 and any("still running" in s for s in out.skipped)

    again = merge.merge(calls, local)                                   # idempotent
    assert not again.copied and not again.studies and again.n_trials == 0 and not again.logs


def test_a_run_table_that_went_on_replaces_the_local_one_and_a_diverged_one_is_a_conflict(tmp_path):
    local = tmp_path / "results"
    _run(local, "run-a", n=1)
    grown = tmp_path / "g" / "results"
    _run(grown, "run-a", n=3)
    out = merge.merge([_call(grown, tmp_path, "c1", None)], local)
    assert out.replaced == ["h100/gemm/run-a.parquet"] and len(load(local)) == 3
    other = tmp_path / "o" / "results"
    w = RunWriter(other / "h100" / "gemm", "run-a")
    w.add(_row(run_id="run-a", trial=7, time_ms=9.0))
    out = merge.merge([_call(other, tmp_path, "c2", None)], local)
    assert out.conflicts and len(load(local)) == 3


def test_the_cli_merges_and_fails_on_a_conflict(tmp_path):
    local = tmp_path / "results"
    _run(local, "run-a")
    (local / "notes.txt").write_text("local\n")
    there = tmp_path / "t" / "results"
    shutil.copytree(local, there)
    _run(there, "run-b")
    call = _call(there, tmp_path, "c", None)
    root = str(Path(__file__).resolve().parent.parent)
    cmd = [sys.executable, "-m", "lab", "merge", "--results", str(local), str(call / "results.tgz")]
    res = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    assert res.returncode == 0 and "copied h100/gemm/run-b.parquet" in res.stdout, res.stdout + res.stderr
    (there / "notes.txt").write_text("changed\n")
    res = subprocess.run(cmd[:-1] + [str(_call(there, tmp_path, "c2", None))], cwd=root, capture_output=True, text=True)
    assert res.returncode == 1 and "CONFLICT notes.txt" in res.stdout
    with pytest.raises(LabError, match="neither results.tgz nor results/"):
        merge.merge([tmp_path / "t" / "results" / "h100"], local)
    (tmp_path / "junk.tgz").write_text("not an archive")
    res = subprocess.run(cmd[:-1] + [str(tmp_path / "junk.tgz")], cwd=root, capture_output=True, text=True)
    assert res.returncode == 2 and res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1
