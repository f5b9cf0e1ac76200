"""Every GPU of the host against one GPU, on the same study size (issue 27).

    python scripts/multi_gpu_study.py --kernel gemm --device h200 --trials 2 [--results results] [-- SWEEP ARGS]

Runs ``python -m lab sweep KERNEL --device D --dsl all --trials T --gpus all`` (one worker per GPU on one
study), then the same sweep with ``--gpus 0``, each on a fresh SQLite study in a temporary folder and with
empty compile caches (lab.study.fresh_cache_env: a fresh folder per run), so that neither run reuses the
other's trials or compiles. nvidia-smi samples every GPU's utilisation (%) every 0.5 s during each run.
Prints, and writes to <results>/logs/<first run id>-multi-gpu.md: each run's wall time (s); per GPU its
mean utilisation, the share of samples above 0 % and the rows it measured; configs measured twice; and per
(DSL, shape) each run's best config and median (ms, A/B-confirmed where the run confirmed), compared by
lab.analysis.compare_runs. Exit status 1 when a config was measured twice or a sweep failed.
``--from-runs ALL_IDS ONE_IDS`` writes the same comparison for runs already under <results> (a call
that ran them apart), their wall times from the rows' stamps.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import analysis, results, study  # noqa: E402

SAMPLE = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
          "-lms", "500"]


def utilisation(text: str) -> pd.DataFrame:
    """Per GPU index: samples, mean utilisation (%), share of samples above 0 %, peak memory used (MiB),
    from nvidia-smi's csv lines (index, utilization.gpu, memory.used)."""
    recs = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(p.isdigit() for p in parts):
            recs.append({"gpu": int(parts[0]), "util": int(parts[1]), "mem": int(parts[2])})
    if not recs:
        return pd.DataFrame(columns=["gpu", "samples", "mean_util", "busy_share", "peak_mem_mib"])
    d = pd.DataFrame(recs)
    g = d.groupby("gpu")
    return pd.DataFrame({"samples": g.size(), "mean_util": g["util"].mean(),
                         "busy_share": g["util"].apply(lambda u: (u > 0).mean()),
                         "peak_mem_mib": g["mem"].max()}).reset_index()


def run_sweep(args, gpus: str, work: Path) -> tuple[float, str, int]:
    """One sweep on a fresh study and fresh caches under ``work``; (wall s, nvidia-smi samples, exit)."""
    home = work / "home"
    home.mkdir(parents=True)
    env = {**study.fresh_cache_env(home), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "lab", "sweep", args.kernel, "--device", args.device, "--dsl", args.dsl,
           "--trials", str(args.trials), "--gpus", gpus, "--storage", f"sqlite:///{work / 'study.db'}",
           "--results", args.results, "--no-progress", *args.sweep_args]
    print("$", " ".join(cmd), flush=True)
    with open(work / "smi.csv", "w") as smi_out:
        smi = subprocess.Popen(SAMPLE, stdout=smi_out, stderr=subprocess.DEVNULL)
        t0 = time.time()
        sweep = subprocess.Popen(cmd, cwd=ROOT, env=env)
        try:
            code = sweep.wait()
        except KeyboardInterrupt:  # a call's time limit (SIGINT): keep what finished, report it
            print(f"interrupted after {time.time() - t0:.0f} s: the report covers the rows written so far")
            try:
                code = sweep.wait(timeout=15)  # the sweep got the signal too and writes its rows
            except (subprocess.TimeoutExpired, KeyboardInterrupt):
                sweep.kill()
                code = sweep.wait()
            code = code or 130
        wall = time.time() - t0
        smi.terminate()
        smi.wait()
    return wall, (work / "smi.csv").read_text(), code


def row_wall(rows: pd.DataFrame) -> float:
    """Seconds from the earliest run id's start (its UTC stamp) to the last row the runs wrote."""
    start = pd.to_datetime(rows["run_id"].str[:16], format="%Y%m%dT%H%M%SZ", utc=True).min()
    return (pd.to_datetime(rows["time_utc"], utc=True).max() - start).total_seconds()


def report(args, runs: dict, out: Path) -> int:
    """The comparison of the "all" and "one" runs (see the module docstring); the exit status."""
    df = results.load(out)
    rows = {n: df[df["run_id"].isin(r["ids"])] for n, r in runs.items()}
    cmp = analysis.compare_runs(rows["one"], rows["all"])
    ids = runs["all"]["ids"] + runs["one"]["ids"]
    lines = [f"# {args.kernel} on every GPU vs one GPU ({args.device}, --dsl {args.dsl}, --trials {args.trials} "
             f"{' '.join(args.sweep_args)}), runs {', '.join(ids)}", ""]
    for n, r in runs.items():
        measured = rows[n][rows[n]["phase"] == "sweep"]
        per_gpu = measured.groupby(measured["gpu_index"].fillna(-1).astype(int)).size().to_dict()
        lines.append(f"- --gpus {'all' if n == 'all' else '0'}: wall {r['wall']:.1f} s ({r['wall_source']}), "
                     f"exit {r['code']}, sweep rows {len(measured)} (per GPU index: {per_gpu}), actual GPU "
                     f"{sorted(rows[n]['actual_gpu'].dropna().unique())}")
        if r["smi"] is None:
            lines.append("  - no nvidia-smi samples")
            continue
        for u in r["smi"].itertuples():
            lines.append(f"  - GPU {u.gpu}: {u.samples} samples, mean utilisation {u.mean_util:.1f} %, "
                         f"busy (> 0 %) in {100 * u.busy_share:.0f} % of samples, peak memory {u.peak_mem_mib} MiB")
    done = all(r["code"] != 130 for r in runs.values())
    speed = runs["one"]["wall"] / runs["all"]["wall"] if done and runs["all"]["wall"] else float("nan")
    lines += [f"- wall time one GPU / all GPUs: {speed:.2f}x", "",
              "| dsl | shape | configs (one / all) | twice | best ms one GPU | best ms all GPUs | all / one | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None or pd.isna(v) else f"{v:.4f}"  # noqa: E731
    for c in cmp.itertuples():
        lines.append(f"| {c.dsl} | {c.shape} | {c.configs_a} / {c.configs_b} | {c.twice} | {fmt(c.ms_a)} | "
                     f"{fmt(c.ms_b)} | {fmt(c.ratio)} | {c.verdict} |")
    for c in cmp[cmp["verdict"] == "differs"].itertuples():
        lines.append(f"- {c.dsl} {c.shape}: one GPU {json.loads(c.config_a or 'null')}, "
                     f"all GPUs {json.loads(c.config_b or 'null')}")
    results.write_log(out, ids, "multi-gpu", "\n".join(lines))
    return 1 if int(cmp["twice"].sum()) or any(r["code"] for r in runs.values()) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", required=True)
    ap.add_argument("--device", default="h200")
    ap.add_argument("--dsl", default="all")
    ap.add_argument("--trials", type=int, default=2, help="measured configs per DSL and shape, both runs")
    ap.add_argument("--results", default="results")
    ap.add_argument("--from-runs", nargs=2, metavar=("ALL_IDS", "ONE_IDS"),
                    help="no sweep: compare committed runs (comma lists of run ids), walls from their rows")
    ap.add_argument("--smi", nargs=2, metavar=("ALL_CSV", "ONE_CSV"), help="with --from-runs: nvidia-smi samples "
                    "(index, utilization.gpu, memory.used) of each run, '-' for none")
    ap.add_argument("sweep_args", nargs="*", help="more sweep arguments for both runs (after --)")
    args = ap.parse_args(argv)
    out = Path(args.results)
    if args.from_runs:
        df = results.load(out)
        runs = {}
        for i, (name, spec) in enumerate(zip(("all", "one"), args.from_runs)):
            ids = spec.split(",")
            csv = args.smi[i] if args.smi and args.smi[i] != "-" else None
            runs[name] = {"ids": ids, "code": 0, "wall": row_wall(df[df["run_id"].isin(ids)]),
                          "wall_source": "first run id to last row", "smi": utilisation(Path(csv).read_text())
                          if csv else None}
        return report(args, runs, out)
    seen = set(results.load(out)["run_id"]) if out.exists() else set()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, gpus in (("all", "all"), ("one", "0")):
            wall, smi, code = run_sweep(args, gpus, Path(tmp) / name)
            now = set(results.load(out)["run_id"])
            runs[name] = {"wall": wall, "wall_source": "sweep process" + (", interrupted" if code == 130 else ""),
                          "smi": utilisation(smi), "code": code, "ids": sorted(now - seen)}
            seen = now
            if code == 130:
                break
    runs.setdefault("one", {"wall": 0.0, "wall_source": "not run", "smi": None, "code": 130, "ids": []})
    return report(args, runs, out)


if __name__ == "__main__":
    raise SystemExit(main())
