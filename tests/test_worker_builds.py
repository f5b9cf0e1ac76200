"""LAB_BACKGROUND_BUILDS: a named DSL's parity-shape builds run in a thread beside the timed shape's
build, with the same outcome (status, parity shapes checked, an error where it surfaced before)."""
from __future__ import annotations

import threading
import time

import pytest

from lab import registry, space, worker

BUILD_S = 0.4


@pytest.fixture
def slow_sim(lab_env, monkeypatch):
    """The sim lane with a build that takes BUILD_S seconds and records (thread, M, start, end); a
    build at the parity shape raises when the test sets fail_parity."""
    mod = registry.get("sim", "gemm").module
    real, calls, state = mod.build, [], {"fail_parity": False}
    timed_m = space.get_shape("gemm", "tiny")["M"]

    def build(config, shape):
        start = time.perf_counter()
        time.sleep(BUILD_S)
        calls.append((threading.current_thread().name, shape["M"], start, time.perf_counter()))
        if state["fail_parity"] and shape["M"] != timed_m:
            raise RuntimeError("simulated compiler failure at the parity shape")
        return real(config, shape)

    monkeypatch.setattr(mod, "build", build)
    task = {"kind": "trial", "kernel": "gemm", "dsl": "sim", "config": registry.get("sim", "gemm").full_config({}),
            "shape": space.get_shape("gemm", "tiny"), "seed": 1, "device": "cpu", "no_timing": True}
    return task, calls, state


def _keep(r: dict) -> dict:
    return {k: r.get(k) for k in ("status", "parity_shapes", "error")}


def test_parity_builds_overlap_the_timed_build_with_the_same_outcome(slow_sim, monkeypatch):
    task, calls, state = slow_sim
    serial = worker.execute(task)
    assert serial["status"] == "ok" and len(serial["parity_shapes"]) == 2, serial
    assert {c[0] for c in calls} == {threading.current_thread().name}
    calls.clear()
    monkeypatch.setenv("LAB_BACKGROUND_BUILDS", "other, sim")
    t0 = time.perf_counter()
    background = worker.execute(task)
    assert _keep(background) == _keep(serial)
    (timed,), (parity,) = [c for c in calls if c[0] != "lab-parity-builds"], [c for c in calls if c[0] == "lab-parity-builds"]
    assert parity[2] < timed[3] and timed[2] < parity[3], calls       # the two builds overlapped in time
    assert time.perf_counter() - t0 < 2 * BUILD_S + 0.3


def test_a_failing_parity_build_surfaces_as_before(slow_sim, monkeypatch):
    task, _, state = slow_sim
    state["fail_parity"] = True
    serial = worker.execute(task)
    monkeypatch.setenv("LAB_BACKGROUND_BUILDS", "sim")
    background = worker.execute(task)
    assert serial["status"] not in ("ok", "wrong_result") and "parity shape" in serial["error"], serial
    assert _keep(background) == _keep(serial)


def test_other_dsls_build_in_the_trials_thread(slow_sim, monkeypatch):
    task, calls, _ = slow_sim
    monkeypatch.setenv("LAB_BACKGROUND_BUILDS", "tilelang")
    assert worker.execute(task)["status"] == "ok"
    assert {c[0] for c in calls} == {threading.current_thread().name}


def test_an_exception_without_a_message_names_where_it_was_raised():
    """A compile that fails with a bare ``RuntimeError()`` (the TileLang M2RNN forward at b2_n8 on the
    H100, 2026-11-26: the row says only "RuntimeError: ") still tells where to look."""
    from lab.worker import exception_text

    def compile_step():
        raise RuntimeError()

    try:
        compile_step()
    except RuntimeError as exc:
        text = exception_text(exc)
    assert text.startswith("RuntimeError: (no message; raised at ") and "in compile_step)" in text
    assert exception_text(ValueError("bad tile")) == "ValueError: bad tile"


def test_abab_lanes_share_inputs_and_outputs(lab_env, monkeypatch):
    """The A/B re-timing hands every lane the same input and output tensors: two lanes are never timed
    on buffers at different addresses (identical calls then differ only by their code)."""
    mod = registry.get("sim", "gemm").module
    real, seen = mod.build, []

    def build(config, shape):
        run = real(config, shape)

        def recorded(inputs, outputs):
            seen.append((id(inputs), id(outputs)))
            return run(inputs, outputs)
        return recorded

    monkeypatch.setattr(mod, "build", build)
    config = registry.get("sim", "gemm").full_config({})
    task = {"kind": "abab", "kernel": "gemm", "shape": space.get_shape("gemm", "tiny"), "seed": 1, "device": "cpu",
            "lanes": [("sim", config, {}), ("sim", config, {})],
            "timing": {"warmup_ms": 0.0, "min_samples": 2, "max_samples": 4, "budget_ms": 50.0, "min_time_ms": 0.0}}
    result = worker.execute(task)
    assert result["status"] == "ok" and [len(s) for s in result["samples"]] == [len(result["samples"][0])] * 2
    assert len(seen) >= 4 and len(set(seen)) == 1
