"""torch lane for m2rnn_bwd: the problem's reference math run in fp32 on the device (eager PyTorch,
one Python step per time step, vectorised over batch and heads; every state kept from one forward,
then explicit backprop through time). The baseline row of the tables; nothing to tune or compile."""
from __future__ import annotations

import torch

from lab.problems import _m2rnn as m2

DSL = "torch"
KERNEL = "m2rnn_bwd"
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
        for name, value in m2.bptt_backward(inputs, shape, torch.float32).items():
            outputs[name].copy_(value)
    return run


def versions() -> dict:
    v = {"torch": torch.__version__}
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    return v
