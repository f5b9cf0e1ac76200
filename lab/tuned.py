"""Tuned configs for the code that ships the kernels: results/tuned/<device>.json and ``best``.

``export`` writes one file per device profile with, per (kernel, DSL, shape), the best parity-checked
config: among the rows measured with the checkout's lane code and toolchain where there are any (else
the rows whose configs name only knobs the lane still has), the fastest A/B-confirmed one where there
are confirm rows and no sweep since found a clearly faster config (``lab.headline``), else the fastest
sweep trial (``timing`` says which), its median (ms), the run it
came from and the lane identity and toolchain it was measured with, plus ``fresh``: whether that
identity is still the checkout's (``lab.gate``).
Rows of a GB10 profile emulated on another GPU keep ``emulated: true`` and the GPU that ran them.

    from lab import tuned
    cfg = tuned.best("gemm", "triton", "h100", "sq4096_bf16").config
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab import gate, headline, identity, registry
from lab.devices import LabError, get_profile

FORMAT = "lab.tuned/1"
DEFAULT_DIR = identity.ROOT / "results" / "tuned"


def _pick(rows: pd.DataFrame) -> tuple[pd.Series, str]:
    sweep = rows[rows["phase"] == "sweep"]
    c = headline.standing_confirm(rows[rows["phase"] == "confirm"], sweep)
    if c is not None:
        return c, "confirm"
    pool, timing = (sweep, "sweep") if not sweep.empty else (rows, str(rows["phase"].iloc[0]))
    return pool.sort_values(["time_ms", "time_utc"]).iloc[0], timing


def _runnable(rows: pd.DataFrame, lane, device: str) -> pd.DataFrame:
    """The rows whose config names only knobs the checkout's lane still has (a stale row of a removed
    knob is a config today's code cannot run) and, emulated, that the lane accepts for the profile's
    target (``gate.emulated_misfits``). All rows when none qualifies or the lane does not import here."""
    try:
        knobs = set(lane.module.TUNABLES)
    except LabError:
        return rows
    keep = rows[[set(json.loads(c or "{}")) <= knobs for c in rows["config_json"]]]
    keep = keep.drop(index=list(gate.emulated_misfits(keep, lane, get_profile(device).target)))
    return keep if not keep.empty else rows


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def entries(df: pd.DataFrame, device: str) -> list[dict]:
    """The export's entries for one device profile, sorted by kernel, DSL, shape."""
    ok = gate.ok_rows(df)
    ok = ok[ok["requested_profile"] == device] if not ok.empty else ok
    out = []
    freshness = gate.Freshness()
    for (kernel, dsl, shape), rows in ok.groupby(["kernel", "dsl", "shape"], sort=True):
        lane = registry.get(dsl, kernel)
        module = lane.module_name
        # Rows of the checkout's code and toolchain first: an older confirm does not outrank them; else
        # rows of configs today's lane can run.
        fresh = rows[freshness.mask(rows)]
        r, timing = _pick(fresh if not fresh.empty else _runnable(rows, lane, device))
        versions = json.loads(r["versions_json"] or "{}")
        measured = gate.measured_identity(module, versions, str(r["git_commit"]), bool(r["git_dirty"]))
        dims = json.loads(r["shape_json"] or "{}")
        same = rows[rows["config_json"] == r["config_json"]]["parity_rel_l2"].dropna()  # confirm rows skip parity
        out.append({
            "kernel": kernel, "dsl": dsl, "shape": shape, "dims": dims, "config": json.loads(r["config_json"]),
            "median_ms": _num(r["time_ms"]), "iqr_ms": _num(r["time_iqr_ms"]), "timing": timing,
            "parity_rel_l2": _num(same.max()) if not same.empty else None, "run_id": r["run_id"], "time_utc": r["time_utc"],
            "git_commit": r["git_commit"], "actual_gpu": r["actual_gpu"], "emulated": bool(r["emulated"]),
            "compile_target": r["compile_target"],
            "toolchain": {k: v for k, v in sorted(versions.items()) if k not in ("lane_sha", "lane_code", "lane_files", "lane_hash")},
            "lane_files": measured["lane_files"] if measured else None,
            "fresh": freshness.fresh(r),
        })
    return out


def export(df: pd.DataFrame, out_dir: Path = DEFAULT_DIR, devices: list[str] | None = None) -> list[Path]:
    """Writes <out_dir>/<device>.json for each device (default: every profile with ok rows)."""
    ok = gate.ok_rows(df)
    for d in devices or []:
        get_profile(d)
    names = list(devices) if devices else sorted(set(ok["requested_profile"].dropna())) if not ok.empty else []
    if not names:
        raise LabError("no ok rows to export")
    paths = []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for device in names:
        rows = entries(df, device)
        doc = {"format": FORMAT, "device": device, "newest_row_utc": max((e["time_utc"] for e in rows), default=None),
               "entries": rows}
        path = out_dir / f"{device}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
        paths.append(path)
    return paths


@dataclass(frozen=True)
class Tuned:
    """A tuned config. ``exact`` is False only for a nearest-shape answer, which ``label`` describes."""
    config: dict
    kernel: str
    dsl: str
    device: str
    shape: str
    dims: dict
    median_ms: float | None
    run_id: str
    fresh: bool
    exact: bool
    label: str


def _distance(a: dict, b: dict) -> float:
    """Sum of |log ratio| over the numeric dims both shapes have; inf when other dims differ."""
    if any(a.get(k) != b.get(k) for k in a.keys() & b.keys() if not isinstance(a[k], (int, float)) or isinstance(a[k], bool)):
        return math.inf
    return sum(abs(math.log(max(a[k], 1) / max(b[k], 1))) for k in a.keys() & b.keys()
               if isinstance(a[k], (int, float)) and not isinstance(a[k], bool))


def load(device: str, path: Path | None = None) -> dict:
    get_profile(device)
    f = Path(path or DEFAULT_DIR) / f"{device}.json"
    try:
        doc = json.loads(f.read_text())
    except FileNotFoundError:
        raise LabError(f"no tuned configs for device {device!r}: {f} is missing (python -m lab export)") from None
    if doc.get("format") != FORMAT:
        raise LabError(f"{f}: format {doc.get('format')!r}, expected {FORMAT!r}")
    return doc


def best(kernel: str, dsl: str, device: str, shape: str | dict, nearest: bool = False,
         path: Path | None = None) -> Tuned:
    """The tuned config of ``kernel`` in ``dsl`` on ``device`` at a named shape or exact dims.
    Raises LabError when that shape has none, unless ``nearest`` asks for the closest measured shape
    (same non-numeric dims such as dtype; returned with ``exact=False`` and a label)."""
    doc = load(device, path)
    mine = [e for e in doc["entries"] if e["kernel"] == kernel and e["dsl"] == dsl]
    if not mine:
        have = sorted({(e["kernel"], e["dsl"]) for e in doc["entries"]})
        raise LabError(f"no tuned {kernel}/{dsl} on {device} (have: {', '.join('/'.join(h) for h in have) or 'none'})")
    hit = [e for e in mine if (e["shape"] == shape if isinstance(shape, str) else e["dims"] == shape)]
    if hit:
        e = hit[0]
        return _tuned(e, device, True, f"{kernel}/{dsl} on {device} at {e['shape']}")
    names = ", ".join(e["shape"] for e in mine)
    if not nearest:
        raise LabError(f"no tuned {kernel}/{dsl} on {device} at shape {shape!r} (tuned: {names}; nearest=True for the closest)")
    if isinstance(shape, str):
        from lab import space
        dims = space.get_shape(kernel, shape)
    else:
        dims = shape
    scored = sorted(((_distance(dims, e["dims"]), e["shape"], e) for e in mine), key=lambda t: (t[0], t[1]))
    if math.isinf(scored[0][0]):
        raise LabError(f"no tuned {kernel}/{dsl} on {device} with the non-numeric dims of {dims} (tuned: {names})")
    e = scored[0][2]
    return _tuned(e, device, False, f"nearest to {json.dumps(dims, sort_keys=True)}: {e['shape']} "
                                    f"{json.dumps(e['dims'], sort_keys=True)}")


def _tuned(e: dict, device: str, exact: bool, label: str) -> Tuned:
    return Tuned(config=e["config"], kernel=e["kernel"], dsl=e["dsl"], device=device, shape=e["shape"],
                 dims=e["dims"], median_ms=e["median_ms"], run_id=e["run_id"], fresh=e["fresh"], exact=exact,
                 label=label)
