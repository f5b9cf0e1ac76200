"""Tidy result tables: one Parquet file per run, one row per trial, under results/<device>/<kernel>/.

Each finished trial rewrites the run's file atomically (write to a temp file, then rename), so a
killed sweep loses no finished trial. ``load(path)`` returns every run under ``path`` as one pandas
DataFrame. Units are in the column names: *_ms milliseconds, *_bytes bytes, tflops TFLOP/s,
gbs GB/s, pct_* percent of the device profile's ceiling.
"""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

# Phases of a row that says a lane ran nothing at a shape (with the reason): it cannot run there.
NOT_RUN_PHASES = ("eligibility", "space")

# Every row has these columns (config values are also flattened into cfg.<key> columns and shape
# dims into shape.<dim> columns).
COLUMNS = {
    "run_id": "str", "time_utc": "str", "git_commit": "str", "git_dirty": "bool",
    "kernel": "str", "dsl": "str", "baseline": "bool", "shape": "str", "shape_json": "str", "dtype": "str",
    "config_json": "str", "phase": "str", "trial": "int",
    "requested_profile": "str", "actual_gpu": "str", "actual_profile": "str",
    "preflight_target": "str", "compile_target": "str", "emulated": "bool", "compile_only": "bool",
    "status": "str", "error": "str",
    "smem_estimate_bytes": "float", "smem_compiled_bytes": "float", "smem_limit_bytes": "float",
    "smem_launched_bytes": "float", "registers": "float", "spills": "float",
    "parity_json": "str", "parity_rel_l2": "float", "parity_rel_max": "float",
    "tol_rel_l2": "float", "tol_rel_max": "float", "parity_shapes": "str",
    "time_ms": "float", "time_q1_ms": "float", "time_q3_ms": "float", "time_iqr_ms": "float",
    "time_ci_half_ms": "float", "samples": "float", "samples_ms": "object", "timing_stop": "str",
    "graph_ms": "float", "tflops": "float", "gbs": "float", "pct_peak_tflops": "float", "pct_peak_bw": "float",
    "compile_s": "float", "preflight_compile_s": "float",
    "sm_clock_start_mhz": "float", "sm_clock_end_mhz": "float", "clock_drift": "bool",
    "versions_json": "str", "seed": "int", "sampler": "str", "study": "str",
    "host": "str", "gpu_index": "float",  # the machine and GPU (index on it) that measured the row
    "precision": "str",  # the sweep file's [precision.NAME] table the run fixed ("" = the lane's defaults)
}


def git_state(root: Path | None = None) -> tuple[str, bool]:
    """(commit, dirty) of the project checkout; ("unknown", False) outside git.

    LAB_GIT_COMMIT / LAB_GIT_DIRTY, when set, win: the GPU machine gets a copy of the working tree
    whose .git (when it has one) can be an older snapshot than the files beside it (seen 2026-11-22:
    rows of commit 8e877f3's code recorded the stale a1ec5f3, dirty)."""
    root = root or Path(__file__).resolve().parent.parent
    if os.environ.get("LAB_GIT_COMMIT"):
        return os.environ["LAB_GIT_COMMIT"], os.environ.get("LAB_GIT_DIRTY", "0") == "1"
    fallback = ("unknown", False)
    try:
        p = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=root, capture_output=True,
                           text=True, timeout=10)
        commit = p.stdout.strip()
        if p.returncode != 0 or not re.fullmatch(r"[0-9a-f]{40}", commit):
            return fallback
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        return commit, dirty
    except Exception:
        return fallback


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


_ISSUED: set[str] = set()


def new_run_id(tag: str) -> str:
    """<UTC second>-<tag>-<pid>, with -2, -3, ... when this process already issued that id (gate --run
    starts several sweeps in one process: the same id would make the second overwrite the first's rows)."""
    base = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + f"-{tag}-{os.getpid()}"
    run_id, n = base, 1
    while run_id in _ISSUED:
        n += 1
        run_id = f"{base}-{n}"
    _ISSUED.add(run_id)
    return run_id


def flatten(row: dict) -> dict:
    cfg = json.loads(row.get("config_json") or "{}")
    shape = json.loads(row.get("shape_json") or "{}")
    flat = dict(row)
    flat.update({f"cfg.{k}": v for k, v in cfg.items()})
    flat.update({f"shape.{k}": v for k, v in shape.items() if k != "dtype"})
    return flat


def check_row(row: dict) -> None:
    missing = [c for c in COLUMNS if c not in row]
    if missing:
        raise ValueError(f"result row lacks {', '.join(missing)}")


class RunWriter:
    """Collects a run's rows and keeps ``<dir>/<run_id>.parquet`` current after every row."""

    def __init__(self, directory: Path, run_id: str):
        self.path = Path(directory) / f"{run_id}.parquet"
        self.rows: list[dict] = []

    def add(self, row: dict) -> None:
        check_row(row)
        self.rows.append(flatten(row))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".parquet.tmp")
        frame(self.rows).to_parquet(tmp, index=False)
        os.replace(tmp, self.path)


def frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    for col, kind in COLUMNS.items():
        if col not in df:
            df[col] = None
        if kind == "float":
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    # cfg.* columns can mix types across DSLs only in separate files; inside one file keep them as given.
    for col in df.columns:
        if col.startswith("cfg.") and df[col].map(type).nunique() > 1:
            df[col] = df[col].astype(str)
    return df


def load(path: str | os.PathLike = "results") -> pd.DataFrame:
    """Every run table under ``path`` (recursively) as one DataFrame; empty frame when none."""
    files = sorted(Path(path).rglob("*.parquet"))
    if not files:
        return frame([])
    # Read each file's bytes in one go: a sweep may be replacing it right now, and a reader that
    # opened it twice could see two versions.
    parts = [pd.read_parquet(io.BytesIO(f.read_bytes())).assign(source_file=str(f)) for f in files]
    return pd.concat(parts, ignore_index=True, sort=False)


def write_log(results_dir: str | os.PathLike, run_ids: list[str], name: str, text: str) -> Path | None:
    """Print ``text`` and keep it as <results_dir>/logs/<first run id>-<name>.md, beside the rows it
    describes (nothing written when no run wrote rows)."""
    print(text)
    if not run_ids:
        return None
    log = Path(results_dir) / "logs" / f"{run_ids[0]}-{name}.md"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(text + "\n")
    return log
