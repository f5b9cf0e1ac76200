"""Tables behind results/analysis.ipynb, shaped from ``lab.results.load`` output (pure pandas).

Each function returns a DataFrame (empty, with its columns, when no row qualifies). Times are in ms,
shared memory in bytes, errors relative (see lab/parity.py), and speeds are ratios: the fastest
lane's time / the lane's time (1 = the fastest lane at that shape and device, 0.5 = twice as slow).
Headline times are the report's (lab/report.py, ``best_per_dsl``): each DSL's best A/B confirm among
its rows of today's lane code (all its rows where it has none) while it stands (lab/headline.py), else
its best sweep trial among them; ``timing_source`` says which, per lane.
"""
from __future__ import annotations

import json

import pandas as pd

from lab import report

DEVICE = ["requested_profile", "emulated", "actual_gpu"]   # the GPU too: see lab/report.py GROUP
SHAPE = DEVICE + ["kernel", "shape"]


def _empty(cols: list[str]) -> pd.DataFrame:
    return pd.DataFrame(columns=cols)


def headline(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (device, emulated, kernel, shape, dsl): the report's headline config and timing."""
    return report.with_ratios(report.best_per_dsl(df))


def best_lanes(df: pd.DataFrame) -> pd.DataFrame:
    """Per (device, emulated, kernel, shape): the fastest lane (``best_dsl``, headline median ``best_ms``,
    its config and ``timing_source``), the runner-up and ``margin`` = runner-up ms / best ms (> 1), and
    how many lanes ran."""
    cols = SHAPE + ["best_dsl", "best_ms", "runner_up", "runner_up_ms", "margin", "lanes", "timing_source", "config"]
    h = headline(df)
    rows = []
    for key, g in h.groupby(SHAPE):
        g = g.sort_values("head_ms")
        first = g.iloc[0]
        second = g.iloc[1] if len(g) > 1 else None
        rows.append(dict(zip(SHAPE, key)) | {
            "best_dsl": first["dsl"], "best_ms": first["head_ms"],
            "runner_up": second["dsl"] if second is not None else "",
            "runner_up_ms": second["head_ms"] if second is not None else float("nan"),
            "margin": second["head_ms"] / first["head_ms"] if second is not None else float("nan"),
            "lanes": len(g), "timing_source": first["timing_source"], "config": first["config_json"]})
    return pd.DataFrame(rows, columns=cols) if rows else _empty(cols)


def relative_speed(df: pd.DataFrame) -> pd.DataFrame:
    """Per (device, emulated, kernel, shape, dsl): headline median ``ms`` and ``speed`` = fastest ms / ms,
    with two intervals from the lane's own spread (the fastest lane's time held fixed): ``speed_lo`` /
    ``speed_hi`` from the 95% CI of its median (ms +- ci_half) and ``speed_q_lo`` / ``speed_q_hi`` from
    its quartiles (q3, q1). NaN where the figure is missing."""
    cols = SHAPE + ["dsl", "ms", "q1_ms", "q3_ms", "ci_half_ms", "fastest_dsl", "speed", "speed_lo", "speed_hi",
                    "speed_q_lo", "speed_q_hi", "timing_source"]
    h = headline(df)
    if h.empty:
        return _empty(cols)
    h = h.rename(columns={"head_ms": "ms", "head_q1_ms": "q1_ms", "head_q3_ms": "q3_ms", "head_ci_half_ms": "ci_half_ms"})
    for c in ("ms", "q1_ms", "q3_ms", "ci_half_ms"):
        h[c] = pd.to_numeric(h[c], errors="coerce")
    fastest = h.loc[h.groupby(SHAPE)["ms"].idxmin(), SHAPE + ["ms", "dsl"]].rename(
        columns={"ms": "fastest_ms", "dsl": "fastest_dsl"})
    h = h.merge(fastest, on=SHAPE)
    h["speed"] = h["fastest_ms"] / h["ms"]
    h["speed_lo"] = h["fastest_ms"] / (h["ms"] + h["ci_half_ms"])
    low = h["ms"] - h["ci_half_ms"]
    h["speed_hi"] = (h["fastest_ms"] / low).where(low > 0)
    h["speed_q_lo"] = h["fastest_ms"] / h["q3_ms"]
    h["speed_q_hi"] = h["fastest_ms"] / h["q1_ms"]
    return h[cols].sort_values(SHAPE + ["speed"], ascending=[True] * len(SHAPE) + [False]).reset_index(drop=True)


def _config_changes(a: str, b: str) -> str:
    ca, cb = json.loads(a or "{}"), json.loads(b or "{}")
    return ", ".join(f"{k} {ca.get(k, '-')}->{cb.get(k, '-')}" for k in sorted(set(ca) | set(cb))
                     if ca.get(k) != cb.get(k))


def device_comparison(df: pd.DataFrame, native: str = "h100", emulated: str = "gb10") -> pd.DataFrame:
    """Per (kernel, shape, dsl) with a headline on both: the ``native`` device's (not emulated) and the
    ``emulated`` device's (rows marked emulated) best median (ms) and config, ``changes`` (the config keys
    that differ, "key a->b"), each DSL's rank at that shape on each device (1 = fastest) and ``slowdown`` =
    emulated ms / native ms (the cost of the emulated device's envelope, timed on the native GPU: emulated
    rows from another GPU are left out)."""
    cols = ["kernel", "shape", "dsl", "native_ms", "emulated_ms", "slowdown", "native_rank", "emulated_rank",
            "config_changed", "changes", "native_config", "emulated_config"]
    h = headline(df)
    if h.empty:
        return _empty(cols)
    h = h.assign(rank=h.groupby(SHAPE)["head_ms"].rank(method="min"))
    keep = ["kernel", "shape", "dsl", "actual_gpu", "head_ms", "rank", "config_json"]
    nat = h[(h["requested_profile"] == native) & (h["emulated"] != True)][keep]  # noqa: E712
    emu = h[(h["requested_profile"] == emulated) & (h["emulated"] == True)][keep]  # noqa: E712
    m = nat.merge(emu, on=["kernel", "shape", "dsl", "actual_gpu"], suffixes=("_n", "_e"))
    if m.empty:
        return _empty(cols)
    out = pd.DataFrame({
        "kernel": m["kernel"], "shape": m["shape"], "dsl": m["dsl"], "native_ms": m["head_ms_n"],
        "emulated_ms": m["head_ms_e"], "slowdown": m["head_ms_e"] / m["head_ms_n"],
        "native_rank": m["rank_n"].astype(int), "emulated_rank": m["rank_e"].astype(int),
        "config_changed": m["config_json_n"] != m["config_json_e"],
        "changes": [_config_changes(a, b) for a, b in zip(m["config_json_n"], m["config_json_e"])],
        "native_config": m["config_json_n"], "emulated_config": m["config_json_e"]})
    return out[cols].sort_values(["kernel", "shape", "native_rank"]).reset_index(drop=True)


def device_winners(comparison: pd.DataFrame) -> pd.DataFrame:
    """Per (kernel, shape) of a :func:`device_comparison` table: the DSL(s) ranked first on the native and
    on the emulated device (joined with ", " on a tie; empty when the winner ran on one device only)."""
    cols = ["kernel", "shape", "native_winner", "emulated_winner", "same_winner"]
    if comparison.empty:
        return _empty(cols)
    keys = ["kernel", "shape"]

    def first(rank: str) -> pd.Series:
        return comparison[comparison[rank] == 1].groupby(keys)["dsl"].agg(lambda d: ", ".join(sorted(d)))
    out = comparison[keys].drop_duplicates().set_index(keys)
    out["native_winner"] = first("native_rank")
    out["emulated_winner"] = first("emulated_rank")
    out = out.fillna("").reset_index()
    out["same_winner"] = (out["native_winner"] == out["emulated_winner"]) & (out["native_winner"] != "")
    return out[cols]

def parity_errors(df: pd.DataFrame) -> pd.DataFrame:
    """Per (device, emulated, kernel, shape, dsl, output): the worst ``rel_l2`` and ``rel_max`` over the ok
    trials (any phase with parity figures, from ``parity_json``) and ``n`` (trials). Failed trials are left
    out: their errors describe a wrong answer, not the lane's accuracy."""
    cols = SHAPE + ["dsl", "output", "rel_l2", "rel_max", "n"]
    ok = df[(df["status"] == "ok") & df["parity_json"].notna()]
    recs = []
    for _, r in ok.iterrows():
        try:
            per = json.loads(r["parity_json"])
        except (TypeError, ValueError):
            continue
        if not isinstance(per, dict):
            continue
        for out, e in per.items():
            recs.append({**{c: r[c] for c in SHAPE + ["dsl"]}, "output": out,
                         "rel_l2": e.get("rel_l2"), "rel_max": e.get("rel_max")})
    if not recs:
        return _empty(cols)
    long = pd.DataFrame(recs)
    g = long.groupby(SHAPE + ["dsl", "output"], sort=False)
    return g.agg(rel_l2=("rel_l2", "max"), rel_max=("rel_max", "max"), n=("rel_l2", "size")).reset_index()[cols]


def convergence(df: pd.DataFrame) -> pd.DataFrame:
    """Per (device, emulated, kernel, shape, dsl): its ok sweep trials in the order they ran (time_utc,
    then trial number; every run and study of the lane), numbered ``n`` = 1, 2, ..., with ``time_ms`` and
    ``best_ms``, the lowest median so far."""
    cols = SHAPE + ["dsl", "n", "time_ms", "best_ms", "run_id", "trial"]
    ok = df[(df["phase"] == "sweep") & (df["status"] == "ok") & df["time_ms"].notna()
            & ~report.compile_only_mask(df)]
    if ok.empty:
        return _empty(cols)
    ok = ok.sort_values(["time_utc", "trial"])
    keys = SHAPE + ["dsl"]
    ok = ok.assign(n=ok.groupby(keys).cumcount() + 1, best_ms=ok.groupby(keys)["time_ms"].cummin())
    return ok[cols].sort_values(keys + ["n"]).reset_index(drop=True)


def smem_points(df: pd.DataFrame) -> pd.DataFrame:
    """Configs with both a preflight estimate and a compiled figure of shared memory per CTA (bytes), once
    per (kernel, dsl, shape, config, preflight target): ``estimate``, ``compiled``, the target device's
    ``limit``, ``error`` = estimate - compiled (> 0: the estimate was pessimistic) and ``wrong_side`` (the
    estimate and the compiler disagree on whether the config fits the limit)."""
    cols = ["kernel", "dsl", "shape", "requested_profile", "preflight_target", "estimate", "compiled", "limit",
            "error", "wrong_side", "config_json"]
    has = df[df["smem_estimate_bytes"].notna() & df["smem_compiled_bytes"].notna()]
    if has.empty:
        return _empty(cols)
    has = has.drop_duplicates(["kernel", "dsl", "shape", "config_json", "preflight_target"])
    out = has.rename(columns={"smem_estimate_bytes": "estimate", "smem_compiled_bytes": "compiled",
                              "smem_limit_bytes": "limit"})
    out = out.assign(error=out["estimate"] - out["compiled"],
                     wrong_side=(out["estimate"] <= out["limit"]) != (out["compiled"] <= out["limit"]))
    return out[cols].reset_index(drop=True)


def run_best(rows: pd.DataFrame) -> tuple[str | None, float | None, str]:
    """The best config of one lane at one shape in one run: its A/B-confirmed median when the run
    confirmed one, else its fastest ok sweep trial; (config_json, ms, "confirm" | "sweep")."""
    ok = rows[(rows["status"] == "ok") & rows["time_ms"].notna()]
    for phase in ("confirm", "sweep"):
        p = ok[ok["phase"] == phase]
        if not p.empty:
            r = p.sort_values("time_ms").iloc[0]
            return r["config_json"], float(r["time_ms"]), phase
    return None, None, ""


def measured_twice(rows: pd.DataFrame) -> int:
    """Sweep rows of ``rows`` whose (kernel, dsl, shape, config) another row already measured. A config
    the preflight rejects (``infeasible``) is not a measurement: each worker of a shared study records its
    own rejection, with no compile and no GPU time."""
    sw = rows[(rows["phase"] == "sweep") & (rows["status"] != "infeasible")]
    return int(sw.duplicated(["kernel", "dsl", "shape", "config_json"]).sum())


def compare_runs(a: pd.DataFrame, b: pd.DataFrame, noise: float = 0.03) -> pd.DataFrame:
    """Two sweeps of the same study size side by side (rows of run(s) ``a`` and of run(s) ``b``), one row
    per (kernel, dsl, shape): configs each measured (sweep phase, every status), configs measured more
    than once within one side (``twice``, see measured_twice: must be 0), each side's best config and
    median (ms, see run_best), ``ratio`` = b's best / a's best and ``verdict``: same config, within noise
    (|ratio - 1| <= ``noise``) or differs."""
    key = ["kernel", "dsl", "shape"]
    cols = key + ["configs_a", "configs_b", "twice", "ms_a", "ms_b", "ratio", "verdict", "config_a", "config_b"]
    groups = sorted(set(map(tuple, a[key].values)) | set(map(tuple, b[key].values)))
    recs = []
    for k in groups:
        ga = a[(a[key] == pd.Series(k, index=key)).all(axis=1)]
        gb = b[(b[key] == pd.Series(k, index=key)).all(axis=1)]
        sa, sb = ga[ga["phase"] == "sweep"], gb[gb["phase"] == "sweep"]
        (ca, ma, _), (cb, mb, _) = run_best(ga), run_best(gb)
        ratio = mb / ma if ma and mb else None
        verdict = ("same config" if ca is not None and ca == cb else
                   "within noise" if ratio is not None and abs(ratio - 1) <= noise else "differs")
        recs.append(dict(zip(key, k)) | {
            "configs_a": sa["config_json"].nunique(), "configs_b": sb["config_json"].nunique(),
            "twice": measured_twice(ga) + measured_twice(gb),
            "ms_a": ma, "ms_b": mb, "ratio": ratio, "verdict": verdict, "config_a": ca, "config_b": cb})
    return pd.DataFrame(recs, columns=cols) if recs else _empty(cols)
