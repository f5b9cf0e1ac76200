"""Triton lane for mamba_bwd_bwd (the Mamba-3 MIMO backward kernel "bwd_bwd").

Four kernels (the model and the output definitions are in lab/problems/_mamba3.py):

1. ``_scan``: grid (tiles of dS, H, B). dS_c (N x P, the gradient of the state leaving chunk c) is the
   only serial dependency: dS_{c-1} = exp(DA_CS_last(c)) dS_c + q_hat_c^T (exp(DA_CS) dy_c). A program
   owns SCAN_BJ rotary pairs (rows j and N/2 + j of dS, so that it rotates q without a gather) and
   SCAN_BP columns, walks the chunks last to first with dS in fp32 registers, and writes dS_c in the
   input dtype (the chunk kernels' GEMM operand).
2. ``_chunk_k``: grid (nc * N/2 / KEY_BJ, H, B): the key / query side of one chunk on KEY_BJ rotary pairs.
   It walks P in KEY_BP columns accumulating PsiV dy^T (F x F, F = C*R fused rows t*R + r), PsiV dS^T and
   dy STATES^T (F x KEY_BJ per rotary half), then writes DQ, DK and DANGLES of its columns and its part of
   the row sums over N (DDA_CS_REV, DFACTOR, DDA_CS) and of sum(STATES * dS) (DDA) to a workspace.
   Splitting N across programs is what keeps the state-gradient products in registers: one program
   per chunk holding all of N spills thousands of bytes per thread (sm_90a ptxas, 255 registers).
   It also writes q_hat and k_hat (its columns, input dtype) to a workspace [B, H, nc, C*R, N] for (3):
   2 B H S R N elements, 512 MiB in bf16 at the training shape.
3. ``_chunk_v``: grid (nc, H, B): the value side. k_hat q_hat^T over all of N, then P in BLOCK_P
   columns: dPsiV (DV, the DMIMO_V and DD partials) and PsiV dy^T, reading q_hat and k_hat as the key
   side wrote them (no rotary recomputed per P step); then DSSDA, DGAMMA_DIAG, and the
   sums of the key side's workspace (DDA, DDA_CS, DDA_CS_REV, DFACTOR). The same-step R x R terms (QK_DOT
   into dPsiV, dqk into DK and DQ) are block-diagonal F x F operands of tensor-core products.
4. ``_reduce``: grid (H, B): DMIMO_V and DD summed over chunks (deterministic, no atomics).

Every F x N operand is held as its two rotary halves, so rotary, its transpose and the angle gradient
are elementwise between the halves. GEMM operands are in the input dtype (bf16 / fp16) with fp32
accumulation, as upstream; the elementwise math and every partial are fp32.

Tunables:
  SCAN_BJ, SCAN_BP      dS tile of one scan program: 2 * SCAN_BJ rows (SCAN_BJ rotary pairs) x SCAN_BP
  scan_warps, scan_stages   the scan's num_warps and num_stages (software pipelining of the chunk loop)
  KEY_BJ, KEY_BP        rotary pairs per key-side program, and P columns per step of its P loop
  key_warps             the key-side kernel's num_warps
  VALUE_BJ, BLOCK_P     rotary pairs per step of the value side's N loops (k_hat q_hat^T, and k_hat dS
                        recomputing k_hat per P step), and P columns per step of its P loop
  chunk_warps           the value-side kernel's num_warps
  chunk_stages          num_stages of both chunk kernels' P loops
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import _common
from kernels.triton._common import TARGETS, eligibility, versions  # noqa: F401  (the lane interface)
from lab.problems import _mamba3 as m3

DSL = "triton"
KERNEL = "mamba_bwd_bwd"
TUNABLES = ("SCAN_BJ", "SCAN_BP", "scan_warps", "scan_stages", "KEY_BJ", "KEY_BP", "key_warps", "VALUE_BJ",
            "BLOCK_P", "chunk_warps", "chunk_stages")
DEFAULTS = {"SCAN_BJ": 16, "SCAN_BP": 32, "scan_warps": 4, "scan_stages": 2, "KEY_BJ": 16, "KEY_BP": 32,
            "key_warps": 8, "VALUE_BJ": 16, "BLOCK_P": 32, "chunk_warps": 8, "chunk_stages": 1}
_TL = {"bfloat16": "bf16", "float16": "fp16"}


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def config_reason(config: dict, shape: dict) -> str | None:
    """Shapes the lane cannot take and configs that do not divide the shape (typed, never computed)."""
    c = {**DEFAULTS, **config}
    N, P, C, R = shape["N"], shape["P"], shape["C"], shape["R"]
    nh, F = N // 2, C * R
    if not (_pow2(nh) and nh >= 16):
        return f"N={N}: the lane needs N/2 a power of two >= 16 (tl.dot contracts over rotary halves)"
    if not (_pow2(C) and _pow2(F) and F >= 16):
        return f"C={C}, R={R}: the lane needs C and C*R powers of two with C*R >= 16 (tl.dot sizes)"
    if not _pow2(P) or P < 16:
        return f"P={P}: the lane needs P a power of two >= 16"
    for key, dim, name in (("SCAN_BJ", nh, "N/2"), ("SCAN_BP", P, "P"), ("KEY_BJ", nh, "N/2"), ("KEY_BP", P, "P"),
                           ("VALUE_BJ", nh, "N/2"), ("BLOCK_P", P, "P")):
        v = c[key]
        if not (isinstance(v, int) and _pow2(v) and 16 <= v <= dim):
            return f"{key}={v} must be a power of two in [16, {name}={dim}]"
    # The values each knob may take are the sweep file's (sweeps/mamba_bwd_bwd/triton.toml); the harness checks them.
    return None


# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _fuse(x_c, x_r, C: tl.constexpr, R: tl.constexpr, BP: tl.constexpr):
    """[C, BP] per step times [R, BP] per rank -> [F, BP] over fused rows t*R + r (loads R x fewer)."""
    return tl.reshape(x_c[:, None, :] * x_r[None, :, :], (C * R, BP))


@triton.jit
def _step_tile(X, b, h, c, pp, S, H, C: tl.constexpr, P: tl.constexpr):
    """A [B, S, H, P] tensor's rows of chunk c, columns pp: [C, BP] (fp32)."""
    return tl.load(X + ((b * S + c * C + tl.arange(0, C)[:, None]) * H + h) * P + pp[None, :]).to(tl.float32)


@triton.jit
def _rank_tile(X, h, pp, R: tl.constexpr, P: tl.constexpr):
    """A [H, R, P] per-rank parameter's columns pp for head h: [R, BP] (fp32)."""
    return tl.load(X + (h * R + tl.arange(0, R)[:, None]) * P + pp[None, :]).to(tl.float32)


@triton.jit
def _dy_tile(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R: tl.constexpr, C: tl.constexpr, P: tl.constexpr,
             BP: tl.constexpr, HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr):
    """dL/dy [F, BP] (fp32) of chunk c's fused rows (step t, rank r) and columns pp."""
    if REDUCE_O:
        d = _fuse(_step_tile(DOUT, b, h, c, pp, S, H, C, P), _rank_tile(PHI, h, pp, R, P), C, R, BP)
    else:
        f = tl.arange(0, C * R)
        d = tl.load(DOUT + (((b * S + c * C + f[:, None] // R) * R + f[:, None] % R) * H + h) * P + pp[None, :])
        d = d.to(tl.float32)
    if HAS_Z:
        zz = _fuse(_step_tile(Z, b, h, c, pp, S, H, C, P), _rank_tile(ZETA, h, pp, R, P), C, R, BP)
        d = d * zz * tl.sigmoid(zz)
    return d


@triton.jit
def _rot(lo, hi, cos, sin):
    return lo * cos - hi * sin, lo * sin + hi * cos


@triton.jit
def _scan(Q, QB, ANG, DA, DOUT, PHI, Z, ZETA, DS, S, H, G, NC,
          N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
          BJ: tl.constexpr, BP: tl.constexpr, HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr,
          STAGES: tl.constexpr):
    F: tl.constexpr = C * R
    NH: tl.constexpr = N // 2
    NPB: tl.constexpr = P // BP
    tile, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    j0, p0 = (tile // NPB) * BJ, (tile % NPB) * BP
    g = h // (H // G)
    f = tl.arange(0, F)
    t, r = f // R, f % R
    jj = j0 + tl.arange(0, BJ)
    pp = p0 + tl.arange(0, BP)
    dt = Q.dtype.element_ty
    bq_lo = tl.load(QB + (h * R + r[:, None]) * N + jj[None, :])
    bq_hi = tl.load(QB + (h * R + r[:, None]) * N + NH + jj[None, :])
    run_lo = tl.zeros((BJ, BP), dtype=tl.float32)
    run_hi = tl.zeros((BJ, BP), dtype=tl.float32)
    for i in tl.range(0, NC, num_stages=STAGES):
        c = NC - 1 - i
        s = c * C + t
        row = b * S * R + c * F + f
        q_lo = tl.load(Q + (row[:, None] * G + g) * N + jj[None, :]).to(tl.float32) + bq_lo
        q_hi = tl.load(Q + (row[:, None] * G + g) * N + NH + jj[None, :]).to(tl.float32) + bq_hi
        ang = tl.load(ANG + ((b * S + s[:, None]) * H + h) * NR + jj[None, :], mask=jj[None, :] < NR, other=0.0)
        qh_lo, qh_hi = _rot(q_lo, q_hi, tl.cos(ang), tl.sin(ang))
        ea = tl.exp(tl.load(DA + (b * H + h) * S + s))
        dye = (_dy_tile(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, BP, HAS_Z, REDUCE_O) * ea[:, None]).to(dt)
        a_last = tl.exp(tl.load(DA + (b * H + h) * S + c * C + C - 1))
        # dS_c = dL/dS_{c+1}: what the later chunks sent back (zero for the last chunk).
        out = DS + ((b * H + h) * NC + c) * N * P + jj[:, None] * P + pp[None, :]
        tl.store(out, run_lo.to(dt))
        tl.store(out + NH * P, run_hi.to(dt))
        run_lo = a_last * run_lo + tl.dot(tl.trans(qh_lo.to(dt)), dye)
        run_hi = a_last * run_hi + tl.dot(tl.trans(qh_hi.to(dt)), dye)


@triton.jit
def _group(x, C: tl.constexpr, R: tl.constexpr):
    """Per-row values [F] summed over the R ranks of each step: [C]."""
    return tl.sum(tl.reshape(x, (C, R)), 1)


@triton.jit
def _gates(DT, TRAP, DAR, bh, s, S):
    """gamma, factor and exp(DA_CS_REV) of the rows' steps [F] (fp32)."""
    gamma = tl.load(DT + bh * S + s) * tl.sigmoid(tl.load(TRAP + bh * S + s).to(tl.float32))
    nxt = s + 1
    shifted = tl.load(DT + bh * S + nxt, mask=nxt < S, other=0.0) * \
        tl.sigmoid(-tl.load(TRAP + bh * S + nxt, mask=nxt < S, other=0.0).to(tl.float32))
    return gamma, gamma + shifted, tl.exp(tl.load(DAR + bh * S + s))


@triton.jit
def _decay(SEG, bh, c, t, NC, C: tl.constexpr, R: tl.constexpr, F: tl.constexpr):
    """exp(SEGSUM[t, s]) in (key s, query t) orientation over fused rows, s < t only; and the s == t mask."""
    ts, tt = t[:, None], (tl.arange(0, F) // R)[None, :]
    seg = tl.load(SEG + (bh * NC + c) * C * C + tt * C + ts, mask=ts < tt, other=0.0)
    return tl.where(ts < tt, tl.exp(seg), 0.0), ts == tt


@triton.jit
def _qk_rot(Q, K, QB, KB, ANG, b, h, g, r, s, row, jj, S, H, G, N: tl.constexpr, R: tl.constexpr,
            NR: tl.constexpr):
    """Biased q, k (fp32) on the rotary pairs jj (columns jj and N/2 + jj) and their cos, sin."""
    NH: tl.constexpr = N // 2
    ang = tl.load(ANG + ((b * S + s[:, None]) * H + h) * NR + jj[None, :], mask=jj[None, :] < NR, other=0.0)
    src = (row[:, None] * G + g) * N + jj[None, :]
    bias = (h * R + r[:, None]) * N + jj[None, :]
    q_lo = tl.load(Q + src).to(tl.float32) + tl.load(QB + bias)
    q_hi = tl.load(Q + src + NH).to(tl.float32) + tl.load(QB + bias + NH)
    k_lo = tl.load(K + src).to(tl.float32) + tl.load(KB + bias)
    k_hi = tl.load(K + src + NH).to(tl.float32) + tl.load(KB + bias + NH)
    return q_lo, q_hi, k_lo, k_hi, tl.cos(ang), tl.sin(ang)


@triton.jit
def _chunk_k(Q, K, QB, KB, V, PSI, ANG, DA, DAR, DT, TRAP, SEG, DOUT, PHI, Z, ZETA, STATES, DS,
             DQ, DK, DANG, ROW_WS, DDA_WS, QH, KH, S, H, G, NC,
             N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
             BJ: tl.constexpr, BP: tl.constexpr, HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr,
             STAGES: tl.constexpr):
    """Key / query side of one chunk on BJ rotary pairs: DQ, DK, DANGLES of those columns, and the
    pairs' parts of DDA_CS_REV, DFACTOR, DDA_CS (row sums over N) and of sum(STATES * dS) (DDA)."""
    F: tl.constexpr = C * R
    NH: tl.constexpr = N // 2
    NBJ: tl.constexpr = NH // BJ
    pid, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, jb = pid // NBJ, pid % NBJ
    g = h // (H // G)
    dt = Q.dtype.element_ty
    f = tl.arange(0, F)
    t, r = f // R, f % R
    s = c * C + t
    jj = jb * BJ + tl.arange(0, BJ)
    bh = b * H + h
    row = b * S * R + c * F + f
    dkq = tl.zeros((F, F), dtype=tl.float32)            # PsiV_s . dy_t
    dks_lo = tl.zeros((F, BJ), dtype=tl.float32)        # PsiV dS^T
    dks_hi = tl.zeros((F, BJ), dtype=tl.float32)
    dqs_lo = tl.zeros((F, BJ), dtype=tl.float32)        # dy STATES^T
    dqs_hi = tl.zeros((F, BJ), dtype=tl.float32)
    dda = 0.0
    for p0 in tl.range(0, P, BP, num_stages=STAGES):
        pp = p0 + tl.arange(0, BP)
        psiv16 = _fuse(_step_tile(V, b, h, c, pp, S, H, C, P), _rank_tile(PSI, h, pp, R, P), C, R, BP).to(dt)
        dy16 = _dy_tile(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, BP, HAS_Z, REDUCE_O).to(dt)
        cell = (bh * NC + c) * N * P + jj[:, None] * P + pp[None, :]
        ds_lo, ds_hi = tl.load(DS + cell), tl.load(DS + cell + NH * P)
        st_lo, st_hi = tl.load(STATES + cell), tl.load(STATES + cell + NH * P)
        dda += tl.sum(tl.sum(st_lo.to(tl.float32) * ds_lo.to(tl.float32) +
                             st_hi.to(tl.float32) * ds_hi.to(tl.float32), 1), 0)
        dkq += tl.dot(psiv16, tl.trans(dy16))
        dks_lo += tl.dot(psiv16, tl.trans(ds_lo))
        dks_hi += tl.dot(psiv16, tl.trans(ds_hi))
        dqs_lo += tl.dot(dy16, tl.trans(st_lo.to(dt)))
        dqs_hi += tl.dot(dy16, tl.trans(st_hi.to(dt)))
    a_last = tl.exp(tl.load(DA + bh * S + c * C + C - 1))
    tl.store(DDA_WS + (bh * NC + c) * NBJ + jb, a_last * dda)

    # Everything below the P loop is loaded after it (fewer registers live across it), and the F x F
    # operands go to the input dtype as soon as they are formed.
    gamma, factor, er = _gates(DT, TRAP, DAR, bh, s, S)
    decay, same = _decay(SEG, bh, c, t, NC, C, R, F)
    dqk = tl.where(same, tl.trans(dkq) * gamma[:, None], 0.0).to(dt)   # same-step dL/d(q_{t,o} . k_{t,i})
    dkq_m = (dkq * decay).to(dt)
    q_lo, q_hi, k_lo, k_hi, cos, sin = _qk_rot(Q, K, QB, KB, ANG, b, h, g, r, s, row, jj, S, H, G, N, R, NR)
    qh_lo, qh_hi = _rot(q_lo, q_hi, cos, sin)
    kr_lo, kr_hi = _rot(k_lo, k_hi, cos, sin)
    kh_lo, kh_hi = (kr_lo * factor[:, None]).to(dt), (kr_hi * factor[:, None]).to(dt)
    hb = ((bh * NC + c) * F + f[:, None]) * N + jj[None, :]
    tl.store(KH + hb, kh_lo)
    tl.store(KH + hb + NH, kh_hi)
    tl.store(QH + hb, qh_lo.to(dt))
    tl.store(QH + hb + NH, qh_hi.to(dt))

    # Row sums over this program's pairs, [3, C] per (chunk, pair block): DDA_CS_REV, DFACTOR, DDA_CS.
    ws = ROW_WS + ((bh * NC + c) * NBJ + jb) * 3 * C + tl.arange(0, C)
    tl.store(ws, _group(tl.sum(kh_lo.to(tl.float32) * dks_lo + kh_hi.to(tl.float32) * dks_hi, 1), C, R))
    dkh_lo = er[:, None] * dks_lo + tl.dot(dkq_m, qh_lo.to(dt))
    dkh_hi = er[:, None] * dks_hi + tl.dot(dkq_m, qh_hi.to(dt))
    tl.store(ws + C, _group(tl.sum(kr_lo * dkh_lo + kr_hi * dkh_hi, 1), C, R))
    dkr_lo, dkr_hi = dkh_lo * factor[:, None], dkh_hi * factor[:, None]
    tl.store(ws + 2 * C, _group(tl.sum(qh_lo * dqs_lo + qh_hi * dqs_hi, 1), C, R))
    ea = tl.exp(tl.load(DA + bh * S + s))
    dkq_mt = tl.trans(dkq_m)
    dqh_lo = ea[:, None] * dqs_lo + tl.dot(dkq_mt, kh_lo)
    dqh_hi = ea[:, None] * dqs_hi + tl.dot(dkq_mt, kh_hi)

    # Angle gradient: g0 (-x0 sin - x1 cos) + g1 (x0 cos - x1 sin) per pair, k and q paths, summed over R.
    dang = dkr_lo * (-k_lo * sin - k_hi * cos) + dkr_hi * (k_lo * cos - k_hi * sin) + \
        dqh_lo * (-q_lo * sin - q_hi * cos) + dqh_hi * (q_lo * cos - q_hi * sin)
    dang = tl.sum(tl.reshape(dang, (C, R, BJ)), 1)
    tc = tl.arange(0, C)
    tl.store(DANG + ((b * S + c * C + tc[:, None]) * H + h) * NR + jj[None, :], dang, mask=jj[None, :] < NR)

    # DK, DQ: rotary transpose plus the same-step products with the unrotated biased q, k.
    dqk_t = tl.trans(dqk)
    dk_lo = dkr_lo * cos + dkr_hi * sin + tl.dot(dqk_t, q_lo.to(dt))
    dk_hi = -dkr_lo * sin + dkr_hi * cos + tl.dot(dqk_t, q_hi.to(dt))
    dq_lo = dqh_lo * cos + dqh_hi * sin + tl.dot(dqk, k_lo.to(dt))
    dq_hi = -dqh_lo * sin + dqh_hi * cos + tl.dot(dqk, k_hi.to(dt))
    out = (row[:, None] * H + h) * N + jj[None, :]
    tl.store(DK + out, dk_lo.to(dt))
    tl.store(DK + out + NH, dk_hi.to(dt))
    tl.store(DQ + out, dq_lo.to(dt))
    tl.store(DQ + out + NH, dq_hi.to(dt))


@triton.jit
def _chunk_v(QH, KH, V, PSI, DAR, DT, TRAP, QKD, SEG, DOUT, PHI, Z, ZETA, DPARAM, DS,
             ROW_WS, DDA_WS, DV, DFACTOR, DGAMMA, DDA, DDA_CS, DDA_CS_REV, DSSDA, DPSI_WS, DD_WS,
             S, H, G, NC,
             N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
             BJ: tl.constexpr, BP: tl.constexpr, NBJ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
             REDUCE_O: tl.constexpr, STAGES: tl.constexpr):
    """Value side of one chunk: k_hat q_hat^T over all of N, then P in BP columns: dPsiV (DV, the
    DMIMO_V and DD partials) and PsiV dy^T; then DSSDA, DGAMMA_DIAG, DDA and the key side's row sums."""
    F: tl.constexpr = C * R
    NH: tl.constexpr = N // 2
    c, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dt = QH.dtype.element_ty
    f = tl.arange(0, F)
    t, r = f // R, f % R
    s = c * C + t
    bh = b * H + h
    hrow = ((bh * NC + c) * F + f[:, None]) * N
    gamma, factor, er = _gates(DT, TRAP, DAR, bh, s, S)
    decay, same = _decay(SEG, bh, c, t, NC, C, R, F)
    # Same-step q.k products (biased, before rotary): QKD[(t, o), (t, i)] on the diagonal blocks.
    qkd_at = QKD + ((bh * S + c * C + t[:, None]) * R + r[:, None]) * R + (tl.arange(0, F) % R)[None, :]
    diag_t = tl.trans(tl.load(qkd_at, mask=same, other=0.0).to(tl.float32) * gamma[:, None]).to(dt)
    lkq = tl.zeros((F, F), dtype=tl.float32)           # k_hat_s . q_hat_t, over N in BJ pairs at a time
    for j0 in tl.range(0, NH, BJ):
        hb = hrow + j0 + tl.arange(0, BJ)[None, :]
        lkq += tl.dot(tl.load(KH + hb), tl.trans(tl.load(QH + hb)))
        lkq += tl.dot(tl.load(KH + hb + NH), tl.trans(tl.load(QH + hb + NH)))
    lkq_m = (lkq * decay).to(dt)

    dkq = tl.zeros((F, F), dtype=tl.float32)            # PsiV_s . dy_t
    dd = 0.0
    if HAS_D:
        dpar = tl.load(DPARAM + h)
    tc = tl.arange(0, C)
    for p0 in tl.range(0, P, BP, num_stages=STAGES):
        pp = p0 + tl.arange(0, BP)
        v = _step_tile(V, b, h, c, pp, S, H, C, P)
        psi = _rank_tile(PSI, h, pp, R, P)
        psiv = _fuse(v, psi, C, R, BP)
        dy = _dy_tile(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, BP, HAS_Z, REDUCE_O)
        dy16 = dy.to(dt)
        # k_hat dS_c over N, k_hat recomputed BJ pairs at a time (keeping it costs registers that spill).
        khds = tl.zeros((F, BP), dtype=tl.float32)
        for j0 in tl.range(0, NH, BJ):
            jj = j0 + tl.arange(0, BJ)
            hb = hrow + jj[None, :]
            cell = (bh * NC + c) * N * P + jj[:, None] * P + pp[None, :]
            khds += tl.dot(tl.load(KH + hb), tl.load(DS + cell))
            khds += tl.dot(tl.load(KH + hb + NH), tl.load(DS + cell + NH * P))
        dpsiv = er[:, None] * khds + tl.dot(lkq_m, dy16) + tl.dot(diag_t, dy16)
        if HAS_D:
            dpsiv += dpar * dy
            dd += tl.sum(tl.sum(dy * psiv, 1), 0)
        dv = tl.sum(tl.reshape(dpsiv, (C, R, BP)) * psi[None, :, :], 1)
        tl.store(DV + ((b * S + c * C + tc[:, None]) * H + h) * P + pp[None, :], dv.to(dt))
        dpsi = tl.sum(tl.reshape(dpsiv, (C, R, BP)) * v[:, None, :], 0)
        ra = tl.arange(0, R)
        tl.store(DPSI_WS + ((bh * NC + c) * R + ra[:, None]) * P + pp[None, :], dpsi)
        dkq += tl.dot(psiv.to(dt), tl.trans(dy16))
    if HAS_D:
        tl.store(DD_WS + bh * NC + c, dd)

    per_step = bh * S + c * C + tc
    ssda = tl.sum(tl.sum(tl.reshape(lkq * dkq, (C, R, C, R)), 3), 1)
    tl.store(DSSDA + (bh * NC + c) * C * C + tc[:, None] * C + tc[None, :], ssda)
    qkd = tl.load(qkd_at, mask=same, other=0.0).to(tl.float32)
    tl.store(DGAMMA + per_step, _group(tl.sum(qkd * tl.trans(dkq), 1), C, R))
    # DDA on every step of the chunk, and the row sums over the key side's pair blocks.
    nb = tl.arange(0, NBJ)
    tl.store(DDA + per_step, tl.zeros((C,), dtype=tl.float32) + tl.sum(tl.load(DDA_WS + (bh * NC + c) * NBJ + nb), 0))
    ws = ROW_WS + ((bh * NC + c) * NBJ + nb[:, None]) * 3 * C + tc[None, :]
    tl.store(DDA_CS_REV + per_step, tl.sum(tl.load(ws), 0))
    tl.store(DFACTOR + per_step, tl.sum(tl.load(ws + C), 0))
    tl.store(DDA_CS + per_step, tl.sum(tl.load(ws + 2 * C), 0))


@triton.jit
def _reduce(DPSI_WS, DD_WS, DPSI, DD, H, NC, R: tl.constexpr, P: tl.constexpr, HAS_D: tl.constexpr):
    h, b = tl.program_id(0), tl.program_id(1)
    bh = b * H + h
    rp = tl.arange(0, R)[:, None] * P + tl.arange(0, P)[None, :]
    acc = tl.zeros((R, P), dtype=tl.float32)
    dd = 0.0
    for c in range(NC):
        acc += tl.load(DPSI_WS + (bh * NC + c) * R * P + rp)
        if HAS_D:
            dd += tl.load(DD_WS + bh * NC + c)
    tl.store(DPSI + bh * R * P + rp, acc)
    if HAS_D:
        tl.store(DD + bh, dd)


# --------------------------------------------------------------------------------------------
# launch


def _consts(config: dict, shape: dict) -> dict:
    return {"N": shape["N"], "P": shape["P"], "R": shape["R"], "C": shape["C"], "NR": shape["N"] // shape["rd"],
            "HAS_Z": bool(shape["hasZ"]), "REDUCE_O": bool(shape["reduceO"])}


def _scan_tiles(config: dict, shape: dict) -> int:
    return (shape["N"] // 2 // config["SCAN_BJ"]) * (shape["P"] // config["SCAN_BP"])


def _key_blocks(config: dict, shape: dict) -> int:
    return shape["N"] // 2 // config["KEY_BJ"]


def _kernel_consts(config: dict, shape: dict) -> dict:
    """Compile-time arguments of each kernel (beyond the shape's), keyed by kernel."""
    k, has_d = _consts(config, shape), bool(shape["hasD"])
    return {"scan": {**k, "BJ": config["SCAN_BJ"], "BP": config["SCAN_BP"], "STAGES": config["scan_stages"]},
            "key": {**k, "BJ": config["KEY_BJ"], "BP": config["KEY_BP"], "STAGES": config["chunk_stages"]},
            "value": {**k, "BJ": config["VALUE_BJ"], "BP": config["BLOCK_P"], "NBJ": _key_blocks(config, shape), "HAS_D": has_d,
                      "STAGES": config["chunk_stages"]},
            "reduce": {"R": shape["R"], "P": shape["P"], "HAS_D": has_d}}


def _warps(config: dict) -> dict:
    return {"scan": config["scan_warps"], "key": config["key_warps"], "value": config["chunk_warps"], "reduce": 4}


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    why = config_reason(config, shape)
    if why:
        raise ValueError(why)
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    kc, warps = _kernel_consts(config, shape), _warps(config)
    tiles, nbj = _scan_tiles(config, shape), _key_blocks(config, shape)
    work: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        dev = i["Q"].device
        if work.get("dev") != dev:
            f32 = {"dtype": torch.float32, "device": dev}
            work.update(dev=dev, ds=torch.empty(B, H, nc, N, P, dtype=i["Q"].dtype, device=dev),
                        dda=torch.empty(B, H, nc, nbj, **f32), rows=torch.empty(B, H, nc, nbj, 3, C, **f32),
                        dpsi=torch.empty(B, H, nc, R, P, **f32), dd=torch.empty(B, H, nc, **f32),
                        qh=torch.empty(B, H, nc, C * R, N, dtype=i["Q"].dtype, device=dev),
                        kh=torch.empty(B, H, nc, C * R, N, dtype=i["Q"].dtype, device=dev))
        w = work
        dummy = i["Q"]
        z, zeta = (i["Z"], i["MIMO_Z"]) if shape["hasZ"] else (dummy, i["MIMO_V"])
        dpar = i["D"] if shape["hasD"] else i["MIMO_V"]
        dd_out = o["DD"] if shape["hasD"] else w["dd"]
        _scan[(tiles, H, B)](i["Q"], i["Q_BIAS"], i["ANGLES"], i["DA_CS"], i["DOUT"], i["MIMO_O"], z, zeta,
                             w["ds"], S, H, G, nc, num_warps=warps["scan"], **kc["scan"])
        _chunk_k[(nc * nbj, H, B)](
            i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["V"], i["MIMO_V"], i["ANGLES"], i["DA_CS"], i["DA_CS_REV"],
            i["DT"], i["TRAP"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, i["STATES"], w["ds"],
            o["DQ"], o["DK"], o["DANGLES"], w["rows"], w["dda"], w["qh"], w["kh"], S, H, G, nc,
            num_warps=warps["key"], **kc["key"])
        kern = _chunk_v[(nc, H, B)](
            w["qh"], w["kh"], i["V"], i["MIMO_V"], i["DA_CS_REV"],
            i["DT"], i["TRAP"], i["QK_DOT"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, dpar, w["ds"],
            w["rows"], w["dda"], o["DV"], o["DFACTOR"], o["DGAMMA_DIAG"], o["DDA"], o["DDA_CS"], o["DDA_CS_REV"],
            o["DSSDA"], w["dpsi"], w["dd"], S, H, G, nc, num_warps=warps["value"], **kc["value"])
        _reduce[(H, B)](w["dpsi"], w["dd"], o["DMIMO_V"], dd_out, H, nc, num_warps=warps["reduce"], **kc["reduce"])
        return _common.launch_info(kern)
    return run


def _value_modelled(shape: dict) -> bool:
    """Shapes where smem_kernels' value-side figure is the compiler's (C*R probed: 32 and 64)."""
    return shape["C"] * shape["R"] in (32, 64)


def smem_kernels(config: dict, shape: dict, target: str) -> dict:
    """Shared memory per CTA of each kernel, bytes, as Triton 3.6 allocates it in compile_for (model
    and limits in smem_estimate). e: bytes of a GEMM operand (bf16 / fp16); fp32 tiles are 4 bytes."""
    c = {**DEFAULTS, **config}
    C, R = shape["C"], shape["R"]
    F, e = C * R, 2
    sm90 = _common.cc(target) == 90

    def wgmma(m: int, warps: int) -> tuple[bool, bool]:
        """(an m-row product runs on warpgroup MMA, its warps split N too). Else (below 64 rows,
        sm_121a) Triton takes mma.sync, whose operands go through registers."""
        on = sm90 and m % 64 == 0
        return on, on and 16 * warps > m

    def mma_cvt(nbytes: int, warps: int) -> int:
        """Scratch of an accumulator's conversion between two wgmma layouts: 16 B per thread a round."""
        return min(512 * warps, nbytes)

    # Scan, bytes (its products have SCAN_BJ rows: mma.sync). stage (one per pipeline stage beyond the
    # first): cp.async buffers of the chunk loop's fp32 loads (bf16 / fp16 loads, of unknown alignment
    # in an AOT compile, are not pipelined): angles 4 F BJ, DA_CS rows 4 F and the last step's 4,
    # MIMO_O / MIMO_Z 4 R BP each when present. body: the largest of the q_hat^T operand e BJ F, the dS
    # tile's conversion e BJ BP and dy's rows' e (C or F) BP, those conversions at full size (upper
    # bounds where they decide: they take rounds).
    bj, bp = c["SCAN_BJ"], c["SCAN_BP"]
    stage = 4 * F * bj + 4 * F + 4 + 4 * R * bp * (bool(shape["hasZ"]) + bool(shape["reduceO"]))
    body = max(e * bj * F, e * bj * bp, e * (C if shape["reduceO"] else F) * bp)
    scan = (c["scan_stages"] - 1) * stage + body

    # Key side, after its P loop: dqk [F, F] (e) lives to the end. Peak one: dkq_m's conversion to the
    # transposed product's layout (e F F). Peak two: the fp32 [F, KEY_BJ] conversions of the rotary
    # halves (4 F BJ). On wgmma the B operands k_hat lo / hi [F, BJ] (e each) stay in shared memory
    # from their product to their last use and q_hat's operand (e F BJ) comes and goes, or the four
    # e-byte [F, BJ] tiles of q_hat and k_hat stored for the value side are staged; when the warps
    # split N, dkq_m [F, F] (e) is staged for its products too and fp32 [F, BJ] accumulators change
    # layout. At C*R = 16, an upper bound.
    bj, w = c["KEY_BJ"], c["key_warps"]
    on, split = wgmma(F, w)
    if on:
        key = max((4 + 2 * split) * F * F,
                  (2 + 2 * split) * F * F + 2 * e * F * bj
                  + max(4 * F * bj, e * F * bj + split * mma_cvt(4 * F * bj, w), 4 * e * F * bj))
    elif F >= 32:
        key = max(4 * F * F, 2 * F * F + 4 * F * bj)
    else:
        key = 4 * F * F + 4 * F * bj

    # Value side, bytes (the compiler's figure where _value_modelled, else a bound: smem_inexact).
    # ff = e F F: diag_t, staged all kernel long (lkq_m too with split warps); kt = e F VALUE_BJ: a
    # k_hat / q_hat tile; ds = e VALUE_BJ BLOCK_P: a dS tile; dy = e F BLOCK_P: dy's operand; acc =
    # 4 F BLOCK_P: an fp32 [F, BLOCK_P] conversion (khds' on split wgmma, 512 a warp at most; dpsiv's
    # for D * dy where dy's layout differs); 4 F F: an fp32 [F, F] conversion.
    bj, bp, w = c["VALUE_BJ"], c["BLOCK_P"], c["chunk_warps"]
    reduce_o = bool(shape["reduceO"])
    ff, kt, ds, dy, acc = e * F * F, e * F * bj, e * bj * bp, e * F * bp, 4 * F * bp
    one = bj == shape["N"] // 2          # one-step N loops
    spread = R * bp >= 32 * w            # an [R, BLOCK_P] tile has an element per thread
    dpsiv = acc if shape["hasD"] and (R == 1 or spread) else 0
    split = wgmma(F, w)[1]               # at C*R = 32 and 64, wgmma runs only with its warps split
    if not _value_modelled(shape):
        value = 4 * F * F * (1 + sm90) + e * F * (bj + bp) + 2 * e * bj * bp
    elif split and one:
        value = max(ff + dy + max(kt + ds, mma_cvt(acc, w)), ff + dy + dpsiv, 4 * F * F)
    elif split:
        value = max(2 * ff + dy + mma_cvt(acc, w) + kt + ds, 2 * ff + dy + dpsiv)
    elif one:
        value = max(2 * kt, kt + ds, dpsiv, ff, 2 * dy * (not reduce_o))
    else:
        value = max(ff + 2 * kt, ff + dpsiv, 4 * F * F * (R == 1), (ff + 2 * dy) * (not reduce_o))

    return {"scan": scan, "key": key, "value": value, "reduce": 0}   # reduce: registers only


def smem_inexact(config: dict, shape: dict, target: str) -> set:
    """The kernels whose smem_kernels figure is an upper bound, not the compiler's figure."""
    c = {**DEFAULTS, **config}
    F = shape["C"] * shape["R"]
    bj = c["SCAN_BJ"]
    dy_rows = shape["C"] if shape["reduceO"] else F
    out = set()
    if bj * F < max(bj, dy_rows) * c["SCAN_BP"]:
        out.add("scan")           # a layout conversion's scratch (rounds per warp count) decides
    if F < 32 or c["KEY_BP"] == shape["P"]:
        out.add("key")            # C*R = 16; or one P step: its layouts change
    if not _value_modelled(shape):
        out.add("value")          # C*R outside 32 and 64: not probed, the bound stands
    return out


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA, bytes: the largest of the four kernels' (compile_for's smem_bytes), from
    what each stages in shared memory under Triton 3.6 for an ahead-of-time compile: cp.async buffers
    of its pipelined fp32 loads, GEMM operands (mma.sync converts them through shared memory one at a
    time; sm_90a's warpgroup MMA, taken for products of 64 or 128 rows, reads B from shared memory,
    and A too when its warps split N), and layout-conversion scratch (terms in smem_kernels).

    Over the sweep space (sweeps/mamba_bwd_bwd/triton.toml) at every named shape, each kernel's figure
    equals the compiler's for sm_90a and sm_121a (tests/test_triton_mamba.py) except where smem_inexact
    names it; there it is an upper bound. The value side's figure is exact at C*R = 32 and 64 (every
    named shape); the key side's at C*R >= 32 with KEY_BP < P (every named shape). The scan's is a
    bound where its dS / dy layout conversion outweighs the q_hat^T operand (at the named shapes:
    SCAN_BP = 128, or R = 1, or unreduced DOUT); that bound gives the largest figure only at
    grid_n128_p128_r4_c8 with SCAN_BP = 128. Not modelled: C*R >= 256 (over every device's limit)."""
    return max(smem_kernels(config, shape, target).values())


def _signatures(shape: dict) -> dict:
    """Argument types of the four kernels for an ahead-of-time compile."""
    e, f = f"*{_TL[shape['dtype']]}", "*fp32"
    dims = dict(S="i32", H="i32", G="i32", NC="i32")
    scan = dict(Q=e, QB=f, ANG=f, DA=f, DOUT=e, PHI=f, Z=e, ZETA=f, DS=e, **dims)
    key = dict(Q=e, K=e, QB=f, KB=f, V=e, PSI=f, ANG=f, DA=f, DAR=f, DT=f, TRAP=e, SEG=f, DOUT=e, PHI=f, Z=e,
               ZETA=f, STATES="*bf16", DS=e, DQ=e, DK=e, DANG=f, ROW_WS=f, DDA_WS=f, QH=e, KH=e, **dims)
    value = dict(QH=e, KH=e, V=e, PSI=f, DAR=f, DT=f, TRAP=e, QKD=e, SEG=f, DOUT=e, PHI=f, Z=e,
                 ZETA=f, DPARAM=f, DS=e, ROW_WS=f, DDA_WS=f, DV=e, DFACTOR=f, DGAMMA=f, DDA=f, DDA_CS=f,
                 DDA_CS_REV=f, DSSDA=f, DPSI_WS=f, DD_WS=f, **dims)
    reduce = dict(DPSI_WS=f, DD_WS=f, DPSI=f, DD=f, H="i32", NC="i32")
    return {"scan": scan, "key": key, "value": value, "reduce": reduce}


_FNS = {"scan": _scan, "key": _chunk_k, "value": _chunk_v, "reduce": _reduce}


def compile_kernel(name: str, config: dict, shape: dict, target: str) -> dict:
    """One of the four kernels ("scan", "key", "value", "reduce") for ``target`` (no GPU)."""
    config = {**DEFAULTS, **config}
    return _common.aot(_FNS[name], _signatures(shape)[name], _kernel_consts(config, shape)[name], target,
                       _warps(config)[name])


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """The four kernels for ``target`` (no GPU); smem_bytes / registers are the largest of them."""
    per = {name: compile_kernel(name, config, shape, target) for name in _FNS}
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] or 0 for v in per.values()) or None,
            "compile_s": sum(v["compile_s"] for v in per.values()), "binary": "cubin", "kernels": per}
