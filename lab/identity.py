"""What a lane's measurements depend on: the code of its module and of the kernels/ modules it imports.

A lane's identity is a hash of each file's code with docstrings and comments stripped (the hash of a
canonical dump of the parsed module, docstrings removed), so that editing prose leaves results fresh
and editing a helper the lane imports (kernels/triton/_m2rnn.py, kernels/cute/_aot.py, ...) makes
them stale. The import closure is followed through every kernel package (``registry.kernel_packages``),
never into the harness or a DSL. The same walk runs over any file reader, so the identity of a lane
at an older git commit can be rebuilt from ``git show`` (see ``identity_at_commit``).
"""
from __future__ import annotations

import ast
import hashlib
import re
import importlib
import subprocess
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

Reader = Callable[[str], "str | None"]


# code_hash and _imports are pure functions of the text, cached: the gate, the report and the export
# rebuild the same files' identities at many commits (mostly the same texts).
@lru_cache(maxsize=4096)
def code_hash(source: str) -> str:
    """12 hex digits of the sha1 of the module's syntax tree without docstrings (comments and layout
    never reach the tree). Source that does not parse hashes as text, so a broken file still differs."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return "unparsed-" + hashlib.sha1(source.encode()).hexdigest()[:12]
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return hashlib.sha1(canonical(tree).encode()).hexdigest()[:12]


# The hash scheme rows record beside their lane files ("lane_hash"): rows without it were hashed with
# ast.dump, which differs between Python versions (3.12 added FunctionDef.type_params), so the GPU
# image's Python 3.12 and the checkout's 3.11 disagreed on unchanged files; such rows are judged by
# the identity rebuilt at their commit (lab.gate.measured_identity).
SCHEME = "ast-canon-1"
_VERSIONED_FIELDS = {"type_params", "type_comment", "kind"}


def canonical(node) -> str:
    """A syntax tree as text that does not depend on the Python version: node types and the fields
    that hold something (None and empty lists, the form new optional fields take, are left out)."""
    if isinstance(node, ast.AST):
        parts = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value) or name in _VERSIONED_FIELDS:
                continue
            parts.append(f"{name}={canonical(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(canonical(v) for v in node) + "]"
    return repr(node)



def _package_dirs() -> dict[str, Path]:
    from lab.registry import kernel_packages
    dirs = {}
    for name in kernel_packages():
        mod = importlib.import_module(name)
        dirs[name] = Path(next(iter(mod.__path__))).resolve()
    return dirs


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path.resolve())


def _candidates(module: str, packages: dict[str, Path]) -> list[str]:
    """Files (repo-relative where possible) that could hold ``module``, package __init__ included."""
    pkg = next((p for p in sorted(packages, key=len, reverse=True) if module == p or module.startswith(p + ".")), None)
    if pkg is None:
        return []
    rest = module[len(pkg):].lstrip(".").split(".") if module != pkg else []
    base = packages[pkg].joinpath(*rest)
    return [_rel(base.with_suffix(".py")) if rest else _rel(base / "__init__.py"), _rel(base / "__init__.py")]


@lru_cache(maxsize=4096)
def _imports(source: str, module: str, is_package: bool) -> tuple[str, ...]:
    """Absolute names of every module ``source`` may import (``from a import b`` yields a and a.b)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ()
    names = []
    pkg = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.append(base)
            names += [f"{base}.{a.name}" for a in node.names if a.name != "*"]
    return tuple(names)


def closure(module: str, read: Reader, packages: dict[str, Path] | None = None) -> dict[str, str]:
    """{file: code hash} for ``module`` and every kernel-package module it imports, transitively.
    ``read(path)`` returns a file's text or None when it does not exist."""
    packages = packages if packages is not None else _package_dirs()
    found: dict[str, str] = {}
    todo = [module]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        # Packages on the way run their __init__ on import.
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        for path in _candidates(name, packages):
            if path in found:
                break
            text = read(path)
            if text is None:
                continue
            found[path] = code_hash(text)
            todo += _imports(text, name, path.endswith("__init__.py"))
            break
    return dict(sorted(found.items()))


def summary_hash(files: dict[str, str]) -> str:
    return hashlib.sha1("\n".join(f"{p} {h}" for p, h in sorted(files.items())).encode()).hexdigest()[:12]


def _read_checkout(path: str) -> str | None:
    p = Path(path) if Path(path).is_absolute() else ROOT / path
    try:
        return p.read_text()
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        return None


def lane_identity(module_name: str) -> dict:
    """{"lane_code": summary hash, "lane_files": {file: code hash}, "lane_hash": SCHEME} of a lane
    module in this checkout."""
    files = closure(module_name, _read_checkout)
    return {"lane_code": summary_hash(files), "lane_files": files, "lane_hash": SCHEME}


def git_reader(commit: str, root: Path | None = None) -> Reader:
    """Reads repo-relative files as they were at ``commit`` (None when absent there)."""
    root = root or ROOT
    listing = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit], cwd=root, capture_output=True,
                             text=True, timeout=60).stdout.split("\n")
    present = set(listing)

    def read(path: str) -> str | None:
        if path not in present:
            return None
        p = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, timeout=30)
        return p.stdout.decode(errors="replace") if p.returncode == 0 else None
    return read


def identity_at_commit(module_name: str, commit: str, root: Path | None = None) -> dict | None:
    """The lane's identity at a git commit, or None when the commit is not in this repository."""
    root = root or ROOT
    ok = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True, timeout=30)
    if ok.returncode != 0:
        return None
    files = closure(module_name, git_reader(commit, root))
    return {"lane_code": summary_hash(files), "lane_files": files} if files else None


def materialize(module_name: str, commit: str, dest: Path) -> tuple[str, str]:
    """Writes the lane as it was at ``commit`` (its import closure) under ``dest`` as a separate lane
    package, so that the previous code and the checkout's can run side by side in one process.
    Returns (package, DSL name) of the copy: ``labprev_<commit>`` and ``<dsl>_at_<commit>``; the
    copy's imports of its kernel package are rewritten to point at the copy. Needs ``dest`` on
    sys.path and the package in LAB_KERNEL_PACKAGES to be found by the registry."""
    top, dsl, _ = module_name.rsplit(".", 2)
    tag = commit[:10]
    pkg, new_dsl = f"labprev_{tag}", f"{dsl}_at_{tag}"
    read = git_reader(commit)
    files = closure(module_name, read)
    if not files:
        raise FileNotFoundError(f"{module_name} is not in commit {commit}")
    imports = re.compile(rf"^(\s*(?:from|import)\s+){re.escape(top)}((?:\.\w+)*)", re.M)

    def rename(match) -> str:
        parts = match.group(2).split(".")[1:]
        if parts and parts[0] == dsl:
            parts[0] = new_dsl
        return match.group(1) + ".".join([pkg, *parts])
    prefix = Path(_rel(_package_dirs()[top])).parts
    for rel in files:
        parts = Path(rel).parts
        if parts[: len(prefix)] != prefix:
            continue  # another kernel package: the copy imports today's
        inner = parts[len(prefix):]
        mapped = [pkg] + [new_dsl if i == 0 and p == dsl else p for i, p in enumerate(inner)]
        out = Path(dest).joinpath(*mapped)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(imports.sub(rename, read(rel)))
    for init in (Path(dest) / pkg / "__init__.py", Path(dest) / pkg / new_dsl / "__init__.py"):
        if not init.exists():
            init.write_text("")
    return pkg, new_dsl
