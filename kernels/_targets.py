"""Compile targets, for every lane whatever its DSL: the architecture number of an explicit target name,
the opt-in shared memory per block of that architecture, and the target of the GPU present.

Opt-in maximum shared memory per block, bytes (CUDA C++ Programming Guide, "Technical Specifications
per Compute Capability"): 163 KiB on 8.0 / 8.7, 99 KiB on 8.6 / 8.8 / 8.9 / 10.7 / 12.x, 227 KiB on
9.0 / 10.0 / 10.3 / 11.0 (each 1 KiB below the SM's shared memory per block, which the driver reserves).
"""
from __future__ import annotations

import re

SMEM_OPTIN = {80: 166_912, 86: 101_376, 87: 166_912, 88: 101_376, 89: 101_376, 90: 232_448, 100: 232_448,
              103: 232_448, 107: 101_376, 110: 232_448, 120: 101_376, 121: 101_376}


def cc(target: str) -> int:
    """Architecture number of an explicit target: sm_90a -> 90, sm_121a -> 121, sm_100f -> 100."""
    m = re.fullmatch(r"sm_(\d+)[af]?", target)
    if m is None:
        raise ValueError(f"not an explicit compile target: {target!r} (expected e.g. sm_90a, sm_121a)")
    return int(m.group(1))


def smem_optin(target: str) -> int:
    """The largest shared memory one block may opt in to on ``target``, bytes."""
    arch = cc(target)
    if arch not in SMEM_OPTIN:
        raise ValueError(f"no opt-in shared memory figure for {target} (known: "
                         f"{', '.join(f'sm_{a}' for a in SMEM_OPTIN)})")
    return SMEM_OPTIN[arch]


def device_target() -> str:
    """The current GPU's explicit target: architecture-specific ("a") from sm_90 on, where it exists."""
    import torch
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    return f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
