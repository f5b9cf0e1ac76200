"""TileLang lane for mamba_bwd_bwd (the Mamba-3 MIMO backward kernel "bwd_bwd").

Design: chunk-parallel, three kernels instead of upstream's one CTA per (batch, head) walking the
chunks serially. The only serial dependency of bwd_bwd is the state gradient
dS_{c-1} = exp(DA_CS_last(c)) dS_c + q_hat_c^T (exp(DA_CS) * dy_c), an N x P linear recurrence; once
every dS_c is known, each chunk's work (about ten GEMMs and all the elementwise math) is independent.

1. ``scan``: grid (H, B, N/scan_block_N * P/scan_block_P). Each CTA walks the chunks in reverse
   for one (block_N x block_P) tile of dS, writing dS_c (bf16, the GEMM operand dtype upstream uses
   too) to a workspace [B, H, nc, N, P]; it reads no STATES. Per step: the chunk's raw Q rows, angles,
   DOUT and Z are copied into shared memory (cp.async, ``scan_stages`` steps ahead), then
   the q_hat tile (bias + rotary) and the dy tile (Phi, SiLU gate, exp(DA_CS)) are built there and
   fed to one GEMM. Tiling N and P gives B*H*tiles CTAs instead of B*H. The scan never takes the
   aggressive shared-memory merge (see ``_pass_configs``).
2. ``chunk``: grid (nc, H, B), one CTA per chunk: all outputs except the cross-chunk sums, plus
   per-chunk partials of DMIMO_V [B,H,nc,R,P] and DD [B,H,nc] (workspaces). DDA = exp(DA_CS at the
   chunk's last step) * sum(S_c * dS_c) comes from the S_c tile it already stages and the bf16 dS_c
   (that rounding costs DDA ~1.6e-3 rel_l2, inside its tolerance: tests/test_mamba_reference.py).
   The same-step R x R terms
   (QK_DOT into dPsiV, dqk into DK and DQ) ride in block-diagonal F x F operands of tensor-core GEMMs,
   and DD is the trace of PsiV dy^T, which the dkq GEMM already holds. Only q_hat and rot(k) live in
   shared memory, in N/2-column halves, and the rotary gradients are done in registers (see
   ``_chunk_program``); dPsiV is staged in the input dtype and k_hat.q_hat recomputed for DSSDA
   instead of kept. Compiled for two CTAs per SM (__launch_bounds__; registers capped at
   65536 / (2 threads)): two are resident only if the shared memory fits too.
3. ``reduce``: grid (H, B): DMIMO_V and DD summed over chunks (deterministic, no atomics), one
   thread per output element.

With ``scan_segments`` K > 1 the scan runs K ranges of chunks at once: a local pass (``scan_local``)
runs ranges 1..K-1 from dS = 0 and leaves each range's partial dS and decay, then each scan CTA
starts its range from the carry those compose to. The serial walk is 2 nc/K steps on K times the
CTAs: it pays where B*H and the dS tiles leave SMs idle.

Precision follows upstream: GEMM operands in the input dtype (bf16/fp16), fp32 accumulation, the
elementwise math and every partial in fp32.

Tunables (values and rules: sweeps/mamba_bwd_bwd/tilelang.toml):
  scan_segments       ranges of chunks the scan walks at once (above)
  threads             threads of the chunk kernel (128 / 256)
  scan_threads        threads of the scan kernel (128 / 256)
  scan_block_N/P      dS tile of one scan CTA (divides N / P). Smaller tiles give more CTAs (what
                      B*H = 32 needs) but recompute q_hat per P tile and dy per N tile
  scan_stages         T.Pipelined stages of the scan's chunk loop (0: no software pipelining)
  global_tables       exp(SEGSUM) and cos / sin of the angles read from global memory where used
                      instead of staged in shared fp32 tables (C*C*4 + 2*C*N/rd*4 bytes less: 32 KiB at
                      C = 64, N = 128)
  stage_out           DQ / DK staged in a shared F x N tile and stored in whole rows
  paired_tiles        the chunk kernel's rotary-pair operands as one interleaved tile each, one GEMM per
                      product instead of one per half (see ``_chunk_program``)
  fast_math           True sets tl.enable_fast_math (fast exp/sin/cos); false only as the sweep file's
                      [precision.exact] run option
Fixed (pass configs): no TMA lowering, no warp specialization, the aggressive shared-memory merge in
the chunk kernel only (see ``_pass_configs``); GEMM operand tiles swizzled.
Chunk size C is a problem parameter (it fixes STATES and SEGSUM), not a tunable.
"""

import functools
import time

import torch
import tilelang
import tilelang.language as T

from kernels.tilelang import _common as tl
from kernels.tilelang import _smem_plan as smem_plan

DSL = "tilelang"
KERNEL = "mamba_bwd_bwd"
TUNABLES = ("scan_segments", "threads", "scan_threads", "scan_block_N", "scan_block_P", "scan_stages", "global_tables",
            "stage_out", "paired_tiles", "fast_math")
DEFAULTS = {"scan_segments": 1, "threads": 256, "scan_threads": 128, "scan_block_N": 64, "scan_block_P": 16,
            "scan_stages": 2, "global_tables": False, "stage_out": False, "paired_tiles": False,
            "fast_math": True}
TARGETS = tl.TARGETS
DTYPES = ("float16", "bfloat16")
F32 = "float32"


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    c = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    # The values each knob may take are the sweep file's (sweeps/mamba_bwd_bwd/tilelang.toml); the harness checks them.
    if c["scan_stages"] not in (0, 2):
        # 3 stages gave a wrong dS at nc = 256 (H100, 2026-11-22, run 20261122T113445Z, parity caught it;
        # it passed at the 3-chunk parity shapes): the scan's pipeline is validated at 0 and 2 only.
        return f"scan_stages={c['scan_stages']} must be 0 or 2"
    for key, dim in (("scan_block_N", "N"), ("scan_block_P", "P")):
        v = c[key]
        if not isinstance(v, int) or v < 16 or shape[dim] % v:
            return f"{key}={v} must be >= 16 and divide {dim}={shape[dim]}"
    F = shape["C"] * shape["R"]
    # T.gemm needs each warp to own at least a 16 x 16 tile of every product; the smallest
    # products are F x F and F x N / F x P (M = F rows).
    warps = c["threads"] // 32
    if F * min(F, shape["N"], shape["P"]) < warps * 256 or F % 16 or shape["N"] % 16 or shape["P"] % 16:
        return f"C*R={F}, N={shape['N']}, P={shape['P']} too small for {warps} warps (16x16 of each product per warp)"
    if c["scan_block_N"] * c["scan_block_P"] < (c["scan_threads"] // 32) * 256:
        return f"scan tile {c['scan_block_N']}x{c['scan_block_P']} too small for {c['scan_threads'] // 32} warps"
    if c["paired_tiles"] and (F % 64 or shape["N"] % (2 * _PAIR_BLOCK * (warps // 4))):
        # the pair layout assumes the chunk kernel's products split by warpgroup rows (4 warps over 64 rows),
        # then over N in groups of whole 16-column blocks
        return (f"paired_tiles at C*R={F}, N={shape['N']}, {warps} warps: needs C*R a multiple of 64 and N a "
                f"multiple of {2 * _PAIR_BLOCK * (warps // 4)} (whole 16-column blocks per warpgroup)")
    if (c["scan_block_N"], c["scan_block_P"], c["scan_threads"]) == (32, 128, 512):
        return ("scan tile 32x128 at 512 threads: TileLang 0.1.15 cannot reduce its DDA row sums (ReduceOp: "
                "source index depends on a thread-owned reduce segment)")
    return None


def eligibility(target: str) -> str | None:
    return tl.eligibility(KERNEL, target)


def target_reason(config: dict, target: str) -> str | None:
    """Rules that depend on the target; the TileLang 0.1.15 failures are the compiler's, checked on the
    CPU for every scan tile and chunk form of the space (tests/test_tilelang_mamba.py)."""
    c = {**DEFAULTS, **config}
    if tl.cc(target) == 90 and c["scan_block_N"] == 128:
        return ("scan_block_N=128 on sm_90: TileLang 0.1.15 cannot reduce the DDA row sums of a 128-row wgmma "
                "accumulator (ReduceOp: source index depends on a thread-owned reduce segment)")
    return None


def shape_target_reason(config: dict, shape: dict, target: str) -> str | None:
    """Rules that depend on both the shape and the target."""
    c = {**DEFAULTS, **config}
    half, warpgroups = shape["N"] // 2, c["threads"] // 128
    if tl.cc(target) == 90 and half < 16 * warpgroups and not c["paired_tiles"]:
        return (f"N={shape['N']} at {c['threads']} threads on sm_90: each of the {warpgroups} warpgroups "
                f"would hold under 16 of the N/2 = {half} columns of the chunk kernel's half tiles "
                "(TileLang 0.1.15: layout conflict on qh_lo); use fewer threads")
    return None


def _pass_configs(config: dict, kernel: str) -> dict:
    """Pass configs of one of the three kernels. Only the chunk kernel takes the aggressive merge: in
    the scan, TileLang 0.1.15's planner gave dy_s the memory of z_raw / do_raw, which the loop that
    writes dy_s still reads (scan_stages = 0: every config, every shape), so dS came out wrong."""
    return tl.pass_configs(False, False, kernel == "chunk", config["fast_math"])


# The scan's T.Pipelined copies, in the order its prologue first touches them (TileLang 0.1.15).
_SCAN_PIPELINED = ("ang_raw", "q_raw", "do_raw", "z_raw", "da_raw")
# Config keys that change the shared buffers (or their alignment) of each kernel.
_SMEM_KEYS = {"chunk": ("threads", "global_tables", "stage_out", "paired_tiles"),
              "scan": ("scan_block_N", "scan_block_P", "scan_stages", "scan_threads")}


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Dynamic shared memory per CTA of the largest of the three kernels (the chunk kernel or the
    scan), bytes, without compiling: TileLang's planner replayed on each kernel's own program
    (kernels/tilelang/_smem_plan.py): the chunk kernel at statement granularity (aggressive merge),
    the scan with every buffer live across its chunk loop (the merge is off there) and its pipelined
    copies times scan_stages. Tested equal to the compiler for sm_90a and sm_121a
    (tests/test_tilelang_mamba.py)."""
    c = {**DEFAULTS, **config}
    shape_key = tuple(sorted(shape.items()))
    return max(_planned(k, tuple(c[x] for x in _SMEM_KEYS[k]), shape_key, target) for k in _SMEM_KEYS)


@functools.lru_cache(maxsize=1024)
def _planned(kernel: str, key: tuple, shape_key: tuple, target: str) -> int:
    config, shape = {**DEFAULTS, **dict(zip(_SMEM_KEYS[kernel], key))}, dict(shape_key)
    program = _PROGRAMS[kernel](config, shape)
    if kernel == "chunk":
        return smem_plan.planned_bytes(program, target, True,
                                       reduce_workspace=4 * config["threads"])
    return smem_plan.planned_bytes(program, target, False, {n: max(config["scan_stages"], 1) for n in _SCAN_PIPELINED})


# --------------------------------------------------------------------------------------------
# kernels


def _dims(shape: dict):
    C, R = shape["C"], shape["R"]
    return (shape["B"], shape["S"], shape["H"], shape["G"], shape["N"], shape["P"], R, C, shape["S"] // C,
            shape["N"] // shape["rd"], C * R)


def _dy_value(DOUT, Z, MIMO_O, MIMO_Z, b, t, r, h, p, shape, fast: bool):
    """dL/dy at (step t, rank r, head h, column p), fp32: DOUT through Phi and the SiLU(Z*Zeta) gate
    (``fast``: see _silu)."""
    if shape["reduceO"]:
        d = T.cast(DOUT[b, t, h, p], F32) * MIMO_O[h, r, p]
    else:
        d = T.cast(DOUT[b, t, r, h, p], F32)
    if shape["hasZ"]:
        d = d * _silu(T.cast(Z[b, t, h, p], F32) * MIMO_Z[h, r, p], fast)
    return d


def _silu(x, fast: bool):
    """x sigmoid(x), fp32. fast: h + h tanh(h) with h = x / 2, which nvcc's --use_fast_math (TileLang's
    fast_math) turns into one MUFU.TANH where the sigmoid takes two MUFU ops (exp and reciprocal)."""
    if fast:
        h = x * 0.5
        return h + h * T.tanh(h)
    return x * T.sigmoid(x)


def _step_sum(terms: list):
    """The sum of ``terms`` as one unrolled expression, added pairwise. A small sum written this way into a
    T.Parallel(C) loop runs on C threads; accumulated in a [C] fragment, TileLang 0.1.15 replicates it
    (and its shared-memory loads) on every thread of the CTA."""
    while len(terms) > 1:
        terms = [terms[i] + terms[i + 1] if i + 1 < len(terms) else terms[i] for i in range(0, len(terms), 2)]
    return terms[0]


def _seg(seg_s, SEGSUM, b, h, c, t, s):
    """exp(SEGSUM[t, s]) masked to s < t: from the staged table, or (seg_s None) from global memory."""
    if seg_s is not None:
        return seg_s[t, s]
    return T.if_then_else(s < t, T.exp(SEGSUM[b, h, c, t, s]), 0.0)


def _cos(cos_s, ANGLES, b, t0, h, t, j):
    """cos of the angle of step t0 + t, pair j: from the staged table, or (cos_s None) from global."""
    return cos_s[t, j] if cos_s is not None else T.cos(ANGLES[b, t0 + t, h, j])


def _sin(sin_s, ANGLES, b, t0, h, t, j):
    return sin_s[t, j] if sin_s is not None else T.sin(ANGLES[b, t0 + t, h, j])


def _scan_program(config: dict, shape: dict, local: bool = False):
    """dS scan over the chunks in reverse, from dS = 0.

    With K = scan_segments > 1, the chunks are K segments of L = nc / K and the grid has a
    CTA per (tile, segment). ``local``: segments 1..K-1 each run their chunks from dS = 0 without writing
    dS, leaving that partial dS (fp32) in CARRY[:, :, k] and the segment's whole decay
    exp(sum of DA_CS at each chunk's last step) in SEG_DECAY[:, :, k]. The main scan then starts
    segment k from carry_k = sum over j > k of (decay of segments k+1..j-1) * CARRY_j, composed
    from j = K-1 down (the recurrence is linear in dS), and walks only its own chunks: 2L serial
    steps instead of nc, on K times the CTAs."""
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    dtype = shape["dtype"]
    bn, bp, threads, stages = config["scan_block_N"], config["scan_block_P"], config["scan_threads"], config["scan_stages"]
    tiles_p = P // bp
    tiles = (N // bn) * tiles_p
    half = N // 2
    reduceO, hasZ = shape["reduceO"], shape["hasZ"]
    dout_shape = (B, S, H, P) if reduceO else (B, S, R, H, P)
    K = _segments(config, shape)
    L = nc // K
    grid_segments, seg_first = (K - 1, 1) if local else (K, 0)

    @T.prim_func
    def scan(Q: T.Tensor((B, S, R, G, N), dtype), Q_BIAS: T.Tensor((H, R, N), F32),
             ANGLES: T.Tensor((B, S, H, nr), F32), DA_CS: T.Tensor((B, H, S), F32),
             DOUT: T.Tensor(dout_shape, dtype), Z: T.Tensor((B, S, H, P), dtype),
             MIMO_O: T.Tensor((H, R, P), F32), MIMO_Z: T.Tensor((H, R, P), F32),
             DSTATES: T.Tensor((B, H, nc, N, P), dtype), CARRY: T.Tensor((B, H, K, N, P), F32),
             SEG_DECAY: T.Tensor((B, H, K), F32)):
        with T.Kernel(H, B, tiles * grid_segments, threads=threads) as (h, b, bz):
            hq = h // (H // G)
            tile = bz % tiles
            seg = bz // tiles + seg_first
            n0 = (tile // tiles_p) * bn
            p0 = (tile % tiles_p) * bp
            # raw per-chunk inputs, copied (asynchronously when pipelined) ahead of their step
            q_raw = T.alloc_shared((C, R, N), dtype)       # whole rows: the rotary partner of a column
            ang_raw = T.alloc_shared((C, nr), F32)          # may lie in another N tile
            da_raw = T.alloc_shared((C,), F32)
            do_raw = T.alloc_shared((C, bp) if reduceO else (C, R, bp), dtype)
            z_raw = T.alloc_shared((C, bp), dtype)
            # per-head constants and per-step tables
            qb_s = T.alloc_shared((R, N), F32)
            # only where read: an unread copy still takes bytes the preflight estimate would have to model
            mo_s = T.alloc_shared((R, bp), F32) if reduceO else None
            mz_s = T.alloc_shared((R, bp), F32) if hasZ else None
            cos_s = T.alloc_shared((C, nr), F32)
            sin_s = T.alloc_shared((C, nr), F32)
            ea_s = T.alloc_shared((C,), F32)
            qh_s = T.alloc_shared((F, bn), dtype)
            dy_s = T.alloc_shared((F, bp), dtype)
            ds_f = T.alloc_fragment((bn, bp), F32)
            if not local:
                ds_s = T.alloc_shared((bn, bp), dtype)
                # ds_s is written in the dS accumulator's fragment layout: row-major, rows of bp * 2 bytes
                # put the 8 rows a warp touches at once in one bank (ncu, H100: 9.3-way store conflicts).
                T.annotate_layout({ds_s: tilelang.layout.make_swizzled_layout(ds_s)})
            else:
                log_decay = T.alloc_fragment((1,), F32)
                T.clear(log_decay)
            T.copy(Q_BIAS[h, :, :], qb_s)
            if reduceO:
                T.copy(MIMO_O[h, :, p0:p0 + bp], mo_s)
            if hasZ:
                T.copy(MIMO_Z[h, :, p0:p0 + bp], mz_s)
            T.clear(ds_f)
            if K > 1 and not local:
                # carry_k = CARRY_{k+1} + decay_{k+1} (CARRY_{k+2} + decay_{k+2} (...)), innermost first
                for jj in T.serial(K - 1):
                    j = K - 1 - jj
                    if j > seg:
                        for i, p in T.Parallel(bn, bp):
                            ds_f[i, p] = ds_f[i, p] * SEG_DECAY[b, h, j] + CARRY[b, h, j, n0 + i, p0 + p]
            for it in T.Pipelined(L, num_stages=stages):
                c = (seg + 1) * L - 1 - it if K > 1 else nc - 1 - it    # static when whole: no bounds guards
                T.copy(Q[b, c * C:(c + 1) * C, :, hq, :], q_raw)
                T.copy(ANGLES[b, c * C:(c + 1) * C, h, :], ang_raw)
                T.copy(DA_CS[b, h, c * C:(c + 1) * C], da_raw)
                if reduceO:
                    T.copy(DOUT[b, c * C:(c + 1) * C, h, p0:p0 + bp], do_raw)
                else:
                    T.copy(DOUT[b, c * C:(c + 1) * C, :, h, p0:p0 + bp], do_raw)
                if hasZ:
                    T.copy(Z[b, c * C:(c + 1) * C, h, p0:p0 + bp], z_raw)
                if not local:
                    # dS_c out: the chunk kernel's GEMM operand, and its DDA factor (sum(S_c * dS_c), there)
                    T.copy(ds_f, ds_s)
                    T.copy(ds_s, DSTATES[b, h, c, n0:n0 + bn, p0:p0 + bp])
                else:
                    for i in T.Parallel(1):
                        log_decay[i] = log_decay[i] + da_raw[C - 1]
                for t, j in T.Parallel(C, nr):
                    cos_s[t, j] = T.cos(ang_raw[t, j])
                    sin_s[t, j] = T.sin(ang_raw[t, j])
                for t in T.Parallel(C):
                    ea_s[t] = T.exp(da_raw[t])
                for f, j in T.Parallel(F, bn):
                    t = f // R
                    r = f % R
                    n = n0 + j
                    m = n % half
                    # Modulo, not a select of n +- N/2: TileLang 0.1.15 puts a barrier in every step of a
                    # gather indexed by a select (tests/test_tilelang_mamba.py, rotary gathers).
                    partner = (n + half) % N
                    x = T.cast(q_raw[t, r, n], F32) + qb_s[r, n]
                    y = T.cast(q_raw[t, r, partner], F32) + qb_s[r, partner]
                    sgn = T.if_then_else(n < half, -1.0, 1.0)
                    mm = T.min(m, nr - 1)
                    qh_s[f, j] = T.if_then_else(m < nr, x * cos_s[t, mm] + sgn * y * sin_s[t, mm], x)
                for f, j in T.Parallel(F, bp):
                    t = f // R
                    r = f % R
                    if reduceO:
                        d = T.cast(do_raw[t, j], F32) * mo_s[r, j]
                    else:
                        d = T.cast(do_raw[t, r, j], F32)
                    if hasZ:
                        d = d * _silu(T.cast(z_raw[t, j], F32) * mz_s[r, j], config["fast_math"])
                    dy_s[f, j] = d * ea_s[t]
                for i, j in T.Parallel(bn, bp):
                    ds_f[i, j] = ds_f[i, j] * ea_s[C - 1]
                T.gemm(qh_s, dy_s, ds_f, transpose_A=True)
            if local:
                T.copy(ds_f, CARRY[b, h, seg, n0:n0 + bn, p0:p0 + bp])
                for i in T.Parallel(1):
                    SEG_DECAY[b, h, seg] = T.exp(log_decay[i])    # the same value from every tile

    return scan


# T.gemm annotation: no wgmma wait after this product (sm_90), so that the next T.gemm (which waits for
# all) runs it and the next one as one batch: the two N/2 halves of a product, or independent products
# with nothing between them. Products lowered to mma.sync (sm_120 / sm_121) ignore it.
_NO_WAIT = {"wg_wait": -1}


def _fragment_written(dtype: str, *bufs):
    """The 16-bit ones among shared tiles written from GEMM accumulator fragments: swizzled with the GEMM
    operands, since row-major rows of 128+ bytes put the 8 rows a warp stores at once in one bank (ncu,
    H100, training shape: 4.6-way conflicts on the chunk kernel's shared stores)."""
    return [buf for buf in bufs if buf is not None and buf.dtype == dtype]


def _segments(config: dict, shape: dict) -> int:
    """Segments of the scan (see ``_scan_program``): the largest divisor of the chunk count that is at
    most ``scan_segments`` (a chunk count it does not divide, as at the small parity shapes, takes fewer)."""
    nc = shape["S"] // shape["C"]
    return max(k for k in range(1, config["scan_segments"] + 1) if nc % k == 0)


def _chunk_macros(shape: dict, fast: bool):
    """Macros of the chunk kernel (inlined where called)."""
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    half = N // 2

    @T.macro
    def step_tables(b, h, c, t0, DA_CS, DA_CS_REV, DT, TRAP, SEGSUM, ANGLES, QK_DOT, ea_s, er_s, gam_s, fac_s,
                    seg_s, cos_s, sin_s, qkd_s):
        """Per-step scalars (exp(DA_CS), exp(DA_CS_REV), gamma, factor), exp(SEGSUM) masked to s < t,
        cos / sin of the chunk's angles and QK_DOT, all fp32 in shared memory (seg_s and cos_s / sin_s
        None: those are read from global memory where used, see _seg, _cos and _sin)."""
        for t in T.Parallel(C):
            ea_s[t] = T.exp(DA_CS[b, h, t0 + t])
            er_s[t] = T.exp(DA_CS_REV[b, h, t0 + t])
            g = DT[b, h, t0 + t] * T.sigmoid(T.cast(TRAP[b, h, t0 + t], F32))
            nxt = T.min(t0 + t + 1, S - 1)
            sh = T.if_then_else(t0 + t + 1 < S, DT[b, h, nxt] * T.sigmoid(-T.cast(TRAP[b, h, nxt], F32)), 0.0)
            gam_s[t] = g
            fac_s[t] = g + sh
        if seg_s is not None:
            for t, s in T.Parallel(C, C):
                seg_s[t, s] = T.if_then_else(s < t, T.exp(SEGSUM[b, h, c, t, s]), 0.0)
        if cos_s is not None:
            for t, j in T.Parallel(C, nr):
                cos_s[t, j] = T.cos(ANGLES[b, t0 + t, h, j])
                sin_s[t, j] = T.sin(ANGLES[b, t0 + t, h, j])
        for f, i in T.Parallel(F, R):
            qkd_s[i, f] = T.cast(QK_DOT[b, h, t0 + f // R, f % R, i], F32)

    @T.macro
    def value_tiles(b, h, t0, V, MIMO_V, DOUT, Z, MIMO_O, MIMO_Z, psiv_s, dy_s):
        """PsiV = V_t * Psi_r and dy = dL/dy (Phi, SiLU gate) as F x P GEMM operands."""
        for f, p in T.Parallel(F, P):
            psiv_s[f, p] = T.cast(V[b, t0 + f // R, h, p], F32) * MIMO_V[h, f % R, p]
            dy_s[f, p] = _dy_value(DOUT, Z, MIMO_O, MIMO_Z, b, t0 + f // R, f % R, h, p, shape, fast)

    @T.macro
    def dv_dmv(b, h, c, t0, V, MIMO_V, DV, DMV_PART, dpsiv_s):
        """DV = sum_r dPsiV * Psi_r and this chunk's DMIMO_V partial sum_t dPsiV * V_t, each summed in one
        expression per output element (no fragment: the loops vectorize along P)."""
        for t, p in T.Parallel(C, P):
            DV[b, t0 + t, h, p] = T.cast(_step_sum([T.cast(dpsiv_s[t * R + r, p], F32) * MIMO_V[h, r, p]
                                                    for r in range(R)]), V.dtype)
        for r, p in T.Parallel(R, P):
            DMV_PART[b, h, c, r, p] = _step_sum([T.cast(dpsiv_s[t * R + r, p], F32) * T.cast(V[b, t0 + t, h, p], F32)
                                                 for t in range(C)])

    @T.macro
    def dkq_terms(b, h, c, t0, DSSDA, DD_PART, DGAMMA_DIAG, acc_ff, lkq_f, prod_s, w_s, pv_s, wd_s, seg_s,
                  SEGSUM, gam_s, qkd_s, cc_f):
        """From dkq = PsiV dy^T in acc_ff (row s, column t) and k_hat.q_hat (recomputed in lkq_f):
        DSSDA, the masked dkq (w_s), the same-step products pv and their block-diagonal operand wd_s,
        the DD partial and DGAMMA_DIAG."""
        # two loops: a statement under a condition on the element keeps its whole loop from vectorizing
        for i, j in T.Parallel(F, F):
            prod_s[i, j] = lkq_f[i, j] * acc_ff[i, j]
            w_s[i, j] = acc_ff[i, j] * _seg(seg_s, SEGSUM, b, h, c, j // R, i // R)
        for i, j in T.Parallel(F, F):
            # same-step block: its block-diagonal operand wd[i, j] = gamma_t pv[j, i % R] = gamma_t dkq[i, j]
            # (a 0 / 1 factor, not a select: a select on the element keeps the store from vectorizing)
            wd_s[i, j] = T.cast(i // R == j // R, F32) * gam_s[i // R] * acc_ff[i, j]
        for i, j in T.Parallel(F, F):
            # pv[t, o, i'] = dy_{t,o} . PsiV_{t,i'} = dkq[t*R + i', t*R + o], from the register rather than
            # from wd_s read back
            if i // R == j // R:
                pv_s[j, i % R] = acc_ff[i, j]
        T.clear(cc_f)
        for s, t in T.Parallel(C, C):
            for ri in T.serial(R):
                for ro in T.serial(R):
                    cc_f[s, t] = cc_f[s, t] + T.cast(prod_s[s * R + ri, t * R + ro], F32)
        T.copy(cc_f, DSSDA[b, h, c, :, :])
        if shape["hasD"]:
            # DD partial: sum over the chunk of PsiV . dy, the diagonal of dkq (pv[f, f % R])
            for i in T.Parallel(1):
                DD_PART[b, h, c + i] = _step_sum([pv_s[f, f % R] for f in range(F)])
        for t in T.Parallel(C):
            DGAMMA_DIAG[b, h, t0 + t] = _step_sum([qkd_s[i, t * R + o] * pv_s[t * R + o, i]
                                                   for o in range(R) for i in range(R)])

    @T.macro
    def per_step_row_sum(prod_fn, row_f, rows_s, OUT, b, h, t0):
        """OUT[b, h, t0 + t] = sum over the R fused rows of step t and the columns of prod_fn ([F, X] fragment)."""
        T.reduce_sum(prod_fn, row_f, dim=1)
        T.copy(row_f, rows_s)
        for t in T.Parallel(C):
            OUT[b, h, t0 + t] = _step_sum([rows_s[t * R + r] for r in range(R)])

    @T.macro
    def angles_out(b, t0, h, DANGLES, ang_s, ang_f):
        """DANGLES = the angle gradients of the R ranks of each step, summed."""
        T.clear(ang_f)
        for t, j in T.Parallel(C, nr):
            for r in T.serial(R):
                ang_f[t, j] = ang_f[t, j] + ang_s[t * R + r, j]
        T.copy(ang_f, DANGLES[b, t0:t0 + C, h, :])

    return dict(step_tables=step_tables, value_tiles=value_tiles, dv_dmv=dv_dmv, dkq_terms=dkq_terms,
                per_step_row_sum=per_step_row_sum, angles_out=angles_out)


# Rotary pairs interleaved in blocks of this many columns (``paired_tiles``): the column step between a pair's
# members that every GEMM accumulator layout (wgmma; mma.sync m16n8) keeps in one thread.
_PAIR_BLOCK = 8


def _chunk_signature(shape: dict):
    """The chunk kernel's tensors."""
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    dtype = shape["dtype"]
    dout_shape = (B, S, H, P) if shape["reduceO"] else (B, S, R, H, P)
    return dict(
        Q=T.Tensor((B, S, R, G, N), dtype), K=T.Tensor((B, S, R, G, N), dtype), V=T.Tensor((B, S, H, P), dtype),
        Q_BIAS=T.Tensor((H, R, N), F32), K_BIAS=T.Tensor((H, R, N), F32), MIMO_V=T.Tensor((H, R, P), F32),
        MIMO_O=T.Tensor((H, R, P), F32), MIMO_Z=T.Tensor((H, R, P), F32), Z=T.Tensor((B, S, H, P), dtype),
        D=T.Tensor((H,), F32), ANGLES=T.Tensor((B, S, H, nr), F32), DA_CS=T.Tensor((B, H, S), F32),
        DA_CS_REV=T.Tensor((B, H, S), F32), DT=T.Tensor((B, H, S), F32), TRAP=T.Tensor((B, H, S), dtype),
        STATES=T.Tensor((B, H, nc, N, P), "bfloat16"), QK_DOT=T.Tensor((B, H, S, R, R), dtype),
        SEGSUM=T.Tensor((B, H, nc, C, C), F32), DOUT=T.Tensor(dout_shape, dtype),
        DSTATES=T.Tensor((B, H, nc, N, P), dtype), DQ=T.Tensor((B, S * R, H, N), dtype),
        DK=T.Tensor((B, S * R, H, N), dtype), DV=T.Tensor((B, S, H, P), dtype), DANGLES=T.Tensor((B, S, H, nr), F32),
        DFACTOR=T.Tensor((B, H, S), F32), DGAMMA_DIAG=T.Tensor((B, H, S), F32), DDA=T.Tensor((B, H, S), F32),
        DDA_CS=T.Tensor((B, H, S), F32),
        DDA_CS_REV=T.Tensor((B, H, S), F32), DSSDA=T.Tensor((B, H, nc, C, C), F32),
        DMV_PART=T.Tensor((B, H, nc, R, P), F32), DD_PART=T.Tensor((B, H, nc), F32))


def _chunk_program(config: dict, shape: dict):
    """Chunk kernel: only q_hat = rot(q) and k_rot = rot(k) live in shared memory, with dS and S_c the
    GEMM operands, and the columns of each are split into rotary pairs (n, N/2 + n), so that every GEMM
    result on them holds both members of a pair in the same thread: the rotary gradients and the inverse
    rotation are elementwise in registers. Two ways to hold the pairs (``paired_tiles``):
      false: two F x N/2 tiles (dS, S: N/2 x P) with the columns [0, N/2) and [N/2, N); every product on
             them is two GEMMs into two fragments of one layout.
      true:  one F x N tile (dS, S: N x P rows) in interleaved order, blocks of 8 of the first half then
             8 of the second (stored column 16k + y is column 8k + y, 16k + 8 + y is N/2 + 8k + y): a
             GEMM's accumulator gives a thread columns y and y + 8 of each 16-column block it holds, so
             a pair is in one thread, and each product is one GEMM of twice the width (its A operand
             read from shared memory half as often).

    Identities that keep the unrotated tiles out (all rows of one step share an angle and a factor):
    k_hat = factor * k_rot enters as a row scale of the products; the same-step terms go through the
    rotated tiles, dk = rot^T(factor dk_hat + wd q_hat), dq = rot^T(dq_hat + wd^T k_rot); DFACTOR is
    the row sum of dk_hat * k_rot; the angle gradient of a pair is g_hi x0 - g_lo x1 with (x0, x1)
    the ROTATED pair (times factor on the k side)."""
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    dtype = shape["dtype"]
    threads = config["threads"]
    half = N // 2
    hasD = shape["hasD"]
    paired = config["paired_tiles"]
    blk = _PAIR_BLOCK
    nb = half // blk
    W = N if paired else half           # width of one column tile
    m = _chunk_macros(shape, config["fast_math"])
    sig = _chunk_signature(shape)

    def lo_col(k, y):
        """Stored column of pair j = blk k + y's first member (column j) in its tile."""
        return 2 * blk * k + y if paired else blk * k + y

    def hi_col(k, y):
        """Stored column of the pair's second member (column N/2 + j)."""
        return 2 * blk * k + blk + y if paired else blk * k + y

    def tile_dot(lo_f, hi_f, lo_s, hi_s, f, x):
        """(lo, hi) * (lo_s, hi_s) at stored column x, summed over the tiles."""
        e = lo_f[f, x] * T.cast(lo_s[f, x], F32)
        return e if paired else e + hi_f[f, x] * T.cast(hi_s[f, x], F32)

    @T.macro
    def rotated_tile(b, t0, h, hq, X, X_BIAS, cos_s, sin_s, ANGLES, lo_s, hi_s):
        """rot(X + bias) into the tiles (lo_s is hi_s when paired)."""
        for f, k, y in T.Parallel(F, nb, blk):
            j = k * blk + y
            x0 = T.cast(X[b, t0 + f // R, f % R, hq, j], F32) + X_BIAS[h, f % R, j]
            x1 = T.cast(X[b, t0 + f // R, f % R, hq, half + j], F32) + X_BIAS[h, f % R, half + j]
            cs = _cos(cos_s, ANGLES, b, t0, h, f // R, j % nr)
            sn = _sin(sin_s, ANGLES, b, t0, h, f // R, j % nr)
            lo_s[f, lo_col(k, y)] = T.if_then_else(j < nr, x0 * cs - x1 * sn, x0)
            hi_s[f, hi_col(k, y)] = T.if_then_else(j < nr, x0 * sn + x1 * cs, x1)

    @T.macro
    def state_rows(X, b, h, c, lo_s, hi_s):
        """The N x P tile X[b, h, c] into the row tiles (paired: one tile, rows in the interleaved order)."""
        if paired:
            for x, p in T.Parallel(N, P):
                lo_s[x, p] = X[b, h, c, (x // (2 * blk)) * blk + x % blk + ((x // blk) % 2) * half, p]
        else:
            T.copy(X[b, h, c, 0:half, :], lo_s)
            T.copy(X[b, h, c, half:N, :], hi_s)

    @T.macro
    def state_decay_grad(b, h, c, t0, DSTATES, DA_CS, DDA, st_lo, st_hi, dda_f, dda_row, dda_one, dda_s):
        """DDA on the chunk's steps: exp(DA_CS at its last step) * sum(S_c * dS_c), S_c from the row tiles
        (as state_rows laid them out) and dS_c read again (bf16: the DDA tolerance covers its rounding,
        lab/problems/mamba_bwd_bwd.py), so that the scan reads no STATES."""
        if paired:
            for x, p in T.Parallel(W, P):
                src = (x // (2 * blk)) * blk + x % blk + ((x // blk) % 2) * half
                dda_f[x, p] = T.cast(st_lo[x, p], F32) * T.cast(DSTATES[b, h, c, src, p], F32)
        else:
            for x, p in T.Parallel(W, P):
                dda_f[x, p] = T.cast(st_lo[x, p], F32) * T.cast(DSTATES[b, h, c, x, p], F32) + \
                    T.cast(st_hi[x, p], F32) * T.cast(DSTATES[b, h, c, half + x, p], F32)
        T.reduce_sum(dda_f, dda_row, dim=1)
        T.reduce_sum(dda_row, dda_one, dim=0)
        T.copy(dda_one, dda_s)
        for t in T.Parallel(C):
            DDA[b, h, t0 + t] = dda_s[0] * T.exp(DA_CS[b, h, t0 + C - 1])

    @T.macro
    def gemm_tiles(A, B_lo, B_hi, O_lo, O_hi, transpose_A, transpose_B, clear):
        """O = A B (+ O) on each column tile; B_lo / B_hi and O_lo / O_hi are the two tiles, or (paired)
        B_lo and O_lo the one tile, split over the warps by rows first so that every 16-column block of
        the result lies in one warpgroup (warp on sm_120)."""
        if paired:
            T.gemm(A, B_lo, O_lo, transpose_A=transpose_A, transpose_B=transpose_B, clear_accum=clear,
                   policy=T.GemmWarpPolicy.FullRow)
        else:
            T.gemm(A, B_lo, O_lo, transpose_A=transpose_A, transpose_B=transpose_B, clear_accum=clear,
                   annotations=_NO_WAIT)
            T.gemm(A, B_hi, O_hi, transpose_A=transpose_A, transpose_B=transpose_B, clear_accum=clear)

    @T.macro
    def pair_view(lo_f, hi_f):
        """Paired: hi_f = a register copy of the one tile lo_f (TileLang 0.1.15 accepts only one index
        expression per fragment in a loop; the copy gives the pair's second member its own name, and
        nvcc folds it away)."""
        if paired:
            T.copy(lo_f, hi_f)

    @T.macro
    def pair_row_sum(lo_f, hi_f, lo_s, hi_s, scale_s, tmp_f, row_f, rows_s, OUT, b, t0, h):
        """OUT[b, h, t0 + t] = sum over the step's rows and all N columns of (lo, hi) * (lo_s, hi_s), times
        scale_s[t] when a scale is given."""
        for f, x in T.Parallel(F, W):
            if scale_s is None:
                tmp_f[f, x] = tile_dot(lo_f, hi_f, lo_s, hi_s, f, x)
            else:
                tmp_f[f, x] = tile_dot(lo_f, hi_f, lo_s, hi_s, f, x) * scale_s[f // R]
        m["per_step_row_sum"](tmp_f, row_f, rows_s, OUT, b, h, t0)

    @T.macro
    def scale_rows(lo_f, hi_f, scale_s):
        for f, x in T.Parallel(F, W):
            lo_f[f, x] = lo_f[f, x] * scale_s[f // R]
            if not paired:
                hi_f[f, x] = hi_f[f, x] * scale_s[f // R]

    @T.macro
    def angle_terms(lo_f, hi_f, lo_s, hi_s, scale_s, ang_s, accumulate):
        """ang_s[f, j] (+)= scale (g_hi x_lo - g_lo x_hi) for the rotated pairs j < nr, g the gradient pair
        in (lo_f, hi_f), x the rotated operand pair in (lo_s, hi_s)."""
        pair_view(lo_f, hi_f)
        for f, k, y in T.Parallel(F, nb, blk):
            if k * blk + y < nr:
                g = hi_f[f, hi_col(k, y)] * T.cast(lo_s[f, lo_col(k, y)], F32) - \
                    lo_f[f, lo_col(k, y)] * T.cast(hi_s[f, hi_col(k, y)], F32)
                if accumulate:
                    ang_s[f, k * blk + y] = ang_s[f, k * blk + y] + g
                else:
                    ang_s[f, k * blk + y] = scale_s[f // R] * g

    @T.macro
    def rotate_back_out(lo_f, hi_f, cos_s, sin_s, ANGLES, OUT, out_s, b, t0, row0, h):
        """OUT[row0 + f, h, :] = rot^T of the pair (lo, hi) of the chunk's steps t0.., in the output dtype:
        stored from the fragments, or (out_s given) staged in shared memory and copied out in whole rows
        (from the fragments a warp's store covers 16 of each row's 128 bytes; ncu, H100: 19 of 32 bytes
        per sector used)."""
        pair_view(lo_f, hi_f)
        for f, k, y in T.Parallel(F, nb, blk):
            j = k * blk + y
            g0 = lo_f[f, lo_col(k, y)]
            g1 = hi_f[f, hi_col(k, y)]
            cs = _cos(cos_s, ANGLES, b, t0, h, f // R, j % nr)
            sn = _sin(sin_s, ANGLES, b, t0, h, f // R, j % nr)
            lo = T.if_then_else(j < nr, g0 * cs + g1 * sn, g0)
            hi = T.if_then_else(j < nr, g1 * cs - g0 * sn, g1)
            if out_s is None:
                OUT[b, row0 + f, h, j] = lo
                OUT[b, row0 + f, h, half + j] = hi
            else:
                out_s[f, j] = lo
                out_s[f, half + j] = hi
        if out_s is not None:
            T.copy(out_s, OUT[b, row0:row0 + F, h, :])

    @T.prim_func
    def chunk(Q: sig["Q"], K: sig["K"], V: sig["V"], Q_BIAS: sig["Q_BIAS"], K_BIAS: sig["K_BIAS"],
              MIMO_V: sig["MIMO_V"], MIMO_O: sig["MIMO_O"], MIMO_Z: sig["MIMO_Z"], Z: sig["Z"], D: sig["D"],
              ANGLES: sig["ANGLES"], DA_CS: sig["DA_CS"], DA_CS_REV: sig["DA_CS_REV"], DT: sig["DT"],
              TRAP: sig["TRAP"], STATES: sig["STATES"], QK_DOT: sig["QK_DOT"], SEGSUM: sig["SEGSUM"],
              DOUT: sig["DOUT"], DSTATES: sig["DSTATES"], DQ: sig["DQ"], DK: sig["DK"], DV: sig["DV"],
              DANGLES: sig["DANGLES"], DFACTOR: sig["DFACTOR"], DGAMMA_DIAG: sig["DGAMMA_DIAG"], DDA: sig["DDA"],
              DDA_CS: sig["DDA_CS"], DDA_CS_REV: sig["DDA_CS_REV"], DSSDA: sig["DSSDA"],
              DMV_PART: sig["DMV_PART"], DD_PART: sig["DD_PART"]):
        with T.Kernel(nc, H, B, threads=threads) as (c, h, b):
            T.annotate_min_blocks_per_sm(2)
            hq = h // (H // G)
            t0 = c * C
            qh_lo = T.alloc_shared((F, W), dtype)
            qh_hi = qh_lo if paired else T.alloc_shared((F, half), dtype)
            kr_lo = T.alloc_shared((F, W), dtype)
            kr_hi = kr_lo if paired else T.alloc_shared((F, half), dtype)
            psiv_s = T.alloc_shared((F, P), dtype)
            dy_s = T.alloc_shared((F, P), dtype)
            ds_lo = T.alloc_shared((W, P), dtype)
            ds_hi = ds_lo if paired else T.alloc_shared((half, P), dtype)
            st_lo = T.alloc_shared((W, P), dtype)
            st_hi = st_lo if paired else T.alloc_shared((half, P), dtype)
            w_s = T.alloc_shared((F, F), dtype)         # masked dkq (dk side), first the dPsiV operand
            wq_s = T.alloc_shared((F, F), dtype)        # masked dkq scaled by factor_s (dq side)
            wd_s = T.alloc_shared((F, F), dtype)        # block diagonal: the same-step R x R terms
            prod_s = T.alloc_shared((F, F), dtype)     # k_hat.q_hat * dkq, summed into DSSDA
            pv_s = T.alloc_shared((F, R), F32)
            dpsiv_s = T.alloc_shared((F, P), dtype)
            rows_s = T.alloc_shared((F,), F32)
            ea_s = T.alloc_shared((C,), F32)
            er_s = T.alloc_shared((C,), F32)
            gam_s = T.alloc_shared((C,), F32)
            fac_s = T.alloc_shared((C,), F32)
            erf_s = T.alloc_shared((C,), F32)
            dda_s = T.alloc_shared((1,), F32)
            seg_s = None if config["global_tables"] else T.alloc_shared((C, C), F32)
            cos_s = None if config["global_tables"] else T.alloc_shared((C, nr), F32)
            sin_s = None if config["global_tables"] else T.alloc_shared((C, nr), F32)
            qkd_s = T.alloc_shared((R, F), F32)      # QK_DOT transposed: read along F where the F x F tiles are built
            ang_s = T.alloc_shared((F, nr), F32)
            out_s = T.alloc_shared((F, N), dtype) if config["stage_out"] else None
            T.annotate_layout({buf: tilelang.layout.make_swizzled_layout(buf)
                               for buf in (qh_lo, qh_hi, kr_lo, kr_hi, psiv_s, dy_s, ds_lo, ds_hi, st_lo, st_hi,
                                           w_s, wq_s, wd_s, *_fragment_written(dtype, prod_s, dpsiv_s, out_s))})

            acc_fp = T.alloc_fragment((F, P), F32)
            acc_ff = T.alloc_fragment((F, F), F32)
            lkq_f = T.alloc_fragment((F, F), F32)
            lo_f = T.alloc_fragment((F, W), F32)
            hi_f = T.alloc_fragment((F, W), F32)       # paired: the copy pair_view makes
            tmp_f = T.alloc_fragment((F, W), F32)
            row_f = T.alloc_fragment((F,), F32)
            cc_f = T.alloc_fragment((C, C), F32)
            ang_f = T.alloc_fragment((C, nr), F32)
            dda_f = T.alloc_fragment((W, P), F32)
            dda_row = T.alloc_fragment((W,), F32)
            dda_one = T.alloc_fragment((1,), F32)

            m["step_tables"](b, h, c, t0, DA_CS, DA_CS_REV, DT, TRAP, SEGSUM, ANGLES, QK_DOT, ea_s, er_s, gam_s,
                             fac_s, seg_s, cos_s, sin_s, qkd_s)
            for t in T.Parallel(C):
                erf_s[t] = er_s[t] * fac_s[t]
            rotated_tile(b, t0, h, hq, Q, Q_BIAS, cos_s, sin_s, ANGLES, qh_lo, qh_hi)
            rotated_tile(b, t0, h, hq, K, K_BIAS, cos_s, sin_s, ANGLES, kr_lo, kr_hi)
            m["value_tiles"](b, h, t0, V, MIMO_V, DOUT, Z, MIMO_O, MIMO_Z, psiv_s, dy_s)
            state_rows(DSTATES, b, h, c, ds_lo, ds_hi)

            # ---- dPsiV = exp(DA_CS_REV) factor k_rot dS + (masked k_hat q_hat^T) dy + D dy + diagonal
            # (products over N: a sum over the tiles, the same in either column order)
            if paired:
                T.gemm(kr_lo, ds_lo, acc_fp, clear_accum=True, annotations=_NO_WAIT)
                T.gemm(kr_lo, qh_lo, acc_ff, transpose_B=True, clear_accum=True)
            else:
                T.gemm(kr_lo, ds_lo, acc_fp, clear_accum=True, annotations=_NO_WAIT)
                T.gemm(kr_hi, ds_hi, acc_fp, annotations=_NO_WAIT)
                T.gemm(kr_lo, qh_lo, acc_ff, transpose_B=True, clear_accum=True, annotations=_NO_WAIT)
                T.gemm(kr_hi, qh_hi, acc_ff, transpose_B=True)
            for f, p in T.Parallel(F, P):
                acc_fp[f, p] = acc_fp[f, p] * erf_s[f // R]
            for i, j in T.Parallel(F, F):
                acc_ff[i, j] = acc_ff[i, j] * fac_s[i // R]                 # lkq[s, t] = k_hat_s . q_hat_t
            for i, j in T.Parallel(F, F):
                # _seg is 0 on the same-step block (s < t only), which takes gamma QK_DOT instead
                w_s[i, j] = acc_ff[i, j] * _seg(seg_s, SEGSUM, b, h, c, j // R, i // R) + \
                    T.cast(i // R == j // R, F32) * gam_s[i // R] * qkd_s[i % R, j]
            T.gemm(w_s, dy_s, acc_fp)
            if hasD:
                for f, p in T.Parallel(F, P):
                    acc_fp[f, p] = acc_fp[f, p] + D[h] * T.cast(dy_s[f, p], F32)
            T.copy(acc_fp, dpsiv_s)
            m["dv_dmv"](b, h, c, t0, V, MIMO_V, DV, DMV_PART, dpsiv_s)

            # ---- dkq = PsiV dy^T (row s, column t): DSSDA, masked copies, same-step terms
            T.gemm(psiv_s, dy_s, acc_ff, transpose_B=True, clear_accum=True, annotations=_NO_WAIT)
            # lkq again (recomputed: keeping it across the dPsiV steps costs an F x F tile of shared memory)
            if paired:
                T.gemm(kr_lo, qh_lo, lkq_f, transpose_B=True, clear_accum=True)
            else:
                T.gemm(kr_lo, qh_lo, lkq_f, transpose_B=True, clear_accum=True, annotations=_NO_WAIT)
                T.gemm(kr_hi, qh_hi, lkq_f, transpose_B=True)
            for i, j in T.Parallel(F, F):
                lkq_f[i, j] = lkq_f[i, j] * fac_s[i // R]
            m["dkq_terms"](b, h, c, t0, DSSDA, DD_PART, DGAMMA_DIAG, acc_ff, lkq_f, prod_s, w_s, pv_s, wd_s,
                           seg_s, SEGSUM, gam_s, qkd_s, cc_f)

            # ---- dk_hat = exp(DA_CS_REV) PsiV dS^T + masked dkq q_hat; DDA_CS_REV, DFACTOR, DK
            gemm_tiles(psiv_s, ds_lo, ds_hi, lo_f, hi_f, False, True, True)
            # wq_s after the last read of the dS tiles, so that it can take their bytes (8 KiB at F = 64).
            for i, j in T.Parallel(F, F):
                wq_s[i, j] = acc_ff[i, j] * _seg(seg_s, SEGSUM, b, h, c, j // R, i // R) * fac_s[i // R]
            pair_row_sum(lo_f, hi_f, kr_lo, kr_hi, fac_s, tmp_f, row_f, rows_s, DDA_CS_REV, b, t0, h)
            scale_rows(lo_f, hi_f, er_s)
            gemm_tiles(w_s, qh_lo, qh_hi, lo_f, hi_f, False, False, False)
            pair_row_sum(lo_f, hi_f, kr_lo, kr_hi, None, tmp_f, row_f, rows_s, DFACTOR, b, t0, h)
            angle_terms(lo_f, hi_f, kr_lo, kr_hi, fac_s, ang_s, False)
            scale_rows(lo_f, hi_f, fac_s)
            gemm_tiles(wd_s, qh_lo, qh_hi, lo_f, hi_f, False, False, False)       # same-step terms
            rotate_back_out(lo_f, hi_f, cos_s, sin_s, ANGLES, DK, out_s, b, t0, c * F, h)

            # ---- dq_hat = exp(DA_CS) dy S_c^T + masked dkq^T k_hat; DDA_CS, DQ, DANGLES
            state_rows(STATES, b, h, c, st_lo, st_hi)
            state_decay_grad(b, h, c, t0, DSTATES, DA_CS, DDA, st_lo, st_hi, dda_f, dda_row, dda_one, dda_s)
            gemm_tiles(dy_s, st_lo, st_hi, lo_f, hi_f, False, True, True)
            pair_row_sum(lo_f, hi_f, qh_lo, qh_hi, None, tmp_f, row_f, rows_s, DDA_CS, b, t0, h)
            scale_rows(lo_f, hi_f, ea_s)
            gemm_tiles(wq_s, kr_lo, kr_hi, lo_f, hi_f, True, False, False)
            angle_terms(lo_f, hi_f, qh_lo, qh_hi, None, ang_s, True)
            m["angles_out"](b, t0, h, DANGLES, ang_s, ang_f)
            gemm_tiles(wd_s, kr_lo, kr_hi, lo_f, hi_f, True, False, False)        # same-step terms
            rotate_back_out(lo_f, hi_f, cos_s, sin_s, ANGLES, DQ, out_s, b, t0, c * F, h)

    return chunk


def _reduce_program(config: dict, shape: dict):
    """Grid (H, B): DMIMO_V and DD summed over the chunks; every output element has its own thread (no
    serial walk over the chunks across elements), deterministic (no atomics)."""
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    hasD = shape["hasD"]

    @T.prim_func
    def reduce(DMV_PART: T.Tensor((B, H, nc, R, P), F32), DD_PART: T.Tensor((B, H, nc), F32),
               DMIMO_V: T.Tensor((B, H, R, P), F32), DD: T.Tensor((B, H), F32)):
        with T.Kernel(H, B, threads=256) as (h, b):
            acc = T.alloc_fragment((R, P), F32)
            T.clear(acc)
            for r, p in T.Parallel(R, P):
                for c in T.unroll(nc):
                    acc[r, p] = acc[r, p] + DMV_PART[b, h, c, r, p]
            T.copy(acc, DMIMO_V[b, h, :, :])
            if hasD:
                tot = T.alloc_fragment((1,), F32)
                T.clear(tot)
                for i in T.Parallel(1):
                    for c in T.unroll(nc):
                        tot[i] = tot[i] + DD_PART[b, h, c]
                T.copy(tot, DD[b, h:h + 1])

    return reduce


def _scan_tiles(config: dict, shape: dict) -> int:
    return (shape["N"] // config["scan_block_N"]) * (shape["P"] // config["scan_block_P"])


_PROGRAMS = {"scan_local": functools.partial(_scan_program, local=True), "scan": _scan_program,
             "chunk": _chunk_program, "reduce": _reduce_program}


def _kernels(config: dict, shape: dict) -> list:
    """The kernels a config launches, in launch order (the local scan only with segments)."""
    return [k for k in _PROGRAMS if k != "scan_local" or _segments(config, shape) > 1]


# --------------------------------------------------------------------------------------------
# compile


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile of the three kernels for ``target`` (no GPU). smem_bytes and registers
    are the largest over the kernels (the chunk kernel's in practice); per-kernel figures ride along.
    A kernel whose shared-memory layout overlaps buffers one statement reads and writes is refused
    (RuntimeError: the preflight records it with the reason)."""
    config = {**DEFAULTS, **config}
    _refuse(config, shape, target)
    t0 = time.perf_counter()
    per = {}
    for name in _kernels(config, shape):
        program = _PROGRAMS[name](config, shape)
        art = tl.lower(program, target, _pass_configs(config, name))
        _check_layout(name, program, art.kernel_source)
        cubin = tl.cubin_of(art.kernel_source, target, _pass_configs(config, name), use_cache=False)
        usage = tl.resource_usage(cubin, target)
        per[name] = {"smem_bytes": tl.dynamic_smem(art) + usage["static_smem"], "registers": usage["registers"]}
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] for v in per.values()),
            "compile_s": time.perf_counter() - t0, "binary": "cubin", "kernels": per}


def _refuse(config: dict, shape: dict, target: str) -> None:
    why = config_reason(config, shape) or eligibility(target) or target_reason(config, target) or \
        shape_target_reason(config, shape, target)
    if why:
        raise RuntimeError(why)


def _check_layout(name: str, program, source: str) -> None:
    hazards = smem_plan.alias_hazards(program, source)
    if hazards:
        pairs = ", ".join(f"{w} over {r}" for w, r in hazards)
        raise RuntimeError(f"{name} kernel: TileLang's shared-memory planner placed buffers a statement writes on "
                           f"bytes that statement still reads ({pairs}); this layout computes garbage")


# --------------------------------------------------------------------------------------------
# launch


def build(config: dict, shape: dict):
    """Compile the kernels for the current GPU's explicit target and return ``run``; the dS, carry and
    partial-sum workspaces are allocated once per device on the first call."""
    config = {**DEFAULTS, **config}
    target = tl.device_target()
    _refuse(config, shape, target)
    kernels = {}
    for name in _kernels(config, shape):
        program = _PROGRAMS[name](config, shape)
        kernels[name] = tilelang.compile(program, target=tl.tvm_target(target), execution_backend="tvm_ffi",
                                         pass_configs=_pass_configs(config, name))
        _check_layout(name, program, kernels[name].get_kernel_source())
    info = _launch_info(kernels, config, shape, target)
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    segments = _segments(config, shape)
    work: dict = {}

    def run(inputs, outputs):
        dev = inputs["Q"].device
        if work.get("device") != dev:
            work.update(device=dev, ds=torch.empty(B, H, nc, N, P, dtype=inputs["Q"].dtype, device=dev),
                        dmv=torch.empty(B, H, nc, R, P, dtype=torch.float32, device=dev),
                        dd=torch.zeros(B, H, nc, dtype=torch.float32, device=dev),
                        dd_out=torch.empty(B, H, dtype=torch.float32, device=dev),
                        carry=torch.empty(B, H, segments, N, P, dtype=torch.float32, device=dev),
                        decay=torch.empty(B, H, segments, dtype=torch.float32, device=dev))
        i, o = inputs, outputs
        z, mo, mz, d = i["Z"], i["MIMO_O"], i["MIMO_Z"], i["D"]
        scan_args = (i["Q"], i["Q_BIAS"], i["ANGLES"], i["DA_CS"], i["DOUT"], z, mo, mz, work["ds"], work["carry"],
                     work["decay"])
        if segments > 1:
            kernels["scan_local"](*scan_args)
        kernels["scan"](*scan_args)
        kernels["chunk"](i["Q"], i["K"], i["V"], i["Q_BIAS"], i["K_BIAS"], i["MIMO_V"], mo, mz, z, d,
                         i["ANGLES"], i["DA_CS"], i["DA_CS_REV"], i["DT"], i["TRAP"], i["STATES"], i["QK_DOT"],
                         i["SEGSUM"], i["DOUT"], work["ds"], o["DQ"], o["DK"], o["DV"], o["DANGLES"],
                         o["DFACTOR"], o["DGAMMA_DIAG"], o["DDA"], o["DDA_CS"], o["DDA_CS_REV"], o["DSSDA"],
                         work["dmv"], work["dd"])
        kernels["reduce"](work["dmv"], work["dd"], o["DMIMO_V"], o["DD"] if shape["hasD"] else work["dd_out"])
        return info
    return run


def _launch_info(kernels: dict, config: dict, shape: dict, target: str) -> dict:
    """Largest shared memory (dynamic + static) and registers over the built kernels (best effort)."""
    try:
        smem, regs = 0, 0
        for name, k in kernels.items():
            art = k.artifact if getattr(k, "artifact", None) is not None else \
                tl.lower(_PROGRAMS[name](config, shape), target, _pass_configs(config, name))
            cubin = tl.cubin_of(k.get_kernel_source(), target, _pass_configs(config, name), use_cache=True)
            usage = tl.resource_usage(cubin, target)
            smem = max(smem, tl.dynamic_smem(art) + usage["static_smem"])
            regs = max(regs, usage["registers"])
        return {"smem_bytes": smem, "registers": regs, "spills": None}
    except Exception:
        return {"smem_bytes": None, "registers": None, "spills": None}


def versions() -> dict:
    import tvm_ffi
    return {"tilelang": tilelang.__version__, "apache-tvm-ffi": getattr(tvm_ffi, "__version__", "?"),
            "torch": torch.__version__}
