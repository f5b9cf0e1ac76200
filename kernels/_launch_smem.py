"""Static shared memory as the driver counts it against a block's opt-in limit (CuTe DSL and cuTile lanes).

A kernel's .nv.shared.<kernel> section (cuobjdump's SHARED) holds, on sm_90 and newer, the 1 KiB per-block
reservation that the opt-in limit (232,448 B on H100, 101,376 B on GB10) is already net of; the driver's
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES leaves it out. Measured on an H100 (scripts/smem_truth.py, 2026-11-25,
results/logs/20261125T220405Z-mamba_bwd_bwd-h100-972-log.txt): a CuTe DSL GEMM section of 1,024 B reads
0 B, a cuTile GEMM section of 214,120 B reads 213,096 B. kernels/tilelang/_common.py ``resource_usage``
applies the same rule to TileLang cubins.
"""
from __future__ import annotations

from kernels._targets import cc

BLOCK_RESERVATION = 1024  # bytes every block reserves on sm_90 and newer


def driver_static(res: dict, target: str) -> int:
    """The kernel's static shared memory as the driver counts it, bytes, from ``kernels._cubin.resources``'
    figures: the .nv.shared.<kernel> section less BLOCK_RESERVATION on sm_90+. The .nv.shared.reserved.*
    sections are not included."""
    static = res["static"]
    return max(0, static - BLOCK_RESERVATION) if cc(target) >= 90 else static
