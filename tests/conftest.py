"""Shared fixtures: an isolated sweeps folder, cache and results folder per test, and the
simulated lane package (tests.fake_lanes) registered next to the real kernels."""
from __future__ import annotations

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
