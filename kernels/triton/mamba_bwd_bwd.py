"""Triton lane for mamba_bwd_bwd (the Mamba-3 MIMO backward kernel "bwd_bwd").

Five kernels, one more with scan segments and one more with dy_prep, one fewer with the fused chunk
kernel (the model and the output definitions are in lab/problems/_mamba3.py). F = C*R: the fused rows
t*R + r of a chunk (step t, rank r).

P. ``_prep`` (dy_prep only, launched first): grid (nc * P/32, H, B), dL/dy of every chunk at once (the
   gate with Phi, SiLU(Z * Zeta), the rank broadcast; _dy_load / _dy_from's values) into DY [B, H, nc,
   F, P] in the input dtype. The chunk kernels' P loops then load dy instead of building it, where the
   key side builds it in each of a chunk's N/2/KEY_BJ programs and the value side again; their D terms
   (DD, D dy in DV) take it rounded, as their products do. The scan keeps building its own operands
   (q_hat * exp(DA_CS) and dy): at ~3 us a serial step (H200: 810 us over training's 256 chunks, against
   ~4,200 us for each chunk kernel) it is not the cuTile scan that SCAN_PREP took from 2,431 to 492 us
   (9.5 us a step, its operand builds on the chain); the part it could drop is the elementwise share of
   a step whose load latencies its pipelining already hides, while a QS workspace would add B*H*S*R*N
   elements to _prep's writes and reading DY [F, BP] there R times the bytes of its [C, BP] tiles.

0. ``_angles``: cos and sin of every angle (fp32, [B, S, H, N/rd] each), read by (1) and (2), which so
   take no transcendental range reduction (libdevice's sinf / cosf keep a 28-byte local array for it)
   and, in the scan, none on its serial path (each step would repeat it for the R ranks of a row).
1. ``_scan``: grid (tiles of dS x segments, H, B). dS_c (N x P, the gradient of the state leaving chunk c) is the
   only serial dependency: dS_{c-1} = exp(DA_CS_last(c)) dS_c + q_hat_c^T (exp(DA_CS) dy_c). A program
   owns SCAN_BJ rotary pairs (rows j and N/2 + j of dS, so that it rotates q without a gather) and
   SCAN_BP columns, walks the chunks last to first with dS in fp32 registers, and writes dS_c in the
   input dtype (the chunk kernels' GEMM operand).
   With K = scan_segments > 1 the chunks are K ranges of nc / K, and the recurrence, linear in dS, is
   walked on all of them at once: a local pass (the same kernel, LOCAL) runs ranges 1..K-1 from dS = 0
   and leaves each one's sum (fp32, [B, H, K, N, P]) and whole decay exp(sum of DA_CS at its chunks'
   last steps); then each scan program starts its range from the later ranges' sums, composed with
   those decays, and walks only its own chunks: 2 nc / K serial steps on K times the programs, for
   shapes whose B*H and dS tiles leave SMs idle.
2. ``_chunk_k``: grid (nc * N/2 / KEY_BJ, H, B): the key / query side of one chunk on KEY_BJ rotary
   pairs. Its P loop (KEY_BP columns a step) accumulates, fp32 in registers, PsiV dy^T (F x F), PsiV dS^T
   and dy STATES^T (F x KEY_BJ per rotary half) and the chunk's sums of STATES * dS (DDA) and
   dy * PsiV (DD, written by the program of the first pair block). After it, one value at a time:
   the F x F GEMM operands (dkq_m = PsiV dy^T exp(SEGSUM) off the diagonal blocks, dqk_t = gamma PsiV dy^T
   on them, input dtype, staged in shared memory); q, k of its pairs rotated with _angles' cos / sin,
   q_hat and k_hat written to a workspace [B, H, nc, F, N] (input dtype, 2 B H S R N elements) for (3);
   the row sums of its pairs (DDA_CS_REV, DDA_CS, DFACTOR) to a workspace; the key path (dk_hat, DK);
   then the query path (dq_hat, DANGLES, DQ), whose F x F operands are the transposes of the staged
   key-path ones. The same-step products are taken in the rotated frame (a step's rows share one
   angle, so dqk_t q = rot^T(dqk_t q_hat)), and the angle gradient is g_hi x_lo - g_lo x_hi in the
   rotated x: DK and DQ take one inverse rotation each and no unrotated q or k stays live. Splitting N
   across programs keeps the state-gradient products in registers; every program of a chunk repeats
   the F x F product of the P loop.
3. ``_chunk_v``: grid (nc, H, B): the value side. k_hat q_hat^T over all of N (VALUE_BJ pairs a step,
   both rotary halves in one product), merged with the same-step QK_DOT terms into one F x F operand
   (disjoint supports: exp(SEGSUM) is zero on the diagonal blocks); then P in BLOCK_P columns: k_hat dS
   (the same N steps, k_hat read again from L1 / L2), dPsiV, DV and the DMIMO_V partial (the D term
   reduced apart in dy's layout and added to both), PsiV dy^T; then k_hat q_hat^T again for DSSDA
   (read again rather than held in registers across the P loop), DGAMMA_DIAG, DDA and the sums of the
   key side's row-sum workspace (DDA_CS_REV, DFACTOR, DDA_CS).
4. ``_reduce``: grid (H, B): DMIMO_V and DD summed over chunks (deterministic, no atomics).

With fused_chunk, one kernel takes the place of (2) and (3): ``_chunk``, grid (nc, H, B), both sides of a
chunk on all of N (N/2 <= 32). It builds k_hat, q_hat and the dPsiV operand first; one P loop then reads
PsiV, dy, dS and STATES once for the key side's products and the value side's; after it every per-chunk
output. Neither side's product is repeated, and no q_hat / k_hat or row-sum workspace crosses global
memory. The price: registers (the compiler's own count, 255 at 8 warps: one CTA an SM, and local memory:
ptxas, sm_90a, training, 824 B of spills with BLOCK_P = 64).

Every F x N operand is held as its two rotary halves, so rotary, its transpose and the angle gradient
are elementwise between the halves. GEMM operands are in the input dtype (bf16 / fp16) with fp32
accumulation, as upstream; the elementwise math and every partial are fp32.

Registers. A value built elementwise that becomes a GEMM operand (PsiV, dy, q_hat, the rotated k, the
F x F operands) passes through ``_fence`` first: Triton then computes it once, in the layout of its
inputs, and moves it to the operand's layout through shared memory, instead of recomputing it in the
operand's layout, which replicates it across warps (dy as mma.sync's B operand: 64 elements a thread
per step instead of 8). A value also used elementwise in another layout is fenced only on its operand
path (the layout pass would clone the fence with the rest of the chain). With these, the first seed
spills nothing (cuobjdump -res-usage, sm_90a, LOCAL 0 at 128 registers), but its value side keeps a
stack frame (312 B at h100_tuned, 264 B at training; the key side 0 / 24 B), and the fused kernel 832 B
at training (255 registers).

Loads. In the chunk kernels' P loops every load of a step is issued before the step's first layout
conversion: a conversion goes through shared memory between two barriers, and a load placed after one
waits for it, so loads interleaved with conversions pay their latencies one after another. PsiV's and
dy's per-step and per-rank tiles are read directly on the fused rows ([F, BP], each step read R times
from L1), since a [C, BP] tile broadcast over ranks is itself a conversion right behind its load. The
scan keeps the [C, BP] / [R, BP] tiles (_dy_tile): its chunk loop's pipelining stages those loads in
shared memory, R times smaller.

Global memory between the kernels (allocated once per device): cos / sin (0 -> 1, 2); dS [B, H, nc, N, P]
in the input dtype (1 -> 2, 3); the scan's segment sums and decays (local pass -> 1); q_hat, k_hat [B, H, nc,
F, N] in the input dtype, the row sums and DDA partials (2 -> 3); DMIMO_V and DD partials (3 -> 4); with
dy_prep, DY [B, H, nc, F, P] in the input dtype (P -> 2, 3 or the fused kernel; 512 MiB at training in bf16).

Tunables:
  SCAN_BJ, SCAN_BP      dS tile of one scan program: 2 * SCAN_BJ rows (SCAN_BJ rotary pairs) x SCAN_BP
  scan_warps, scan_stages   the scan's num_warps and num_stages (software pipelining of the chunk loop)
  scan_segments         ranges of chunks the scan walks at once (above; the largest count up to it that
                        divides the chunk count)
  KEY_BJ, KEY_BP        rotary pairs per key-side program, and P columns per step of its P loop
  key_warps             the key-side kernel's num_warps
  VALUE_BJ, BLOCK_P     rotary pairs per step of the value side's N loops (k_hat q_hat^T, and k_hat dS
                        reading k_hat again per P step), and P columns per step of its P loop
  chunk_warps           the value-side kernel's num_warps
  chunk_stages          num_stages of both chunk kernels' P loops
  key_maxnreg, value_maxnreg   registers per thread each chunk kernel may use. At 8 warps, 128 lets two
                        CTAs share an SM (65,536 registers) where the compiler's own choice (150-210)
                        leaves one; 80, three; 0, the compiler's own count (fused kernel only)
  fused_chunk           ``_chunk`` instead of (2) and (3); it takes BLOCK_P, chunk_warps, chunk_stages and
                        value_maxnreg
  dy_prep               ``_prep`` first, and the chunk kernels (split or fused) load its DY
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
TUNABLES = ("SCAN_BJ", "SCAN_BP", "scan_warps", "scan_stages", "scan_segments", "KEY_BJ", "KEY_BP", "key_warps",
            "VALUE_BJ", "BLOCK_P", "chunk_warps", "chunk_stages", "key_maxnreg", "value_maxnreg", "fused_chunk",
            "dy_prep")
DEFAULTS = {"SCAN_BJ": 16, "SCAN_BP": 32, "scan_warps": 4, "scan_stages": 2, "scan_segments": 1, "KEY_BJ": 16,
            "KEY_BP": 32, "key_warps": 8, "VALUE_BJ": 16, "BLOCK_P": 32, "chunk_warps": 8, "chunk_stages": 1,
            "key_maxnreg": 128, "value_maxnreg": 128, "fused_chunk": False, "dy_prep": False}
_TL = {"bfloat16": "bf16", "float16": "fp16"}
ANGLE_BLOCK = 1024   # angles per program of _angles
PREP_BP = 32         # P columns per program of _prep (at most P)


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
    if c["fused_chunk"] and nh > 32:
        return (f"fused_chunk at N={N}: the fused kernel takes N/2 <= 32 (at N = 128 it made an illegal memory access "
                f"on sm_90a, Triton 3.6, where the interpreter computes right: results/logs/20261128T015602Z-call-log.txt)")
    # The values each knob may take are the sweep file's (sweeps/mamba_bwd_bwd/triton.toml); the harness checks them.
    return None


# --------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _step_rows(X, b, h, c, pp, S, H, R: tl.constexpr, C: tl.constexpr, P: tl.constexpr):
    """A [B, S, H, P] tensor's rows of chunk c on the fused rows (row t*R + r reads step t), columns pp:
    [F, BP] (fp32). Each step is read R times (L1 hits), so that the tile meets a per-rank one in the
    layout it was loaded in: a [C, BP] tile broadcast over ranks and reshaped is a layout conversion
    (shared memory and two barriers) right behind its load, and such conversions serialize the loads."""
    t = tl.arange(0, C * R) // R
    return tl.load(X + ((b * S + c * C + t[:, None]) * H + h) * P + pp[None, :]).to(tl.float32)


@triton.jit
def _rank_rows(X, h, pp, R: tl.constexpr, C: tl.constexpr, P: tl.constexpr):
    """A [H, R, P] per-rank parameter's columns pp for head h on the fused rows (row t*R + r reads rank
    r): [F, BP] (fp32)."""
    r = tl.arange(0, C * R) % R
    return tl.load(X + (h * R + r[:, None]) * P + pp[None, :]).to(tl.float32)


@triton.jit
def _dy_load(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R: tl.constexpr, C: tl.constexpr, P: tl.constexpr,
             HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr):
    """The tiles dL/dy is built from, each [F, BP] fp32 on the fused rows: dO, Phi, Z, zeta. A tile an
    option does not use is dO's again."""
    if REDUCE_O:
        d = _step_rows(DOUT, b, h, c, pp, S, H, R, C, P)
        phi = _rank_rows(PHI, h, pp, R, C, P)
    else:
        f = tl.arange(0, C * R)
        d = tl.load(DOUT + (((b * S + c * C + f[:, None] // R) * R + f[:, None] % R) * H + h) * P + pp[None, :])
        d = d.to(tl.float32)
        phi = d
    if HAS_Z:
        z = _step_rows(Z, b, h, c, pp, S, H, R, C, P)
        zeta = _rank_rows(ZETA, h, pp, R, C, P)
    else:
        z, zeta = d, phi
    return d, phi, z, zeta


@triton.jit
def _dy_from(d, phi, z, zeta, HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr):
    """dL/dy [F, BP] (fp32) of chunk c's fused rows (step t, rank r) from _dy_load's tiles."""
    if REDUCE_O:
        d = d * phi
    if HAS_Z:
        zz = z * zeta
        d = d * zz * tl.sigmoid(zz)
    return d


@triton.jit
def _dy_at(DY, bh, c, pp, NC, F: tl.constexpr, P: tl.constexpr):
    """Pointers to _prep's dy of chunk c, columns pp, in DY [B, H, nc, F, P]: [F, BP]."""
    return DY + ((bh * NC + c) * F + tl.arange(0, F)[:, None]) * P + pp[None, :]


@triton.jit
def _prep(DOUT, PHI, Z, ZETA, DY, S, H, NC, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, BP: tl.constexpr,
          HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr):
    """dy_prep: dL/dy of every chunk at once, grid (nc * P/BP, H, B), one [F, BP] tile a program, into DY
    (input dtype, the chunk kernels' GEMM operand): the values _dy_load / _dy_from build in their P loops."""
    pid, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c, pp = pid // (P // BP), (pid % (P // BP)) * BP + tl.arange(0, BP)
    d, phi, z, zeta = _dy_load(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, HAS_Z, REDUCE_O)
    dy = _dy_from(d, phi, z, zeta, HAS_Z, REDUCE_O)
    tl.store(_dy_at(DY, b * H + h, c, pp, NC, C * R, P), dy.to(DY.dtype.element_ty))


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
    """dL/dy [F, BP] (fp32) of chunk c's fused rows and columns pp, from [C, BP] and [R, BP] tiles: the
    scan's form, whose loads the chunk loop's pipelining stages (cp.async), R x smaller than _dy_load's."""
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
def _angles(ANG, COS, SIN, n, BLOCK: tl.constexpr):
    """cos and sin of every angle (fp32, [B, S, H, N/rd] each, as ANGLES), for the scan and the key side."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ang = tl.load(ANG + i, mask=i < n, other=0.0)
    tl.store(COS + i, tl.cos(ang), mask=i < n)
    tl.store(SIN + i, tl.sin(ang), mask=i < n)


@triton.jit
def _scan(Q, QB, COS, SIN, DA, DOUT, PHI, Z, ZETA, DS, CARRY, DECAY, S, H, G, NC,
          N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
          BJ: tl.constexpr, BP: tl.constexpr, HAS_Z: tl.constexpr, REDUCE_O: tl.constexpr,
          STAGES: tl.constexpr, K: tl.constexpr, LOCAL: tl.constexpr):
    F: tl.constexpr = C * R
    NH: tl.constexpr = N // 2
    NPB: tl.constexpr = P // BP
    TILES: tl.constexpr = (NH // BJ) * NPB
    pid, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile, seg = pid % TILES, pid // TILES + LOCAL    # the local pass runs segments 1..K-1
    L = NC // K
    c_lo = seg * L
    j0, p0 = (tile // NPB) * BJ, (tile % NPB) * BP
    g = h // (H // G)
    f = tl.arange(0, F)
    t, r = f // R, f % R
    jj = j0 + tl.arange(0, BJ)
    pp = p0 + tl.arange(0, BP)
    bh = b * H + h
    dt = Q.dtype.element_ty
    bq_lo = tl.load(QB + (h * R + r[:, None]) * N + jj[None, :])
    bq_hi = tl.load(QB + (h * R + r[:, None]) * N + NH + jj[None, :])
    run_lo = tl.zeros((BJ, BP), dtype=tl.float32)
    run_hi = tl.zeros((BJ, BP), dtype=tl.float32)
    cell = jj[:, None] * P + pp[None, :]
    if K > 1:
        if not LOCAL:
            # dS leaving the segment's last chunk: the later segments' local sums, each decayed across
            # the segments between (the recurrence is linear in dS), composed from the last one down.
            for i in tl.range(0, K - 1 - seg):
                j = K - 1 - i
                dec = tl.load(DECAY + bh * K + j)
                run_lo = tl.load(CARRY + (bh * K + j) * N * P + cell) + dec * run_lo
                run_hi = tl.load(CARRY + (bh * K + j) * N * P + NH * P + cell) + dec * run_hi
    log_decay = 0.0
    for i in tl.range(0, L, num_stages=STAGES):
        c = c_lo + L - 1 - i
        s = c * C + t
        row = b * S * R + c * F + f
        q_lo = tl.load(Q + (row[:, None] * G + g) * N + jj[None, :]).to(tl.float32) + bq_lo
        q_hi = tl.load(Q + (row[:, None] * G + g) * N + NH + jj[None, :]).to(tl.float32) + bq_hi
        at = ((b * S + s[:, None]) * H + h) * NR + jj[None, :]
        cos = tl.load(COS + at, mask=jj[None, :] < NR, other=1.0)
        sin = tl.load(SIN + at, mask=jj[None, :] < NR, other=0.0)
        qh_lo, qh_hi = _rot(q_lo, q_hi, cos, sin)
        ea = tl.exp(tl.load(DA + bh * S + s))
        dye = (_dy_tile(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, BP, HAS_Z, REDUCE_O) * ea[:, None]).to(dt)
        da_last = tl.load(DA + bh * S + c * C + C - 1)
        a_last = tl.exp(da_last)
        if not LOCAL:
            # dS_c = dL/dS_{c+1}: what the later chunks sent back (zero for the last chunk).
            out = DS + (bh * NC + c) * N * P + cell
            tl.store(out, run_lo.to(dt))
            tl.store(out + NH * P, run_hi.to(dt))
        else:
            log_decay += da_last
        run_lo = a_last * run_lo + tl.dot(tl.trans(qh_lo.to(dt)), dye)
        run_hi = a_last * run_hi + tl.dot(tl.trans(qh_hi.to(dt)), dye)
    if LOCAL:
        # This segment's own sum (from dS = 0) and its whole decay, for the main pass's segments below.
        tl.store(CARRY + (bh * K + seg) * N * P + cell, run_lo)
        tl.store(CARRY + (bh * K + seg) * N * P + NH * P + cell, run_hi)
        if tile == 0:
            tl.store(DECAY + bh * K + seg, tl.exp(log_decay))


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
def _fence(x, FENCE: tl.constexpr):
    """x (fp32) unchanged. Compiled, it passes through a register move marked as having side effects,
    which the hoisting of GEMM-operand layout conversions does not cross: x is computed once, in the
    layout of its inputs, and reaches the operand's layout through shared memory instead of being
    recomputed in that layout (replicated across warps). For values whose other consumers share that
    layout only: where one wants another layout, the layout pass clones the chain with this move,
    and the clone cannot be removed. The interpreter has no inline assembly: there it is the identity."""
    if FENCE:
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=False, pack=1)
    return x


@triton.jit
def _key_query_paths(dks_lo, dks_hi, dqs_lo, dqs_hi, dkq_m, dqk_t, qh_lo, qh_hi, qh16_lo, qh16_hi, kr_lo, kr_hi,
                     kh_lo, kh_hi, cos, sin, er, factor, REV_AT, FACTOR_AT, CS_AT, DA, DK, DQ, DANG, b, h, c, s, row,
                     jj, bh, S, H, N: tl.constexpr, NR: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
                     BJ: tl.constexpr):
    """After a chunk's P loop, on its rotary pairs jj (BJ of them): the row sums over those pairs
    (DDA_CS_REV, DFACTOR, DDA_CS, each [C], stored at REV_AT / FACTOR_AT / CS_AT), then the key path
    (DK) and the query path (DANGLES, DQ). dks / dqs: PsiV dS^T and dy STATES^T; dkq_m / dqk_t: the F x F
    operands; q_hat (fp32 and input dtype), rot(k), k_hat, cos / sin of the pairs' rows."""
    NH: tl.constexpr = N // 2
    dt = qh16_lo.dtype
    tl.store(REV_AT, _group(tl.sum(kh_lo.to(tl.float32) * dks_lo + kh_hi.to(tl.float32) * dks_hi, 1), C, R))
    tl.store(CS_AT, _group(tl.sum(qh_lo * dqs_lo + qh_hi * dqs_hi, 1), C, R))

    # Key path. Same-step products in the rotated frame: the block-diagonal dqk_t mixes rows of one
    # step only, which share their angle, so dqk_t q = rot^T(dqk_t q_hat). A product added to a value
    # that came from another product is subtracted with a negated operand (exact) instead: Triton folds
    # x + dot(a, b) into the product's accumulator, and a product feeding another one gets all warps
    # along its rows (each warpgroup then computes the whole F x KEY_BJ tile).
    dkh_lo = er[:, None] * dks_lo + tl.dot(dkq_m, qh16_lo)
    dkh_hi = er[:, None] * dks_hi + tl.dot(dkq_m, qh16_hi)
    tl.store(FACTOR_AT, _group(tl.sum(kr_lo * dkh_lo + kr_hi * dkh_hi, 1), C, R))
    dkr_lo, dkr_hi = dkh_lo * factor[:, None], dkh_hi * factor[:, None]
    dang = dkr_hi * kr_lo - dkr_lo * kr_hi
    gk_lo = dkr_lo - tl.dot(dqk_t, -qh16_lo)
    gk_hi = dkr_hi - tl.dot(dqk_t, -qh16_hi)
    out = (row[:, None] * H + h) * N + jj[None, :]
    tl.store(DK + out, (gk_lo * cos + gk_hi * sin).to(dt))
    tl.store(DK + out + NH, (gk_hi * cos - gk_lo * sin).to(dt))

    # Query path.
    ea = tl.exp(tl.load(DA + bh * S + s))
    dqh_lo = ea[:, None] * dqs_lo - tl.dot(tl.trans(dkq_m), -kh_lo)
    dqh_hi = ea[:, None] * dqs_hi - tl.dot(tl.trans(dkq_m), -kh_hi)
    dang += dqh_hi * qh_lo - dqh_lo * qh_hi
    dang = tl.sum(tl.reshape(dang, (C, R, BJ)), 1)
    tc = tl.arange(0, C)
    tl.store(DANG + ((b * S + c * C + tc[:, None]) * H + h) * NR + jj[None, :], dang, mask=jj[None, :] < NR)
    gq_lo = dqh_lo - tl.dot(tl.trans(dqk_t), (-kr_lo).to(dt))
    gq_hi = dqh_hi - tl.dot(tl.trans(dqk_t), (-kr_hi).to(dt))
    tl.store(DQ + out, (gq_lo * cos + gq_hi * sin).to(dt))
    tl.store(DQ + out + NH, (gq_hi * cos - gq_lo * sin).to(dt))


@triton.jit
def _chunk_k(Q, K, QB, KB, V, PSI, COS, SIN, DA, DAR, DT, TRAP, SEG, DOUT, PHI, Z, ZETA, DY, STATES, DS,
             DQ, DK, DANG, ROW_WS, DDA_WS, DD_WS, QH, KH, S, H, G, NC,
             N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
             BJ: tl.constexpr, BP: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr, REDUCE_O: tl.constexpr,
             STAGES: tl.constexpr, FENCE: tl.constexpr, DY_PREP: tl.constexpr):
    """Key / query side of one chunk on BJ rotary pairs: DQ, DK, DANGLES of those columns, q_hat and
    k_hat of them for the value side, the pairs' parts of DDA_CS_REV, DFACTOR, DDA_CS (row sums over N)
    and of sum(STATES * dS) (DDA), and (first pair block) the chunk's sum(dy * PsiV) (DD). DY_PREP: dy is
    _prep's (DY, input dtype), loaded instead of built from DOUT, MIMO_O, Z, MIMO_Z."""
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
    dd = 0.0
    for p0 in tl.range(0, P, BP, num_stages=STAGES):
        pp = p0 + tl.arange(0, BP)
        # Every load of the step first: a fence (and the layout conversion behind it, a barrier) orders
        # the loads after it, whose latencies would then add up instead of overlapping.
        v, psi = _step_rows(V, b, h, c, pp, S, H, R, C, P), _rank_rows(PSI, h, pp, R, C, P)
        if DY_PREP:
            dyp = tl.load(_dy_at(DY, bh, c, pp, NC, F, P))
        else:
            d, phi, z, zeta = _dy_load(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, HAS_Z, REDUCE_O)
        cell = (bh * NC + c) * N * P + jj[:, None] * P + pp[None, :]
        ds_lo, ds_hi = tl.load(DS + cell), tl.load(DS + cell + NH * P)
        st_lo, st_hi = tl.load(STATES + cell), tl.load(STATES + cell + NH * P)
        psiv = _fence(v * psi, FENCE)
        if DY_PREP:
            # Fenced as the built dy is. Unfenced (cuobjdump, sm_121a, the seeds at the four default
            # shapes), stack frames were 80-104 B larger than without dy_prep on the key and value sides
            # and 128-312 B on the fused kernel; fenced, at most 8 B larger, and shared memory the same.
            dy = _fence(dyp.to(tl.float32), FENCE)
        else:
            dy = _fence(_dy_from(d, phi, z, zeta, HAS_Z, REDUCE_O), FENCE)
        if HAS_D:
            dd += tl.sum(tl.sum(psiv * dy, 1), 0)
        psiv16, dy16 = psiv.to(dt), dy.to(dt)
        dda += tl.sum(tl.sum(st_lo.to(tl.float32) * ds_lo.to(tl.float32) +
                             st_hi.to(tl.float32) * ds_hi.to(tl.float32), 1), 0)
        dkq += tl.dot(psiv16, tl.trans(dy16))
        dks_lo += tl.dot(psiv16, tl.trans(ds_lo))
        dks_hi += tl.dot(psiv16, tl.trans(ds_hi))
        dqs_lo += tl.dot(dy16, tl.trans(st_lo.to(dt)))
        dqs_hi += tl.dot(dy16, tl.trans(st_hi.to(dt)))
    a_last = tl.exp(tl.load(DA + bh * S + c * C + C - 1))
    tl.store(DDA_WS + (bh * NC + c) * NBJ + jb, a_last * dda)
    if HAS_D:
        tl.store(DD_WS + bh * NC + c, dd, mask=jb == 0)

    gamma, factor, er = _gates(DT, TRAP, DAR, bh, s, S)
    decay, same = _decay(SEG, bh, c, t, NC, C, R, F)
    # The F x F operands, input dtype: dkq_m [F(s), F(t)]; dqk_t = dL/d(q_t,o . k_t,i) at [(t, i), (t, o)].
    dkq_m = _fence(dkq * decay, FENCE).to(dt)
    dqk_t = _fence(tl.where(same, dkq * gamma[:, None], 0.0), FENCE).to(dt)

    # Biased q, k on this program's pairs, rotated with _angles' cos / sin (1, 0 beyond N / rd).
    src = (row[:, None] * G + g) * N + jj[None, :]
    bias = (h * R + r[:, None]) * N + jj[None, :]
    at = ((b * S + s[:, None]) * H + h) * NR + jj[None, :]
    cos = tl.load(COS + at, mask=jj[None, :] < NR, other=1.0)
    sin = tl.load(SIN + at, mask=jj[None, :] < NR, other=0.0)
    q_lo = tl.load(Q + src).to(tl.float32) + tl.load(QB + bias)
    q_hi = tl.load(Q + src + NH).to(tl.float32) + tl.load(QB + bias + NH)
    qh_lo, qh_hi = _rot(q_lo, q_hi, cos, sin)
    k_lo = tl.load(K + src).to(tl.float32) + tl.load(KB + bias)
    k_hi = tl.load(K + src + NH).to(tl.float32) + tl.load(KB + bias + NH)
    kr_lo, kr_hi = _rot(k_lo, k_hi, cos, sin)
    qh_lo, qh_hi, kr_lo, kr_hi = _fence(qh_lo, FENCE), _fence(qh_hi, FENCE), _fence(kr_lo, FENCE), _fence(kr_hi, FENCE)
    kh_lo, kh_hi = (kr_lo * factor[:, None]).to(dt), (kr_hi * factor[:, None]).to(dt)
    qh16_lo, qh16_hi = qh_lo.to(dt), qh_hi.to(dt)
    hb = ((bh * NC + c) * F + f[:, None]) * N + jj[None, :]
    tl.store(KH + hb, kh_lo)
    tl.store(KH + hb + NH, kh_hi)
    tl.store(QH + hb, qh16_lo)
    tl.store(QH + hb + NH, qh16_hi)
    ws = ROW_WS + ((bh * NC + c) * NBJ + jb) * 3 * C + tl.arange(0, C)
    _key_query_paths(dks_lo, dks_hi, dqs_lo, dqs_hi, dkq_m, dqk_t, qh_lo, qh_hi, qh16_lo, qh16_hi, kr_lo, kr_hi,
                     kh_lo, kh_hi, cos, sin, er, factor, ws, ws + C, ws + 2 * C, DA, DK, DQ, DANG, b, h, c, s, row,
                     jj, bh, S, H, N, NR, C, R, BJ)


@triton.jit
def _lkq(QH, KH, hrow, N: tl.constexpr, F: tl.constexpr, BJ: tl.constexpr):
    """k_hat_s . q_hat_t over all of N [F(s), F(t)] (fp32), BJ rotary pairs at a time."""
    NH: tl.constexpr = N // 2
    lkq = tl.zeros((F, F), dtype=tl.float32)
    m = tl.arange(0, 2 * BJ)
    col = (m // BJ) * NH + m % BJ
    if BJ == NH:    # all of N: one product per rotary half (see _chunk_v's k_hat dS)
        jj = tl.arange(0, NH)[None, :]
        lkq = tl.dot(tl.load(KH + hrow + jj), tl.trans(tl.load(QH + hrow + jj)))
        lkq += tl.dot(tl.load(KH + hrow + NH + jj), tl.trans(tl.load(QH + hrow + NH + jj)))
    else:
        for j0 in tl.range(0, NH, BJ):
            hb = hrow + j0 + col[None, :]
            lkq += tl.dot(tl.load(KH + hb), tl.trans(tl.load(QH + hb)))
    return lkq


@triton.jit
def _chunk_v(QH, KH, V, PSI, DAR, DT, TRAP, QKD, SEG, DOUT, PHI, Z, ZETA, DY, DPARAM, DS,
             ROW_WS, DDA_WS, DV, DFACTOR, DGAMMA, DDA, DDA_CS, DDA_CS_REV, DSSDA, DPSI_WS,
             S, H, G, NC,
             N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
             BJ: tl.constexpr, BP: tl.constexpr, NBJ: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr,
             REDUCE_O: tl.constexpr, STAGES: tl.constexpr, FENCE: tl.constexpr, DY_PREP: tl.constexpr):
    """Value side of one chunk: k_hat q_hat^T over all of N, then P in BP columns: dPsiV (DV and the
    DMIMO_V partial) and PsiV dy^T; then DSSDA, DGAMMA_DIAG, DDA and the key side's row sums. DY_PREP:
    dy is _prep's (the D terms then take it rounded to the input dtype, as the products do)."""
    F: tl.constexpr = C * R
    NH: tl.constexpr = N // 2
    c, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    dt = QH.dtype.element_ty
    f = tl.arange(0, F)
    t, r = f // R, f % R
    s = c * C + t
    bh = b * H + h
    hrow = ((bh * NC + c) * F + f[:, None]) * N
    # Same-step q.k products (biased, before rotary), QKD[(t, o), (t, i)], read at [(t, i), (t, o)].
    qkd_at = QKD + ((bh * S + c * C + t[:, None]) * R + (f % R)[None, :]) * R + r[:, None]
    lkq = _lkq(QH, KH, hrow, N, F, BJ)
    gamma, factor, er = _gates(DT, TRAP, DAR, bh, s, S)
    decay, same = _decay(SEG, bh, c, t, NC, C, R, F)
    # dPsiV's operand against dy: exp(SEGSUM) k_hat.q_hat below the diagonal blocks, gamma q.k on them
    # (disjoint supports, so one operand holds both).
    qkd = tl.load(qkd_at, mask=same, other=0.0).to(tl.float32)
    a_v = _fence(tl.where(same, qkd * gamma[:, None], lkq * decay), FENCE).to(dt)

    dkq = tl.zeros((F, F), dtype=tl.float32)            # PsiV_s . dy_t
    if HAS_D:
        dpar = tl.load(DPARAM + h)
    tc = tl.arange(0, C)
    for p0 in tl.range(0, P, BP, num_stages=STAGES):
        pp = p0 + tl.arange(0, BP)
        # The step's loads first (see _chunk_k's P loop).
        v, psi = _step_rows(V, b, h, c, pp, S, H, R, C, P), _rank_rows(PSI, h, pp, R, C, P)
        if DY_PREP:
            dyp = tl.load(_dy_at(DY, bh, c, pp, NC, F, P))
        else:
            d, phi, z, zeta = _dy_load(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, HAS_Z, REDUCE_O)
        if BJ == NH:
            # all of N: one product per rotary half. As one product over N (contiguous columns) Triton
            # 3.6 reads shared memory out of bounds on sm_90a (compute-sanitizer: invalid __shared__
            # read of 512 bytes; every N = 64 shape, VALUE_BJ = 32; results/logs/20261127T075816Z-call-log.txt)
            jh = tl.arange(0, NH)
            cell = (bh * NC + c) * N * P + jh[:, None] * P + pp[None, :]
            kh_lo, kh_hi = tl.load(KH + hrow + jh[None, :]), tl.load(KH + hrow + NH + jh[None, :])
            ds_lo, ds_hi = tl.load(DS + cell), tl.load(DS + cell + NH * P)
        psiv = v * psi
        if DY_PREP:
            dy = _fence(dyp.to(tl.float32), FENCE)
        else:
            dy = _fence(_dy_from(d, phi, z, zeta, HAS_Z, REDUCE_O), FENCE)
        dy16 = dy.to(dt)
        # k_hat dS_c over N, BJ pairs (both rotary halves, one product) a step, k_hat read again.
        if BJ == NH:
            khds = tl.dot(kh_lo, ds_lo)
            khds += tl.dot(kh_hi, ds_hi)
        else:
            khds = tl.zeros((F, BP), dtype=tl.float32)
            m = tl.arange(0, 2 * BJ)
            col = (m // BJ) * NH + m % BJ
            for j0 in tl.range(0, NH, BJ):
                jj = j0 + col
                cell = (bh * NC + c) * N * P + jj[:, None] * P + pp[None, :]
                khds += tl.dot(tl.load(KH + hrow + jj[None, :]), tl.load(DS + cell))
        dpsiv = er[:, None] * khds + tl.dot(a_v, dy16)
        dv = tl.sum(tl.reshape(dpsiv * psi, (C, R, BP)), 1)
        dpsi = tl.sum(tl.reshape(dpsiv * v, (C, R, BP)), 0)
        if HAS_D:   # the D term, reduced in dy's layout (dy feeds no other one) and added after
            dyd = dpar * dy
            dv += tl.sum(tl.reshape(dyd * psi, (C, R, BP)), 1)
            dpsi += tl.sum(tl.reshape(dyd * v, (C, R, BP)), 0)
        tl.store(DV + ((b * S + c * C + tc[:, None]) * H + h) * P + pp[None, :], dv.to(dt))
        ra = tl.arange(0, R)
        tl.store(DPSI_WS + ((bh * NC + c) * R + ra[:, None]) * P + pp[None, :], dpsi)
        dkq += tl.dot(_fence(psiv, FENCE).to(dt), tl.trans(dy16))

    per_step = bh * S + c * C + tc
    # k_hat q_hat^T again (L2-resident reads) rather than kept live in registers across the P loop.
    ssda = tl.sum(tl.sum(tl.reshape(_lkq(QH, KH, hrow, N, F, BJ) * dkq, (C, R, C, R)), 3), 1)
    tl.store(DSSDA + (bh * NC + c) * C * C + tc[:, None] * C + tc[None, :], ssda)
    qkd = tl.load(qkd_at, mask=same, other=0.0).to(tl.float32)
    tl.store(DGAMMA + per_step, _group(tl.sum(qkd * dkq, 1), C, R))
    # DDA on every step of the chunk, and the row sums over the key side's pair blocks.
    nb = tl.arange(0, NBJ)
    tl.store(DDA + per_step, tl.zeros((C,), dtype=tl.float32) + tl.sum(tl.load(DDA_WS + (bh * NC + c) * NBJ + nb), 0))
    ws = ROW_WS + ((bh * NC + c) * NBJ + nb[:, None]) * 3 * C + tc[None, :]
    tl.store(DDA_CS_REV + per_step, tl.sum(tl.load(ws), 0))
    tl.store(DFACTOR + per_step, tl.sum(tl.load(ws + C), 0))
    tl.store(DDA_CS + per_step, tl.sum(tl.load(ws + 2 * C), 0))


@triton.jit
def _rotated_qk(Q, K, QB, KB, COS, SIN, b, h, g, s, row, r, S, H, G,
                N: tl.constexpr, R: tl.constexpr, NR: tl.constexpr, FENCE: tl.constexpr):
    """Biased q and k of a chunk's fused rows on all of N, rotated with _angles' cos / sin (1, 0 beyond
    N / rd): q_hat lo, hi, rot(k) lo, hi (fenced), cos, sin; each [F, N/2] fp32."""
    NH: tl.constexpr = N // 2
    jj = tl.arange(0, NH)
    src = (row[:, None] * G + g) * N + jj[None, :]
    bias = (h * R + r[:, None]) * N + jj[None, :]
    at = ((b * S + s[:, None]) * H + h) * NR + jj[None, :]
    cos = tl.load(COS + at, mask=jj[None, :] < NR, other=1.0)
    sin = tl.load(SIN + at, mask=jj[None, :] < NR, other=0.0)
    q_lo = tl.load(Q + src).to(tl.float32) + tl.load(QB + bias)
    q_hi = tl.load(Q + src + NH).to(tl.float32) + tl.load(QB + bias + NH)
    qh_lo, qh_hi = _rot(q_lo, q_hi, cos, sin)
    k_lo = tl.load(K + src).to(tl.float32) + tl.load(KB + bias)
    k_hi = tl.load(K + src + NH).to(tl.float32) + tl.load(KB + bias + NH)
    kr_lo, kr_hi = _rot(k_lo, k_hi, cos, sin)
    return _fence(qh_lo, FENCE), _fence(qh_hi, FENCE), _fence(kr_lo, FENCE), _fence(kr_hi, FENCE), cos, sin


@triton.jit
def _chunk(Q, K, QB, KB, V, PSI, COS, SIN, DA, DAR, DT, TRAP, QKD, SEG, DOUT, PHI, Z, ZETA, DY, DPARAM, STATES,
           DS, DQ, DK, DANG, DV, DFACTOR, DGAMMA, DDA, DDA_CS, DDA_CS_REV, DSSDA, DPSI_WS, DD_WS, S, H, G, NC,
           N: tl.constexpr, P: tl.constexpr, R: tl.constexpr, C: tl.constexpr, NR: tl.constexpr,
           BP: tl.constexpr, HAS_Z: tl.constexpr, HAS_D: tl.constexpr, REDUCE_O: tl.constexpr,
           STAGES: tl.constexpr, FENCE: tl.constexpr, DY_PREP: tl.constexpr):
    """Both sides of one chunk on all of N (fused_chunk): one P loop (BP columns a step) reads PsiV, dy,
    dS and STATES once and feeds the key side's products (PsiV dy^T, PsiV dS^T, dy STATES^T, the DDA and
    DD sums) and the value side's (dPsiV = exp(DA_CS_REV) k_hat dS + a_v dy: DV and the DMIMO_V
    partial), with k_hat and a_v (from k_hat q_hat^T) built before it; after it every per-chunk output,
    with q and k read again (L2) rather than held across the loop. No q_hat / k_hat or row-sum
    workspace, and no product computed twice. DY_PREP: dy is _prep's, as in _chunk_k and _chunk_v."""
    F: tl.constexpr = C * R
    NH: tl.constexpr = N // 2
    c, h, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = h // (H // G)
    dt = Q.dtype.element_ty
    f = tl.arange(0, F)
    t, r = f // R, f % R
    s = c * C + t
    tc = tl.arange(0, C)
    bh = b * H + h
    row = b * S * R + c * F + f
    jh = tl.arange(0, NH)
    gamma, factor, er = _gates(DT, TRAP, DAR, bh, s, S)
    decay, same = _decay(SEG, bh, c, t, NC, C, R, F)
    qkd_at = QKD + ((bh * S + c * C + t[:, None]) * R + (f % R)[None, :]) * R + r[:, None]

    qh_lo, qh_hi, kr_lo, kr_hi, cos, sin = _rotated_qk(Q, K, QB, KB, COS, SIN, b, h, g, s, row, r, S, H, G, N, R,
                                                       NR, FENCE)
    kh_lo, kh_hi = (kr_lo * factor[:, None]).to(dt), (kr_hi * factor[:, None]).to(dt)
    lkq = tl.dot(kh_lo, tl.trans(qh_lo.to(dt))) + tl.dot(kh_hi, tl.trans(qh_hi.to(dt)))
    qkd = tl.load(qkd_at, mask=same, other=0.0).to(tl.float32)
    # dPsiV's operand against dy: exp(SEGSUM) k_hat.q_hat below the diagonal blocks, gamma q.k on them.
    a_v = _fence(tl.where(same, qkd * gamma[:, None], lkq * decay), FENCE).to(dt)

    dkq = tl.zeros((F, F), dtype=tl.float32)            # PsiV_s . dy_t
    dks_lo = tl.zeros((F, NH), dtype=tl.float32)        # PsiV dS^T
    dks_hi = tl.zeros((F, NH), dtype=tl.float32)
    dqs_lo = tl.zeros((F, NH), dtype=tl.float32)        # dy STATES^T
    dqs_hi = tl.zeros((F, NH), dtype=tl.float32)
    dda = 0.0
    dd = 0.0
    if HAS_D:
        dpar = tl.load(DPARAM + h)
    for p0 in tl.range(0, P, BP, num_stages=STAGES):
        pp = p0 + tl.arange(0, BP)
        # The step's loads first (see _chunk_k's P loop).
        v, psi = _step_rows(V, b, h, c, pp, S, H, R, C, P), _rank_rows(PSI, h, pp, R, C, P)
        if DY_PREP:
            dyp = tl.load(_dy_at(DY, bh, c, pp, NC, F, P))
        else:
            d, phi, z, zeta = _dy_load(DOUT, PHI, Z, ZETA, b, h, c, pp, S, H, R, C, P, HAS_Z, REDUCE_O)
        cell = (bh * NC + c) * N * P + jh[:, None] * P + pp[None, :]
        ds_lo, ds_hi = tl.load(DS + cell), tl.load(DS + cell + NH * P)
        st_lo, st_hi = tl.load(STATES + cell).to(dt), tl.load(STATES + cell + NH * P).to(dt)
        psiv = _fence(v * psi, FENCE)
        if DY_PREP:
            dy = _fence(dyp.to(tl.float32), FENCE)
        else:
            dy = _fence(_dy_from(d, phi, z, zeta, HAS_Z, REDUCE_O), FENCE)
        psiv16, dy16 = psiv.to(dt), dy.to(dt)
        if HAS_D:
            dd += tl.sum(tl.sum(psiv * dy, 1), 0)
        dda += tl.sum(tl.sum(st_lo.to(tl.float32) * ds_lo.to(tl.float32) +
                             st_hi.to(tl.float32) * ds_hi.to(tl.float32), 1), 0)
        dkq += tl.dot(psiv16, tl.trans(dy16))
        dks_lo += tl.dot(psiv16, tl.trans(ds_lo))
        dks_hi += tl.dot(psiv16, tl.trans(ds_hi))
        dqs_lo += tl.dot(dy16, tl.trans(st_lo))
        dqs_hi += tl.dot(dy16, tl.trans(st_hi))
        # Value side: one product per rotary half (see _chunk_v).
        khds = tl.dot(kh_lo, ds_lo)
        khds += tl.dot(kh_hi, ds_hi)
        dpsiv = er[:, None] * khds + tl.dot(a_v, dy16)
        dv = tl.sum(tl.reshape(dpsiv * psi, (C, R, BP)), 1)
        dpsi = tl.sum(tl.reshape(dpsiv * v, (C, R, BP)), 0)
        if HAS_D:
            dyd = dpar * dy
            dv += tl.sum(tl.reshape(dyd * psi, (C, R, BP)), 1)
            dpsi += tl.sum(tl.reshape(dyd * v, (C, R, BP)), 0)
        tl.store(DV + ((b * S + c * C + tc[:, None]) * H + h) * P + pp[None, :], dv.to(dt))
        ra = tl.arange(0, R)
        tl.store(DPSI_WS + ((bh * NC + c) * R + ra[:, None]) * P + pp[None, :], dpsi)

    per_step = bh * S + c * C + tc
    a_last = tl.exp(tl.load(DA + bh * S + c * C + C - 1))
    tl.store(DDA + per_step, tl.zeros((C,), dtype=tl.float32) + a_last * dda)
    if HAS_D:
        tl.store(DD_WS + bh * NC + c, dd)
    qkd = tl.load(qkd_at, mask=same, other=0.0).to(tl.float32)
    tl.store(DGAMMA + per_step, _group(tl.sum(qkd * dkq, 1), C, R))

    qh_lo, qh_hi, kr_lo, kr_hi, cos, sin = _rotated_qk(Q, K, QB, KB, COS, SIN, b, h, g, s, row, r, S, H, G, N, R,
                                                       NR, FENCE)
    kh_lo, kh_hi = (kr_lo * factor[:, None]).to(dt), (kr_hi * factor[:, None]).to(dt)
    qh16_lo, qh16_hi = qh_lo.to(dt), qh_hi.to(dt)
    lkq = tl.dot(kh_lo, tl.trans(qh16_lo)) + tl.dot(kh_hi, tl.trans(qh16_hi))
    ssda = tl.sum(tl.sum(tl.reshape(lkq * dkq, (C, R, C, R)), 3), 1)
    tl.store(DSSDA + (bh * NC + c) * C * C + tc[:, None] * C + tc[None, :], ssda)
    # The F x F operands (see _chunk_k), then the row sums, the key path and the query path.
    dkq_m = _fence(dkq * decay, FENCE).to(dt)
    dqk_t = _fence(tl.where(same, dkq * gamma[:, None], 0.0), FENCE).to(dt)
    _key_query_paths(dks_lo, dks_hi, dqs_lo, dqs_hi, dkq_m, dqk_t, qh_lo, qh_hi, qh16_lo, qh16_hi, kr_lo, kr_hi,
                     kh_lo, kh_hi, cos, sin, er, factor, DDA_CS_REV + per_step, DFACTOR + per_step, DDA_CS + per_step,
                     DA, DK, DQ, DANG, b, h, c, s, row, jh, bh, S, H, N, NR, C, R, NH)


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


def _prep_bp(shape: dict) -> int:
    return min(PREP_BP, shape["P"])


def _segments(config: dict, shape: dict) -> int:
    """Ranges of chunks the scan walks at once: the largest count of at most ``scan_segments`` that
    divides the chunk count (1 where none above 1 does)."""
    nc = shape["S"] // shape["C"]
    return max(k for k in range(1, config["scan_segments"] + 1) if nc % k == 0)


def kernels(config: dict, shape: dict) -> list[str]:
    """The kernels a config launches, in launch order (_prep only with dy_prep, the scan's local pass
    only with segments)."""
    c = {**DEFAULTS, **config}
    prep = ["prep"] if c["dy_prep"] else []
    local = ["scan_local"] if _segments(c, shape) > 1 else []
    return prep + ["angles"] + local + ["scan"] + (["chunk"] if c["fused_chunk"] else ["key", "value"]) + ["reduce"]


def _kernel_consts(config: dict, shape: dict, fence: bool = True) -> dict:
    """Compile-time arguments of each kernel (beyond the shape's), keyed by kernel. fence: _fence's
    register move is emitted (False only under the interpreter, which has no inline assembly)."""
    k, has_d = _consts(config, shape), bool(shape["hasD"])
    scan = {**k, "BJ": config["SCAN_BJ"], "BP": config["SCAN_BP"], "STAGES": config["scan_stages"],
            "K": _segments(config, shape)}
    chunk = {"HAS_D": has_d, "STAGES": config["chunk_stages"], "FENCE": fence, "DY_PREP": bool(config["dy_prep"])}
    return {"prep": {"P": shape["P"], "R": shape["R"], "C": shape["C"], "BP": _prep_bp(shape), "HAS_Z": k["HAS_Z"],
                     "REDUCE_O": k["REDUCE_O"]},
            "angles": {"BLOCK": ANGLE_BLOCK}, "scan_local": {**scan, "LOCAL": True},
            "scan": {**scan, "LOCAL": False},
            "key": {**k, "BJ": config["KEY_BJ"], "BP": config["KEY_BP"], **chunk},
            "value": {**k, "BJ": config["VALUE_BJ"], "BP": config["BLOCK_P"], "NBJ": _key_blocks(config, shape),
                      **chunk},
            "chunk": {**k, "BP": config["BLOCK_P"], **chunk},
            "reduce": {"R": shape["R"], "P": shape["P"], "HAS_D": has_d}}


def _warps(config: dict) -> dict:
    return {"prep": 4, "angles": 4, "scan_local": config["scan_warps"], "scan": config["scan_warps"],
            "key": config["key_warps"], "value": config["chunk_warps"], "chunk": config["chunk_warps"], "reduce": 4}


def _launch_opts(config: dict) -> dict:
    """num_warps, and maxnreg for the chunk kernels, of each kernel's launch (keyword arguments of kernel[grid])."""
    regs = {"key": config["key_maxnreg"], "value": config["value_maxnreg"], "chunk": config["value_maxnreg"]}
    return {name: {"num_warps": w} | ({"maxnreg": regs[name]} if regs.get(name) else {})
            for name, w in _warps(config).items()}


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    why = config_reason(config, shape)
    if why:
        raise ValueError(why)
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    kc, launch = _kernel_consts(config, shape, fence=not _common.interpreting()), _launch_opts(config)
    tiles, nbj, segs = _scan_tiles(config, shape), _key_blocks(config, shape), _segments(config, shape)
    n_ang = B * S * H * nr
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
                        cos=torch.empty(B, S, H, nr, **f32), sin=torch.empty(B, S, H, nr, **f32),
                        kh=torch.empty(B, H, nc, C * R, N, dtype=i["Q"].dtype, device=dev),
                        carry=torch.empty(B, H, segs, N, P, **f32), decay=torch.empty(B, H, segs, **f32))
            if config["dy_prep"]:
                work["dy"] = torch.empty(B, H, nc, C * R, P, dtype=i["Q"].dtype, device=dev)
        w = work
        dummy = i["Q"]
        z, zeta = (i["Z"], i["MIMO_Z"]) if shape["hasZ"] else (dummy, i["MIMO_V"])
        dpar = i["D"] if shape["hasD"] else i["MIMO_V"]
        dd_out = o["DD"] if shape["hasD"] else w["dd"]
        dy = w["dy"] if config["dy_prep"] else dummy
        if config["dy_prep"]:
            _prep[(nc * P // _prep_bp(shape), H, B)](i["DOUT"], i["MIMO_O"], z, zeta, dy, S, H, nc, **launch["prep"],
                                                     **kc["prep"])
        _angles[(triton.cdiv(n_ang, ANGLE_BLOCK),)](i["ANGLES"], w["cos"], w["sin"], n_ang, **launch["angles"],
                                                     **kc["angles"])
        scan_args = (i["Q"], i["Q_BIAS"], w["cos"], w["sin"], i["DA_CS"], i["DOUT"], i["MIMO_O"], z, zeta, w["ds"],
                     w["carry"], w["decay"], S, H, G, nc)
        if segs > 1:
            _scan[(tiles * (segs - 1), H, B)](*scan_args, **launch["scan_local"], **kc["scan_local"])
        _scan[(tiles * segs, H, B)](*scan_args, **launch["scan"], **kc["scan"])
        if config["fused_chunk"]:
            kern = _chunk[(nc, H, B)](
                i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["V"], i["MIMO_V"], w["cos"], w["sin"], i["DA_CS"],
                i["DA_CS_REV"], i["DT"], i["TRAP"], i["QK_DOT"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, dy,
                dpar, i["STATES"], w["ds"], o["DQ"], o["DK"], o["DANGLES"], o["DV"], o["DFACTOR"], o["DGAMMA_DIAG"],
                o["DDA"], o["DDA_CS"], o["DDA_CS_REV"], o["DSSDA"], w["dpsi"], w["dd"], S, H, G, nc,
                **launch["chunk"], **kc["chunk"])
            _reduce[(H, B)](w["dpsi"], w["dd"], o["DMIMO_V"], dd_out, H, nc, **launch["reduce"], **kc["reduce"])
            return _common.launch_info(kern)
        _chunk_k[(nc * nbj, H, B)](
            i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["V"], i["MIMO_V"], w["cos"], w["sin"], i["DA_CS"],
            i["DA_CS_REV"],
            i["DT"], i["TRAP"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, dy, i["STATES"], w["ds"],
            o["DQ"], o["DK"], o["DANGLES"], w["rows"], w["dda"], w["dd"], w["qh"], w["kh"], S, H, G, nc,
            **launch["key"], **kc["key"])
        kern = _chunk_v[(nc, H, B)](
            w["qh"], w["kh"], i["V"], i["MIMO_V"], i["DA_CS_REV"],
            i["DT"], i["TRAP"], i["QK_DOT"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, dy, dpar, w["ds"],
            w["rows"], w["dda"], o["DV"], o["DFACTOR"], o["DGAMMA_DIAG"], o["DDA"], o["DDA_CS"], o["DDA_CS_REV"],
            o["DSSDA"], w["dpsi"], S, H, G, nc, **launch["value"], **kc["value"])
        _reduce[(H, B)](w["dpsi"], w["dd"], o["DMIMO_V"], dd_out, H, nc, **launch["reduce"], **kc["reduce"])
        return _common.launch_info(kern)
    return run


def _value_modelled(config: dict, shape: dict) -> bool:
    """Where smem_kernels' value-side figure is the compiler's: C*R probed (32 and 64), several P steps."""
    c = {**DEFAULTS, **config}
    return shape["C"] * shape["R"] in (32, 64) and c["BLOCK_P"] < shape["P"]


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

    # Scan, bytes (its products have SCAN_BJ rows: mma.sync). stage (one per pipeline stage beyond the
    # first): cp.async buffers of the chunk loop's fp32 loads (bf16 / fp16 loads, of unknown alignment
    # in an AOT compile, are not pipelined): cos and sin 4 F BJ each, DA_CS rows 4 F and the last step's 4,
    # MIMO_O / MIMO_Z 4 R BP each when present. body: the largest of the q_hat^T operand e BJ F, the dS
    # tile's conversion e BJ BP and dy's rows' e (C or F) BP, those conversions at full size (upper
    # bounds where they decide: they take rounds).
    bj, bp = c["SCAN_BJ"], c["SCAN_BP"]
    stage = 2 * 4 * F * bj + 4 * F + 4 + 4 * R * bp * (bool(shape["hasZ"]) + bool(shape["reduceO"]))
    body = max(e * bj * F, e * bj * bp, e * (C if shape["reduceO"] else F) * bp)
    scan = (c["scan_stages"] - 1) * stage + body

    # Key side. Split wgmma (sm_90a, 64 rows, 8 warps): after the P loop dkq_m and dqk_t are staged as
    # A operands (e F F each), the fp32 rotated q / k [F, KEY_BJ] change layout (4 F BJ) and q_hat's B
    # operands lo / hi stay staged (e F BJ each); in the P loop (less at the named shapes) PsiV's and
    # dy's operands (e F BP, dy's twice) and the dS / STATES tiles (e BJ BP each). mma.sync (sm_121a,
    # or a wgmma whose warps do not split N): the P loop's PsiV and dy operands (e F BP each) and a
    # cross-warp sum's scratch (4 bytes a warp), or after it dqk's transposed operand (e F F) and an
    # [F, BJ] one.
    bj, bp, w = c["KEY_BJ"], c["KEY_BP"], c["key_warps"]
    if wgmma(F, w)[1]:
        key = max(2 * e * F * F + 4 * F * bj + 2 * e * F * bj, 3 * e * F * bp + 4 * e * bj * bp)
    else:
        key = max(2 * e * F * bp + 4 * w, e * F * F + e * F * bj)

    # Value side, bytes (the compiler's figure where _value_modelled, else a bound: smem_inexact).
    # ff = e F F: the dPsiV operand (A of dy), staged all P loop long; kt = 2 e F VALUE_BJ: a k_hat
    # (or q_hat) tile of one N step, both rotary halves; ds = 2 e VALUE_BJ BLOCK_P: its dS tile;
    # dy = e F BLOCK_P: dy's operand, from its cast to PsiV dy^T; red = 4 F BLOCK_P: with D, the
    # reduction scratch of the D term's [C, R, BLOCK_P] (fp32), in the region the N loop's tiles use.
    # With one N step (VALUE_BJ = N/2) the products take one rotary half each, and k_hat q_hat^T reaches
    # the dPsiV product from registers: on split wgmma an fp32 [F, F] conversion decides; on mma.sync
    # dy's operand beside the larger of both halves' k_hat and dS tiles (kt + ds: loaded before dy is
    # built, so all four are staged at once) and the D term's scratch, or k_hat q_hat^T's two half tiles.
    bj, bp, w = c["VALUE_BJ"], c["BLOCK_P"], c["chunk_warps"]
    ff, kt, ds, dy = e * F * F, 2 * e * F * bj, 2 * e * bj * bp, e * F * bp
    red = 4 * F * bp * bool(shape["hasD"])
    one = bj == shape["N"] // 2
    wide = 4 * F * F * (wgmma(F, w)[1] and one)
    if not _value_modelled(config, shape):
        value = max(ff + dy + max(kt + ds, red), 2 * kt, kt + ds + 2 * dy, wide)
    elif one and wide:
        value = wide
    elif one:
        value = max(kt, dy + max(kt + ds, red))
    else:
        value = ff + dy + max(kt + ds, red)

    # The scan's local pass (with segments) stages the same tiles without the dS store: at most the scan's.
    local = {"scan_local": scan} if "scan_local" in kernels(config, shape) else {}
    # angles, reduce and _prep (dy stored in the layout it is loaded and built in): registers only. The
    # chunk kernels stage the same with dy_prep: dy, loaded, is fenced as the dy they build.
    prep = {"prep": 0} if c["dy_prep"] else {}
    if c["fused_chunk"]:
        # Fused kernel, a bound (smem_inexact): q_hat and k_hat's operands, e F N for each, and four
        # [F, BLOCK_P] tiles (PsiV's and dy's operands, in their layouts, in the P loop). At C*R = 64 it is
        # the compiler's figure on sm_90a with BLOCK_P = 32, 11-19% above it with 64; about twice it
        # on sm_121a (mma.sync stages less). BLOCK_P = 128 (94,208 B on sm_90a at training) is beyond it.
        chunk = 2 * e * F * shape["N"] + 4 * e * F * c["BLOCK_P"]
        return {**prep, "angles": 0, "scan": scan, **local, "chunk": chunk, "reduce": 0}
    return {**prep, "angles": 0, "scan": scan, **local, "key": key, "value": value, "reduce": 0}


def smem_inexact(config: dict, shape: dict, target: str) -> set:
    """The kernels whose smem_kernels figure is an upper bound, not the compiler's figure."""
    c = {**DEFAULTS, **config}
    F = shape["C"] * shape["R"]
    bj = c["SCAN_BJ"]
    dy_rows = shape["C"] if shape["reduceO"] else F
    out = {"scan_local"} & set(kernels(config, shape))   # bounded by the scan's figure
    if bj * F < max(bj, dy_rows) * c["SCAN_BP"]:
        out.add("scan")           # a layout conversion's scratch (rounds per warp count) decides
    if F not in (32, 64) or c["KEY_BP"] == shape["P"]:
        out.add("key")            # C*R outside 32 and 64: not probed; or one P step: its layouts change
    if not _value_modelled(config, shape):
        out.add("value")          # likewise: the bound stands
    if c["fused_chunk"]:
        out.add("chunk")          # a bound (smem_kernels)
    return out & set(kernels(config, shape))


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA, bytes: the largest of the kernels' (compile_for's smem_bytes), from
    what each stages in shared memory under Triton 3.6 for an ahead-of-time compile: cp.async buffers
    of its pipelined fp32 loads, GEMM operands (mma.sync converts them through shared memory one at a
    time; sm_90a's warpgroup MMA, taken for products of 64 or 128 rows, reads B from shared memory,
    and A too when its warps split N), and layout-conversion scratch (terms in smem_kernels).

    Over the sweep space (sweeps/mamba_bwd_bwd/triton.toml) at every named shape, each kernel's figure
    equals the compiler's for sm_90a and sm_121a (tests/test_triton_mamba.py) except where smem_inexact
    names it; there it is an upper bound (dy_prep's configs are compiled there at gb10 and training; with
    it the chunk kernels' figures are those without it, checked at every named shape when written). The
    key side's and the value side's figures are exact at C*R = 32 and 64 with more than one P step (every
    named shape). The scan's is a bound where its dS / dy layout conversion outweighs the q_hat^T operand
    (at the named shapes: SCAN_BP = 128, or R = 1, or unreduced DOUT); that bound gives the largest figure
    only at grid_n128_p128_r4_c8 with SCAN_BP = 128. The fused chunk kernel's figure is a bound (checked
    at the named shapes it takes, where it is the largest), so that a fused config's preflight is an
    upper bound too. Not modelled: C*R >= 256 (over every device's limit)."""
    return max(smem_kernels(config, shape, target).values())


def _signatures(shape: dict) -> dict:
    """Argument types of each kernel of ``kernels`` (keyed by name) for an ahead-of-time compile."""
    e, f = f"*{_TL[shape['dtype']]}", "*fp32"
    dims = dict(S="i32", H="i32", G="i32", NC="i32")
    scan = dict(Q=e, QB=f, COS=f, SIN=f, DA=f, DOUT=e, PHI=f, Z=e, ZETA=f, DS=e, CARRY=f, DECAY=f, **dims)
    key = dict(Q=e, K=e, QB=f, KB=f, V=e, PSI=f, COS=f, SIN=f, DA=f, DAR=f, DT=f, TRAP=e, SEG=f, DOUT=e, PHI=f, Z=e,
               ZETA=f, DY=e, STATES="*bf16", DS=e, DQ=e, DK=e, DANG=f, ROW_WS=f, DDA_WS=f, DD_WS=f, QH=e, KH=e, **dims)
    value = dict(QH=e, KH=e, V=e, PSI=f, DAR=f, DT=f, TRAP=e, QKD=e, SEG=f, DOUT=e, PHI=f, Z=e,
                 ZETA=f, DY=e, DPARAM=f, DS=e, ROW_WS=f, DDA_WS=f, DV=e, DFACTOR=f, DGAMMA=f, DDA=f, DDA_CS=f,
                 DDA_CS_REV=f, DSSDA=f, DPSI_WS=f, **dims)
    chunk = dict(Q=e, K=e, QB=f, KB=f, V=e, PSI=f, COS=f, SIN=f, DA=f, DAR=f, DT=f, TRAP=e, QKD=e, SEG=f, DOUT=e,
                 PHI=f, Z=e, ZETA=f, DY=e, DPARAM=f, STATES="*bf16", DS=e, DQ=e, DK=e, DANG=f, DV=e, DFACTOR=f,
                 DGAMMA=f, DDA=f, DDA_CS=f, DDA_CS_REV=f, DSSDA=f, DPSI_WS=f, DD_WS=f, **dims)
    reduce = dict(DPSI_WS=f, DD_WS=f, DPSI=f, DD=f, H="i32", NC="i32")
    angles = dict(ANG=f, COS=f, SIN=f, n="i32")
    prep = dict(DOUT=e, PHI=f, Z=e, ZETA=f, DY=e, S="i32", H="i32", NC="i32")
    return {"prep": prep, "angles": angles, "scan_local": scan, "scan": scan, "key": key, "value": value,
            "chunk": chunk, "reduce": reduce}


_FNS = {"prep": _prep, "angles": _angles, "scan_local": _scan, "scan": _scan, "key": _chunk_k, "value": _chunk_v,
        "chunk": _chunk, "reduce": _reduce}


def compile_kernel(name: str, config: dict, shape: dict, target: str) -> dict:
    """One kernel of ``kernels`` ("prep", "angles", "scan_local", "scan", "key", "value", "chunk", "reduce") for
    ``target`` (no GPU)."""
    config = {**DEFAULTS, **config}
    return _common.aot(_FNS[name], _signatures(shape)[name], _kernel_consts(config, shape)[name], target,
                       **_launch_opts(config)[name])


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """The config's kernels (``kernels``) for ``target`` (no GPU); smem_bytes / registers are the largest of them."""
    per = {name: compile_kernel(name, config, shape, target) for name in kernels(config, shape)}
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] or 0 for v in per.values()) or None,
            "compile_s": sum(v["compile_s"] for v in per.values()), "binary": "cubin", "kernels": per}
