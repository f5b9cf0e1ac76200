"""Helpers every Triton lane shares: target parsing, launch info of a compiled kernel, versions."""
from __future__ import annotations

import torch
import triton


def cc(target: str) -> int:
    """Compute capability of an explicit target name: sm_90a -> 90, sm_121a -> 121."""
    return int(target.removeprefix("sm_").rstrip("a"))


def launch_info(kernel) -> dict:
    """Shared memory (bytes), registers per thread and spills of the kernel that was launched."""
    meta = getattr(kernel, "metadata", None)
    if meta is None:  # the interpreter returns no compiled kernel
        return {}
    return {"smem_bytes": int(meta.shared), "registers": getattr(kernel, "n_regs", None),
            "spills": getattr(kernel, "n_spills", None)}


def versions() -> dict:
    return {"triton": triton.__version__, "torch": torch.__version__}
