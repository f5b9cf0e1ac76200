"""torch lane for m2rnn_fwd: the problem's reference math run in fp32 on the device (eager PyTorch,
one Python step per time step, vectorised over batch and heads).
The baseline row of the tables; nothing to tune or compile."""
from __future__ import annotations

import torch

from kernels.torch._eager import (  # noqa: F401  (the lane interface)
    BASELINE, DEFAULTS, DSL, TUNABLES, compile_for, config_reason, eligibility, smem_estimate,
    versions)
from lab.problems import _m2rnn as m2

KERNEL = "m2rnn_fwd"
# A slow fp32 reference, not a library a user would pick: the report compares the lanes with the
# fastest one at each shape instead of with this one (lab/registry.py).
BASELINE_KIND = "reference"


def build(config: dict, shape: dict):
    def run(inputs, outputs):
        y, h = m2.forward(m2.expand(inputs, shape, torch.float32))
        outputs["y"].copy_(y)
        outputs["h_final"].copy_(h)
    return run
