"""Triton lane for mamba_bwd_bwd (the Mamba-3 MIMO backward kernel "bwd_bwd").

Three kernels (the model and the output definitions are in lab/problems/_mamba3.py):

1. ``_scan``: grid (tiles of dS, H, B). dS_c (N x P, the gradient of the state leaving chunk c) is the
   only serial dependency: dS_{c-1} = exp(DA_CS_last(c)) dS_c + q_hat_c^T (exp(DA_CS) dy_c). A program
   owns SCAN_BJ rotary pairs (rows j and N/2 + j of dS, so that it rotates q without a gather) and
   SCAN_BP columns, walks the chunks last to first with dS in fp32 registers, and writes dS_c in the
   input dtype (the chunk kernel's GEMM operand) plus its tile's part of sum(STATES_c * dS_c) for DDA.
2. ``_chunk``: grid (nc, H, B), one program per chunk, everything else. Every F x N operand (F = C*R
   fused rows t*R + r) is held as its two rotary halves [F, N/2], so rotary, its transpose and the
   angle gradient are elementwise between the halves. The program first forms k_hat q_hat^T (F x F),
   then walks P in BLOCK_P columns: dPsiV (DV, the DMIMO_V and DD partials) per block, and the F x F
   and F x N products that sum over P (PsiV dy^T, PsiV dS^T, dy STATES^T) accumulate; the rest (DSSDA,
   DGAMMA_DIAG, DFACTOR, DDA_CS(_REV), DANGLES, DQ, DK) follows from them. The same-step R x R terms
   (QK_DOT into dPsiV, dqk into DK and DQ) are block-diagonal F x F operands of tensor-core products.
3. ``_reduce``: grid (H, B): DMIMO_V and DD summed over chunks (deterministic, no atomics).

GEMM operands are in the input dtype (bf16 / fp16) with fp32 accumulation, as upstream; the
elementwise math and every partial are fp32.

Tunables:
  SCAN_BJ, SCAN_BP      dS tile of one scan program: 2 * SCAN_BJ rows (SCAN_BJ rotary pairs) x SCAN_BP
  scan_warps, scan_stages   the scan's num_warps and num_stages (software pipelining of the chunk loop)
  BLOCK_P               P columns per step of the chunk program's P loop
  chunk_warps, chunk_stages the chunk kernel's num_warps and num_stages (of the P loop)
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
TUNABLES = ("SCAN_BJ", "SCAN_BP", "scan_warps", "scan_stages", "BLOCK_P", "chunk_warps", "chunk_stages")
DEFAULTS = {"SCAN_BJ": 16, "SCAN_BP": 32, "scan_warps": 4, "scan_stages": 2, "BLOCK_P": 32, "chunk_warps": 8,
            "chunk_stages": 1}
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
    for key, dim, name in (("SCAN_BJ", nh, "N/2"), ("SCAN_BP", P, "P"), ("BLOCK_P", P, "P")):
        v = c[key]
        if not (isinstance(v, int) and _pow2(v) and 16 <= v <= dim):
            return f"{key}={v} must be a power of two in [16, {name}={dim}]"
    for key in ("scan_warps", "chunk_warps"):
        if c[key] not in (1, 2, 4, 8, 16):
            return f"{key}={c[key]} must be 1, 2, 4, 8 or 16"
    for key in ("scan_stages", "chunk_stages"):
        if c[key] not in (1, 2, 3, 4):
            return f"{key}={c[key]} must be 1 to 4"
    return None


def target_reason(config: dict, target: str) -> str | None:
    return None


# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _dy_tile(DOUT, PHI, Z, ZETA, b, h, s, r, pp, S, H, R: tl.constexpr, P: tl.constexpr,
             HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr):
    """dL/dy [F, BP] (fp32) of the fused rows (step s, rank r) and columns pp."""
    if REDUCE_O:
        d = tl.load(DOUT + ((b * S + s[:, None]) * H + h) * P + pp[None, :]).to(tl.float32)
        d = d * tl.load(PHI + (h * R + r[:, None]) * P + pp[None, :])
    else:
        d = tl.load(DOUT + (((b * S + s[:, None]) * R + r[:, None]) * H + h) * P + pp[None, :]).to(tl.float32)
    if HAS_Z:
        zz = tl.load(Z + ((b * S + s[:, None]) * H + h) * P + pp[None, :]).to(tl.float32)
        zz = zz * tl.load(ZETA + (h * R + r[:, None]) * P + pp[None, :])
        d = d * zz * tl.sigmoid(zz)
    return d


@triton.jit
def _rot(lo, hi, cos, sin):
    return lo * cos - hi * sin, lo * sin + hi * cos


@triton.jit
def _scan(Q, QB, ANG, DA, DOUT, PHI, Z, ZETA, STATES, DS, DDA_WS, S, H, G, NC,
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
    dda = 0.0
    for i in tl.range(0, NC, num_stages=STAGES):
        c = NC - 1 - i
        s = c * C + t
        row = b * S * R + c * F + f
        q_lo = tl.load(Q + (row[:, None] * G + g) * N + jj[None, :]).to(tl.float32) + bq_lo
        q_hi = tl.load(Q + (row[:, None] * G + g) * N + NH + jj[None, :]).to(tl.float32) + bq_hi
        ang = tl.load(ANG + ((b * S + s[:, None]) * H + h) * NR + jj[None, :], mask=jj[None, :] < NR, other=0.0)
        qh_lo, qh_hi = _rot(q_lo, q_hi, tl.cos(ang), tl.sin(ang))
        ea = tl.exp(tl.load(DA + (b * H + h) * S + s))
        dye = (_dy_tile(DOUT, PHI, Z, ZETA, b, h, s, r, pp, S, H, R, P, HAS_Z, REDUCE_O) * ea[:, None]).to(dt)
        a_last = tl.exp(tl.load(DA + (b * H + h) * S + c * C + C - 1))
        # dS_c = dL/dS_{c+1}: what the later chunks sent back (zero for the last chunk).
        out = DS + ((b * H + h) * NC + c) * N * P + jj[:, None] * P + pp[None, :]
        tl.store(out, run_lo.to(dt))
        tl.store(out + NH * P, run_hi.to(dt))
        st = STATES + ((b * H + h) * NC + c) * N * P + jj[:, None] * P + pp[None, :]
        part = tl.sum(tl.sum(tl.load(st).to(tl.float32) * run_lo + tl.load(st + NH * P).to(tl.float32) * run_hi, 1), 0)
        tl.store(DDA_WS + ((b * H + h) * NC + c) * tl.num_programs(0) + tile, a_last * part)
        run_lo = a_last * run_lo + tl.dot(tl.trans(qh_lo.to(dt)), dye)
        run_hi = a_last * run_hi + tl.dot(tl.trans(qh_hi.to(dt)), dye)


@triton.jit
def _group(x, C: tl.constexpr, R: tl.constexpr):
    """Per-row values [F] summed over the R ranks of each step: [C]."""
    return tl.sum(tl.reshape(x, (C, R)), 1)


@triton.jit
def _chunk(Q, K, QB, KB, V, PSI, ANG, DA, DAR, DT, TRAP, QKD, SEG, DOUT, PHI, Z, ZETA, DPARAM, STATES, DS,
           DDA_WS, DQ, DK, DV, DANG, DFACTOR, DGAMMA, DDA, DDA_CS, DDA_CS_REV, DSSDA, DPSI_WS, DD_WS,
           S, H, G, NC,
           N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
           BP: tl.constexpr, NT: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
           REDUCE_O: tl.constexpr, STAGES: tl.constexpr):
    F: tl.constexpr = C * R
    NH: tl.constexpr = N // 2
    c, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    dt = Q.dtype.element_ty
    f = tl.arange(0, F)
    t, r = f // R, f % R
    s = c * C + t
    jj = tl.arange(0, NH)
    bh = b * H + h
    row = b * S * R + c * F + f

    # Per-row scalars: gates, decays.
    dtv = tl.load(DT + bh * S + s)
    gamma = dtv * tl.sigmoid(tl.load(TRAP + bh * S + s).to(tl.float32))
    nxt = s + 1
    shifted = tl.load(DT + bh * S + nxt, mask=nxt < S, other=0.0) * \
        tl.sigmoid(-tl.load(TRAP + bh * S + nxt, mask=nxt < S, other=0.0).to(tl.float32))
    factor = gamma + shifted
    ea = tl.exp(tl.load(DA + bh * S + s))
    er = tl.exp(tl.load(DAR + bh * S + s))
    # exp(SEGSUM[t, s]) in (key s, query t) orientation over fused rows, s < t only.
    fc = tl.arange(0, F)
    ts, tt = t[:, None], (fc // R)[None, :]
    decay = tl.where(ts < tt, tl.exp(tl.load(SEG + (bh * NC + c) * C * C + tt * C + ts, mask=ts < tt, other=0.0)), 0.0)
    same = ts == tt
    # Same-step q.k products (biased, before rotary): QKD[(t, o), (t, i)] on the diagonal blocks.
    qkd = tl.load(QKD + ((bh * S + c * C + ts) * R + r[:, None]) * R + (fc % R)[None, :], mask=same, other=0.0)
    qkd = qkd.to(tl.float32)

    # Rotary halves of q_hat, rot(k) and k_hat.
    ang = tl.load(ANG + ((b * S + s[:, None]) * H + h) * NR + jj[None, :], mask=jj[None, :] < NR, other=0.0)
    cos, sin = tl.cos(ang), tl.sin(ang)
    q_lo = tl.load(Q + (row[:, None] * G + g) * N + jj[None, :]).to(tl.float32) + \
        tl.load(QB + (h * R + r[:, None]) * N + jj[None, :])
    q_hi = tl.load(Q + (row[:, None] * G + g) * N + NH + jj[None, :]).to(tl.float32) + \
        tl.load(QB + (h * R + r[:, None]) * N + NH + jj[None, :])
    k_lo = tl.load(K + (row[:, None] * G + g) * N + jj[None, :]).to(tl.float32) + \
        tl.load(KB + (h * R + r[:, None]) * N + jj[None, :])
    k_hi = tl.load(K + (row[:, None] * G + g) * N + NH + jj[None, :]).to(tl.float32) + \
        tl.load(KB + (h * R + r[:, None]) * N + NH + jj[None, :])
    qh_lo, qh_hi = _rot(q_lo, q_hi, cos, sin)
    kr_lo, kr_hi = _rot(k_lo, k_hi, cos, sin)
    kh_lo = (kr_lo * factor[:, None]).to(dt)
    kh_hi = (kr_hi * factor[:, None]).to(dt)
    qh_lo16, qh_hi16 = qh_lo.to(dt), qh_hi.to(dt)
    lkq = tl.dot(kh_lo, tl.trans(qh_lo16)) + tl.dot(kh_hi, tl.trans(qh_hi16))     # k_hat_s . q_hat_t
    lkq_m = (lkq * decay).to(dt)
    diag_t = tl.trans(qkd * gamma[:, None]).to(dt)                                 # dPsiV same-step term

    dkq = tl.zeros((F, F), dtype=tl.float32)            # PsiV_s . dy_t
    dks_lo = tl.zeros((F, NH), dtype=tl.float32)        # PsiV dS^T
    dks_hi = tl.zeros((F, NH), dtype=tl.float32)
    dqs_lo = tl.zeros((F, NH), dtype=tl.float32)        # dy STATES^T
    dqs_hi = tl.zeros((F, NH), dtype=tl.float32)
    dd = 0.0
    if HAS_D:
        dpar = tl.load(DPARAM + h)
    tc = tl.arange(0, C)
    for p0 in tl.range(0, P, BP, num_stages=STAGES):
        pp = p0 + tl.arange(0, BP)
        v = tl.load(V + ((b * S + s[:, None]) * H + h) * P + pp[None, :]).to(tl.float32)
        psi = tl.load(PSI + (h * R + r[:, None]) * P + pp[None, :])
        psiv = v * psi
        dy = _dy_tile(DOUT, PHI, Z, ZETA, b, h, s, r, pp, S, H, R, P, HAS_Z, REDUCE_O)
        dy16, psiv16 = dy.to(dt), psiv.to(dt)
        cell = (bh * NC + c) * N * P + jj[:, None] * P + pp[None, :]
        ds_lo, ds_hi = tl.load(DS + cell), tl.load(DS + cell + NH * P)
        st_lo, st_hi = tl.load(STATES + cell).to(dt), tl.load(STATES + cell + NH * P).to(dt)
        dpsiv = er[:, None] * (tl.dot(kh_lo, ds_lo) + tl.dot(kh_hi, ds_hi)) + tl.dot(lkq_m, dy16) + tl.dot(diag_t, dy16)
        if HAS_D:
            dpsiv += dpar * dy
            dd += tl.sum(tl.sum(dy * psiv, 1), 0)
        dv = tl.sum(tl.reshape(dpsiv * psi, (C, R, BP)), 1)
        tl.store(DV + ((b * S + c * C + tc[:, None]) * H + h) * P + pp[None, :], dv.to(dt))
        dpsi = tl.sum(tl.reshape(dpsiv * v, (C, R, BP)), 0)
        ra = tl.arange(0, R)
        tl.store(DPSI_WS + ((bh * NC + c) * R + ra[:, None]) * P + pp[None, :], dpsi)
        dkq += tl.dot(psiv16, tl.trans(dy16))
        dks_lo += tl.dot(psiv16, tl.trans(ds_lo))
        dks_hi += tl.dot(psiv16, tl.trans(ds_hi))
        dqs_lo += tl.dot(dy16, tl.trans(st_lo))
        dqs_hi += tl.dot(dy16, tl.trans(st_hi))
    if HAS_D:
        tl.store(DD_WS + bh * NC + c, dd)

    per_step = bh * S + c * C + tc
    ssda = tl.sum(tl.sum(tl.reshape(lkq * dkq, (C, R, C, R)), 3), 1)
    tl.store(DSSDA + (bh * NC + c) * C * C + tc[:, None] * C + tc[None, :], ssda)
    dkq_t = tl.trans(dkq)                                   # dy_t . PsiV_s, rows (t, o)
    tl.store(DGAMMA + per_step, _group(tl.sum(qkd * dkq_t, 1), C, R))
    dqk = tl.where(same, dkq_t * gamma[:, None], 0.0).to(dt)  # same-step dL/d(q_{t,o} . k_{t,i})
    tl.store(DDA_CS_REV + per_step, _group(tl.sum(kh_lo.to(tl.float32) * dks_lo + kh_hi.to(tl.float32) * dks_hi, 1), C, R))
    dkq_m = (dkq * decay).to(dt)
    dkh_lo = er[:, None] * dks_lo + tl.dot(dkq_m, qh_lo16)
    dkh_hi = er[:, None] * dks_hi + tl.dot(dkq_m, qh_hi16)
    tl.store(DFACTOR + per_step, _group(tl.sum(kr_lo * dkh_lo + kr_hi * dkh_hi, 1), C, R))
    dkr_lo, dkr_hi = dkh_lo * factor[:, None], dkh_hi * factor[:, None]
    tl.store(DDA_CS + per_step, _group(tl.sum(qh_lo * dqs_lo + qh_hi * dqs_hi, 1), C, R))
    dkq_mt = tl.trans(dkq_m)
    dqh_lo = ea[:, None] * dqs_lo + tl.dot(dkq_mt, kh_lo)
    dqh_hi = ea[:, None] * dqs_hi + tl.dot(dkq_mt, kh_hi)

    # Angle gradient: g0 (-x0 sin - x1 cos) + g1 (x0 cos - x1 sin) per pair, k and q paths, summed over R.
    dang = dkr_lo * (-k_lo * sin - k_hi * cos) + dkr_hi * (k_lo * cos - k_hi * sin) + \
        dqh_lo * (-q_lo * sin - q_hi * cos) + dqh_hi * (q_lo * cos - q_hi * sin)
    dang = tl.sum(tl.reshape(dang, (C, R, NH)), 1)
    tl.store(DANG + ((b * S + c * C + tc[:, None]) * H + h) * NR + jj[None, :], dang, mask=jj[None, :] < NR)
    # DDA on every step of the chunk: exp(a_last) sum(STATES_c dS_c), summed over the scan's tiles.
    nt = tl.arange(0, NT)
    tl.store(DDA + per_step, tl.zeros((C,), dtype=tl.float32) + tl.sum(tl.load(DDA_WS + (bh * NC + c) * NT + nt), 0))

    # DK, DQ: rotary transpose plus the same-step products with the unrotated biased q, k.
    q16 = (q_lo.to(dt), q_hi.to(dt))
    k16 = (k_lo.to(dt), k_hi.to(dt))
    dqk_t = tl.trans(dqk)
    dk_lo = dkr_lo * cos + dkr_hi * sin + tl.dot(dqk_t, q16[0])
    dk_hi = -dkr_lo * sin + dkr_hi * cos + tl.dot(dqk_t, q16[1])
    dq_lo = dqh_lo * cos + dqh_hi * sin + tl.dot(dqk, k16[0])
    dq_hi = -dqh_lo * sin + dqh_hi * cos + tl.dot(dqk, k16[1])
    out = (row[:, None] * H + h) * N + jj[None, :]
    tl.store(DK + out, dk_lo.to(dt))
    tl.store(DK + out + NH, dk_hi.to(dt))
    tl.store(DQ + out, dq_lo.to(dt))
    tl.store(DQ + out + NH, dq_hi.to(dt))


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


def _tiles(config: dict, shape: dict) -> int:
    return (shape["N"] // 2 // config["SCAN_BJ"]) * (shape["P"] // config["SCAN_BP"])


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    why = config_reason(config, shape)
    if why:
        raise ValueError(why)
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    k = _consts(config, shape)
    tiles = _tiles(config, shape)
    work: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        dev = i["Q"].device
        if work.get("dev") != dev:
            dt = i["Q"].dtype
            f32 = {"dtype": torch.float32, "device": dev}
            work.update(dev=dev, ds=torch.empty(B, H, nc, N, P, dtype=dt, device=dev),
                        dda=torch.empty(B, H, nc, tiles, **f32), dpsi=torch.empty(B, H, nc, R, P, **f32),
                        dd=torch.empty(B, H, nc, **f32))
        w = work
        dummy = i["Q"]
        z, zeta = (i["Z"], i["MIMO_Z"]) if shape["hasZ"] else (dummy, i["MIMO_V"])
        dpar = i["D"] if shape["hasD"] else i["MIMO_V"]
        dd_out = o["DD"] if shape["hasD"] else w["dd"]
        _scan[(tiles, H, B)](i["Q"], i["Q_BIAS"], i["ANGLES"], i["DA_CS"], i["DOUT"], i["MIMO_O"], z, zeta,
                             i["STATES"], w["ds"], w["dda"], S, H, G, nc, BJ=config["SCAN_BJ"], BP=config["SCAN_BP"],
                             STAGES=config["scan_stages"], num_warps=config["scan_warps"], **k)
        kern = _chunk[(nc, H, B)](
            i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["V"], i["MIMO_V"], i["ANGLES"], i["DA_CS"], i["DA_CS_REV"],
            i["DT"], i["TRAP"], i["QK_DOT"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, dpar, i["STATES"],
            w["ds"], w["dda"], o["DQ"], o["DK"], o["DV"], o["DANGLES"], o["DFACTOR"], o["DGAMMA_DIAG"],
            o["DDA"], o["DDA_CS"], o["DDA_CS_REV"], o["DSSDA"], w["dpsi"], w["dd"], S, H, G, nc,
            BP=config["BLOCK_P"], NT=tiles, HAS_D=bool(shape["hasD"]), STAGES=config["chunk_stages"],
            num_warps=config["chunk_warps"], **k)
        _reduce[(H, B)](w["dpsi"], w["dd"], o["DMIMO_V"], dd_out, H, nc, R=R, P=P, HAS_D=bool(shape["hasD"]))
        return _common.launch_info(kern)
    return run


def smem_estimate(config: dict, shape: dict, target: str) -> int | None:
    return None


def _signatures(shape: dict) -> dict:
    """Argument types of the three kernels for an ahead-of-time compile."""
    e, f = f"*{_TL[shape['dtype']]}", "*fp32"
    scan = dict(Q=e, QB=f, ANG=f, DA=f, DOUT=e, PHI=f, Z=e, ZETA=f, STATES="*bf16", DS=e, DDA_WS=f,
                S="i32", H="i32", G="i32", NC="i32")
    chunk = dict(Q=e, K=e, QB=f, KB=f, V=e, PSI=f, ANG=f, DA=f, DAR=f, DT=f, TRAP=e, QKD=e, SEG=f, DOUT=e, PHI=f,
                 Z=e, ZETA=f, DPARAM=f, STATES="*bf16", DS=e, DDA_WS=f, DQ=e, DK=e, DV=e, DANG=f, DFACTOR=f,
                 DGAMMA=f, DDA=f, DDA_CS=f, DDA_CS_REV=f, DSSDA=f, DPSI_WS=f, DD_WS=f, S="i32", H="i32", G="i32",
                 NC="i32")
    reduce = dict(DPSI_WS=f, DD_WS=f, DPSI=f, DD=f, H="i32", NC="i32")
    return {"scan": scan, "chunk": chunk, "reduce": reduce}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """The three kernels for ``target`` (no GPU); smem_bytes / registers are the largest of them."""
    config = {**DEFAULTS, **config}
    k, sig = _consts(config, shape), _signatures(shape)
    per = {
        "scan": _common.aot(_scan, sig["scan"], {**k, "BJ": config["SCAN_BJ"], "BP": config["SCAN_BP"],
                                                 "STAGES": config["scan_stages"]}, target, config["scan_warps"]),
        "chunk": _common.aot(_chunk, sig["chunk"], {**k, "BP": config["BLOCK_P"], "NT": _tiles(config, shape),
                                                    "HAS_D": bool(shape["hasD"]), "STAGES": config["chunk_stages"]},
                             target, config["chunk_warps"]),
        "reduce": _common.aot(_reduce, sig["reduce"], {"R": shape["R"], "P": shape["P"], "HAS_D": bool(shape["hasD"])},
                              target, 4),
    }
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] or 0 for v in per.values()) or None,
            "compile_s": sum(v["compile_s"] for v in per.values()), "binary": "cubin", "kernels": per}
