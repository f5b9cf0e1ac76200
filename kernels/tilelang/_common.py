"""Compile plumbing shared by the TileLang lanes (TileLang 0.1.15): explicit targets, lowering
without nvcc, AOT cubins with TileLang's own nvcc callback, and resource figures read from the cubin."""
from __future__ import annotations


import tilelang
import tvm
from tilelang.transform import PassConfigKey

from kernels import _cubin
from kernels._targets import cc, device_target  # noqa: F401  (the lanes call tl.cc, tl.device_target)

TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_120a", "sm_121a")


def eligibility(kernel: str, target: str) -> str | None:
    """Why a TileLang lane cannot compile for ``target`` (None when it can)."""
    if target not in TARGETS:
        return f"tilelang {kernel} has no path for {target} (has {', '.join(TARGETS)})"
    return None


def pass_configs(tma: bool, warp_specialized: bool, aggressive_smem_merge: bool, fast_math: bool = False) -> dict:
    """TileLang pass configs for the lanes' boolean tunables (names from tilelang.transform.PassConfigKey)."""
    pc = {}
    if not tma:
        pc[PassConfigKey.TL_DISABLE_TMA_LOWER.value] = True
    if not warp_specialized:
        pc[PassConfigKey.TL_DISABLE_WARP_SPECIALIZED.value] = True
    if fast_math:
        pc[PassConfigKey.TL_ENABLE_FAST_MATH.value] = True
    if aggressive_smem_merge:
        pc[PassConfigKey.TL_ENABLE_AGGRESSIVE_SHARED_MEMORY_MERGE.value] = True
    return pc


def tvm_target(target: str) -> tvm.target.Target:
    # 0.1.15 takes a dict for target attributes (tilelang.compile docstring); "arch" carries the
    # "a" suffix that enables wgmma / setmaxnreg on sm_90a.
    return tvm.target.Target({"kind": "cuda", "arch": target})


def lower(program, target: str, pass_configs: dict):
    """TileLang lowering to CUDA source (no nvcc): the artifact with the device module."""
    tgt = tvm_target(target)
    with tvm.transform.PassContext(opt_level=3, config=pass_configs), tgt:
        return tilelang.lower(program, target=tgt)


def dynamic_smem(artifact) -> int:
    """Dynamic shared memory (bytes) the launch requests: the device function's dyn_shared_memory_buf."""
    sizes = [int(f.attrs["dyn_shared_memory_buf"]) for f in artifact.device_mod.functions.values()
             if f.attrs is not None and "dyn_shared_memory_buf" in f.attrs]
    return max(sizes, default=0)


def cubin_of(source: str, target: str, pass_configs: dict, use_cache: bool) -> bytes:
    """nvcc through TileLang's own callback and flags; ``use_cache=False`` turns TileLang's binary
    cache off so that a binary is never shared between targets."""
    from tilelang.cuda.backend import tilelang_callback_cuda_compile
    from tilelang.env import CacheState
    was_enabled = CacheState.is_enabled()
    if not use_cache:
        CacheState.disable()
    try:
        return bytes(tilelang_callback_cuda_compile(source, tvm_target(target), pass_configs))
    finally:
        if was_enabled and not use_cache:
            CacheState.enable()


def resource_usage(cubin: bytes, target: str) -> dict:
    """The (single) kernel of a TileLang cubin: name, registers per thread, static shared memory and
    spill bytes (per-thread stack + local memory), read by kernels/_cubin.py.

    On sm_90 and newer the kernel's .nv.shared section (cuobjdump's SHARED) holds 1 KiB more than the
    driver's static size (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES): a plain nvcc kernel with no shared
    variables reads SHARED:1024 for sm_90a and sm_121a, and on an H100 TileLang cubins reading 2048 / 1024
    had driver static sizes 1024 / 0. That 1 KiB is the per-block reservation the opt-in limit
    (232,448 B on H100, 101,376 B on GB10) is already net of, so it is taken off here: the figure
    returned is what counts against the opt-in limit (kernels/_launch_smem.py applies the same rule to
    the CuTe DSL and cuTile cubins; the driver's figures behind it are there)."""
    r = _cubin.resources(cubin)
    static = r["static"]
    if cc(target) >= 90:
        static = max(0, static - 1024)
    return {"name": r["kernel"], "registers": r["registers"], "static_smem": static,
            "spill_bytes": (r["stack"] or 0) + r["local"]}
