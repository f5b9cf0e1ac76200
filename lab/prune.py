"""Which knob values of a lane's search space the committed results support (`python -m lab prune`).

A value is supported when some ok, measured row that used it is within ``within`` (default 5%) of the
lane's fastest ok row at the same shape, device profile and emulation. Every other value of the sweep
file is a pruning candidate: "slower" (measured in at least ``min_rows`` ok rows, never within the
margin), "thin" (fewer rows: one bad row may owe its time to the other knobs of its config) or
"unmeasured" (no ok row ever used it). Rows of every commit count: a value that once won under older
code is kept until a sweep says otherwise. A row whose config lacks a knob ran with the lane's
DEFAULTS at the row's commit (read from git); where that commit's DEFAULTS do not name the knob either
(it did not exist yet), the row says nothing about it.
"""
from __future__ import annotations

import ast
import functools
import json
import subprocess
from dataclasses import dataclass

import pandas as pd

from lab import identity, registry
from lab.devices import LabError
from lab.space import load_space


@dataclass(frozen=True)
class Support:
    knob: str
    value: object
    in_space: bool          # the value is in the sweep file now
    ok_rows: int            # measured ok rows that used it
    best_ratio: float | None  # min over (shape, device) of its fastest time / the lane's fastest there
    where: str              # the (device, shape) of best_ratio

    def verdict(self, within: float, min_rows: int = 3) -> str:
        if self.best_ratio is None:
            return "unmeasured"
        if self.best_ratio <= 1 + within:
            return "keep"
        return "slower" if self.ok_rows >= min_rows else "thin"


@functools.lru_cache(maxsize=None)
def defaults_at(path: str, commit: str) -> dict:
    """The ``DEFAULTS = {...}`` literal of the file at ``path`` (relative to the checkout) at ``commit``;
    {} when git or the literal cannot be read."""
    try:
        for node in ast.parse(identity.git_reader(commit)(path) or "").body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DEFAULTS" for t in node.targets):
                return ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError, subprocess.SubprocessError):
        pass
    return {}


def _measured(df: pd.DataFrame, kernel: str, dsl: str) -> pd.DataFrame:
    ok = df[(df["kernel"] == kernel) & (df["dsl"] == dsl) & (df["status"] == "ok")
            & ~df["compile_only"].astype(bool) & df["time_ms"].notna()].copy()
    ok["group"] = (ok["requested_profile"].astype(str)
                   + [f" (emulated on {g})" if e else "" for e, g in zip(ok["emulated"], ok["actual_gpu"])]
                   + " " + ok["shape"].astype(str))
    ok["lane_best"] = ok.groupby("group")["time_ms"].transform("min")
    ok["ratio"] = ok["time_ms"] / ok["lane_best"]
    path = f"kernels/{dsl}/{kernel}.py"
    ok["config"] = [{**defaults_at(path, str(commit)), **json.loads(cfg or "{}")}
                    for cfg, commit in zip(ok["config_json"], ok["git_commit"])]
    return ok


def support(df: pd.DataFrame, kernel: str, dsl: str) -> list[Support]:
    """One entry per (knob, value) of the sweep file, plus values the results used that it no longer has."""
    lane = registry.get(dsl, kernel)
    space = load_space(kernel, dsl, tuple(lane.module.TUNABLES))
    ok = _measured(df, kernel, dsl)
    out = []
    for knob, values in space.params.items():
        seen = ok[ok["config"].map(lambda c: knob in c)]
        keyed = seen.assign(v=seen["config"].map(lambda c: json.dumps(c[knob])))
        used = {json.loads(v) for v in keyed["v"].unique()}
        for value in list(values) + [v for v in used if v not in values]:
            rows = keyed[keyed["v"] == json.dumps(value)]
            if rows.empty:
                out.append(Support(knob, value, value in values, 0, None, ""))
                continue
            best = rows.loc[rows["ratio"].idxmin()]
            out.append(Support(knob, value, value in values, len(rows), float(best["ratio"]), best["group"]))
    return out


def render(entries: list[Support], kernel: str, dsl: str, within: float, min_rows: int = 3) -> str:
    lines = [f"{dsl}/{kernel}: knob values vs the lane's fastest ok row per shape and device "
             f"(supported: within {within:.0%}; slower: in {min_rows}+ ok rows, never within)",
             f"{'knob':<18} {'value':<12} {'ok rows':>7} {'best ratio':>10}  verdict     where"]
    for e in entries:
        ratio = "-" if e.best_ratio is None else f"{e.best_ratio:.3f}"
        verdict = e.verdict(within, min_rows) + ("" if e.in_space else " (not in space)")
        lines.append(f"{e.knob:<18} {json.dumps(e.value):<12} {e.ok_rows:>7} {ratio:>10}  {verdict:<11} {e.where}")
    for kind in ("slower", "thin", "unmeasured"):
        hits = [e for e in entries if e.in_space and e.verdict(within, min_rows) == kind]
        lines.append(f"{kind}: {len(hits)} value(s) of the sweep file" +
                     (": " + ", ".join(f"{e.knob}={json.dumps(e.value)}" for e in hits) if hits else ""))
    return "\n".join(lines)


def report(df: pd.DataFrame, kernel: str, dsls: list[str], within: float, min_rows: int = 3) -> str:
    if not 0 <= within < 1:
        raise LabError(f"--within must be in [0, 1), got {within}")
    parts = []
    for dsl in dsls:
        lane = registry.get(dsl, kernel)
        if lane.is_baseline and not lane.module.TUNABLES:
            continue
        parts.append(render(support(df, kernel, dsl), kernel, dsl, within, min_rows))
    return "\n\n".join(parts)
