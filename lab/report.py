"""Markdown summary and PNG plots from result tables (``python -m lab report results/``).

Per (requested device, emulated, kernel, shape): the best ok config per DSL with its median time,
IQR, TFLOP/s, % of the running device's peak, SMEM, and the ratio to the baseline lane (cuBLAS
for GEMM). Where A/B confirm rows exist, ratios come from them (same process, alternating).
Verdicts FASTER / SLOWER / SAME compare interquartile ranges: SAME when they overlap.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from lab.results import load


def _verdict(a_q1, a_q3, b_q1, b_q3) -> str:
    if a_q3 < b_q1:
        return "FASTER"
    if a_q1 > b_q3:
        return "SLOWER"
    return "SAME"


def best_per_dsl(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (device, emulated, kernel, shape, dsl): the config to show and its timings.

    Where runs re-timed their best configs A/B (phase=confirm), the newest such run decides: its
    confirmed config per DSL, with the interleaved timings (confirm_*), so that every lane of the
    table was timed side by side in one run. A DSL without a confirm row in that run shows its best
    sweep trial. ``sweep_best_ms`` is the lowest sweep median of the DSL over all runs."""
    group = ["requested_profile", "emulated", "kernel", "shape"]
    keys = group + ["dsl"]
    ok = df[(df["status"] == "ok") & (df["phase"] == "sweep")]
    if ok.empty:
        return ok
    best = ok.loc[ok.groupby(keys)["time_ms"].idxmin()].copy()
    best["sweep_best_ms"] = best["time_ms"]
    conf = df[(df["phase"] == "confirm") & (df["status"] == "ok")]
    cols = {"time_ms": "confirm_ms", "time_q1_ms": "confirm_q1_ms", "time_q3_ms": "confirm_q3_ms",
            "samples": "confirm_n", "run_id": "confirm_run"}
    out = []
    for gkey, g in best.groupby(group):
        c = conf[(conf[group] == pd.Series(gkey, index=group)).all(axis=1)] if not conf.empty else conf
        if c.empty:
            out.append(g.assign(**{v: float("nan") for v in cols.values()}))
            continue
        newest = c.loc[c["time_utc"].idxmax(), "run_id"]
        c = c[c["run_id"] == newest]
        rows = []
        for _, r in g.iterrows():
            cr = c[c["dsl"] == r["dsl"]]
            if cr.empty:
                rows.append(r.to_dict() | {v: float("nan") for v in cols.values()})
                continue
            cr = cr.iloc[-1]
            same = ok[(ok[keys] == pd.Series(tuple(gkey) + (r["dsl"],), index=keys)).all(axis=1)
                      & (ok["config_json"] == cr["config_json"])].sort_values("time_utc")
            base = same.iloc[-1].to_dict() if not same.empty else r.to_dict()
            base["sweep_best_ms"] = r["sweep_best_ms"]
            rows.append(base | {v: cr[k] for k, v in cols.items()})
        out.append(pd.DataFrame(rows))
    return pd.concat(out, ignore_index=True)


def with_ratios(best: pd.DataFrame) -> pd.DataFrame:
    """Adds the headline timing (A/B confirm when every lane of the shape has one, else the sweep),
    the rates at that timing, ratio_to_baseline (baseline time / lane time: >1 is faster than the
    baseline) and the FASTER / SLOWER / SAME verdict."""
    out = []
    for _, g in best.groupby(["requested_profile", "emulated", "kernel", "shape"]):
        g = g.copy()
        use_confirm = g["confirm_ms"].notna().all()
        src = ("confirm_ms", "confirm_q1_ms", "confirm_q3_ms", "confirm_n") if use_confirm else \
              ("time_ms", "time_q1_ms", "time_q3_ms", "samples")
        g["head_ms"], g["head_q1_ms"], g["head_q3_ms"], g["head_n"] = (g[c] for c in src)
        g["timing_source"] = "A/B confirm" if use_confirm else "sweep"
        scale = g["time_ms"] / g["head_ms"]  # rates scale inversely with time
        for c in ("tflops", "gbs", "pct_peak_tflops"):
            g[f"head_{c}"] = g[c] * scale
        base = g[g["baseline"] == True]  # noqa: E712 (pandas)
        if base.empty:
            g["ratio_to_baseline"], g["vs_baseline"] = float("nan"), ""
        else:
            b = base.iloc[0]
            g["ratio_to_baseline"] = b["head_ms"] / g["head_ms"]
            g["vs_baseline"] = [_verdict(r["head_q1_ms"], r["head_q3_ms"], b["head_q1_ms"], b["head_q3_ms"])
                                if not r["baseline"] else "baseline" for _, r in g.iterrows()]
        out.append(g)
    return pd.concat(out) if out else best


def _fmt(x, spec):
    return "-" if x is None or (isinstance(x, float) and pd.isna(x)) else format(x, spec)


def _config_text(cfg_json: str) -> str:
    cfg = json.loads(cfg_json or "{}")
    return " ".join(f"{k}={v}" for k, v in cfg.items()) or "(library)"


def markdown(df: pd.DataFrame) -> str:
    lines = ["# Kernel lab report", ""]
    if df.empty:
        return "\n".join(lines + ["No result rows."])
    runs = df.groupby("run_id").agg(time=("time_utc", "min"), gpu=("actual_gpu", "first"),
                                    req=("requested_profile", "first"), emu=("emulated", "first"),
                                    commit=("git_commit", "first"), rows=("status", "size"))
    lines += ["## Runs", "", "| run | started (UTC) | requested | GPU that ran | emulated | commit | rows |",
              "|---|---|---|---|---|---|---|"]
    for rid, r in runs.iterrows():
        lines.append(f"| {rid} | {r.time} | {r.req} | {r.gpu} | {bool(r.emu)} | {str(r.commit)[:10]} | {r.rows} |")
    lines.append("")
    best = with_ratios(best_per_dsl(df))
    for (dev, emu, kernel), g in df.groupby(["requested_profile", "emulated", "kernel"]):
        gpu = ", ".join(sorted(set(g["actual_gpu"])))
        title = f"## {kernel} on {dev}" + (f" (EMULATED on {gpu})" if emu else f" ({gpu})")
        lines += [title, ""]
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
        b = best[(best["requested_profile"] == dev) & (best["emulated"] == emu) & (best["kernel"] == kernel)] \
            if not best.empty else best
        for shape, gs in g.groupby("shape"):
            dims = json.loads(gs["shape_json"].iloc[0])
            bs = b[b["shape"] == shape] if not b.empty else b
            source = bs["timing_source"].iloc[0] if not bs.empty else "sweep"
            lines += [f"### {shape} `{' '.join(f'{k}={v}' for k, v in dims.items())}`", "",
                      f"| DSL | median ms ({source}) | IQR ms | n | sweep best ms | TFLOP/s | % peak | GB/s | vs baseline "
                      f"| ratio | SMEM B: estimate / compiled ({gs['preflight_target'].iloc[0]}) / launched "
                      f"({gs['compile_target'].iloc[0]}) | regs | spills | parity rel_l2 (tol) | config |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for _, r in bs.sort_values("head_ms").iterrows():
                smem = " / ".join(_fmt(r.get(c), ",.0f") for c in ("smem_estimate_bytes", "smem_compiled_bytes", "smem_launched_bytes"))
                lines.append(
                    f"| {r['dsl']} | {_fmt(r['head_ms'], '.4f')} | {_fmt(r['head_q3_ms'] - r['head_q1_ms'], '.4f')} | "
                    f"{_fmt(r['head_n'], '.0f')} | {_fmt(r['sweep_best_ms'], '.4f')} | {_fmt(r['head_tflops'], '.1f')} | "
                    f"{_fmt(r['head_pct_peak_tflops'], '.1f')} | {_fmt(r['head_gbs'], '.0f')} | "
                    f"{r.get('vs_baseline', '')} | {_fmt(r.get('ratio_to_baseline'), '.3f')} | {smem} | "
                    f"{_fmt(r.get('registers'), '.0f')} | {_fmt(r.get('spills'), '.0f')} | "
                    f"{_fmt(r['parity_rel_l2'], '.2e')} ({_fmt(r['tol_rel_l2'], 'g')}) | {_config_text(r['config_json'])} |")
            for _, r in gs[gs["phase"] == "eligibility"].drop_duplicates("dsl").iterrows():
                lines.append(f"| {r['dsl']} | - | - | - | - | - | - | - | - | - | - | - | {r['error']} |")
            if shape in counts.index:
                c = counts.loc[shape]
                lines += ["", "Trials by status: " + "; ".join(
                    f"{dsl}: " + ", ".join(f"{s} {int(n)}" for s, n in row.items() if n) for dsl, row in c.iterrows())]
            if not bs.empty:
                runs = ", ".join(sorted(set(bs["confirm_run"].dropna()))) if source == "A/B confirm" else "sweep rows"
                lines.append(f"Timing and ratios from: {source} ({runs}; ratio = baseline time / lane time; verdict "
                             f"by IQR overlap). Sweep best = the DSL's lowest sweep median over all runs.")
            lines += _worst_parity(gs)
            drift = gs["clock_drift"].fillna(False).astype(bool).sum()
            if drift:
                lines.append(f"WARNING: {drift} rows had SM clock drift > 10% between start and end of timing.")
            lines.append("")
    return "\n".join(lines) + "\n"


def _worst_parity(gs: pd.DataFrame) -> list[str]:
    """For kernels with several outputs: the worst relative errors per output over every parity-checked
    trial of each DSL at this shape (rel_l2 / rel_max, from each row's parity_json)."""
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
    lines = ["", "Worst relative error per output over the parity-checked trials at this shape (rel_l2 / rel_max; n trials):", "",
             "| DSL | n | " + " | ".join(outs) + " |", "|---|---|" + "---|" * len(outs)]
    for dsl, per in sorted(worst.items()):
        n = max(v[2] for v in per.values())
        lines.append(f"| {dsl} | {n} | " + " | ".join(
            f"{per[o][0]:.1e} / {per[o][1]:.1e}" if o in per else "-" for o in outs) + " |")
    return lines


def plots(df: pd.DataFrame, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = with_ratios(best_per_dsl(df))
    files = []
    if best.empty:
        return files
    for (dev, emu, kernel), g in best.groupby(["requested_profile", "emulated", "kernel"]):
        tag = f"{kernel}_{dev}" + ("_emulated" if emu else "")
        shapes = list(dict.fromkeys(g["shape"]))
        dsls = sorted(set(g["dsl"]))
        for metric, ylabel, name in (("head_tflops", "TFLOP/s (best config)", "tflops"),
                                     ("ratio_to_baseline", "speed vs baseline (>1 faster)", "ratio")):
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
            ax.set_title(f"{kernel} on {dev}" + (" (emulated)" if emu else ""))
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
    df = load(path)
    out = out or path / "report"
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(df)
    pngs = plots(df, out) if not df.empty else []
    if pngs:
        md += "\n## Plots\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    (out / "report.md").write_text(md)
    return out / "report.md"
