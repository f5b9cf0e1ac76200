"""Lanes: one implementation of one kernel in one DSL, found as ``kernels/<dsl>/<kernel>.py``.

A lane module defines (see kernels/triton/gemm.py for a full example):

  DSL, KERNEL          names
  TUNABLES, DEFAULTS   tunable config keys and their default values
  BASELINE             optional; True for the lane the others are compared with (torch)
  BASELINE_KIND        optional, for a BASELINE lane: "library" (default: a library a user would
                       pick, e.g. cuBLAS; the report's ratios are against it) or "reference" (a slow
                       reference such as eager fp32 math; the report compares with the fastest lane
                       at each shape instead and names it)
  config_reason(config, shape) -> str | None       arithmetic rules (no compile)
  eligibility(target) -> str | None                 does the lane have a path for this target
  target_reason(config, target) -> str | None       optional: config rules that depend on the target
  shape_target_reason(config, shape, target)         optional: rules that depend on both
  smem_estimate(config, shape, target) -> int | None  analytic shared memory per CTA, bytes
  compile_for(config, shape, target) -> dict        AOT compile, no GPU: {"smem_bytes", ...}
  build(config, shape) -> run(inputs, outputs) [-> optional dict of launch info]
  versions() -> dict                                 package versions that produced the binary
  cache_env(folder, target) -> dict                  optional: env vars pointing the DSL's compile cache
                                                     at a per-target folder
  RETIRED              optional: former knobs a config may still name; config_reason judges them

The values a tunable may take and the rules over several of them are declared once, in the lane's sweep
file (``sweeps/<kernel>/<dsl>.toml``); the harness holds every config that enters from outside a sweep
to it (``Lane.space_reason``). ``config_reason`` keeps what depends on the shape or on combinations the
file cannot express.

The harness never imports a DSL itself: everything DSL-specific goes through these names.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass
from types import ModuleType

from lab.devices import LabError

BASELINE_KINDS = ("library", "reference")
REQUIRED = ("DSL", "KERNEL", "TUNABLES", "DEFAULTS", "config_reason", "eligibility",
            "smem_estimate", "compile_for", "build", "versions")


def kernel_packages() -> list[str]:
    """Packages holding ``<dsl>/<kernel>.py`` lanes; LAB_KERNEL_PACKAGES adds more (comma-separated)."""
    extra = [p for p in os.environ.get("LAB_KERNEL_PACKAGES", "").split(",") if p]
    return ["kernels", *extra]


@dataclass(frozen=True)
class Eligibility:
    """Whether a lane can run on a target. ``code`` is one of: ok, unavailable, ineligible, missing."""
    code: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code == "ok"

    def __str__(self) -> str:
        return "ok" if self.ok else f"{self.code}: {self.reason}"


@dataclass
class Lane:
    dsl: str
    kernel: str
    module_name: str
    _module: ModuleType | None = None
    import_error: str | None = None

    @property
    def module(self) -> ModuleType:
        if self._module is None and self.import_error is None:
            try:
                mod = importlib.import_module(self.module_name)
                missing = [n for n in REQUIRED if not hasattr(mod, n)]
                if missing:
                    self.import_error = f"lane module lacks {', '.join(missing)}"
                else:
                    self._module = mod
            except Exception as exc:  # a DSL that is not installed, or a broken lane file
                self.import_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if self._module is None:
            raise LabError(f"{self.dsl}/{self.kernel} unavailable: {self.import_error}")
        return self._module

    @property
    def is_baseline(self) -> bool:
        return bool(getattr(self.module, "BASELINE", False))

    @property
    def baseline_kind(self) -> str:
        """``library`` or ``reference`` (see BASELINE_KIND above)."""
        kind = getattr(self.module, "BASELINE_KIND", "library")
        if kind not in BASELINE_KINDS:
            raise LabError(f"{self.module_name}.BASELINE_KIND is {kind!r} (known: {', '.join(BASELINE_KINDS)})")
        return kind

    def eligibility(self, target: str) -> Eligibility:
        try:
            mod = self.module
        except LabError:
            return Eligibility("unavailable", self.import_error or "")
        reason = mod.eligibility(target)
        return Eligibility("ok") if reason is None else Eligibility("ineligible", reason)

    def target_reason(self, config: dict, target: str) -> str | None:
        """The lane's optional ``target_reason``; None (no target rule) when it has none."""
        fn = getattr(self.module, "target_reason", None)
        return fn(config, target) if fn else None

    def space_reason(self, space, config: dict) -> str | None:
        """Why a full config is outside ``space`` (a ``lab.space.Space`` of this lane), or None: see
        ``Space.value_reason``; the lane's DEFAULTS and RETIRED knobs as this lane declares them."""
        return space.value_reason(config, self.module.DEFAULTS, tuple(getattr(self.module, "RETIRED", ())))

    def full_config(self, config: dict) -> dict:
        unknown = [k for k in config if k not in self.module.TUNABLES]
        if unknown:
            raise LabError(f"unknown config key {', '.join(map(repr, unknown))} for {self.dsl}/{self.kernel} "
                           f"(known: {', '.join(self.module.TUNABLES) or 'none'})")
        return {**self.module.DEFAULTS, **config}


def dsls() -> list[str]:
    found = set()
    for pkg in kernel_packages():
        mod = importlib.import_module(pkg)
        found.update(m.name for m in pkgutil.iter_modules(mod.__path__) if m.ispkg)
    return sorted(found)


def _module_name(dsl: str, kernel: str) -> str | None:
    for pkg in kernel_packages():
        try:
            sub = importlib.import_module(f"{pkg}.{dsl}")
        except ImportError:
            continue
        if any(m.name == kernel for m in pkgutil.iter_modules(sub.__path__)):
            return f"{pkg}.{dsl}.{kernel}"
    return None


_LANES: dict[tuple[str, str], Lane] = {}


def get(dsl: str, kernel: str) -> Lane:
    if dsl not in dsls():
        raise LabError(f"unknown DSL {dsl!r} (known: {', '.join(dsls())})")
    key = (dsl, kernel)
    if key not in _LANES:
        name = _module_name(dsl, kernel)
        if name is None:
            raise LabError(f"DSL {dsl!r} has no {kernel!r} kernel (no kernels/{dsl}/{kernel}.py)")
        _LANES[key] = Lane(dsl, kernel, name)
    return _LANES[key]


def baseline_kind(dsl: str, kernel: str) -> str:
    """The lane's BASELINE_KIND; ``library`` (the default) for a lane that cannot be found or imported
    (an unknown value still raises)."""
    try:
        lane = get(dsl, kernel)
        lane.module
    except LabError:
        return "library"
    return lane.baseline_kind


def registered_rows(df):
    """The rows of ``df`` (a results frame) written by lanes this registry knows: a test lane's rows (the
    fault campaign's, tests/fault_lanes) stay in results/ as evidence but are no lane's tuned config,
    report table or gate entry."""
    if df.empty:
        return df
    known = set(dsls())
    pairs = {(d, k) for d, k in df[["dsl", "kernel"]].drop_duplicates().itertuples(index=False)
             if d in known and _module_name(d, k) is not None}
    return df[[(d, k) in pairs for d, k in zip(df["dsl"], df["kernel"])]]


def lanes_for(kernel: str) -> list[Lane]:
    """Every lane that has a file for ``kernel`` (importable or not)."""
    return [get(d, kernel) for d in dsls() if _module_name(d, kernel) is not None]


def eligibility_table(kernel: str, target: str) -> dict[str, Eligibility]:
    """Per DSL: ok, or a typed reason (``missing`` when the DSL has no file for this kernel)."""
    table = {}
    for d in dsls():
        if _module_name(d, kernel) is None:
            table[d] = Eligibility("missing", f"no kernels/{d}/{kernel}.py")
        else:
            table[d] = get(d, kernel).eligibility(target)
    return table
