"""Preflight: decide, before any GPU work, whether a config can run on a target device profile.

Order of checks (each rejection is recorded with its reason and costs no compile):
  1. the sweep file's values and restrictions (``Lane.space_reason``), then the lane's arithmetic rules
     (``config_reason``);
  2. the lane's target rules (``target_reason``);
  3. the analytic shared-memory estimate against the profile's opt-in limit;
  4. an ahead-of-time compile for the profile's target (CPU only): the compiled shared memory
     against the limit. Compile results are cached on disk per lane version and target.
All sizes are bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from lab import identity
from lab.devices import DeviceProfile
from lab.registry import Lane
from lab.space import Space, config_key
from lab.worker import exception_text


@dataclass
class Verdict:
    feasible: bool
    reason: str = ""
    stage: str = ""                    # rules, target, estimate, compile, compile_error, ok
    smem_estimate: int | None = None
    smem_compiled: int | None = None
    smem_limit: int | None = None
    compile_s: float | None = None
    compile_note: str = ""             # why no compile-verified figure exists, when it does not
    registers: int | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def cache_dir() -> Path:
    return Path(os.environ.get("LAB_CACHE_DIR", Path.home() / ".cache" / "lab"))


def lane_cache_env(lane: Lane, target: str) -> dict:
    """Environment a lane wants for compiling for ``target``: its own per-target cache folders (the
    lane's optional ``cache_env(folder, target)``), so a binary for one target is never reused for
    another."""
    fn = getattr(lane.module, "cache_env", None)
    return dict(fn(cache_dir() / "dsl" / lane.dsl / target, target)) if fn else {}


def _cache_file(lane: Lane, target: str) -> Path:
    tag = hashlib.sha1(json.dumps(lane.module.versions(), sort_keys=True).encode()).hexdigest()[:10]
    tag += "-" + identity.lane_identity(lane.module_name)["lane_code"][:10]
    return cache_dir() / "preflight" / f"{lane.dsl}-{lane.kernel}-{target}-{tag}.json"


def compile_cached(lane: Lane, config: dict, shape: dict, target: str) -> dict:
    """AOT compile through the lane, memoized on disk. Returns the lane's compile dict, or
    ``{"error": text}`` when the compile failed, or ``{"unsupported": text}`` when the lane cannot
    compile ahead of time."""
    path = _cache_file(lane, target)
    key = config_key({"config": config, "shape": shape})
    try:
        cache = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    if key in cache:
        return cache[key]
    os.environ.update(lane_cache_env(lane, target))
    try:
        result = dict(lane.module.compile_for(config, shape, target))
    except NotImplementedError as exc:
        return {"unsupported": str(exc)}
    except Exception as exc:
        result = {"error": exception_text(exc)[:2000]}
    # Merge with what other processes wrote meanwhile, then replace atomically.
    try:
        cache = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    cache[key] = result
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache))
    os.replace(tmp, path)
    return result


def cheap_checks(lane: Lane, space: Space | None, config: dict, shape: dict, profile: DeviceProfile) -> Verdict:
    """Checks 1-3 (no compile)."""
    mod = lane.module
    limit = profile.smem_optin_bytes
    reason = (lane.space_reason(space, config) if space else None) or mod.config_reason(config, shape)
    if reason:
        return Verdict(False, reason, "rules", smem_limit=limit)
    reason = mod.eligibility(profile.target) or lane.target_reason(config, profile.target)
    shape_target = getattr(mod, "shape_target_reason", None)
    reason = reason or (shape_target(config, shape, profile.target) if shape_target else None)
    if reason:
        return Verdict(False, reason, "target", smem_limit=limit)
    est = mod.smem_estimate(config, shape, profile.target)
    if est is not None and est > limit:
        return Verdict(False, f"estimated shared memory {est} B > {profile.name} limit {limit} B", "estimate",
                       smem_estimate=est, smem_limit=limit)
    return Verdict(True, "", "estimate", smem_estimate=est, smem_limit=limit)


def check(lane: Lane, space: Space | None, config: dict, shape: dict, profile: DeviceProfile,
          compile: bool = True) -> Verdict:
    """All four checks; ``compile=False`` stops after the estimate."""
    v = cheap_checks(lane, space, config, shape, profile)
    if not v.feasible or not compile:
        return v
    t0 = time.perf_counter()
    res = compile_cached(lane, config, shape, profile.target)
    v.compile_s = res.get("compile_s", time.perf_counter() - t0)
    if "unsupported" in res:
        v.compile_note = res["unsupported"]
        v.stage = "ok"
        return v
    if "error" in res:
        v.feasible, v.stage, v.reason = False, "compile_error", res["error"]
        return v
    v.smem_compiled, v.registers = res.get("smem_bytes"), res.get("registers")
    if v.smem_compiled is not None and v.smem_compiled > v.smem_limit:
        v.feasible, v.stage = False, "compile"
        v.reason = f"compiled shared memory {v.smem_compiled} B > {profile.name} limit {v.smem_limit} B"
        return v
    v.stage = "ok"
    return v


def _check_in_process(args) -> dict:
    from lab import registry
    from lab.devices import get_profile
    dsl, kernel, space, config, shape, profile_name = args
    return check(registry.get(dsl, kernel), space, config, shape, get_profile(profile_name)).as_dict()


class CompilePool:
    """Runs :func:`check` for upcoming candidates in CPU processes while the GPU times others."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool = None
        if workers > 0:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor
            self._pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))

    def submit(self, lane: Lane, space: Space | None, config: dict, shape: dict, profile: DeviceProfile):
        args = (lane.dsl, lane.kernel, space, config, shape, profile.name)
        if self._pool is None:
            from concurrent.futures import Future
            fut: Future = Future()
            fut.set_result(_check_in_process(args))
            return fut
        return self._pool.submit(_check_in_process, args)

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


def _compile_in_process(args) -> dict:
    from lab import registry
    dsl, kernel, config, shape, target = args
    return compile_cached(registry.get(dsl, kernel), config, shape, target)


def summarize(lane: Lane, space: Space, shape: dict, profile: DeviceProfile, compile_limit: int | None,
              seed: int = 0, workers: int = 0) -> dict:
    """Preflight a whole space for ``lane`` on ``profile``: counts and estimate/compiler agreement.

    A space of more than ``space.SCAN_LIMIT`` points is judged on its seeds and a seeded sample of that
    many (``space_sampled``). With ``compile_limit`` set, only that many configs that pass the cheap
    checks (a seeded random sample) are compiled; the rest are judged by the estimate alone.
    ``workers`` > 0 compiles in that many CPU processes. ``rows`` holds every compiled config with its
    figures (bytes).
    """
    import random

    scanned, exhaustive = space.scan(seed=seed)
    configs = [lane.full_config(c) for c in scanned]
    cheap = [(c, cheap_checks(lane, space, c, shape, profile)) for c in configs]
    by_stage: dict[str, int] = {}
    for _, v in cheap:
        if not v.feasible:
            by_stage[v.stage] = by_stage.get(v.stage, 0) + 1
    passing = [c for c, v in cheap if v.feasible]
    # Over-limit estimates are also compiled (a sample) to see whether the estimate was too pessimistic.
    over = [c for c, v in cheap if v.stage == "estimate" and not v.feasible]
    rng = random.Random(seed)
    to_compile = passing + over
    if compile_limit is not None and len(to_compile) > compile_limit:
        to_compile = rng.sample(to_compile, compile_limit)
    results = _compile_all(lane, to_compile, shape, profile.target, workers)
    rows = []
    for c, res in zip(to_compile, results):
        est = lane.module.smem_estimate(c, shape, profile.target)
        rows.append({"config": c, "estimate": est, "compiled": res.get("smem_bytes"),
                     "registers": res.get("registers"), "error": res.get("error"),
                     "unsupported": res.get("unsupported")})
    compiled = [r for r in rows if r["compiled"] is not None]
    limit = profile.smem_optin_bytes
    fits_compiled = sum(1 for r in compiled if r["compiled"] <= limit)
    disagree = [r for r in compiled if r["estimate"] is not None and r["estimate"] != r["compiled"]]
    wrong_side = [r for r in compiled if r["estimate"] is not None
                  and (r["estimate"] <= limit) != (r["compiled"] <= limit)]
    unsupported = next((r["unsupported"] for r in rows if r["unsupported"]), None)
    return {"space": len(configs), "space_size": space.size, "space_sampled": not exhaustive, "rejected": by_stage,
            "fit_estimate": len(passing), "over_estimate": len(over),
            "sampled": len(to_compile), "unsupported": unsupported,
            "compiled": len(compiled), "compile_errors": sum(1 for r in rows if r["error"]),
            "fit_compiled": fits_compiled, "agree_exact": len(compiled) - len(disagree),
            "disagree": disagree, "wrong_side_of_limit": wrong_side, "rows": rows, "limit": limit}


def _compile_all(lane: Lane, configs: list[dict], shape: dict, target: str, workers: int) -> list[dict]:
    if not configs:
        return []
    first = compile_cached(lane, configs[0], shape, target)
    if first.get("unsupported"):
        return [first]  # the lane has no ahead-of-time compile at all
    rest = configs[1:]
    if workers <= 1 or not rest:
        return [first] + [compile_cached(lane, c, shape, target) for c in rest]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return [first] + list(pool.map(_compile_in_process,
                                       [(lane.dsl, lane.kernel, c, shape, target) for c in rest]))


def _reason_group(reason: str) -> str:
    """A reason with the config's own numbers masked (``BLOCK_M=256 must be ...`` -> ``BLOCK_M=… must be
    ...``), so that configs refused by the same rule fall in one group; restrictions stay as written."""
    if reason.startswith("restriction:"):
        return reason
    return re.sub(r"\b(\w+)=-?\d[\w.]*", r"\1=…", reason)


def rejection_summary(verdicts: list[Verdict], profile: DeviceProfile, top: int = 4) -> str:
    """Why configs failed the cheap checks, by kind: how many the SMEM estimate puts over ``profile``'s
    limit and by how much (min / max excess, bytes), how many broke which rule (grouped by rule text, the
    ``top`` most frequent named) and how many the target refused (likewise). Feasible verdicts are ignored."""
    def grouped(stage: str, label: str) -> str | None:
        counts = Counter(_reason_group(v.reason) for v in verdicts if not v.feasible and v.stage == stage)
        if not counts:
            return None
        named = [f"{n} '{text}'" for text, n in counts.most_common(top)]
        rest = len(counts) - top
        return (f"{sum(counts.values())} {label} (" + ", ".join(named)
                + (f", and {rest} other reason{'s' * (rest > 1)}" if rest > 0 else "") + ")")

    parts = []
    over = [v.smem_estimate - v.smem_limit for v in verdicts
            if not v.feasible and v.stage == "estimate" and v.smem_estimate is not None and v.smem_limit is not None]
    if over:
        by = f"{min(over):,} B" if min(over) == max(over) else f"{min(over):,} to {max(over):,} B"
        parts.append(f"{len(over)} over the {profile.name} limit of {profile.smem_optin_bytes:,} B by estimate (by {by})")
    parts += [p for p in (grouped("rules", "broke rules"), grouped("target", "refused by target")) if p]
    known = {"estimate", "rules", "target"}
    other = Counter(v.stage or "?" for v in verdicts if not v.feasible and v.stage not in known)
    parts += [f"{n} rejected at stage {stage}" for stage, n in sorted(other.items())]
    return f"{len(verdicts):,} configs checked: " + "; ".join(parts) if parts else f"{len(verdicts):,} configs checked"
