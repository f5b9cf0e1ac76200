"""torch lane for mamba_bwd_bwd: reference (2) of lab/problems/_mamba3.py run in fp32 on the device.

Eager PyTorch, vectorised over chunks (one Python step per chunk only for the N x P state-gradient
scan), one batch element at a time to bound memory. It is the lab's readable implementation of the
boundary and the baseline row of its tables; it has nothing to tune and nothing to compile.
"""
from __future__ import annotations

import torch

from lab.problems import _mamba3 as m3

DSL = "torch"
KERNEL = "mamba_bwd_bwd"
TUNABLES: tuple[str, ...] = ()
DEFAULTS: dict = {}
BASELINE = True


def config_reason(config: dict, shape: dict) -> str | None:
    return None


def eligibility(target: str) -> str | None:
    return None


def target_reason(config: dict, target: str) -> str | None:
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int | None:
    return None


def compile_for(config: dict, shape: dict, target: str) -> dict:
    raise NotImplementedError("eager PyTorch: nothing to compile ahead")


def build(config: dict, shape: dict):
    def run(inputs, outputs):
        for name, value in m3.reference_outputs(inputs, shape).items():
            outputs[name].copy_(value)
    return run


def versions() -> dict:
    v = {"torch": torch.__version__}
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    return v
