"""A GEMM lane whose FAULT tunable makes a real GPU fault, for the fault campaign (scripts/fault_campaign.py).

FAULT: none (a correct Triton GEMM), illegal_address (a store 2^40 elements past the output: an
illegal memory access that poisons the CUDA context), hang (a kernel spinning on a flag nobody sets),
nan (the GEMM writes NaN), oom (asks the allocator for 64 TiB), compile_error (a kernel Triton
rejects: tl.arange over 3 elements; also fails the preflight's ahead-of-time compile), sigkill (the
worker kills itself with SIGKILL mid-trial). Each must end as a row with its status and reason while
the sweep goes on. BLOCK (16 or 32) gives the campaign more than one healthy config.
"""
from __future__ import annotations

import os
import signal

import torch
import triton
import triton.language as tl

from kernels.triton import _common

DSL = "faults"
KERNEL = "gemm"
FAULTS = ("none", "illegal_address", "hang", "nan", "oom", "compile_error", "sigkill")
TUNABLES = ("FAULT", "BLOCK")
DEFAULTS = {"FAULT": "none", "BLOCK": 32}


@triton.jit
def _gemm(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK: tl.constexpr, POISON: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BLOCK + tl.arange(0, BLOCK)
    rn = pn * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=(rm[:, None] < M) & (k0 + rk < K)[None, :], other=0.0)
        b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :], mask=(k0 + rk < K)[:, None] & (rn < N)[None, :], other=0.0)
        acc += tl.dot(a, b)
    if POISON:
        acc = acc * float("nan")
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _store_far(c_ptr):
    tl.store(c_ptr + (1 << 40), 1.0)


@triton.jit
def _spin(flag_ptr):
    while tl.load(flag_ptr, volatile=True) == 0:
        pass


@triton.jit
def _rejected(c_ptr):
    tl.store(c_ptr + tl.arange(0, 3), 0.0)  # tl.arange needs a power-of-2 length: a compile error


def config_reason(config: dict, shape: dict) -> str | None:
    if config["FAULT"] not in FAULTS:
        return f"FAULT={config['FAULT']!r} is not one of {', '.join(FAULTS)}"
    if config["BLOCK"] not in (16, 32):
        return f"BLOCK={config['BLOCK']} must be 16 or 32"
    return None


def eligibility(target: str) -> str | None:
    return _common.eligibility(target)


def smem_estimate(config: dict, shape: dict, target: str) -> int | None:
    return None  # the compiled figure decides; this lane exists to fail, not to fit


def compile_for(config: dict, shape: dict, target: str) -> dict:
    e = "*fp16" if shape["dtype"] == "float16" else "*bf16"
    if config["FAULT"] == "compile_error":
        return _common.aot(_rejected, {"c_ptr": e}, {}, target, 4)
    sig = {"a_ptr": e, "b_ptr": e, "c_ptr": e, "M": "i32", "N": "i32", "K": "i32"}
    return _common.aot(_gemm, sig, {"BLOCK": config["BLOCK"], "POISON": config["FAULT"] == "nan"}, target, 4)


def build(config: dict, shape: dict):
    fault, block = config["FAULT"], config["BLOCK"]
    if fault == "compile_error":  # the JIT compile, in the worker's compile phase
        _rejected[(1,)](torch.empty(4, device="cuda" if torch.cuda.is_available() else "cpu"))

    def run(inputs, outputs):
        c = outputs["c"]
        if fault == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "oom":
            torch.empty(1 << 46, dtype=torch.uint8, device=c.device)
        if fault == "illegal_address":
            _store_far[(1,)](c)
        if fault == "hang":
            _spin[(1,)](torch.zeros(1, dtype=torch.int32, device=c.device))
        M, N, K = shape["M"], shape["N"], shape["K"]
        grid = (triton.cdiv(M, block), triton.cdiv(N, block))
        _gemm[grid](inputs["a"], inputs["b"], c, M, N, K, BLOCK=block, POISON=fault == "nan")
        return _common.launch_info(None)
    return run


def versions() -> dict:
    return _common.versions()
