"""cuTile lane for mamba_bwd_bwd (the Mamba-3 MIMO backward kernel "bwd_bwd"; the model, the inputs and
the 12 outputs are defined in lab/problems/_mamba3.py).

The decomposition is the Triton lane's (kernels/triton/mamba_bwd_bwd.py, parity-checked on the H100),
written with cuTile tile operations. Four kernels (five with SCAN_PREP, one more with scan segments),
launched in this order on the current stream:

1. ``_scan``, grid (N/2/SCAN_BJ * P/SCAN_BP, H, B): the only serial dependency. dS_c (N x P, the
   gradient of the state leaving chunk c) walks the chunks last to first in fp32:
   dS_{c-1} = exp(DA_CS_last(c)) dS_c + q_hat_c^T (exp(DA_CS) dy_c). A program owns SCAN_BJ rotary
   pairs (rows j and N/2 + j, so the rotation is elementwise between two tiles) and SCAN_BP columns.
   With SCAN_SEGMENTS = K > 1 the chunks are K ranges walked at once: a local pass (the same kernel,
   grid (tiles * (K-1), H, B)) runs ranges 1..K-1 from dS = 0 and leaves each range's partial dS and
   decay in CARRY [B, H, K, N, P] / DECAY [B, H, K] (fp32); then a program per (tile, range) starts from
   the carry those compose to. 2 nc/K serial steps on K times the programs, for shapes whose B*H and
   dS tiles leave SMs idle. With SCAN_PREP a kernel before it (``_prep``, grid (nc, H, B)) builds the
   scan's operands of every chunk in parallel (below), and the serial loop only loads them.
2. ``_chunk_k``, grid (nc * N/2/KEY_BJ, H, B): the key / query side of one chunk on KEY_BJ rotary pairs.
   Its P loop (KEY_BP columns a step) accumulates PsiV dy^T (F x F, F = C*R fused rows t*R + r),
   PsiV dS^T and dy STATES^T; then DQ, DK and DANGLES of its pairs, and its pairs' parts of the row sums
   over N (DDA_CS_REV, DFACTOR, DDA_CS) and of sum(STATES * dS) (DDA), and (VALUE_QK "load") its pairs'
   q_hat and k_hat.
3. ``_chunk_v``, grid (nc, H, B): the value side. VALUE_QK "load": on the key side's q_hat and k_hat,
   k_hat q_hat^T over N in VALUE_BJ coordinates a step, and k_hat dS in its P loop from KH tiles again.
   "recompute": q_hat and k_hat of the whole N built here once (the key side's rotary and factor, the
   same helpers; lo / hi halves of F x N/2 each, rounded to the input dtype as the key side rounds them,
   held over the P loop), k_hat q_hat^T and k_hat dS one GEMM per half. Then P in BLOCK_P columns:
   dPsiV (DV, per-chunk DMIMO_V and DD partials), PsiV dy^T; then DSSDA, DGAMMA_DIAG and the sums of the
   key side's partials (DDA, DDA_CS, DDA_CS_REV, DFACTOR).
4. ``_reduce``, grid (P/RP, H, B): DMIMO_V (RP = min(P, 32) columns a program) and DD summed over the
   chunks, RB chunks a step (RB * R * RP = 4,096 fp32 at most; deterministic, no atomics).

What crosses global memory between them (the lane allocates it once per device):
  dS            [B, H, nc, N, P] input dtype   scan -> both chunk kernels (the GEMM operand)
  row partials  [B, H, nc, N/2/KEY_BJ, 4, C] fp32   key side -> value side (DDA_CS_REV, DFACTOR, DDA_CS; the
                fourth row only pads the tile to a power of two)
  DDA partials  [B, H, nc, N/2/KEY_BJ] fp32         key side -> value side
  q_hat, k_hat  [B, H, nc, C*R, N] input dtype each  key side -> value side (VALUE_QK "load" only; 537 MB in all
                at the training shape, where Q, K are 8 MB and ANGLES 33 MB)
  DMIMO_V, DD   [B, H, nc, R, P], [B, H, nc] fp32   value side -> reduce
  QS, DY        [B, H, nc, C*R, N], [B, H, nc, C*R, P] input dtype   _prep -> scan, DY also -> chunk kernels
                (SCAN_PREP only; 805 MB in all at the training shape)
cuTile keeps no state on chip across kernels, so these are the temporaries a one-kernel TileLang
design keeps in shared memory; the dS scan is the only part that needs the chunk order.

cuTile specifics. Loads and stores are whole tiles (``ct.load`` / ``ct.store`` at tile indices), so
the fused rows t*R + r of a chunk are the tile (1, C, R, 1, BJ) of Q / K [B, S, R, G, N] reshaped,
the rotary halves are the tiles jb and N/2/BJ + jb of the last axis, and DQ / DK [B, S*R, H, N] take
(1, F, 1, BJ) tiles. The angles [B, S, H, N/rd] are read as BJ-wide tiles with zero padding past
N/rd (cos 1, sin 0: the identity rotation of the non-rotary pairs); a pair block wholly past N/rd
reads a clamped tile and masks it. The shifted gate needs DT / TRAP of the step after each step, which
crosses chunks: it is a ``ct.gather`` (zero past S, as the model defines). GEMM operands are in the
input dtype (bf16 / fp16) with fp32 accumulation (``ct.mma``), as upstream; elementwise math and every
partial are fp32.

Tunables (sweeps/mamba_bwd_bwd/cutile.toml):
  SCAN_BJ, SCAN_BP     dS tile of one scan program: SCAN_BJ rotary pairs x SCAN_BP columns
  SCAN_SEGMENTS        chunk ranges the scan walks at once (above; the largest divisor of nc up to it)
  SCAN_PREP            a kernel before the scan, grid (nc, H, B), builds the scan's operands of every chunk
                       at once: q_hat scaled by exp(DA_CS) (QS [B, H, nc, C*R, N]) and dy (DY [B, H, nc,
                       C*R, P]), input dtype; the scan's serial loop then loads two tiles a step instead
                       of rotating q and gating dy on its chain (cos / sin, sigmoid, the rank broadcasts),
                       and the key and value sides' P loops load dy instead of building it (the GEMM
                       operands are the same bf16 / fp16 values either way; the value side's D terms, DD
                       and D dy in DV, then take dy rounded to them too)
  KEY_BJ, KEY_BP       rotary pairs per key-side program; P columns per step of its P loop
  VALUE_BJ, BLOCK_P    pairs per step of the value side's N loops ("load" only); P columns per step of its
                       P loop
  VALUE_QK             "load": the value side reads QH / KH, which the key side writes; "recompute": it builds
                       q_hat, k_hat from Q, K, the biases, ANGLES, DT, TRAP (above) and nothing writes QH / KH
  occupancy            CTAs per SM tileiras compiles every kernel for (0: its choice)
  prep_occupancy       CTAs per SM for _prep alone (0: ``occupancy``); _prep streams ~40 KB a program
                       and does no GEMM, so it may want more CTAs resident than the chunk kernels
  num_worker_warps     warps of the compute warp group (0: tileiras' choice; cuda-tile 1.7.0 writes
                       TileIR 13.4, where only 4 and 8 exist)

Read for the API (no code copied): cuda-tile 1.7.0 ``cuda/tile/_stub.py`` docstrings (load / store with
``order`` and padding, gather, mma, reshape, broadcast_to, reductions), and this lab's
kernels/cutile/gemm.py and m2rnn_fwd.py (AOT export, array constraints, resources).
"""
from __future__ import annotations

import time

import torch
import cuda.tile as ct

from kernels import _targets
from kernels.cutile.gemm import (ARCHS, _gpu_code, _launch_info, array_constraint, cubin_resources, eligibility,
                                 export_cubin)
from kernels.cutile.gemm import versions  # noqa: F401  (the lane interface)
from lab.problems import _mamba3 as m3

DSL = "cutile"
KERNEL = "mamba_bwd_bwd"
TUNABLES = ("SCAN_BJ", "SCAN_BP", "SCAN_SEGMENTS", "SCAN_PREP", "KEY_BJ", "KEY_BP", "VALUE_BJ", "BLOCK_P",
            "occupancy", "num_worker_warps", "prep_occupancy", "VALUE_QK")
DEFAULTS = {"SCAN_BJ": 16, "SCAN_BP": 32, "SCAN_SEGMENTS": 1, "SCAN_PREP": False, "KEY_BJ": 16, "KEY_BP": 32,
            "VALUE_BJ": 16, "BLOCK_P": 32, "occupancy": 0, "num_worker_warps": 0, "prep_occupancy": 0,
            "VALUE_QK": "load"}
VALUE_QK = ("load", "recompute")
TARGETS = tuple(f"sm_{a}a" if a >= 90 else f"sm_{a}" for a in ARCHS)
DTYPES = ("bfloat16", "float16")
KERNELS = ("scan", "key", "value", "reduce")


def _segments(config: dict, shape: dict) -> int:
    """Ranges the scan walks at once: the largest divisor of the chunk count that is at most SCAN_SEGMENTS."""
    nc = shape["S"] // shape["C"]
    return max(k for k in range(1, config["SCAN_SEGMENTS"] + 1) if nc % k == 0)


_REDUCE_ELEMS = 4096


def _reduce_blocks(shape: dict) -> tuple:
    """(RP, RB) of _reduce: P columns per program and chunks per step. A step loads an (RB, R, RP) block of
    _REDUCE_ELEMS fp32 (16 KB) at most: enough loads in flight to hide the latency of the chunk walk (one
    (R, P) tile a step was latency-bound) in a modest register footprint; RP = 32 gives P/32 programs per
    (b, h) (B*H is 32 at anchor_b2 and h100_tuned, far below the SM count)."""
    nc = shape["S"] // shape["C"]
    rp = min(shape["P"], 32)
    return rp, max(1, min(1 << (nc - 1).bit_length(), _REDUCE_ELEMS // (shape["R"] * rp)))


def _kernel_names(config: dict, shape: dict) -> tuple:
    """The kernels a config launches, in order: the scan's operand kernel only with SCAN_PREP, the local
    scan pass only with segments."""
    return (("prep",) if config["SCAN_PREP"] else ()) + (("scan_local",) if _segments(config, shape) > 1 else ()) \
        + KERNELS

K_ = ct.Constant[int]
B_ = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


# --------------------------------------------------------------------------------------------
# tile helpers (inlined into the kernels)


def _rows(x, C, R):
    """[C] per-step values -> [F, 1] per fused row t*R + r."""
    return ct.reshape(ct.broadcast_to(ct.reshape(x, (C, 1)), (C, R)), (C * R, 1))


def _group(x, C, R):
    """[F] per-row values summed over the R ranks of each step: [C]."""
    return ct.sum(ct.reshape(x, (C, R)), axis=1)


def _steps(X, b, h, c, C):
    """Chunk c of a [B, H, S] tensor: [C] fp32."""
    return ct.reshape(ct.load(X, (b, h, c), (1, 1, C)), (C,)).astype(ct.float32)


def _fuse(X, W, b, h, c, pb, C, R, BP):
    """[B, S, H, P] rows of chunk c times [H, R, P] per-rank weights, columns block pb: [F, BP] fp32."""
    x = ct.reshape(ct.load(X, (b, c, h, pb), (1, C, 1, BP)), (C, 1, BP)).astype(ct.float32)
    w = ct.load(W, (h, 0, pb), (1, R, BP)).astype(ct.float32)
    return ct.reshape(x * w, (C * R, BP))


def _dy(DOUT, PHI, Z, ZETA, b, h, c, pb, C, R, BP, HAS_Z, REDUCE_O):
    """dL/dy of chunk c's fused rows, columns block pb: [F, BP] fp32."""
    if REDUCE_O:
        d = _fuse(DOUT, PHI, b, h, c, pb, C, R, BP)
    else:
        d = ct.reshape(ct.load(DOUT, (b, c, 0, h, pb), (1, C, R, 1, BP)), (C * R, BP)).astype(ct.float32)
    if HAS_Z:
        zz = _fuse(Z, ZETA, b, h, c, pb, C, R, BP)
        d = d * zz / (1.0 + ct.exp(-zz))
    return d


def _half(X, XB, b, c, g, h, jb, C, R, BJ):
    """Biased q or k (X [B, S, R, G, N], XB [H, R, N]) of chunk c on the pair-block tile jb: [F, BJ] fp32."""
    x = ct.reshape(ct.load(X, (b, c, 0, g, jb), (1, C, R, 1, BJ)), (C, R, BJ)).astype(ct.float32)
    bias = ct.load(XB, (h, 0, jb), (1, R, BJ)).astype(ct.float32)
    return ct.reshape(x + bias, (C * R, BJ))


def _angles(ANG, b, c, h, jb, C, R, BJ, NR):
    """cos, sin [F, BJ] of the pairs jb*BJ .. jb*BJ + BJ - 1 (angle 0 past NR)."""
    last = (NR - 1) // BJ
    a = ct.reshape(ct.load(ANG, (b, c, h, min(jb, last)), (1, C, 1, BJ), padding_mode=ZERO), (C, 1, BJ))
    jj = ct.reshape(ct.arange(BJ, dtype=ct.int32) + jb * BJ, (1, 1, BJ))
    a = ct.where(jj < NR, a, 0.0)
    # cos / sin once per step, then broadcast over the R ranks (the precise versions are costly).
    return (ct.reshape(ct.broadcast_to(ct.cos(a), (C, R, BJ)), (C * R, BJ)),
            ct.reshape(ct.broadcast_to(ct.sin(a), (C, R, BJ)), (C * R, BJ)))


def _rot(lo, hi, cos, sin):
    return lo * cos - hi * sin, lo * sin + hi * cos


def _rotated(X, XB, cos, sin, b, c, g, h, jb, NHB, C, R, BJ):
    """Biased q or k of pair block jb (of NHB) and its rotation: lo, hi, rotated lo, rotated hi, [F, BJ] fp32."""
    lo = _half(X, XB, b, c, g, h, jb, C, R, BJ)
    hi = _half(X, XB, b, c, g, h, NHB + jb, C, R, BJ)
    return (lo, hi) + _rot(lo, hi, cos, sin)


def _gates(DT, TRAP, DAR, b, h, c, C, R):
    """gamma, factor and exp(DA_CS_REV) per fused row: [F, 1] fp32 each."""
    dt = _steps(DT, b, h, c, C)
    gamma = dt / (1.0 + ct.exp(-_steps(TRAP, b, h, c, C)))
    nxt = ct.arange(C, dtype=ct.int32) + (c * C + 1)
    # The step after each step (it crosses into the next chunk); zero past S, as the model defines.
    dt_n = ct.gather(DT, (b, h, nxt)).astype(ct.float32)
    trap_n = ct.gather(TRAP, (b, h, nxt)).astype(ct.float32)
    factor = gamma + dt_n / (1.0 + ct.exp(trap_n))
    return _rows(gamma, C, R), _rows(factor, C, R), _rows(ct.exp(_steps(DAR, b, h, c, C)), C, R)


def _expand(x, C, R):
    """[C, C] per step pair -> [F, F] over fused rows and columns."""
    return ct.reshape(ct.broadcast_to(ct.reshape(x, (C, 1, C, 1)), (C, R, C, R)), (C * R, C * R))


def _decay(SEG, b, h, c, C, R):
    """exp(SEGSUM[t, s]) in (key s, query t) orientation, s < t only, over fused rows: [F, F] fp32."""
    seg = ct.reshape(ct.load(SEG, (b, h, c, 0, 0), (1, 1, 1, C, C), order=(0, 1, 2, 4, 3)), (C, C))
    ts = ct.reshape(ct.arange(C, dtype=ct.int32), (C, 1))
    tt = ct.reshape(ct.arange(C, dtype=ct.int32), (1, C))
    return _expand(ct.where(ts < tt, ct.exp(seg.astype(ct.float32)), 0.0), C, R)


def _same(C, R):
    """[F, F] mask of the same-step (block-diagonal R x R) entries."""
    f = ct.arange(C * R, dtype=ct.int32) // R
    return ct.reshape(f, (C * R, 1)) == ct.reshape(f, (1, C * R))


def _hat(X, b, h, c, jt, F, BJ):
    """Columns jt*BJ .. jt*BJ + BJ - 1 of chunk c of q_hat or k_hat [B, H, nc, F, N]: [F, BJ]."""
    return ct.reshape(ct.load(X, (b, h, c, 0, jt), (1, 1, 1, F, BJ)), (F, BJ))


def _cell(X, b, h, c, jb, pb, BJ, BP):
    """Tile (jb, pb) of chunk c of a [B, H, nc, N, P] state tensor: [BJ, BP]."""
    return ct.reshape(ct.load(X, (b, h, c, jb, pb), (1, 1, 1, BJ, BP)), (BJ, BP))


# --------------------------------------------------------------------------------------------
# kernels


def _prep(Q, QB, ANG, DA, DOUT, PHI, Z, ZETA, QS, DY,
          HG: K_, N: K_, P: K_, R: K_, C: K_, NR: K_, BJ: K_, BP: K_, HAS_Z: B_, REDUCE_O: B_):
    """The scan's operands of chunk c, off its serial chain: q_hat * exp(DA_CS) per fused row into QS and
    dy into DY (both [B, H, nc, F, *], input dtype)."""
    NHB = N // 2 // BJ
    c = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    g = h // HG
    F = C * R
    dt = Q.dtype
    e = _rows(ct.exp(_steps(DA, b, h, c, C)), C, R)
    for jb in range(NHB):
        cos, sin = _angles(ANG, b, c, h, jb, C, R, BJ, NR)
        _, _, lo, hi = _rotated(Q, QB, cos, sin, b, c, g, h, jb, NHB, C, R, BJ)
        ct.store(QS, (b, h, c, 0, jb), ct.reshape((lo * e).astype(dt), (1, 1, 1, F, BJ)))
        ct.store(QS, (b, h, c, 0, NHB + jb), ct.reshape((hi * e).astype(dt), (1, 1, 1, F, BJ)))
    for pb in range(P // BP):
        dy = _dy(DOUT, PHI, Z, ZETA, b, h, c, pb, C, R, BP, HAS_Z, REDUCE_O)
        ct.store(DY, (b, h, c, 0, pb), ct.reshape(dy.astype(dt), (1, 1, 1, F, BP)))


def _scan(Q, QB, ANG, DA, DOUT, PHI, Z, ZETA, QS, DY, DS, CARRY, DECAY,
          HG: K_, N: K_, P: K_, R: K_, C: K_, NR: K_, BJ: K_, BP: K_, HAS_Z: B_, REDUCE_O: B_, SEGS: K_,
          LOCAL: B_, PREP: B_):
    """dS_c for every chunk c (the gradient of the state leaving chunk c; zero for the last), in SEGS
    ranges of NC / SEGS chunks, a program per (tile, range). LOCAL: ranges 1..SEGS-1 from dS = 0, no dS
    written; each leaves its partial dS in CARRY[:, :, k] and its decay (the product of its chunks'
    exp(DA_CS at the last step)) in DECAY[:, :, k]. Else range k starts from the carry those compose to:
    carry_k = CARRY_{k+1} + DECAY_{k+1} carry_{k+1}, carry_{SEGS-1} = 0 (the recurrence is linear).
    PREP: the operands are _prep's QS / DY tiles; else built here from Q, ANG, DOUT, Z."""
    F = C * R
    NHB = N // 2 // BJ
    NPB = P // BP
    NC = Q.shape[1] // C
    L = NC // SEGS
    tiles = NHB * NPB
    tile = ct.bid(0) % tiles
    seg = ct.bid(0) // tiles
    if LOCAL:
        seg = seg + 1
    h = ct.bid(1)
    b = ct.bid(2)
    jb = tile // NPB
    pb = tile % NPB
    g = h // HG
    dt = Q.dtype
    run_lo = ct.zeros((BJ, BP), dtype=ct.float32)
    run_hi = ct.zeros((BJ, BP), dtype=ct.float32)
    decay = ct.full((1,), 1.0, dtype=ct.float32)
    if not LOCAL:
        for jj in range(SEGS - 1 - seg):
            j = SEGS - 1 - jj
            a = ct.gather(DECAY, (b, h, j))
            run_lo = a * run_lo + _cell(CARRY, b, h, j, jb, pb, BJ, BP)
            run_hi = a * run_hi + _cell(CARRY, b, h, j, NHB + jb, pb, BJ, BP)
    for i in range(L):
        c = (seg + 1) * L - 1 - i
        if not LOCAL:
            ct.store(DS, (b, h, c, jb, pb), ct.reshape(run_lo, (1, 1, 1, BJ, BP)).astype(DS.dtype))
            ct.store(DS, (b, h, c, NHB + jb, pb), ct.reshape(run_hi, (1, 1, 1, BJ, BP)).astype(DS.dtype))
        if PREP:
            qh_lo = _hat(QS, b, h, c, jb, F, BJ)
            qh_hi = _hat(QS, b, h, c, NHB + jb, F, BJ)
            dye = _hat(DY, b, h, c, pb, F, BP)
        else:
            cos, sin = _angles(ANG, b, c, h, jb, C, R, BJ, NR)
            _, _, lo, hi = _rotated(Q, QB, cos, sin, b, c, g, h, jb, NHB, C, R, BJ)
            qh_lo, qh_hi = lo.astype(dt), hi.astype(dt)
            e = _rows(ct.exp(_steps(DA, b, h, c, C)), C, R)
            dye = (_dy(DOUT, PHI, Z, ZETA, b, h, c, pb, C, R, BP, HAS_Z, REDUCE_O) * e).astype(dt)
        a_last = ct.exp(ct.gather(DA, (b, h, c * C + C - 1)))
        decay = decay * a_last
        run_lo = ct.mma(ct.transpose(qh_lo), dye, a_last * run_lo)
        run_hi = ct.mma(ct.transpose(qh_hi), dye, a_last * run_hi)
    if LOCAL:
        ct.store(CARRY, (b, h, seg, jb, pb), ct.reshape(run_lo, (1, 1, 1, BJ, BP)))
        ct.store(CARRY, (b, h, seg, NHB + jb, pb), ct.reshape(run_hi, (1, 1, 1, BJ, BP)))
        ct.store(DECAY, (b, h, seg), ct.reshape(decay, (1, 1, 1)))   # the same value from every tile


def _chunk_k(Q, K, QB, KB, V, PSI, ANG, DA, DAR, DT, TRAP, SEG, DOUT, PHI, Z, ZETA, DY, STATES, DS,
             DQ, DK, DANG, ROW_WS, DDA_WS, QH, KH,
             HG: K_, N: K_, P: K_, R: K_, C: K_, NR: K_, BJ: K_, BP: K_, HAS_Z: B_, REDUCE_O: B_, PREP: B_,
             STORE_HAT: B_):
    """Key / query side of one chunk on BJ rotary pairs; with STORE_HAT also writes its pairs' q_hat, k_hat
    (input dtype) to QH, KH [B, H, nc, F, N] for the value side (VALUE_QK "load")."""
    F = C * R
    NHB = N // 2 // BJ
    pid = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    c = pid // NHB
    jb = pid % NHB
    g = h // HG
    dt = Q.dtype
    dkq = ct.zeros((F, F), dtype=ct.float32)          # PsiV_s . dy_t
    dks_lo = ct.zeros((F, BJ), dtype=ct.float32)      # PsiV dS^T
    dks_hi = ct.zeros((F, BJ), dtype=ct.float32)
    dqs_lo = ct.zeros((F, BJ), dtype=ct.float32)      # dy STATES^T
    dqs_hi = ct.zeros((F, BJ), dtype=ct.float32)
    dda = ct.zeros((BJ, BP), dtype=ct.float32)        # STATES * dS, summed at the end
    for pb in range(P // BP):
        psiv = _fuse(V, PSI, b, h, c, pb, C, R, BP).astype(dt)
        if PREP:
            dy16 = _hat(DY, b, h, c, pb, F, BP)
        else:
            dy16 = _dy(DOUT, PHI, Z, ZETA, b, h, c, pb, C, R, BP, HAS_Z, REDUCE_O).astype(dt)
        ds_lo = _cell(DS, b, h, c, jb, pb, BJ, BP)
        ds_hi = _cell(DS, b, h, c, NHB + jb, pb, BJ, BP)
        st_lo = _cell(STATES, b, h, c, jb, pb, BJ, BP)
        st_hi = _cell(STATES, b, h, c, NHB + jb, pb, BJ, BP)
        dda = dda + st_lo.astype(ct.float32) * ds_lo.astype(ct.float32) + \
            st_hi.astype(ct.float32) * ds_hi.astype(ct.float32)
        dkq = ct.mma(psiv, ct.transpose(dy16), dkq)
        dks_lo = ct.mma(psiv, ct.transpose(ds_lo.astype(dt)), dks_lo)
        dks_hi = ct.mma(psiv, ct.transpose(ds_hi.astype(dt)), dks_hi)
        dqs_lo = ct.mma(dy16, ct.transpose(st_lo.astype(dt)), dqs_lo)
        dqs_hi = ct.mma(dy16, ct.transpose(st_hi.astype(dt)), dqs_hi)
    a_last = ct.exp(ct.gather(DA, (b, h, c * C + C - 1)))
    ct.store(DDA_WS, (b, h, c, jb), ct.reshape(a_last * ct.sum(dda), (1, 1, 1, 1)))

    gamma, factor, er = _gates(DT, TRAP, DAR, b, h, c, C, R)
    dqk = ct.where(_same(C, R), ct.transpose(dkq) * gamma, 0.0).astype(dt)   # same-step dL/d(q_{t,o}.k_{t,i})
    dkq_m = (dkq * _decay(SEG, b, h, c, C, R)).astype(dt)
    cos, sin = _angles(ANG, b, c, h, jb, C, R, BJ, NR)
    q_lo, q_hi, qh_lo, qh_hi = _rotated(Q, QB, cos, sin, b, c, g, h, jb, NHB, C, R, BJ)
    k_lo, k_hi, kr_lo, kr_hi = _rotated(K, KB, cos, sin, b, c, g, h, jb, NHB, C, R, BJ)
    kh_lo = (kr_lo * factor).astype(dt)
    kh_hi = (kr_hi * factor).astype(dt)
    if STORE_HAT:
        ct.store(QH, (b, h, c, 0, jb), ct.reshape(qh_lo.astype(dt), (1, 1, 1, F, BJ)))
        ct.store(QH, (b, h, c, 0, NHB + jb), ct.reshape(qh_hi.astype(dt), (1, 1, 1, F, BJ)))
        ct.store(KH, (b, h, c, 0, jb), ct.reshape(kh_lo, (1, 1, 1, F, BJ)))
        ct.store(KH, (b, h, c, 0, NHB + jb), ct.reshape(kh_hi, (1, 1, 1, F, BJ)))

    # Row sums over this program's pairs, [3, C] per (chunk, pair block): DDA_CS_REV, DFACTOR, DDA_CS.
    rev = _group(ct.sum(kh_lo.astype(ct.float32) * dks_lo + kh_hi.astype(ct.float32) * dks_hi, axis=1), C, R)
    ct.store(ROW_WS, (b, h, c, jb, 0, 0), ct.reshape(rev, (1, 1, 1, 1, 1, C)))
    dkh_lo = ct.mma(dkq_m, qh_lo.astype(dt), er * dks_lo)
    dkh_hi = ct.mma(dkq_m, qh_hi.astype(dt), er * dks_hi)
    fac = _group(ct.sum(kr_lo * dkh_lo + kr_hi * dkh_hi, axis=1), C, R)
    ct.store(ROW_WS, (b, h, c, jb, 1, 0), ct.reshape(fac, (1, 1, 1, 1, 1, C)))
    dkr_lo = dkh_lo * factor
    dkr_hi = dkh_hi * factor
    cs = _group(ct.sum(qh_lo * dqs_lo + qh_hi * dqs_hi, axis=1), C, R)
    ct.store(ROW_WS, (b, h, c, jb, 2, 0), ct.reshape(cs, (1, 1, 1, 1, 1, C)))
    ea = _rows(ct.exp(_steps(DA, b, h, c, C)), C, R)
    dkq_mt = ct.transpose(dkq_m)
    dqh_lo = ct.mma(dkq_mt, kh_lo, ea * dqs_lo)
    dqh_hi = ct.mma(dkq_mt, kh_hi, ea * dqs_hi)

    # Angle gradient of the pairs (k and q paths, summed over the ranks); a block wholly past NR has none.
    dang = dkr_lo * (-k_lo * sin - k_hi * cos) + dkr_hi * (k_lo * cos - k_hi * sin) + \
        dqh_lo * (-q_lo * sin - q_hi * cos) + dqh_hi * (q_lo * cos - q_hi * sin)
    dang = ct.sum(ct.reshape(dang, (C, R, BJ)), axis=1)
    if jb * BJ < NR:
        ct.store(DANG, (b, c, h, jb), ct.reshape(dang, (1, C, 1, BJ)))

    # DK, DQ: the rotary transpose plus the same-step products with the unrotated biased q, k.
    dqk_t = ct.transpose(dqk)
    dk_lo = ct.mma(dqk_t, q_lo.astype(dt), dkr_lo * cos + dkr_hi * sin)
    dk_hi = ct.mma(dqk_t, q_hi.astype(dt), dkr_hi * cos - dkr_lo * sin)
    dq_lo = ct.mma(dqk, k_lo.astype(dt), dqh_lo * cos + dqh_hi * sin)
    dq_hi = ct.mma(dqk, k_hi.astype(dt), dqh_hi * cos - dqh_lo * sin)
    ct.store(DK, (b, c, h, jb), ct.reshape(dk_lo, (1, F, 1, BJ)).astype(DK.dtype))
    ct.store(DK, (b, c, h, NHB + jb), ct.reshape(dk_hi, (1, F, 1, BJ)).astype(DK.dtype))
    ct.store(DQ, (b, c, h, jb), ct.reshape(dq_lo, (1, F, 1, BJ)).astype(DQ.dtype))
    ct.store(DQ, (b, c, h, NHB + jb), ct.reshape(dq_hi, (1, F, 1, BJ)).astype(DQ.dtype))


def _chunk_v(Q, K, QB, KB, ANG, QH, KH, V, PSI, DAR, DT, TRAP, QKD, SEG, DOUT, PHI, Z, ZETA, DY, DPARAM, DS,
             ROW_WS, DDA_WS, DV, DFACTOR, DGAMMA, DDA, DDA_CS, DDA_CS_REV, DSSDA, DPSI_WS, DD_WS,
             HG: K_, N: K_, P: K_, R: K_, C: K_, NR: K_, BJ: K_, BP: K_, NKB: K_, HAS_Z: B_, HAS_D: B_,
             REDUCE_O: B_, PREP: B_, RECOMPUTE: B_):
    """Value side of one chunk (NKB: the key side's pair blocks, whose partials it sums). q_hat and k_hat
    are the key side's QH, KH, or with RECOMPUTE built here from Q, K, ANG, DT, TRAP (Q, K, QB, KB, ANG
    are read only then, QH, KH only without it)."""
    F = C * R
    NH = N // 2
    NHB = NH // BJ
    c = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    dt = Q.dtype
    gamma, factor, er = _gates(DT, TRAP, DAR, b, h, c, C, R)
    # Same-step q.k products (biased, before rotary) as a block-diagonal [F, F]: [(t, o), (t, i)].
    qkd = ct.reshape(ct.load(QKD, (b, h, c, 0, 0), (1, 1, C, R, R)), (C, R, 1, R)).astype(ct.float32)
    tc = ct.arange(C, dtype=ct.int32)
    eye = ct.reshape(tc, (C, 1, 1, 1)) == ct.reshape(tc, (1, 1, C, 1))
    diag = ct.reshape(ct.where(ct.broadcast_to(eye, (C, R, C, R)), ct.broadcast_to(qkd, (C, R, C, R)), 0.0),
                      (F, F))
    diag_t = ct.transpose(diag * gamma).astype(dt)

    lkq = ct.zeros((F, F), dtype=ct.float32)          # k_hat_s . q_hat_t over N
    if RECOMPUTE:
        # The whole N as one pair block: lo / hi halves [F, N/2], rounded as the key side rounds them, held
        # over the P loop (one rotary per program).
        cos, sin = _angles(ANG, b, c, h, 0, C, R, NH, NR)
        _, _, qh_lo, qh_hi = _rotated(Q, QB, cos, sin, b, c, h // HG, h, 0, 1, C, R, NH)
        _, _, kr_lo, kr_hi = _rotated(K, KB, cos, sin, b, c, h // HG, h, 0, 1, C, R, NH)
        qh_lo, qh_hi = qh_lo.astype(dt), qh_hi.astype(dt)
        kh_lo, kh_hi = (kr_lo * factor).astype(dt), (kr_hi * factor).astype(dt)
        lkq = ct.mma(kh_hi, ct.transpose(qh_hi), ct.mma(kh_lo, ct.transpose(qh_lo), lkq))
    else:   # BJ coordinates at a time
        for jt in range(2 * NHB):
            lkq = ct.mma(_hat(KH, b, h, c, jt, F, BJ), ct.transpose(_hat(QH, b, h, c, jt, F, BJ)), lkq)
    lkq_m = (lkq * _decay(SEG, b, h, c, C, R)).astype(dt)

    dkq = ct.zeros((F, F), dtype=ct.float32)          # PsiV_s . dy_t
    dd = ct.zeros((F, BP), dtype=ct.float32)
    dpar = ct.gather(DPARAM, h).astype(ct.float32)
    for pb in range(P // BP):
        v = ct.reshape(ct.load(V, (b, c, h, pb), (1, C, 1, BP)), (C, 1, BP)).astype(ct.float32)
        psi = ct.load(PSI, (h, 0, pb), (1, R, BP)).astype(ct.float32)
        psiv = ct.reshape(v * psi, (F, BP))
        if PREP:   # _prep's dy, in the input dtype (the D terms below then take it rounded, as the GEMMs do)
            dy16 = _hat(DY, b, h, c, pb, F, BP)
            dy = dy16.astype(ct.float32)
        else:
            dy = _dy(DOUT, PHI, Z, ZETA, b, h, c, pb, C, R, BP, HAS_Z, REDUCE_O)
            dy16 = dy.astype(dt)
        khds = ct.zeros((F, BP), dtype=ct.float32)    # k_hat dS_c over N
        if RECOMPUTE:
            khds = ct.mma(kh_lo, _cell(DS, b, h, c, 0, pb, NH, BP).astype(dt), khds)
            khds = ct.mma(kh_hi, _cell(DS, b, h, c, 1, pb, NH, BP).astype(dt), khds)
        else:   # BJ coordinates at a time
            for jt in range(2 * NHB):
                khds = ct.mma(_hat(KH, b, h, c, jt, F, BJ), _cell(DS, b, h, c, jt, pb, BJ, BP).astype(dt), khds)
        dpsiv = ct.mma(diag_t, dy16, ct.mma(lkq_m, dy16, er * khds))
        if HAS_D:
            dpsiv = dpsiv + dpar * dy
            dd = dd + dy * psiv
        d3 = ct.reshape(dpsiv, (C, R, BP))
        dv = ct.sum(d3 * psi, axis=1)
        ct.store(DV, (b, c, h, pb), ct.reshape(dv, (1, C, 1, BP)).astype(DV.dtype))
        ct.store(DPSI_WS, (b, h, c, 0, pb), ct.reshape(ct.sum(d3 * v, axis=0), (1, 1, 1, R, BP)))
        dkq = ct.mma(psiv.astype(dt), ct.transpose(dy16), dkq)
    if HAS_D:
        ct.store(DD_WS, (b, h, c), ct.reshape(ct.sum(dd), (1, 1, 1)))

    ssda = ct.sum(ct.sum(ct.reshape(lkq * dkq, (C, R, C, R)), axis=3), axis=1)
    ct.store(DSSDA, (b, h, c, 0, 0), ct.reshape(ssda, (1, 1, 1, C, C)))
    dg = _group(ct.sum(diag * ct.transpose(dkq), axis=1), C, R)
    ct.store(DGAMMA, (b, h, c), ct.reshape(dg, (1, 1, C)))
    # DDA on every step of the chunk, and the row sums over the key side's pair blocks.
    dda = ct.sum(ct.load(DDA_WS, (b, h, c, 0), (1, 1, 1, NKB)))
    ct.store(DDA, (b, h, c), ct.broadcast_to(ct.reshape(dda, (1, 1, 1)), (1, 1, C)))
    rows = ct.sum(ct.reshape(ct.load(ROW_WS, (b, h, c, 0, 0, 0), (1, 1, 1, NKB, 4, C), padding_mode=ZERO),
                             (NKB, 4, C)), axis=0)
    ct.store(DDA_CS_REV, (b, h, c), ct.reshape(ct.extract(rows, (0, 0), (1, C)), (1, 1, C)))
    ct.store(DFACTOR, (b, h, c), ct.reshape(ct.extract(rows, (1, 0), (1, C)), (1, 1, C)))
    ct.store(DDA_CS, (b, h, c), ct.reshape(ct.extract(rows, (2, 0), (1, C)), (1, 1, C)))


def _reduce(DPSI_WS, DD_WS, DPSI, DD, R: K_, RP: K_, RB: K_, HAS_D: B_):
    """DMIMO_V columns block pb (RP wide) of (b, h), and DD in the pb = 0 program: the per-chunk partials
    summed elementwise RB chunks a step (zero past nc), then over the RB rows once (a fixed order: no
    atomics, deterministic)."""
    pb = ct.bid(0)
    h = ct.bid(1)
    b = ct.bid(2)
    NC = DD_WS.shape[2]
    acc = ct.zeros((1, 1, RB, R, RP), dtype=ct.float32)
    dd = ct.zeros((1, 1, RB), dtype=ct.float32)
    # Plain loads: with TMA, tileiras staged 85-137 KB of shared memory for this stream (cuda-tile 1.7.0).
    for cb in range((NC + RB - 1) // RB):
        acc = acc + ct.load(DPSI_WS, (b, h, cb, 0, pb), (1, 1, RB, R, RP), padding_mode=ZERO, allow_tma=False)
        if HAS_D:
            dd = dd + ct.load(DD_WS, (b, h, cb), (1, 1, RB), padding_mode=ZERO, allow_tma=False)
    ct.store(DPSI, (b, h, 0, pb), ct.reshape(ct.sum(ct.reshape(acc, (RB, R, RP)), axis=0), (1, 1, R, RP)))
    if HAS_D:
        if pb == 0:
            ct.store(DD, (b, h), ct.reshape(ct.sum(dd), (1, 1)))


_BODIES = {"prep": _prep, "scan_local": _scan, "scan": _scan, "key": _chunk_k, "value": _chunk_v, "reduce": _reduce}
_KERNELS: dict = {}


def _kernel(name: str, config: dict):
    hints = {k: config[k] or None for k in ("num_worker_warps", "occupancy")}
    if name == "prep" and config["prep_occupancy"]:
        hints["occupancy"] = config["prep_occupancy"]
    hints = tuple(hints.items())
    key = (name, hints)
    if key not in _KERNELS:
        _KERNELS[key] = ct.kernel(_BODIES[name], **dict(hints))
    return _KERNELS[key]


# --------------------------------------------------------------------------------------------
# rules


def _pow2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and not v & (v - 1)


def config_reason(config: dict, shape: dict) -> str | None:
    """Shapes the lane cannot take and configs that do not divide the shape (typed, never computed)."""
    c = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    N, P, C, R = shape["N"], shape["P"], shape["C"], shape["R"]
    nh, F = N // 2, C * R
    if not (_pow2(nh) and nh >= 16):
        return f"N={N}: the lane needs N/2 a power of two >= 16 (cuTile tile sides; ct.mma contracts over rotary halves)"
    if not (_pow2(C) and _pow2(F) and F >= 16):
        return f"C={C}, R={R}: the lane needs C and C*R powers of two with C*R >= 16 (cuTile tile sides, ct.mma sizes)"
    if not (_pow2(P) and P >= 16):
        return f"P={P}: the lane needs P a power of two >= 16"
    if c["VALUE_QK"] not in VALUE_QK:
        return f"VALUE_QK={c['VALUE_QK']!r} must be one of {', '.join(VALUE_QK)}"
    for key, dim, name in (("SCAN_BJ", nh, "N/2"), ("SCAN_BP", P, "P"), ("KEY_BJ", nh, "N/2"), ("KEY_BP", P, "P"),
                           ("VALUE_BJ", nh, "N/2"), ("BLOCK_P", P, "P")):
        v = c[key]
        if not (_pow2(v) and 16 <= v <= dim):
            return f"{key}={v} must be a power of two in [16, {name}={dim}]"
    # The values each knob may take are the sweep file's (sweeps/mamba_bwd_bwd/cutile.toml); the harness checks them.
    B, S, H, G, _, _, _, _, nc, _ = m3.dims(shape)
    if max(B * H * nc * N * P, B * S * R * H * max(N, P), B * H * nc * C * C) >= 2**31:
        return "arrays of 2^31 or more elements need int64 indexing, which this lane does not specialize"
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int | None:
    """Shared memory per CTA, bytes: an upper bound, the target's opt-in per-block limit.

    tileiras, not the kernel, decides what goes through shared memory (layout conversions between the
    mma fragments and the elementwise tiles, transposed operands, load staging) and sizes it to the
    target, as for the cuTile GEMM lane; ``compile_for`` reads the exact figure from the cubin and the
    tests hold compiled <= this bound.
    """
    return _targets.smem_optin(target)


# --------------------------------------------------------------------------------------------
# AOT signatures




def _layouts(config: dict, shape: dict) -> dict:
    """(dtype, dims) of every array argument, by name, as build passes them."""
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    e, f = shape["dtype"], "float32"
    nkb = N // 2 // config["KEY_BJ"]
    segs = _segments(config, shape)
    ds = (e, (B, H, nc, N, P))
    hat = (e, (B, H, nc, C * R, N)) if config["VALUE_QK"] == "load" else ds
    dout = (B, S, H, P) if shape["reduceO"] else (B, S, R, H, P)
    return {"Q": (e, (B, S, R, G, N)), "K": (e, (B, S, R, G, N)), "QB": (f, (H, R, N)), "KB": (f, (H, R, N)),
            "V": (e, (B, S, H, P)), "PSI": (f, (H, R, P)), "PHI": (f, (H, R, P)), "ANG": (f, (B, S, H, nr)),
            "DA": (f, (B, H, S)), "DAR": (f, (B, H, S)), "DT": (f, (B, H, S)), "TRAP": (e, (B, H, S)),
            "SEG": (f, (B, H, nc, C, C)), "DOUT": (e, dout), "Z": (e, (B, S, H, P)), "ZETA": (f, (H, R, P)),
            "STATES": ("bfloat16", (B, H, nc, N, P)), "DS": ds, "QKD": (e, (B, H, S, R, R)),
            "DPARAM": (f, (H,)), "DQ": (e, (B, S * R, H, N)), "DK": (e, (B, S * R, H, N)), "DV": (e, (B, S, H, P)),
            "DANG": (f, (B, S, H, nr)), "ROW_WS": (f, (B, H, nc, nkb, 4, C)), "DDA_WS": (f, (B, H, nc, nkb)),
            "DPSI_WS": (f, (B, H, nc, R, P)), "DD_WS": (f, (B, H, nc)), "DPSI": (f, (B, H, R, P)),
            "DD": (f, (B, H)), **{k: (f, (B, H, S)) for k in ("DFACTOR", "DGAMMA", "DDA", "DDA_CS", "DDA_CS_REV")},
            "DSSDA": (f, (B, H, nc, C, C)), "CARRY": (f, (B, H, segs, N, P)), "DECAY": (f, (B, H, segs)),
            # dS stands in for the workspaces a config does not allocate (no code path reads them then).
            "QH": hat, "KH": hat, **({"QS": (e, (B, H, nc, C * R, N)), "DY": (e, (B, H, nc, C * R, P))}
                                     if config["SCAN_PREP"] else {"QS": ds, "DY": ds})}


def _params(name: str) -> list[str]:
    import inspect
    return [p for p in inspect.signature(_BODIES[name]).parameters]


def _consts(name: str, config: dict, shape: dict) -> list:
    """Compile-time arguments of a kernel, in its parameter order."""
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    z, o = bool(shape["hasZ"]), bool(shape["reduceO"])
    base = [H // G, N, P, R, C, nr]
    if name in ("scan", "scan_local"):
        return base + [config["SCAN_BJ"], config["SCAN_BP"], z, o, _segments(config, shape), name == "scan_local",
                       bool(config["SCAN_PREP"])]
    if name == "prep":
        return base + [config["SCAN_BJ"], config["SCAN_BP"], z, o]
    load = config["VALUE_QK"] == "load"
    if name == "key":
        return base + [config["KEY_BJ"], config["KEY_BP"], z, o, bool(config["SCAN_PREP"]), load]
    if name == "value":
        return base + [config["VALUE_BJ"], config["BLOCK_P"], N // 2 // config["KEY_BJ"], z, bool(shape["hasD"]), o,
                       bool(config["SCAN_PREP"]), not load]
    return [R, *_reduce_blocks(shape), bool(shape["hasD"])]


def _signature(name: str, config: dict, shape: dict):
    from cuda.tile.compilation import CallingConvention, KernelSignature
    lay = _layouts(config, shape)
    consts = _consts(name, config, shape)
    arrays = [array_constraint(*lay[p]) for p in _params(name)[:len(_params(name)) - len(consts)]]
    return KernelSignature(arrays + consts, CallingConvention.cutile_python_v1())


def compile_cubins(config: dict, shape: dict, target: str) -> dict:
    return {name: export_cubin(_kernel(name, config), _signature(name, config, shape), _gpu_code(target))
            for name in _kernel_names(config, shape)}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """The kernels of a config for ``target`` (no GPU); smem_bytes / registers are the largest of them."""
    config = {**DEFAULTS, **config}
    reason = eligibility(target) or config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    per = {}
    t0 = time.perf_counter()
    for name in _kernel_names(config, shape):
        t1 = time.perf_counter()
        cubin = export_cubin(_kernel(name, config), _signature(name, config, shape), _gpu_code(target))
        per[name] = {**cubin_resources(cubin, target), "compile_s": time.perf_counter() - t1}
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] or 0 for v in per.values()) or None,
            "stack_bytes": max(v["stack_bytes"] or 0 for v in per.values()),
            "compile_s": time.perf_counter() - t0, "binary": "cubin", "kernels": per}


# --------------------------------------------------------------------------------------------
# launch


def build(config: dict, shape: dict):
    """``run(inputs, outputs)``: the four launches (and _prep with SCAN_PREP, the local pass with scan
    segments) on the current stream (each kernel JIT-compiled by cuTile on its first call and cached by
    signature). Returns the value-side kernel's launched resources."""
    config = {**DEFAULTS, **config}
    why = config_reason(config, shape)
    if why:
        raise ValueError(why)
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    names = _kernel_names(config, shape)
    kern = {name: _kernel(name, config) for name in names}
    consts = {name: _consts(name, config, shape) for name in names}
    segs = _segments(config, shape)
    scan_tiles = (N // 2 // config["SCAN_BJ"]) * (P // config["SCAN_BP"])
    nkb = N // 2 // config["KEY_BJ"]
    load = config["VALUE_QK"] == "load"
    rp = _reduce_blocks(shape)[0]
    work: dict = {}
    info: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        dev = i["Q"].device
        if work.get("dev") != dev:
            f32 = {"dtype": torch.float32, "device": dev}
            work.update(dev=dev, ds=torch.empty(B, H, nc, N, P, dtype=i["Q"].dtype, device=dev),
                        dda=torch.empty(B, H, nc, nkb, **f32),
                        # [.., 4, C]: three row sums and one unused row (tile sides are powers of two)
                        rows=torch.zeros(B, H, nc, nkb, 4, C, **f32),
                        dpsi=torch.empty(B, H, nc, R, P, **f32), dd=torch.empty(B, H, nc, **f32),
                        dd_out=torch.empty(B, H, **f32), d=torch.zeros(H, **f32),
                        carry=torch.empty(B, H, segs, N, P, **f32), decay=torch.empty(B, H, segs, **f32))
            ds, prep = work["ds"], config["SCAN_PREP"]

            def fused(cols):
                return torch.empty(B, H, nc, C * R, cols, dtype=i["Q"].dtype, device=dev)
            # dS stands in for the workspaces a config does not allocate (no code path reads them then).
            work.update(qh=fused(N) if load else ds, kh=fused(N) if load else ds,
                        qs=fused(N) if prep else ds, dy=fused(P) if prep else ds)
        w = work
        z, zeta = (i["Z"], i["MIMO_Z"]) if shape["hasZ"] else (i["V"], i["MIMO_V"])   # not read without Z
        dpar = i["D"] if shape["hasD"] else w["d"]
        dd_out = o["DD"] if shape["hasD"] else w["dd_out"]
        stream = torch.cuda.current_stream()
        inputs_q = (i["Q"], i["Q_BIAS"], i["ANGLES"], i["DA_CS"], i["DOUT"], i["MIMO_O"], z, zeta)
        qs, dy = w["qs"], w["dy"]
        scan_args = inputs_q + (qs, dy, w["ds"], w["carry"], w["decay"])
        launches = [("prep", (nc, H, B), inputs_q + (qs, dy))] if config["SCAN_PREP"] else []
        launches += [("scan_local", (scan_tiles * (segs - 1), H, B), scan_args)] if segs > 1 else []
        launches += [
            ("scan", (scan_tiles * segs, H, B), scan_args),
            ("key", (nc * nkb, H, B), (i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["V"], i["MIMO_V"], i["ANGLES"],
                                       i["DA_CS"], i["DA_CS_REV"], i["DT"], i["TRAP"], i["SEGSUM"], i["DOUT"],
                                       i["MIMO_O"], z, zeta, dy, i["STATES"], w["ds"], o["DQ"], o["DK"], o["DANGLES"],
                                       w["rows"], w["dda"], w["qh"], w["kh"])),
            ("value", (nc, H, B), (i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["ANGLES"], w["qh"], w["kh"], i["V"],
                                   i["MIMO_V"], i["DA_CS_REV"], i["DT"], i["TRAP"], i["QK_DOT"], i["SEGSUM"],
                                   i["DOUT"], i["MIMO_O"], z, zeta, dy, dpar, w["ds"], w["rows"], w["dda"], o["DV"],
                                   o["DFACTOR"], o["DGAMMA_DIAG"], o["DDA"], o["DDA_CS"], o["DDA_CS_REV"], o["DSSDA"],
                                   w["dpsi"], w["dd"])),
            ("reduce", (P // rp, H, B), (w["dpsi"], w["dd"], o["DMIMO_V"], dd_out)),
        ]
        for name, grid, arrays in launches:
            args = tuple(arrays) + tuple(consts[name])
            ct.launch(stream, grid, kern[name], args)
        if not info:
            name, _, arrays = launches[-2]
            info.update(_launch_info(kern[name], tuple(arrays) + tuple(consts[name])))
            info["launches"] = len(launches)
        return info

    return run


def seed_for(shape: dict) -> dict:
    """The config the lane's tests compile at a named shape (the defaults; they fit sm_121a's 101,376 B at
    every named shape, tests/test_cutile_mamba.py)."""
    return dict(DEFAULTS)


# Compiled shared memory (bytes, the largest of the four kernels) of ``seed_for(shape)`` at the named shapes
# (sweeps/mamba_bwd_bwd/shapes.toml), read from the tileiras cubins (cuda-tile 1.7.0, 2026-11-26) as the
# driver counts it (kernels/_launch_smem.py driver_static: the section less the 1 KiB sm_90+ reservation): the
# value side is the largest on sm_90a, the key side on sm_121a; the scan 15-41 KB, the reduce ~2.6 KB (none
# before its blocked loads). tileiras gave the scan and the reduce 255 registers and the chunk kernels 168 (255
# for the value side at two shapes; no hint); local memory (spills) up to ~350 B per thread, ~1.7-1.9 KB in
# the key side at C = 8 with P = 128 and at R = 1. tests/test_cutile_mamba.py compiles and compares (GB10
# shape by default, the others under -m slow).
SMEM = {
    "h100_tuned": {"sm_90a": 183_344, "sm_121a": 95_132},
    "anchor_b2": {"sm_90a": 112_664, "sm_121a": 95_132},
    "training": {"sm_90a": 170_232, "sm_121a": 95_132},
    "gb10": {"sm_90a": 112_664, "sm_121a": 95_132},
    "grid_n32_p64_r4_c16": {"sm_90a": 98_368, "sm_121a": 93_332},
    "grid_n128_p128_r4_c8": {"sm_90a": 219_160, "sm_121a": 84_484},
    "grid_n128_p64_r8_c8": {"sm_90a": 176_680, "sm_121a": 98_700},
    "grid_n128_p64_r2_c32": {"sm_90a": 199_704, "sm_121a": 93_316},
    "grid_n128_p64_r1_c64": {"sm_90a": 200_560, "sm_121a": 97_404},
    "gqa_plain_rd2": {"sm_90a": 132_248, "sm_121a": 99_172},
}
