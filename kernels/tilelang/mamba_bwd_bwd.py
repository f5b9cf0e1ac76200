"""TileLang lane for mamba_bwd_bwd (the Mamba-3 MIMO backward kernel "bwd_bwd").

Design: chunk-parallel, three kernels instead of upstream's one CTA per (batch, head) walking the
chunks serially. The only serial dependency of bwd_bwd is the state gradient
dS_{c-1} = exp(DA_CS_last(c)) dS_c + q_hat_c^T (exp(DA_CS) * dy_c), an N x P linear recurrence; once
every dS_c is known, each chunk's work (about ten GEMMs and all the elementwise math) is independent.

1. ``scan``: grid (H, B, N/scan_block_N * P/scan_block_P). Each CTA walks the chunks in reverse
   for one (block_N x block_P) tile of dS, writing dS_c (bf16, the GEMM operand dtype upstream uses
   too) to a workspace [B, H, nc, N, P], and its tile's part of sum(S_c * dS_c) from the fp32 dS
   (DDA: with a bf16 dS the cancellation in that sum cost 1.5% rel. error at a 3-chunk shape). Per
   step: the chunk's raw Q rows, angles, DOUT, Z and STATES tile are copied into shared memory (cp.async,
   ``scan_stages`` steps ahead: the loads are off the serial path), then the q_hat tile (bias + rotary,
   cos/sin once per (step, pair)) and the dy tile (Phi, SiLU gate, exp(DA_CS)) are built there and fed
   to one GEMM. Tiling N and P gives B*H*tiles CTAs instead of B*H.
2. ``chunk``: grid (nc, H, B), one CTA per chunk: all outputs except the cross-chunk sums, plus
   per-chunk partials of DMIMO_V [B,H,nc,R,P] and DD [B,H,nc] (workspaces). The same-step R x R terms
   (QK_DOT into dPsiV, dqk into DK and DQ) ride in block-diagonal F x F operands of tensor-core GEMMs
   rather than R-deep loops over shared memory per element, and DD is the trace of PsiV dy^T, which
   the dkq GEMM already holds (H100, 2026-11-22, training shape: 4.05 -> 3.89 ms for this kernel; it
   runs one 256-thread CTA per SM, 12.5% occupancy, limited by both registers and shared memory,
   which is what ``lean_smem`` and ``min_blocks`` address).
3. ``reduce``: grid (H, B): DMIMO_V and DD summed over chunks, DDA over scan tiles (deterministic,
   no atomics).

Precision follows upstream: GEMM operands in the input dtype (bf16/fp16), fp32 accumulation, the
elementwise math and every partial in fp32.

Tunables:
  threads             threads of the chunk kernel (128 / 256 / 512)
  min_blocks          CTAs per SM the chunk kernel is compiled for (__launch_bounds__: 2 caps registers
                      at 65536 / (2 threads)); two are resident only if the shared memory fits too
  scan_threads        threads of the scan kernel (128 / 256 / 512)
  scan_block_N/P      dS tile of one scan CTA (divides N / P). Smaller tiles give more CTAs (what
                      B*H = 32 needs) but recompute q_hat per P tile and dy per N tile; at B*H >= the
                      SM count one tile per (batch, head) does the least work per serial step
  scan_stages         T.Pipelined stages of the scan's chunk loop (0: no software pipelining)
  lkq_fp32            keep k_hat.q_hat (F x F, needed again for DSSDA) in fp32 shared memory; False
                      stores it in the input dtype as upstream does (half the bytes: 8 KiB at
                      C*R = 64, what brings the N = P = 64 chunk kernel under GB10's 99 KiB)
  lean_smem           structural: stage dPsiV in the input dtype and recompute k_hat.q_hat for DSSDA
                      (one more F x F x N GEMM) instead of keeping it across the dPsiV steps; the
                      peak falls by F*P*2 + F*F*e bytes (24 KiB at the training shape), which lets
                      two CTAs share an H100 SM there
  swizzle             swizzled layouts for the chunk kernel's GEMM operand tiles
  tma                 False sets tl.disable_tma_lower
  warp_specialized    False sets tl.disable_warp_specialized
  fast_math           True sets tl.enable_fast_math (fast exp/sin/cos)
  aggressive_smem_merge  True sets tl.enable_aggressive_shared_memory_merge (lifetime-based reuse
                      of shared buffers: what fits the chunk kernel in GB10's 99 KiB at N = P = 64)
Chunk size C is a problem parameter (it fixes STATES and SEGSUM), not a tunable.
"""

import time

import torch
import tilelang
import tilelang.language as T

from kernels.tilelang import _common as tl

DSL = "tilelang"
KERNEL = "mamba_bwd_bwd"
TUNABLES = ("threads", "min_blocks", "scan_threads", "scan_block_N", "scan_block_P", "scan_stages", "lkq_fp32",
            "lean_smem", "swizzle", "tma", "warp_specialized", "fast_math", "aggressive_smem_merge")
DEFAULTS = {"threads": 256, "min_blocks": 1, "scan_threads": 128, "scan_block_N": 64, "scan_block_P": 32,
            "scan_stages": 2, "lkq_fp32": False, "lean_smem": False, "swizzle": True, "tma": False,
            "warp_specialized": False, "fast_math": True, "aggressive_smem_merge": True}
TARGETS = tl.TARGETS
DTYPES = ("float16", "bfloat16")
F32 = "float32"


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    c = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    if c["threads"] not in (128, 256, 512):
        return f"threads={c['threads']} must be 128, 256 or 512"
    if c["min_blocks"] not in (1, 2):
        return f"min_blocks={c['min_blocks']} must be 1 or 2"
    if c["scan_threads"] not in (128, 256, 512):
        return f"scan_threads={c['scan_threads']} must be 128, 256 or 512"
    if c["scan_stages"] not in (0, 2):
        # 3 stages gave a wrong dS at nc = 256 (H100, 2026-11-22, run 20261122T113445Z, parity caught it;
        # it passed at the 3-chunk parity shapes): the scan's pipeline is validated at 0 and 2 only.
        return f"scan_stages={c['scan_stages']} must be 0 or 2"
    for key, dim in (("scan_block_N", "N"), ("scan_block_P", "P")):
        v = c[key]
        if not isinstance(v, int) or v < 16 or shape[dim] % v:
            return f"{key}={v} must be >= 16 and divide {dim}={shape[dim]}"
    for key in ("lkq_fp32", "lean_smem", "swizzle", "tma", "warp_specialized", "fast_math", "aggressive_smem_merge"):
        if not isinstance(c[key], bool):
            return f"{key}={c[key]!r} must be true or false"
    F = shape["C"] * shape["R"]
    # T.gemm needs each warp to own at least a 16 x 16 tile of every product; the smallest
    # products are F x F and F x N / F x P (M = F rows).
    warps = c["threads"] // 32
    if F * min(F, shape["N"], shape["P"]) < warps * 256 or F % 16 or shape["N"] % 16 or shape["P"] % 16:
        return f"C*R={F}, N={shape['N']}, P={shape['P']} too small for {warps} warps (16x16 of each product per warp)"
    if c["scan_block_N"] * c["scan_block_P"] < (c["scan_threads"] // 32) * 256:
        return f"scan tile {c['scan_block_N']}x{c['scan_block_P']} too small for {c['scan_threads'] // 32} warps"
    return None


def eligibility(target: str) -> str | None:
    return tl.eligibility(KERNEL, target)


def target_reason(config: dict, target: str) -> str | None:
    c = {**DEFAULTS, **config}
    if tl.cc(target) < 90 and (c["tma"] or c["warp_specialized"]):
        return f"tma / warp_specialized are sm_90+ features; leave them false on {target}"
    return None


def _pass_configs(config: dict) -> dict:
    return tl.pass_configs(config["tma"], config["warp_specialized"], config["aggressive_smem_merge"],
                           config["fast_math"])


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA of the chunk kernel (the largest of the three), bytes.

    A liveness model of its shared buffers (``_buffers``: size and the steps where each is live;
    e = element size of the dtype, F = C*R): q, q_hat, k, k_hat (e F N each), PsiV and dy (e F P),
    dS_c and STATES (e N P, never live together), the masked F x F operand (e F F), k_hat.q_hat kept
    for DSSDA (e or 4 bytes x F F), the block-diagonal same-step operand of DK / DQ (e F F), dPsiV and
    the fp32 dk/dq staging tile, per-step scalars, exp(SEGSUM), cos/sin, QK_DOT, the same-step terms
    and the angle gradients. TileLang 0.1.15 reuses shared buffers
    whose lifetimes do not overlap (with or without tl.enable_aggressive_shared_memory_merge for this
    kernel), so the figure is the largest live set over the steps, 16-byte aligned per buffer, plus
    768 B on sm_90 (measured: every sm_90a build is 768 B above its sm_121a twin).
    Measured against the compiler (tests/test_tilelang_mamba.py): exact for the GB10 shape on sm_90a and
    sm_121a and for the N=64 shapes (both lkq variants); the planner packs less tightly than the model at
    N=128 (h100_tuned: 1.2% above it, 13% with lkq_fp32, where the fp32 F x F buffer is not at the
    peak step)."""
    c = {**DEFAULTS, **config}
    return _merged(_buffers(c, shape)) + (768 if tl.cc(target) == 90 else 0)


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def _buffers(config: dict, shape: dict) -> dict:
    """name -> (bytes, (first step, last step)) of the chunk kernel's shared buffers. Steps: 0 loads,
    1 dPsiV, 2 DV / DMIMO_V, 3 dkq, DSSDA, the same-step terms and DD, 4 the dk_hat GEMMs (last use of
    PsiV and dS_c) and DDA_CS_REV, 5 dk_hat staged, its angle gradient, DK and DFACTOR, 6 (unused),
    7 dq_hat (STATES loaded here), 8 DQ and DANGLES."""
    C, R, N, P = shape["C"], shape["R"], shape["N"], shape["P"]
    F, nr = C * R, N // shape["rd"]
    e = 2
    lean = config["lean_smem"]
    return {
        "qp": (e * F * N, (0, 8)), "qh": (e * F * N, (0, 7)), "kp": (e * F * N, (0, 8)),
        "kh": (e * F * N, (0, 7)), "psiv": (e * F * P, (0, 4)), "dy": (e * F * P, (0, 7)),
        "ds": (e * N * P, (0, 4)), "st": (e * N * P, (7, 7)), "w": (e * F * F, (1, 7)),
        "prod": ((4 if config["lkq_fp32"] else e) * F * F, (3, 3) if lean else (1, 3)), "pv": (4 * F * R, (3, 3)),
        "dpsiv": ((e if lean else 4) * F * P, (1, 2)), "wd": (e * F * F, (4, 8)), "g": (4 * F * N, (5, 8)),
        "rows": (4 * F, (4, 7)), "scal": (4 * 4 * C, (0, 8)), "seg": (4 * C * C, (0, 3)),
        "cs": (4 * 2 * C * nr, (0, 8)), "qkd": (4 * F * R, (0, 3)), "ang": (4 * F * nr, (5, 8)),
    }


def _merged(sizes: dict) -> int:
    peak = 0
    for step in range(9):
        peak = max(peak, sum(_align(b) for b, (lo, hi) in sizes.values() if lo <= step <= hi))
    return peak


# --------------------------------------------------------------------------------------------
# kernels


def _dims(shape: dict):
    C, R = shape["C"], shape["R"]
    return (shape["B"], shape["S"], shape["H"], shape["G"], shape["N"], shape["P"], R, C, shape["S"] // C,
            shape["N"] // shape["rd"], C * R)


def _dy_value(DOUT, Z, MIMO_O, MIMO_Z, b, t, r, h, p, shape):
    """dL/dy at (step t, rank r, head h, column p), fp32: DOUT through Phi and the SiLU(Z*Zeta) gate."""
    if shape["reduceO"]:
        d = T.cast(DOUT[b, t, h, p], F32) * MIMO_O[h, r, p]
    else:
        d = T.cast(DOUT[b, t, r, h, p], F32)
    if shape["hasZ"]:
        zz = T.cast(Z[b, t, h, p], F32) * MIMO_Z[h, r, p]
        d = d * zz * T.sigmoid(zz)
    return d


def _scan_program(config: dict, shape: dict):
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    dtype = shape["dtype"]
    bn, bp, threads, stages = config["scan_block_N"], config["scan_block_P"], config["scan_threads"], config["scan_stages"]
    tiles_p = P // bp
    tiles = (N // bn) * tiles_p
    half = N // 2
    reduceO, hasZ = shape["reduceO"], shape["hasZ"]
    dout_shape = (B, S, H, P) if reduceO else (B, S, R, H, P)

    @T.prim_func
    def scan(Q: T.Tensor((B, S, R, G, N), dtype), Q_BIAS: T.Tensor((H, R, N), F32),
             ANGLES: T.Tensor((B, S, H, nr), F32), DA_CS: T.Tensor((B, H, S), F32),
             DOUT: T.Tensor(dout_shape, dtype), Z: T.Tensor((B, S, H, P), dtype),
             MIMO_O: T.Tensor((H, R, P), F32), MIMO_Z: T.Tensor((H, R, P), F32),
             STATES: T.Tensor((B, H, nc, N, P), "bfloat16"), DSTATES: T.Tensor((B, H, nc, N, P), dtype),
             DDA_PART: T.Tensor((B, H, nc, tiles), F32)):
        with T.Kernel(H, B, tiles, threads=threads) as (h, b, tile):
            hq = h // (H // G)
            n0 = (tile // tiles_p) * bn
            p0 = (tile % tiles_p) * bp
            # raw per-chunk inputs, copied (asynchronously when pipelined) ahead of their step
            q_raw = T.alloc_shared((C, R, N), dtype)       # whole rows: the rotary partner of a column
            ang_raw = T.alloc_shared((C, nr), F32)          # may lie in another N tile
            da_raw = T.alloc_shared((C,), F32)
            do_raw = T.alloc_shared((C, bp) if reduceO else (C, R, bp), dtype)
            z_raw = T.alloc_shared((C, bp), dtype)
            st_raw = T.alloc_shared((bn, bp), "bfloat16")
            # per-head constants and per-step tables
            qb_s = T.alloc_shared((R, N), F32)
            mo_s = T.alloc_shared((R, bp), F32)
            mz_s = T.alloc_shared((R, bp), F32)
            cos_s = T.alloc_shared((C, nr), F32)
            sin_s = T.alloc_shared((C, nr), F32)
            ea_s = T.alloc_shared((C,), F32)
            qh_s = T.alloc_shared((F, bn), dtype)
            dy_s = T.alloc_shared((F, bp), dtype)
            ds_s = T.alloc_shared((bn, bp), dtype)
            ds_f = T.alloc_fragment((bn, bp), F32)
            prod_f = T.alloc_fragment((bn, bp), F32)
            row_f = T.alloc_fragment((bn,), F32)
            one = T.alloc_fragment((1,), F32)
            T.copy(Q_BIAS[h, :, :], qb_s)
            T.copy(MIMO_O[h, :, p0:p0 + bp], mo_s)
            T.copy(MIMO_Z[h, :, p0:p0 + bp], mz_s)
            T.clear(ds_f)
            for it in T.Pipelined(nc, num_stages=stages):
                c = nc - 1 - it
                T.copy(Q[b, c * C:(c + 1) * C, :, hq, :], q_raw)
                T.copy(ANGLES[b, c * C:(c + 1) * C, h, :], ang_raw)
                T.copy(DA_CS[b, h, c * C:(c + 1) * C], da_raw)
                if reduceO:
                    T.copy(DOUT[b, c * C:(c + 1) * C, h, p0:p0 + bp], do_raw)
                else:
                    T.copy(DOUT[b, c * C:(c + 1) * C, :, h, p0:p0 + bp], do_raw)
                if hasZ:
                    T.copy(Z[b, c * C:(c + 1) * C, h, p0:p0 + bp], z_raw)
                T.copy(STATES[b, h, c, n0:n0 + bn, p0:p0 + bp], st_raw)
                # dS_c out (bf16 GEMM operand for the chunk kernel) and its DDA partial from the fp32
                # dS (a bf16 dS loses the cancellation in sum(S * dS)).
                T.copy(ds_f, ds_s)
                T.copy(ds_s, DSTATES[b, h, c, n0:n0 + bn, p0:p0 + bp])
                for i, j in T.Parallel(bn, bp):
                    prod_f[i, j] = ds_f[i, j] * T.cast(st_raw[i, j], F32)
                T.reduce_sum(prod_f, row_f, dim=1)
                T.reduce_sum(row_f, one, dim=0)
                T.copy(one, DDA_PART[b, h, c, tile:tile + 1])
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
                    partner = T.if_then_else(n < half, n + half, n - half)
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
                        zz = T.cast(z_raw[t, j], F32) * mz_s[r, j]
                        d = d * zz * T.sigmoid(zz)
                    dy_s[f, j] = d * ea_s[t]
                for i, j in T.Parallel(bn, bp):
                    ds_f[i, j] = ds_f[i, j] * T.exp(da_raw[C - 1])
                T.gemm(qh_s, dy_s, ds_f, transpose_A=True)

    return scan


def _chunk_macros(C: int, R: int, N: int, nr: int):
    """Macros of the chunk kernel's steps that run once for the k side and once for the q side."""
    F, half = C * R, N // 2

    @T.macro
    def per_step_row_sum(prod_fn, row_f, rows_s, c_f, out):
        """out[t] = sum over the R fused rows of step t and the N columns of prod_fn ([F, N] fragment)."""
        T.reduce_sum(prod_fn, row_f, dim=1)
        T.copy(row_f, rows_s)
        T.clear(c_f)
        for t in T.Parallel(C):
            for r in T.serial(R):
                c_f[t] = c_f[t] + rows_s[t * R + r]
        T.copy(c_f, out)

    @T.macro
    def angle_grad(g_s, x_s, cos_s, sin_s, fac_s, ang_s, first):
        """dL/dangle of the rotary pairs from g_s = dL/d(rotated x) and the unrotated x_s; the k side
        (``first``) scales by factor and writes ang_s, the q side adds to it."""
        for f, j in T.Parallel(F, nr):
            x0 = T.cast(x_s[f, j], F32)
            x1 = T.cast(x_s[f, half + j], F32)
            cs = cos_s[f // R, j]
            sn = sin_s[f // R, j]
            if first:
                ang_s[f, j] = fac_s[f // R] * (g_s[f, j] * (-x0 * sn - x1 * cs) + g_s[f, half + j] * (x0 * cs - x1 * sn))
            else:
                ang_s[f, j] = ang_s[f, j] + g_s[f, j] * (-x0 * sn - x1 * cs) + g_s[f, half + j] * (x0 * cs - x1 * sn)

    @T.macro
    def rotate_back(g_s, cos_s, sin_s, out):
        """out = g_s with the rotary rotation of each pair undone (dL/d(rotated x) -> dL/dx)."""
        for f, n in T.Parallel(F, N):
            m = n % half
            partner = T.if_then_else(n < half, n + half, n - half)
            sgn = T.if_then_else(n < half, 1.0, -1.0)
            cs = cos_s[f // R, T.min(m, nr - 1)]
            sn = sin_s[f // R, T.min(m, nr - 1)]
            out[f, n] = T.if_then_else(m < nr, g_s[f, n] * cs + sgn * g_s[f, partner] * sn, g_s[f, n])

    return per_step_row_sum, angle_grad, rotate_back


def _chunk_program(config: dict, shape: dict):
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    dtype = shape["dtype"]
    threads = config["threads"]
    lean = config["lean_smem"]
    half = N // 2
    hasD, hasZ = shape["hasD"], shape["hasZ"]
    dout_shape = (B, S, H, P) if shape["reduceO"] else (B, S, R, H, P)
    _per_step_row_sum, _angle_grad, _rotate_back = _chunk_macros(C, R, N, nr)

    @T.prim_func
    def chunk(Q: T.Tensor((B, S, R, G, N), dtype), K: T.Tensor((B, S, R, G, N), dtype),
              V: T.Tensor((B, S, H, P), dtype), Q_BIAS: T.Tensor((H, R, N), F32), K_BIAS: T.Tensor((H, R, N), F32),
              MIMO_V: T.Tensor((H, R, P), F32), MIMO_O: T.Tensor((H, R, P), F32), MIMO_Z: T.Tensor((H, R, P), F32),
              Z: T.Tensor((B, S, H, P), dtype), D: T.Tensor((H,), F32), ANGLES: T.Tensor((B, S, H, nr), F32),
              DA_CS: T.Tensor((B, H, S), F32), DA_CS_REV: T.Tensor((B, H, S), F32), DT: T.Tensor((B, H, S), F32),
              TRAP: T.Tensor((B, H, S), dtype), STATES: T.Tensor((B, H, nc, N, P), "bfloat16"),
              QK_DOT: T.Tensor((B, H, S, R, R), dtype), SEGSUM: T.Tensor((B, H, nc, C, C), F32),
              DOUT: T.Tensor(dout_shape, dtype), DSTATES: T.Tensor((B, H, nc, N, P), dtype),
              DQ: T.Tensor((B, S * R, H, N), dtype), DK: T.Tensor((B, S * R, H, N), dtype),
              DV: T.Tensor((B, S, H, P), dtype), DANGLES: T.Tensor((B, S, H, nr), F32),
              DFACTOR: T.Tensor((B, H, S), F32), DGAMMA_DIAG: T.Tensor((B, H, S), F32),
              DDA_CS: T.Tensor((B, H, S), F32), DDA_CS_REV: T.Tensor((B, H, S), F32),
              DSSDA: T.Tensor((B, H, nc, C, C), F32), DMV_PART: T.Tensor((B, H, nc, R, P), F32),
              DD_PART: T.Tensor((B, H, nc), F32)):
        with T.Kernel(nc, H, B, threads=threads) as (c, h, b):
            if config["min_blocks"] > 1:
                T.annotate_min_blocks_per_sm(config["min_blocks"])
            hq = h // (H // G)
            t0 = c * C
            qp_s = T.alloc_shared((F, N), dtype)
            qh_s = T.alloc_shared((F, N), dtype)
            kp_s = T.alloc_shared((F, N), dtype)
            kh_s = T.alloc_shared((F, N), dtype)
            psiv_s = T.alloc_shared((F, P), dtype)
            dy_s = T.alloc_shared((F, P), dtype)
            st_s = T.alloc_shared((N, P), dtype)
            ds_s = T.alloc_shared((N, P), dtype)
            w_s = T.alloc_shared((F, F), dtype)
            wd_s = T.alloc_shared((F, F), dtype)        # block diagonal: the same-step R x R terms of DK / DQ
            prod_s = T.alloc_shared((F, F), F32 if config["lkq_fp32"] else dtype)
            pv_s = T.alloc_shared((F, R), F32)
            g_s = T.alloc_shared((F, N), F32)
            dpsiv_s = T.alloc_shared((F, P), dtype if lean else F32)
            rows_s = T.alloc_shared((F,), F32)
            ea_s = T.alloc_shared((C,), F32)
            er_s = T.alloc_shared((C,), F32)
            gam_s = T.alloc_shared((C,), F32)
            fac_s = T.alloc_shared((C,), F32)
            seg_s = T.alloc_shared((C, C), F32)
            cos_s = T.alloc_shared((C, nr), F32)
            sin_s = T.alloc_shared((C, nr), F32)
            qkd_s = T.alloc_shared((F, R), F32)
            ang_s = T.alloc_shared((F, nr), F32)
            if config["swizzle"]:
                T.annotate_layout({buf: tilelang.layout.make_swizzled_layout(buf)
                                   for buf in (qp_s, qh_s, kp_s, kh_s, psiv_s, dy_s, st_s, ds_s, w_s, wd_s)})

            acc_fp = T.alloc_fragment((F, P), F32)
            acc_ff = T.alloc_fragment((F, F), F32)
            if lean:
                lkq_f = T.alloc_fragment((F, F), F32)
            acc_fn = T.alloc_fragment((F, N), F32)
            tmp_fn = T.alloc_fragment((F, N), F32)
            row_f = T.alloc_fragment((F,), F32)
            c_f = T.alloc_fragment((C,), F32)
            one_d = T.alloc_fragment((1,), F32)
            cc_f = T.alloc_fragment((C, C), F32)
            dv_f = T.alloc_fragment((C, P), F32)
            dmv_f = T.alloc_fragment((R, P), F32)
            ang_f = T.alloc_fragment((C, nr), F32)

            # ---- per-step scalars and small tables
            for t in T.Parallel(C):
                ea_s[t] = T.exp(DA_CS[b, h, t0 + t])
                er_s[t] = T.exp(DA_CS_REV[b, h, t0 + t])
                g = DT[b, h, t0 + t] * T.sigmoid(T.cast(TRAP[b, h, t0 + t], F32))
                nxt = T.min(t0 + t + 1, S - 1)
                sh = T.if_then_else(t0 + t + 1 < S, DT[b, h, nxt] * T.sigmoid(-T.cast(TRAP[b, h, nxt], F32)), 0.0)
                gam_s[t] = g
                fac_s[t] = g + sh
            for t, s in T.Parallel(C, C):
                seg_s[t, s] = T.if_then_else(s < t, T.exp(SEGSUM[b, h, c, t, s]), 0.0)
            for t, j in T.Parallel(C, nr):
                cos_s[t, j] = T.cos(ANGLES[b, t0 + t, h, j])
                sin_s[t, j] = T.sin(ANGLES[b, t0 + t, h, j])
            for f, i in T.Parallel(F, R):
                qkd_s[f, i] = T.cast(QK_DOT[b, h, t0 + f // R, f % R, i], F32)

            # ---- operand tiles
            for f, n in T.Parallel(F, N):
                qp_s[f, n] = T.cast(Q[b, t0 + f // R, f % R, hq, n], F32) + Q_BIAS[h, f % R, n]
                kp_s[f, n] = T.cast(K[b, t0 + f // R, f % R, hq, n], F32) + K_BIAS[h, f % R, n]
            for f, p in T.Parallel(F, P):
                psiv_s[f, p] = T.cast(V[b, t0 + f // R, h, p], F32) * MIMO_V[h, f % R, p]
                dy_s[f, p] = _dy_value(DOUT, Z, MIMO_O, MIMO_Z, b, t0 + f // R, f % R, h, p, shape)
            T.copy(DSTATES[b, h, c, :, :], ds_s)
            for f, n in T.Parallel(F, N):
                m = n % half
                partner = T.if_then_else(n < half, n + half, n - half)
                sgn = T.if_then_else(n < half, -1.0, 1.0)
                cs = cos_s[f // R, T.min(m, nr - 1)]
                sn = sin_s[f // R, T.min(m, nr - 1)]
                xq = T.cast(qp_s[f, n], F32)
                yq = T.cast(qp_s[f, partner], F32)
                xk = T.cast(kp_s[f, n], F32)
                yk = T.cast(kp_s[f, partner], F32)
                qh_s[f, n] = T.if_then_else(m < nr, xq * cs + sgn * yq * sn, xq)
                kh_s[f, n] = T.if_then_else(m < nr, xk * cs + sgn * yk * sn, xk) * fac_s[f // R]

            # ---- dPsiV = exp(DA_CS_REV) k_hat dS + (masked k_hat q_hat^T) dy + D dy + diagonal
            T.gemm(kh_s, ds_s, acc_fp, clear_accum=True)
            for f, p in T.Parallel(F, P):
                acc_fp[f, p] = acc_fp[f, p] * er_s[f // R]
            T.gemm(kh_s, qh_s, acc_ff, transpose_B=True, clear_accum=True)      # lkq[s, t]
            if not lean:
                T.copy(acc_ff, prod_s)
            # Masked lkq (earlier steps) and, on the same-step R x R blocks, gamma * QK_DOT^T: one GEMM
            # with dy instead of an R-deep loop over shared memory per element.
            for i, j in T.Parallel(F, F):
                w_s[i, j] = T.if_then_else(i // R == j // R, gam_s[i // R] * qkd_s[j, i % R],
                                           acc_ff[i, j] * seg_s[j // R, i // R])
            T.gemm(w_s, dy_s, acc_fp)
            if hasD:
                for f, p in T.Parallel(F, P):
                    acc_fp[f, p] = acc_fp[f, p] + D[h] * T.cast(dy_s[f, p], F32)
            T.copy(acc_fp, dpsiv_s)

            # ---- DV and DMIMO_V partials
            T.clear(dv_f)
            for t, p in T.Parallel(C, P):
                for r in T.serial(R):
                    dv_f[t, p] = dv_f[t, p] + dpsiv_s[t * R + r, p] * MIMO_V[h, r, p]
            T.copy(dv_f, DV[b, t0:t0 + C, h, :])
            T.clear(dmv_f)
            for r, p in T.Parallel(R, P):
                for t in T.serial(C):
                    dmv_f[r, p] = dmv_f[r, p] + dpsiv_s[t * R + r, p] * T.cast(V[b, t0 + t, h, p], F32)
            T.copy(dmv_f, DMV_PART[b, h, c, :, :])

            # ---- dkq = PsiV dy^T (row s, column t): DSSDA, the same-step diagonal, masked copy
            T.gemm(psiv_s, dy_s, acc_ff, transpose_B=True, clear_accum=True)
            if lean:
                T.gemm(kh_s, qh_s, lkq_f, transpose_B=True, clear_accum=True)     # lkq again, not kept
            for i, j in T.Parallel(F, F):
                if lean:
                    prod_s[i, j] = lkq_f[i, j] * acc_ff[i, j]
                else:
                    prod_s[i, j] = T.cast(prod_s[i, j], F32) * acc_ff[i, j]
                w_s[i, j] = acc_ff[i, j] * seg_s[j // R, i // R]
                if i // R == j // R:
                    # same-step block: pv[t, o, i'] = dy_{t,o} . PsiV_{t,i'} = dkq[t*R + i', t*R + o]
                    pv_s[j, i % R] = acc_ff[i, j]
            T.clear(cc_f)
            for s, t in T.Parallel(C, C):
                for ri in T.serial(R):
                    for ro in T.serial(R):
                        cc_f[s, t] = cc_f[s, t] + T.cast(prod_s[s * R + ri, t * R + ro], F32)
            T.copy(cc_f, DSSDA[b, h, c, :, :])
            for i, j in T.Parallel(F, F):
                wd_s[i, j] = T.if_then_else(i // R == j // R, gam_s[i // R] * pv_s[j, i % R], 0.0)
            if hasD:
                # DD partial: sum over the chunk of PsiV . dy, the diagonal of dkq (pv[f, f % R])
                for f in T.Parallel(F):
                    row_f[f] = pv_s[f, f % R]
                T.reduce_sum(row_f, one_d, dim=0)
                T.copy(one_d, DD_PART[b, h, c:c + 1])
            T.clear(c_f)
            for t in T.Parallel(C):
                for o in T.serial(R):
                    for i in T.serial(R):
                        c_f[t] = c_f[t] + qkd_s[t * R + o, i] * pv_s[t * R + o, i]
            T.copy(c_f, DGAMMA_DIAG[b, h, t0:t0 + C])

            # ---- dk_hat = exp(DA_CS_REV) PsiV dS^T + masked dkq q_hat; DDA_CS_REV, DFACTOR, DK
            T.gemm(psiv_s, ds_s, acc_fn, transpose_B=True, clear_accum=True)
            for f, n in T.Parallel(F, N):
                tmp_fn[f, n] = acc_fn[f, n] * T.cast(kh_s[f, n], F32)
            _per_step_row_sum(tmp_fn, row_f, rows_s, c_f, DDA_CS_REV[b, h, t0:t0 + C])
            for f, n in T.Parallel(F, N):
                acc_fn[f, n] = acc_fn[f, n] * er_s[f // R]
            T.gemm(w_s, qh_s, acc_fn)
            T.copy(acc_fn, g_s)                                                  # dk_hat (rotated frame)
            _angle_grad(g_s, kp_s, cos_s, sin_s, fac_s, ang_s, True)
            _rotate_back(g_s, cos_s, sin_s, tmp_fn)
            for f, n in T.Parallel(F, N):
                acc_fn[f, n] = tmp_fn[f, n] * T.cast(kp_s[f, n], F32)
            _per_step_row_sum(acc_fn, row_f, rows_s, c_f, DFACTOR[b, h, t0:t0 + C])
            for f, n in T.Parallel(F, N):
                acc_fn[f, n] = fac_s[f // R] * tmp_fn[f, n]
            T.gemm(wd_s, qp_s, acc_fn)                                           # same-step terms
            T.copy(acc_fn, DK[b, c * F:(c + 1) * F, h, :])

            # ---- dq_hat = exp(DA_CS) dy S_c^T + masked dkq^T k_hat; DDA_CS, DQ, DANGLES
            T.copy(STATES[b, h, c, :, :], st_s)     # loaded once dS_c is dead: the two can share memory
            T.gemm(dy_s, st_s, acc_fn, transpose_B=True, clear_accum=True)
            for f, n in T.Parallel(F, N):
                tmp_fn[f, n] = acc_fn[f, n] * T.cast(qh_s[f, n], F32)
            _per_step_row_sum(tmp_fn, row_f, rows_s, c_f, DDA_CS[b, h, t0:t0 + C])
            for f, n in T.Parallel(F, N):
                acc_fn[f, n] = acc_fn[f, n] * ea_s[f // R]
            T.gemm(w_s, kh_s, acc_fn, transpose_A=True)
            T.copy(acc_fn, g_s)                                                  # dq_hat
            _angle_grad(g_s, qp_s, cos_s, sin_s, fac_s, ang_s, False)
            T.clear(ang_f)
            for t, j in T.Parallel(C, nr):
                for r in T.serial(R):
                    ang_f[t, j] = ang_f[t, j] + ang_s[t * R + r, j]
            T.copy(ang_f, DANGLES[b, t0:t0 + C, h, :])
            _rotate_back(g_s, cos_s, sin_s, acc_fn)
            T.gemm(wd_s, kp_s, acc_fn, transpose_A=True)                         # same-step terms
            T.copy(acc_fn, DQ[b, c * F:(c + 1) * F, h, :])

    return chunk


def _reduce_program(config: dict, shape: dict):
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    hasD = shape["hasD"]
    tiles = _scan_tiles(config, shape)

    @T.prim_func
    def reduce(DMV_PART: T.Tensor((B, H, nc, R, P), F32), DD_PART: T.Tensor((B, H, nc), F32),
               DDA_PART: T.Tensor((B, H, nc, tiles), F32), DA_CS: T.Tensor((B, H, S), F32),
               DMIMO_V: T.Tensor((B, H, R, P), F32), DD: T.Tensor((B, H), F32), DDA: T.Tensor((B, H, S), F32)):
        with T.Kernel(H, B, threads=128) as (h, b):
            dda_f = T.alloc_fragment((C,), F32)
            for c in T.serial(nc):
                # DDA = exp(DA_CS at the chunk's last step) * sum(S_c * dS_c), on every step of the chunk
                T.clear(dda_f)
                for t in T.Parallel(C):
                    for k in T.serial(tiles):
                        dda_f[t] = dda_f[t] + DDA_PART[b, h, c, k]
                    dda_f[t] = dda_f[t] * T.exp(DA_CS[b, h, c * C + C - 1])
                T.copy(dda_f, DDA[b, h, c * C:(c + 1) * C])
            acc = T.alloc_fragment((R, P), F32)
            T.clear(acc)
            for r, p in T.Parallel(R, P):
                for c in T.serial(nc):
                    acc[r, p] = acc[r, p] + DMV_PART[b, h, c, r, p]
            T.copy(acc, DMIMO_V[b, h, :, :])
            if hasD:
                tot = T.alloc_fragment((1,), F32)
                T.clear(tot)
                for i in T.Parallel(1):
                    for c in T.serial(nc):
                        tot[i] = tot[i] + DD_PART[b, h, c]
                T.copy(tot, DD[b, h:h + 1])

    return reduce


def _scan_tiles(config: dict, shape: dict) -> int:
    return (shape["N"] // config["scan_block_N"]) * (shape["P"] // config["scan_block_P"])


_PROGRAMS = {"scan": _scan_program, "chunk": _chunk_program, "reduce": _reduce_program}


# --------------------------------------------------------------------------------------------
# compile


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile of the three kernels for ``target`` (no GPU). smem_bytes and registers
    are the largest over the kernels (the chunk kernel's in practice); per-kernel figures ride along."""
    config = {**DEFAULTS, **config}
    t0 = time.perf_counter()
    per = {}
    for name, prog in _PROGRAMS.items():
        art = tl.lower(prog(config, shape), target, _pass_configs(config))
        cubin = tl.cubin_of(art.kernel_source, target, _pass_configs(config), use_cache=False)
        usage = tl.resource_usage(cubin, target)[0]
        per[name] = {"smem_bytes": tl.dynamic_smem(art) + usage["static_smem"], "registers": usage["registers"]}
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] for v in per.values()),
            "compile_s": time.perf_counter() - t0, "binary": "cubin", "kernels": per}


# --------------------------------------------------------------------------------------------
# launch


def build(config: dict, shape: dict):
    """Compile the three kernels for the current GPU's explicit target and return ``run``; the
    dS and partial-sum workspaces are allocated once per device on the first call."""
    config = {**DEFAULTS, **config}
    target = tl.device_target()
    if eligibility(target):
        raise RuntimeError(eligibility(target))
    kernels = {name: tilelang.compile(prog(config, shape), target=tl.tvm_target(target), execution_backend="tvm_ffi",
                                      pass_configs=_pass_configs(config))
               for name, prog in _PROGRAMS.items()}
    info = _launch_info(kernels, config, shape, target)
    B, S, H, G, N, P, R, C, nc, nr, F = _dims(shape)
    work: dict = {}

    def run(inputs, outputs):
        dev = inputs["Q"].device
        if work.get("device") != dev:
            work.update(device=dev, ds=torch.empty(B, H, nc, N, P, dtype=inputs["Q"].dtype, device=dev),
                        dmv=torch.empty(B, H, nc, R, P, dtype=torch.float32, device=dev),
                        dd=torch.zeros(B, H, nc, dtype=torch.float32, device=dev),
                        dd_out=torch.empty(B, H, dtype=torch.float32, device=dev),
                        dda=torch.empty(B, H, nc, _scan_tiles(config, shape), dtype=torch.float32, device=dev))
        i, o = inputs, outputs
        z, mo, mz, d = i["Z"], i["MIMO_O"], i["MIMO_Z"], i["D"]
        kernels["scan"](i["Q"], i["Q_BIAS"], i["ANGLES"], i["DA_CS"], i["DOUT"], z, mo, mz, i["STATES"], work["ds"],
                        work["dda"])
        kernels["chunk"](i["Q"], i["K"], i["V"], i["Q_BIAS"], i["K_BIAS"], i["MIMO_V"], mo, mz, z, d, i["ANGLES"],
                         i["DA_CS"], i["DA_CS_REV"], i["DT"], i["TRAP"], i["STATES"], i["QK_DOT"], i["SEGSUM"],
                         i["DOUT"], work["ds"], o["DQ"], o["DK"], o["DV"], o["DANGLES"], o["DFACTOR"],
                         o["DGAMMA_DIAG"], o["DDA_CS"], o["DDA_CS_REV"], o["DSSDA"], work["dmv"], work["dd"])
        kernels["reduce"](work["dmv"], work["dd"], work["dda"], i["DA_CS"], o["DMIMO_V"],
                          o["DD"] if shape["hasD"] else work["dd_out"], o["DDA"])
        return info
    return run


def _launch_info(kernels: dict, config: dict, shape: dict, target: str) -> dict:
    """Largest shared memory (dynamic + static) and registers over the built kernels (best effort)."""
    try:
        smem, regs = 0, 0
        for name, k in kernels.items():
            art = k.artifact if getattr(k, "artifact", None) is not None else \
                tl.lower(_PROGRAMS[name](config, shape), target, _pass_configs(config))
            cubin = tl.cubin_of(k.get_kernel_source(), target, _pass_configs(config), use_cache=True)
            usage = tl.resource_usage(cubin, target)[0]
            smem = max(smem, tl.dynamic_smem(art) + usage["static_smem"])
            regs = max(regs, usage["registers"])
        return {"smem_bytes": smem, "registers": regs, "spills": None}
    except Exception:
        return {"smem_bytes": None, "registers": None, "spills": None}


def versions() -> dict:
    import tvm_ffi
    return {"tilelang": tilelang.__version__, "apache-tvm-ffi": getattr(tvm_ffi, "__version__", "?"),
            "torch": torch.__version__}
