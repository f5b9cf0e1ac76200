"""``python -m lab gate --run``: refresh the stale entries on the GPU present and judge the change.

For each entry the gate finds stale, slower (an earlier A/B's SLOWER verdict at today's code: re-judged
against the same previous code), never measured, or fresh at shapes no A/B judged (``Entry.unjudged``:
re-measured by a plain sweep, or by a gate --run stopped before that shape's A/B) on this device (the
present profile, or a profile named with --device, emulated), each such shape in turn is re-swept (the
previous committed best config enqueued first, then a bounded number of new trials) and judged before the next one
(a run stopped part way keeps its finished shapes' verdicts): the previous best (its config run by
the code it was measured with: the lane's files at that row's git commit, copied by
``identity.materialize``) and the new best (the checkout) are timed interleaved, twice: once with
the previous lane first and once with the checkout's first (built, warmed up and listed first), each
half of the time budget, and each side's samples pooled over both (``ab_counterbalanced``). The ratio
new / previous of the pooled medians with its 95% interval gives FASTER / SAME / SLOWER. Exit 1 on
SLOWER or on any wrong result in the re-sweep.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab import gate, identity, preflight, registry, space, sweep
from lab.devices import LabError, PresentGPU, get_profile
from lab.timing import median_ci, sample_summary
from lab.worker import WorkerRunner

NOISE = 0.01  # a ratio whose whole interval lies within 1% of 1.0 is SAME even when the interval excludes 1.0


@dataclass
class Verdict:
    shape: str
    word: str  # FASTER / SAME / SLOWER / NEW (nothing to compare with)
    previous_ms: float | None = None
    new_ms: float | None = None
    ratio: tuple[float, float, float] | None = None  # (median ratio new / previous, 95% low, high)

    def line(self, e: gate.Entry) -> str:
        head = f"{e.kernel} {e.dsl} {e.device} {self.shape}"
        if self.ratio is None:
            return f"{head}: {self.word} (new best {self.new_ms:.4f} ms; no previous ok row to compare with)" \
                if self.new_ms else f"{head}: {self.word}"
        r, lo, hi = self.ratio
        return (f"{head}: previous {self.previous_ms:.4f} ms -> new {self.new_ms:.4f} ms, ratio {r:.3f} "
                f"(95% CI {lo:.3f}-{hi:.3f}): {self.word}")


# Time budget of each of the two A/B halves (ms, samples): together what one A/B run had.
AB_TIMING = {"budget_ms": 3000.0, "min_time_ms": 250.0, "min_samples": 25}


def ab_counterbalanced(runner, task: dict, timeout_s: float) -> dict:
    """``task`` (kind abab, lanes [previous, checkout]) run twice, the second time with the lanes in the
    other order, and each lane's samples pooled: [previous samples, checkout samples]. A lane's place in
    the task (which is built, allocated and warmed up first, and is index 0 of the interleaving) then
    weighs on both sides alike (in one order, unchanged kernel code was judged SLOWER than itself; the
    runs are named in README.md, "gate --run")."""
    halves = []
    for lanes in (task["lanes"], task["lanes"][::-1]):
        result = runner.run({**task, "lanes": lanes, "timing": AB_TIMING}, timeout_s)
        if result.get("status") != "ok":
            return result
        halves.append(result)
    first, swapped = halves
    return {"status": "ok", "stop": f"{first.get('stop', '')}+{swapped.get('stop', '')}",
            "samples": [first["samples"][0] + swapped["samples"][1], first["samples"][1] + swapped["samples"][0]]}


def judge(previous: list[float], new: list[float]) -> tuple[str, tuple[float, float, float]]:
    """FASTER / SAME / SLOWER from two interleaved sample lists (ms), by the interval of the ratio of
    medians (bounds from each median's 95% interval)."""
    pm, plo, phi = median_ci(previous)
    nm, nlo, nhi = median_ci(new)
    ratio = (nm / pm, nlo / phi, nhi / plo)
    if ratio[1] > 1 + NOISE:
        return "SLOWER", ratio
    if ratio[2] < 1 - NOISE:
        return "FASTER", ratio
    return "SAME", ratio


def _previous_best(rows: pd.DataFrame) -> dict[str, pd.Series]:
    """Per shape, the fastest committed ok row of any measuring phase: a later sweep that found a
    faster config without a confirm run still sets the bar (a confirm-only pool would fall back on an
    older, slower config)."""
    return {shape: g.sort_values(["time_ms", "time_utc"]).iloc[0] for shape, g in rows.groupby("shape")}


def _reseeds(rows: pd.DataFrame, listed) -> list[dict]:
    """Configs the re-sweep of one shape measures first: the previous best's (``rows``: that shape's
    committed ok rows), and, when today's sweep file no longer lists one of its values (a value the lane
    retired: the CuTe DSL GEMM's PATH "auto"), also the fastest committed config it does list, so that
    --trials 0 still times today's code there. ``listed(config)``: whether the file lists its values."""
    configs = [json.loads(c) for c in rows.sort_values(["time_ms", "time_utc"])["config_json"]]
    fallback = next((c for c in configs if listed(c)), None)
    return configs[:1] + ([fallback] if fallback is not None and not listed(configs[0]) else [])


def _previous_lane(e: gate.Entry, row: pd.Series, work: Path) -> tuple[str, dict]:
    """(DSL name to run the previous best under, its versions). The checkout's lane when the row was
    measured with today's code, else a copy of the lane at the row's commit."""
    lane = registry.get(e.dsl, e.kernel)
    versions = json.loads(row["versions_json"] or "{}")
    measured = gate.measured_identity(lane.module_name, versions, str(row["git_commit"]), bool(row["git_dirty"]))
    if measured is not None and not gate.code_changes(measured, identity.lane_identity(lane.module_name)):
        return e.dsl, versions
    if measured is None or not row["git_commit"] or bool(row["git_dirty"]):
        raise RuntimeError(f"the previous best at {row['shape']} was measured with code this repository cannot "
                           f"rebuild (commit {row['git_commit']!r}, dirty {bool(row['git_dirty'])})")
    pkg, dsl = identity.materialize(lane.module_name, str(row["git_commit"]), work)
    if str(work) not in sys.path:
        sys.path.insert(0, str(work))
    packages = [p for p in os.environ.get("LAB_KERNEL_PACKAGES", "").split(",") if p]
    os.environ["LAB_KERNEL_PACKAGES"] = ",".join(dict.fromkeys(packages + [pkg]))
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([str(work), *sys.path]))
    return dsl, versions


def refresh(df: pd.DataFrame, present: PresentGPU | None, *, devices: list[str] | None = None,
            kernels: list[str] | None = None, dsls: list[str] | None = None, shapes: list[str] | None = None,
            trials: int = 8, results_dir: Path = Path("results"), timeout_s: float = 300.0, runner=None,
            out=print) -> int:
    """Re-sweeps and A/B-judges every stale entry runnable here; returns the exit status (0 / 1).
    ``shapes``: re-check exactly these shapes of the selected entries, fresh ones included."""
    here = present.profile if present else None
    entries, known = [], set()
    for e in gate.evaluate(df, devices=devices, kernels=kernels, dsls=dsls):
        if shapes:
            named = space.load_shapes(e.kernel)[0]
            known |= set(named)
            e.stale_shapes = [s for s in shapes if s in named]
        elif e.status == "fresh" and e.unjudged:
            # Fresh shapes whose change no A/B judged (a plain sweep measured it, or a gate --run stopped
            # between a shape's re-sweep and its A/B): judged here like stale ones.
            e.stale_shapes = list(e.unjudged)
        # Reference lanes are refreshed only when named with --dsl (they are slow and never required).
        if (e.stale_shapes if shapes else e.status != "fresh" or e.unjudged) \
                and (e.device == here or (devices and e.device in devices)) \
                and (not e.reference or (dsls and e.dsl in dsls)):
            entries.append(e)
    unknown = [s for s in shapes or [] if s not in known]
    if unknown:
        raise LabError(f"unknown shape {unknown[0]!r} for the selected kernels (see sweeps/<kernel>/shapes.toml)")
    if not entries:
        out(f"gate --run: nothing stale or unjudged to refresh on {', '.join(devices or []) or here or 'this machine'}")
        return 0
    ok = gate.ok_rows(df)
    failed = False
    work = Path(tempfile.mkdtemp(prefix="lab-gate-"))
    for e in entries:
        rows = ok[(ok["kernel"] == e.kernel) & (ok["dsl"] == e.dsl) & (ok["requested_profile"] == e.device)] \
            if not ok.empty else ok
        today_mask = gate.Freshness().mask(rows)
        today = rows[today_mask]
        if e.status == "slower" and not rows.empty:
            # The bar stays the code the SLOWER verdict compared with, not today's rows of the re-checked lane.
            rows = rows[~today_mask]
        target = get_profile(e.device).target
        misfits = gate.emulated_misfits(rows, registry.get(e.dsl, e.kernel), target)
        for shape, g in rows.loc[list(misfits)].groupby("shape"):
            out(f"{e.kernel} {e.dsl} {e.device} {shape}: {len(g)} emulated row(s) no bar, the lane refuses their "
                f"config for {target}: {misfits[g.index[0]]}")
        rows = rows.drop(index=list(misfits))
        prev = _previous_best(rows) if not rows.empty else {}
        todo = e.stale_shapes or space.load_shapes(e.kernel)[1]
        lane = registry.get(e.dsl, e.kernel)
        sp = space.load_space(e.kernel, e.dsl, tuple(lane.module.TUNABLES))

        def listed(cfg: dict) -> bool:
            return not sp.unlisted(lane.full_config({k: v for k, v in cfg.items() if k in lane.module.TUNABLES}))

        why = "fresh, no A/B of this code" if e.status == "fresh" else e.status
        out(f"gate --run: {e.kernel} {e.dsl} {e.device}: {why}; re-sweeping {', '.join(todo)}")
        ab_runner = runner
        # One shape at a time, each judged before the next is swept: a run stopped part way (a call's time
        # limit) keeps the verdicts of the shapes it finished, and the next gate --run starts from the rest.
        for shape in todo:
            req = sweep.SweepRequest(
                kernel=e.kernel, device=e.device, dsls=[e.dsl], shapes=[shape], trials=trials, new_trials=True,
                timeout_s=timeout_s,
                emulate=e.device != here, results_dir=results_dir, baseline=False, confirm=False, progress=False,
                seeds={(e.dsl, shape): _reseeds(rows[rows["shape"] == shape], listed)} if shape in prev else {})
            sw, _ = sweep.run(req, present, runner=runner, out=out)
            new_rows = pd.DataFrame(sw.writer.rows)
            wrong = new_rows[new_rows["status"] == "wrong_result"] if not new_rows.empty else new_rows
            for _, w in wrong.iterrows():
                failed = True
                was = " (the previous best)" if shape in prev and \
                    json.loads(w["config_json"]) == json.loads(prev[shape]["config_json"]) else ""
                out(f"PARITY FAIL {e.kernel} {e.dsl} {e.device} {shape}{was}: {w['config_json']}: {str(w['error'])[:200]}")
            good = new_rows[(new_rows["status"] == "ok")] if not new_rows.empty else new_rows
            # Today's code at this shape: its fastest row, of this re-sweep or committed before (a re-check
            # of a slower entry re-measures only the seeds; its study's best may be an earlier trial).
            mine = pd.concat([f[f["shape"] == shape] for f in (good, today) if not f.empty])
            if mine.empty:
                why = " (no previous best at this shape, and --trials 0 asks for no new config)" \
                    if shape not in prev and trials == 0 else ""
                out(f"{e.kernel} {e.dsl} {e.device} {shape}: no ok config in the re-sweep{why}")
                failed = True
                continue
            best = mine.sort_values("time_ms").iloc[0]
            if shape not in prev:
                out(Verdict(shape, "NEW", new_ms=float(best["time_ms"])).line(e))
                continue
            try:
                prev_dsl, prev_versions = _previous_lane(e, prev[shape], work)
            except (RuntimeError, FileNotFoundError) as exc:
                out(f"{e.kernel} {e.dsl} {e.device} {shape}: no A/B: {exc}")
                failed = True
                continue
            # A worker imports the previous lanes' packages at start: one materialized after it started
            # (another commit's code, at a later shape) needs a fresh worker.
            env = {k: os.environ[k] for k in ("LAB_KERNEL_PACKAGES", "PYTHONPATH") if k in os.environ}
            if runner is None and (ab_runner is None or ab_runner.env != env):
                if ab_runner is not None:
                    ab_runner.close()
                ab_runner = WorkerRunner("cuda", env=env)
            cache = preflight.lane_cache_env(lane, sw.mode.run_target)
            task = {"kind": "abab", "kernel": e.kernel, "shape": dict(sw.shapes_all[shape]), "seed": 7,
                    "l2_bytes": sw.l2_bytes, "lanes": [(prev_dsl, json.loads(prev[shape]["config_json"]), cache),
                                                       (e.dsl, json.loads(best["config_json"]), cache)]}
            result = ab_counterbalanced(ab_runner, task, timeout_s * 2)
            if result.get("status") != "ok":
                out(f"{e.kernel} {e.dsl} {e.device} {shape}: A/B failed: {result.get('status')}: "
                    f"{str(result.get('error', ''))[:200]}")
                failed = True
                continue
            word, ratio = judge(result["samples"][0], result["samples"][1])
            for phase, cfg, samples, versions in (
                    ("gate_previous", prev[shape]["config_json"], result["samples"][0], prev_versions),
                    ("gate_checkout", best["config_json"], result["samples"][1], json.loads(best["versions_json"]))):
                res = sample_summary(samples, f"abab-{result.get('stop', '')}")
                study = f"gate {word}" + (f" previous@{prev[shape]['git_commit']}" if phase == "gate_previous" else "")
                sw.writer.add(sw._row(lane, shape, dict(sw.shapes_all[shape]), json.loads(cfg), -1, "ok", None, res,
                                      versions=versions, phase=phase, study=study))
            v = Verdict(shape, word, float(median_ci(result["samples"][0])[0]),
                        float(median_ci(result["samples"][1])[0]), ratio)
            out(v.line(e))
            failed = failed or word == "SLOWER"
        if ab_runner is not None and ab_runner is not runner and hasattr(ab_runner, "close"):
            ab_runner.close()
    out(f"gate --run: {'FAIL' if failed else 'pass'}")
    return 1 if failed else 0
