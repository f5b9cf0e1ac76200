"""Run candidates in a separate process that can be killed and replaced.

A compile error, an illegal memory access (which poisons the CUDA context), a hang or a wrong
answer in one candidate is recorded with its status and never takes the sweep down.

``execute(task)`` is what the worker process does for one task (also callable in-process);
``WorkerRunner`` owns the process, applies the timeout and restarts it after a timeout or crash.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

STATUSES = ("ok", "infeasible", "compile_error", "runtime_error", "timeout", "wrong_result", "compiled")

# Substrings of errors after which the CUDA context can no longer be trusted.
_STICKY = ("illegal memory access", "misaligned address", "unspecified launch failure", "illegal instruction",
           "device-side assert", "CUDA error", "an illegal", "hardware exception")


def _sync(device: str):
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# Allocation failures: a run-time outcome even in the first call (the compile phase), never a compile error.
_OOM = ("out of memory", "can't allocate memory", "OutOfMemoryError")


def _classify(exc: BaseException, phase: str) -> str:
    text = f"{type(exc).__name__}: {exc}"
    if any(s.lower() in text.lower() for s in _STICKY + _OOM):
        return "runtime_error"
    return "compile_error" if phase == "compile" else "runtime_error"


def exception_text(exc: BaseException) -> str:
    """``Type: message``; for an exception raised without a message (a TileLang AOT compile on the
    H100, 2026-11-26, recorded only ``RuntimeError:``), the file, line and function that raised it."""
    text = f"{type(exc).__name__}: {exc}".strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if not str(exc).strip() and frames:
        f = frames[-1]
        text += f" (no message; raised at {f.filename}:{f.lineno} in {f.name})"
    return text


def _err_text(exc: BaseException) -> str:
    lines = exception_text(exc).splitlines()
    return " | ".join(lines[:3] + (["..."] if len(lines) > 6 else []) + lines[-3:] if len(lines) > 6 else lines)[:1500]


def _parity_at(problem, run, shape, device, seed, tol, per):
    from lab import parity
    inputs = problem.make_inputs(shape, device, seed)
    outputs = problem.alloc_outputs(shape, device)
    run(inputs, outputs)
    _sync(device)
    ref = problem.reference(inputs, shape)
    ok, errors = parity.compare(outputs, ref, tol, per)
    return ok, errors


def parity_shapes(problem, task: dict) -> list[dict]:
    """The extra shapes a trial is checked at: the task's ``parity_shapes`` if it names them (each
    validated like any shape), else the problem's own for the timed shape."""
    if "parity_shapes" not in task:
        return problem.parity_shapes(task["shape"])
    for pshape in task["parity_shapes"]:
        problem.check_shape(pshape)
    return list(task["parity_shapes"])


def background_dsls() -> set[str]:
    """DSLs whose parity-shape builds start in a background thread while the timed shape builds and
    runs: ``LAB_BACKGROUND_BUILDS`` (a comma list; default none). Only for a lane whose ``build``
    compiles eagerly and may run beside itself in two threads (TileLang's: a trial at the bwd_bwd
    training shape spends ~30 s compiling each shape, one after the other; two TileLang builds in
    threads took 17.6 s against 32.2 s serially on a 2-core CPU)."""
    return {d.strip() for d in os.environ.get("LAB_BACKGROUND_BUILDS", "").split(",") if d.strip()}


def _start_builds(mod, config: dict, shapes: list[dict]) -> list:
    """One daemon thread building ``shapes`` in order; a Future per shape (its exception surfaces
    where the result is taken, as a build in the caller would raise there). Daemon: a trial that
    fails early does not wait for the builds it no longer needs."""
    import threading
    from concurrent.futures import Future

    futures = [Future() for _ in shapes]

    def work():
        for shape, fut in zip(shapes, futures):
            try:
                fut.set_result(mod.build(config, shape))
            except BaseException as exc:  # noqa: BLE001  (handed to the trial, which classifies it)
                fut.set_exception(exc)

    threading.Thread(target=work, daemon=True, name="lab-parity-builds").start()
    return futures


def run_trial(task: dict) -> dict:
    """Build, parity-check (timed shape + the problem's extra ragged shapes) and time one config.

    ``task["parity_shapes"]`` (a list of shapes), when present, replaces the problem's own extra
    shapes: a test picks small ones that cover the same code paths (the interpreter runs each step
    in Python); sweeps leave it out."""
    from lab import parity, problems, registry, timing

    device = task.get("device", "cuda")
    os.environ.update(task.get("env", {}))
    problem = problems.get(task["kernel"])
    lane = registry.get(task["dsl"], task["kernel"])
    mod = lane.module
    config, shape, seed = task["config"], task["shape"], task["seed"]
    tol = problem.tolerance(shape)
    per = problem.output_tolerances(shape)
    out: dict = {"tol_rel_l2": tol.rel_l2, "tol_rel_max": tol.rel_max}
    phase = "compile"
    try:
        checks = [(i, p) for i, p in enumerate(parity_shapes(problem, task)) if not mod.config_reason(config, p)]
        early = _start_builds(mod, config, [p for _, p in checks]) if task["dsl"] in background_dsls() else None
        run = mod.build(config, shape)
        inputs = problem.make_inputs(shape, device, seed)
        outputs = problem.alloc_outputs(shape, device)
        t0 = time.perf_counter()
        info = run(inputs, outputs)  # first call: JIT compile + launch
        _sync(device)
        out["compile_s"] = time.perf_counter() - t0
        if isinstance(info, dict):
            out.update({f"launch_{k}": v for k, v in info.items()})
        phase = "parity"
        ref = problem.reference(inputs, shape)
        ok, errors = parity.compare(outputs, ref, tol, per)
        out["parity"] = {k: vars(v) for k, v in errors.items()}
        out["parity_rel_l2"] = max(e.rel_l2 for e in errors.values())
        out["parity_rel_max"] = max(e.rel_max for e in errors.values())
        if not ok:
            return {**out, "status": "wrong_result", "error": parity.describe_failure(errors, tol, "timed shape", per)}
        checked = ["timed"]
        # A parity shape the config's rules refuse is left out; the timed shape still counts.
        for k, (i, pshape) in enumerate(checks):
            prun = early[k].result() if early is not None else mod.build(config, pshape)
            ok, errors = _parity_at(problem, prun, pshape, device, seed + 1 + i, tol,
                                    problem.output_tolerances(pshape))
            where = "x".join(str(pshape[d]) for d in problem.dims)
            checked.append(where)
            if not ok:
                return {**out, "status": "wrong_result", "error": parity.describe_failure(errors, tol, where, per)}
        out["parity_shapes"] = checked
        if task.get("no_timing"):
            return {**out, "status": "ok"}
        phase = "timing"
        # Timing inputs the parity run never saw; the last timed output is checked too.
        t_inputs = problem.make_inputs(shape, device, seed + 1000)
        t_outputs = problem.alloc_outputs(shape, device)
        clocks0 = timing.gpu_clocks() if device.startswith("cuda") else {}
        t = timing.bench(lambda: run(t_inputs, t_outputs), device=device, l2_bytes=task.get("l2_bytes", 0),
                         **task.get("timing", {}))
        clocks1 = timing.gpu_clocks() if device.startswith("cuda") else {}
        ok, errors = parity.compare(t_outputs, problem.reference(t_inputs, shape), tol, per)
        if not ok:
            return {**out, "status": "wrong_result",
                    "error": parity.describe_failure(errors, tol, "timed shape after timing (fresh inputs)", per)}
        out.update(time_ms=t.median_ms, time_q1_ms=t.q1_ms, time_q3_ms=t.q3_ms, time_iqr_ms=t.iqr_ms,
                   time_ci_half_ms=t.ci_half_ms, samples=t.n, samples_ms=t.samples_ms, timing_stop=t.stop,
                   graph_ms=t.graph_ms, graph_note=t.graph_note,
                   sm_clock_start_mhz=clocks0.get("sm_mhz"), sm_clock_end_mhz=clocks1.get("sm_mhz"))
        return {**out, "status": "ok"}
    except Exception as exc:
        status = _classify(exc, phase)
        return {**out, "status": status, "error": f"[{phase}] {_err_text(exc)}",
                "traceback": traceback.format_exc()[-4000:],
                "sticky": any(s.lower() in str(exc).lower() for s in _STICKY)}


def run_abab(task: dict) -> dict:
    """Re-time several (dsl, config) lanes interleaved sample by sample (A B A B ...), so that the
    comparison is made under the same clocks; returns each lane's samples. Every lane reads the same
    inputs and writes the same output tensors (the calls run one after another), so that no lane is
    timed on buffers at other addresses than the others'."""
    from lab import problems, registry, timing
    device = task.get("device", "cuda")
    os.environ.update(task.get("env", {}))
    problem = problems.get(task["kernel"])
    shape = task["shape"]
    inputs = problem.make_inputs(shape, device, task["seed"])
    outputs = problem.alloc_outputs(shape, device)
    fns = []
    for dsl, config, env in task["lanes"]:
        os.environ.update(env)  # the lane's per-target compile cache
        run = registry.get(dsl, task["kernel"]).module.build(config, shape)
        fns.append(lambda run=run: run(inputs, outputs))
    timings = timing.bench_interleaved(fns, device=device, l2_bytes=task.get("l2_bytes", 0), **task.get("timing", {}))
    return {"status": "ok", "samples": [t.samples_ms for t in timings], "stop": timings[0].stop}


def execute(task: dict) -> dict:
    if task.get("kind") == "abab":
        return run_abab(task)
    return run_trial(task)


def _serve(conn):
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        result = execute(task)
        conn.send(result)
        if result.get("sticky"):
            return  # the CUDA context is poisoned: exit, the parent starts a fresh worker


class WorkerRunner:
    """One persistent worker process; ``run(task, timeout_s)`` returns the result dict."""

    def __init__(self, device: str = "cuda", env: dict | None = None):
        self.device = device
        self.env = env or {}
        self.ctx = mp.get_context("spawn")
        self.proc = None
        self.conn = None
        self.restarts = 0

    def _start(self):
        parent, child = self.ctx.Pipe()
        old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            self.proc = self.ctx.Process(target=_serve, args=(child,), daemon=True)
            self.proc.start()
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self.conn = parent

    def _kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(10)
        self.proc, self.conn = None, None
        self.restarts += 1

    def run(self, task: dict, timeout_s: float) -> dict:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        task = {**task, "device": self.device}
        t0 = time.perf_counter()
        try:
            self.conn.send(task)
            if not self.conn.poll(timeout_s):
                self._kill()
                return {"status": "timeout", "error": f"no result within {timeout_s:g} s (worker killed)"}
            result = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            code = self.proc.exitcode if self.proc else None
            self._kill()
            return {"status": "runtime_error", "error": f"worker process died (exit code {code})"}
        result["wall_s"] = time.perf_counter() - t0
        if result.get("sticky"):
            self._kill()
        return result

    def close(self):
        if self.conn is not None:
            try:
                self.conn.send(None)
            except Exception:
                pass
        if self.proc is not None:
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
        self.proc = self.conn = None
