"""Markdown summary and PNG plots from result tables (``python -m lab report results/``).

Per (requested device, emulated, GPU that ran, kernel, shape): one row per DSL with its median time (ms), IQR,
TFLOP/s, % of the running device's peak, SMEM (bytes), and the ratio to a reference lane: the
baseline lane when it is a library a user would pick (cuBLAS for GEMM), else (the lane declares
``BASELINE_KIND = "reference"``, see lab/registry.py, or there is no baseline) the fastest lane at
that shape, named in the table. Each DSL is judged on its rows of the checkout's lane code and
toolchain (``gate.Freshness``) where it has any there, else on all its rows, marked "(older code)".
Its headline is its best A/B confirm (lowest confirm median) among those rows, unless a sweep found a
config clearly faster than the confirmed one since (``lab.headline``), else its best sweep trial among
them; the ``timing`` column says which, per row, and the note under the table names the confirm runs.
Verdicts FASTER / SLOWER / SAME compare interquartile ranges: SAME when they overlap.
Rows of ``--compile-only`` runs (no timings) get their own section: what compiled, what fits.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from lab import registry
from lab.devices import match_profile
from lab.results import NOT_RUN_PHASES, load

# The GPU is part of the group: a profile emulated on two GPUs (GB10 on an H100, later on an H200) gives two
# tables, so that no ratio sets one GPU's timing against another's.
GROUP = ["requested_profile", "emulated", "actual_gpu", "kernel", "shape"]
KEYS = GROUP + ["dsl"]
CONFIRM_COLS = {"time_ms": "confirm_ms", "time_q1_ms": "confirm_q1_ms", "time_q3_ms": "confirm_q3_ms",
                "time_ci_half_ms": "confirm_ci_half_ms", "samples": "confirm_n", "run_id": "confirm_run"}
HEAD_COLS = ["head_ms", "head_q1_ms", "head_q3_ms", "head_ci_half_ms", "head_n", "timing_source", "head_tflops",
             "head_gbs", "head_pct_peak_tflops", "ratio_to_baseline", "vs_baseline", "ratio_ref", "ratio_kind",
             "is_reference"]


def _verdict(a_q1, a_q3, b_q1, b_q3) -> str:
    if a_q3 < b_q1:
        return "FASTER"
    if a_q1 > b_q3:
        return "SLOWER"
    return "SAME"


def compile_only_mask(df: pd.DataFrame) -> pd.Series:
    """Rows of ``--compile-only`` runs (no timings)."""
    return df["compile_only"].eq(True)


def best_per_dsl(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (device, emulated, GPU, kernel, shape, dsl) of the timed runs: the config to show.

    Candidate rows of each (device, emulated, GPU, kernel, shape, dsl): its ok sweep and confirm rows of the
    checkout's lane code and toolchain (``gate.Freshness``) where it has any, else all its ok rows;
    ``fresh`` says which. From the candidates: the best A/B confirm (lowest confirm median; phase=confirm)
    gives the timings (confirm_*, ms) unless a later sweep superseded it (``lab.headline``), and the
    other columns (SMEM, registers, parity) come from that confirm run's own sweep row of that config,
    else the newest candidate sweep row of that config before the confirm (a later run of the same config
    may have measured other code), else the newest one, else the confirm row itself. A DSL without a
    standing confirm among its candidates shows its best sweep trial (confirm_* NaN). ``sweep_best_ms`` is
    the lowest sweep median among the candidates (NaN if none)."""
    from lab import gate, headline
    timed = _with_gpu(df[~compile_only_mask(df)])
    ok = timed[(timed["status"] == "ok") & timed["time_ms"].notna() & timed["phase"].isin(("sweep", "confirm"))]
    empty = {"sweep_best_ms": pd.Series(dtype=float), "fresh": pd.Series(dtype=bool)} \
        | {v: pd.Series(dtype=float) for v in CONFIRM_COLS.values()}
    if ok.empty:
        return ok.assign(**empty)
    fresh = gate.Freshness().mask(ok)
    has_fresh = fresh.groupby([ok[k] for k in KEYS], dropna=False).transform("any").astype(bool)
    ok = ok[fresh | ~has_fresh]
    rows = []
    for _, g in ok.groupby(KEYS, sort=True):
        sweep, conf = g[g["phase"] == "sweep"], g[g["phase"] == "confirm"]
        c = headline.standing_confirm(conf, sweep)
        if c is None:
            row = sweep.loc[sweep["time_ms"].idxmin()].to_dict() | {v: float("nan") for v in CONFIRM_COLS.values()}
        else:
            same = sweep[sweep["config_json"] == c["config_json"]]
            # The code that the confirm timed: its own run's row, else the newest row before it.
            own = same[same["run_id"] == c["run_id"]]
            before = same[same["time_utc"] <= c["time_utc"]]
            same = next((x for x in (own, before, same) if not x.empty), same).sort_values("time_utc")
            row = (same.iloc[-1] if not same.empty else c).to_dict()
            row |= {v: c[k] for k, v in CONFIRM_COLS.items()}
        rows.append(row | {"sweep_best_ms": sweep["time_ms"].min() if not sweep.empty else float("nan"),
                           "fresh": bool(fresh[g.index[0]])})
    return pd.DataFrame(rows)


def headline_configs(df: pd.DataFrame, kernel: str, device: str, emulated: bool,
                     gpu: str | None = None) -> dict[tuple[str, str], dict]:
    """{(dsl, shape): config} of the report's headline row of each tuned lane of ``kernel`` on the requested
    ``device`` profile (native or emulated), timed on ``gpu`` (a torch device name) where given, else on
    any GPU (the fastest headline where several GPUs ran it): what ``sweep --seed-best`` measures first."""
    if df.empty:
        return {}
    df = df[(df["kernel"] == kernel) & (df["requested_profile"] == device) & (df["emulated"] == bool(emulated))]
    if gpu is not None:
        df = df[df["actual_gpu"] == gpu]
    best = best_per_dsl(df)
    if best.empty:
        return {}
    # slowest first, so that where several GPUs ran a lane at a shape the fastest headline is the one kept
    best = best.assign(_t=best["confirm_ms"].fillna(best["time_ms"])).sort_values("_t", ascending=False)
    return {(r["dsl"], r["shape"]): json.loads(r["config_json"] or "{}")
            for _, r in best.iterrows() if not bool(r["baseline"])}


def _reference_lane(g: pd.DataFrame) -> tuple[pd.Series, str]:
    """(row, kind): the library baseline ("baseline"), else the fastest lane of ``g`` ("fastest")."""
    from lab import registry
    base = g[g["baseline"] == True]  # noqa: E712 (pandas)
    if not base.empty and registry.baseline_kind(base["dsl"].iloc[0], base["kernel"].iloc[0]) == "library":
        return base.iloc[0], "baseline"
    return g.loc[g["head_ms"].idxmin()], "fastest"


def with_ratios(best: pd.DataFrame) -> pd.DataFrame:
    """Adds each row's headline timing (ms): its A/B confirm where ``best_per_dsl`` found one, else its
    sweep trial (``timing_source`` "A/B confirm" or "sweep"), the rates at that timing,
    ``ratio_to_baseline`` (reference time / lane time: > 1 is faster than the reference), the
    FASTER / SLOWER / SAME verdict ``vs_baseline``, and which lane is the reference: ``ratio_ref`` (its
    DSL) and ``ratio_kind`` ("baseline": a library baseline; "fastest": the fastest lane, where the
    baseline lane is a slow reference or absent). ``is_reference`` marks such a lane."""
    from lab import registry
    if best.empty:
        return best.assign(**{c: pd.Series(dtype=object) for c in HEAD_COLS})
    out = []
    for _, g in best.groupby(GROUP):
        g = g.copy()
        confirmed = g["confirm_ms"].notna()
        for head, c_col, s_col in (("head_ms", "confirm_ms", "time_ms"), ("head_q1_ms", "confirm_q1_ms", "time_q1_ms"),
                                   ("head_q3_ms", "confirm_q3_ms", "time_q3_ms"),
                                   ("head_ci_half_ms", "confirm_ci_half_ms", "time_ci_half_ms"),
                                   ("head_n", "confirm_n", "samples")):
            g[head] = g[c_col].where(confirmed, g[s_col]).astype(float)
        g["timing_source"] = confirmed.map({True: "A/B confirm", False: "sweep"})
        scale = g["time_ms"] / g["head_ms"]  # rates scale inversely with time
        for c in ("tflops", "gbs", "pct_peak_tflops"):
            g[f"head_{c}"] = g[c] * scale
        ref, kind = _reference_lane(g)
        g["ratio_ref"], g["ratio_kind"] = ref["dsl"], kind
        g["ratio_to_baseline"] = ref["head_ms"] / g["head_ms"]
        g["vs_baseline"] = [kind if r["dsl"] == ref["dsl"] else
                            _verdict(r["head_q1_ms"], r["head_q3_ms"], ref["head_q1_ms"], ref["head_q3_ms"])
                            for _, r in g.iterrows()]
        g["is_reference"] = [bool(r["baseline"] == True) and registry.baseline_kind(r["dsl"], r["kernel"]) == "reference"  # noqa: E712
                             for _, r in g.iterrows()]
        out.append(g)
    return pd.concat(out, ignore_index=True)


def compile_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (requested device, kernel, shape, dsl) of ``--compile-only`` runs: configs proposed, rejected
    before compiling (rules, target, estimate), compiled for the target, how many fit the device's limit
    (``smem_limit`` bytes) as compiled, the smallest compiled shared memory (bytes), compile errors (with
    the first one) and a note (a lane that ran nothing, or has nothing to compile ahead)."""
    cols = ["requested_profile", "kernel", "shape", "dsl", "target", "smem_limit", "proposed",
            "rejected_before_compile", "compiled", "fit", "min_compiled_smem", "compile_errors", "first_error", "note"]
    co = df[compile_only_mask(df)]
    rows = []
    for (dev, kernel, shape, dsl), g in co.groupby(["requested_profile", "kernel", "shape", "dsl"]):
        sw = g[g["phase"] == "sweep"]
        nothing = sw["error"].fillna("").str.startswith("compile-only:")
        notes = list(dict.fromkeys(g.loc[g["phase"].isin(NOT_RUN_PHASES), "error"].tolist()
                                   + sw.loc[nothing, "error"].tolist()))
        sw = sw[~nothing]
        compiled = sw[(sw["status"] == "compiled") | sw["smem_compiled_bytes"].notna()]
        errors = sw[sw["status"] == "compile_error"]
        rows.append({"requested_profile": dev, "kernel": kernel, "shape": shape, "dsl": dsl,
                     "target": g["preflight_target"].iloc[0], "smem_limit": g["smem_limit_bytes"].max(),
                     "proposed": len(sw), "rejected_before_compile": len(sw) - len(compiled) - len(errors),
                     "compiled": len(compiled), "fit": int((sw["status"] == "compiled").sum()),
                     "min_compiled_smem": compiled["smem_compiled_bytes"].min(),
                     "compile_errors": len(errors), "first_error": errors["error"].iloc[0] if len(errors) else "",
                     "note": "; ".join(str(n) for n in notes)})
    return pd.DataFrame(rows, columns=cols)


def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and pd.isna(x)) else format(x, spec)


def _config_text(cfg_json: str, reference: bool = False) -> str:
    cfg = json.loads(cfg_json or "{}")
    return " ".join(f"{k}={v}" for k, v in cfg.items()) or ("(reference)" if reference else "(library)")


def _mode(r) -> str:
    return "compile-only" if r.co == True else ("emulated" if r.emu == True else "native")  # noqa: E712


def markdown(df: pd.DataFrame) -> str:
    lines = ["# Kernel lab report", ""]
    if df.empty:
        return "\n".join(lines + ["No result rows."])
    runs = df.groupby("run_id").agg(time=("time_utc", "min"), gpu=("actual_gpu", "first"),
                                    req=("requested_profile", "first"), emu=("emulated", "first"),
                                    co=("compile_only", "first"), commit=("git_commit", "first"),
                                    rows=("status", "size"))
    lines += ["## Runs", "", "| run | started (UTC) | requested | GPU that ran | mode | commit | rows |",
              "|---|---|---|---|---|---|---|"]
    for rid, r in runs.iterrows():
        lines.append(f"| {rid} | {r.time} | {r.req} | {r.gpu} | {_mode(r)} | {str(r.commit)[:10]} | {r.rows} |")
    lines.append("")
    timed = _with_gpu(df[~compile_only_mask(df)])
    best = with_ratios(best_per_dsl(timed))
    for (dev, emu, gpu, kernel), g in timed.groupby(["requested_profile", "emulated", "actual_gpu", "kernel"]):
        lines += _device_section(dev, emu, gpu, kernel, g, best)
    lines += _compile_only_section(compile_summary(df))
    return "\n".join(lines) + "\n"


def _device_section(dev, emu, gpu, kernel, g: pd.DataFrame, best: pd.DataFrame) -> list[str]:
    lines = [f"## {kernel} on {dev}" + (f" (EMULATED on {gpu})" if emu else f" ({gpu})"), ""]
    if emu:
        lines += [f"Configs limited to the {dev} envelope (preflight for {g['preflight_target'].iloc[0]}); "
                  f"timings are from {gpu}, with that GPU's own code generation. The baseline library runs "
                  f"unconstrained on that GPU.", ""]
        ok = g[(g["status"] == "ok") & (g["phase"] == "sweep")]
        over = ok[ok["smem_launched_bytes"] > ok["smem_limit_bytes"]]
        if not over.empty:
            lines += [f"Note: {len(over)} of {len(ok)} ok trials launched a binary using more shared memory on "
                      f"{gpu} than the {dev} limit ({', '.join(sorted(set(over['dsl'])))}): the same config "
                      f"compiles differently per target, so these timings are not {dev} timings.", ""]
    counts = g[g["phase"] == "sweep"].groupby(["shape", "dsl", "status"]).size().unstack(fill_value=0)
    b = best[(best["requested_profile"] == dev) & (best["emulated"] == emu) & (best["actual_gpu"] == gpu)
             & (best["kernel"] == kernel)]
    for shape, gs in g.groupby("shape"):
        lines += _shape_table(shape, gs, b[b["shape"] == shape], counts)
    return lines


def _shape_table(shape, gs: pd.DataFrame, bs: pd.DataFrame, counts: pd.DataFrame) -> list[str]:
    dims = json.loads(gs["shape_json"].iloc[0])
    if bs.empty:
        ref_label = "baseline"
    else:
        ref_label = f"{bs['ratio_kind'].iloc[0]} ({bs['ratio_ref'].iloc[0]})"
    lines = [f"### {shape} `{' '.join(f'{k}={v}' for k, v in dims.items())}`", "",
             f"| DSL | median ms | IQR ms | n | timing | sweep best ms | TFLOP/s | % peak | GB/s | vs {ref_label} "
             f"| ratio | SMEM B: estimate / compiled ({gs['preflight_target'].iloc[0]}) / launched "
             f"({gs['compile_target'].iloc[0]}) | regs | spills | parity rel_l2 (tol) | config |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in bs.sort_values("head_ms").iterrows():
        smem = " / ".join(_fmt(r.get(c), ",.0f") for c in ("smem_estimate_bytes", "smem_compiled_bytes", "smem_launched_bytes"))
        lines.append(
            f"| {_lane_name(r)} | {_fmt(r['head_ms'], '.4f')} | {_fmt(r['head_q3_ms'] - r['head_q1_ms'], '.4f')} | "
            f"{_fmt(r['head_n'], '.0f')} | {r['timing_source']} | {_fmt(r['sweep_best_ms'], '.4f')} | "
            f"{_fmt(r['head_tflops'], '.1f')} | {_fmt(r['head_pct_peak_tflops'], '.1f')} | {_fmt(r['head_gbs'], '.0f')} | "
            f"{r['vs_baseline']} | {_fmt(r['ratio_to_baseline'], '.3f')} | {smem} | "
            f"{_fmt(r.get('registers'), '.0f')} | {_fmt(r.get('spills'), '.0f')} | "
            f"{_fmt(r['parity_rel_l2'], '.2e')} ({_fmt(r['tol_rel_l2'], 'g')}) | {_config_text(r['config_json'], r['is_reference'])} |")
    # A lane that ran nothing here (not importable, ineligible, no feasible config) is listed only when no
    # run of it succeeded at this shape and device.
    ran = set(gs.loc[gs["status"] == "ok", "dsl"]) | set(bs["dsl"])
    idle = gs[gs["phase"].isin(NOT_RUN_PHASES) & ~gs["dsl"].isin(ran)]
    for _, r in idle.sort_values("time_utc").drop_duplicates("dsl", keep="last").sort_values("dsl").iterrows():
        lines.append(f"| {r['dsl']} |" + " - |" * 14 + f" {r['error']} |")
    if shape in counts.index:
        c = counts.loc[shape]
        lines += ["", "Trials by status: " + "; ".join(
            f"{dsl}: " + ", ".join(f"{s} {int(n)}" for s, n in row.items() if n) for dsl, row in c.iterrows())]
    if not bs.empty:
        lines.append(_timing_note(bs))
    lines += _worst_parity(gs[gs["status"] == "ok"])
    drift = gs["clock_drift"].fillna(False).astype(bool).sum()
    if drift:
        lines.append(f"WARNING: {drift} rows had SM clock drift > 10% between start and end of timing.")
    lines.append("")
    return lines


def _lane_name(r) -> str:
    return (r["dsl"] + (" (reference)" if r["is_reference"] else "")
            + ("" if r.get("fresh", True) else " (older code)"))


def _timing_note(bs: pd.DataFrame) -> str:
    """What the table's timings and ratios are: which lanes from which A/B confirm run, which from the sweep."""
    kind, ref = bs["ratio_kind"].iloc[0], bs["ratio_ref"].iloc[0]
    if kind == "baseline":
        what = f"ratio = baseline ({ref}) time / lane time"
    else:
        refs = bs[bs["is_reference"]]["dsl"].tolist()
        why = (f"the {', '.join(refs)} lane is a slow reference, not a library baseline" if refs
               else "no library baseline in this table")
        what = f"ratio = fastest lane ({ref}) time / lane time; {why}"
    conf = bs[bs["timing_source"] == "A/B confirm"]
    swept = sorted(bs.loc[bs["timing_source"] != "A/B confirm", "dsl"])
    parts = []
    if not conf.empty:
        runs = conf.groupby("confirm_run")["dsl"].agg(lambda d: ", ".join(sorted(d)))
        parts.append("A/B confirm, each lane's best: " + "; ".join(f"{dsls} in run {run}" for run, dsls in runs.items())
                     + (" (lanes from different confirm runs were not interleaved with each other)" if len(runs) > 1 else ""))
    if swept:
        parts.append(f"sweep, each lane's best trial (no A/B confirm among its rows): {', '.join(swept)}")
    older = sorted(bs.loc[~bs["fresh"].astype(bool), "dsl"]) if "fresh" in bs else []
    rows_of = ("A lane's rows are those of today's lane code and toolchain, or all its rows where it has none"
               + (f" (marked older code: {', '.join(older)})" if older else "") + ".")
    return (f"Timing and ratios from: {'; '.join(parts)}; {what}; verdict by IQR overlap. {rows_of} "
            f"Sweep best = the lane's lowest sweep median among its rows.")


def _compile_only_section(summary: pd.DataFrame) -> list[str]:
    if summary.empty:
        return []
    lines = ["## Compile-only runs", "",
             "Preflight and ahead-of-time compiles for the requested device's target, nothing timed. Fit = compiled "
             "and within the device's shared-memory limit (the lane's figure for the target).", ""]
    for (dev, kernel), g in summary.groupby(["requested_profile", "kernel"]):
        targets = ", ".join(sorted(set(g["target"].dropna())))
        limit = _fmt(g["smem_limit"].max(), ",.0f")
        lines += [f"### {kernel} for {dev} ({targets}, limit {limit} B)", "",
                  "| shape | DSL | configs proposed | rejected before compile | compiled | fit the limit "
                  "| smallest compiled SMEM B | compile errors | note |", "|---|---|---|---|---|---|---|---|---|"]
        for _, r in g.iterrows():
            err = f"{r['compile_errors']}" + (f" (first: {r['first_error'][:160]})" if r["compile_errors"] else "")
            lines.append(f"| {r['shape']} | {r['dsl']} | {r['proposed']} | {r['rejected_before_compile']} | "
                         f"{r['compiled']} | {r['fit']} | {_fmt(r['min_compiled_smem'], ',.0f')} | {err} | "
                         f"{r['note'] or ''} |")
        lines.append("")
    return lines


def _worst_parity(gs: pd.DataFrame) -> list[str]:
    """For kernels with several outputs: the worst relative errors per output over the ok trials of each
    DSL at this shape (rel_l2 / rel_max, from each row's parity_json). Failed trials are left out."""
    worst: dict[str, dict[str, list[float]]] = {}
    for _, r in gs[gs["parity_json"].notna()].iterrows():
        try:
            per = json.loads(r["parity_json"])
        except (TypeError, ValueError):
            continue
        if not isinstance(per, dict) or len(per) < 2:
            continue
        for out, e in per.items():
            w = worst.setdefault(r["dsl"], {}).setdefault(out, [0.0, 0.0, 0])
            w[0], w[1], w[2] = max(w[0], e["rel_l2"]), max(w[1], e["rel_max"]), w[2] + 1
    if not worst:
        return []
    outs = list(next(iter(worst.values())))
    lines = ["", "Worst relative error per output over the ok trials at this shape (rel_l2 / rel_max; n trials):", "",
             "| DSL | n | " + " | ".join(outs) + " |", "|---|---|" + "---|" * len(outs)]
    for dsl, per in sorted(worst.items()):
        n = max(v[2] for v in per.values())
        lines.append(f"| {dsl} | {n} | " + " | ".join(
            f"{per[o][0]:.1e} / {per[o][1]:.1e}" if o in per else "-" for o in outs) + " |")
    return lines


def _with_gpu(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with ``actual_gpu`` filled ("unknown GPU"), so that grouping by it drops no row."""
    return df.assign(actual_gpu=df["actual_gpu"].fillna("unknown GPU")) if "actual_gpu" in df else df


def _gpu_tag(gpu: str) -> str:
    """A short name for a GPU in file names: its profile (h100, h200), else its name in lower case, '_' for
    anything but letters and digits."""
    return match_profile(gpu) or "".join(c if c.isalnum() else "_" for c in gpu.lower())


def plots(df: pd.DataFrame, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = with_ratios(best_per_dsl(df))
    files = []
    if best.empty:
        return files
    for (dev, emu, gpu, kernel), g in best.groupby(["requested_profile", "emulated", "actual_gpu", "kernel"]):
        # emulated: named by the GPU that ran it too (e.g. gb10_emulated_on_h200)
        on = _gpu_tag(gpu)
        tag = f"{kernel}_{dev}" + (f"_emulated_on_{on}" if emu else "")
        shapes = list(dict.fromkeys(g["shape"]))
        dsls = sorted(set(g["dsl"]))
        vs = "baseline (>1 faster)" if set(g["ratio_kind"]) == {"baseline"} else "fastest lane (1 = fastest)"
        for metric, ylabel, name in (("head_tflops", "TFLOP/s (best config)", "tflops"),
                                     ("ratio_to_baseline", f"speed vs {vs}", "ratio")):
            if g[metric].isna().all():
                continue
            fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(shapes) * max(1, len(dsls)) / 2), 4))
            width = 0.8 / max(1, len(dsls))
            for i, dsl in enumerate(dsls):
                vals = [g[(g["shape"] == s) & (g["dsl"] == dsl)][metric].max() for s in shapes]
                vals = [0.0 if pd.isna(v) else v for v in vals]
                ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=dsl)
            if name == "ratio":
                ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xticks([x + width * (len(dsls) - 1) / 2 for x in range(len(shapes))])
            ax.set_xticklabels(shapes, rotation=20, ha="right")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{kernel} on {dev}" + (f" (emulated on {gpu})" if emu else ""))
            ax.legend()
            fig.tight_layout()
            path = out / f"{tag}_{name}.png"
            fig.savefig(path, dpi=110)
            plt.close(fig)
            files.append(path)
    return files


def write(path: Path, out: Path | None = None) -> Path:
    from lab.devices import LabError
    if not path.exists():
        raise LabError(f"no such results folder: {path}")
    df = registry.registered_rows(load(path))
    out = out or path / "report"
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(df)
    pngs = plots(df, out) if not df.empty else []
    for old in {*out.glob("*_tflops.png"), *out.glob("*_ratio.png")} - set(pngs):
        old.unlink()   # a plot of an earlier report that this one no longer draws (e.g. a renamed group)
    if pngs:
        md += "\n## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    (out / "report.md").write_text(md)
    return out / "report.md"
