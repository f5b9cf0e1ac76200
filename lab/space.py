"""Declarative search spaces and named shapes, read from ``sweeps/<kernel>/``.

``sweeps/<kernel>/shapes.toml``::

    default = ["sq4096_bf16", ...]          # shapes a sweep takes when --shape is not given
    [shapes.sq4096_bf16]
    M = 4096
    N = 4096
    K = 4096
    dtype = "bfloat16"

``sweeps/<kernel>/<dsl>.toml``::

    [params]                                 # each tunable and the values it may take
    BLOCK_M = [64, 128, 256]
    [restrictions]                           # Python expressions over the params; all must hold
    rules = ["BLOCK_M * BLOCK_N <= 128 * 256"]
    [[seed]]                                 # optional: configs a new study tries first
    BLOCK_M = 128
    [precision.exact]                        # optional: a run option (`sweep --precision exact`), not a
    FAST_TANH = false                        # knob: these tunables take these values in every trial of the
                                             # run; without --precision they take the lane's DEFAULTS

A precision choice (an approximate tanh, tf32 products) is never a tuning axis: the tuner would always
resolve it to the least exact value. So such tunables stay out of [params]: a run uses the lane's
defaults, or one named [precision.NAME] table for all its trials.
"""
from __future__ import annotations

import ast
import hashlib
import itertools
import json
import os
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from lab.devices import LabError

_ALLOWED_NODES = (ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.Name, ast.Load,
                  ast.Constant, ast.And, ast.Or, ast.Not, ast.Add, ast.Sub, ast.Mult, ast.Div,
                  ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt,
                  ast.GtE, ast.In, ast.NotIn, ast.Tuple, ast.List, ast.Call, ast.IfExp, ast.BitAnd,
                  ast.BitOr, ast.LShift, ast.RShift)
_FUNCS = {"min": min, "max": max, "abs": abs}


def sweeps_dir() -> Path:
    return Path(os.environ.get("LAB_SWEEPS_DIR", Path(__file__).resolve().parent.parent / "sweeps"))


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise LabError(f"missing sweep file {path}") from None
    except tomllib.TOMLDecodeError as exc:
        raise LabError(f"malformed sweep file {path}: {exc}") from None


def config_key(config: dict) -> str:
    """Canonical JSON of a config: the identity used for duplicate detection."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


# At most this many configs of a space are checked one by one (sweep start, preflight summary); larger
# spaces are sampled.
SCAN_LIMIT = 20_000


@dataclass
class Space:
    """A discrete search space: ``params`` maps each tunable to its allowed values."""
    params: dict[str, list]
    rules: list[str] = field(default_factory=list)
    source: str = ""
    seeds: list[dict] = field(default_factory=list)  # configs tried first in a new study
    fixed_names: tuple = ()  # tunables a rule may name that are not params (precision keys: lane defaults)
    precisions: dict = field(default_factory=dict)  # the file's [precision.NAME] tables: NAME -> {tunable: value}

    def __post_init__(self):
        self._compiled = []
        for rule in self.rules:
            try:
                tree = ast.parse(rule, mode="eval")
            except SyntaxError as exc:
                raise LabError(f"malformed restriction {rule!r} in {self.source}: {exc.msg}") from None
            for node in ast.walk(tree):
                if not isinstance(node, _ALLOWED_NODES):
                    raise LabError(f"restriction {rule!r} in {self.source} uses {type(node).__name__}")
                if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _FUNCS):
                    raise LabError(f"restriction {rule!r} in {self.source} calls a function other than min/max/abs")
                if isinstance(node, ast.Name) and node.id not in self.params and node.id not in _FUNCS \
                        and node.id not in self.fixed_names:
                    raise LabError(f"restriction {rule!r} in {self.source} names unknown param {node.id!r}")
            self._compiled.append((rule, compile(tree, self.source or "<rule>", "eval")))

    def __reduce__(self):  # compiled rules are code objects: rebuild them in the receiving process
        return (Space, (self.params, self.rules, self.source, self.seeds, self.fixed_names, self.precisions))

    @property
    def tag(self) -> str:
        """6 hex digits of the space (params and rules): part of a study's name, because Optuna cannot
        resume a study whose categorical choices changed (a pruned or widened sweep file)."""
        text = json.dumps([self.params, self.rules], sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:6]

    def rule_reason(self, config: dict) -> str | None:
        """The first restriction ``config`` breaks, or None."""
        for rule, code in self._compiled:
            if not eval(code, {"__builtins__": {}}, {**_FUNCS, **config}):  # noqa: S307 (AST-checked above)
                return f"restriction: {rule}"
        return None

    @property
    def where(self) -> str:
        """The sweep file as ``sweeps/<kernel>/<dsl>.toml`` (wherever LAB_SWEEPS_DIR puts the folder)."""
        p = Path(self.source)
        return f"sweeps/{p.parent.name}/{p.name}" if self.source else "the sweep space"

    def allowed(self, key: str, defaults: dict) -> list:
        """The values tunable ``key`` may take: its [params] list; for a tunable that is not a param (a
        precision key, a knob the file leaves out), the lane's default and the values [precision.NAME]
        tables set."""
        if key in self.params:
            return self.params[key]
        out = [defaults[key]] if key in defaults else []
        for table in self.precisions.values():
            if key in table and not any(same_value(table[key], v) for v in out):
                out.append(table[key])
        return out

    def unlisted(self, config: dict) -> list[str]:
        """``KEY=VALUE`` for each param of ``config`` whose value the [params] list does not hold."""
        return [f"{k}={json.dumps(v)}" for k, v in config.items()
                if k in self.params and not any(same_value(v, c) for c in self.params[k])]

    def value_reason(self, config: dict, defaults: dict, retired: tuple = ()) -> str | None:
        """Why ``config`` (a full config) is outside this space, in one line, or None: a value that is not
        one of its tunable's allowed values (``allowed``; compared with its type, so true is not 1), else
        the first restriction it breaks. Keys in ``retired`` (former knobs the lane still accepts at the
        value its code fixes them to) are the lane's to judge and are skipped here."""
        for key, value in config.items():
            if key in retired:
                continue
            allowed = self.allowed(key, defaults)
            if not any(same_value(value, v) for v in allowed):
                text = ", ".join(json.dumps(v) for v in allowed) or "none"
                kind = "" if key in self.params else "; not a param: the lane's default or a [precision.NAME] value"
                return f"{key}={json.dumps(value)} is not in {self.where} (allowed: {text}{kind})"
        return self.rule_reason(config)

    @property
    def size(self) -> int:
        n = 1
        for values in self.params.values():
            n *= len(values)
        return n

    def configs(self):
        """Every point of the grid (restrictions not applied)."""
        names = list(self.params)
        for combo in itertools.product(*(self.params[n] for n in names)):
            yield dict(zip(names, combo))

    def scan(self, limit: int = SCAN_LIMIT, seed: int = 0) -> tuple[list[dict], bool]:
        """(configs, exhaustive): the seeds, then every point of the grid when it has at most ``limit``
        points, else ``limit`` distinct points drawn at random (seeded), never enumerating the grid: a
        space declared as data can have billions of points. No config appears twice."""
        seen: set[str] = set()
        out: list[dict] = []

        def add(config):
            key = config_key(config)
            if key not in seen:
                seen.add(key)
                out.append(config)
        for config in self.seeds:
            add(config)
        if self.size <= limit:
            for config in self.configs():
                add(config)
            return out, True
        rng = random.Random(seed)
        names = list(self.params)
        target = len(out) + limit
        for _ in range(limit * 4):
            if len(out) >= target:
                break
            add({n: rng.choice(self.params[n]) for n in names})
        return out, False


def same_value(a, b) -> bool:
    """Equal values of one type (``True == 1`` and ``1 == 1.0`` in Python, not here)."""
    return type(a) is type(b) and a == b


def precisions(kernel: str, dsl: str) -> dict[str, dict]:
    """The sweep file's [precision.NAME] tables: NAME -> {tunable: value}."""
    path = sweeps_dir() / kernel / f"{dsl}.toml"
    return _precision_tables(_read_toml(path), path)


def _precision_tables(data: dict, path: Path) -> dict[str, dict]:
    tables = data.get("precision", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) and t for t in tables.values()):
        raise LabError(f"malformed sweep file {path}: [precision.NAME] entries must be non-empty tables")
    return tables


def load_space(kernel: str, dsl: str, tunables: tuple[str, ...], precision: str | None = None) -> Space:
    """The search space of ``sweeps/<kernel>/<dsl>.toml``; with ``precision``, its [precision.NAME]
    table's values fixed in every config (each becomes a one-value param)."""
    path = sweeps_dir() / kernel / f"{dsl}.toml"
    data = _read_toml(path)
    params = data.get("params", {})
    if not isinstance(params, dict):
        raise LabError(f"malformed sweep file {path}: [params] must be a table")
    for name, values in params.items():
        if name not in tunables:
            raise LabError(f"unknown config key {name!r} in {path} (tunables: {', '.join(tunables) or 'none'})")
        if not isinstance(values, list) or not values:
            raise LabError(f"malformed sweep file {path}: params.{name} must be a non-empty list")
        if len({json.dumps(v) for v in values}) != len(values):
            raise LabError(f"malformed sweep file {path}: params.{name} repeats a value")
    rules = data.get("restrictions", {}).get("rules", [])
    if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
        raise LabError(f"malformed sweep file {path}: restrictions.rules must be a list of strings")
    unknown = set(data) - {"params", "restrictions", "seed", "precision"}
    if unknown:
        raise LabError(f"malformed sweep file {path}: unknown section(s) {', '.join(sorted(unknown))}")
    seeds = data.get("seed", [])
    if not isinstance(seeds, list) or not all(isinstance(s, dict) for s in seeds):
        raise LabError(f"malformed sweep file {path}: [[seed]] entries must be tables")
    for s in seeds:
        for k, v in s.items():
            if k not in params:
                raise LabError(f"unknown config key {k!r} in a [[seed]] of {path}")
            if v not in params[k]:
                raise LabError(f"malformed sweep file {path}: seed value {k}={v!r} is not in params.{k}")
        if set(s) != set(params):
            raise LabError(f"malformed sweep file {path}: a [[seed]] must set every param ({', '.join(params)})")
    tables = _precision_tables(data, path)
    for name, table in tables.items():
        for k in table:
            if k not in tunables:
                raise LabError(f"unknown config key {k!r} in [precision.{name}] of {path}")
            if k in params and table[k] not in params[k]:
                raise LabError(f"malformed sweep file {path}: [precision.{name}] {k}={table[k]!r} is not in params.{k}")
    if precision is not None:
        if precision not in tables:
            raise LabError(f"{path} declares no [precision.{precision}] (declared: {', '.join(tables) or 'none'})")
        fixed = {k: [v] for k, v in tables[precision].items()}
        params = {**params, **fixed}
        seeds = [{**s, **{k: v[0] for k, v in fixed.items()}} for s in seeds]
    fixed_names = tuple(sorted({k for t in tables.values() for k in t}))
    return Space(params, rules, str(path), seeds, fixed_names, tables)


def load_shapes(kernel: str) -> tuple[dict[str, dict], list[str]]:
    """Named shapes and the default list for ``kernel``."""
    path = sweeps_dir() / kernel / "shapes.toml"
    data = _read_toml(path)
    shapes = data.get("shapes")
    if not isinstance(shapes, dict) or not shapes:
        raise LabError(f"malformed sweep file {path}: needs a [shapes.NAME] table")
    default = data.get("default", list(shapes))
    missing = [s for s in default if s not in shapes]
    if missing:
        raise LabError(f"malformed sweep file {path}: default names unknown shape(s) {', '.join(missing)}")
    return shapes, default


def get_shape(kernel: str, name: str) -> dict:
    shapes, _ = load_shapes(kernel)
    if name not in shapes:
        raise LabError(f"unknown shape {name!r} for {kernel} (known: {', '.join(shapes)})")
    return dict(shapes[name])
