"""torch lane for GEMM: torch.matmul, i.e. cuBLAS on a GPU (the baseline row of every table).

It has no tunables and no shared-memory figure of its own (cuBLAS picks its kernel at run time),
and it also runs on the CPU.
"""
from __future__ import annotations

import torch

from kernels.torch._eager import (  # noqa: F401  (the lane interface)
    BASELINE, DEFAULTS, DSL, TUNABLES, config_reason, eligibility, smem_estimate)

KERNEL = "gemm"


def compile_for(config: dict, shape: dict, target: str) -> dict:
    raise NotImplementedError("torch.matmul dispatches to cuBLAS at run time: nothing to compile ahead")


def build(config: dict, shape: dict):
    def run(inputs, outputs):
        torch.matmul(inputs["a"], inputs["b"], out=outputs["c"])
    return run


def versions() -> dict:
    v = {"torch": torch.__version__}
    if torch.version.cuda:
        v["cuda"] = torch.version.cuda
        try:
            v["cublas"] = str(torch._C._cuda_getCompiledVersion())
        except Exception:  # private API; best effort
            pass
    return v
