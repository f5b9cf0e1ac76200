"""TileLang GEMM lane: C = A @ B with fp32 accumulation, C in the input dtype.

One tiled kernel: each CTA owns a ``block_M x block_N`` tile of C, walks K in ``block_K`` steps
under ``T.Pipelined`` (``num_stages`` shared-memory buffers), copies the A and B tiles into shared
memory with ``T.copy`` and accumulates them with ``T.gemm`` into a register fragment, then stores the
tile (directly from registers, or staged through a shared tile when ``epilogue = "smem"``).

What TileLang 0.1.15 makes of it depends on the target (read from the generated CUDA source):
  * sm_90a: TMA bulk loads into swizzled shared memory, a producer warpgroup (128 extra threads,
    warp specialization) feeding ``threads/128`` consumer warpgroups issuing wgmma;
  * sm_100a / sm_120a / sm_121a: TMA loads + warp specialization as well, but the fragment
    accumulator makes T.gemm lower to warp-level mma.sync (tcgen05 needs a tensor-memory
    accumulator, which this lane does not use), so sm_100a runs without its fastest MMA path;
  * sm_80/86/89: cp.async pipelining + mma.sync.
  A tile that leaves a warpgroup fewer than 64 rows (e.g. block_M = 32) silently drops sm_90a to
  mma.sync too; T.gemm's policy is a preference, TileLang picks the warp partition it can tile.
Ragged shapes: TMA zero-fills out-of-bounds boxes and TileLang guards every other global access
(checked in the generated source for M=197 N=136 K=264 and, with K rows that are not 16-byte
aligned, M=1531 N=1023 K=777, where TileLang itself falls back from TMA to guarded cp.async).

Tunables (the ones TileLang really exposes for this kernel):
  block_M, block_N, block_K   tile shape
  num_stages                  pipeline depth (shared-memory buffers of A and B)
  threads                     threads per CTA for the MMA (128 or 256: one or two warpgroups);
                              with warp specialization the launch adds a 128-thread producer group
  panel_size                  T.use_swizzle rasterization panel width in CTAs (0: plain row order)
  policy                      GemmWarpPolicy: how warps split the tile (Square, FullRow, FullCol)
  epilogue                    "direct": fragment -> global; "smem": fragment -> shared -> global
  tma                         False sets pass config tl.disable_tma_lower: the shared C tile is
                              stored by threads instead of a TMA store (only matters with the
                              smem epilogue; 0.1.15 marks the flag deprecated and warns)
  warp_specialized            False sets tl.disable_warp_specialized: no producer warpgroup and
                              no TMA loads; one role with a cp.async software pipeline
  aggressive_smem_merge       True sets tl.enable_aggressive_shared_memory_merge
(Pass-config names from tilelang.transform.PassConfigKey in the installed 0.1.15.)
"""
from __future__ import annotations

import time

import torch
import tilelang
import tilelang.language as T

from kernels.tilelang import _common as tl

DSL = "tilelang"
KERNEL = "gemm"
TUNABLES = ("block_M", "block_N", "block_K", "num_stages", "threads", "panel_size", "policy",
            "epilogue", "tma", "warp_specialized", "aggressive_smem_merge")
DEFAULTS = {"block_M": 128, "block_N": 256, "block_K": 64, "num_stages": 3, "threads": 256,
            "panel_size": 10, "policy": "Square", "epilogue": "smem", "tma": True,
            "warp_specialized": True, "aggressive_smem_merge": False}
TARGETS = tl.TARGETS
DTYPES = ("float16", "bfloat16")
_ELEM = {"float16": 2, "bfloat16": 2}


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile.

    Ragged M, N, K are handled by the generated code (TMA zero fill, guarded copies), so no shape
    is refused for raggedness; only dtypes and tiles too small for their warps are."""
    config = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    # The values each knob may take are the sweep file's (sweeps/gemm/tilelang.toml); the harness checks them.
    warps = config["threads"] // 32
    # TileLang needs every warp to own a multiple of 16 rows x 8 columns of C; this lab rule asks
    # for a 16x16 block per warp (TileLang: "No valid warp partition for T.gemm" otherwise).
    if config["block_M"] * config["block_N"] < warps * 16 * 16:
        return f"tile {config['block_M']}x{config['block_N']} too small for {warps} warps (16x16 of C per warp)"
    return None


def eligibility(target: str) -> str | None:
    """Why this lane cannot compile for ``target`` (None when it can)."""
    return tl.eligibility(KERNEL, target)


def target_reason(config: dict, target: str) -> str | None:
    """Config rules that depend on the compile target."""
    config = {**DEFAULTS, **config}
    cc = tl.cc(target)
    if cc < 90 and (config["tma"] is False or config["warp_specialized"] is False):
        # TMA and warp specialization do not exist before sm_90: the flags would change nothing,
        # so only the default spelling is accepted (keeps the search space free of duplicates).
        return f"tma / warp_specialized are sm_90+ features; leave them true on {target}"
    return None


def _pass_configs(config: dict) -> dict:
    return tl.pass_configs(config["tma"], config["warp_specialized"], config["aggressive_smem_merge"])


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Analytic shared memory per CTA in bytes (dynamic + static), modelled on TileLang 0.1.15.

    Dynamic: ``num_stages`` copies of the A tile (block_M x block_K) and the B tile
    (block_K x block_N) in the input dtype; with ``epilogue = "smem"`` the C tile
    (block_M x block_N) is added unless the shared-memory planner reuses the operand buffers
    for it (it does: the C tile is live only after the K loop), so the dynamic size is
    max(operands, C tile); except with ``aggressive_smem_merge`` on sm_100+ under the warp-
    specialized pipeline, where the compiler keeps them apart (operands + C tile). TileLang
    rounds each buffer to its alignment, which for these power-of-two tiles changes nothing.
    Static: 1 KiB when the warp-specialized TMA pipeline keeps its mbarriers there, else 0 (see
    ``_static_smem``). Tests hold the estimate to the compiled figure (dynamic + static) exactly.
    """
    config = {**DEFAULTS, **config}
    elem = _ELEM[shape["dtype"]]
    bm, bn, bk, st = config["block_M"], config["block_N"], config["block_K"], config["num_stages"]
    operands = st * (bm * bk + bk * bn) * elem
    dyn = operands
    if config["epilogue"] == "smem":
        dyn = max(operands, bm * bn * elem)
        if config["aggressive_smem_merge"] and tl.cc(target) >= 100 and _warp_specialized(config, shape, target):
            # Measured: on sm_100a/120a/121a (mma.sync under the TMA warp-specialized pipeline)
            # the aggressive merge leaves the C tile beside the operand buffers instead of on them.
            dyn = operands + bm * bn * elem
    return dyn + _static_smem(config, shape, target)


def _tma_rows(shape: dict) -> tuple[bool, bool]:
    """Whether A's and B's row strides allow TMA (16-byte aligned: K, N multiples of 8 in 2-byte dtypes)."""
    elem = _ELEM[shape["dtype"]]
    return (shape["K"] * elem) % 16 == 0, (shape["N"] * elem) % 16 == 0


def _static_smem(config: dict, shape: dict, target: str) -> int:
    """Static shared memory the launch adds to the dynamic size (what the driver reports as
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES), for TileLang 0.1.15 kernels.

    The warp-specialized TMA pipeline keeps its mbarrier array (2 x num_stages x 8 B) in static
    shared memory; TileLang aligns the dynamic buffer to 1024 B, so that rounds up to 1 KiB.
    TileLang builds that pipeline on sm_90+ when warp specialization is on and at least one of
    A, B can be loaded by TMA (row stride a multiple of 16 B); otherwise it falls back to
    cp.async with no static variables. Measured on an H100: driver static 1024 B (WS) and 0
    (no WS); the launch accepted a dynamic size up to 232,448 - static B, not more.
    """
    return 1024 if _warp_specialized(config, shape, target) else 0


def _warp_specialized(config: dict, shape: dict, target: str) -> bool:
    """Whether TileLang builds the warp-specialized TMA pipeline for this config, shape and target."""
    return tl.cc(target) >= 90 and config["warp_specialized"] and any(_tma_rows(shape))


# --------------------------------------------------------------------------------------------
# kernel


def _program(config: dict, shape: dict):
    M, N, K = shape["M"], shape["N"], shape["K"]
    dtype = shape["dtype"]
    bm, bn, bk = config["block_M"], config["block_N"], config["block_K"]
    stages, threads, panel = config["num_stages"], config["threads"], config["panel_size"]
    policy = getattr(T.GemmWarpPolicy, config["policy"])
    smem_epilogue = config["epilogue"] == "smem"

    @T.prim_func
    def gemm(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, bn), T.ceildiv(M, bm), threads=threads) as (bx, by):
            a_s = T.alloc_shared((bm, bk), dtype)
            b_s = T.alloc_shared((bk, bn), dtype)
            acc = T.alloc_fragment((bm, bn), "float32")
            if smem_epilogue:
                c_s = T.alloc_shared((bm, bn), dtype)
            # Grouped rasterization: CTAs launched together share A rows / B columns in L2.
            T.use_swizzle(panel_size=max(panel, 1), enable=panel > 0)
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, bk), num_stages=stages):
                T.copy(A[by * bm, k * bk], a_s)
                T.copy(B[k * bk, bx * bn], b_s)
                T.gemm(a_s, b_s, acc, policy=policy)
            if smem_epilogue:
                T.copy(acc, c_s)
                T.copy(c_s, C[by * bm, bx * bn])
            else:
                T.copy(acc, C[by * bm, bx * bn])

    return gemm


# --------------------------------------------------------------------------------------------
# compile


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile for ``target`` (no GPU needed).

    Lowers with TileLang for the explicit target, compiles the CUDA source to a cubin with the
    same nvcc callback and flags ``tilelang.compile`` uses (with TileLang's caches turned off, so a
    binary is never shared between targets), and returns ``{"smem_bytes", "registers",
    "compile_s", "binary": "cubin"}``: smem_bytes = the dynamic size the launch requests (the
    device function's ``dyn_shared_memory_buf``) + the cubin's static shared memory (its .nv.shared section,
    less the 1 KiB reservation it counts on sm_90+: see ``_common.resource_usage``).
    """
    config = {**DEFAULTS, **config}
    t0 = time.perf_counter()
    art = tl.lower(_program(config, shape), target, _pass_configs(config))
    cubin = tl.cubin_of(art.kernel_source, target, _pass_configs(config), use_cache=False)
    seconds = time.perf_counter() - t0
    usage = tl.resource_usage(cubin, target)
    dyn = tl.dynamic_smem(art)
    return {"smem_bytes": dyn + usage["static_smem"], "registers": usage["registers"],
            "compile_s": seconds, "binary": "cubin", "dynamic_smem": dyn, "static_smem": usage["static_smem"]}


# --------------------------------------------------------------------------------------------
# launch


def build(config: dict, shape: dict):
    """Return ``run(inputs, outputs)`` launching the kernel on the current device.

    Compiles once here for the current device's explicit target (never ``target="auto"``:
    TileLang's kernel cache keys on the target string, so "auto" could reuse a binary built for
    another GPU); each call only launches, on torch's current stream (TVM-FFI reads it through
    torch's DLPack exchange API). The static shapes are baked in: build per shape.
    """
    config = {**DEFAULTS, **config}
    target = tl.device_target()
    if eligibility(target):
        raise RuntimeError(eligibility(target))
    kernel = tilelang.compile(_program(config, shape), target=tl.tvm_target(target), execution_backend="tvm_ffi",
                              pass_configs=_pass_configs(config))
    info = _launch_info(kernel, config, shape, target)

    def run(inputs, outputs):
        kernel(inputs["a"], inputs["b"], outputs["c"])
        return info
    return run


def _launch_info(kernel, config: dict, shape: dict, target: str) -> dict:
    """Shared memory (dynamic + static) and registers of the built kernel, from its cubin.

    The dynamic size comes from the lowered device module; a kernel that TileLang loaded from its
    on-disk cache carries no artifact (``kernel.artifact is None``), so then the program is
    lowered again (no nvcc, well under a second). The cubin comes through the same nvcc callback
    with TileLang's binary cache on, which ``tilelang.compile`` has filled for this exact source,
    target and flags (no second nvcc run). Launch info is best effort: on any failure the figures
    are None and the kernel still runs."""
    try:
        art = kernel.artifact if getattr(kernel, "artifact", None) is not None else \
            tl.lower(_program(config, shape), target, _pass_configs(config))
        dyn = tl.dynamic_smem(art)
        cubin = tl.cubin_of(kernel.get_kernel_source(), target, _pass_configs(config), use_cache=True)
        usage = tl.resource_usage(cubin, target)
    except Exception:
        return {"smem_bytes": None, "registers": None, "spills": None}
    return {"smem_bytes": dyn + usage["static_smem"], "registers": usage["registers"], "spills": None}


def versions() -> dict:
    import tvm_ffi
    return {"tilelang": tilelang.__version__, "apache-tvm-ffi": getattr(tvm_ffi, "__version__", "?"),
            "torch": torch.__version__}
