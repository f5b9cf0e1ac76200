"""The re-sweep gate: which (kernel, DSL, device profile) results no longer describe the checkout.

For every entry that has committed results, or that ``sweeps/gate.toml`` requires, the ok rows of
each shape are compared with the checkout (a shape is fresh when any of them matches it; the newest
row names what changed): the lane's code identity (``lab.identity``: the lane module and the
kernels/ modules it imports, docstrings and comments stripped), the harness version
(``lab.__version__``) and the pinned toolchain (pyproject.toml). Rows written before identities were
recorded are judged by the lane's identity rebuilt at the row's git commit. No GPU is needed.

With ``base`` (a git ref), only entries whose lane code, harness version or toolchain pins changed
between ``base`` and the checkout are required: what a branch must re-sweep before it merges.
"""
from __future__ import annotations

import json
import re
import subprocess
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import pandas as pd

import lab
from lab import identity, problems, registry, space
from lab.devices import LabError, PROFILES, get_profile
from lab.results import NOT_RUN_PHASES

# Row version keys that are not toolchain pins (identity, harness, the image's own builds).
_NOT_PINNED = {"lab", "lane_sha", "lane_code", "lane_files", "lane_hash", "python", "torch", "cuda", "cublas"}


@dataclass
class Entry:
    """One (kernel, DSL, device profile): ``status`` is fresh, stale, slower (fresh rows, but the newest
    ``gate --run`` A/B at this code judged a shape SLOWER than the previous best's code) or never measured."""
    kernel: str
    dsl: str
    device: str
    required: bool
    status: str = "never measured"
    changes: list[str] = field(default_factory=list)
    stale_shapes: list[str] = field(default_factory=list)
    emulated: bool = False
    touched: bool | None = None  # with --base: did base..checkout change what this lane's rows depend on
    needed: bool = False          # named by gate.toml (``required`` drops it when --base did not touch it)
    reference: bool = False       # a reference lane, never required
    unjudged: list[str] = field(default_factory=list)  # fresh shapes whose code change no gate --run A/B judged

    @property
    def failing(self) -> bool:
        return self.required and self.status != "fresh"

    def command(self) -> str:
        if self.status == "slower":
            return (f"python -m lab gate --run --device {self.device} --kernel {self.kernel} --dsl {self.dsl}"
                    + "".join(f" --shape {s}" for s in self.stale_shapes))
        cmd = f"python -m lab sweep {self.kernel} --device {self.device} --dsl {self.dsl}"
        cmd += "".join(f" --shape {s}" for s in self.stale_shapes)
        return cmd + (" --emulate" if self.emulated else "")

    def line(self) -> str:
        what = self.status if not self.changes else f"{self.status}: {'; '.join(self.changes)}"
        mark = "required" if self.required else "untouched" if self.needed else \
            "reference" if self.reference else "optional"
        text = f"{self.kernel:14} {self.dsl:9} {self.device:7} [{mark}] {what}"
        if self.status == "fresh" and self.unjudged:
            return (f"{text} (no gate --run A/B of this code at {', '.join(self.unjudged)})  ->  python -m lab gate "
                    f"--run --device {self.device} --kernel {self.kernel} --dsl {self.dsl}"
                    + "".join(f" --shape {s}" for s in self.unjudged))
        return text if self.status == "fresh" else f"{text}  ->  {self.command()}"


def requirements(path: Path | None = None) -> dict[str, list[str]]:
    """{kernel: required device profiles} from sweeps/gate.toml (``default`` for kernels not named)."""
    path = path or space.sweeps_dir() / "gate.toml"
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise LabError(f"missing gate file {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise LabError(f"malformed gate file {path}: {exc}") from None
    req = data.get("required")
    if not isinstance(req, dict) or not isinstance(req.get("default"), list):
        raise LabError(f"malformed gate file {path}: needs [required] with default = [device, ...]")
    known = problems.names()
    for key, devices in req.items():
        if key != "default" and key not in known:
            raise LabError(f"gate file {path}: unknown kernel {key!r} (known: {', '.join(known)})")
        if not isinstance(devices, list):
            raise LabError(f"gate file {path}: {key} must be a list of device profiles")
        for d in devices:
            get_profile(d)
    return {k: list(req.get(k, req["default"])) for k in known}


def pinned_toolchain(text: str | None = None) -> dict[str, str]:
    """{package: version} of every ``name==version`` pin in pyproject.toml (dependencies and extras);
    ``text``: another version of that file."""
    data = tomllib.loads(text if text is not None else (identity.ROOT / "pyproject.toml").read_text())
    proj = data.get("project", {})
    specs = list(proj.get("dependencies", [])) + [s for v in proj.get("optional-dependencies", {}).values() for s in v]
    pins = {}
    for s in specs:
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^;\s]+)", s)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def _pin_for(name: str, pins: dict[str, str]) -> str | None:
    name = name.lower()
    if name in pins:
        return pins[name]
    return next((v for n, v in pins.items() if n.endswith("-" + name)), None)


@lru_cache(maxsize=None)
def _identity_at(module: str, commit: str) -> dict | None:
    return identity.identity_at_commit(module, commit)


def measured_identity(module: str, versions: dict, commit: str, dirty: bool) -> dict | None:
    """The lane files a row was measured with: recorded in the row (in this checkout's hash scheme),
    else rebuilt at its git commit (a dirty checkout's commit does not say what ran), else what an
    older scheme recorded (compared as is: stale unless equal), else None."""
    recorded = {"lane_code": versions.get("lane_code"), "lane_files": versions["lane_files"]} \
        if "lane_files" in versions else None
    if recorded and versions.get("lane_hash") == identity.SCHEME:
        return recorded
    if commit and commit != "unknown" and not dirty:
        return _identity_at(module, commit)
    return recorded


def code_changes(measured: dict | None, current: dict) -> set[str]:
    """Files whose code differs between a measured identity and the checkout's ("?" when the
    measured identity is unknown)."""
    if measured is None:
        return {"? (no identity recorded; dirty or unknown commit)"}
    a, b = measured["lane_files"], current["lane_files"]
    return {p for p in a.keys() | b.keys() if a.get(p) != b.get(p)}


def version_changes(versions: dict, pins: dict[str, str]) -> list[str]:
    out = []
    if versions.get("lab") != lab.__version__:
        out.append(f"harness {versions.get('lab')} -> {lab.__version__}")
    for name, was in sorted(versions.items()):
        if name in _NOT_PINNED:
            continue
        now = _pin_for(name, pins)
        if now is not None and now != was:
            out.append(f"{name} {was} -> {now}")
    return out


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Measured, parity-checked rows at the lab's default precision (compile-only and failed trials
    excluded, and the gate's re-runs of previous code, phase gate_previous; runs with --precision are
    studies of their own, not what a lane ships; rows of test lanes, see registry.registered_rows)."""
    df = registry.registered_rows(df)
    if df.empty:
        return df
    precision = df["precision"].fillna("") if "precision" in df else ""
    keep = (df["status"] == "ok") & ~df["compile_only"].fillna(False).astype(bool) & df["time_ms"].notna() \
        & (df["phase"] != "gate_previous") & (precision == "")
    keep &= pd.Series([_at_default_precision(k, d, c) for k, d, c in
                       zip(df["kernel"].astype(str), df["dsl"].astype(str), df["config_json"].fillna(""))],
                      index=df.index, dtype=bool)
    return df[keep]


def refused_today(lane: registry.Lane, config_json: str, target: str) -> str | None:
    """Why the checkout's lane refuses a recorded config for ``target`` (its ``target_reason``), or None.
    Knobs the lane has since removed are dropped first: a removed knob is not a refusal."""
    knobs = set(lane.module.TUNABLES)
    config = {k: v for k, v in json.loads(config_json or "{}").items() if k in knobs}
    return lane.target_reason(lane.full_config(config), target)


def emulated_misfits(rows: pd.DataFrame, lane: registry.Lane, target: str) -> dict:
    """{row index: reason} for the emulated rows whose config the checkout's lane refuses for ``target``
    (the emulated profile's): such a row timed a path the profile cannot run (the CuTe DSL GEMM's PATH
    "auto" chose wgmma on the H100 under a GB10 profile), so it is no bar for that profile's code."""
    emulated = rows[rows["emulated"].fillna(False).astype(bool)] if not rows.empty else rows
    by_config = {c: refused_today(lane, c, target) for c in set(emulated["config_json"])}
    return {i: by_config[c] for i, c in emulated["config_json"].items() if by_config[c]}


@lru_cache(maxsize=None)
def _precision_defaults(kernel: str, dsl: str) -> dict:
    """{key: the lane's default} for the keys of the sweep file's [precision.NAME] tables."""
    try:
        keys = {k for table in space.precisions(kernel, dsl).values() for k in table}
        defaults = registry.get(dsl, kernel).module.DEFAULTS
    except (LabError, FileNotFoundError):
        return {}
    return {k: defaults[k] for k in keys if k in defaults}


def at_default_precision(r: pd.Series) -> bool:
    """False for a row whose config sets a precision key (now a run option, see space.precisions) to
    another value than the lane's default: a row from before that knob left the search space (e.g. the
    Triton M2RNN forward at DOT = tf32x3 on fp32 inputs, where the default is the inputs' own fp32)."""
    return _at_default_precision(str(r["kernel"]), str(r["dsl"]), r["config_json"] or "")


@lru_cache(maxsize=None)
def _at_default_precision(kernel: str, dsl: str, config_json: str) -> bool:
    defaults = _precision_defaults(kernel, dsl)
    if not defaults:
        return True
    cfg = json.loads(config_json or "{}")
    return all(cfg.get(k, v) == v for k, v in defaults.items())


def _default_shapes(kernel: str) -> list[str]:
    """The kernel's default shapes (sweeps/<kernel>/shapes.toml); none when the kernel has no shapes file."""
    try:
        return space.load_shapes(kernel)[1]
    except (LabError, FileNotFoundError):
        return []


def newest_per_shape(rows: pd.DataFrame) -> pd.DataFrame:
    return rows.sort_values("time_utc").groupby("shape", sort=True).tail(1)


def row_changes(r: pd.Series, module: str, current: dict, pins: dict) -> tuple[set[str], list[str]]:
    """(lane files changed since the row, toolchain / harness changes): both empty for a row of today's code."""
    versions = json.loads(r["versions_json"] or "{}")
    code = code_changes(measured_identity(module, versions, str(r["git_commit"]), bool(r["git_dirty"])), current)
    return code, version_changes(versions, pins)


class RowChanges:
    """``row_changes`` of one lane's rows, each distinct recorded identity (versions, commit, dirty)
    worked out once: ``self(row)``."""

    def __init__(self, module: str, current: dict, pins: dict):
        self.module, self.current, self.pins = module, current, pins
        self._memo: dict = {}

    def __call__(self, row: pd.Series) -> tuple[set[str], list[str]]:
        key = (row["versions_json"], str(row["git_commit"]), bool(row["git_dirty"]))
        if key not in self._memo:
            self._memo[key] = row_changes(row, self.module, self.current, self.pins)
        return self._memo[key]


class Freshness:
    """``fresh(row)``: the row measured the checkout's lane code with today's harness and toolchain pins
    (``row_changes`` empty), each distinct (lane, recorded identity) worked out once."""

    def __init__(self):
        self._pins = pinned_toolchain()
        self._lanes: dict[str, RowChanges] = {}

    def fresh(self, row: pd.Series) -> bool:
        try:
            module = registry.get(row["dsl"], row["kernel"]).module_name
        except LabError:    # a lane this checkout does not have (a test lane's rows): not today's code
            return False
        if module not in self._lanes:
            self._lanes[module] = RowChanges(module, identity.lane_identity(module), self._pins)
        return not any(self._lanes[module](row))

    def mask(self, rows: pd.DataFrame) -> pd.Series:
        return pd.Series([self.fresh(r) for _, r in rows.iterrows()], index=rows.index, dtype=bool)


def slower_verdicts(rows: pd.DataFrame, module: str, current: dict, pins: dict,
                    cross_precision: frozenset = frozenset()) -> dict[str, str]:
    """{shape: run id} where the newest ``gate --run`` A/B row of the checkout's side (phase gate_checkout,
    its verdict in ``study``) judged today's code SLOWER than the previous best's. A later A/B at the same
    code replaces the verdict; a code change makes the shape stale instead."""
    if rows.empty or "phase" not in rows:
        return {}
    ab = rows[rows["phase"] == "gate_checkout"]
    changes = RowChanges(module, current, pins)
    ab = ab[[not any(changes(r)) for _, r in ab.iterrows()]] if not ab.empty else ab
    out = {}
    for _, r in newest_per_shape(ab).iterrows():
        # An A/B against a previous best of another precision (``cross_precision``: (run id, shape) of
        # such gate_previous rows) compared precisions, not code.
        if (str(r["run_id"]), r["shape"]) in cross_precision:
            continue
        if str(r["study"]).startswith("gate SLOWER") and r["shape"]:
            out[r["shape"]] = str(r["run_id"])
    return out


def _unjudged(rows: pd.DataFrame, changes: RowChanges, no_bar: frozenset) -> list[str]:
    """Shapes with rows of other code too (the lane, harness or toolchain changed since) whose rows of
    today's code hold no ``gate --run`` A/B (phase gate_checkout): re-measured by a plain sweep, the
    change there was never compared with the previous best's code. Rows in ``no_bar`` (emulated misfits:
    no previous best to compare with) do not count as other code. Informational: such a shape is fresh."""
    out = []
    for shape, g in rows.sort_values("time_utc").groupby("shape", sort=True):
        ab = g[g["phase"] == "gate_checkout"]
        if any(not any(changes(r)) for _, r in ab.iterrows()):
            continue
        # Newest first: older rows may need their identity rebuilt from git, and one row of other code is enough.
        if any(i not in no_bar and any(changes(r)) for i, r in g.iloc[::-1].iterrows()):
            out.append(shape)
    return out


def _evaluate(entry: Entry, rows: pd.DataFrame, module: str, current: dict, pins: dict,
              unmeasured: list[str] = (), cross_precision: frozenset = frozenset(),
              no_bar: frozenset | None = None) -> None:
    """``unmeasured``: default shapes of a required entry where this lane and device have no ok row and no
    refusal of the whole lane: the entry is stale at them, as a lane measured at one shape is not fresh at four.
    ``no_bar``: the indices of rows that are no A/B bar (``emulated_misfits``); None: no A/B expected
    (a reference lane), so no shape is listed as unjudged."""
    if rows.empty:
        entry.status = "never measured"
        return
    files: set[str] = set()
    others: list[str] = []
    changes = RowChanges(module, current, pins)
    for _, g in rows.sort_values("time_utc").groupby("shape", sort=True):
        entry.emulated = entry.emulated or bool(g["emulated"].any())
        # A shape is fresh when any of its rows measured the checkout's code: a newer row of other code
        # (a branch measured beside this checkout with LAB_BRANCH) does not make today's rows stale.
        if any(not any(changes(r)) for _, r in g.iloc[::-1].iterrows()):
            continue
        code, other = changes(g.iloc[-1])
        entry.stale_shapes.append(g.iloc[-1]["shape"])
        files |= code
        others += [c for c in other if c not in others]
    entry.stale_shapes.sort()
    missing = sorted(set(unmeasured) - set(entry.stale_shapes))
    if not entry.stale_shapes and not missing:
        slower = slower_verdicts(rows, module, current, pins, cross_precision)
        entry.status = "slower" if slower else "fresh"
        entry.unjudged = [] if slower or no_bar is None else _unjudged(rows, changes, no_bar)
        if slower:
            entry.stale_shapes = sorted(slower)
            entry.changes = [f"gate --run judged this code SLOWER than the previous best's at "
                             f"{', '.join(f'{s} (run {run})' for s, run in sorted(slower.items()))}"]
        return
    entry.status = "stale"
    entry.changes = ([f"lane code {', '.join(sorted(files))}"] if files else []) + others
    if entry.stale_shapes:
        entry.changes.append(f"shapes {', '.join(entry.stale_shapes)}")
    if missing:
        entry.changes.append(f"default shapes with no ok row {', '.join(missing)}")
        entry.stale_shapes = sorted(entry.stale_shapes + missing)


@dataclass
class BaseDiff:
    """What changed between a git ref and the checkout."""
    harness: bool
    pins: set[str]
    lanes: dict[tuple[str, str], bool]  # (kernel, DSL) -> lane code changed

    def touches(self, lane: registry.Lane, version_keys: set[str]) -> bool:
        """Lane code or harness changed, or a pin of a package the lane's rows recorded (by name, or
        the DSL's own name for a lane never measured)."""
        keys = {k.lower() for k in version_keys} or {lane.dsl}
        pins = any(p == k or p.endswith("-" + k) for p in self.pins for k in keys)
        return self.harness or self.lanes[(lane.kernel, lane.dsl)] or pins


def diff_since(base: str, lanes: list[registry.Lane]) -> BaseDiff:
    ok = subprocess.run(["git", "cat-file", "-e", f"{base}^{{commit}}"], cwd=identity.ROOT, capture_output=True)
    if ok.returncode != 0:
        raise LabError(f"unknown git ref {base!r}")
    read = identity.git_reader(base)
    m = re.search(r'__version__\s*=\s*"([^"]+)"', read("lab/__init__.py") or "")
    old, new = pinned_toolchain(text=read("pyproject.toml") or ""), pinned_toolchain()
    return BaseDiff(harness=(m.group(1) if m else None) != lab.__version__,
                    pins={n for n in old.keys() | new.keys() if old.get(n) != new.get(n)},
                    lanes={(ln.kernel, ln.dsl): identity.closure(ln.module_name, read)
                           != identity.lane_identity(ln.module_name)["lane_files"] for ln in lanes})


def evaluate(df: pd.DataFrame, devices: list[str] | None = None, base: str | None = None,
             required: dict[str, list[str]] | None = None, kernels: list[str] | None = None,
             dsls: list[str] | None = None) -> list[Entry]:
    """Every entry with results or required, in kernel / DSL / device order (``kernels``, ``dsls``,
    ``devices``: only those)."""
    required = required if required is not None else requirements()
    for d in devices or []:
        get_profile(d)
    pins = pinned_toolchain()
    ok = ok_rows(df)
    previous = df[df["phase"] == "gate_previous"] if "phase" in df else df.iloc[0:0]
    cross_precision = frozenset((str(r["run_id"]), r["shape"]) for _, r in previous.iterrows()
                                if not at_default_precision(r))
    entries = []
    for k in kernels or []:
        problems.get(k)
    for d in dsls or []:
        if d not in registry.dsls():
            raise LabError(f"unknown DSL {d!r} (known: {', '.join(registry.dsls())})")
    lanes = [lane for k in problems.names() if not kernels or k in kernels
             for lane in registry.lanes_for(k) if not dsls or lane.dsl in dsls]
    diff = diff_since(base, lanes) if base else None
    for lane in lanes:
        current = identity.lane_identity(lane.module_name)
        rows = ok[(ok["kernel"] == lane.kernel) & (ok["dsl"] == lane.dsl)] if not ok.empty else ok
        measured = set(rows["requested_profile"]) if not rows.empty else set()
        for device in PROFILES:
            if devices and device not in devices:
                continue
            # A reference lane (BASELINE_KIND "reference": an eager fp32 loop that parity and reports
            # use, not code that ships) is never required; its rows are listed, marked as such.
            reference = registry.baseline_kind(lane.dsl, lane.kernel) == "reference"
            need = device in required.get(lane.kernel, []) and not reference
            if not need and device not in measured:
                continue
            e = Entry(lane.kernel, lane.dsl, device, need, needed=need, reference=reference)
            mine = rows[rows["requested_profile"] == device] if not rows.empty else rows
            if diff:
                keys = {k for v in mine["versions_json"] for k in json.loads(v or "{}")} - _NOT_PINNED
                e.touched = diff.touches(lane, keys)
                e.required = need and e.touched
            # A default shape is tried when an ok row or a refusal of the whole lane (a row of phase
            # eligibility / space: it cannot run there, with the reason) names it; failed trials alone (a
            # run stopped after one infeasible config) leave it untried.
            here = df[(df["kernel"] == lane.kernel) & (df["dsl"] == lane.dsl)
                      & (df["requested_profile"] == device)] if not df.empty else df
            tried = set(here[(here["status"] == "ok") | here["phase"].isin(NOT_RUN_PHASES)]["shape"]) \
                if not here.empty else set()
            unmeasured = [s for s in _default_shapes(lane.kernel) if s not in tried] if need else []
            try:
                no_bar = None if reference else frozenset(emulated_misfits(mine, lane, get_profile(device).target))
            except LabError:  # the lane does not import here: its rows are judged by their identity alone
                no_bar = frozenset()
            _evaluate(e, mine, lane.module_name, current, pins, unmeasured, cross_precision, no_bar)
            entries.append(e)
    return entries
