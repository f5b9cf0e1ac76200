"""What every eager-PyTorch lane has in common: no tunables, no rules, no shared-memory figure, nothing
to compile ahead. A lane imports these and defines KERNEL, build() (and compile_for() when it has a
more specific reason than the generic one)."""
from __future__ import annotations

import torch

DSL = "torch"
TUNABLES: tuple[str, ...] = ()
DEFAULTS: dict = {}
BASELINE = True  # the row other lanes are compared with


def config_reason(config: dict, shape: dict) -> str | None:
    return None


def eligibility(target: str) -> str | None:
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int | None:
    return None


def compile_for(config: dict, shape: dict, target: str) -> dict:
    raise NotImplementedError("eager PyTorch: nothing to compile ahead")


def versions() -> dict:
    v = {"torch": torch.__version__}
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
    return v
