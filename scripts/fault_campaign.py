"""The GPU fault campaign (issue 25): a sweep of the fault lane (tests/fault_lanes/faults/gemm.py) whose
configs make an illegal memory access, hang, write NaN, exhaust GPU memory, fail to compile and SIGKILL
their own worker, with the sweep process itself killed (SIGKILL) after KILL_AFTER rows and restarted.

    python scripts/fault_campaign.py --results results [--device h100] [--kill-after 5] [--timeout 30]

Writes the sweep's rows under <results>/<device>/gemm/ as any sweep does, and prints (and writes to
<results>/logs/<first run id>-fault-campaign.md) a table: per trial its fault, status, reason and the
wall time the sweep spent on it (since the previous row: worker restarts included), then the totals:
rows per status, trials lost to the kill (finished before it, absent after: must be 0), configs
measured twice, and the restart's recovery time (restart to its first row).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import results  # noqa: E402

SHAPE = "fault_small"
SHAPE_TOML = f'\n[shapes.{SHAPE}]\nM = 256\nN = 256\nK = 256\ndtype = "float16"\n'


def _env(sweeps: Path) -> dict:
    return {**os.environ, "LAB_SWEEPS_DIR": str(sweeps), "LAB_KERNEL_PACKAGES": "tests.fault_lanes",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _rows(out: Path, since: set[str]) -> pd.DataFrame:
    df = results.load(out)
    if df.empty:
        return df
    df = df[(df["dsl"] == "faults")]
    return df[~df["run_id"].isin(since)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--kill-after", type=int, default=5, help="rows before the sweep process is killed")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per candidate (the hang's cost)")
    args = ap.parse_args(argv)
    out = Path(args.results)
    before = set(_rows(out, set())["run_id"]) if (out / args.device / "gemm").exists() else set()
    with tempfile.TemporaryDirectory() as tmp:
        sweeps = Path(tmp) / "sweeps"
        shutil.copytree(ROOT / "sweeps", sweeps)
        shutil.copy(ROOT / "tests" / "fault_lanes" / "faults.toml", sweeps / "gemm" / "faults.toml")
        with open(sweeps / "gemm" / "shapes.toml", "a") as f:
            f.write(SHAPE_TOML)
        cmd = [sys.executable, "-m", "lab", "sweep", "gemm", "--device", args.device, "--dsl", "faults",
               "--shape", SHAPE, "--sampler", "grid", "--trials", "100", "--timeout", str(args.timeout),
               "--no-baseline", "--no-confirm", "--no-progress", "--results", str(out)]
        t_start = time.time()
        # Its own process group: the SIGKILL below hits the sweep process alone (its workers are orphaned,
        # as when that process dies), and the group is reaped after it so that no orphan keeps the GPU
        # or the caller's output open.
        first = subprocess.Popen(cmd, cwd=ROOT, env=_env(sweeps), start_new_session=True)
        while first.poll() is None and len(_rows(out, before)) < args.kill_after:
            time.sleep(0.5)
        killed_at = time.time()
        finished_before = set(_rows(out, before)["config_json"])
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
        first.wait()
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        restart = time.time()
        second = subprocess.run(cmd, cwd=ROOT, env=_env(sweeps))
        t_end = time.time()
    df = _rows(out, before).sort_values("time_utc")
    df["t"] = pd.to_datetime(df["time_utc"])
    df["wall_s"] = df.groupby("run_id")["t"].diff().dt.total_seconds()
    run_ids = list(dict.fromkeys(df["run_id"]))
    lines = [f"# Fault campaign: {args.device}, runs {', '.join(run_ids)}", "",
             "| run | fault | BLOCK | status | wall s | reason |", "|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        c = json.loads(r["config_json"])
        wall = "-" if pd.isna(r["wall_s"]) else f"{r['wall_s']:.1f}"
        lines.append(f"| {run_ids.index(r['run_id']) + 1} | {c['FAULT']} | {c['BLOCK']} | {r['status']} | {wall} | "
                     f"{' '.join(str(r['error'] or '').split())[:110].replace('|', '/')} |")
    after = set(df["config_json"])
    second_rows = df[df["run_id"] != (run_ids[0] if run_ids else "")]
    recovery = (second_rows["t"].min().timestamp() - restart) if not second_rows.empty else float("nan")
    counts = df["status"].value_counts().to_dict()
    lines += ["", f"- faults injected: {sum(json.loads(c)['FAULT'] != 'none' for c in df['config_json'])} trials "
                  f"of {df['config_json'].nunique()} configs; rows per status: {counts}",
              f"- sweep killed (SIGKILL) after {len(finished_before)} rows, {killed_at - t_start:.1f} s in; "
              f"restarted; first row of the restart after {recovery:.1f} s; restart exit code {second.returncode}",
              f"- trials lost: {len(finished_before - after)}; configs measured twice: "
              f"{int(df['config_json'].duplicated().sum())}; total wall time {t_end - t_start:.1f} s"]
    results.write_log(out, run_ids, "fault-campaign", "\n".join(lines))
    return 0 if not (finished_before - after) and second.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
