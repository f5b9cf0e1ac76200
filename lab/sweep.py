"""Optuna-driven sweeps: one resumable study per (kernel, DSL, shape, device, toolchain).

Flow per candidate: the sampler proposes a config; a config already measured in the study is not
measured again; cheap preflight checks (rules, target, SMEM estimate) reject infeasible configs
without compiling; an AOT compile for the target profile (in a CPU process pool, overlapping the GPU
timing of the previous candidate) verifies shared memory; the survivor is parity-checked and timed
in a killable worker process. Every outcome is a row, written as soon as it exists.
Queued configs (the request's seeds, the sweep file's, grid points) are measured in their queue order,
also across runs: one compiled ahead and not measured when a run reaches its --trials, or cut by a kill,
goes back in its place (``lab.study.requeue`` / ``order_of``), so the next run measures it first.
Objective: median time in ms (minimized). Non-ok outcomes are told to Optuna as constraint
violations with a penalty value, so TPE learns to avoid them.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from lab import identity, preflight, problems, registry, space as space_mod, study as study_mod
from lab.devices import DeviceProfile, LabError, PresentGPU, PROFILES, get_profile
from lab.results import RunWriter, git_state, new_run_id, now_utc
from lab.worker import WorkerRunner

PENALTY_MS = 1e9  # objective value told to Optuna for any non-ok outcome (with constraint > 0)
GRID_LIMIT = 100_000  # grid points a grid sweep enqueues at most
STALE_STREAK = 200  # consecutive proposals that add nothing new before the space counts as exhausted


@dataclass
class Mode:
    """What will actually happen: measured natively, emulated, or compile-only."""
    requested: DeviceProfile
    actual_gpu: str
    actual_profile: str
    run_target: str | None     # compile target of the binaries that run (None when compile-only)
    emulated: bool
    compile_only: bool
    run_profile: DeviceProfile | None  # profile of the GPU that runs (for peaks), None if unknown


def _target_of(gpu: PresentGPU) -> str:
    major, minor = gpu.capability
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def resolve_mode(requested: str, present: PresentGPU | None, emulate: bool, compile_only: bool) -> Mode:
    """Requested profile vs the GPU present: refuses a mismatch unless --emulate or --compile-only."""
    prof = get_profile(requested)
    if emulate and compile_only:
        raise LabError("--emulate and --compile-only are exclusive")
    if compile_only:
        label = present.name if present else "none (CPU only)"
        return Mode(prof, label, present.profile if present and present.profile else "none", None, False, True, None)
    if present is None:
        raise LabError(f"no GPU on this machine: a {requested} sweep needs one; use --compile-only to preflight "
                       f"and compile for {prof.target} without running")
    run_prof = PROFILES.get(present.profile) if present.profile else None
    if present.profile == requested:
        return Mode(prof, present.name, present.profile, _target_of(present), False, False, run_prof)
    if not emulate:
        raise LabError(f"requested device {requested} ({prof.gpu}) but this machine has {present.name} "
                       f"(profile {present.profile or 'unknown'}); pass --emulate to run {requested}-limited "
                       f"configs on it (rows marked emulated) or --compile-only")
    return Mode(prof, present.name, present.profile or "unknown", _target_of(present), True, False, run_prof)


@dataclass
class SweepRequest:
    kernel: str
    device: str
    dsls: list[str] | None = None          # None: every lane of the kernel
    shapes: list[str] | None = None        # None: the kernel's default shapes
    trials: int = 40                       # measured candidates per (DSL, shape), resumed studies included
    new_trials: bool = False               # trials counts this run's new configs after its seeds (gate --run)
    timeout_s: float = 300.0               # per candidate (compile + parity + timing)
    sampler: str = "tpe"
    seed: int = 0
    storage: str | None = None
    emulate: bool = False
    compile_only: bool = False
    results_dir: Path = Path("results")
    prefetch: int = 2                      # candidates compiled ahead while the GPU times the current one
    compile_workers: int = 2
    baseline: bool = True                  # add the baseline lane (torch) when it is not in dsls
    confirm: bool = True                   # re-time best configs A B A B against the baseline at the end
    progress: bool = True
    timing: dict = field(default_factory=dict)  # overrides for lab.timing.bench
    confirm_timing: dict = field(default_factory=dict)  # overrides for the A/B confirm
    seeds: dict = field(default_factory=dict)  # {(dsl, shape name): [config, ...]} tried first, before the sweep file's
    precision: str | None = None           # a [precision.NAME] table of the sweep files fixed in every trial


def _sampler(name: str, seed: int):
    import optuna
    if name == "tpe":
        # Constraints come from Trial.set_constraint (Optuna 5): non-ok outcomes are violations.
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=8, multivariate=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        # The grid is enqueued into the study (see _sweep_lane); Optuna's GridSampler calls
        # study.stop() when exhausted, which ask/tell does not allow.
        return optuna.samplers.RandomSampler(seed=seed)
    raise LabError(f"unknown sampler {name!r} (known: tpe, random, grid)")


def _versions(lane: registry.Lane) -> dict:
    """Everything that produced the binary and the measurement: part of the study key, so that a
    result from another toolchain, lane code (``lab.identity``) or harness version is never reused
    silently."""
    import lab
    v = dict(lane.module.versions())
    v["python"] = platform.python_version()
    v["lab"] = lab.__version__
    v.update(identity.lane_identity(lane.module_name))
    try:
        import optuna
        v["optuna"] = optuna.__version__
    except ImportError:
        pass
    return v


def _distributions(space: space_mod.Space):
    import optuna
    return {k: optuna.distributions.CategoricalDistribution(v) for k, v in space.params.items()}


def _recover_dead_trials(study, rows_dir: Path) -> None:
    """Trials left RUNNING by a killed sweep on this host (other hosts' are left alone).

    A kill can fall between writing a trial's row and telling Optuna: such a trial is completed
    from its row (so the config is not measured twice); any other dead trial is marked FAIL."""
    import optuna
    from lab.results import load
    host = study_mod.worker_identity()["host"]
    dead = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # Another host's trial, or one a worker is still setting up (asked, its pid not yet written).
        if t.user_attrs.get("host") != host or not t.user_attrs.get("pid"):
            continue
        pid = t.user_attrs.get("pid")
        try:
            alive = pid != os.getpid() and (os.kill(pid, 0) is None)
        except OSError:
            alive = False
        if not alive:
            dead.append(t)
    if not dead:
        return
    rows = load(rows_dir)
    rows = rows[(rows["study"] == study.study_name) & (rows["phase"] == "sweep")]
    storage = study._storage
    for t in dead:
        try:
            _recover_one(study, storage, t, rows[rows["trial"] == t.number])
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another worker on this host recovered it first


def _recover_one(study, storage, t, got) -> None:
    """Complete a dead trial from its row (``got``), or fail it and enqueue its config again."""
    import optuna
    if got.empty:  # died before its row: failed, and its config enqueued again (as for a silent worker)
        storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        study_mod.retry_callback()(study, storage.get_trial(t._trial_id))
        return
    r = got.iloc[-1]
    status = r["status"]
    key = space_mod.config_key(json.loads(r["config_json"]))
    value = float(r["time_ms"]) if status == "ok" else PENALTY_MS
    measured = status not in ("infeasible",)
    for k, v in (("status", status), ("config_key", key), ("measured", measured), ("recovered", True)):
        storage.set_trial_user_attr(t._trial_id, k, v)
    # The same constraint Trial.set_constraint("ok", ...) records for a live trial.
    from optuna.trial._trial import _CONSTRAINTS_KEY
    storage.set_trial_system_attr(t._trial_id, f"{_CONSTRAINTS_KEY}:ok", 0.0 if status == "ok" else 1.0)
    storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.COMPLETE, [value])


class Sweep:
    def __init__(self, req: SweepRequest, mode: Mode, runner=None, out=print):
        self.req, self.mode, self.out = req, mode, out
        self.problem = problems.get(req.kernel)
        self.shapes_all, default = space_mod.load_shapes(req.kernel)
        names = req.shapes or default
        for n in names:
            if n not in self.shapes_all:
                raise LabError(f"unknown shape {n!r} for {req.kernel} (known: {', '.join(self.shapes_all)})")
        self.shape_names = names
        for n in names:
            self.problem.check_shape(self.shapes_all[n])
        self.lanes = self._select_lanes()
        tag = f"{req.kernel}-{req.device}" + ("-emulated" if mode.emulated else "") + ("-compile" if mode.compile_only else "")
        self.run_id = new_run_id(tag)
        self.dir = Path(req.results_dir) / req.device / req.kernel
        self.writer = RunWriter(self.dir, self.run_id)
        self.storage = req.storage or f"sqlite:///{(self.dir / 'optuna.db').resolve()}"
        self._storage = None  # opened on first use (lab.study.open_storage)
        self.worker = study_mod.worker_identity(measures=mode.run_target is not None)
        self.commit, self.dirty = git_state()
        l2 = 0
        if mode.run_profile and mode.run_profile.l2_bytes:
            l2 = mode.run_profile.l2_bytes
        self.l2_bytes = l2
        self.runner = runner
        self.summary: list[dict] = []

    def _select_lanes(self) -> list[registry.Lane]:
        req = self.req
        if req.dsls:
            lanes = [registry.get(d, req.kernel) for d in req.dsls]
            if req.baseline:
                lanes += [l for l in registry.lanes_for(req.kernel)
                          if l not in lanes and l.import_error is None and _safe_baseline(l)]
        else:
            lanes = registry.lanes_for(req.kernel)
        # Baseline first so its row exists when the others are compared with it.
        return sorted(lanes, key=lambda l: (not _safe_baseline(l), l.dsl))

    # -- rows -------------------------------------------------------------------------------------
    def _row(self, lane, shape_name, shape, config, trial, status, verdict=None, result=None,
             versions=None, phase="sweep", study="") -> dict:
        result = result or {}
        v = verdict or preflight.Verdict(status == "ok")
        run_prof = self.mode.run_profile
        t = result.get("time_ms")
        flops, nbytes = self.problem.flops(shape), self.problem.bytes_moved(shape)
        tflops = flops / (t * 1e-3) / 1e12 if t else None
        gbs = nbytes / (t * 1e-3) / 1e9 if t else None
        c0, c1 = result.get("sm_clock_start_mhz"), result.get("sm_clock_end_mhz")
        return {
            "run_id": self.run_id, "time_utc": now_utc(), "git_commit": self.commit, "git_dirty": self.dirty,
            "kernel": self.req.kernel, "dsl": lane.dsl, "baseline": _safe_baseline(lane), "shape": shape_name,
            "shape_json": json.dumps(shape, sort_keys=True), "dtype": shape.get("dtype"),
            "config_json": json.dumps(config, sort_keys=True), "phase": phase, "trial": trial,
            "requested_profile": self.req.device, "actual_gpu": self.mode.actual_gpu,
            "actual_profile": self.mode.actual_profile, "preflight_target": self.mode.requested.target,
            "compile_target": self.mode.run_target or self.mode.requested.target,
            "emulated": self.mode.emulated, "compile_only": self.mode.compile_only,
            "status": status, "error": result.get("error") or (v.reason if status != "ok" else ""),
            "smem_estimate_bytes": v.smem_estimate, "smem_compiled_bytes": v.smem_compiled,
            "smem_limit_bytes": v.smem_limit, "smem_launched_bytes": result.get("launch_smem_bytes"),
            "registers": result.get("launch_registers", v.registers), "spills": result.get("launch_spills"),
            "parity_json": json.dumps(result.get("parity", {})), "parity_rel_l2": result.get("parity_rel_l2"),
            "parity_rel_max": result.get("parity_rel_max"), "tol_rel_l2": result.get("tol_rel_l2"),
            "tol_rel_max": result.get("tol_rel_max"), "parity_shapes": ",".join(result.get("parity_shapes", [])),
            "time_ms": t, "time_q1_ms": result.get("time_q1_ms"), "time_q3_ms": result.get("time_q3_ms"),
            "time_iqr_ms": result.get("time_iqr_ms"), "time_ci_half_ms": result.get("time_ci_half_ms"),
            "samples": result.get("samples"), "samples_ms": result.get("samples_ms"),
            "timing_stop": result.get("timing_stop"), "graph_ms": result.get("graph_ms"),
            "tflops": tflops, "gbs": gbs,
            "pct_peak_tflops": 100 * tflops / run_prof.bf16_tflops if tflops and run_prof and run_prof.bf16_tflops else None,
            "pct_peak_bw": 100 * gbs / run_prof.mem_bw_gbs if gbs and run_prof and run_prof.mem_bw_gbs else None,
            "compile_s": result.get("compile_s"), "preflight_compile_s": v.compile_s,
            "sm_clock_start_mhz": c0, "sm_clock_end_mhz": c1,
            "clock_drift": bool(c0 and c1 and abs(c1 - c0) / c0 > 0.10),
            "versions_json": json.dumps(versions or {}, sort_keys=True), "seed": self.req.seed,
            "sampler": self.req.sampler, "study": study,
            "host": self.worker["host"], "gpu_index": self.worker["gpu_index"],
            "precision": self._precision(lane) or "",
        }

    def _precision(self, lane) -> str | None:
        """The run's --precision for a tuned lane; the baseline (a library or reference) has none."""
        return None if _safe_baseline(lane) else self.req.precision

    # -- main loop --------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        req = self.req
        pool = preflight.CompilePool(req.compile_workers if req.prefetch > 0 else 0)
        self.out(f"run {self.run_id}: rows in {self.writer.path}")  # ties a log to its rows
        if self.runner is None and not self.mode.compile_only:
            self.runner = WorkerRunner("cuda")
        try:
            for shape_name in self.shape_names:
                shape = dict(self.shapes_all[shape_name])
                best: dict[str, tuple] = {}
                for lane in self.lanes:
                    got = self._sweep_lane(lane, shape_name, shape, pool)
                    if got:
                        best[lane.dsl] = got
                if req.confirm and not self.mode.compile_only and len(best) > 1:
                    self._confirm_once(shape_name, shape, best)
        finally:
            pool.close()
            if self.runner is not None and hasattr(self.runner, "close"):
                self.runner.close()
        return self.summary

    def _eligible(self, lane) -> registry.Eligibility:
        e = lane.eligibility(self.mode.requested.target)
        if e.ok and self.mode.run_target and self.mode.run_target != self.mode.requested.target:
            e2 = lane.eligibility(self.mode.run_target)
            if not e2.ok:
                return registry.Eligibility(e2.code, f"on the GPU that runs ({self.mode.run_target}): {e2.reason}")
        return e

    def _refuse(self, lane, shape_name, shape, config, verdict, **row_kw):
        """A lane that runs nothing at this shape: one infeasible row with the reason, printed and summarized."""
        self.writer.add(self._row(lane, shape_name, shape, config, -1, "infeasible", verdict, **row_kw))
        self.out(f"{lane.dsl:8s} {shape_name}: {verdict.reason}")
        self.summary.append({"dsl": lane.dsl, "shape": shape_name, "note": verdict.reason})

    def _sweep_lane(self, lane, shape_name, shape, pool):
        import optuna
        req = self.req
        elig = self._eligible(lane)
        if not elig.ok:
            self._refuse(lane, shape_name, shape, {}, preflight.Verdict(False, str(elig), "eligibility"),
                         phase="eligibility")
            return None
        mod = lane.module
        space = space_mod.load_space(req.kernel, lane.dsl, tuple(mod.TUNABLES), self._precision(lane))
        versions = _versions(lane)
        vhash = hashlib.sha1(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:8]
        shape_tag = hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:6]
        study_name = (f"{req.kernel}|{lane.dsl}|{shape_name}-{shape_tag}|req={req.device}|gpu={self.mode.actual_profile}"
                      f"|emu={int(self.mode.emulated)}|co={int(self.mode.compile_only)}|tc={vhash}|sp={space.tag}")
        self.dir.mkdir(parents=True, exist_ok=True)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            if self._storage is None:
                self._storage = study_mod.open_storage(self.storage)
            study = optuna.create_study(study_name=study_name, storage=self._storage, direction="minimize",
                                        sampler=_sampler(req.sampler, req.seed), load_if_exists=True)
        except (ValueError, ImportError, *study_mod.storage_errors()) as exc:
            raise LabError(f"cannot open study storage {self.storage}: {str(exc).splitlines()[0]}") from None
        _recover_dead_trials(study, self.dir)
        study_mod.fail_stale(study)  # other workers' dead trials: failed, their configs enqueued again
        if req.sampler == "grid" and space.size > GRID_LIMIT:
            raise LabError(f"--sampler grid over {space.size:,} configs of {space.source} (at most {GRID_LIMIT:,}): "
                           f"use tpe or random")
        # The sweep file's seeds come after the request's, in a new study and in a resumed one (a seed
        # added since is measured by the next run's first trials; one already measured is skipped).
        fresh = not study.get_trials(deepcopy=False)
        seeded: set[str] = set()  # keys of the request's seeds (gate --run: the previous best)
        for seed_cfg in req.seeds.get((lane.dsl, shape_name), []):  # e.g. the gate's previous best configs
            # A trial holds only the space's params, each one of its listed values: a seed's other keys
            # (a precision key, a knob the lane retired) take the lane's defaults, as every trial's do, and
            # a seed naming a value the file no longer lists (a pruned sweep file) cannot be a trial of
            # this study; the gate still times that config with the code it was measured with.
            cfg = lane.full_config({k: v for k, v in seed_cfg.items() if k in mod.TUNABLES})
            unlisted = space.unlisted(cfg)
            if unlisted:
                self.out(f"{lane.dsl:8s} {shape_name}: seed not in {space.where} ({', '.join(unlisted)}): "
                         f"not a trial of this sweep")
                continue
            study_mod.enqueue(study, cfg)
            seeded.add(space_mod.config_key(cfg))
        for seed_cfg in space.seeds:  # known-good starting points from the sweep file
            study_mod.enqueue(study, seed_cfg)
        if fresh and req.sampler == "grid":
            for cfg in space.configs():
                study.enqueue_trial(cfg, skip_if_exists=True)
        dists = _distributions(space)
        measured: dict[str, float] = {}
        for t in study.get_trials(deepcopy=False):
            if t.user_attrs.get("measured") and t.state == optuna.trial.TrialState.COMPLETE:
                measured[t.user_attrs["config_key"]] = t.value
        # Feasible configs at this shape: all of them for a space of at most SCAN_LIMIT points, else the seeds
        # and a seeded sample (counting a space of billions would take hours); unknown (inf) when sampled.
        scanned, exhaustive = space.scan(seed=req.seed or 0)
        # A sampled space only needs to know whether any config passes (the seeds come first, so that
        # is usually the first check): estimating thousands of samples costs minutes for lanes whose
        # estimate builds the kernel's program.
        verdicts: list[preflight.Verdict] = []  # every config checked (all of them when none passes)

        def passes_one(c) -> bool:
            verdicts.append(preflight.cheap_checks(lane, space, lane.full_config(c), shape, self.mode.requested))
            return verdicts[-1].feasible
        passes = map(passes_one, scanned)
        feasible_total = sum(passes) if exhaustive else (math.inf if any(passes) else 0)
        if feasible_total == 0 and req.sampler != "grid":
            # A lane that refuses the whole shape still leaves a row with its reasons, summarised by kind (fail
            # closed, recorded), not an empty study; the row carries the space's first config (its first seed).
            cfg, why = lane.full_config(scanned[0]), verdicts[0]
            checked = "" if exhaustive else (f" (checked: the seeds and a random sample of {len(scanned):,} of its "
                                             f"{space.size:,} configs)")
            verdict = preflight.Verdict(False, f"no config of the sweep space passes the preflight at this shape"
                                               f"{checked}; {preflight.rejection_summary(verdicts, self.mode.requested)}",
                                        why.stage, smem_estimate=why.smem_estimate, smem_limit=why.smem_limit)
            self._refuse(lane, shape_name, shape, cfg, verdict, phase="space", versions=versions, study=study_name)
            return None
        done0 = len(measured)
        # gate --run: --trials new configs after the request's seeds, which are measured first.
        trials = req.trials + done0 + len(seeded - measured.keys()) if req.new_trials else req.trials
        target = trials if req.sampler == "grid" else min(trials, feasible_total)
        bar = _progress(req.progress, total=target, initial=min(done0, target), desc=f"{lane.dsl} {shape_name}")
        beats = study_mod.Heartbeats(self._storage)
        queue: deque = deque()
        pending: set[str] = set()
        stale = 0
        counts: dict[str, int] = {}
        best_val = min(measured.values(), default=None)
        best_val = best_val if best_val is not None and best_val < PENALTY_MS else None
        rejected_by_compile: set[str] = set()
        rejected_cheap: set[str] = set()
        enqueued: set[str] = set()  # feasible configs put in the queue after the sampler stalled

        def taken_for_dead(trial):
            self.out(f"{lane.dsl:8s} {shape_name}: trial {trial.number} was taken for dead by another worker "
                     f"(no heartbeat for LAB_GRACE_S s) and its config retried there; a row it has stays")
            beats.stop(trial)

        def tell(trial, value, status, key, measured_flag, row=None):
            try:
                for k in ("error", "parity_rel_l2", "smem_compiled_bytes") if row else ():  # shown by `lab dashboard`
                    if row.get(k) not in (None, ""):
                        trial.set_user_attr(k, row[k] if k != "error" else str(row[k])[:300])
                trial.set_user_attr("status", status)
                trial.set_user_attr("config_key", key)
                trial.set_user_attr("measured", measured_flag)
                trial.set_constraint("ok", 0.0 if status == "ok" else 1.0)
                study.tell(trial, value)
            except optuna.exceptions.UpdateFinishedTrialError:
                taken_for_dead(trial)
            beats.stop(trial)

        def drop(trial):
            try:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # failed already, by a worker that took it for dead
            beats.stop(trial)

        def queued(trial) -> bool:
            """Whether ``trial`` was popped from the queue (a seed, a grid point, a retry), not proposed."""
            return "fixed_params" in study._storage.get_trial_system_attrs(trial._trial_id)

        def put_back(trial):
            study_mod.requeue(study, trial)
            beats.stop(trial)

        def release(trial):
            """A trial held and not measured: a queued config goes back in its place, a proposal is failed."""
            put_back(trial) if queued(trial) else drop(trial)

        def more() -> bool:
            study_mod.fail_stale(study)  # a worker that died meanwhile: its config goes back in the queue
            # Other workers' measurements count toward the target, and so do the configs they hold now.
            held = 0
            for t in study_mod.trials(study, (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.RUNNING)):
                if t.state == optuna.trial.TrialState.RUNNING:
                    theirs = (t.user_attrs.get("host"), t.user_attrs.get("pid")) != (self.worker["host"],
                                                                                      self.worker["pid"])
                    held += bool(t.user_attrs.get("claim")) and theirs
                elif t.user_attrs.get("measured") and t.user_attrs.get("config_key") not in measured:
                    measured[t.user_attrs["config_key"]] = t.value
            if len(measured) + held >= target:
                return False
            if req.sampler == "grid":  # every grid point gets its row, infeasible ones included
                return bool(queue) or grid_left()
            return len(measured.keys() | rejected_by_compile) < feasible_total

        def unclaimed_left() -> bool:
            """Whether a proposal can still be new: not while every feasible config of a counted space is
            measured, queued or rejected (asking then only returns configs in hand, each a failed trial)."""
            return len(measured.keys() | pending | rejected_by_compile) < feasible_total

        def grid_left() -> bool:
            """Grid points this worker has neither measured, rejected nor queued (queued ones are still
            to be measured: counting them as done dropped the queue's configs unmeasured)."""
            return len(measured.keys() | rejected_by_compile | rejected_cheap | pending) < space.size

        try:
            while more():
                # Fill the look-ahead queue: proposals go through the cheap checks now, compiles in the pool.
                while (len(queue) <= req.prefetch and stale < STALE_STREAK
                       and (grid_left() if req.sampler == "grid" else unclaimed_left())):
                    trial = study.ask(dists)
                    beats.start(trial)
                    try:
                        for k, v in self.worker.items():
                            trial.set_user_attr(k, v)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        taken_for_dead(trial)
                        stale += 1
                        continue
                    if queued(trial) and study_mod.queued_ahead(study, trial):
                        put_back(trial)   # a config retried or put back waits ahead of it: that one first
                        continue
                    cfg = lane.full_config(dict(trial.params))
                    key = space_mod.config_key(cfg)
                    if key in measured or key in pending or key in rejected_by_compile or key in rejected_cheap:
                        stale += 1
                        if key in measured:
                            tell(trial, measured[key], "duplicate", key, False)
                        else:
                            drop(trial)
                        continue
                    cheap = preflight.cheap_checks(lane, space, cfg, shape, self.mode.requested)
                    if not cheap.feasible:
                        stale += 1
                        self.writer.add(self._row(lane, shape_name, shape, cfg, trial.number, "infeasible", cheap,
                                                  versions=versions, study=study_name))
                        counts["infeasible"] = counts.get("infeasible", 0) + 1
                        rejected_cheap.add(key)
                        tell(trial, PENALTY_MS, "infeasible", key, False)
                        continue
                    try:
                        owner = study_mod.claim(study, trial, key)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        taken_for_dead(trial)
                        stale += 1
                        continue
                    if owner is None and study_mod.rank(study, trial) >= target:
                        release(trial)  # workers that claimed earlier fill the target
                        break
                    if owner is not None:  # another worker holds this config
                        stale += 1
                        if owner.state == optuna.trial.TrialState.COMPLETE:
                            measured[key] = owner.value
                            tell(trial, owner.value, "duplicate", key, False)
                        else:
                            counts["taken"] = counts.get("taken", 0) + 1
                            drop(trial)
                        continue
                    pending.add(key)
                    queue.append((trial, cfg, key, pool.submit(lane, space, cfg, shape, self.mode.requested)))
                if not queue and exhaustive and req.sampler != "grid":
                    # A counted space whose sampler keeps proposing configs it has (TPE where few pass the
                    # rules): the feasible configs not yet tried go in, each once.
                    done = measured.keys() | pending | rejected_by_compile | enqueued
                    left = {k: c for c, v in zip(scanned, verdicts) if v.feasible
                            and (k := space_mod.config_key(lane.full_config(c))) not in done}
                    if left:
                        self.out(f"{lane.dsl:8s} {shape_name}: the sampler proposed nothing new in {stale} tries; "
                                 f"enqueueing the {len(left)} feasible config(s) not yet tried")
                        for k, c in left.items():
                            study.enqueue_trial(c)
                            enqueued.add(k)
                        stale = 0
                        continue
                if not queue:
                    self.out(f"{lane.dsl:8s} {shape_name}: no new feasible config proposed in {STALE_STREAK} tries; "
                             f"stopping")
                    break
                trial, cfg, key, fut = queue.popleft()
                pending.discard(key)
                verdict = preflight.Verdict(**fut.result())
                if not verdict.feasible:
                    status = "compile_error" if verdict.stage == "compile_error" else "infeasible"
                    row = self._row(lane, shape_name, shape, cfg, trial.number, status, verdict, versions=versions,
                                    study=study_name)
                    self.writer.add(row)
                    counts[status] = counts.get(status, 0) + 1
                    rejected_by_compile.add(key)
                    tell(trial, PENALTY_MS, status, key, status == "compile_error", row)
                    if status == "compile_error":
                        measured[key] = PENALTY_MS
                        bar.update(1)
                    continue
                stale = 0
                if self.mode.compile_only and verdict.compile_note:
                    # Nothing to compile ahead of time (a run-time library): one row says so, then stop.
                    verdict.reason = f"compile-only: nothing to compile ahead of time ({verdict.compile_note})"
                    self.writer.add(self._row(lane, shape_name, shape, cfg, trial.number, "infeasible", verdict,
                                              versions=versions, study=study_name))
                    counts["infeasible"] = counts.get("infeasible", 0) + 1
                    tell(trial, PENALTY_MS, "infeasible", key, False)
                    break
                if self.mode.compile_only:
                    result, status = {}, "compiled"
                else:
                    task = {"kind": "trial", "kernel": req.kernel, "dsl": lane.dsl, "config": cfg, "shape": shape,
                            "seed": req.seed * 100003 + trial.number, "l2_bytes": self.l2_bytes, "timing": req.timing,
                            "env": preflight.lane_cache_env(lane, self.mode.run_target)}
                    result = self.runner.run(task, req.timeout_s)
                    status = result["status"]
                row = self._row(lane, shape_name, shape, cfg, trial.number, status, verdict, result, versions=versions,
                                study=study_name)
                self.writer.add(row)
                counts[status] = counts.get(status, 0) + 1
                value = result.get("time_ms") if status == "ok" else PENALTY_MS
                tell(trial, value, status, key, True, row)
                measured[key] = value
                if status == "ok" and (best_val is None or value < best_val):
                    best_val = value
                bar.update(1)
                bar.set_postfix_str(f"best {best_val:.4f} ms" if best_val else "best -", refresh=False)
            for trial, *_ in queue:   # prefetched, not measured
                release(trial)
        finally:  # also when the loop fails: a held trial beats no longer, so another worker retries it
            beats.stop_all()
        bar.close()
        ok = {k: v for k, v in measured.items() if v < PENALTY_MS}
        summary = {"dsl": lane.dsl, "shape": shape_name, "measured": len(measured), "counts": counts,
                   "best_ms": min(ok.values()) if ok else None, "study": study_name}
        self.summary.append(summary)
        outcome = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "nothing new"
        self.out(f"{lane.dsl:8s} {shape_name}: {len(measured)} measured in the study ({len(measured) - done0} new); "
                 f"this run's outcomes: {outcome}; best "
                 + (f"{summary['best_ms']:.4f} ms" if ok else "- (no ok trial)"))
        # Without an ok trial of its own, a worker still names the study: another worker's may hold one.
        return (lane, json.loads(min(ok, key=ok.get)) if ok else None, versions, study_name)

    def _confirm_once(self, shape_name, shape, best: dict) -> None:
        """Confirm unless another worker of the same studies did (or will): the worker that finds no
        trial of them still running confirms, once per set of best configs (a claim, lab.study)."""
        import optuna
        entries = list(best.values())
        studies = [optuna.load_study(study_name=name, storage=self._storage) for *_, name in entries]
        if any(study_mod.trials(s, (optuna.trial.TrialState.RUNNING,)) for s in studies):
            self.out(f"confirm {shape_name}: other workers are still measuring; the last to finish confirms")
            return
        best = {}  # each lane's best as the study holds it now (other workers' trials included)
        for (lane, _, versions, name), s in zip(entries, studies):
            ok = [t for t in study_mod.trials(s, (optuna.trial.TrialState.COMPLETE,))
                  if t.user_attrs.get("measured") and t.user_attrs.get("status") == "ok"]
            if ok:
                top = min(ok, key=lambda t: t.value)   # ties: the lowest trial number (trials() sorts by it)
                best[lane.dsl] = (lane, json.loads(top.user_attrs["config_key"]), versions, name)
        if len(best) < 2:
            return
        names = sorted(s.study_name for s in studies)
        claims = optuna.create_study(storage=self._storage, load_if_exists=True, study_name=(
            f"{self.req.kernel}|confirm|{shape_name}|{hashlib.sha1('|'.join(names).encode()).hexdigest()[:12]}"))
        # Keyed by the best configs alone, not by how many trials the studies hold: a worker between two
        # trials holds none RUNNING, so another may confirm before that worker's last trial; with the
        # trial count in the key, that worker then confirmed the same bests a second time.
        key = json.dumps({"best": sorted((lane.dsl, cfg) for lane, cfg, _, _ in best.values())}, sort_keys=True)
        beats = study_mod.Heartbeats(self._storage)
        try:
            trial = study_mod.claim_alone(claims, key, beats)
            if trial is None:
                self.out(f"confirm {shape_name}: confirmed before (an earlier run or another worker) or being "
                         "confirmed now, for these best configs")
                return
            self._confirm(shape_name, shape, best)
            trial.set_user_attr("measured", True)
            claims.tell(trial, 0.0)
        finally:
            beats.stop_all()

    def _confirm(self, shape_name, shape, best: dict):
        """Re-time each lane's best config interleaved (A B A B ...) in one worker; rows phase=confirm."""
        import statistics
        from lab.timing import sample_summary
        entries = list(best.values())
        timing = {**self.req.timing, "budget_ms": 6000.0, "min_time_ms": 500.0, "min_samples": 50}
        task = {"kind": "abab", "kernel": self.req.kernel, "shape": shape, "seed": self.req.seed + 7,
                "lanes": [(lane.dsl, cfg, preflight.lane_cache_env(lane, self.mode.run_target))
                          for lane, cfg, _, _ in entries], "l2_bytes": self.l2_bytes,
                "timing": {**timing, **self.req.confirm_timing}}
        result = self.runner.run(task, self.req.timeout_s * 2)
        if result.get("status") != "ok":
            self.out(f"confirm {shape_name}: {result.get('status')}: {result.get('error', '')[:200]}")
            return
        for (lane, cfg, versions, study), samples in zip(entries, result["samples"]):
            res = sample_summary(samples, f"abab-{result.get('stop', '')}")
            self.writer.add(self._row(lane, shape_name, shape, cfg, -1, "ok", None, res, versions=versions,
                                      phase="confirm", study=study))
            self.out(f"confirm  {shape_name}: {lane.dsl:8s} {res['time_ms']:.4f} ms (IQR {res['time_iqr_ms']:.4f}, n={len(samples)}, "
                     f"{statistics.mean(samples):.4f} mean)")


def _safe_baseline(lane) -> bool:
    try:
        return lane.is_baseline
    except LabError:
        return False


class _NoBar:
    def update(self, n=1): pass
    def set_postfix_str(self, s, refresh=True): pass
    def close(self): pass


def _progress(enabled: bool, **kw):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(unit="trial", dynamic_ncols=True, **kw)


def run(req: SweepRequest, present: PresentGPU | None, runner=None, out=print) -> tuple[Sweep, list[dict]]:
    mode = resolve_mode(req.device, present, req.emulate, req.compile_only)
    sweep = Sweep(req, mode, runner=runner, out=out)
    if mode.emulated:
        out(f"EMULATED: configs limited to the {req.device} envelope (SMEM <= {mode.requested.smem_optin_bytes} B, "
            f"preflight compile for {mode.requested.target}); timings from {mode.actual_gpu}; rows marked emulated")
    return sweep, sweep.run()
