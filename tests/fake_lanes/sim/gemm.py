"""A simulated GEMM lane for harness tests: behaviour is chosen by the config's MODE.

MODE: ok | slow (ok, but SPEED x slower) | compile_error | runtime_error | sticky (a CUDA-style
error that poisons the context; runtime_error fails from the second call on) | crash (the process dies) | hang | wrong | unwritten (leaves NaN).
Shared memory is SMEM_KB * 1024 bytes, by estimate and by "compile" alike (ESTIMATE_BIAS_KB shifts
the estimate). Every compile_for call is appended to $LAB_SIM_COMPILE_LOG, so tests can prove that
infeasible configs are never compiled.
"""
from __future__ import annotations

import json
import os
import time

import torch

DSL = "sim"
KERNEL = "gemm"
TUNABLES = ("MODE", "SMEM_KB", "SPEED", "ESTIMATE_BIAS_KB")
DEFAULTS = {"MODE": "ok", "SMEM_KB": 16, "SPEED": 1, "ESTIMATE_BIAS_KB": 0}


def config_reason(config, shape):
    return None if config["MODE"] != "refused" else "MODE=refused is refused by the lane's rules"


def eligibility(target):
    return None if target != "sm_75" else "sim has no sm_75 path"


def target_reason(config, target):
    return None


def smem_estimate(config, shape, target):
    return (config["SMEM_KB"] + config["ESTIMATE_BIAS_KB"]) * 1024


def compile_for(config, shape, target):
    log = os.environ.get("LAB_SIM_COMPILE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"config": config, "target": target}) + "\n")
    if config["MODE"] == "compile_error":
        raise RuntimeError("simulated compiler failure")
    return {"smem_bytes": config["SMEM_KB"] * 1024, "registers": 32, "compile_s": 0.0}


def build(config, shape):
    mode = config["MODE"]
    state = {"calls": 0}

    def run(inputs, outputs):
        state["calls"] += 1
        if mode == "compile_error":
            raise RuntimeError("simulated JIT compile failure")
        if mode == "crash":
            os._exit(7)
        if mode == "hang":
            time.sleep(3600)
        if mode == "runtime_error" and state["calls"] > 1:  # compiles and runs once, then fails
            raise ValueError("simulated launch failure")
        if mode == "sticky":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if mode == "unwritten":
            return {}
        c = (inputs["a"].double() @ inputs["b"].double()).to(outputs["c"].dtype)
        if mode == "wrong":
            c = c * 1.1
        if mode == "slow":
            time.sleep(0.0005 * config["SPEED"])
        outputs["c"].copy_(c)
        return {"smem_bytes": config["SMEM_KB"] * 1024}
    return run


def versions():
    return {"sim": "1.0", "torch": torch.__version__}
