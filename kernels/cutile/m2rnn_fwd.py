"""cuTile lane for m2rnn_fwd (math and layouts: lab/problems/_m2rnn.py).

Design. One program per (batch row, block of HEADS value heads, K slab of BK = K / K_SPLIT rows);
grid (B * N / HEADS, K_SPLIT). The state H [HEADS, BK, V] is an fp32 tile carried through the chunk
loop; W is loaded once. Time runs in chunks of T steps: the chunk's k [., BK, T], v [HEADS, T, V],
f [., 1, T] and q are loaded as whole tiles (``order`` picks the transposed views; TMA when
allowed, so tileiras adds a producer warp group and mbarriers), one chunk ahead of use when PREFETCH
(chunk c+1's loads are issued before chunk c's steps and carried to the next iteration). The T steps
are unrolled (``ct.static_iter``) so each step's rows come out of the chunk tiles with ``ct.extract``
at constant indices. Per step:
    acc = k_t v_t^T (off the chain);  A = mma(H, W, acc)  (operands per DOT);  Z = tanh(A)
    H = f_t H + (1 - f_t) Z
y: with YSTACK the chunk's states are stacked ([HEADS, T, BK, V], ``ct.insert``) and reduced against
q once per chunk (sum over the BK rows), otherwise y_t = sum_rows(H * q_t) per step; y is stored
once per chunk ([HEADS, T, V]). With K_SPLIT > 1 y is a per-slab fp32 partial summed afterwards
(torch), as in the Triton lane. A ragged S: the last chunk reads zeros past S and f is set to 1 there,
so H = 1 * H + 0 * Z keeps the state bit for bit; y rows past S are dropped by ``ct.store``.

What the AOT SASS (sm_90a, b2_n8, T = 16) showed and drove the defaults: a per-step y reduction
crosses the 4 warps of the compute group through shared memory (5-7 block barriers per step);
YSTACK removes all of them from the unrolled steps. The bf16 step then runs HMMA.16816 with the
next step's A operand packed from the accumulator registers (F2FP, no shared memory), MUFU.TANH,
and one FMUL + FFMA per element. A dynamic (non-unrolled) step loop made tileiras keep the chunk
tiles in local memory (spills), hence the unrolling. Plain strides (no 16-byte divisibility
facts) gave scalar 2-byte loads; the signature below records the divisibility the JIT sees.
Without an occupancy hint tileiras takes 168 registers x 384 threads (1 CTA per SM: b8_n84's 672
CTAs would run in 6 waves); occupancy = 3 gives 80 registers x 256 threads, no spills.
KV: the broadcast k_t v_t^T took ~70 of the ~120 SASS instructions of a step (quad shuffles
and selects building the accumulator layout). KV = "mma" computes it as the product of the chunk's k
[BK, T] with every column but t zeroed and the chunk's v [T, V] (exact: one bf16 product per element), which
tileiras writes straight into the accumulator: ~47 instructions per step. "cat" folds it into the step's
product ([H | k] [W ; v], K = 32).

Tunables (values in sweeps/m2rnn_fwd/cutile.toml):
  num_worker_warps  0 (auto), 4, 8: warps of the compute warp group. cuda-tile 1.7.0 writes TileIR
                    bytecode 13.4, where only 4 and 8 exist (1, 2 need 13.5, a dev-only level there),
                    so one warp per (b, n) cannot be asked for.
  occupancy         0 (auto), 1..32: CTAs per SM tileiras compiles for (caps registers)
  K_SPLIT           1, 2, 4: K slabs per (b, heads) (BK >= 16); BK = 16 makes tileiras lower the
                    16 x 16 x 16 product to FFMA, where DOT f32 is the cheaper (and exact) choice
  HEADS             1, 2, 4: value heads per program (a batched [HEADS, BK, V] x [., V, V] mma); a
                    head block must read one shared q/k/W/f head or one head each
  T                 8, 16, 32: steps per chunk
  PREFETCH          load chunk c+1 while chunk c runs
  YSTACK            y per chunk from the stacked states vs a reduction per step
  TMA               chunk loads may use TMA (allow_tma) vs plain loads
  DOT               bf16 inputs: the per-step product's operands, "bf16" (H rounded to bf16, upstream's
                    choice), "tf32", "tf32x3" (three tf32 products, ~fp32), "f32" (fp32 operands:
                    tileiras emits FFMA, exact fp32). fp32 inputs always multiply fp32-accurately:
                    tf32x3 when asked, otherwise f32 (as the Triton lane's fp32 shapes use ieee)
  FAST_TANH         ct.tanh(rounding_mode=APPROX): MUFU.TANH (tanh.approx.f32) vs the full-precision
                    tanh (rounding_mode FULL, the default)
  KV                k_t v_t^T: "outer" (broadcast product), "mma" (one-hot masked chunk product; bf16
                    inputs, T >= 16), "cat" ([H | k] [W ; v]; DOT bf16, HEADS 1, T == V)

Read for the API (no code copied): cuda-tile 1.7.0 ``cuda/tile/_stub.py`` docstrings (load/store
``order`` and padding, ``extract``/``insert``, ``static_iter``, ``mma``, ``tanh`` rounding modes),
``_compiler_options.py`` / ``_ir2bytecode.py`` (num_worker_warps per bytecode version),
``cuda/tile/compilation`` (export_kernel, KernelSignature, ArrayConstraint), NVIDIA/cutile-python
samples/AttentionFMHA.py (transposed loads with ``order``, occupancy hint) and cext/tile_kernel.cpp
(the array specialization the JIT derives), and this lab's kernels/cutile/gemm.py (AOT export,
resources, launch info).
"""
from __future__ import annotations

import time

import torch
import cuda.tile as ct

from kernels import _targets
from kernels.cutile.gemm import (ARCHS, _gpu_code, _launch_info, array_constraint, cubin_resources, eligibility,
                                 export_cubin)
from kernels.cutile.gemm import versions  # noqa: F401  (the lane interface)

DSL = "cutile"
KERNEL = "m2rnn_fwd"
TUNABLES = ("num_worker_warps", "occupancy", "K_SPLIT", "HEADS", "T", "PREFETCH", "YSTACK", "TMA", "DOT",
            "FAST_TANH", "KV")
DEFAULTS = {"num_worker_warps": 0, "occupancy": 2, "K_SPLIT": 1, "HEADS": 1, "T": 16, "PREFETCH": True,
            "YSTACK": True, "TMA": True, "DOT": "bf16", "FAST_TANH": True, "KV": "mma"}
TARGETS = tuple(f"sm_{a}a" if a >= 90 else f"sm_{a}" for a in ARCHS)
DTYPES = ("float32", "bfloat16")
DOTS = ("bf16", "tf32", "tf32x3", "f32")
KVS = ("outer", "mma", "cat")

C = ct.Constant[int]
CB = ct.Constant[bool]


def _step_product(h, w_hi, w_lo, acc, DOT):
    """acc + H @ W with the operands DOT names (0 bf16, 1 tf32, 2 three tf32 products, 3 fp32)."""
    if DOT == 0:
        return ct.mma(h.astype(ct.bfloat16), w_hi, acc)
    elif DOT == 1:
        return ct.mma(h.astype(ct.tfloat32), w_hi, acc)
    elif DOT == 2:
        h_hi = h.astype(ct.tfloat32)
        h_lo = (h - h_hi.astype(ct.float32)).astype(ct.tfloat32)
        acc = ct.mma(h_lo, w_hi, acc)
        acc = ct.mma(h_hi, w_lo, acc)
        return ct.mma(h_hi, w_hi, acc)
    else:
        return ct.mma(h, w_hi, acc)


def _load_chunk(q, k, v, f, b, c, ks, hb, iq, ik, i_f, QH, KH, FH, HEADS, BK, V, T, YSTACK, TMA):
    """Chunk c (steps c*T .. c*T+T-1): q as [QH, T, BK] (YSTACK) or [QH, BK, T], k as [KH, BK, T],
    v as [HEADS, T, V], f as [FH, T]; rows past S read zeros. Tile shapes are in tile-axis order,
    ``order`` maps them onto the array axes (B, S, heads, K)."""
    zero = ct.PaddingMode.ZERO
    if YSTACK:
        qc = ct.load(q, (b, iq, c, ks), (1, QH, T, BK), order=(0, 2, 1, 3), padding_mode=zero, allow_tma=TMA)
    else:
        qc = ct.load(q, (b, iq, ks, c), (1, QH, BK, T), order=(0, 2, 3, 1), padding_mode=zero, allow_tma=TMA)
    kc = ct.load(k, (b, ik, ks, c), (1, KH, BK, T), order=(0, 2, 3, 1), padding_mode=zero, allow_tma=TMA)
    vc = ct.load(v, (b, hb, c, 0), (1, HEADS, T, V), order=(0, 2, 1, 3), padding_mode=zero, allow_tma=TMA)
    fc = ct.load(f, (b, i_f, c), (1, FH, T), order=(0, 2, 1), padding_mode=zero, allow_tma=TMA)
    return qc, kc, vc, fc


def _m2rnn_fwd(q, k, v, W, f, h0, y, h_out,
               N: C, V: C, GQ: C, GK: C, GW: C, GF: C, HEADS: C, BK: C, KSPLIT: C, T: C,
               HAS_H0: CB, PREFETCH: CB, YSTACK: CB, TMA: CB, DOT: C, FAST: CB, KV: C):
    """Grid (B * N / HEADS, KSPLIT). q [B,S,Nq,K], k [B,S,Nk,K], v [B,S,N,V], W [Nw,V,V], f [B,S,Nf],
    h0 / h_out [B,N,K,V]; y [B,S,N,V], or with KSPLIT > 1 an fp32 [KSPLIT*B,S,N,V] of partials.
    G* = value heads per q / k / W / f head; a head block reads one shared head (G % HEADS == 0)
    or HEADS consecutive ones (G == 1)."""
    S = v.shape[1]
    NB = N // HEADS
    b = ct.bid(0) // NB
    hb = ct.bid(0) % NB
    ks = ct.bid(1)
    n0 = hb * HEADS
    QH = HEADS if GQ == 1 else 1
    KH = HEADS if GK == 1 else 1
    WH = HEADS if GW == 1 else 1
    FH = HEADS if GF == 1 else 1
    iq = hb if GQ == 1 else n0 // GQ
    ik = hb if GK == 1 else n0 // GK
    iw = hb if GW == 1 else n0 // GW
    i_f = hb if GF == 1 else n0 // GF

    w = ct.load(W, (iw, 0, 0), (WH, V, V)).astype(ct.float32)
    w_lo = w
    if DOT == 0:
        w_hi = w.astype(ct.bfloat16)
    elif DOT == 3:
        w_hi = w
    else:
        w_hi = w.astype(ct.tfloat32)
        w_lo = (w - w_hi.astype(ct.float32)).astype(ct.tfloat32)
    if HAS_H0:
        h = ct.load(h0, (b, hb, ks, 0), (1, HEADS, BK, V)).reshape((HEADS, BK, V)).astype(ct.float32)
    else:
        h = ct.zeros((HEADS, BK, V), dtype=ct.float32)

    nchunks = ct.cdiv(S, T)
    yrow = b if KSPLIT == 1 else ks * (y.shape[0] // KSPLIT) + b
    if PREFETCH:
        qc, kc, vc, fc = _load_chunk(q, k, v, f, b, 0, ks, hb, iq, ik, i_f, QH, KH, FH, HEADS, BK, V, T,
                                     YSTACK, TMA)
    for c in range(nchunks):
        if PREFETCH:
            # Clamped: a tile wholly outside the array is undefined; the last chunk reloads itself.
            nq, nk, nv, nf = _load_chunk(q, k, v, f, b, min(c + 1, nchunks - 1), ks, hb, iq, ik, i_f,
                                         QH, KH, FH, HEADS, BK, V, T, YSTACK, TMA)
        else:
            qc, kc, vc, fc = _load_chunk(q, k, v, f, b, c, ks, hb, iq, ik, i_f, QH, KH, FH, HEADS, BK, V, T,
                                         YSTACK, TMA)
        kf = kc.reshape((KH, BK, T)).astype(ct.float32)
        vf = vc.reshape((HEADS, T, V)).astype(ct.float32)
        # Steps past S get f = 1: H = 1 * H + 0 * Z keeps the state bit for bit.
        pos = ct.arange(T, dtype=ct.int32).reshape((1, 1, T)) + c * T
        ff = ct.where(pos < S, fc.reshape((FH, 1, T)).astype(ct.float32), 1.0)
        gf = 1.0 - ff
        if YSTACK:
            hs = ct.zeros((HEADS, T, BK, V), dtype=ct.float32)
        else:
            qf = qc.reshape((QH, BK, T)).astype(ct.float32)
            yc = ct.zeros((HEADS, T, V), dtype=ct.float32)
        if KV != 0:
            kb = kc.reshape((KH, BK, T))
            vb = vc.reshape((HEADS, T, V))
            tcol = ct.arange(T, dtype=ct.int32).reshape((1, 1, T))
            kzero = ct.zeros((KH, BK, T), dtype=kb.dtype)
            if KV == 2:
                wv = ct.cat((w_hi.reshape((WH, V, V)), vb.astype(ct.bfloat16)), 1)
        for i in ct.static_iter(range(T)):
            if KV == 0:
                acc = ct.extract(kf, (0, 0, i), (KH, BK, 1)) * ct.extract(vf, (0, i, 0), (HEADS, 1, V))
                a = _step_product(h, w_hi, w_lo, acc, DOT)
            else:
                # k_t v_t^T as a product of the one-hot-masked chunk k [BK, T] and the chunk v [T, V]: exact
                # (one bf16 x bf16 product per element), and in the mma accumulator layout directly.
                km = ct.where(tcol == i, kb, kzero)
                if KV == 1:
                    acc = ct.mma(km, vb, ct.zeros((HEADS, BK, V), dtype=ct.float32))
                    a = _step_product(h, w_hi, w_lo, acc, DOT)
                else:
                    a = ct.mma(ct.cat((h.astype(ct.bfloat16), km.astype(ct.bfloat16)), 2), wv,
                               ct.zeros((HEADS, BK, V), dtype=ct.float32))
            if FAST:
                z = ct.tanh(a, rounding_mode=ct.RoundingMode.APPROX)
            else:
                z = ct.tanh(a)
            h = ct.extract(ff, (0, 0, i), (FH, 1, 1)) * h + ct.extract(gf, (0, 0, i), (FH, 1, 1)) * z
            if YSTACK:
                hs = ct.insert(hs, (0, i, 0, 0), h.reshape((HEADS, 1, BK, V)))
            else:
                yt = ct.sum(h * ct.extract(qf, (0, 0, i), (QH, BK, 1)), axis=1, keepdims=True)
                yc = ct.insert(yc, (0, i, 0), yt)
        if YSTACK:
            # One reduction over the BK rows per chunk instead of one per step.
            yc = ct.sum(hs * qc.reshape((QH, T, BK, 1)).astype(ct.float32), axis=2)
        ct.store(y, (yrow, hb, c, 0), yc.reshape((1, HEADS, T, V)).astype(y.dtype), order=(0, 2, 1, 3))
        if PREFETCH:
            qc, kc, vc, fc = nq, nk, nv, nf
    ct.store(h_out, (b, hb, ks, 0), h.reshape((1, HEADS, BK, V)).astype(h_out.dtype))


_KERNELS: dict = {}


def _kernel(config: dict):
    hints = tuple((k, config[k] or None) for k in ("num_worker_warps", "occupancy"))
    if hints not in _KERNELS:
        _KERNELS[hints] = ct.kernel(_m2rnn_fwd, **dict(hints))
    return _KERNELS[hints]


def _groups(shape: dict) -> dict:
    return {n: shape["N"] // shape[n] for n in ("Nq", "Nk", "Nw", "Nf")}


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and not v & (v - 1)


def _dot(config: dict, shape: dict) -> int:
    """Index into DOTS of the product actually compiled: fp32 inputs always multiply fp32-accurately
    (DOT tf32x3 as asked, otherwise f32), as the Triton lane's fp32 shapes always use ieee."""
    if shape["dtype"] == "float32" and config["DOT"] != "tf32x3":
        return DOTS.index("f32")
    return DOTS.index(config["DOT"])


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    config = {**DEFAULTS, **config}
    dt, K, V, N = shape["dtype"], shape["K"], shape["V"], shape["N"]
    if dt not in DTYPES:
        return f"dtype {dt} not supported (have {', '.join(DTYPES)})"
    if config["DOT"] not in DOTS:
        return f"DOT={config['DOT']!r} must be one of {', '.join(DOTS)}"
    if config["KV"] not in KVS:
        return f"KV={config['KV']!r} must be one of {', '.join(KVS)}"
    if config["KV"] != "outer" and (dt != "bfloat16" or config["T"] < 16):
        return (f"KV={config['KV']}: k v^T as a product over the chunk needs bf16 inputs (exact products) and "
                f"T >= 16 (the mma's K; T={config['T']})")
    if config["KV"] == "cat" and (config["DOT"] != "bf16" or config["T"] != V or config["HEADS"] != 1):
        return (f"KV=cat: [H | k] [W ; v] needs DOT=bf16, HEADS=1 and T == V (cat takes equal shapes; "
                f"T={config['T']}, V={V})")
    if config["num_worker_warps"] not in (0, 4, 8):
        # cuda-tile 1.7.0 writes TileIR bytecode 13.4, where only 4 and 8 exist (1, 2, 16, 32 need 13.5).
        return f"num_worker_warps={config['num_worker_warps']} must be 0 (auto), 4 or 8"
    if not (isinstance(config["occupancy"], int) and 0 <= config["occupancy"] <= 32):
        return f"occupancy={config['occupancy']} must be 0 (auto) or in [1, 32]"
    if config["T"] not in (8, 16, 32):
        return f"T={config['T']} must be 8, 16 or 32"
    for key in ("PREFETCH", "YSTACK", "TMA", "FAST_TANH"):
        if not isinstance(config[key], bool):
            return f"{key} must be true or false"
    if not (_pow2(K) and _pow2(V) and K >= 16 and V >= 16):
        return f"K={K} and V={V} must be powers of two >= 16 (cuTile tile sides; the mma needs 16)"
    ks = config["K_SPLIT"]
    if ks not in (1, 2, 4) or K // ks < 16:
        return f"K_SPLIT={ks} must be 1, 2 or 4 with K/K_SPLIT >= 16 (K={K})"
    hd = config["HEADS"]
    if hd not in (1, 2, 4) or N % hd:
        return f"HEADS={hd} must be 1, 2 or 4 and divide N={N}"
    for name, g in _groups(shape).items():
        if g != 1 and g % hd:
            return (f"HEADS={hd}: a block of value heads must read one shared {name} head or one head "
                    f"each ({name}={shape[name]} gives {g} value heads per {name} head)")
    state = hd * (K // ks) * V
    if state > 4096 or (config["YSTACK"] and state * config["T"] > 32768):
        return (f"state HEADS x K/K_SPLIT x V = {state} fp32 (x T={config['T']} stacked when YSTACK) "
                f"exceeds 4096 (32768 stacked): beyond the registers / shared memory of one CTA")
    if shape["B"] * shape["S"] * shape["N"] * max(K, V) >= 2**31:
        return "arrays of 2^31 or more elements need int64 indexing, which this lane does not specialize"
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int | None:
    """Shared memory per CTA, bytes: an upper bound, the target's opt-in per-block limit.

    tileiras, not the kernel, decides what goes through shared memory (the TMA landing buffers and
    their pipeline depth, layout conversions between the mma fragments and the broadcast k, v, f, q
    rows, the stacked states of YSTACK) and it sizes that to the target and the occupancy hint: over
    the AOT compiles in tests/test_cutile_m2rnn_fwd.py the same kernel took 5 KB to 180 KB as the
    occupancy hint and T changed. So the analytic figure is only this bound; ``compile_for`` gives
    the exact one and the tests hold compiled <= estimate.
    """
    return _targets.smem_optin(target)




def _consts(config: dict, shape: dict) -> tuple:
    g = _groups(shape)
    return (shape["N"], shape["V"], g["Nq"], g["Nk"], g["Nw"], g["Nf"], config["HEADS"],
            shape["K"] // config["K_SPLIT"], config["K_SPLIT"], config["T"], bool(shape["h0"]),
            config["PREFETCH"], config["YSTACK"], config["TMA"], _dot(config, shape), config["FAST_TANH"],
            KVS.index(config["KV"]))


def _signature(config: dict, shape: dict):
    from cuda.tile.compilation import CallingConvention, KernelSignature
    dt = shape["dtype"]
    B, S, N, Nq, Nk, Nw, Nf, K, V = (shape[d] for d in ("B", "S", "N", "Nq", "Nk", "Nw", "Nf", "K", "V"))
    ks = config["K_SPLIT"]
    y = array_constraint("float32", (ks * B, S, N, V)) if ks > 1 else array_constraint(dt, (B, S, N, V))
    arrays = [array_constraint(dt, (B, S, Nq, K)), array_constraint(dt, (B, S, Nk, K)), array_constraint(dt, (B, S, N, V)),
              array_constraint(dt, (Nw, V, V)), array_constraint(dt, (B, S, Nf)), array_constraint(dt, (B, N, K, V)), y,
              array_constraint(dt, (B, N, K, V))]
    return KernelSignature(arrays + list(_consts(config, shape)), CallingConvention.cutile_python_v1())


def _compile_cubin(config: dict, shape: dict, gpu_code: str) -> bytes:
    return export_cubin(_kernel(config), _signature(config, shape), gpu_code)


def compile_for(config: dict, shape: dict, target: str) -> dict:
    config = {**DEFAULTS, **config}
    reason = eligibility(target) or config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    t0 = time.perf_counter()
    cubin = _compile_cubin(config, shape, _gpu_code(target))
    res = cubin_resources(cubin, target)
    return {**res, "compile_s": time.perf_counter() - t0, "binary": "cubin"}


def build(config: dict, shape: dict):
    """``run(inputs, outputs)``: one launch on the current stream (JIT-compiled by cuTile on the first
    call and cached by signature), plus the sum of the per-slab y partials when K_SPLIT > 1. Returns
    the launched binary's shared memory, registers and spills (the same signature exported for this
    device once; informative only)."""
    config = {**DEFAULTS, **config}
    reason = config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    kernel = _kernel(config)
    consts = _consts(config, shape)
    B, S, N, V, ks = shape["B"], shape["S"], shape["N"], shape["V"], config["K_SPLIT"]
    grid = (B * N // config["HEADS"], ks, 1)
    parts: dict = {}
    info: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        dev = i["v"].device
        if ks > 1 and parts.get("dev") != dev:
            parts.update(dev=dev, y=torch.empty(ks * B, S, N, V, dtype=torch.float32, device=dev))
        y = parts["y"] if ks > 1 else o["y"]
        h0 = i.get("h0", o["h_final"])   # not read when the shape has no h0
        args = (i["q"], i["k"], i["v"], i["W"], i["f"], h0, y, o["h_final"], *consts)
        ct.launch(torch.cuda.current_stream(), grid, kernel, args)
        if ks > 1:
            total = y.view(ks, B, S, N, V)
            if o["y"].dtype == torch.float32:
                torch.sum(total, 0, out=o["y"])
            else:
                o["y"].copy_(total.sum(0))
        if not info:
            info.update(_launch_info(kernel, args))
        return info

    return run
