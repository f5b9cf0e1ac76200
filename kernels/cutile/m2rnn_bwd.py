"""cuTile lane for m2rnn_bwd: backprop through time per (batch row, value head). Math and layouts:
lab/problems/_m2rnn.py; the contract copies kernels/triton/m2rnn_bwd.py (per-value-head gradient buffers;
shared q / k / W / f heads and dW's batch sum folded by lab.problems._m2rnn.reduce_heads afterwards).

The kernels follow what the forward lane (kernels/cutile/m2rnn_fwd.py) learned from tileiras' sm_90a
SASS: steps unrolled inside a chunk (``ct.static_iter``) so rows come out of chunk tiles at constant
indices, per-step values stacked into chunk tiles with ``ct.insert`` and reduced once per chunk
(a reduction over the BK rows crosses warps through shared memory with block barriers), one load and one
store per chunk and array. Every store -> load dependence between programs crosses a kernel boundary:
cuTile orders no weak memory accesses across a program's threads (its memory_model page).

Per step t, from the last to the first (H_{t-1} the state before step t, Z its tanh):
    Z = tanh(H_{t-1} W + k_t v_t^T);  dz = (1 - f_t)(1 - Z^2)
    G = dH + q_t dy_t^T;  dX = dz G;  dH = dX W^T + f_t G      (the serial chain)
    dW += H_{t-1}^T dX;  dk_t = sum_V dX v_t;  dv_t = sum_K dX k_t;  df_t = sum G (H_{t-1} - Z)
    dq_t = H_t dy_t,  H_t = f_t H_{t-1} + (1 - f_t) Z
Only the chain is serial; two structures (WALK) take it apart from the rest.

WALK = "chain" (``_fwd_ckpt``, then ``_seg3`` launched NSEG + 2 times, ``schedule3``): the checkpointing
forward (grid B*N) carries the fp32 state H [BK, BV] through chunks of T_FWD steps, stores the state before
every CKPT-th step to ``ckpt`` [B*N, NSEG, BK, BV] and, since dy is an input, dq_t (the states after each
step stacked, reduced over V once per chunk). Each segment launch has grid B*N x (2 + G_SPLIT): role 0
walks the chain of one segment in chunks of T steps, dz as the recompute stored it, storing G; role 1
recomputes the segment before it from its checkpoint into a scratch [B*N, CKPT, BK, BV] (the states before
each step, and dz); roles 2.. take the gradients of the segment after it, whose chain ran in the previous
launch (``_grads``: Z again, dX, dk / dv / df as batched reductions, dW as a product of the states loaded
again transposed and padded to 64 rows; one dW part per program and segment, summed by torch). States are
buffered by segment mod 3, dz and G mod 2, so the three segments of a launch never share a buffer and every
buffer is read in a later launch than its write.

WALK = "store" (``_fwd_store``, ``_chain_all``, ``_grads_all``): no checkpoints. The forward keeps every
state before its step ([B*N, S, BK, BV], int64-indexed: 2.8e9 elements at b8_n84); then one chain program
per (batch row, head) walks all S steps and B*N x G_SPLIT programs take all gradients, dW as block-diagonal
products of the chunk's own tiles (``_dw_diag``), each kernel with its own occupancy hint (fwd_occupancy,
occupancy, g_occupancy). DZ_STORE picks one of two pairs of forward and chain:
  - DZ_STORE: the forward stacks a chunk's states and dz and stores each once per chunk of T_FWD; the chain
    loads dz; the gradient kernel takes dq;
  - no DZ_STORE: the forward stores each step's state from the step's registers and takes dq as one-hot
    products (``_fwd_steps``); the chain recomputes each step's Z in its step loop.
PIPE cuts the chain into pieces, one launch each on a high-priority stream; each piece's gradients run on the
caller's stream once its chain is done, beside the next piece's chain. The cost is the traffic: states, dz
and G written and read once each (B*N*S*BK*BV elements each way).

Scratch dtype (``scratch_dtype``): bf16 when the products take bf16 operands (DOT = input, bf16 inputs),
which round the states to bf16 anyway, so the stored states lose nothing; fp32 otherwise.

Steps past a ragged S read zero q / k / v / dy and get f = 1, so they leave dH unchanged and add
nothing; stores drop rows past S. K and V are padded to powers of two >= 16 (BK, BV): zero-padded
loads keep padded rows / columns of H and dH at zero.

cuTile gives no control of threads, registers or shared memory; tileiras decides them under the
occupancy hints. Tunables:
  WALK              "chain" or "store" (above)
  CKPT              WALK = chain: checkpoint interval (steps), ceil(S/CKPT) + 2 launches (WALK = store: STORE_CKPT)
  T, T_FWD          steps per chunk of the chain (and WALK = chain's recompute) and of the forward (unrolled)
  KV                k v^T as broadcast outer products ("outer") or, in WALK = store's forward only, as
                    one-hot masked products over 16-step windows ("fwd", bf16 inputs: exact products)
  T_G, G_SPLIT      the gradient programs' chunk (steps) and programs per (batch row, head) and segment
                    (chain) or sequence (store)
  DZ_STORE          WALK = store: the forward / chain pair above (WALK = chain: always stored)
  PIPE              WALK = store: pieces of the chain, each one launch, whose gradients run beside the
                    next piece's chain (two streams); 1 for WALK = chain
  STEP_MMA          the serial products (the forward / recompute step, the chain's dH): "2d" (tileiras
                    picks wgmma on sm_90a), "batched" (a batch of one: mma.sync) or "fwd" (batched in the
                    forward / recompute step only); ``_serial``
  PARTIALS          WALK = store, bf16 inputs: dtype of the per-value-head dq / dk / dv / df buffers
  DOT               operands of the products for bf16 inputs: input (bf16, upstream's choice), tf32,
                    tf32x3 (hi/lo split, ~fp32), ieee (fp32 mma); fp32 inputs always use ieee
  FAST_TANH         ct.tanh(rounding_mode=APPROX) (MUFU.TANH) vs RoundingMode.FULL
  occupancy, fwd_occupancy, g_occupancy  @ct.kernel CTAs-per-SM hints of the chain / segment kernel, the
                    forward and (WALK = store) the gradient kernel
RETIRED names former knobs (``retired_values``: what the code fixes them to); old configs still name them.

Read to learn the API (no code copied): cuda-tile 1.7.0 installed source (cuda/tile/_stub.py docstrings
of load (order) / store / extract / insert / static_iter / mma / tanh, _memory_model.py, _execution.py
kernel hints, _compile.py bytecode versions), NVIDIA/cutile-python samples AttentionFMHA.py, docs
performance.rst and memory_model.rst; kernels/cutile/gemm.py (export) and m2rnn_fwd.py (this lab).
"""
from __future__ import annotations

import time

import torch
import cuda.tile as ct

from kernels import _targets
from kernels.cutile.gemm import ARCHS, _gpu_code, cubin_resources, export_cubin, versions  # noqa: F401
from lab.problems import _m2rnn as m2

DSL = "cutile"
KERNEL = "m2rnn_bwd"
# Former knobs, now fixed code or a function of other knobs (``retired_values``). Configs recorded before they
# went (results tables, the gate's previous bests) name them, so TUNABLES still lists them and config_reason
# accepts a config that gives one the value the code has for it; DEFAULTS leaves them out.
RETIRED = ("T_RE", "ROLES", "STORE", "C_ROWS", "num_worker_warps", "SCRATCH", "DW", "FWD_STORE", "DQ", "CHAIN_Z")
TUNABLES = ("CKPT", "T", "T_FWD", "KV", "WALK", "T_G", "G_SPLIT", "DZ_STORE", "PIPE", "STEP_MMA", "PARTIALS",
            "DOT", "FAST_TANH", "occupancy", "fwd_occupancy", "g_occupancy") + RETIRED
# Default: WALK = "chain" at CKPT 128, T = 4, dz stored, 4 gradient programs per segment (the b2_n8 seed of
# sweeps/m2rnn_bwd/cutile.toml). Configs recorded without a knob ran with its default: these values stay.
# WALK = "store" keeps no checkpoints: CKPT stays at this value (one config per distinct kernel).
STORE_CKPT = 64
DEFAULTS = {"CKPT": 128, "T": 4, "T_FWD": 16, "KV": "outer", "WALK": "chain", "T_G": 4, "G_SPLIT": 4,
            "DZ_STORE": True, "PIPE": 1, "STEP_MMA": "2d", "PARTIALS": "float32", "DOT": "input",
            "FAST_TANH": True, "occupancy": 1, "fwd_occupancy": 3, "g_occupancy": 0}
TARGETS = tuple(f"sm_{a}a" if a in (90, 100, 103, 110, 120, 121) else f"sm_{a}" for a in ARCHS)
DTYPES = ("float32", "bfloat16")
DOTS = ("input", "tf32", "tf32x3", "ieee")
WALKS = ("chain", "store")
KERNEL_NAMES = ("forward", "backward", "gradients")
PIPES = (1, 8, 16)
# STEP_MMA: the bits of DOT (``dot_mode``) that batch the serial products (``_serial``): 4 the forward /
# recompute step, 8 dH of the chain.
STEP_MMAS = {"2d": 0, "batched": 12, "fwd": 4}
PARTIALS = ("float32", "bfloat16")
G_SPLITS = (2, 4, 8, 16)
KVS = ("outer", "fwd")
CKPTS = (64, 128)
CHUNKS = {"T": (2, 4), "T_FWD": (8, 16), "T_G": (2, 4)}
OCCUPANCIES = {"occupancy": (1, 6), "fwd_occupancy": (2, 3), "g_occupancy": (0, 2, 3)}
MAX_BK, MAX_BV = 64, 32
_CT = {"float32": ct.float32, "bfloat16": ct.bfloat16}
_ELEM = {"float32": 4, "bfloat16": 2}

C = ct.Constant[int]
CB = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
F32 = ct.float32


# ---- device code --------------------------------------------------------------------------------

def _tanh(x, FAST):
    if FAST:
        return ct.tanh(x, rounding_mode=ct.RoundingMode.APPROX)
    return ct.tanh(x, rounding_mode=ct.RoundingMode.FULL)


def _prod(a, b, acc, DOT, B_EXACT):
    """acc + a @ b for fp32 tiles a, b. DOT % 4 (the higher bits are ``_serial``'s): 0 bf16 operands, 1 tf32, 2 three
    tf32 products (hi/lo split; two when B_EXACT, i.e. b is a bf16 value and so exact in tf32), 3 fp32 mma."""
    mode = DOT % 4
    if mode == 0:
        return ct.mma(a.astype(ct.bfloat16), b.astype(ct.bfloat16), acc)
    if mode == 3:
        return ct.mma(a, b, acc)
    ah = a.astype(ct.tfloat32)
    bh = b.astype(ct.tfloat32)
    acc = ct.mma(ah, bh, acc)
    if mode == 2:
        acc = ct.mma((a - ah.astype(F32)).astype(ct.tfloat32), bh, acc)
        if not B_EXACT:
            acc = ct.mma(ah, (b - bh.astype(F32)).astype(ct.tfloat32), acc)
    return acc


def _recompute_z(hs, w, acc, DOT, FAST, SCB):
    """Z = tanh(H W + acc) for stacked states hs [T, BK, BV] as loaded from the scratch: with bf16 operands
    (DOT input) and a bf16 scratch the loaded tile is the product's operand as it is (no round trip
    through fp32, which cost the chain and the gradient kernel unpack and repack instructions)."""
    if SCB and DOT % 4 == 0:
        return _tanh(ct.mma(hs, w.astype(ct.bfloat16), acc), FAST)
    return _tanh(_prod(hs.astype(F32), w, acc, DOT, True), FAST)


def _serial(a, b, acc, DOT, B_EXACT, BIT):
    """``_prod`` for the products on a serial chain, [M, K] x [K, N]: BIT 4 for the forward / recompute step,
    8 for dH = dX W^T + f G of the chain. With that bit of DOT set (``dot_mode``) as a batch of one,
    [1, M, K] x [1, K, N]: for a 2-D product of this size tileiras emits a warpgroup wgmma on sm_90a (HGMMA,
    with its fence / arrive / commit / wait each step), for a batched one warp-level mma.sync (HMMA), as in
    the forward lane's step."""
    M = a.shape[0]
    K = a.shape[1]
    N = b.shape[1]
    if (DOT // BIT) % 2 == 1:
        a = a.reshape((1, M, K))
        b = b.reshape((1, K, N))
        acc = acc.reshape((1, M, N))
    return _prod(a, b, acc, DOT, B_EXACT).reshape((M, N))


def _load_w(W, nw, BV):
    return ct.load(W, (nw, 0, 0), (1, BV, BV), padding_mode=ZERO).reshape((BV, BV)).astype(F32)


def _cols(x, b, h, c, T, BX):
    """Steps [c*T, c*T + T) of head h of x [B, S, H, X] as a [BX, T] fp32 tile (one step per column;
    zeros past S and X)."""
    return ct.load(x, (b, h, 0, c), (1, 1, BX, T), order=(0, 2, 3, 1), padding_mode=ZERO).reshape((BX, T)).astype(F32)


def _rows(x, b, h, c, T, BX):
    """The same steps as a [T, BX] fp32 tile (one step per row)."""
    return ct.load(x, (b, h, c, 0), (1, 1, T, BX), order=(0, 2, 1, 3), padding_mode=ZERO).reshape((T, BX)).astype(F32)


def _gates(f, b, h, c, T, S):
    """f of steps [c*T, c*T + T) as [1, T] fp32, 1 past S (a step that keeps the state as it is)."""
    fc = ct.load(f, (b, h, c), (1, 1, T), order=(0, 2, 1), padding_mode=ZERO).reshape((1, T)).astype(F32)
    pos = ct.arange(T, dtype=ct.int32).reshape((1, T)) + c * T
    return ct.where(pos < S, fc, 1.0)


KW = 16   # steps of the window the one-hot products take as their K (the bf16 mma's K is 16)


def _pair(x, y, b, hx, hy, c, T, BX, BY, KV):
    """Chunk c's x as [BX, T] and y as [T, BY] (one step per column / row), and where step i of the chunk is
    in them. With KV the tiles are bf16 (exact: the inputs are bf16) and, for chunks shorter than KW, those of
    the KW-step window holding the chunk (the one-hot product needs K >= 16), at offset (c*T) % KW."""
    if KV:
        if T < KW:
            cw = (c * T) // KW
            return (_cols(x, b, hx, cw, KW, BX).astype(ct.bfloat16), _rows(y, b, hy, cw, KW, BY).astype(ct.bfloat16),
                    (c * T) % KW)
        return _cols(x, b, hx, c, T, BX).astype(ct.bfloat16), _rows(y, b, hy, c, T, BY).astype(ct.bfloat16), 0
    return _cols(x, b, hx, c, T, BX), _rows(y, b, hy, c, T, BY), 0


def _outer(xc, yc, off, i, BX, BY, T, KV):
    """x_i y_i^T [BX, BY] fp32 for step i of a chunk from ``_pair``'s tiles. With KV it is the product of x's
    tile with its columns other than off + i zeroed and y's tile: tileiras writes that straight into the mma
    accumulator layout, where the broadcast outer product cost about 70 shuffles and selects per step (sm_90a
    SASS of the forward lane). Exact either way: one bf16 x bf16 product per element."""
    if KV:
        W = max(T, KW)
        xm = ct.where(ct.arange(W, dtype=ct.int32).reshape((1, W)) == off + i, xc, ct.zeros((BX, W), dtype=ct.bfloat16))
        return ct.mma(xm, yc, ct.zeros((BX, BY), dtype=F32))
    return ct.extract(xc, (0, i), (BX, 1)) * ct.extract(yc, (i, 0), (1, BY))


def _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, KV):
    """(Z, H') of step i of a chunk from the state h: Z = tanh(h W + k v^T), H' = f h + (1 - f) Z."""
    ft = ct.extract(ff, (0, i), (1, 1))
    z = _tanh(_serial(h, w, _outer(kc, vc, off, i, BK, BV, T, KV), DOT, True, 4), FAST)
    return z, ft * h + (1.0 - ft) * z


def _program(v, W, N, GW, BV):
    """(bn, b, n, S, w) of a program on grid axis 0 = batch row x value head: its index, batch row, head,
    the sequence length and the head's W [BV, BV] in fp32."""
    bn = ct.bid(0)
    n = bn % N
    return bn, bn // N, n, v.shape[1], _load_w(W, n // GW, BV)


def _initial_state(h0, b, n, BK, BV, HAS_H0):
    """The state before step 0, [BK, BV] fp32: h0's (zero-padded) or zeros."""
    if HAS_H0:
        return ct.load(h0, (b, n, 0, 0), (1, 1, BK, BV), padding_mode=ZERO).reshape((BK, BV)).astype(F32)
    return ct.zeros((BK, BV), dtype=F32)


def _fwd_chunk(h, w, k, v, f, b, n, c, S, GK, GF, BK, BV, T, DOT, FAST):
    """Chunk c (T steps) of the forward from the state h before it: (its states after each step, stacked
    [T, BK, BV]; the state after the chunk)."""
    kc, vc, off = _pair(k, v, b, n // GK, n, c, T, BK, BV, False)
    ff = _gates(f, b, n // GF, c, T, S)
    out = ct.zeros((T, BK, BV), dtype=F32)
    for i in ct.static_iter(range(T)):
        z, h = _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, False)
        out = ct.insert(out, (i, 0, 0), h.reshape((1, BK, BV)))
    return out, h


def _fwd_ckpt(k, v, W, f, dy, h0, ckpt, dq,
              N: C, GK: C, GW: C, GF: C, BK: C, BV: C, CKPT: C, T: C, HAS_H0: CB, DOT: C, FAST: CB):
    """WALK = "chain", grid B*N. States H_{j*CKPT - 1} into ckpt [B*N, NSEG, BK, BV]; dq_t = H_t dy_t (per value head)
    into dq [B, S, N, K] fp32."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    h = _initial_state(h0, b, n, BK, BV, HAS_H0)
    per = CKPT // T
    nch = ct.cdiv(S, T)
    for j in range(ct.cdiv(S, CKPT)):
        ct.store(ckpt, (bn, j, 0, 0), h.reshape((1, 1, BK, BV)))
        for cc in range(min(per, nch - j * per)):
            c = j * per + cc
            hs, h = _fwd_chunk(h, w, k, v, f, b, n, c, S, GK, GF, BK, BV, T, DOT, FAST)
            dqc = ct.sum(hs * _rows(dy, b, n, c, T, BV).reshape((T, 1, BV)), axis=2)        # [T, BK]
            ct.store(dq, (b, n, c, 0), dqc.reshape((1, 1, T, BK)), order=(0, 2, 1, 3))


def _recompute(k, v, w, f, ckpt, sc, dzo, b, n, bn, jr, Lr, S,
               GK, GF, BK, BV, CKPT, T, DOT, FAST, SCB):
    """sc[bn, i] = the state before step jr*CKPT + i, and dzo[bn, i] = (1 - f)(1 - Z^2) of that step (the
    chain's factor), for the Lr steps of segment jr, in whole chunks of T (the chain's chunk, so they cover
    every row the chain's chunks read; rows past S keep the state: f = 1 there); with SCB both as bf16."""
    h = ct.load(ckpt, (bn, jr, 0, 0), (1, 1, BK, BV)).reshape((BK, BV))
    _replay(k, v, w, f, h, sc, dzo, b, n, bn, jr * (CKPT // T), ct.cdiv(Lr, T), S, GK, GF, BK, BV, T, DOT,
            FAST, False, SCB)


def _replay(k, v, w, f, h, sc, dzo, b, n, bn, c0, nch, S, GK, GF, BK, BV, T, DOT, FAST, KV, SCB):
    """From the state h before chunk c0 (global chunks of T steps), run nch chunks; chunk c's states before
    each step go to sc[bn, c*T + i] and (1 - f)(1 - Z^2) to dzo (one store per chunk each)."""
    for c in range(nch):
        cg = c0 + c
        kc, vc, off = _pair(k, v, b, n // GK, n, cg, T, BK, BV, KV)
        ff = _gates(f, b, n // GF, cg, T, S)
        hs = ct.zeros((T, BK, BV), dtype=F32)
        dzs = ct.zeros((T, BK, BV), dtype=F32)
        for i in ct.static_iter(range(T)):
            hs = ct.insert(hs, (i, 0, 0), h.reshape((1, BK, BV)))
            z, h = _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, KV)
            ft = ct.extract(ff, (0, i), (1, 1))
            dzs = ct.insert(dzs, (i, 0, 0), ((1.0 - ft) * (1.0 - z * z)).reshape((1, BK, BV)))
        ct.store(sc, (bn, c, 0, 0), _scr(hs, SCB).reshape((1, T, BK, BV)))
        ct.store(dzo, (bn, c, 0, 0), _scr(dzs, SCB).reshape((1, T, BK, BV)))


def _scr(x, SCB):
    """x as stored in the scratch: bf16 with SCB, else fp32 as it is."""
    if SCB:
        return x.astype(ct.bfloat16)
    return x


def _outer_stack(x, y, b, hx, hy, cg, T, BX, BY):
    """[T, BX, BY] fp32: x_t y_t^T for the T steps of chunk cg (one broadcast product of the chunk's rows)."""
    return _rows(x, b, hx, cg, T, BX).reshape((T, BX, 1)) * _rows(y, b, hy, cg, T, BY).reshape((T, 1, BY))


def _chain(q, k, v, w, f, dy, sc, dzi, dh_in, dh_out, go, b, n, bn, jc, Lc, S,
           GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, DZ, SCB, GL):
    """Only the serial chain of segment jc (Lc steps), per chunk of T from the last (GL, WALK = "store": the
    scratch holds every step, indexed by the global chunk; else the segment's alone):
    G = dH + q dy^T, dX = dz G, dH = dX W^T + f G, with dz = (1 - f)(1 - Z^2) loaded from dzi (DZ) or, without
    DZ, each step's Z recomputed from the states in sc as its own 2-D product inside the step loop, off the
    chain (a product batched per chunk is a warp-level mma whose accumulator layout is not the serial
    wgmma's, so its dz would cross shared memory with block barriers on sm_90a); the chunk's G stacked and
    stored to go. dk, dv, df and dW are left to ``_grads``."""
    wt = ct.transpose(w)
    dH = ct.load(dh_in, (bn, 0, 0), (1, BK, BV)).reshape((BK, BV))
    per = CKPT // T
    nch = ct.cdiv(Lc, T)
    for cc in range(nch):
        c = nch - 1 - cc
        cg = jc * per + c
        cs = cg if GL else c
        ff = _gates(f, b, n // GF, cg, T, S).reshape((T, 1, 1))
        if DZ:
            dz = ct.load(dzi, (bn, cs, 0, 0), (1, T, BK, BV)).reshape((T, BK, BV)).astype(F32)
        else:
            hraw = ct.load(sc, (bn, cs, 0, 0), (1, T, BK, BV)).reshape((T, BK, BV))
        qdy = _outer_stack(q, dy, b, n // GQ, n, cg, T, BK, BV)
        gs = ct.zeros((T, BK, BV), dtype=F32)
        if not DZ:
            kvs = _outer_stack(k, v, b, n // GK, n, cg, T, BK, BV)
        for ii in ct.static_iter(range(T)):
            i = T - 1 - ii
            ft = ct.extract(ff, (i, 0, 0), (1, 1, 1)).reshape((1, 1))
            G = dH + ct.extract(qdy, (i, 0, 0), (1, BK, BV)).reshape((BK, BV))
            if not DZ:
                zi = _recompute_z(ct.extract(hraw, (i, 0, 0), (1, BK, BV)).reshape((BK, BV)), w,
                                  ct.extract(kvs, (i, 0, 0), (1, BK, BV)).reshape((BK, BV)), DOT, FAST, SCB)
                dX = (1.0 - ft) * (1.0 - zi * zi) * G
            else:
                dX = ct.extract(dz, (i, 0, 0), (1, BK, BV)).reshape((BK, BV)) * G
            dH = _serial(dX, wt, ft * G, DOT, True, 8)
            gs = ct.insert(gs, (i, 0, 0), G.reshape((1, BK, BV)))
        ct.store(go, (bn, cs, 0, 0), _scr(gs, SCB).reshape((1, T, BK, BV)))
    ct.store(dh_out, (bn, 0, 0), dH.reshape((1, BK, BV)))


def _grads(k, v, w, f, dy, sc, gi, dq, dk, dv, df, dwo, b, n, bn, jg, Lg, part, S,
           GK, GF, GS, BK, BV, CKPT, TG, DOT, FAST, DQ, SUB, RAG, GL, SCB):
    """The gradients of segment jg (WALK = "chain") or piece jg (WALK = "store") that are not on the chain,
    from its states (sc) and the chain's G (gi), in chunks of TG steps; program ``part`` of GS takes chunks
    part, part + GS, ...
    Per chunk Z is recomputed (one batched product), dX = (1 - f)(1 - Z^2) G, and dk = dX v, dv = k^T dX,
    df = sum G (H - Z) are batched reductions. dW += H^T dX: with SUB > 0 (``dw_sub``), per SUB steps one
    [SUB*BV, BK] x [BK, SUB*BV] product of the chunk's own states and dX (transposed in registers), whose
    diagonal [BV, BV] blocks t = t' are the steps' H_t^T dX_t; the off-diagonal ones are summed along and
    dropped once per program (WALK = "store"). Else one [MP, TG*BK] x [TG*BK, BV] product of the states
    loaded again transposed and zero-padded to 64 rows (a 64-row product is the wgmma shape; tileiras lowers
    a 16-row one to FFMA). The segment's dW part goes to dwo[bn, jg*GS + part]. With RAG (S not a multiple of
    the segment / chunk) rows past S are zeroed: a chunk longer than the chain's or the recompute's may read
    scratch rows no launch wrote. With DQ also dq_t = H_t dy_t, H_t = f H_{t-1} + (1 - f) Z (WALK = "store"
    with DZ_STORE, whose forward writes no dq). GL as ``_chain``."""
    MP = max(64, BV)
    if SUB:
        dwp = ct.zeros((SUB * BV, SUB * BV), dtype=F32)
    else:
        dwp = ct.zeros((MP, BV), dtype=F32)
    per = CKPT // TG
    nch = ct.cdiv(Lg, TG)
    for cc in range(ct.cdiv(nch - part, GS)):
        c = part + cc * GS
        cg = jg * per + c
        cs = cg if GL else c
        hraw = ct.load(sc, (bn, cs, 0, 0), (1, TG, BK, BV)).reshape((TG, BK, BV))
        g = ct.load(gi, (bn, cs, 0, 0), (1, TG, BK, BV)).reshape((TG, BK, BV)).astype(F32)
        hc = hraw.astype(F32)
        if RAG:
            live = ct.arange(TG, dtype=ct.int32).reshape((TG, 1, 1)) + cg * TG < S
            hc = ct.where(live, hc, 0.0)
            g = ct.where(live, g, 0.0)
        kr = _rows(k, b, n // GK, cg, TG, BK).reshape((TG, BK, 1))
        vr = _rows(v, b, n, cg, TG, BV).reshape((TG, 1, BV))
        ff = _gates(f, b, n // GF, cg, TG, S).reshape((TG, 1, 1))
        kv = kr * vr
        # Rows past S were never written (any bits): with RAG their Z comes from the zeroed states.
        z = _recompute_z(hc if RAG else hraw, w, kv, DOT, FAST, SCB and not RAG)
        dxs = _grad_sums(hc, z, g, ff, kr, vr, dy, dq, dk, dv, df, b, n, cg, BK, BV, TG, DQ)
        if SUB:
            # bf16 operands straight from a bf16 scratch when no row needs zeroing (no round trip via fp32).
            dwp = _dw_diag(dwp, hraw if DOT % 4 == 0 and not RAG else hc, dxs, BK, BV, TG, DOT, SUB)
        else:
            hpt = ct.load(sc, (bn, 0, cs, 0), (1, MP, TG, BK), order=(0, 3, 1, 2), padding_mode=ZERO)
            hpt = hpt.reshape((MP, TG, BK)).astype(F32)
            if RAG:
                hpt = ct.where(live.reshape((1, TG, 1)), hpt, 0.0)
            dwp = _prod(hpt.reshape((MP, TG * BK)), dxs.reshape((TG * BK, BV)), dwp, DOT, False)
    if SUB:
        dw = _dw_fold(dwp, BV, SUB)
    else:
        dw = ct.extract(dwp, (0, 0), (BV, BV))
    ct.store(dwo, (bn, jg * GS + part, 0, 0), dw.reshape((1, 1, BV, BV)))


def _grad_sums(hc, z, g, ff, kr, vr, dy, dq, dk, dv, df, b, n, cg, BK, BV, TG, DQ):
    """Chunk cg's gradients off the chain from its states before each step hc, Z, G (each [TG, BK, BV]),
    f [TG, 1, 1], k [TG, BK, 1] and v [TG, 1, BV]: dk = dX v, dv = k^T dX, df = sum G (H - Z) and, with DQ,
    dq = H_t dy_t (H_t = f H_{t-1} + (1 - f) Z), each one batched reduction and one store. Returns dX
    [TG, BK, BV]."""
    dxs = (1.0 - ff) * (1.0 - z * z) * g
    ct.store(dk, (b, n, cg, 0), ct.sum(dxs * vr, axis=2).reshape((1, 1, TG, BK)).astype(dk.dtype), order=(0, 2, 1, 3))
    ct.store(dv, (b, n, cg, 0), ct.sum(dxs * kr, axis=1).reshape((1, 1, TG, BV)).astype(dv.dtype), order=(0, 2, 1, 3))
    ct.store(df, (b, n, cg),
             ct.sum(ct.sum(g * (hc - z), axis=2), axis=1).reshape((1, 1, TG)).astype(df.dtype), order=(0, 2, 1))
    if DQ:
        hn = ff * hc + (1.0 - ff) * z
        dyr = _rows(dy, b, n, cg, TG, BV).reshape((TG, 1, BV))
        ct.store(dq, (b, n, cg, 0),
                 ct.sum(hn * dyr, axis=2).reshape((1, 1, TG, BK)).astype(dq.dtype), order=(0, 2, 1, 3))
    return dxs


def _dw_diag(dwp, hs, dxs, BK, BV, TG, DOT, SUB):
    """dwp + per SUB steps of the chunk the [SUB*BV, SUB*BV] product of its states hs (transposed in
    registers) and dX; its diagonal [BV, BV] blocks are the steps' H_{t-1}^T dX_t (``_dw_fold``)."""
    for s in ct.static_iter(range(TG // SUB)):
        ha = ct.permute(ct.extract(hs, (s, 0, 0), (SUB, BK, BV)), (0, 2, 1)).reshape((SUB * BV, BK))
        xb = ct.permute(ct.extract(dxs, (s, 0, 0), (SUB, BK, BV)), (1, 0, 2)).reshape((BK, SUB * BV))
        dwp = _prod(ha, xb, dwp, DOT, False)
    return dwp


def _dw_fold(dwp, BV, SUB):
    """The sum of the diagonal [BV, BV] blocks of ``_dw_diag``'s accumulator."""
    step = ct.arange(SUB, dtype=ct.int32)
    eye = step.reshape((SUB, 1, 1, 1)) == step.reshape((1, 1, SUB, 1))
    return ct.sum(ct.sum(ct.where(eye, dwp.reshape((SUB, BV, SUB, BV)), 0.0), axis=2), axis=0)


def _seg3(q, k, v, W, f, dy, ckpt, h_re, h_ch, h_gr, dz_re, dz_ch, g_ch, g_gr, dh_in, dh_out, dk, dv, df, dwo,
          jc: int, Lc: int, jr: int, Lr: int, jg: int, Lg: int,
          N: C, GQ: C, GK: C, GW: C, GF: C, BK: C, BV: C, CKPT: C, T: C, TG: C, GS: C, DOT: C, FAST: CB,
          SCB: CB, SUB: C, RAG: CB):
    """One launch of WALK = "chain" (``schedule3``), grid B*N x (2 + GS): role 0 walks the chain of
    segment jc (dz as the recompute stored it), role 1 recomputes segment jr, roles 2.. take the gradients of
    segment jg (jc's successor, whose chain ran in the previous launch). A role with no steps does nothing.
    No array is both read and written here."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    role = ct.bid(1)
    if role == 0:
        if Lc > 0:
            _chain(q, k, v, w, f, dy, h_ch, dz_ch, dh_in, dh_out, g_ch, b, n, bn, jc, Lc, S,
                   GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, True, SCB, False)
    elif role == 1:
        if Lr > 0:
            _recompute(k, v, w, f, ckpt, h_re, dz_re, b, n, bn, jr, Lr, S, GK, GF, BK, BV, CKPT, T, DOT, FAST,
                       SCB)
    else:
        if Lg > 0:
            _grads(k, v, w, f, dy, h_gr, g_gr, dk, dk, dv, df, dwo, b, n, bn, jg, Lg, role - 2, S,
                   GK, GF, GS, BK, BV, CKPT, TG, DOT, FAST, False, SUB, RAG, False, SCB)


def schedule3(nseg: int, S: int, ckpt: int) -> list[tuple[int, int, int, int, int, int]]:
    """(jc, Lc, jr, Lr, jg, Lg) of the NSEG + 2 launches of WALK = "chain": launch m walks the chain of
    segment jc = NSEG - m, recomputes jr = jc - 1 and takes the gradients of jg = jc + 1 (L = 0 where
    the segment does not exist). The lane picks buffers by segment: states j % 3 (written at launch
    NSEG - j - 1, read at NSEG - j and NSEG - j + 1), dz and G j % 2, so within a launch the three
    segments' buffers are distinct."""
    def seg_len(j):
        return min(ckpt, S - j * ckpt) if 0 <= j < nseg else 0
    return [(nseg - m, seg_len(nseg - m), nseg - m - 1, seg_len(nseg - m - 1), nseg - m + 1, seg_len(nseg - m + 1))
            for m in range(nseg + 2)]


def _fwd_store(k, v, W, f, dy, h0, hs: ct.IndexedWithInt64, dzs: ct.IndexedWithInt64, dq,
               N: C, GK: C, GW: C, GF: C, BK: C, BV: C, T: C, HAS_H0: CB, DOT: C, FAST: CB, KV: CB, DZ: CB,
               SCB: CB, RAGF: CB):
    """WALK = "store", grid B*N: the forward through all S steps, storing every state before its step to
    hs [B*N, S, BK, BV] (int64 indexing: 2.8e9 elements at b8_n84). With DZ stacked per chunk, with
    (1 - f)(1 - Z^2) to dzs (``_replay``; the gradient kernel takes dq); else per step, with dq_t = H_t dy_t
    to dq (``_fwd_steps``)."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    h = _initial_state(h0, b, n, BK, BV, HAS_H0)
    if not DZ:
        _fwd_steps(k, v, w, f, dy, h, hs, dq, b, n, bn, S, GK, GF, BK, BV, T, DOT, FAST, KV, SCB, RAGF)
    else:
        _replay(k, v, w, f, h, hs, dzs, b, n, bn, 0, ct.cdiv(S, T), S, GK, GF, BK, BV, T, DOT, FAST, KV, SCB)


def _fwd_steps(k, v, w, f, dy, h, hs, dq, b, n, bn, S, GK, GF, BK, BV, T, DOT, FAST, KV, SCB, RAGF):
    """The storing forward without dz: one [BK, BV] store per step from the step's registers (no [T, BK, BV]
    stack: tileiras moves the step's tile to a store layout through shared memory, one block barrier, then
    one 16-byte global store per thread), and dq as a one-hot product per step into a [BK, T]
    accumulator: dq[:, i] += H_t (dy chunk [BV, T] with every column but i zeroed), exact products of the
    bf16-rounded state (K = BV), one store per chunk. The chunk's inputs are loaded one chunk ahead. With
    RAGF (S not a multiple of T) steps past S store nothing (a tile wholly outside an array is undefined)."""
    nch = ct.cdiv(S, T)
    kc, vc, off = _pair(k, v, b, n // GK, n, 0, T, BK, BV, KV)
    ff = _gates(f, b, n // GF, 0, T, S)
    dyc = _cols(dy, b, n, 0, T, BV)
    col = ct.arange(T, dtype=ct.int32).reshape((1, T))
    for c in range(nch):
        cn = min(c + 1, nch - 1)
        kn, vn, offn = _pair(k, v, b, n // GK, n, cn, T, BK, BV, KV)
        fn = _gates(f, b, n // GF, cn, T, S)
        dyn = _cols(dy, b, n, cn, T, BV)
        dqa = ct.zeros((BK, T), dtype=F32)
        for i in ct.static_iter(range(T)):
            t = c * T + i
            _store_step(hs, bn, t, h, S, BK, BV, SCB, RAGF)
            z, h = _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, KV)
            # A batch of one: mma.sync with both operands in registers (a wgmma reads B from shared
            # memory, which the per-step mask would have to be written to, with a block barrier).
            dqa = _prod(h.reshape((1, BK, BV)), ct.where(col == i, dyc, 0.0).reshape((1, BV, T)),
                        dqa.reshape((1, BK, T)), DOT, True).reshape((BK, T))
        ct.store(dq, (b, n, 0, c), dqa.reshape((1, 1, BK, T)).astype(dq.dtype), order=(0, 2, 3, 1))
        kc, vc, off, ff, dyc = kn, vn, offn, fn, dyn


def _store_step(x, bn, t, tile, S, BK, BV, SCB, RAGF):
    """tile [BK, BV] as row t of x [B*N, S, BK, BV]; with RAGF only when t < S."""
    if RAGF:
        if t < S:
            ct.store(x, (bn, t, 0, 0), _scr(tile, SCB).reshape((1, 1, BK, BV)))
    else:
        ct.store(x, (bn, t, 0, 0), _scr(tile, SCB).reshape((1, 1, BK, BV)))


def _chain_all(q, k, v, W, f, dy, hs: ct.IndexedWithInt64, dzs: ct.IndexedWithInt64, dh_in, dh_out,
               gs: ct.IndexedWithInt64, jp: int, Lp: int,
               N: C, GQ: C, GK: C, GW: C, GF: C, BK: C, BV: C, T: C, DOT: C, FAST: CB, DZ: CB, SCB: CB,
               PL: C):
    """WALK = "store", grid B*N: ``_chain`` through piece jp (Lp steps from step jp*PL) in one program (dz
    loaded with DZ, else Z recomputed per step from the stored states), G to gs [B*N, S, BK, BV]."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    _chain(q, k, v, w, f, dy, hs, dzs, dh_in, dh_out, gs, b, n, bn, jp, Lp, S,
           GQ, GK, GF, BK, BV, PL, T, DOT, FAST, DZ, SCB, True)


def _grads_all(k, v, W, f, dy, hs: ct.IndexedWithInt64, gs: ct.IndexedWithInt64, dq, dk, dv, df, dwo,
               jp: int, Lp: int,
               N: C, GK: C, GW: C, GF: C, GS: C, BK: C, BV: C, TG: C, DOT: C, FAST: CB, SUB: C, RAG: CB,
               PL: C, DQG: CB, SCB: CB):
    """WALK = "store", grid B*N x GS: ``_grads`` (with dq when the forward takes none, DQG) over piece jp (as
    ``_chain_all``), program bid(1) taking every GS-th chunk of TG steps; dW parts to dwo [B*N, PIPE*GS, BV,
    BV]."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    _grads(k, v, w, f, dy, hs, gs, dq, dk, dv, df, dwo, b, n, bn, jp, Lp, ct.bid(1), S,
           GK, GF, GS, BK, BV, PL, TG, DOT, FAST, DQG, SUB, RAG, True, SCB)


_KERNELS: dict = {}


def _kernels(config: dict) -> dict:
    """{"forward", "backward"[, "gradients"]}: the ``ct.kernel`` objects of the config's walk with its
    occupancy hints (0 = compiler's choice); "backward" is the segment kernel, or with WALK = "store" the
    chain, and "gradients" that walk's gradient kernel."""
    fns = {"chain": (_fwd_ckpt, _seg3), "store": (_fwd_store, _chain_all, _grads_all)}[config["WALK"]]
    hints = (config["fwd_occupancy"], config["occupancy"], config["g_occupancy"])
    key = (hints, tuple(fn.__name__ for fn in fns))
    if key not in _KERNELS:
        _KERNELS[key] = {name: ct.kernel(fn, occupancy=occ or None) for name, fn, occ in zip(KERNEL_NAMES, fns, hints)}
    return _KERNELS[key]


# ---- lane interface -----------------------------------------------------------------------------

def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def dot_mode(config: dict, shape: dict) -> int:
    """The kernels' DOT: the operand mode (DOTS index; fp32 inputs always multiply in fp32, as the
    problem's fp32 band assumes) plus STEP_MMA's bits (``_serial``)."""
    mode = 3 if shape["dtype"] == "float32" else DOTS.index(config["DOT"])
    return mode + STEP_MMAS[config["STEP_MMA"]]


def config_reason(config: dict, shape: dict) -> str | None:
    config = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    if _block(shape["K"]) > MAX_BK or _block(shape["V"]) > MAX_BV:
        return (f"K={shape['K']}, V={shape['V']}: the padded state tile [{_block(shape['K'])}, {_block(shape['V'])}] "
                f"exceeds [{MAX_BK}, {MAX_BV}]: the chunk stacks of T such tiles would spill")
    if config["CKPT"] not in CKPTS:
        return f"CKPT={config['CKPT']} must be one of {', '.join(map(str, CKPTS))}"
    for key, values in CHUNKS.items():
        if config[key] not in values:
            return f"{key}={config[key]} must be one of {', '.join(map(str, values))}"
    if config["KV"] not in KVS:
        return f"KV={config['KV']!r} must be one of {', '.join(KVS)}"
    if config["KV"] != "outer" and shape["dtype"] != "bfloat16":
        return f"KV={config['KV']}: the one-hot products need bf16 inputs (exact products)"
    if config["KV"] == "fwd" and config["WALK"] != "store":
        return "KV=fwd (one-hot products in the forward only) applies to WALK=store"
    if config["WALK"] not in WALKS:
        return f"WALK={config['WALK']!r} must be one of {', '.join(WALKS)}"
    reason = _walk_reason(config, shape)
    if reason:
        return reason
    if config["DOT"] not in DOTS:
        return f"DOT={config['DOT']!r} must be one of {', '.join(DOTS)}"
    if not isinstance(config["STEP_MMA"], str) or config["STEP_MMA"] not in STEP_MMAS:
        return f"STEP_MMA={config['STEP_MMA']!r} must be one of {', '.join(STEP_MMAS)}"
    if not isinstance(config["FAST_TANH"], bool):
        return "FAST_TANH must be true or false"
    for key, values in OCCUPANCIES.items():
        if config[key] not in values:
            return f"{key}={config[key]} must be one of {', '.join(map(str, values))}"
    reason = _retired_reason(config, shape)
    if reason:
        return reason
    B, S, N = shape["B"], shape["S"], shape["N"]
    tile = _block(shape["K"]) * _block(shape["V"])
    # The scratch of WALK = "store" (every state) is indexed in int64; the others' arrays are not.
    rows = config["G_SPLIT"] if config["WALK"] == "store" else max(_nseg(config, shape) * config["G_SPLIT"],
                                                                   config["CKPT"])
    if max(B * S * N * _block(max(shape["K"], shape["V"])), B * N * rows * tile) >= 2**31:
        return "arrays with 2^31 or more elements need int64 indexing, which this lane does not specialize"
    return None


def _walk_reason(config: dict, shape: dict) -> str | None:
    """The rules of the knobs that depend on the walk; WALK = "store" keeps CKPT at STORE_CKPT."""
    walk = config["WALK"]
    if config["G_SPLIT"] not in G_SPLITS:
        return f"G_SPLIT={config['G_SPLIT']} must be one of {', '.join(map(str, G_SPLITS))}"
    if not isinstance(config["DZ_STORE"], bool):
        return "DZ_STORE must be true or false"
    if walk != "store" and not config["DZ_STORE"]:
        return "WALK=chain: the recompute stores dz for the chain: DZ_STORE must be true"
    if config["PIPE"] not in PIPES or (walk != "store" and config["PIPE"] != 1):
        return f"PIPE={config['PIPE']} must be one of {', '.join(map(str, PIPES))}, and 1 unless WALK=store"
    if config["PARTIALS"] not in PARTIALS:
        return f"PARTIALS={config['PARTIALS']!r} must be one of {', '.join(PARTIALS)}"
    if config["PARTIALS"] != "float32" and (walk != "store" or shape["dtype"] != "bfloat16"):
        return "PARTIALS=bfloat16 (per-value-head dq / dk / dv / df in bf16) applies to WALK=store with bf16 inputs"
    if walk == "store" and config["CKPT"] != STORE_CKPT:
        return f"WALK=store keeps every state (no checkpoints): CKPT must stay {STORE_CKPT}"
    return None


def retired_values(config: dict, shape: dict) -> dict:
    """What each RETIRED knob is in the code that runs ``config`` (a full config): T_RE 0 (the recompute's
    chunk is T), ROLES "split", STORE "h", C_ROWS 1 and num_worker_warps 0 (the compiler's choice); SCRATCH
    the ``scratch_dtype``; DW "pad" with WALK = "chain" (``_grads``' padded product) and "diag" with
    WALK = "store"; FWD_STORE, DQ and CHAIN_Z "chunk", "grads" and "chunk" with DZ_STORE, else "step", "fwd"
    and "step"."""
    dz = config["DZ_STORE"]
    return {"T_RE": 0, "ROLES": "split", "STORE": "h", "C_ROWS": 1, "num_worker_warps": 0,
            "SCRATCH": scratch_dtype(config, shape), "DW": "diag" if config["WALK"] == "store" else "pad",
            "FWD_STORE": "chunk" if dz else "step", "DQ": "grads" if dz else "fwd",
            "CHAIN_Z": "chunk" if dz else "step"}


def _retired_reason(config: dict, shape: dict) -> str | None:
    """A RETIRED knob that a config still names must have the value the code has for it."""
    want = retired_values(config, shape)
    for key in RETIRED:
        if key in config and (config[key] != want[key] or type(config[key]) is not type(want[key])):
            return f"{key}={config[key]!r}: no longer a knob; this config runs with {key}={want[key]!r}"
    return None


def scratch_dtype(config: dict, shape: dict) -> str:
    """The dtype of the stored states, dz and G: bf16 when the products take bf16 operands (DOT = input with
    bf16 inputs; they round the states to bf16 anyway, so the bf16 scratch loses nothing), else fp32."""
    return "bfloat16" if dot_mode(config, shape) % 4 == 0 else "float32"


def eligibility(target: str) -> str | None:
    if _targets.cc(target) not in ARCHS:
        return f"cuTile (tileiras 13.5) has no code generation for {target} (has {', '.join(TARGETS)})"
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA, bytes: an upper bound, the target's opt-in per-block limit. tileiras alone
    decides what it stages (TMA landing buffers of the chunk tiles and the [T, BK, BV] scratch chunk,
    layout conversions for the per-step rows and the once-per-chunk reductions), sized to the target and
    the occupancy hint, so the analytic figure is only this bound; ``compile_for`` gives the exact one
    and the preflight uses it."""
    return _targets.smem_optin(target)


def _consts(config: dict, shape: dict) -> dict:
    N = shape["N"]
    return {"N": N, "GQ": N // shape["Nq"], "GK": N // shape["Nk"], "GW": N // shape["Nw"], "GF": N // shape["Nf"],
            "BK": _block(shape["K"]), "BV": _block(shape["V"]), "CKPT": config["CKPT"], "T": config["T"],
            "T_FWD": config["T_FWD"], "KVF": config["KV"] != "outer",
            "DOT": dot_mode(config, shape), "FAST": bool(config["FAST_TANH"]), "TG": config["T_G"],
            "GS": config["G_SPLIT"], "DZ": config["DZ_STORE"], "SCB": scratch_dtype(config, shape) == "bfloat16",
            "SUB": dw_sub(config, shape), "RAG": _ragged(config, shape), "PL": piece_len(config, shape),
            "DQG": config["DZ_STORE"], "RAGF": shape["S"] % config["T_FWD"] != 0}



def piece_len(config: dict, shape: dict) -> int:
    """WALK = "store": steps per chain / gradient piece, S / PIPE rounded up to a multiple of 16 (of every
    chunk length), so that pieces start on chunk boundaries; the last piece may be shorter."""
    return -(-shape["S"] // (16 * config["PIPE"])) * 16


def pieces(config: dict, shape: dict) -> int:
    return -(-shape["S"] // piece_len(config, shape))


def dw_sub(config: dict, shape: dict) -> int:
    """WALK = "store": steps per block-diagonal dW product of the gradient programs, so that its
    [SUB*BV, SUB*BV] result has at most 64 rows (one wgmma M); 0 for WALK = "chain" (the padded product)."""
    return max(1, min(config["T_G"], 64 // _block(shape["V"]))) if config["WALK"] == "store" else 0


def _ragged(config: dict, shape: dict) -> bool:
    """Whether a gradient chunk can reach past S: S not a multiple of the store walk's chunk or of the
    chain walk's segment (CKPT, a multiple of T_G); only then are its rows masked."""
    return shape["S"] % (config["T_G"] if config["WALK"] == "store" else config["CKPT"]) != 0


_FWD_CONSTS = ("N", "GK", "GW", "GF", "BK", "BV", "CKPT", "T_FWD", "HAS_H0", "DOT", "FAST")
_CHAIN_CONSTS = ("N", "GQ", "GK", "GW", "GF", "BK", "BV", "CKPT", "T", "TG", "GS", "DOT", "FAST", "SCB", "SUB", "RAG")


# The compile-time arguments of the WALK = "store" kernels, by kernel name. KVF: the forward's KV (KV = "fwd":
# one-hot products there, broadcast ones in the chain and the gradients); DQG: the gradient kernel takes dq.
_STORE_CONSTS = {"forward": ("N", "GK", "GW", "GF", "BK", "BV", "T_FWD", "HAS_H0", "DOT", "FAST", "KVF", "DZ", "SCB",
                             "RAGF"),
                 "backward": ("N", "GQ", "GK", "GW", "GF", "BK", "BV", "T", "DOT", "FAST", "DZ", "SCB", "PL"),
                 "gradients": ("N", "GK", "GW", "GF", "GS", "BK", "BV", "TG", "DOT", "FAST", "SUB", "RAG",
                               "PL", "DQG", "SCB")}


def _nseg(config: dict, shape: dict) -> int:
    return -(-shape["S"] // config["CKPT"])


def _array(dtype: str, size: tuple, index64: bool = False):
    """The ArrayConstraint cuTile's JIT derives for a contiguous, 16-byte aligned torch tensor (the rules
    of kernels/cutile/gemm.py's _array_constraint, any rank); index64 for a parameter annotated
    ``ct.IndexedWithInt64``."""
    from cuda.tile.compilation import ArrayConstraint
    elem = _ELEM[dtype]
    strides = [1]
    for s in reversed(size[1:]):
        strides.insert(0, strides[0] * s)
    return ArrayConstraint(_CT[dtype], len(size), index_dtype=ct.int64 if index64 else ct.int32,
                           stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=tuple(1 if s == 1 else None for s in strides),
                           stride_divisible_by=tuple(16 // elem if s * elem % 16 == 0 else 1 for s in strides),
                           shape_divisible_by=tuple(16 if d % 16 == 0 else 1 for d in size),
                           base_addr_divisible_by=16)


def _scratch_dims(config: dict, shape: dict) -> tuple:
    """One scratch buffer of states or of G: [B*N, CKPT, BK, BV] (WALK = "chain": one segment); with
    WALK = "store" all S steps: [B*N, S, BK, BV]."""
    rows = shape["S"] if config["WALK"] == "store" else config["CKPT"]
    return shape["B"] * shape["N"], rows, _block(shape["K"]), _block(shape["V"])


def _dz_dims(config: dict, shape: dict) -> tuple:
    """One dz buffer: a scratch buffer with DZ_STORE, else a placeholder never read."""
    return _scratch_dims(config, shape) if config["DZ_STORE"] else (1, 1, _block(shape["K"]), _block(shape["V"]))


def _dw_dims(config: dict, shape: dict) -> tuple:
    """dW parts: one [BV, BV] per (batch row and head, segment (WALK = "chain") or piece (WALK = "store"),
    gradient program)."""
    bv = _block(shape["V"])
    segs = pieces(config, shape) if config["WALK"] == "store" else _nseg(config, shape)
    return shape["B"] * shape["N"], segs * config["G_SPLIT"], bv, bv


def _signatures(config: dict, shape: dict):
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    dt, bk, bv, nseg = shape["dtype"], _block(K), _block(V), _nseg(config, shape)
    c = {**_consts(config, shape), "HAS_H0": bool(shape["h0"])}
    i32 = ScalarConstraint(ct.int32)
    g = lambda *s: _array("float32", s)  # noqa: E731
    k, v, dy = _array(dt, (B, S, shape["Nk"], K)), _array(dt, (B, S, N, V)), _array(dt, (B, S, N, V))
    W, f = _array(dt, (shape["Nw"], V, V)), _array(dt, (B, S, shape["Nf"]))
    ck = g(B * N, nseg, bk, bv)
    fwd = [k, v, W, f, dy, _array(dt, (B, N, K, V)), ck, g(B, S, N, K)] + [c[n] for n in _FWD_CONSTS]
    dh = g(B * N, bk, bv)
    grads = [g(B, S, N, K), g(B, S, N, V), g(B, S, N)]
    scr = scratch_dtype(config, shape)
    if config["WALK"] == "chain":
        h = _array(scr, _scratch_dims(config, shape))
        dz = _array(scr, _dz_dims(config, shape))
        bwd = [_array(dt, (B, S, shape["Nq"], K)), k, v, W, f, dy, ck, h, h, h, dz, dz, h, h, dh, dh, *grads,
               g(*_dw_dims(config, shape)), *[i32] * 6] + [c[n] for n in _CHAIN_CONSTS]
    if config["WALK"] == "store":
        big = _array(scr, _scratch_dims(config, shape), index64=True)
        dzb = _array(scr, _dz_dims(config, shape), index64=True)
        con = {name: [c[n] for n in names] for name, names in _STORE_CONSTS.items()}
        part = lambda *s: _array(config["PARTIALS"], s)  # noqa: E731
        grads = [part(B, S, N, K), part(B, S, N, V), part(B, S, N)]
        bwd = [_array(dt, (B, S, shape["Nq"], K)), k, v, W, f, dy, big, dzb, dh, dh, big, i32, i32] + \
            con["backward"]
        fwd = [k, v, W, f, dy, _array(dt, (B, N, K, V)), big, dzb, grads[0]] + con["forward"]
        gr = [k, v, W, f, dy, big, big, *grads[:1], *grads, g(*_dw_dims(config, shape)), i32, i32] + \
            con["gradients"]
    cc = CallingConvention.cutile_python_v1()
    sigs = {"forward": KernelSignature(fwd, cc), "backward": KernelSignature(bwd, cc)}
    if config["WALK"] == "store":
        sigs["gradients"] = KernelSignature(gr, cc)
    return sigs


def compile_cubins(config: dict, shape: dict, target: str, which=("forward", "backward")) -> dict:
    """{"forward": cubin, "backward": cubin} (those in ``which``) for ``target`` (no GPU needed)."""
    config = {**DEFAULTS, **config}
    reason = eligibility(target) or config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    kernels = _kernels(config)
    sigs = _signatures(config, shape)
    which = [name for name in which if name in kernels] + (["gradients"] if "gradients" in kernels else [])
    return {name: export_cubin(kernels[name], sigs[name], _gpu_code(target)) for name in which}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Every kernel of the config for ``target``; smem_bytes / registers / stack_bytes are the largest."""
    t0 = time.perf_counter()
    cubins = compile_cubins(config, shape, target)
    seconds = time.perf_counter() - t0
    res = {name: cubin_resources(c, target) for name, c in cubins.items()}
    top = {key: max(r[key] or 0 for r in res.values()) for key in ("smem_bytes", "registers", "stack_bytes")}
    return {**top, "compile_s": seconds, "binary": "cubin", "kernels": res}


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    reason = config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    kernels = _kernels(config)
    fwd, bwd = kernels["forward"], kernels["backward"]
    c = {**_consts(config, shape), "HAS_H0": bool(shape["h0"])}
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    bk, bv, nseg = c["BK"], c["BV"], _nseg(config, shape)
    grid_fwd = (B * N, 1, 1)
    store = config["WALK"] == "store"
    grid = (B * N, 2 + config["G_SPLIT"], 1)       # WALK = "chain": the segment launches
    plan = [] if store else schedule3(nseg, S, config["CKPT"])
    work: dict = {}

    def alloc(dev):
        f32 = {"dtype": torch.float32, "device": dev}
        part = {"dtype": getattr(torch, config["PARTIALS"]), "device": dev}
        scr = {"dtype": getattr(torch, scratch_dtype(config, shape)), "device": dev}
        work.clear()
        work.update(dev=dev, ckpt=torch.empty(B * N, nseg, bk, bv, **f32),
                    dh=[torch.zeros(B * N, bk, bv, **f32) for _ in range(2)],
                    dq=torch.empty(B, S, N, K, **part), dk=torch.empty(B, S, N, K, **part),
                    dv=torch.empty(B, S, N, V, **part), df=torch.empty(B, S, N, **part))
        if store:
            work.update(h=torch.empty(*_scratch_dims(config, shape), **scr),
                        dz=torch.empty(*_dz_dims(config, shape), **scr),
                        g=torch.empty(*_scratch_dims(config, shape), **scr),
                        dwp=torch.empty(*_dw_dims(config, shape), **f32))
            if pieces(config, shape) > 1:
                # Highest priority: the chain is the critical path; its CTAs go before waiting gradient CTAs.
                work.update(chain_stream=torch.cuda.Stream(device=dev, priority=-5),
                            events=[torch.cuda.Event() for _ in range(pieces(config, shape))])
        else:
            work.update(h=[torch.empty(*_scratch_dims(config, shape), **scr) for _ in range(3)],
                        dz=[torch.empty(*_dz_dims(config, shape), **scr) for _ in range(2)],
                        g=[torch.empty(*_scratch_dims(config, shape), **scr) for _ in range(2)],
                        dwp=torch.empty(*_dw_dims(config, shape), **f32))

    def walk(i, stream):
        """The segment launches; returns (dW [B*N, BV, BV], dh0 [B*N, BK, BV]) from the work buffers."""
        w = work
        args = (i["q"], i["k"], i["v"], i["W"], i["f"], i["dy"], w["ckpt"])
        consts = [c[n] for n in _CHAIN_CONSTS]
        for m, p in enumerate(plan):
            j = nseg - m            # the chain's segment; buffers by segment, also where a role is idle
            bufs = (w["h"][(j - 1) % 3], w["h"][j % 3], w["h"][(j + 1) % 3], w["dz"][(j - 1) % 2],
                    w["dz"][j % 2], w["g"][j % 2], w["g"][(j + 1) % 2], w["dh"][(m + 1) % 2], w["dh"][m % 2],
                    w["dk"], w["dv"], w["df"], w["dwp"])
            ct.launch(stream, grid, bwd, (*args, *bufs, *p, *consts))
        return w["dwp"].sum(1), w["dh"][nseg % 2]

    def run(inputs, outputs):
        i, o = inputs, outputs
        if work.get("dev") != i["v"].device:
            alloc(i["v"].device)
        w = work
        stream = torch.cuda.current_stream()
        h0 = i.get("h0", i["dh_final"])        # not read when there is no h0
        # dH starts at dh_final (in dh[0] for every schedule), dW at zero; padded rows / columns stay zero.
        w["dh"][0].zero_()
        w["dh"][0][:, :K, :V].copy_(i["dh_final"].reshape(B * N, K, V))
        if store:
            return run_store(i, o, stream, h0)
        ct.launch(stream, grid_fwd, fwd, (i["k"], i["v"], i["W"], i["f"], i["dy"], h0, w["ckpt"], w["dq"],
                                          *(c[n] for n in _FWD_CONSTS)))
        dw, dh0 = walk(i, stream)
        finish(o, dw, dh0)
        return {"grid": list(grid[:2]), "launches": 1 + len(plan)}

    def run_store(i, o, stream, h0):
        """WALK = "store": the storing forward, then per piece (last first) the chain on a high-priority
        stream and, once it is done, the piece's gradients on the caller's stream, so that the gradients of
        piece p run beside the chain of piece p - 1. 1 + 2 * PIPE launches."""
        w = work
        con = {name: [c[n] for n in names] for name, names in _STORE_CONSTS.items()}
        ct.launch(stream, grid_fwd, fwd, (i["k"], i["v"], i["W"], i["f"], i["dy"], h0, w["h"], w["dz"], w["dq"],
                                          *con["forward"]))
        npc, pl = pieces(config, shape), c["PL"]
        side = w["chain_stream"] if npc > 1 else stream
        if side is not stream:
            side.wait_stream(stream)
        for m in range(npc):
            p = npc - 1 - m
            lp = min(pl, S - p * pl)
            ct.launch(side, grid_fwd, bwd, (i["q"], i["k"], i["v"], i["W"], i["f"], i["dy"], w["h"], w["dz"],
                                            w["dh"][m % 2], w["dh"][(m + 1) % 2], w["g"], p, lp, *con["backward"]))
            if side is not stream:
                w["events"][m].record(side)
                stream.wait_event(w["events"][m])
            gargs = (i["k"], i["v"], i["W"], i["f"], i["dy"], w["h"], w["g"], w["dq"], w["dk"], w["dv"], w["df"],
                     w["dwp"], p, lp, *con["gradients"])
            ct.launch(stream, (B * N, config["G_SPLIT"], 1), kernels["gradients"], gargs)
        finish(o, w["dwp"].sum(1), w["dh"][npc % 2])
        return {"grid": [B * N, config["G_SPLIT"]], "launches": 1 + 2 * npc}

    def finish(o, dw, dh0):
        w = work
        parts = {n: w[n] for n in ("dq", "dk", "dv", "df")}
        parts["dW"] = dw[:, :V, :V].reshape(B, N, V, V)
        parts["dh0"] = dh0[:, :K, :V].reshape(B, N, K, V)
        grads = m2.reduce_heads(parts, shape)
        for name, value in grads.items():
            o[name].copy_(value)
    return run
