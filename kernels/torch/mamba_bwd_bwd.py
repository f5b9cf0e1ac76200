"""torch lane for mamba_bwd_bwd: reference (2) of lab/problems/_mamba3.py run in fp32 on the device.

Eager PyTorch, vectorised over chunks (one Python step per chunk only for the N x P state-gradient
scan), one batch element at a time to bound memory. It is the lab's readable implementation of the
boundary and the baseline row of its tables; it has nothing to tune and nothing to compile.
"""
from __future__ import annotations

from kernels.torch._eager import (  # noqa: F401  (the lane interface)
    BASELINE, DEFAULTS, DSL, TUNABLES, compile_for, config_reason, eligibility, smem_estimate,
    versions)
from lab.problems import _mamba3 as m3

KERNEL = "mamba_bwd_bwd"
# A slow fp32 reference, not a library a user would pick: the report compares the lanes with the
# fastest one at each shape instead of with this one (lab/registry.py).
BASELINE_KIND = "reference"


def build(config: dict, shape: dict):
    def run(inputs, outputs):
        for name, value in m3.reference_outputs(inputs, shape).items():
            outputs[name].copy_(value)
    return run
