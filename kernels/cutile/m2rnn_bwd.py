"""cuTile lane for m2rnn_bwd: a checkpointing forward, then backprop through time per (batch row,
value head). Math and layouts: lab/problems/_m2rnn.py; the contract copies kernels/triton/m2rnn_bwd.py
(fp32 per-value-head gradient buffers, shared q / k / W / f heads and dW's batch sum folded by
lab.problems._m2rnn.reduce_heads afterwards; df comes back as per-column partials [B, S, N, BV] that
torch sums first).

Kernel 1 (``_fwd_ckpt``), grid B*N: the fp32 state H [BK, BV] is a tile carried through the time loop;
k, v, f are loaded once per chunk of T_FWD steps as [T_FWD, BK] / [T_FWD, BV] / [T_FWD] tiles and each
step picks its row with ``ct.extract`` (dynamic row index; tileiras stages the chunk in shared memory and
reads rows with LDS). The state before every CKPT-th step goes to ``ckpt`` [B*N, NSEG, BK, BV] (fp32);
the kernel stops at the last checkpoint. Per step: ``ct.mma(H, W, k v^T)`` (operands per DOT; wgmma
64x16x16 on sm_90a), ``ct.tanh``, the gate.

Kernel 2 (``_seg``), grid B*N, launched NSEG + 1 times (``schedule``): launch m recomputes segment
NSEG - m - 1 from its checkpoint into a global fp32 scratch [B*N, CKPT, BK, BV] (row i = the state before
the segment's step i) and walks segment NSEG - m backwards from the scratch that launch m - 1 wrote. Two
scratch buffers alternate (segment j in buffer j % 2) and dH [B*N, BK, BV] / dW [B*N, BV, BV] move between
two fp32 buffer pairs (read m % 2, write (m + 1) % 2), so no launch reads an array it writes: every
store -> load dependence crosses a kernel boundary. (The first version recomputed and walked in one
program, reading back scratch it had just stored: cuTile documents no ordering of weak memory accesses
across threads (its memory_model page), tileiras 13.5 lowered both the scratch stores and loads to TMA
(UTMASTG / UTMALDG in separate warp-specialized regions of the sm_90a SASS, loads prefetched ahead),
and on the H100 (2026-11-22) dq / dW / df, which need the read-back states, were non-finite at S=4096
and wrong at ragged_h0 while dk / dv were nearly right: stale or uninitialized states, inferred from
that pattern, not traced instruction by instruction.) The walk,
chunk by chunk of T steps (k, v, f, q, dy rows as above), reads H_{t-1}, recomputes Z_t (one mma + tanh
that does not depend on dH; STORE_Z keeps it from the recompute in a second scratch instead) and
    dq_t = H_t dy_t;  G = dH + q_t dy_t^T;  df_t = sum(G (H_{t-1} - Z_t));  dX = (1 - f_t) G (1 - Z_t^2)
    dW += H_{t-1}^T dX;  dk_t = dX v_t;  dv_t = dX^T k_t;  dH = mma(dX, W^T, f_t G)
with dH a carried tile: only G -> dX -> mma -> dH is serial. Per-step gradients are small stores straight
to the fp32 buffers (every row is written by the walk of its segment). The recompute and the walk of
one launch are independent. Scratch traffic: every state is written once and read once (B*N*S*BK*BV*4
bytes each way, 11 GB at b8_n84); a small CKPT keeps a segment's scratch (B*N*CKPT*BK*BV*4 bytes) in L2
between the two launches, a large one means fewer launches. K and V are padded to powers of two >= 16
(BK, BV): zero-padded loads keep the padded rows / columns of H and dH at zero, stores drop them; ragged
S is zero-padded chunk loads plus dynamic step counts.

cuTile gives no control of threads, registers or shared memory; tileiras chose (sm_90a AOT, b8_n84):
forward 256 threads, backward 256 threads (384 when left to itself). Register use follows the occupancy
hints: the defaults give the forward 64 registers (4 CTAs per SM) and the backward 128 (2 per SM), with
no stack in either; higher hints spill. T > 1 in the backward puts the chunk tiles on the stack (about
2.3 KB per chunk row at the compiler's occupancy), so the default backward loads one row set per step
(T = 1) and lets tileiras pipeline the loads. Tunables:
  CKPT              checkpoint interval (steps): ckpt B*N*ceil(S/CKPT)*BK*BV*4 bytes, two scratch
                    buffers as above, ceil(S/CKPT) + 2 launches
  T, T_FWD          rows per input chunk load, backward / forward (powers of two <= CKPT)
  LOADS             backward inputs: "chunk" (chunk tiles + extract) or "step" (one load per row and step)
  STORE_Z           keep Z_t in a second scratch during the recompute (walk loads it; no mma/tanh there)
  DOT               operands of the per-step products for bf16 inputs: input (H, dX rounded to bf16,
                    upstream's choice), tf32, tf32x3 (hi/lo split, ~fp32), ieee (fp32 mma); fp32
                    inputs always use ieee (the problem's fp32 band needs fp32 products)
  FAST_TANH         ct.tanh(rounding_mode=APPROX): MUFU.TANH (tanh.approx.f32; checked in the sm_90a
                    SASS); false: RoundingMode.FULL, tileiras' exact software tanh (no MUFU.TANH)
  num_worker_warps  @ct.kernel hint for both kernels: 0 (compiler), 4 or 8 (cuda-tile 1.7.0 emits
                    bytecode 13.4, where other values are refused)
  occupancy, fwd_occupancy  @ct.kernel CTAs-per-SM hints of the backward / forward (0 = compiler)

Read to learn the API (no code copied): cuda-tile 1.7.0 installed source (cuda/tile/_stub.py docstrings
of load/store/extract/mma/tanh, _memory_model.py, _ir/ops.py extract, _passes/token_order.py,
_execution.py kernel hints, _compile.py bytecode versions), NVIDIA/cutile-python samples/templates/AttentionFMHA.py and
test/kernels/attention.py (a loop carrying tiles through ct.mma), docs/source/performance.rst and
memory_model.rst, Tile IR memory model (docs.nvidia.com/cuda/tile-ir); kernels/cutile/gemm.py (export).
"""
from __future__ import annotations

import time

import torch
import cuda.tile as ct

from kernels.cutile.gemm import ARCHS, _arch, _gpu_code, cubin_resources, export_cubin, versions  # noqa: F401
from lab.problems import _m2rnn as m2

DSL = "cutile"
KERNEL = "m2rnn_bwd"
TUNABLES = ("CKPT", "T", "T_FWD", "LOADS", "STORE_Z", "DOT", "FAST_TANH", "num_worker_warps", "occupancy",
            "fwd_occupancy")
DEFAULTS = {"CKPT": 32, "T": 1, "T_FWD": 16, "LOADS": "chunk", "STORE_Z": False, "DOT": "input", "FAST_TANH": True,
            "num_worker_warps": 0, "occupancy": 2, "fwd_occupancy": 4}
TARGETS = tuple(f"sm_{a}a" if a in (90, 100, 103, 110, 120, 121) else f"sm_{a}" for a in ARCHS)
DTYPES = ("float32", "bfloat16")
DOTS = ("input", "tf32", "tf32x3", "ieee")
LOADS = ("chunk", "step")
CKPTS = (8, 16, 32, 64, 128, 256)
MAX_BK, MAX_BV = 64, 32   # larger state tiles spill (fp32 K = V = 64, sm_90a AOT: 4 KB / 10 KB of stack)
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
    """acc + a @ b for fp32 tiles a, b. DOT: 0 bf16 operands, 1 tf32, 2 three tf32 products (hi/lo
    split; two when B_EXACT, i.e. b is a bf16 value and so exact in tf32), 3 fp32 mma."""
    if DOT == 0:
        return ct.mma(a.astype(ct.bfloat16), b.astype(ct.bfloat16), acc)
    if DOT == 3:
        return ct.mma(a, b, acc)
    ah = a.astype(ct.tfloat32)
    bh = b.astype(ct.tfloat32)
    acc = ct.mma(ah, bh, acc)
    if DOT == 2:
        acc = ct.mma((a - ah.astype(F32)).astype(ct.tfloat32), bh, acc)
        if not B_EXACT:
            acc = ct.mma(ah, (b - bh.astype(F32)).astype(ct.tfloat32), acc)
    return acc


def _load_w(W, nw, BV):
    return ct.load(W, (nw, 0, 0), (1, BV, BV), padding_mode=ZERO).reshape((BV, BV)).astype(F32)


def _chunk(x, b, c, h, T, BX):
    """Steps [c*T, c*T + T) of head h of x [B, S, H, X] as a [T, BX] fp32 tile (zeros past S and X)."""
    return ct.load(x, (b, c, h, 0), (1, T, 1, BX), padding_mode=ZERO).reshape((T, BX)).astype(F32)


def _fchunk(f, b, c, h, T):
    return ct.load(f, (b, c, h), (1, T, 1), padding_mode=ZERO).reshape((T,)).astype(F32)


def _row(xc, i, BX):
    return ct.extract(xc, (i, 0), (1, BX))                     # [1, BX]


def _pick(x, xc, b, t, h, i, BX, STEP):
    """Row of step t (chunk row i) as [1, BX] fp32: from the chunk tile, or (STEP) loaded by itself."""
    if STEP:
        return ct.load(x, (b, t, h, 0), (1, 1, 1, BX), padding_mode=ZERO).reshape((1, BX)).astype(F32)
    return _row(xc, i, BX)


def _fpick(f, fc, b, t, h, i, STEP):
    if STEP:
        return ct.load(f, (b, t, h), (1, 1, 1)).reshape((1, 1)).astype(F32)
    return ct.extract(fc, (i,), (1,)).reshape((1, 1))


def _fwd_ckpt(k, v, W, f, h0, ckpt, NSEG: int,
              N: C, GK: C, GW: C, GF: C, BK: C, BV: C, CKPT: C, T: C, HAS_H0: CB, DOT: C, FAST: CB):
    """States H_{j*CKPT} (j < NSEG) of one (batch row, value head) into ckpt [B*N, NSEG, BK, BV]."""
    bn = ct.bid(0)
    b = bn // N
    n = bn % N
    w = _load_w(W, n // GW, BV)
    if HAS_H0:
        h = ct.load(h0, (b, n, 0, 0), (1, 1, BK, BV), padding_mode=ZERO).reshape((BK, BV)).astype(F32)
    else:
        h = ct.zeros((BK, BV), dtype=F32)
    per = CKPT // T
    for j in range(NSEG - 1):
        ct.store(ckpt, (bn, j, 0, 0), h.reshape((1, 1, BK, BV)))
        for cc in range(per):
            c = j * per + cc
            kc = _chunk(k, b, c, n // GK, T, BK)
            vc = _chunk(v, b, c, n, T, BV)
            fc = _fchunk(f, b, c, n // GF, T)
            for i in range(T):
                kt = _row(kc, i, BK).reshape((BK, 1))
                ft = ct.extract(fc, (i,), (1,)).reshape((1, 1))
                z = _tanh(_prod(h, w, kt * _row(vc, i, BV), DOT, True), FAST)
                h = ft * h + (1.0 - ft) * z
    ct.store(ckpt, (bn, NSEG - 1, 0, 0), h.reshape((1, 1, BK, BV)))


def _seg(q, k, v, W, f, dy, ckpt, sc_in, zs_in, sc_out, zs_out, dh_in, dw_in, dh_out, dw_out,
         dq, dk, dv, df, jw: int, Lw: int, jr: int, Lr: int,
         N: C, GQ: C, GK: C, GW: C, GF: C, BK: C, BV: C, CKPT: C, T: C, DOT: C, FAST: CB, STEP: CB, ZS: CB):
    """One launch of the backward for one (batch row, value head): recompute segment jr (Lr steps, none
    when Lr = 0) from its checkpoint into sc_out / zs_out, and walk segment jw (Lw steps, none when
    Lw = 0) backwards from the states that the previous launch left in sc_in / zs_in, carrying dH and
    dW from dh_in / dw_in to dh_out / dw_out. No array is both read and written here."""
    bn = ct.bid(0)
    b = bn // N
    n = bn % N
    w = _load_w(W, n // GW, BV)
    per = CKPT // T
    # Recompute: sc_out[i] = H_{t0 + i - 1}, the state before step t0 + i of segment jr.
    h = ct.load(ckpt, (bn, jr, 0, 0), (1, 1, BK, BV)).reshape((BK, BV))
    for c in range(ct.cdiv(Lr, T)):
        kc = _chunk(k, b, jr * per + c, n // GK, T, BK)
        vc = _chunk(v, b, jr * per + c, n, T, BV)
        fc = _fchunk(f, b, jr * per + c, n // GF, T)
        for i in range(min(T, Lr - c * T)):
            ct.store(sc_out, (bn, c * T + i, 0, 0), h.reshape((1, 1, BK, BV)))
            kt = _row(kc, i, BK).reshape((BK, 1))
            ft = ct.extract(fc, (i,), (1,)).reshape((1, 1))
            z = _tanh(_prod(h, w, kt * _row(vc, i, BV), DOT, True), FAST)
            if ZS:
                ct.store(zs_out, (bn, c * T + i, 0, 0), z.reshape((1, 1, BK, BV)))
            h = ft * h + (1.0 - ft) * z
    # Walk segment jw backwards.
    wt = ct.transpose(w)
    dH = ct.load(dh_in, (bn, 0, 0), (1, BK, BV)).reshape((BK, BV))
    dw = ct.load(dw_in, (bn, 0, 0), (1, BV, BV)).reshape((BV, BV))
    nch = ct.cdiv(Lw, T)
    for cc in range(nch):
        c = nch - 1 - cc
        cg = jw * per + c
        if STEP:
            kc, vc, qc, dyc, fc = k, v, q, dy, f      # unused: rows are loaded per step
        else:
            kc = _chunk(k, b, cg, n // GK, T, BK)
            vc = _chunk(v, b, cg, n, T, BV)
            qc = _chunk(q, b, cg, n // GQ, T, BK)
            dyc = _chunk(dy, b, cg, n, T, BV)
            fc = _fchunk(f, b, cg, n // GF, T)
        steps = min(T, Lw - c * T)
        for ii in range(steps):
            i = steps - 1 - ii
            t = cg * T + i
            hp = ct.load(sc_in, (bn, c * T + i, 0, 0), (1, 1, BK, BV)).reshape((BK, BV))
            kt = _pick(k, kc, b, t, n // GK, i, BK, STEP).reshape((BK, 1))
            vt = _pick(v, vc, b, t, n, i, BV, STEP)
            qt = _pick(q, qc, b, t, n // GQ, i, BK, STEP).reshape((BK, 1))
            dyt = _pick(dy, dyc, b, t, n, i, BV, STEP)
            ft = _fpick(f, fc, b, t, n // GF, i, STEP)
            if ZS:
                z = ct.load(zs_in, (bn, c * T + i, 0, 0), (1, 1, BK, BV)).reshape((BK, BV))
            else:
                z = _tanh(_prod(hp, w, kt * vt, DOT, True), FAST)
            ht = ft * hp + (1.0 - ft) * z
            G = dH + qt * dyt
            dX = (1.0 - ft) * G * (1.0 - z * z)
            dH = _prod(dX, wt, ft * G, DOT, True)
            dw = _prod(ct.transpose(hp), dX, dw, DOT, False)
            ct.store(dq, (b, t, n, 0), ct.sum(ht * dyt, axis=1).reshape((1, 1, 1, BK)))
            ct.store(dk, (b, t, n, 0), ct.sum(dX * vt, axis=1).reshape((1, 1, 1, BK)))
            ct.store(dv, (b, t, n, 0), ct.sum(dX * kt, axis=0).reshape((1, 1, 1, BV)))
            ct.store(df, (b, t, n, 0), ct.sum(G * (hp - z), axis=0).reshape((1, 1, 1, BV)))
    ct.store(dh_out, (bn, 0, 0), dH.reshape((1, BK, BV)))
    ct.store(dw_out, (bn, 0, 0), dw.reshape((1, BV, BV)))


def schedule(nseg: int, S: int, ckpt: int) -> list[tuple[int, int, int, int]]:
    """(jw, Lw, jr, Lr) of the NSEG + 1 segment launches: launch m walks segment NSEG - m (none at
    m = 0) and recomputes segment NSEG - m - 1 (none at m = NSEG). Segment j's states live in scratch
    buffer j % 2, dH / dW move from buffer m % 2 to (m + 1) % 2: every read of a buffer is in a later
    launch than its write, so the kernel boundary orders them."""
    seg_len = lambda j: min(ckpt, S - j * ckpt)  # noqa: E731
    out = []
    for m in range(nseg + 1):
        jw, jr = nseg - m, nseg - m - 1
        out.append((jw if m else 0, seg_len(jw) if m else 0, max(jr, 0), seg_len(jr) if jr >= 0 else 0))
    return out


_KERNELS: dict = {}


def _kernels(config: dict):
    """(forward, backward) ``ct.kernel`` objects for the config's compiler hints (0 = compiler's choice)."""
    nww = config["num_worker_warps"] or None
    key = (config["fwd_occupancy"], config["occupancy"], nww)
    if key not in _KERNELS:
        _KERNELS[key] = (ct.kernel(_fwd_ckpt, occupancy=key[0] or None, num_worker_warps=nww),
                         ct.kernel(_seg, occupancy=key[1] or None, num_worker_warps=nww))
    return _KERNELS[key]


# ---- lane interface -----------------------------------------------------------------------------

def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def dot_mode(config: dict, shape: dict) -> int:
    """fp32 inputs always multiply in fp32 (the problem's fp32 band assumes it)."""
    return 3 if shape["dtype"] == "float32" else DOTS.index(config["DOT"])


def config_reason(config: dict, shape: dict) -> str | None:
    config = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    if _block(shape["K"]) > MAX_BK or _block(shape["V"]) > MAX_BV:
        return (f"K={shape['K']}, V={shape['V']}: the padded state tile [{_block(shape['K'])}, {_block(shape['V'])}] "
                f"exceeds [{MAX_BK}, {MAX_BV}]; tileiras spills such tiles (fp32 K = V = 64: 4 KB forward and "
                f"10 KB backward stack per thread, sm_90a)")
    if config["CKPT"] not in CKPTS:
        return f"CKPT={config['CKPT']} must be one of {', '.join(map(str, CKPTS))}"
    for key in ("T", "T_FWD"):
        if config[key] not in (1, 2, 4, 8, 16, 32) or config[key] > config["CKPT"]:
            return f"{key}={config[key]} must be 1, 2, 4, 8, 16 or 32 and at most CKPT={config['CKPT']}"
    if not isinstance(config["STORE_Z"], bool):
        return "STORE_Z must be true or false"
    if config["LOADS"] not in LOADS:
        return f"LOADS={config['LOADS']!r} must be one of {', '.join(LOADS)}"
    if config["DOT"] not in DOTS:
        return f"DOT={config['DOT']!r} must be one of {', '.join(DOTS)}"
    if not isinstance(config["FAST_TANH"], bool):
        return "FAST_TANH must be true or false"
    if config["num_worker_warps"] not in (0, 4, 8):
        # cuda-tile 1.7.0 emits bytecode 13.4, where tileiras takes only 4 or 8 (other values: 13.5+).
        return f"num_worker_warps={config['num_worker_warps']} must be 0 (auto), 4 or 8"
    for key in ("occupancy", "fwd_occupancy"):
        if config[key] not in range(0, 33):
            return f"{key}={config[key]} must be 0 (auto) or in [1, 32]"
    B, S, N = shape["B"], shape["S"], shape["N"]
    tile = _block(shape["K"]) * _block(shape["V"])
    if max(B * S * N * _block(max(shape["K"], shape["V"])), B * N * max(_nseg(config, shape), config["CKPT"]) * tile) \
            >= 2**31:
        return "arrays with 2^31 or more elements need int64 indexing, which this lane does not specialize"
    return None


def eligibility(target: str) -> str | None:
    if _arch(target) not in ARCHS:
        return f"cuTile (tileiras 13.5) has no code generation for {target} (has {', '.join(TARGETS)})"
    return None


def target_reason(config: dict, target: str) -> str | None:
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA, bytes: the larger kernel's (the backward's), a bound fitted to AOT compiles
    rather than derived, since tileiras alone decides what it stages (W operand descriptors, layout
    conversions of the per-step rows and reductions). At BK x BV = 64 x 16 the segment kernel compiled to
    45.6-47.6 KB (CKPT 8..256, T 1..4) on sm_90a and sm_121a, 49.7 KB with LOADS=step, 55.7 KB with
    STORE_Z, 63.8 KB with num_worker_warps=8 (b8_n84, sm_90a); the forward 13.9-18.7 KB.
    Bound: 52 KB per 1024 state elements, plus 16 KB for 8 worker warps and 24 KB for STORE_Z. The
    compiled figure (compile_for) is the exact one; the tests hold compiled <= estimate."""
    config = {**DEFAULTS, **config}
    scale = max(1.0, _block(shape["K"]) * _block(shape["V"]) / 1024)
    return int(53_248 * scale) + 16_384 * (config["num_worker_warps"] == 8) + 24_576 * bool(config["STORE_Z"])


def _consts(config: dict, shape: dict) -> dict:
    N = shape["N"]
    return {"N": N, "GQ": N // shape["Nq"], "GK": N // shape["Nk"], "GW": N // shape["Nw"], "GF": N // shape["Nf"],
            "BK": _block(shape["K"]), "BV": _block(shape["V"]), "CKPT": config["CKPT"], "T": config["T"],
            "T_FWD": config["T_FWD"],
            "DOT": dot_mode(config, shape), "FAST": bool(config["FAST_TANH"]), "STEP": config["LOADS"] == "step",
            "ZS": bool(config["STORE_Z"])}


_FWD_CONSTS = ("N", "GK", "GW", "GF", "BK", "BV", "CKPT", "T_FWD", "HAS_H0", "DOT", "FAST")
_BWD_CONSTS = ("N", "GQ", "GK", "GW", "GF", "BK", "BV", "CKPT", "T", "DOT", "FAST", "STEP", "ZS")


def _nseg(config: dict, shape: dict) -> int:
    return -(-shape["S"] // config["CKPT"])


def _array(dtype: str, size: tuple):
    """The ArrayConstraint cuTile's JIT derives for a contiguous, 16-byte aligned torch tensor (the rules
    of kernels/cutile/gemm.py's _array_constraint, any rank)."""
    from cuda.tile.compilation import ArrayConstraint
    elem = _ELEM[dtype]
    strides = [1]
    for s in reversed(size[1:]):
        strides.insert(0, strides[0] * s)
    return ArrayConstraint(_CT[dtype], len(size), index_dtype=ct.int32, stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=tuple(1 if s == 1 else None for s in strides),
                           stride_divisible_by=tuple(16 // elem if s * elem % 16 == 0 else 1 for s in strides),
                           shape_divisible_by=tuple(16 if d % 16 == 0 else 1 for d in size),
                           base_addr_divisible_by=16)


def _signatures(config: dict, shape: dict):
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    dt, bk, bv, nseg = shape["dtype"], _block(K), _block(V), _nseg(config, shape)
    c = {**_consts(config, shape), "HAS_H0": bool(shape["h0"])}
    i32 = ScalarConstraint(ct.int32)
    k, v = _array(dt, (B, S, shape["Nk"], K)), _array(dt, (B, S, N, V))
    W, f = _array(dt, (shape["Nw"], V, V)), _array(dt, (B, S, shape["Nf"]))
    state, ck = _array(dt, (B, N, K, V)), _array("float32", (B * N, nseg, bk, bv))
    fwd = [k, v, W, f, state, ck, i32] + [c[n] for n in _FWD_CONSTS]
    g = lambda *s: _array("float32", s)  # noqa: E731
    sc, zs = g(B * N, config["CKPT"], bk, bv), g(B * N, config["CKPT"] if config["STORE_Z"] else 1, bk, bv)
    dh, dw = g(B * N, bk, bv), g(B * N, bv, bv)
    bwd = [_array(dt, (B, S, shape["Nq"], K)), k, v, W, f, _array(dt, (B, S, N, V)), ck, sc, zs, sc, zs,
           dh, dw, dh, dw, g(B, S, N, K), g(B, S, N, K), g(B, S, N, V), g(B, S, N, bv),
           i32, i32, i32, i32] + [c[n] for n in _BWD_CONSTS]
    cc = CallingConvention.cutile_python_v1()
    return KernelSignature(fwd, cc), KernelSignature(bwd, cc)


def compile_cubins(config: dict, shape: dict, target: str, which=("forward", "backward")) -> dict:
    """{"forward": cubin, "backward": cubin} (those in ``which``) for ``target`` (no GPU needed)."""
    config = {**DEFAULTS, **config}
    reason = eligibility(target) or config_reason(config, shape) or target_reason(config, target)
    if reason:
        raise ValueError(reason)
    kernels = dict(zip(("forward", "backward"), _kernels(config)))
    sigs = dict(zip(("forward", "backward"), _signatures(config, shape)))
    return {name: export_cubin(kernels[name], sigs[name], _gpu_code(target)) for name in which}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Both kernels for ``target``; smem_bytes / registers / stack_bytes are the larger of the two."""
    t0 = time.perf_counter()
    cubins = compile_cubins(config, shape, target)
    seconds = time.perf_counter() - t0
    res = {name: cubin_resources(c) for name, c in cubins.items()}
    top = {key: max(r[key] or 0 for r in res.values()) for key in ("smem_bytes", "registers", "stack_bytes")}
    return {**top, "compile_s": seconds, "binary": "cubin", "kernels": res}


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    reason = config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    fwd, bwd = _kernels(config)
    c = _consts(config, shape)
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    bk, bv, nseg = c["BK"], c["BV"], _nseg(config, shape)
    grid = (B * N, 1, 1)
    plan = schedule(nseg, S, config["CKPT"])
    work: dict = {}

    def run(inputs, outputs, trace=None):
        """``trace(m, work)``, if given, is called after the forward (m = -1) and after segment launch m
        (scripts/debug_cutile_m2rnn_bwd.py's hook; it may overwrite ckpt / scratch)."""
        i, o = inputs, outputs
        dev = i["v"].device
        if work.get("dev") != dev:
            f32 = {"dtype": torch.float32, "device": dev}
            nz = config["CKPT"] if config["STORE_Z"] else 1
            work.clear()
            work.update(dev=dev, ckpt=torch.empty(B * N, nseg, bk, bv, **f32),
                        sc=[torch.empty(B * N, config["CKPT"], bk, bv, **f32) for _ in range(2)],
                        zs=[torch.empty(B * N, nz, bk, bv, **f32) for _ in range(2)],
                        dh=[torch.zeros(B * N, bk, bv, **f32) for _ in range(2)],
                        dw=[torch.zeros(B * N, bv, bv, **f32) for _ in range(2)],
                        dq=torch.empty(B, S, N, K, **f32), dk=torch.empty(B, S, N, K, **f32),
                        dv=torch.empty(B, S, N, V, **f32), df=torch.empty(B, S, N, bv, **f32))
        w = work
        stream = torch.cuda.current_stream()
        h0 = i.get("h0", i["dh_final"])        # not read when there is no h0
        ct.launch(stream, grid, fwd, (i["k"], i["v"], i["W"], i["f"], h0, w["ckpt"], nseg,
                                      *(c[n] if n != "HAS_H0" else bool(shape["h0"]) for n in _FWD_CONSTS)))
        if trace is not None:
            trace(-1, w)
        # dH starts at dh_final, dW at zero; padded rows / columns stay zero throughout.
        w["dh"][0].zero_()
        w["dh"][0][:, :K, :V].copy_(i["dh_final"].reshape(B * N, K, V))
        w["dw"][0].zero_()
        consts = [c[n] for n in _BWD_CONSTS]
        for m, (jw, lw, jr, lr) in enumerate(plan):
            a, z = m % 2, (m + 1) % 2
            si, so = (nseg - m) % 2, (nseg - m + 1) % 2     # segment j's states: buffer j % 2
            ct.launch(stream, grid, bwd, (i["q"], i["k"], i["v"], i["W"], i["f"], i["dy"], w["ckpt"],
                                          w["sc"][si], w["zs"][si], w["sc"][so], w["zs"][so],
                                          w["dh"][a], w["dw"][a], w["dh"][z], w["dw"][z],
                                          w["dq"], w["dk"], w["dv"], w["df"], jw, lw, jr, lr, *consts))
            if trace is not None:
                trace(m, w)
        last = len(plan) % 2
        parts = {n: w[n] for n in ("dq", "dk", "dv")}
        parts["dW"] = w["dw"][last][:, :V, :V].reshape(B, N, V, V)
        parts["dh0"] = w["dh"][last][:, :K, :V].reshape(B, N, K, V)
        parts["df"] = w["df"].sum(-1)          # df_t's sum over the V columns of its per-column partials
        grads = m2.reduce_heads(parts, shape)
        for name, value in grads.items():
            o[name].copy_(value)
        return {"grid": grid[0], "launches": 1 + len(plan)}
    return run
