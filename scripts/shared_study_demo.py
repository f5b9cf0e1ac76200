"""One worker against several on one GPU, each on a fresh study in a PostgreSQL database (issue 25).

    python scripts/shared_study_demo.py --storage postgresql://postgres@/postgres?host=/tmp/labpg.X \
        [--workers 2] [--kernel gemm --dsl triton --shape sq4096_bf16] [--device h100]

A small grid (``--space``: a sweep file whose [params] replace the lane's, default
scripts/demo_grids/<dsl>_<kernel>.toml: Triton's, compiles of a second, or TileLang's, compiles of ~4 s)
is swept to exhaustion twice: by one `python -m lab sweep` process on database <db>_one, then by
``--workers`` processes started together on database <db>_two (both created here), each run with empty
compile caches (lab.study.fresh_cache_env), so that a warm cache does not hide what compiling costs.
Exhausting a grid makes the two outcomes comparable: the same configs must be measured, each once, with
the same statuses, and the fastest config should agree unless two configs lie within timing noise (both
workers time on the one GPU at once, so the several-worker run's times carry that contention; its rows say
so by their run ids).
Prints (and writes to <results>/logs/<first run id>-shared-study.md) per config its status in each run
and its median (ms), then the wall time of each run, configs measured twice and the best of each.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab import analysis, results, study  # noqa: E402



def compare(one: pd.DataFrame, many: pd.DataFrame) -> dict:
    """The outcome of the two runs' sweep rows: configs measured by one and not the other, configs the
    several-worker run measured more than once, status disagreements, and each run's fastest ok config."""
    a, b = set(one["config_json"]), set(many["config_json"])
    status_a = one.drop_duplicates("config_json").set_index("config_json")["status"]
    status_b = many.drop_duplicates("config_json").set_index("config_json")["status"]
    both = sorted(a & b)
    return {"only_one": sorted(a - b), "only_many": sorted(b - a),
            "twice": analysis.measured_twice(many) + analysis.measured_twice(one),
            "status_differs": [c for c in both if status_a[c] != status_b[c]],
            "best_one": analysis.run_best(one)[0], "best_many": analysis.run_best(many)[0]}


def _sweep(args, storage: str, out: Path, env: dict, n: int, home: Path) -> float:
    """Wall time (s) of ``n`` sweep processes on ``storage``, started together with empty compile caches
    under ``home`` (shared by them, as by workers of one machine), so that both runs compile everything."""
    env = study.fresh_cache_env(home, env)
    cmd = [sys.executable, "-m", "lab", "sweep", args.kernel, "--device", args.device, "--dsl", args.dsl,
           "--shape", args.shape, "--sampler", "grid", "--trials", "1000", "--storage", storage,
           "--no-baseline", "--no-confirm", "--no-progress", "--results", str(out)]
    t0 = time.time()
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env) for _ in range(n)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a sweep process exited with {codes}")
    return time.time() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--storage", required=True, help="postgresql:// URL of a server (its database is left alone)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kernel", default="gemm")
    ap.add_argument("--dsl", default="triton")
    ap.add_argument("--shape", default="sq4096_bf16")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--space", help="sweep file whose [params] / [restrictions] replace the lane's "
                    "(default: scripts/demo_grids/<dsl>_<kernel>.toml)")
    ap.add_argument("--results", default="results")
    args = ap.parse_args(argv)
    out = Path(args.results)
    before = set(results.load(out)["run_id"]) if out.exists() else set()
    with tempfile.TemporaryDirectory() as tmp:
        sweeps = Path(tmp) / "sweeps"
        shutil.copytree(ROOT / "sweeps", sweeps)
        space = Path(args.space) if args.space else ROOT / "scripts" / "demo_grids" / f"{args.dsl}_{args.kernel}.toml"
        (sweeps / args.kernel / f"{args.dsl}.toml").write_text(space.read_text())
        env = {**os.environ, "LAB_SWEEPS_DIR": str(sweeps),
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        db = "labdemo"
        wall_one = _sweep(args, study.create_database(args.storage, f"{db}_one"), out, env, 1, Path(tmp) / "one")
        mid = set(results.load(out)["run_id"])
        wall_many = _sweep(args, study.create_database(args.storage, f"{db}_two"), out, env, args.workers,
                           Path(tmp) / "many")
    df = results.load(out)
    df = df[(df["kernel"] == args.kernel) & (df["dsl"] == args.dsl) & (df["phase"] == "sweep")]
    one = df[df["run_id"].isin(mid - before)]
    many = df[~df["run_id"].isin(mid)]
    res = compare(one, many)
    keys = sorted(set(one["config_json"]) | set(many["config_json"]))
    run_ids = sorted(set(one["run_id"])) + sorted(set(many["run_id"]))

    def cell(d, k):
        r = d[d["config_json"] == k]
        if r.empty:
            return "-"
        r = r.iloc[0]
        return f"{r['status']} {r['time_ms']:.4f}" if r["status"] == "ok" else str(r["status"])
    lines = [f"# Shared study on PostgreSQL: 1 worker vs {args.workers} on one GPU ({args.kernel} {args.dsl} "
             f"{args.shape}, {args.device}), runs {', '.join(run_ids)}", "",
             f"| config | 1 worker (status, ms) | {args.workers} workers (status, ms) | runs that measured it (id tail) |",
             "|---|---|---|---|"]
    configs = [json.loads(k) for k in keys]
    varying = [n for n in configs[0] if len({json.dumps(c.get(n)) for c in configs}) > 1] if configs else []
    for k in keys:
        who = ", ".join(sorted(many[many["config_json"] == k]["run_id"].str[-6:]))
        cfg = {n: v for n, v in json.loads(k).items() if n in varying}
        lines.append(f"| {json.dumps(cfg)} | {cell(one, k)} | {cell(many, k)} | {who} |")
    lines += ["", f"- wall time: 1 worker {wall_one:.1f} s, {args.workers} workers {wall_many:.1f} s",
              f"- configs: {one['config_json'].nunique()} (1 worker) / {many['config_json'].nunique()} "
              f"({args.workers} workers); only in one run: {len(res['only_one']) + len(res['only_many'])}; "
              f"measured twice: {res['twice']}; status differs: {len(res['status_differs'])}",
              f"- fastest: 1 worker {res['best_one']}; {args.workers} workers {res['best_many']} "
              f"({'same' if res['best_one'] == res['best_many'] else 'different'})"]
    results.write_log(out, run_ids, "shared-study", "\n".join(lines))
    same = not (res["only_one"] or res["only_many"] or res["twice"] or res["status_differs"])
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
