"""Helpers every Triton lane shares: targets, ahead-of-time compiles, launch info, versions."""
from __future__ import annotations

import os
import time

import torch
import triton

from kernels._targets import cc  # noqa: F401  (the lanes call _common.cc)

TARGETS = ("sm_80", "sm_90a", "sm_100a", "sm_120a", "sm_121a")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def eligibility(target: str) -> str | None:
    return None if target in TARGETS else f"no Triton path for {target} (have {', '.join(TARGETS)})"


def launch_info(kernel) -> dict:
    """Shared memory (bytes), registers per thread and spills of the kernel that was launched."""
    meta = getattr(kernel, "metadata", None)
    if meta is None:  # the interpreter returns no compiled kernel
        return {}
    return {"smem_bytes": int(meta.shared), "registers": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None)}


def versions() -> dict:
    return {"triton": triton.__version__, "torch": torch.__version__}


def aot(fn, sig: dict, consts: dict, target: str, num_warps: int, num_stages: int | None = None,
        maxnreg: int | None = None) -> dict:
    """Ahead-of-time compile for ``target`` (no GPU): shared memory (bytes) and registers of the cubin.
    maxnreg: registers per thread the compiler may use (None: its own choice)."""
    from triton.backends.compiler import GPUTarget
    sig = {**sig, **{k: "constexpr" for k in consts}}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    opts = ({"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages is not None else {})
            | ({"maxnreg": maxnreg} if maxnreg else {}))
    t0 = time.perf_counter()
    kernel = triton.compile(src, target=GPUTarget("cuda", cc(target), 32), options=opts)
    return {"smem_bytes": int(kernel.metadata.shared), "registers": getattr(kernel, "n_regs", None),
            "compile_s": time.perf_counter() - t0, "binary": "cubin"}
