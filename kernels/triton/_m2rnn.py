"""Triton pieces shared by the M2RNN forward and backward lanes: tanh, one recurrence step, the
forward kernel (which also writes the backward's checkpoints), and the lane plumbing.

Layout of a program: one (batch row, value head) and a BLOCK_K-row slab of the K x V state, which
stays in registers (fp32) for the whole sequence: rows of H evolve independently (W multiplies from
the right, f is a scalar), so the forward may split K across programs; y then needs a sum over slabs.
Per step: one (BLOCK_K x V) @ (V x V) tensor-core product with H rounded to the input dtype (fp32
inputs: IEEE fp32 product), the rank-1 k v^T, tanh, the gate.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import TARGETS, aot, eligibility, interpreting  # noqa: F401  (used by both lanes)

DTYPES = ("float32", "bfloat16")
_TL_NAME = {"float32": "fp32", "bfloat16": "bf16"}


@triton.jit
def tanh(x, FAST: tl.constexpr):
    if FAST:
        # tanh.approx.f32 (sm_75+): one MUFU op, ~2^-11 relative error.
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def mm(a, b, DOT: tl.constexpr):
    """fp32 a @ b with operands as DOT says: 0 rounded to b's dtype (upstream's choice), 1 tf32,
    2 three tf32 products (about fp32 accuracy), 3 IEEE fp32."""
    if DOT == 0:
        return tl.dot(a.to(b.dtype), b)
    elif DOT == 1:
        return tl.dot(a, b.to(tl.float32), input_precision="tf32")
    elif DOT == 2:
        return tl.dot(a, b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a, b.to(tl.float32), input_precision="ieee")


@triton.jit
def step(h, Wt, kt, vt, ft, DOT: tl.constexpr, FAST: tl.constexpr):
    """One recurrence step on an fp32 state slab h [BK, BV]; returns (Z_t, H_t)."""
    a = mm(h, Wt, DOT)
    z = tanh(a + kt[:, None] * vt[None, :], FAST)
    return z, ft * h + (1.0 - ft) * z


@triton.jit
def step_inputs(k_row, v_row, f_row, q_row, t, S, NK, NQ, NF, mk, mv,
                N: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WITH_Q: tl.constexpr):
    """Step t's (k_t, v_t, f_t, q_t) in the input dtype, zeros past the sequence end; q_t only when
    WITH_Q (k_t stands in otherwise)."""
    ok = t < S
    kt = tl.load(k_row + t * NK * K, mask=mk & ok, other=0.0)
    vt = tl.load(v_row + t * N * V, mask=mv & ok, other=0.0)
    ft = tl.load(f_row + t * NF, mask=ok, other=0.0)
    if WITH_Q:
        qt = tl.load(q_row + t * NQ * K, mask=mk & ok, other=0.0)
    else:
        qt = kt
    return kt, vt, ft, qt


@triton.jit
def group_inputs(k_row, v_row, f_row, q_row, t0, S, NK, NQ, NF, mk, mv,
                 N: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WITH_Q: tl.constexpr, U: tl.constexpr):
    """The inputs of steps t0 .. t0+U-1, a tuple: loaded one group ahead of their use, so a step's
    global-load latency overlaps the previous group's U steps instead of stalling the chain."""
    res = ()
    for i in tl.static_range(U):
        res = res + (step_inputs(k_row, v_row, f_row, q_row, t0 + i, S, NK, NQ, NF, mk, mv, N, K, V, WITH_Q),)
    return res


@triton.jit
def forward_step(h, Wt, inp, t, ckpt_tile, y_row, mkv, mv, N: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, WRITE_Y: tl.constexpr, CKPT: tl.constexpr, DOT: tl.constexpr,
                 FAST: tl.constexpr):
    """Step t from its inputs ``inp``: the checkpoint of H_{t-1} when t % CKPT == 0, H_t, y_t."""
    if CKPT > 0:
        if t % CKPT == 0:
            tl.store(ckpt_tile + (t // CKPT) * K * V, h, mask=mkv)
    kt, vt, ft, qt = inp
    z, h = step(h, Wt, kt.to(tl.float32), vt.to(tl.float32), ft.to(tl.float32), DOT, FAST)
    if WRITE_Y:
        yt = tl.sum(h * qt.to(tl.float32)[:, None], axis=0)
        tl.store(y_row + t * N * V, yt.to(y_row.dtype.element_ty), mask=mv)
    return h


@triton.jit
def m2rnn_forward(q, k, v, W, f, h0, y, h_out, ckpt,
                  S, NQ, NK, NF, NW, NSEG,
                  N: tl.constexpr, KSPLIT: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                  HAS_H0: tl.constexpr, WRITE_Y: tl.constexpr, CKPT: tl.constexpr,
                  DOT: tl.constexpr, FAST: tl.constexpr, U: tl.constexpr):
    """Forward over all S steps, in groups of U steps whose inputs are loaded one group ahead.
    WRITE_Y: y (fp32 partial per K slab when KSPLIT > 1, else the output) and the final state;
    CKPT > 0: the state before every CKPT-th step into ckpt [B, N, NSEG, K, V]."""
    bn = tl.program_id(0)
    ks = tl.program_id(1)
    b = bn // N
    n = bn % N
    rk = ks * BK + tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]
    Wt = tl.load(W + (n // (N // NW)) * V * V + rv[:, None] * V + rv[None, :], mask=mv[:, None] & mv[None, :],
                 other=0.0)
    state = (b * N + n) * K * V + rk[:, None] * V + rv[None, :]
    if HAS_H0:
        h = tl.load(h0 + state, mask=mkv, other=0.0).to(tl.float32)
    else:
        h = tl.zeros((BK, BV), dtype=tl.float32)
    q_row = q + (b * S * NQ + n // (N // NQ)) * K + rk
    k_row = k + (b * S * NK + n // (N // NK)) * K + rk
    v_row = v + (b * S * N + n) * V + rv
    f_row = f + b * S * NF + n // (N // NF)
    y_row = y + ((ks * (tl.num_programs(0) // N) + b) * S * N + n) * V + rv    # [KSPLIT, B, S, N, V]
    ckpt_tile = ckpt + (b * N + n) * NSEG * K * V + rk[:, None] * V + rv[None, :]
    cur = group_inputs(k_row, v_row, f_row, q_row, 0, S, NK, NQ, NF, mk, mv, N, K, V, WRITE_Y, U)
    for t0 in range(0, S - U + 1, U):
        nxt = group_inputs(k_row, v_row, f_row, q_row, t0 + U, S, NK, NQ, NF, mk, mv, N, K, V, WRITE_Y, U)
        for i in tl.static_range(U):
            h = forward_step(h, Wt, cur[i], t0 + i, ckpt_tile, y_row, mkv, mv, N, K, V, WRITE_Y, CKPT, DOT, FAST)
        cur = nxt
    t0 = S - S % U                   # the last S % U steps: ``cur`` holds their inputs
    for i in tl.static_range(U - 1):
        if t0 + i < S:
            h = forward_step(h, Wt, cur[i], t0 + i, ckpt_tile, y_row, mkv, mv, N, K, V, WRITE_Y, CKPT, DOT, FAST)
    if WRITE_Y:
        tl.store(h_out + state, h.to(h_out.dtype.element_ty), mask=mkv)


def block(n: int) -> int:
    """Power-of-two tile >= 16 covering n (tl.dot needs 16 on each side)."""
    return max(16, triton.next_power_of_2(n))


DOTS = ("input", "tf32", "tf32x3", "ieee")


def dot_mode(config: dict, shape: dict) -> int:
    """fp32 inputs always multiply in IEEE fp32 (the problem's fp32 band assumes it)."""
    return 3 if shape["dtype"] == "float32" else DOTS.index(config["DOT"])


def common_reason(config: dict, shape: dict) -> str | None:
    """The rules both M2RNN lanes share (dtype); None when they hold. The values each knob may take are
    the sweep files' (sweeps/m2rnn_fwd/triton.toml, sweeps/m2rnn_bwd/triton.toml); the harness checks them."""
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    return None


def slab(config: dict, shape: dict) -> int:
    """BLOCK_K: rows of the state per program."""
    return block(-(-shape["K"] // config["K_SPLIT"]))


def ksplit_reason(config: dict, shape: dict) -> str | None:
    ks = config["K_SPLIT"]
    if slab(config, shape) * ks > block(shape["K"]):
        return f"K_SPLIT={ks}: K/K_SPLIT must be >= 16 (K={shape['K']})"
    return None


def fast_tanh(config: dict) -> bool:
    """The inline-PTX tanh cannot run in the interpreter: there the exact formula stands in (CPU tests)."""
    return bool(config["FAST_TANH"]) and not interpreting()


def forward_signature(shape: dict, y_fp32: bool) -> dict:
    t = f"*{_TL_NAME[shape['dtype']]}"
    return {"q": t, "k": t, "v": t, "W": t, "f": t, "h0": t, "y": "*fp32" if y_fp32 else t, "h_out": t,
            "ckpt": "*fp32", "S": "i32", "NQ": "i32", "NK": "i32", "NF": "i32", "NW": "i32", "NSEG": "i32"}



@triton.jit
def back_inputs(scr, tile, mkv, k_row, v_row, f_row, q_row, dy_row, t, i, ok, NK, NQ, NF, mk, mv,
                N: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """Step t's inputs for the reverse walk: H_{t-1} (segment row i of the scratch), k_t, v_t, f_t,
    q_t, dy_t; zeros where not ``ok``."""
    h_prev = tl.load(scr + i * K * V + tile, mask=mkv & ok, other=0.0)
    kt = tl.load(k_row + t * NK * K, mask=mk & ok, other=0.0)
    vt = tl.load(v_row + t * N * V, mask=mv & ok, other=0.0)
    ft = tl.load(f_row + t * NF, mask=ok, other=0.0)
    qt = tl.load(q_row + t * NQ * K, mask=mk & ok, other=0.0)
    dyt = tl.load(dy_row + t * N * V, mask=mv & ok, other=0.0)
    return h_prev, kt, vt, ft, qt, dyt


@triton.jit
def back_group(scr, tile, mkv, k_row, v_row, f_row, q_row, dy_row, t0, i0, NK, NQ, NF, mk, mv,
               N: tl.constexpr, K: tl.constexpr, V: tl.constexpr, U: tl.constexpr):
    """Reverse-walk inputs of segment rows i0, i0-1, .., i0-U+1 (steps t0+i0 downwards), a tuple."""
    res = ()
    for u in tl.static_range(U):
        res = res + (back_inputs(scr, tile, mkv, k_row, v_row, f_row, q_row, dy_row, t0 + i0 - u, i0 - u,
                                 i0 - u >= 0, NK, NQ, NF, mk, mv, N, K, V),)
    return res


@triton.jit
def back_step(dH, dW_acc, Wt, inp, t, g_k, g_v, g_f, dq, dk, dv, df, mk, mv,
              N: tl.constexpr, K: tl.constexpr, V: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr):
    """One BPTT step t from its inputs: writes dq_t, dk_t, dv_t, df_t; returns (dH_{t-1}, dW_acc)."""
    h_prev, kt, vt, ft, qt, dyt = inp
    kt = kt.to(tl.float32)
    vt = vt.to(tl.float32)
    ft = ft.to(tl.float32)
    qt = qt.to(tl.float32)
    dyt = dyt.to(tl.float32)
    z, h_t = step(h_prev, Wt, kt, vt, ft, DOT, FAST)
    tl.store(dq + g_k + t * N * K, tl.sum(h_t * dyt[None, :], axis=1), mask=mk)
    G = dH + qt[:, None] * dyt[None, :]
    tl.store(df + g_f + t * N, tl.sum(tl.sum(G * (h_prev - z), axis=1), axis=0))
    dX = (1.0 - ft) * G * (1.0 - z * z)
    dW_acc += mm(tl.trans(h_prev), dX.to(Wt.dtype) if DOT == 0 else dX, DOT)
    dXW = mm(dX, tl.trans(Wt), DOT)
    tl.store(dk + g_k + t * N * K, tl.sum(dX * vt[None, :], axis=1), mask=mk)
    tl.store(dv + g_v + t * N * V, tl.sum(dX * kt[:, None], axis=0), mask=mv)
    return ft * G + dXW, dW_acc


@triton.jit
def m2rnn_backward(q, k, v, W, f, dy, dh_final, ckpt, scratch, dq, dk, dv, df, dW, dh0,
                   S, NQ, NK, NF, NW, NSEG,
                   N: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                   CKPT: tl.constexpr, DOT: tl.constexpr, FAST: tl.constexpr, U: tl.constexpr):
    """Backprop through time for one (batch row, value head) and a BK-row slab of K (program_id 1):
    rows of dH evolve independently like rows of H, so only dv, df and dW (sums over K) need the
    slabs' partials, which land at [slab] of dv [KSPLIT, B, S, N, V], df [KSPLIT, B, S, N] and
    dW [KSPLIT, B, N, V, V]. Segments of CKPT steps are
    walked last to first: the segment's states are recomputed from its checkpoint into ``scratch``
    [B*N, CKPT, K, V] (fp32), then read back in reverse. Both walks run in groups of U steps whose
    inputs are loaded one group ahead. Per-value-head gradients go to fp32 buffers dq, dk [B, S, N, K],
    dv, df, dW as above, dh0 [B, N, K, V]; the lane sums slabs and shared heads afterwards."""
    bn = tl.program_id(0)
    ks = tl.program_id(1)
    b = bn // N
    n = bn % N
    slab = ks * tl.num_programs(0)            # B*N: partial buffers are [KSPLIT, B*N, ...]
    rk = ks * BK + tl.arange(0, BK)
    rv = tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    mkv = mk[:, None] & mv[None, :]
    tile = rk[:, None] * V + rv[None, :]
    Wt = tl.load(W + (n // (N // NW)) * V * V + rv[:, None] * V + rv[None, :], mask=mv[:, None] & mv[None, :],
                 other=0.0)
    dH = tl.load(dh_final + bn * K * V + tile, mask=mkv, other=0.0).to(tl.float32)
    dW_acc = tl.zeros((BV, BV), dtype=tl.float32)
    q_row = q + (b * S * NQ + n // (N // NQ)) * K + rk
    k_row = k + (b * S * NK + n // (N // NK)) * K + rk
    v_row = v + (b * S * N + n) * V + rv
    f_row = f + b * S * NF + n // (N // NF)
    dy_row = dy + (b * S * N + n) * V + rv
    g_k = (b * S * N + n) * K + rk
    g_v = (slab * S + b * S * N + n) * V + rv
    g_f = slab * S + b * S * N + n
    scr = scratch + bn * CKPT * K * V
    for jj in range(NSEG):
        j = NSEG - 1 - jj
        t0 = j * CKPT
        L = tl.minimum(CKPT, S - t0)
        h = tl.load(ckpt + (bn * NSEG + j) * K * V + tile, mask=mkv, other=0.0)
        tl.debug_barrier()                   # the previous segment's reads of scratch are done
        tl.store(scr + tile, h, mask=mkv)
        # Recompute H_{t0} .. H_{t0+L-2} into scratch rows 1 .. L-1 (steps t0 .. t0+L-2).
        cur = group_inputs(k_row, v_row, f_row, q_row, t0, t0 + L - 1, NK, NQ, NF, mk, mv, N, K, V, False, U)
        for i0 in range(0, L - U, U):
            nxt = group_inputs(k_row, v_row, f_row, q_row, t0 + i0 + U, t0 + L - 1, NK, NQ, NF, mk, mv, N, K, V,
                               False, U)
            for u in tl.static_range(U):
                kt, vt, ft, qt = cur[u]
                z, h = step(h, Wt, kt.to(tl.float32), vt.to(tl.float32), ft.to(tl.float32), DOT, FAST)
                tl.store(scr + (i0 + u + 1) * K * V + tile, h, mask=mkv)
            cur = nxt
        i0 = (L - 1) - (L - 1) % U
        for u in tl.static_range(U - 1):
            if i0 + u < L - 1:
                kt, vt, ft, qt = cur[u]
                z, h = step(h, Wt, kt.to(tl.float32), vt.to(tl.float32), ft.to(tl.float32), DOT, FAST)
                tl.store(scr + (i0 + u + 1) * K * V + tile, h, mask=mkv)
        tl.debug_barrier()                   # scratch written by all threads before it is read back
        # Walk steps t0+L-1 .. t0 (segment rows L-1 .. 0).
        cur = back_group(scr, tile, mkv, k_row, v_row, f_row, q_row, dy_row, t0, L - 1, NK, NQ, NF, mk, mv,
                         N, K, V, U)
        for ii0 in range(0, L - U + 1, U):
            nxt = back_group(scr, tile, mkv, k_row, v_row, f_row, q_row, dy_row, t0, L - 1 - ii0 - U, NK, NQ, NF,
                             mk, mv, N, K, V, U)
            for u in tl.static_range(U):
                dH, dW_acc = back_step(dH, dW_acc, Wt, cur[u], t0 + L - 1 - ii0 - u, g_k, g_v, g_f, dq, dk, dv,
                                       df, mk, mv, N, K, V, DOT, FAST)
            cur = nxt
        ii0 = L - L % U
        for u in tl.static_range(U - 1):
            if ii0 + u < L:
                dH, dW_acc = back_step(dH, dW_acc, Wt, cur[u], t0 + L - 1 - ii0 - u, g_k, g_v, g_f, dq, dk, dv,
                                       df, mk, mv, N, K, V, DOT, FAST)
    tl.store(dW + (slab + bn) * V * V + rv[:, None] * V + rv[None, :], dW_acc, mask=mv[:, None] & mv[None, :])
    tl.store(dh0 + bn * K * V + tile, dH, mask=mkv)


def backward_signature(shape: dict) -> dict:
    t = f"*{_TL_NAME[shape['dtype']]}"
    sig = {name: t for name in ("q", "k", "v", "W", "f", "dy", "dh_final")}
    sig.update({name: "*fp32" for name in ("ckpt", "scratch", "dq", "dk", "dv", "df", "dW", "dh0")})
    sig.update({"S": "i32", "NQ": "i32", "NK": "i32", "NF": "i32", "NW": "i32", "NSEG": "i32"})
    return sig
