"""torch lane for m2rnn_fwd: the problem's reference math run in fp32 on the device (eager PyTorch,
one Python step per time step, vectorised over batch and heads).
The baseline row of the tables; nothing to tune or compile."""
from __future__ import annotations

import torch

from lab.problems import _m2rnn as m2

DSL = "torch"
KERNEL = "m2rnn_fwd"
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
        y, h = m2.forward(m2.expand(inputs, shape, torch.float32))
        outputs["y"].copy_(y)
        outputs["h_final"].copy_(h)
    return run


def versions() -> dict:
    v = {"torch": torch.__version__}
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    return v
