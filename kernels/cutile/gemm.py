"""cuTile GEMM lane: C = A @ B with fp32 accumulation, C in the input dtype.

cuTile (``cuda.tile``) describes the kernel per output tile; the tileiras compiler picks the
thread layout, the copy engine (TMA on sm_90+ when strides allow it), the MMA instruction
(wgmma on sm_90a, tcgen05 on sm_100a, mma.sync on sm_80/sm_12x) and the pipeline depth. What the
kernel controls, and what this lane tunes:

  * ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``: the output tile and the K step of ``ct.load``/``ct.mma``;
  * ``GROUP_M``: grouped tile order (``GROUP_M`` tile-rows share a band of B) for L2 reuse;
  * ``num_ctas``: CTAs per cluster (CGA), ``occupancy``: CTAs expected per SM,
    ``num_worker_warps``: warps of the compute warp groups (compiler hints of ``@ct.kernel``;
    0 leaves the choice to the compiler);
  * ``LATENCY``: the ``latency=`` DRAM-traffic hint of the operand loads, 1 (low) to 10 (high);
    0 leaves it to the compiler;
  * ``PERSISTENT``: 1 launches ``min(tiles, SMs x max(occupancy, 1))`` programs that stride over the
    output tiles, 0 one program per tile.

Ragged shapes: operand tiles are loaded with ``padding_mode=ZERO`` so the K tail and the M/N edges
read zeros (TMA zero-fills out of bounds, the non-TMA path pads as asked), and ``ct.store`` drops
out-of-bounds elements (documented in ``cuda.tile.load``/``store``, cuda-tile 1.7.0 ``_stub.py``).
No tile lies wholly outside its array (grid and K loop use ceil division), which is the one case
the docs leave undefined. Unaligned row strides (K or N not a multiple of 8 for 2-byte types) are
specialized by the cuTile JIT without TMA, so any M, N, K runs.

Targets: tileiras 13.5 compiles for sm_80/86/87/88/89/90/100/103/107/110/120/121
(``tileiras --help``); the lab's "a" targets map to the plain name (tileiras emits sm_90a SASS for
``sm_90``: its ``.note.nv.tkinfo`` records ``-arch sm_90a``).
"""
from __future__ import annotations

import io
import time

import torch
import cuda.tile as ct

from kernels import _cubin, _launch_smem, _targets

DSL = "cutile"
KERNEL = "gemm"
TUNABLES = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_ctas", "occupancy", "num_worker_warps",
            "LATENCY", "PERSISTENT")
DEFAULTS = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_ctas": 1, "occupancy": 1,
            "num_worker_warps": 8, "LATENCY": 0, "PERSISTENT": 0}
# tileiras 13.5 --gpu-name values (tileiras --help); lab targets carry an "a" suffix.
ARCHS = (80, 86, 87, 88, 89, 90, 100, 103, 107, 110, 120, 121)
DTYPES = ("float16", "bfloat16", "float32")
_CT_DTYPE = {"float16": ct.float16, "bfloat16": ct.bfloat16, "float32": ct.float32}
_ELEM = {"float16": 2, "bfloat16": 2, "float32": 4}

Const = ct.Constant[int]


def _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M):
    # Grouped order: consecutive tiles walk GROUP_M tile-rows down one tile-column band.
    tiles_m = ct.cdiv(M, BLOCK_M)
    tiles_n = ct.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows = min(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (tile % per_group) % rows
    tile_n = (tile % per_group) // rows
    return tile_m, tile_n


def _tile_product(A, B, tile_m, tile_n, BLOCK_M, BLOCK_N, BLOCK_K, LATENCY):
    # Zero padding makes the K tail (and M/N edges) contribute nothing.
    zero = ct.PaddingMode.ZERO
    # fp32 operands go through the tensor cores as tf32 (the problem's fp32 band allows it).
    op_dtype = ct.tfloat32 if A.dtype == ct.float32 else A.dtype
    acc = ct.full((BLOCK_M, BLOCK_N), 0, dtype=ct.float32)
    for k in range(ct.num_tiles(A, axis=1, shape=(BLOCK_M, BLOCK_K))):
        if LATENCY > 0:
            a = ct.load(A, (tile_m, k), (BLOCK_M, BLOCK_K), padding_mode=zero, latency=LATENCY)
            b = ct.load(B, (k, tile_n), (BLOCK_K, BLOCK_N), padding_mode=zero, latency=LATENCY)
        else:
            a = ct.load(A, (tile_m, k), (BLOCK_M, BLOCK_K), padding_mode=zero)
            b = ct.load(B, (k, tile_n), (BLOCK_K, BLOCK_N), padding_mode=zero)
        acc = ct.mma(a.astype(op_dtype), b.astype(op_dtype), acc)
    return acc


def _gemm_tiles(A, B, C, BLOCK_M: Const, BLOCK_N: Const, BLOCK_K: Const, GROUP_M: Const,
                LATENCY: Const):
    """One program per output tile (1-D grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N))."""
    M = A.shape[0]
    N = B.shape[1]
    tile_m, tile_n = _tile_coords(ct.bid(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tile_product(A, B, tile_m, tile_n, BLOCK_M, BLOCK_N, BLOCK_K, LATENCY)
    ct.store(C, (tile_m, tile_n), acc.astype(C.dtype))


def _gemm_persistent(A, B, C, BLOCK_M: Const, BLOCK_N: Const, BLOCK_K: Const, GROUP_M: Const,
                     LATENCY: Const):
    """A fixed number of programs stride over the output tiles."""
    M = A.shape[0]
    N = B.shape[1]
    tiles = ct.cdiv(M, BLOCK_M) * ct.cdiv(N, BLOCK_N)
    for tile in range(ct.bid(0), tiles, ct.num_blocks(0)):
        tile_m, tile_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tile_product(A, B, tile_m, tile_n, BLOCK_M, BLOCK_N, BLOCK_K, LATENCY)
        ct.store(C, (tile_m, tile_n), acc.astype(C.dtype))


_BODIES = {0: _gemm_tiles, 1: _gemm_persistent}
_KERNELS: dict = {}


def _kernel(config: dict):
    """The ``ct.kernel`` for a config's body and compiler hints (0 = let the compiler choose)."""
    hints = tuple((k, config[k] or None) for k in ("num_ctas", "occupancy", "num_worker_warps"))
    key = (int(config["PERSISTENT"]), hints)
    if key not in _KERNELS:
        _KERNELS[key] = ct.kernel(_BODIES[key[0]], **dict(hints))
    return _KERNELS[key]


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    # The values each knob may take are the sweep file's (sweeps/gemm/cutile.toml); the harness checks them.
    if shape["M"] * shape["K"] >= 2**31 or shape["K"] * shape["N"] >= 2**31 or shape["M"] * shape["N"] >= 2**31:
        return "arrays with 2^31 or more elements need int64 indexing, which this lane does not specialize"
    return None


def _gpu_code(target: str) -> str:
    return f"sm_{_targets.cc(target)}"


def eligibility(target: str) -> str | None:
    """Why this lane cannot compile for ``target`` (None when it can)."""
    arch = _targets.cc(target)
    if arch not in ARCHS:
        have = ", ".join(f"sm_{a}" for a in ARCHS)
        return f"cuTile (tileiras 13.5) has no code generation for {target} (has {have})"
    return None


def target_reason(config: dict, target: str) -> str | None:
    """Config rules that depend on the compile target."""
    arch = _targets.cc(target)
    if config["num_ctas"] > 1 and arch is not None and arch < 90:
        return f"num_ctas={config['num_ctas']} needs thread block clusters (sm_90+), target is {target}"
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int | None:
    """Analytic shared memory per CTA in bytes: an upper bound, the target's opt-in per-block limit.

    tileiras, not the kernel, chooses the pipeline depth and the warp layout: it keeps as many
    copies of the operand tiles as fit in the target's shared memory (and shrinks the pipeline,
    or stages operands through registers, when a tile is large), so the compiled figure is not a
    function of the tile sizes alone. Over 108 AOT compiles per target (tiles 64-256 x 64-256 x
    32-128, occupancy 1-2, num_worker_warps auto/8, bf16) it never exceeded the per-block opt-in
    limit of the target: at most 230,536 B on sm_90 (limit 232,448 B) and 99,756 B on sm_121
    (limit 101,376 B). The occupancy hint is not a budget it keeps to (occupancy=2 configs still
    compiled to 230 KB on sm_90), so the bound does not divide by it. The estimate is therefore
    this limit (232,448 B for sm_90/sm_100/sm_103/sm_110; 166,912 B for sm_80/sm_87; 101,376 B
    for the others); the compiled figure (``compile_for``) is the exact one, and the tests hold
    compiled <= estimate.
    """
    return _targets.smem_optin(target)


def array_constraint(dtype: str, dims: tuple):
    """The ArrayConstraint the cuTile JIT derives for a contiguous, 16-byte aligned torch tensor of
    shape ``dims`` (any rank); the cuTile lanes' AOT signatures use it.

    Mirrors ``compute_array_specialization_bits`` and the ArrayConstraint construction in
    NVIDIA/cutile-python cext/tile_kernel.cpp: unit last stride is a constant, a stride divisible
    by 16 bytes is recorded as divisible by 16/elem elements, a shape divisible by 16 as such,
    non-negative strides, no aliasing, base address divisible by 16.
    """
    from cuda.tile.compilation import ArrayConstraint
    elem = _ELEM[dtype]
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    return ArrayConstraint(_CT_DTYPE[dtype], len(dims), index_dtype=ct.int32, stride_lower_bound_incl=0,
                           alias_groups=(), may_alias_internally=False,
                           stride_constant=(None,) * (len(dims) - 1) + (1,),
                           stride_divisible_by=tuple(16 // elem if s * elem % 16 == 0 else 1 for s in strides),
                           shape_divisible_by=tuple(16 if d % 16 == 0 else 1 for d in dims),
                           base_addr_divisible_by=16)


def _signature(config: dict, shape: dict):
    from cuda.tile.compilation import CallingConvention, KernelSignature
    dt = shape["dtype"]
    M, N, K = shape["M"], shape["N"], shape["K"]
    arrays = [array_constraint(dt, (M, K)), array_constraint(dt, (K, N)), array_constraint(dt, (M, N))]
    consts = [config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "LATENCY")]
    return KernelSignature(arrays + consts, CallingConvention.cutile_python_v1())


# ---- reading the cubin (ELF) -------------------------------------------------------------------

def cubin_resources(cubin: bytes, target: str) -> dict:
    """Shared memory, registers and stack of the (single) kernel in a tileiras cubin for ``target``.

    ``smem_bytes`` is the static shared memory as the driver counts it (``_launch_smem.driver_static``: the
    ``.nv.shared.<kernel>`` section less the 1 KiB sm_90+ reservation) plus the ``.nv.shared.reserved.*``
    sections the compiler reserves beside it. cuTile kernels use no dynamic shared memory (cuda-tile 1.7.0
    JIT launches them with none), so this is what a launch requests. ``smem_section`` is the raw section
    (cuobjdump's SHARED).
    """
    r = _cubin.resources(cubin)
    static = _launch_smem.driver_static(r, target)
    return {"smem_bytes": static + r["reserved"], "smem_static": static, "smem_section": r["static"],
            "smem_reserved": r["reserved"], "registers": r["registers"], "stack_bytes": r["stack"]}


def export_cubin(kernel, signature, gpu_code: str) -> bytes:
    """Compile ``kernel`` for one signature to a cubin through cuTile's export path, with its disk cache
    bypassed (a real compile every time: no binary reuse). The M2RNN lanes use it too."""
    from cuda.tile._cext import default_tile_context
    from cuda.tile.compilation import export_kernel

    cfg = default_tile_context.config
    saved, cfg.cache_dir = cfg.cache_dir, None
    try:
        buf = io.BytesIO()
        export_kernel(kernel, [signature], buf, gpu_code=gpu_code, output_format="cubin")
    finally:
        cfg.cache_dir = saved
    return buf.getvalue()


def _compile_cubin(config: dict, shape: dict, gpu_code: str) -> bytes:
    return export_cubin(_kernel(config), _signature(config, shape), gpu_code)


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile for ``target`` (no GPU needed).

    Returns ``{"smem_bytes", "registers", "stack_bytes", "compile_s", "binary": "cubin"}`` read
    from the cubin that tileiras produced for the signature the JIT would use for contiguous,
    16-byte aligned tensors of ``shape``.
    """
    reason = eligibility(target) or config_reason(config, shape) or target_reason(config, target)
    if reason:
        raise ValueError(reason)
    t0 = time.perf_counter()
    cubin = _compile_cubin(config, shape, _gpu_code(target))
    seconds = time.perf_counter() - t0
    res = cubin_resources(cubin, target)
    return {**res, "compile_s": seconds, "binary": "cubin"}


def build(config: dict, shape: dict):
    """Return ``run(inputs, outputs)`` launching the kernel on the current device.

    The kernel is JIT-compiled by cuTile on the first launch (and cached by signature); every
    call after that only launches. The first call also compiles the same signature ahead of time
    to read the shared memory, registers and stack of the launched binary (cached, returned by
    every call).
    """
    bm, bn, bk, gm, lat = (config[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "LATENCY"))
    M, N = shape["M"], shape["N"]
    tiles = -(-M // bm) * -(-N // bn)
    kernel = _kernel(config)
    if config["PERSISTENT"]:
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        grid = (min(tiles, sms * max(1, config["occupancy"])), 1, 1)
    else:
        grid = (tiles, 1, 1)
    info: dict = {}

    def run(inputs, outputs):
        a, b, c = inputs["a"], inputs["b"], outputs["c"]
        ct.launch(torch.cuda.current_stream(), grid, kernel, (a, b, c, bm, bn, bk, gm, lat))
        if not info:
            info.update(_launch_info(kernel, (a, b, c, bm, bn, bk, gm, lat)))
        return info

    return run


def _launch_info(kernel, args) -> dict:
    """Resources of the binary the JIT launched: the same signature compiled for this device."""
    from cuda.tile._compile import get_sm_arch
    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel
    try:
        sig = KernelSignature.from_kernel_args(kernel, args, CallingConvention.cutile_python_v1())
        buf = io.BytesIO()
        export_kernel(kernel, [sig], buf, gpu_code=get_sm_arch(), output_format="cubin")
        res = cubin_resources(buf.getvalue(), get_sm_arch())
    except Exception as exc:  # launch info is informative only; the launch itself already ran
        return {"launch_info_error": f"{type(exc).__name__}: {exc}"[:300]}
    stack = res.get("stack_bytes")
    return {"smem_bytes": res["smem_bytes"], "registers": res["registers"],
            "spills": None if stack is None else int(stack > 0)}


def versions() -> dict:
    import importlib.metadata as md
    v = {"cuda-tile": ct.__version__, "torch": torch.__version__}
    try:
        v["tileiras"] = md.version("nvidia-cuda-tileiras")
    except md.PackageNotFoundError:
        pass
    return v
