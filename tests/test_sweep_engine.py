"""The sweep engine: statuses, preflight before compile, duplicates, resume after a kill."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import compiled_configs

FAST_TIMING = {"budget_ms": 30.0, "warmup_ms": 1.0, "min_samples": 3, "max_samples": 20}
H100 = ("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 << 20, "h100")


def present_h100():
    from lab.devices import PresentGPU
    return PresentGPU(*H100)


class SimRunner:
    """Stands in for the worker process: outcomes follow the sim lane's MODE, no process, no GPU."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.seen: list[dict] = []

    def run(self, task, timeout_s):
        time.sleep(self.delay_s)
        if task.get("kind") == "abab":
            return {"status": "ok", "samples": [[1.0, 1.1, 0.9] for _ in task["lanes"]]}
        cfg = task["config"]
        self.seen.append(cfg)
        mode = cfg.get("MODE", "ok")
        if mode in ("ok", "slow"):
            t = (1.0 if mode == "ok" else 2.0) * cfg.get("SPEED", 1) + cfg.get("SMEM_KB", 0) / 1000
            return {"status": "ok", "time_ms": t, "time_q1_ms": t * 0.99, "time_q3_ms": t * 1.01,
                    "time_iqr_ms": t * 0.02, "samples": 10, "samples_ms": [t] * 10, "parity": {},
                    "parity_rel_l2": 0.0, "parity_rel_max": 0.0, "tol_rel_l2": 1e-3, "tol_rel_max": 1e-3}
        status = {"runtime_error": "runtime_error", "wrong": "wrong_result", "unwritten": "wrong_result"}[mode]
        return {"status": status, "error": f"simulated {mode}"}

    def close(self):
        pass


def _request(env, **kw):
    from lab.sweep import SweepRequest
    base = dict(kernel="gemm", device="h100", dsls=["sim"], shapes=["tiny"], trials=100, results_dir=env.results,
                sampler="grid", baseline=False, confirm=False, progress=False, prefetch=0, timing=FAST_TIMING,
                timeout_s=20.0)
    base.update(kw)
    return SweepRequest(**base)


def test_every_status_recorded_and_infeasible_never_compiled(lab_env):
    """Real worker process on the CPU: parity catches wrong and unwritten outputs; rules and the SMEM
    estimate reject configs without a compile; the AOT compile rejects compile errors."""
    from lab import sweep
    from lab.results import load
    from lab.worker import WorkerRunner

    req = _request(lab_env, device="gb10", emulate=True)  # 99 KiB envelope: SMEM_KB=200 is infeasible
    sw, summary = sweep.run(req, present_h100(), runner=WorkerRunner("cpu"), out=lambda *_: None)
    df = load(lab_env.results)
    sw_rows = df[df["phase"] == "sweep"]
    statuses = set(sw_rows["status"])
    assert {"ok", "infeasible", "compile_error", "runtime_error", "wrong_result"} <= statuses
    # Every config of the grid got exactly one row; none was measured twice.
    assert sw_rows["config_json"].is_unique
    assert len(sw_rows) == 7 * 3 * 2
    # Wrong and unwritten outputs are caught by parity, not trusted.
    cfg_mode = sw_rows["config_json"].map(lambda c: json.loads(c)["MODE"])
    feasible = sw_rows["config_json"].map(lambda c: json.loads(c)["SMEM_KB"] < 99)
    assert set(sw_rows[(cfg_mode == "wrong") & feasible]["status"]) == {"wrong_result"}
    assert set(sw_rows[(cfg_mode == "unwritten") & feasible]["status"]) == {"wrong_result"}
    assert "nonfinite=" in sw_rows[(cfg_mode == "unwritten") & feasible]["error"].iloc[0]
    # Infeasible configs carry their reason and were never compiled.
    inf = sw_rows[sw_rows["status"] == "infeasible"]
    assert inf["error"].str.len().min() > 0
    compiled = compiled_configs(lab_env)
    assert compiled, "feasible configs go through the AOT compile"
    assert all(c["MODE"] != "refused" and c["SMEM_KB"] < 99 for c in compiled)
    assert set(inf["config_json"].map(lambda c: json.loads(c)["SMEM_KB"])) == {16, 64, 200}  # refused + 200
    # Rows say what ran.
    assert sw_rows["emulated"].all() and set(sw_rows["requested_profile"]) == {"gb10"}
    assert set(sw_rows["actual_gpu"]) == {H100[0]}
    assert set(sw_rows["preflight_target"]) == {"sm_121a"} and set(sw_rows["compile_target"]) == {"sm_90a"}
    ok = sw_rows[sw_rows["status"] == "ok"]
    assert (ok["parity_rel_l2"] <= ok["tol_rel_l2"]).all() and ok["time_ms"].gt(0).all()


def test_compiler_over_limit_rejected_even_when_estimate_fits(lab_env):
    from lab import preflight, registry
    from lab.devices import get_profile
    lane = registry.get("sim", "gemm")
    shape = {"M": 24, "N": 16, "K": 40, "dtype": "float32"}
    cfg = lane.full_config({"SMEM_KB": 120, "ESTIMATE_BIAS_KB": -60})
    v = preflight.check(lane, None, cfg, shape, get_profile("gb10"))
    assert not v.feasible and v.stage == "compile" and v.smem_compiled == 120 * 1024
    assert "compiled shared memory" in v.reason
    assert preflight.check(lane, None, cfg, shape, get_profile("h100")).feasible


def test_tpe_sweep_stops_at_trials_and_skips_duplicates(lab_env):
    from lab import sweep
    from lab.results import load
    runner = SimRunner()
    req = _request(lab_env, sampler="tpe", trials=6, seed=3)
    sweep.run(req, present_h100(), runner=runner, out=lambda *_: None)
    keys = [json.dumps(c, sort_keys=True) for c in runner.seen]
    assert len(keys) == len(set(keys))  # never re-measured
    df = load(lab_env.results)
    measured = df[(df["phase"] == "sweep") & (df["status"] != "infeasible")]
    assert len(measured) == 6


def test_a_space_smaller_than_the_trials_asks_for_nothing_it_has_in_hand(lab_env):
    """Once every config of a counted space is measured or queued, the sweep stops asking the sampler:
    each further proposal could only repeat one and would be recorded as a failed trial."""
    import optuna
    from lab import sweep
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok"]\nSMEM_KB = [16]\nSPEED = [1, 8]\nESTIMATE_BIAS_KB = [0]\n')
    runner = SimRunner()
    sweep.run(_request(lab_env, sampler="tpe", trials=10, seed=4, prefetch=2), present_h100(), runner=runner,
              out=lambda *_: None)
    assert len(runner.seen) == 2
    storage = f"sqlite:///{next(lab_env.results.rglob('optuna.db'))}"
    trials = [t for s in optuna.get_all_study_summaries(storage) if "|sim|" in s.study_name
              for t in optuna.load_study(study_name=s.study_name, storage=storage).get_trials()]
    states = [t.state.name for t in trials]
    # Two measured; while one is queued the sampler may still propose it (a few failed trials), but
    # not once both are in hand (up to STALE_STREAK more).
    assert states.count("COMPLETE") == 2 and len(states) < 10, states


def test_lane_refusing_the_whole_shape_leaves_a_row_with_its_reason(lab_env):
    """No feasible config at a shape (every one refused by the lane's rules): one infeasible row that says
    why, nothing measured, and the sweep goes on."""
    from lab import sweep
    from lab.results import load
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["refused"]\nSMEM_KB = [16]\nSPEED = [1]\nESTIMATE_BIAS_KB = [0]\n')
    runner = SimRunner()
    lines = []
    sweep.run(_request(lab_env, sampler="tpe", trials=3, seed=1), present_h100(), runner=runner, out=lines.append)
    assert runner.seen == []
    df = load(lab_env.results)
    rows = df[df["dsl"] == "sim"]
    assert len(rows) == 1 and rows["status"].iloc[0] == "infeasible" and rows["phase"].iloc[0] == "space"
    assert "MODE=refused is refused by the lane's rules" in rows["error"].iloc[0]
    assert any("no config of the sweep space" in str(line) for line in lines)


def test_refused_space_summarises_the_reasons_by_kind(lab_env, monkeypatch):
    """No feasible config: the row says how many configs the SMEM estimate put over the limit (with the
    smallest and largest excess), how many broke which rule and how many the target refused."""
    from lab import registry, sweep
    from lab.results import load
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok", "refused"]\nSMEM_KB = [120, 200]\nSPEED = [1, 2, 3]\nESTIMATE_BIAS_KB = [0]\n'
        '[restrictions]\nrules = ["SPEED != 3"]\n')
    lane = registry.get("sim", "gemm")
    monkeypatch.setattr(lane.module, "target_reason",
                        lambda cfg, target: f"SPEED={cfg['SPEED']} has no path on {target}" if cfg["SPEED"] == 2 else None)
    runner, lines = SimRunner(), []
    sweep.run(_request(lab_env, device="gb10", emulate=True, sampler="tpe", trials=3), present_h100(),
              runner=runner, out=lines.append)
    assert runner.seen == []
    rows = load(lab_env.results)
    assert len(rows) == 1 and rows["phase"].iloc[0] == "space"
    why = rows["error"].iloc[0]
    limit = 101_376  # gb10 opt-in shared memory per block, bytes
    # 12 configs: 4 by the restriction (SPEED=3; the sweep file's rules come first), 4 refused by the lane
    # (MODE=refused), 2 by the target (SPEED=2), 2 over the limit by estimate (SMEM_KB 120 and 200).
    assert "12 configs checked" in why
    assert f"2 over the gb10 limit of {limit:,} B by estimate (by {120 * 1024 - limit:,} to {200 * 1024 - limit:,} B)" in why
    assert "8 broke rules (4 'restriction: SPEED != 3', 4 'MODE=refused is refused by the lane's rules')" in why
    assert "2 refused by target (2 'SPEED=… has no path on sm_121a')" in why


def test_rejection_summary_masks_config_values_and_names_the_most_frequent_rules():
    from lab.devices import get_profile
    from lab.preflight import Verdict, rejection_summary
    h100 = get_profile("h100")
    vs = ([Verdict(False, f"BLOCK_M={b} must be 64 or 128", "rules") for b in (32, 256, 512)]
          + [Verdict(False, f"rule {i}", "rules") for i in "abcd"]
          + [Verdict(False, "over", "estimate", smem_estimate=h100.smem_optin_bytes + 8, smem_limit=h100.smem_optin_bytes)]
          + [Verdict(True, "", "estimate")])
    text = rejection_summary(vs, h100, top=2)
    assert text.startswith("9 configs checked: 1 over the h100 limit of 232,448 B by estimate (by 8 B); ")
    assert "7 broke rules (3 'BLOCK_M=… must be 64 or 128', 1 'rule a', and 3 other reasons)" in text


_HUGE = "SMEM_KB = {}\nSPEED = {}\nESTIMATE_BIAS_KB = {}\n".format(*[list(range(1, 101))] * 3)


def test_huge_space_sweeps_without_counting_every_config(lab_env):
    """10^6 configs (2x10^6 with the refused mode): the sweep samples instead of enumerating, measures what was
    asked, and a space refused at the shape says that only a sample was checked."""
    from lab import sweep
    from lab.results import load
    (lab_env.sweeps / "gemm" / "sim.toml").write_text('[params]\nMODE = ["ok"]\n' + _HUGE)
    runner = SimRunner()
    t0 = time.perf_counter()
    sweep.run(_request(lab_env, sampler="random", trials=3, seed=2), present_h100(), runner=runner,
              out=lambda *_: None)
    assert time.perf_counter() - t0 < 60 and len(runner.seen) == 3
    (lab_env.sweeps / "gemm" / "sim.toml").write_text('[params]\nMODE = ["refused"]\n' + _HUGE)
    sweep.run(_request(lab_env, sampler="tpe", trials=3, seed=2), present_h100(), runner=runner, out=lambda *_: None)
    rows = load(lab_env.results)
    space_rows = rows[rows["phase"] == "space"]
    assert len(space_rows) == 1 and "a random sample of 20,000 of its 1,000,000 configs" in space_rows["error"].iloc[0]
    with pytest.raises(Exception, match="grid over 1,000,000 configs"):
        sweep.run(_request(lab_env, sampler="grid", trials=3), present_h100(), runner=runner, out=lambda *_: None)


_KILLABLE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[3])
    from tests.test_sweep_engine import SimRunner, _request, present_h100
    from lab import sweep
    class Env:
        results = Path(sys.argv[1])
    req = _request(Env, sampler="random", trials=int(sys.argv[2]), seed=11)
    sweep.run(req, present_h100(), runner=SimRunner(delay_s=0.3), out=lambda *_: None)
""")


def test_killed_sweep_loses_no_finished_trial_and_resumes(lab_env):
    from lab import sweep
    from lab.results import load
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [16, 32, 48, 64]\nSPEED = [1, 2, 3]\nESTIMATE_BIAS_KB = [0]\n')
    script = lab_env.tmp / "killable.py"
    script.write_text(_KILLABLE)
    proc = subprocess.Popen([sys.executable, str(script), str(lab_env.results), "10", str(lab_env.root)],
                            env=os.environ.copy())
    deadline = time.time() + 120
    rows = 0
    while time.time() < deadline and rows < 3:
        time.sleep(0.2)
        if list(lab_env.results.rglob("*.parquet")):
            rows = len(load(lab_env.results))  # never a half-written file: the writer renames atomically
    assert rows >= 3, "the sweep did not record trials in time"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed = load(lab_env.results)
    assert len(killed) >= 3 and set(killed["status"]) == {"ok"}
    done_before = set(killed["config_json"])

    runner = SimRunner()
    req = _request(lab_env, sampler="random", trials=10, seed=11)
    sweep.run(req, present_h100(), runner=runner, out=lambda *_: None)
    after = load(lab_env.results)
    assert done_before <= set(after["config_json"])       # nothing finished was lost
    rerun = {json.dumps(c, sort_keys=True) for c in runner.seen}
    assert not (rerun & done_before)                        # finished trials were not re-measured
    assert after["config_json"].nunique() == 10 == len(after)  # the study continued to 10 in all
    assert after["run_id"].nunique() == 2


def test_worker_statuses_crash_hang_and_recovery(lab_env):
    """The real worker process: a crash, a hang and a poisoned context are recorded and the next
    candidate still runs in a fresh process."""
    from lab.worker import WorkerRunner
    shape = {"M": 24, "N": 16, "K": 40, "dtype": "float32"}
    runner = WorkerRunner("cpu")

    def task(mode):
        cfg = {"MODE": mode, "SMEM_KB": 16, "SPEED": 1, "ESTIMATE_BIAS_KB": 0}
        return {"kind": "trial", "kernel": "gemm", "dsl": "sim", "config": cfg, "shape": shape, "seed": 1,
                "timing": FAST_TIMING}
    try:
        assert runner.run(task("ok"), 60)["status"] == "ok"
        r = runner.run(task("crash"), 60)
        assert r["status"] == "runtime_error" and "died" in r["error"]
        assert runner.run(task("ok"), 60)["status"] == "ok"
        t0 = time.time()
        r = runner.run(task("hang"), 3)
        assert r["status"] == "timeout" and time.time() - t0 < 30
        r = runner.run(task("sticky"), 60)
        assert r["status"] == "runtime_error" and "illegal memory access" in r["error"]
        assert runner.run(task("compile_error"), 60)["status"] == "compile_error"
        r = runner.run(task("runtime_error"), 60)
        assert r["status"] == "runtime_error" and r["error"].startswith("[timing]")
        assert runner.run(task("wrong"), 60)["status"] == "wrong_result"
        ok = runner.run(task("ok"), 60)
        assert ok["status"] == "ok" and ok["samples"] >= 3 and len(ok["samples_ms"]) == ok["samples"]
        assert runner.restarts >= 3
    finally:
        runner.close()


def test_confirm_retimes_best_configs_against_baseline(lab_env):
    """Real worker on the CPU: the best sim config and the torch baseline are re-timed interleaved,
    and the report takes its ratio from those rows."""
    from lab import sweep
    from lab.report import best_per_dsl, with_ratios
    from lab.results import load
    from lab.worker import WorkerRunner
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        # "slow" sleeps 4 or 10 ms a call: far beyond the noise of a loaded 2-core machine (with 0.5 ms it
        # won once there)
        '[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [16]\nSPEED = [8, 20]\nESTIMATE_BIAS_KB = [0]\n')
    req = _request(lab_env, trials=4, baseline=True, confirm=True,
                   confirm_timing={"budget_ms": 300.0, "min_time_ms": 5.0, "min_samples": 6})
    sweep.run(req, present_h100(), runner=WorkerRunner("cpu"), out=lambda *_: None)
    df = load(lab_env.results)
    conf = df[df["phase"] == "confirm"]
    assert sorted(conf["dsl"]) == ["sim", "torch"] and (conf["samples"] >= 6).all()
    assert conf["timing_stop"].str.startswith("abab").all()
    best = with_ratios(best_per_dsl(df))
    assert set(best["timing_source"]) == {"A/B confirm"} and best["ratio_to_baseline"].notna().all()
    sim_best = best[best["dsl"] == "sim"].iloc[0]
    assert '"MODE": "ok"' in sim_best["config_json"]  # the sleeping mode never wins


_DIES_AFTER_ROW = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from tests.test_sweep_engine import SimRunner, _request, present_h100
    from lab import sweep, results
    add = results.RunWriter.add
    def add_then_die(self, row):
        add(self, row)
        if len(self.rows) == 3:
            os._exit(9)  # the row is on disk, Optuna was not told yet
    results.RunWriter.add = add_then_die
    class Env:
        results = Path(sys.argv[1])
    sweep.run(_request(Env, sampler="random", trials=6, seed=5), present_h100(), runner=SimRunner(), out=lambda *_: None)
""")


def test_kill_between_row_and_study_update_is_recovered(lab_env):
    from lab import sweep
    from lab.results import load
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [16, 32, 48, 64]\nSPEED = [1, 2, 3]\nESTIMATE_BIAS_KB = [0]\n')
    script = lab_env.tmp / "dies.py"
    script.write_text(_DIES_AFTER_ROW)
    p = subprocess.run([sys.executable, str(script), str(lab_env.results), str(lab_env.root)], env=os.environ.copy())
    assert p.returncode == 9
    before = load(lab_env.results)
    assert len(before) == 3
    runner = SimRunner()
    sweep.run(_request(lab_env, sampler="random", trials=6, seed=5), present_h100(), runner=runner, out=lambda *_: None)
    after = load(lab_env.results)
    assert not ({json.dumps(c, sort_keys=True) for c in runner.seen} & set(before["config_json"]))
    assert len(after) == 6 == after["config_json"].nunique()


@pytest.mark.parametrize("prefetch", [0, 2, 5])
def test_grid_measures_every_point_with_candidates_compiled_ahead(lab_env, prefetch):
    """Candidates queued ahead of the GPU are measured before the grid counts as exhausted (a grid sweep
    on the H200 on 2026-11-26, prefetch 2, dropped its last queued config unmeasured)."""
    from lab import sweep
    from lab.results import load
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok"]\nSMEM_KB = [16, 32, 48, 200]\nSPEED = [1, 2]\nESTIMATE_BIAS_KB = [0]\n')
    runner = SimRunner()
    sweep.run(_request(lab_env, device="gb10", emulate=True, prefetch=prefetch, compile_workers=1),
              present_h100(), runner=runner, out=lambda *_: None)
    rows = load(lab_env.results)
    assert len(rows) == 8 and rows["config_json"].is_unique
    assert (rows["status"] == "ok").sum() == 6 and len(runner.seen) == 6  # SMEM_KB 200 > 99 KiB: infeasible


def test_a_resumed_study_measures_a_seed_added_since_first(lab_env):
    """A seed added to the sweep file after a study began is the resumed run's next trial (before, a
    study with trials took no file seeds: the TileLang stage_out seed would have waited on the sampler)."""
    from lab import sweep
    runner = SimRunner()
    sweep.run(_request(lab_env, sampler="tpe", trials=2, seed=5), present_h100(), runner=runner, out=lambda *_: None)
    added = {"MODE": "ok", "SMEM_KB": 64, "SPEED": 2, "ESTIMATE_BIAS_KB": 0}
    assert added not in [{k: c[k] for k in added} for c in runner.seen]
    first = len(runner.seen)
    with open(lab_env.sweeps / "gemm" / "sim.toml", "a") as f:
        f.write("\n[[seed]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in added.items()))
    sweep.run(_request(lab_env, sampler="tpe", trials=3, seed=6), present_h100(), runner=runner, out=lambda *_: None)
    assert {k: runner.seen[first][k] for k in added} == added, runner.seen


def test_a_stalled_sampler_in_a_counted_space_gets_the_feasible_configs_it_missed(lab_env, monkeypatch):
    """TPE in a counted space where few configs pass kept proposing what it had and stopped with the
    trials unfilled (CuTe DSL GEMM, GB10 profile: 2 of 4 feasible configs measured, run
    20261127T200825Z-gemm-gb10-emulated-886): the feasible configs not yet tried are enqueued once, so
    --trials is met (here every feasible config), each measured once."""
    from lab import sweep
    from lab.results import load
    (lab_env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok", "refused"]\nSMEM_KB = [16, 64, 200]\nSPEED = [1, 2]\nESTIMATE_BIAS_KB = [0]\n')
    monkeypatch.setattr(sweep, "STALE_STREAK", 1)   # the first proposal that adds nothing counts as a stall
    runner, lines = SimRunner(), []
    sweep.run(_request(lab_env, sampler="tpe", trials=20, seed=5), present_h100(), runner=runner, out=lines.append)
    keys = [json.dumps(c, sort_keys=True) for c in runner.seen]
    assert len(keys) == len(set(keys)) == 6, lines     # MODE ok x 3 SMEM x 2 SPEED, all fit the H100
    assert any("enqueueing the" in str(line) for line in lines), lines
    df = load(lab_env.results)
    assert len(df[(df["phase"] == "sweep") & (df["status"] == "ok")]) == 6


_SEEDS = [{"MODE": "ok", "SMEM_KB": kb, "SPEED": sp, "ESTIMATE_BIAS_KB": 0} for kb, sp in ((16, 3), (32, 2), (48, 1), (64, 3))]


def _seeded_space(env):
    (env.sweeps / "gemm" / "sim.toml").write_text(
        '[params]\nMODE = ["ok", "slow"]\nSMEM_KB = [16, 32, 48, 64]\nSPEED = [1, 2, 3]\nESTIMATE_BIAS_KB = [0]\n'
        + "".join("\n[[seed]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in s.items()) for s in _SEEDS))


def _picked(seen):
    return [{k: c[k] for k in _SEEDS[0]} for c in seen]


def test_seeds_prefetched_and_not_measured_are_the_next_runs_first(lab_env):
    """A run that stops at its --trials with seeds compiled ahead puts them back in the queue in their
    places: the next run measures them first, in the file's order. (They were failed: a resumed run then
    never measured them, since a failed trial of the same params kept the seed from being enqueued again.)"""
    from lab import sweep
    _seeded_space(lab_env)
    runner = SimRunner()
    sweep.run(_request(lab_env, sampler="tpe", trials=1, seed=5, prefetch=2, compile_workers=1), present_h100(),
              runner=runner, out=lambda *_: None)
    assert _picked(runner.seen) == _SEEDS[:1]
    sweep.run(_request(lab_env, sampler="tpe", trials=4, seed=6, prefetch=2, compile_workers=1), present_h100(),
              runner=runner, out=lambda *_: None)
    assert _picked(runner.seen) == _SEEDS, runner.seen


class _KilledAt(SimRunner):
    """A sweep killed while it measures its ``n``-th config (KeyboardInterrupt: what SIGINT raises)."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def run(self, task, timeout_s):
        if task.get("kind") != "abab" and len(self.seen) + 1 == self.n:
            raise KeyboardInterrupt
        return super().run(task, timeout_s)


def test_a_config_cut_by_a_kill_is_the_resumed_runs_first(lab_env):
    """The config a killed sweep was measuring is failed and retried under a new trial number; it keeps its
    place in the queue, so the resumed run measures it before the seeds queued after it (it came after
    them, and a resumed run with few --trials measured later seeds instead: cuTile, GB10 profile, training,
    2026-11-28, runs 20261128T123727Z-...-1809 and 20261128T124835Z-...-3600)."""
    from lab import sweep
    _seeded_space(lab_env)
    killed = _KilledAt(2)
    with pytest.raises(KeyboardInterrupt):
        sweep.run(_request(lab_env, sampler="tpe", trials=4, seed=5), present_h100(), runner=killed,
                  out=lambda *_: None)
    assert _picked(killed.seen) == _SEEDS[:1]
    runner = SimRunner()
    sweep.run(_request(lab_env, sampler="tpe", trials=3, seed=6), present_h100(), runner=runner, out=lambda *_: None)
    assert _picked(runner.seen) == _SEEDS[1:3], runner.seen


def test_seeds_put_back_are_queued_again_after_lab_merge(lab_env, tmp_path):
    """`lab merge` brings a call's finished trials home, not its waiting ones: the seeds a run compiled
    ahead and put back arrive as failed trials only. The next run (on the merged database) queues them
    again and measures them first."""
    import optuna
    from lab import sweep
    from lab.merge import Summary, merge_studies
    _seeded_space(lab_env)
    runner = SimRunner()
    sweep.run(_request(lab_env, sampler="tpe", trials=1, seed=5, prefetch=2, compile_workers=1), present_h100(),
              runner=runner, out=lambda *_: None)
    home = tmp_path / "home"
    db = home / "h100" / "gemm" / "optuna.db"
    db.parent.mkdir(parents=True)
    optuna.storages.RDBStorage(f"sqlite:///{db}")    # the checkout's (empty) study database
    merge_studies(lab_env.results / "h100" / "gemm" / "optuna.db", db, "h100/gemm/optuna.db", Summary())
    sweep.run(_request(lab_env, sampler="tpe", trials=4, seed=6, results_dir=home), present_h100(), runner=runner,
              out=lambda *_: None)
    assert _picked(runner.seen) == _SEEDS, runner.seen
