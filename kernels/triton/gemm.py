"""Triton GEMM lane: C = A @ B with fp32 accumulation, C in the input dtype.

Three load paths, chosen by the tunable ``LOAD``:
  * ``ptr``: pointer arithmetic with masks (cp.async pipelining on sm_80+, wgmma on sm_90a);
  * ``tma``: host-built tensor descriptors (TMA bulk copies on sm_90a+; out-of-bounds tiles are
    zero-filled by the copy engine, so ragged shapes need no masks). TMA needs 16-byte aligned row
    strides, so K and N must be multiples of 8 for 2-byte dtypes;
  * ``tma_persistent``: the TMA path with one program per SM looping over output tiles.
Tile order is grouped (``GROUP_M`` tile-rows share a band of B) for L2 reuse.
"""
from __future__ import annotations

import time

import torch
import triton
import triton.language as tl

from kernels.triton import _common
from kernels.triton._common import versions  # noqa: F401  (the lane interface)

DSL = "triton"
KERNEL = "gemm"
TUNABLES = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "LOAD")
DEFAULTS = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4,
            "num_stages": 3, "LOAD": "ptr"}
TARGETS = ("sm_80", "sm_90a", "sm_100a", "sm_120a", "sm_121a")
DTYPES = ("float16", "bfloat16", "float32")
LOADS = ("ptr", "tma", "tma_persistent")
_TL_NAME = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


@triton.jit
def _tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped ordering: consecutive programs walk GROUP_M tile-rows down one tile-column band.
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    group = pid // per_group
    first_m = group * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % rows
    tile_n = (pid % per_group) // rows
    return tile_m, tile_n


@triton.jit
def _gemm_ptr(a_ptr, b_ptr, c_ptr, M, N, K,
              stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr):
    tile_m, tile_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Masks rather than clamped indices: clamping hides the contiguity of the column index, the
    # loads then cannot vectorize and the pipeliner falls back to a single stage. With M, N, K
    # divisible by 16 (JIT specialization) the masks are constant over 16 lanes and vectorize.
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    a_tile = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_tile = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, tl.cdiv(K, BLOCK_K)):
        k_rem = K - k0 * BLOCK_K
        a = tl.load(a_tile, mask=row_ok & (ks[None, :] < k_rem), other=0.0)
        b = tl.load(b_tile, mask=(ks[:, None] < k_rem) & col_ok, other=0.0)
        acc = tl.dot(a, b, acc)
        a_tile += BLOCK_K * stride_ak
        b_tile += BLOCK_K * stride_bk
    c = acc.to(c_ptr.dtype.element_ty)
    c_tile = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_tile, c, mask=row_ok & col_ok)


@triton.jit
def _gemm_tma(a_desc, b_desc, c_desc, M, N, K,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GROUP_M: tl.constexpr):
    tile_m, tile_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = tile_m * BLOCK_M
    off_n = tile_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k0 * BLOCK_K])
        b = b_desc.load([k0 * BLOCK_K, off_n])
        acc = tl.dot(a, b, acc)
    c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def _gemm_tma_persistent(a_desc, b_desc, c_desc, M, N, K, NUM_PROGS,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    # One program per SM walks the tiles with stride NUM_PROGS; flattening the tile and K loops
    # lets the pipeliner prefetch the next tile's operands during the current tile's epilogue.
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, NUM_PROGS, flatten=True):
        tile_m, tile_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = tile_m * BLOCK_M
        off_n = tile_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k_tiles):
            a = a_desc.load([off_m, k0 * BLOCK_K])
            b = b_desc.load([k0 * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    # The values each knob may take are the sweep file's (sweeps/gemm/triton.toml); the harness checks them.
    if config["LOAD"] != "ptr":
        elem = _elem_bytes(shape["dtype"])
        for dim in ("K", "N"):
            if (shape[dim] * elem) % 16:
                return f"LOAD=tma needs 16-byte aligned rows: {dim}={shape[dim]} x {elem} B"
    return None


def eligibility(target: str) -> str | None:
    """Why this lane cannot compile for ``target`` (None when it can)."""
    if target not in TARGETS:
        return f"triton gemm has no path for {target} (has {', '.join(TARGETS)})"
    return None


def target_reason(config: dict, target: str) -> str | None:
    """Config rules that depend on the compile target."""
    if config["LOAD"] != "ptr" and _common.cc(target) < 90:
        return f"LOAD={config['LOAD']} requires sm_90 or newer, target is {target}"
    return None


def _elem_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()



def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Analytic shared memory per CTA in bytes, modelled on Triton 3.6's pipeliner.

    The K loop keeps ``buffers`` copies of the A and B tiles: ``num_stages`` on sm_90/sm_100
    with BLOCK_M >= 64 (async MMA keeps one more tile in flight), else ``num_stages - 1``. The TMA path
    adds one 8-byte mbarrier per buffer and stages C through a BLOCK_M x BLOCK_N shared tile for
    its TMA store, which reuses the operand buffers (the total is the larger of the two), except
    in the persistent kernel, where the flattened loop keeps both live (the sum). The
    model was fitted against AOT compiles for sm_90a, sm_100a and sm_121a (tests hold it to the
    compiler within 64 B).
    """
    elem = _elem_bytes(shape["dtype"])
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    stages, cc = max(1, config["num_stages"]), _common.cc(target)
    # wgmma / tcgen05 need BLOCK_M >= 64; smaller tiles take the mma.sync path and its buffering.
    async_mma = cc in (90, 100, 103) and bm >= 64
    buffers = stages if async_mma else max(1, stages - 1)
    operands = buffers * (bm * bk + bk * bn) * elem
    blackwell_dc = async_mma and cc in (100, 103)  # tcgen05 path: extra MMA-completion barriers
    if config["LOAD"] != "ptr":
        barriers = (-(-8 * buffers // 16) * 16 + 16) if blackwell_dc else 8 * buffers
        if config["LOAD"] == "tma_persistent":  # the C staging tile is live across the flattened loop
            return operands + barriers + bm * bn * elem
        return max(operands + barriers, bm * bn * elem)
    return operands + ((16 if stages > 1 else 8) if blackwell_dc else 0)


def _signature(config: dict, shape: dict) -> tuple[object, dict, dict]:
    t = _TL_NAME[shape["dtype"]]
    consts = {k: config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    if config["LOAD"] != "ptr":
        bm, bn, bk = consts["BLOCK_M"], consts["BLOCK_N"], consts["BLOCK_K"]
        sig = {"a_desc": f"tensordesc<{t}[{bm}, {bk}]>", "b_desc": f"tensordesc<{t}[{bk}, {bn}]>",
               "c_desc": f"tensordesc<{t}[{bm}, {bn}]>", "M": "i32", "N": "i32", "K": "i32"}
        fn = _gemm_tma
        if config["LOAD"] == "tma_persistent":
            sig["NUM_PROGS"] = "i32"
            fn = _gemm_tma_persistent
    else:
        # Unit strides are compile-time 1, as the JIT specializes them for contiguous tensors;
        # without that the loads cannot vectorize and the pipeliner keeps a single stage.
        sig = {"a_ptr": f"*{t}", "b_ptr": f"*{t}", "c_ptr": f"*{t}", "M": "i32", "N": "i32", "K": "i32",
               "stride_am": "i32", "stride_ak": "constexpr", "stride_bk": "i32",
               "stride_bn": "constexpr", "stride_cm": "i32", "stride_cn": "constexpr"}
        consts.update(stride_ak=1, stride_bn=1, stride_cn=1)
        fn = _gemm_ptr
    sig.update({k: "constexpr" for k in consts if k not in sig})
    return fn, sig, consts


def cache_env(folder, target: str) -> dict:
    """Triton's cache folder for this target (the harness passes a per-lane, per-target folder)."""
    return {"TRITON_CACHE_DIR": str(folder / "triton")}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile for ``target`` (no GPU needed).

    Returns ``{"smem_bytes": int, "registers": int|None, "compile_s": float, "binary": "cubin"}``
    with the shared memory the launch will request, read from Triton's compiled metadata.
    """
    from triton.backends.compiler import GPUTarget

    fn, sig, consts = _signature(config, shape)
    # Pointer alignment / stride divisibility hints like the JIT gives contiguous 16-B aligned tensors.
    attrs = {}
    if config["LOAD"] == "ptr":
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2)}
        for i, dim in ((3, "M"), (4, "N"), (5, "K"), (6, "K"), (8, "N"), (10, "N")):
            if shape[dim] % 16 == 0:  # M, N, K, then stride_am, stride_bk, stride_cm
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    t0 = time.perf_counter()
    kernel = triton.compile(src, target=GPUTarget("cuda", _common.cc(target), 32),
                            options={"num_warps": config["num_warps"], "num_stages": config["num_stages"]})
    seconds = time.perf_counter() - t0
    return {"smem_bytes": int(kernel.metadata.shared), "registers": getattr(kernel, "n_regs", None),
            "compile_s": seconds, "binary": "cubin"}


def build(config: dict, shape: dict):
    """Return ``run(inputs, outputs)`` launching the kernel on the current device."""
    bm, bn, bk, gm = (config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"))
    launch = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
    M, N, K = shape["M"], shape["N"], shape["K"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)

    if config["LOAD"] != "ptr":
        from triton.tools.tensor_descriptor import TensorDescriptor
        descs: dict = {}  # descriptors encode pointer, shape and strides: rebuilt when any changes

        def desc(t, block):
            key = (t.data_ptr(), tuple(t.shape), t.stride(), tuple(block))
            if key not in descs:
                descs[key] = TensorDescriptor.from_tensor(t, block)
            return descs[key]

        persistent = config["LOAD"] == "tma_persistent"
        if persistent:
            progs = min(grid[0], _num_sms())
            grid = (progs,)

        def run(inputs, outputs):
            a, b, c = inputs["a"], inputs["b"], outputs["c"]
            args = (desc(a, [bm, bk]), desc(b, [bk, bn]), desc(c, [bm, bn]), M, N, K)
            consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, **launch)
            if persistent:
                k = _gemm_tma_persistent[grid](*args, grid[0], **consts)
            else:
                k = _gemm_tma[grid](*args, **consts)
            return _common.launch_info(k)
        return run

    def run(inputs, outputs):
        a, b, c = inputs["a"], inputs["b"], outputs["c"]
        k = _gemm_ptr[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                            c.stride(0), c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
                            **launch)
        return _common.launch_info(k)
    return run


def _num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return 4  # interpreter on the CPU: a few programs still exercise the persistent loop
