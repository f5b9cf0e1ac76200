"""Shared fixtures: an isolated sweeps folder, cache and results folder per test, the simulated lane
package (tests.fake_lanes) registered next to the real kernels, and compile results shared by the
tests of one session."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SIM_SPACE = """
[params]
MODE = ["ok", "slow", "compile_error", "runtime_error", "wrong", "unwritten", "refused"]
SMEM_KB = [16, 64, 200]
SPEED = [1, 2]
ESTIMATE_BIAS_KB = [0]
"""

TINY_SHAPES = """
[shapes.tiny]
M = 24
N = 16
K = 40
dtype = "float32"

[shapes.tiny_fp16]
M = 33
N = 24
K = 40
dtype = "float16"
"""


@pytest.fixture
def lab_env(tmp_path, monkeypatch):
    """Isolated LAB_* folders; returns a namespace of paths."""
    sweeps = tmp_path / "sweeps"
    shutil.copytree(ROOT / "sweeps", sweeps)
    (sweeps / "gemm" / "sim.toml").write_text(SIM_SPACE)
    with open(sweeps / "gemm" / "shapes.toml", "a") as f:
        f.write(TINY_SHAPES)
    monkeypatch.setenv("LAB_SWEEPS_DIR", str(sweeps))
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LAB_KERNEL_PACKAGES", "tests.fake_lanes")
    monkeypatch.setenv("LAB_SIM_COMPILE_LOG", str(tmp_path / "compiled.jsonl"))
    monkeypatch.syspath_prepend(str(ROOT))
    from lab import registry
    registry._LANES.clear()

    class Env:
        root = ROOT
        tmp = tmp_path
        results = tmp_path / "results"
        compile_log = tmp_path / "compiled.jsonl"
    Env.sweeps = sweeps
    yield Env
    registry._LANES.clear()


def compiled_configs(env) -> list[dict]:
    import json
    if not env.compile_log.exists():
        return []
    return [json.loads(line)["config"] for line in env.compile_log.read_text().splitlines()]


def _session_dir(tmp_path_factory) -> Path:
    """A folder every process of this pytest session sees: under xdist each worker's base temp is
    <session base>/<worker id>, so the workers share its parent."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """A cache folder shared by every test (and xdist worker) of this session, fresh each session."""
    path = _session_dir(tmp_path_factory) / "session-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def compiled(session_cache):
    """``compiled(lane_module, config, shape, target)``: ``lane_module.compile_for(config, shape, target)``
    computed once per session, so tests that check the same compile from different angles share it.
    A file lock per key makes a second worker wait for the first one's compile instead of repeating it;
    a compile that raises is not cached (the next caller raises too)."""
    folder = session_cache / "compile_for"
    folder.mkdir(exist_ok=True)

    def compile_for(lane, config: dict, shape: dict, target: str) -> dict:
        key = json.dumps([lane.__name__, config, shape, target], sort_keys=True)
        stem = folder / hashlib.sha1(key.encode()).hexdigest()
        with open(stem.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            done = stem.with_suffix(".pickle")
            if done.exists():
                return pickle.loads(done.read_bytes())
            result = lane.compile_for(config, shape, target)
            tmp = stem.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(pickle.dumps(result))
            os.replace(tmp, done)
            return result
    return compile_for


def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
