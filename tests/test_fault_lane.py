"""The fault campaign's lane (tests/fault_lanes/faults/gemm.py) through the real worker process on the
CPU (Triton's interpreter): every fault ends as its status with a reason, and a healthy trial runs
after each. On the GPU, scripts/fault_campaign.py runs the same lane through `lab sweep`."""
from __future__ import annotations

import time

import pytest

from tests.test_sweep_engine import FAST_TIMING

SHAPE = {"M": 33, "N": 24, "K": 40, "dtype": "float16"}
EXPECTED = {  # fault -> (status, a substring of its reason)
    "nan": ("wrong_result", "nonfinite="),
    "oom": ("runtime_error", "allocate"),
    "sigkill": ("runtime_error", "died"),
    "illegal_address": ("runtime_error", ""),
    "hang": ("timeout", "worker killed"),
}


@pytest.fixture
def fault_env(lab_env, monkeypatch):
    monkeypatch.setenv("LAB_KERNEL_PACKAGES", "tests.fake_lanes,tests.fault_lanes")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return lab_env


def test_every_fault_is_a_row_status_and_the_worker_recovers(fault_env):
    from lab.worker import WorkerRunner
    runner = WorkerRunner("cpu")

    def run(fault, timeout_s=120):
        task = {"kind": "trial", "kernel": "gemm", "dsl": "faults", "config": {"FAULT": fault, "BLOCK": 16},
                "shape": SHAPE, "seed": 1, "timing": FAST_TIMING, "parity_shapes": []}
        return runner.run(task, timeout_s)
    try:
        assert run("none")["status"] == "ok"
        for fault, (status, why) in EXPECTED.items():
            t0 = time.time()
            r = run(fault, 20 if fault == "hang" else 120)
            assert r["status"] == status and why in r.get("error", "").lower(), (fault, r)
            assert time.time() - t0 < 90, fault
            assert run("none")["status"] == "ok", f"no healthy trial after {fault}"
        assert runner.restarts >= 3  # sigkill, illegal_address (segfault or poisoned context), hang
    finally:
        runner.close()


def test_compile_error_fails_the_preflight_compile_and_the_worker(lab_env, monkeypatch):
    from lab import registry
    from lab.worker import WorkerRunner
    monkeypatch.setenv("LAB_KERNEL_PACKAGES", "tests.fake_lanes,tests.fault_lanes")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    lane = registry.get("faults", "gemm")  # imported here without the interpreter: AOT compiles for sm_90a
    assert lane.module.compile_for({"FAULT": "none", "BLOCK": 32}, SHAPE, "sm_90a")["smem_bytes"] >= 0
    with pytest.raises(Exception, match="arange"):
        lane.module.compile_for({"FAULT": "compile_error", "BLOCK": 32}, SHAPE, "sm_90a")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the worker process runs the lane on the CPU
    runner = WorkerRunner("cpu")
    try:
        task = {"kind": "trial", "kernel": "gemm", "dsl": "faults", "config": {"FAULT": "compile_error", "BLOCK": 16},
                "shape": SHAPE, "seed": 1, "timing": FAST_TIMING, "parity_shapes": []}
        r = runner.run(task, 120)
        assert r["status"] == "compile_error" and "arange" in r["error"], r
    finally:
        runner.close()
