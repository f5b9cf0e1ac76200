"""CuTe DSL lane for m2rnn_bwd: a checkpointing forward, then backprop through time per (b, n, K slab).

Both kernels give every warp 16 rows of the K x V = K x 16 state; a CTA is one (batch row, value head,
K slab of R = K / K_SPLIT rows), R / 16 warps. Each thread owns 8 state elements in the fp32
accumulator layout of mma.sync m16n8k16 (rows g, g+8 and columns 2c, 2c+1, 2c+8, 2c+9 of its warp's
16 x 16 tile, g = lane / 4, c = lane % 4). Two 16 x 8 C tiles in that layout are exactly one 16 x 16
A fragment, so the per-step H W runs as two bf16 mma.sync with the previous accumulators packed to
bf16 as A (upstream's operand precision; fp32 accumulate) and k v^T fed in as C; W's B fragments sit
in registers for the whole sequence. Inputs are staged per chunk of CKPT steps into shared memory
with cp.async (16-byte vectors; the gate f through a register), double buffered: the chunk after
(forward) / before (backward) is in flight while the current one runs, so no step waits on DRAM.

Kernel 1 (forward) writes the fp32 state every CKPT steps to a checkpoint buffer in the threads' own
layout (coalesced 16-byte stores). Kernel 2 walks the segments last to first: it recomputes the
segment's CKPT + 1 states from its checkpoint into shared memory (each thread keeps its own elements,
so no barrier is needed between recompute and walk), then runs t = t0 + L - 1 .. t0:
    Z_t = tanh(H_{t-1} W + k v^T) (recomputed, off the chain)    dq_t = H_t dy_t (mma, dy as B column)
    G = dH + q dy^T;  dX = G (1 - f)(1 - Z^2);  dH = mma(bf16(dX), W^T, C = f G)   <- the serial chain
    dk_t = mma(bf16(dX), v column);  df_t = sum G (H_{t-1} - Z) (warp shuffles)
    movmatrix transposes bf16(H_{t-1}) and bf16(dX) in registers, then dW += H_{t-1}^T dX (mma, the
    accumulator stays in registers for the whole sequence) and dv_t = k^T dX (mma, k broadcast as A).
Per-step gradients are staged in shared memory and written per segment, off the chain. Gradients go
to fp32 per-value-head buffers (dv, df, dW per K slab); torch sums the slabs, then
lab.problems._m2rnn.reduce_heads folds shared q / k / W / f heads and dW's batch (the Triton lane's
contract, kernels/triton/m2rnn_bwd.py).

Tunables:
  CKPT       checkpoint interval = chunk of staged steps (4, 8, 16, 32): shared memory per CTA grows as
             (CKPT + 1) * K / K_SPLIT * 16 * 4 bytes of recomputed states; small CKPT: more barriers
             and checkpoint traffic per step
  K_SPLIT    K slabs per (b, n) (1, 2, 4): more CTAs of fewer warps, dv / df / dW partials per slab
  FAST_TANH  tanh.approx.f32 (MUFU) vs an ex2-based formula with an IEEE divide
The operand precision of the products is bf16 (mma.sync); fp32 inputs are refused (they would need
3xTF32 or FMA products to meet the fp32 band). V must be 16 (one n8 pair per warp tile).

API learned from the installed nvidia-cutlass-dsl 4.8.1 sources (cutlass/cute/arch/nvvm_wrappers.py:
inline_ptx, shuffle_sync_bfly, cp_async_*; cutlass/memory/smem.py) and kernels/cute/gemm.py; fragment
ownership of mma.sync m16n8k16 and movmatrix from the PTX ISA. All sizes in bytes.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch

from kernels import _targets
from kernels.cute import _aot
from kernels.cute._aot import static_smem, versions  # noqa: F401 (versions: lane interface)
from lab.problems import _m2rnn as m2

DSL = "cute"
KERNEL = "m2rnn_bwd"
TUNABLES = ("CKPT", "K_SPLIT", "FAST_TANH")
DEFAULTS = {"CKPT": 16, "K_SPLIT": 1, "FAST_TANH": True}
TARGETS = ("sm_90a", "sm_120a", "sm_121a")
CKPTS = (4, 8, 16, 32)
V = 16
F32, BF16, I32 = cutlass.Float32, cutlass.BFloat16, cutlass.Int32
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# Pure-Python rules
# ----------------------------------------------------------------------------------------------

def config_reason(config: dict, shape: dict) -> str | None:
    config = {**DEFAULTS, **config}
    if shape["dtype"] != "bfloat16":
        return (f"dtype {shape['dtype']} not supported: the per-step products run on bf16 mma.sync "
                f"(fp32 would need 3xTF32 or FMA products for its 2e-3 band)")
    if shape["V"] != V:
        return f"V={shape['V']} not supported: the warp tile is 16 x 16, V must be 16"
    # The values each knob may take are the sweep file's (sweeps/m2rnn_bwd/cute.toml); the harness checks them.
    K, ks = shape["K"], config["K_SPLIT"]
    if K % (16 * ks) or not 1 <= K // (16 * ks) <= 8:
        return f"K={K} / K_SPLIT={ks} must be 16 to 128 rows in steps of 16 (one warp per 16 rows)"
    big = shape["B"] * shape["S"] * shape["N"] * max(K, V) * ks
    if big >= 2 ** 31:
        return f"shape too large for 32-bit indexing ({big} elements in one gradient buffer)"
    return None


def eligibility(target: str) -> str | None:
    if target not in TARGETS:
        return f"cute m2rnn_bwd has no path for {target} (bf16 mma.sync + movmatrix; has {', '.join(TARGETS)})"
    return None


def _dims(config: dict, shape: dict) -> dict:
    R = shape["K"] // config["K_SPLIT"]
    T = config["CKPT"]
    return {"R": R, "NW": R // 16, "THREADS": 2 * R, "T": T}


def _bwd_layout(config: dict, shape: dict) -> dict:
    """Byte offsets of the backward kernel's shared memory regions (all 16-byte aligned)."""
    d = _dims(config, shape)
    R, NW, TH, T = d["R"], d["NW"], d["THREADS"], d["T"]
    up = lambda x: -(-x // 16) * 16  # noqa: E731
    lay = {"ST": 0}
    off = (T + 1) * TH * 8 * 4                          # recomputed states, fp32, thread-owned
    lay["IN"] = off
    lay["Q"], lay["K"] = 0, T * R * 2                   # inside one input buffer: bf16 q, k, v, dy; fp32 f
    lay["V"] = 2 * T * R * 2
    lay["DY"] = lay["V"] + T * V * 2
    lay["F"] = lay["DY"] + T * V * 2
    lay["BUF"] = up(lay["F"] + T * 4)
    off += 2 * lay["BUF"]
    lay["DQ"] = off; off += T * R * 4                   # per-segment gradient staging, fp32
    lay["DK"] = off; off += T * R * 4
    lay["DV"] = off; off += T * NW * V * 4
    lay["DF"] = off; off += up(T * NW * 4)
    lay["TOTAL"] = off
    return lay


def _fwd_layout(config: dict, shape: dict) -> dict:
    d = _dims(config, shape)
    R, T = d["R"], d["T"]
    lay = {"Q": 0, "K": 0, "V": T * R * 2}
    lay["DY"] = lay["V"]
    lay["F"] = lay["V"] + T * V * 2
    lay["BUF"] = -(-(lay["F"] + T * 4) // 16) * 16
    lay["IN"] = 0
    lay["TOTAL"] = 2 * lay["BUF"]
    return lay


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA of the backward kernel (the larger of the two), bytes: (CKPT + 1) states
    of R x 16 fp32, two input buffers of CKPT steps (q, k: R bf16, v, dy: 16 bf16, f: fp32), the
    per-segment staging of dq, dk (R fp32), dv (16 fp32 per warp), df (fp32 per warp); plus the static
    part (kernels/cute/_aot.py ``static_smem``). Meant to equal the compiled figure (the tests check it)."""
    config = {**DEFAULTS, **config}
    return _bwd_layout(config, shape)["TOTAL"] + static_smem(target)


# ----------------------------------------------------------------------------------------------
# Device helpers (inline PTX; register operands only)
# ----------------------------------------------------------------------------------------------

def _mma(a, b0, b1, c):
    """D = A B + C, mma.sync m16n8k16 bf16 -> fp32; a: 4 packed bf16x2, b: 2, c: 4 fp32."""
    return cute.arch.inline_ptx(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, "
        "{{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, {{$r6}, {$r7}, {$r8}, {$r9}};",
        write_only_types=[F32] * 4, read_only_args=[a[0], a[1], a[2], a[3], b0, b1, c[0], c[1], c[2], c[3]])


def _pack(lo, hi):
    return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r1}, {$r0};", write_only_types=[I32],
                                read_only_args=[lo, hi])


def _trans(x):
    """Transpose of an 8 x 8 bf16 matrix held one bf16x2 per thread (mma fragment layout)."""
    return cute.arch.inline_ptx("movmatrix.sync.aligned.m8n8.trans.b16 {$w0}, {$r0};", write_only_types=[I32],
                                read_only_args=[x])


def _unpack(w):
    return cute.arch.inline_ptx(
        "{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, {$r0};\ncvt.f32.bf16 {$w0}, lo;\ncvt.f32.bf16 {$w1}, hi;\n}",
        write_only_types=[F32, F32], read_only_args=[w])


def _tanh(x, fast: bool):
    if fast:
        return cute.arch.inline_ptx("tanh.approx.f32 {$w0}, {$r0};", write_only_types=[F32], read_only_args=[x])
    e = cute.arch.inline_ptx("{\n.reg .f32 a;\nabs.f32 a, {$r0};\nmul.f32 a, a, {$r1};\nex2.approx.f32 {$w0}, a;\n}",
                             write_only_types=[F32], read_only_args=[x, F32(-2.0 * _LOG2E)])
    t = (F32(1.0) - e) / (F32(1.0) + e)
    return cute.arch.inline_ptx("copysign.f32 {$w0}, {$r0}, {$r1};", write_only_types=[F32], read_only_args=[x, t])


def _lds_f32(addr):
    return cute.arch.inline_ptx("ld.shared.f32 {$w0}, [{$r0}];", write_only_types=[F32], read_only_args=[addr])


def _lds_u32(addr):
    return cute.arch.inline_ptx("ld.shared.b32 {$w0}, [{$r0}];", write_only_types=[I32], read_only_args=[addr])


def _lds_bf16(addr):
    return cute.arch.inline_ptx("{\n.reg .b16 t;\nld.shared.b16 t, [{$r0}];\ncvt.f32.bf16 {$w0}, t;\n}",
                                write_only_types=[F32], read_only_args=[addr])


def _lds_v4(addr):
    return cute.arch.inline_ptx("ld.shared.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[F32] * 4, read_only_args=[addr])


def _guarded(op: str, args, pred):
    """``op`` under a predicate computed in the asm (a folded constant predicate would not assemble)."""
    if pred is None:
        cute.arch.inline_ptx(op, read_only_args=args)
    else:
        n = len(args)
        cute.arch.inline_ptx("{\n.reg .pred p;\nsetp.ne.b32 p, {$r%d}, 0;\n@p %s\n}" % (n, op),
                             read_only_args=[*args, I32(pred)])


def _sts_f32(addr, x, pred=None):
    _guarded("st.shared.f32 [{$r0}], {$r1};", [addr, x], pred)


def _stg_f32(addr, x, pred=None):
    _guarded("st.global.f32 [{$r0}], {$r1};", [addr, x], pred)


def _sts_v4(addr, x0, x1, x2, x3):
    cute.arch.inline_ptx("st.shared.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", read_only_args=[addr, x0, x1, x2, x3])


def _ldg_v4(addr):
    return cute.arch.inline_ptx("ld.global.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                                write_only_types=[F32] * 4, read_only_args=[addr])


def _stg_v4(addr, x0, x1, x2, x3):
    cute.arch.inline_ptx("st.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", read_only_args=[addr, x0, x1, x2, x3])


def _cp16(dst, src, pred):
    _guarded("cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", [dst, src], pred)


def _bfly_sum(x):
    for m in (1, 2, 4, 8, 16):
        x = x + cute.arch.shuffle_sync_bfly(x, m)
    return x


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------

class M2rnn:
    """Both kernels of one shape and config; every size is a compile-time constant."""

    def __init__(self, config: dict, shape: dict, backward: bool):
        self.backward = backward
        self.B, self.S, self.N = shape["B"], shape["S"], shape["N"]
        self.Nq, self.Nk, self.Nw, self.Nf, self.K = (shape[d] for d in ("Nq", "Nk", "Nw", "Nf", "K"))
        self.h0 = bool(shape["h0"])
        self.KS = config["K_SPLIT"]
        d = _dims(config, shape)
        self.R, self.NW, self.THREADS, self.T = d["R"], d["NW"], d["THREADS"], d["T"]
        self.NSEG = -(-self.S // self.T)
        self.fast = bool(config["FAST_TANH"])
        self.lay = _bwd_layout(config, shape) if backward else _fwd_layout(config, shape)

    # ---- host -----------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, q: cute.Pointer, k: cute.Pointer, v: cute.Pointer, W: cute.Pointer, f: cute.Pointer,
                 h0: cute.Pointer, dy: cute.Pointer, dhf: cute.Pointer, ckpt: cute.Pointer, dq: cute.Pointer,
                 dk: cute.Pointer, dv: cute.Pointer, df: cute.Pointer, dW: cute.Pointer, dh0: cute.Pointer,
                 stream: cuda.CUstream):
        B, S, N, K, KS = self.B, self.S, self.N, self.K, self.KS
        t = lambda p, n: cute.make_tensor(p, cute.make_layout(n))  # noqa: E731
        args = (t(q, B * S * self.Nq * K), t(k, B * S * self.Nk * K), t(v, B * S * N * V), t(W, self.Nw * V * V),
                t(f, B * S * self.Nf), t(h0, B * N * K * V), t(dy, B * S * N * V), t(dhf, B * N * K * V),
                t(ckpt, B * N * KS * self.NSEG * self.THREADS * 8), t(dq, B * S * N * K), t(dk, B * S * N * K),
                t(dv, KS * B * S * N * V), t(df, KS * B * S * N), t(dW, KS * B * N * V * V), t(dh0, B * N * K * V))
        grid = (B * N, KS, 1)
        if cutlass.const_expr(self.backward):
            self.kernel_bwd(*args).launch(grid=grid, block=[self.THREADS, 1, 1], stream=stream)
        else:
            self.kernel_fwd(*args).launch(grid=grid, block=[self.THREADS, 1, 1], stream=stream)

    # ---- pieces ---------------------------------------------------------------------------------
    def _coords(self):
        tid, _, _ = cute.arch.thread_idx()
        bn, ks, _ = cute.arch.block_idx()
        lane = tid % 32
        w = tid // 32
        g = lane // 4
        c = lane % 4
        return tid, bn, ks, bn // self.N, bn % self.N, w, g, c, 16 * w + g

    def _w_frags(self, mW, n, g, c, transpose: bool):
        """B fragments of W (H W: B[k][n] = W[k][n]) or of W^T (dX W^T), for the two n8 tiles."""
        base = (n // (self.N // self.Nw)) * V * V

        def w(r, col):
            return mW[base + (col * V + r if transpose else r * V + col)].to(F32)
        out = []
        for j in range(2):
            out.append(_pack(w(2 * c, 8 * j + g), w(2 * c + 1, 8 * j + g)))
            out.append(_pack(w(2 * c + 8, 8 * j + g), w(2 * c + 9, 8 * j + g)))
        return out

    def _prefetch(self, sbase, t0, b, n, ks, tid, mq, mk, mv, mf, mdy):
        """cp.async the inputs of steps t0 .. t0 + T - 1 (those inside 0 .. S - 1) into the buffer at
        ``sbase``; returns the gate values, loaded into registers (stored later by _store_f)."""
        S, T, R, TH = self.S, self.T, self.R, self.THREADS
        lay = self.lay
        streams = [(mk, self.Nk, self.K, lay["K"], R, n // (self.N // self.Nk), ks * R),
                   (mv, self.N, V, lay["V"], V, n, 0)]
        if cutlass.const_expr(self.backward):
            streams += [(mq, self.Nq, self.K, lay["Q"], R, n // (self.N // self.Nq), ks * R),
                        (mdy, self.N, V, lay["DY"], V, n, 0)]
        for m, heads, width, soff, cols, head, col0 in streams:
            per = cols // 8                       # 16-byte vectors per step
            gbase = m.iterator.toint()
            for it in range(-(-T * per // TH)):
                idx = it * TH + tid
                s = idx // per
                p = idx % per
                tt = t0 + s
                ok = (tt >= 0) & (tt < S)
                if cutlass.const_expr((it + 1) * TH > T * per):
                    ok = ok & (idx < T * per)
                tc = cutlass.min(cutlass.max(tt, 0), S - 1)      # an in-bounds address even when masked
                src = gbase + cutlass.Int64((((b * S + tc) * heads + head) * width + col0 + p * 8) * 2)
                _cp16(sbase + soff + (s * cols + p * 8) * 2, src, ok)
        cute.arch.cp_async_commit_group()
        fvals = []
        for it in range(-(-T // TH)):
            tt = cutlass.min(cutlass.max(t0 + it * TH + tid, 0), S - 1)
            fvals.append(mf[(b * S + tt) * self.Nf + n // (self.N // self.Nf)].to(F32))
        return fvals

    def _store_f(self, sbase, tid, fvals):
        for it in range(len(fvals)):
            idx = it * self.THREADS + tid
            _sts_f32(sbase + self.lay["F"] + idx * 4, fvals[it], idx < self.T)

    def _step_pre(self, ha, ib, i, lr0, c, bw):
        """Pre-activation H_{t-1} W + k v^T of step i of the buffer at ``ib`` (8 values, thread order)."""
        R = self.R
        k0 = _lds_bf16(ib + self.lay["K"] + (i * R + lr0) * 2)
        k1 = _lds_bf16(ib + self.lay["K"] + (i * R + lr0 + 8) * 2)
        vw0 = _lds_u32(ib + self.lay["V"] + (i * V + 2 * c) * 2)
        vw1 = _lds_u32(ib + self.lay["V"] + (i * V + 2 * c + 8) * 2)
        pre = []
        for j, vw in enumerate((vw0, vw1)):
            va, vb = _unpack(vw)
            pre += list(_mma(ha, bw[2 * j], bw[2 * j + 1], (k0 * va, k0 * vb, k1 * va, k1 * vb)))
        return pre, vw0, vw1

    def _ckpt_addr(self, mckpt, bn, ks, j, tid):
        """Float offset of this thread's first 4 state elements in checkpoint j (the other 4 follow
        THREADS * 4 floats later)."""
        return mckpt.iterator.toint() + cutlass.Int64(
            (((bn * self.KS + ks) * self.NSEG + j) * 2 * self.THREADS + tid) * 16)

    # ---- kernel 1: forward, checkpoints only ----------------------------------------------------
    @cute.kernel
    def kernel_fwd(self, mq: cute.Tensor, mk: cute.Tensor, mv: cute.Tensor, mW: cute.Tensor, mf: cute.Tensor,
                   mh0: cute.Tensor, mdy: cute.Tensor, mdhf: cute.Tensor, mckpt: cute.Tensor, mdq: cute.Tensor,
                   mdk: cute.Tensor, mdv: cute.Tensor, mdf: cute.Tensor, mdW: cute.Tensor, mdh0: cute.Tensor):
        tid, bn, ks, b, n, w, g, c, lr0 = self._coords()
        S, T, TH = self.S, self.T, self.THREADS
        smem = cutlass.memory.SmemAllocator()
        sbase = smem.allocate(self.lay["TOTAL"], byte_alignment=16).toint()
        buf = self.lay["BUF"]
        bw = self._w_frags(mW, n, g, c, False)

        h = cute.make_rmem_tensor((8,), F32)
        row0 = (bn * self.K + ks * self.R + lr0) * V
        for e in cutlass.range_constexpr(8):
            r = row0 + ((e // 2) % 2) * 8 * V + 2 * c + e % 2 + 8 * (e // 4)
            if cutlass.const_expr(self.h0):
                h[e] = mh0[r].to(F32)
            else:
                h[e] = F32(0.0)

        fv = self._prefetch(sbase, 0, b, n, ks, tid, mq, mk, mv, mf, mdy)
        self._store_f(sbase, tid, fv)
        for j in cutlass.range(self.NSEG, unroll=1):
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            ib = sbase + (j % 2) * buf
            fv = self._prefetch(sbase + ((j + 1) % 2) * buf, (j + 1) * T, b, n, ks, tid, mq, mk, mv, mf, mdy)
            ck = self._ckpt_addr(mckpt, bn, ks, j, tid)
            _stg_v4(ck, h[0], h[1], h[2], h[3])
            _stg_v4(ck + TH * 16, h[4], h[5], h[6], h[7])
            L = cutlass.min(T, S - j * T)
            for i in cutlass.range(L, unroll=1):
                self._fwd_step(h, ib, i, lr0, c, bw)
            self._store_f(sbase + ((j + 1) % 2) * buf, tid, fv)

    def _fwd_step(self, h, ib, i, lr0, c, bw):
        ha = [_pack(h[2 * p], h[2 * p + 1]) for p in range(4)]
        pre, _, _ = self._step_pre(ha, ib, i, lr0, c, bw)
        f = _lds_f32(ib + self.lay["F"] + i * 4)
        omf = F32(1.0) - f
        for e in range(8):
            h[e] = f * h[e] + omf * _tanh(pre[e], self.fast)

    # ---- kernel 2: backward ---------------------------------------------------------------------
    @cute.kernel
    def kernel_bwd(self, mq: cute.Tensor, mk: cute.Tensor, mv: cute.Tensor, mW: cute.Tensor, mf: cute.Tensor,
                   mh0: cute.Tensor, mdy: cute.Tensor, mdhf: cute.Tensor, mckpt: cute.Tensor, mdq: cute.Tensor,
                   mdk: cute.Tensor, mdv: cute.Tensor, mdf: cute.Tensor, mdW: cute.Tensor, mdh0: cute.Tensor):
        tid, bn, ks, b, n, w, g, c, lr0 = self._coords()
        B, S, N, K, T, R, NW, TH = self.B, self.S, self.N, self.K, self.T, self.R, self.NW, self.THREADS
        lay = self.lay
        smem = cutlass.memory.SmemAllocator()
        sbase = smem.allocate(lay["TOTAL"], byte_alignment=16).toint()
        buf = lay["BUF"]
        bw = self._w_frags(mW, n, g, c, False)
        bwt = self._w_frags(mW, n, g, c, True)
        zero = F32(0.0)

        h = cute.make_rmem_tensor((8,), F32)     # recompute state, then H_t during the walk
        dH = cute.make_rmem_tensor((8,), F32)
        dW = cute.make_rmem_tensor((8,), F32)
        row0 = (bn * K + ks * R + lr0) * V
        for e in cutlass.range_constexpr(8):
            dH[e] = mdhf[row0 + ((e // 2) % 2) * 8 * V + 2 * c + e % 2 + 8 * (e // 4)].to(F32)
            dW[e] = zero
        st_me = sbase + lay["ST"] + tid * 16      # this thread's slot of state 0 (second half: + TH * 16)

        last = self.NSEG - 1
        fv = self._prefetch(sbase + lay["IN"] + (last % 2) * buf, last * T, b, n, ks, tid, mq, mk, mv, mf, mdy)
        self._store_f(sbase + lay["IN"] + (last % 2) * buf, tid, fv)
        for jj in cutlass.range(self.NSEG, unroll=1):
            j = last - jj
            t0 = j * T
            L = cutlass.min(T, S - t0)
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            ib = sbase + lay["IN"] + (j % 2) * buf
            nb = sbase + lay["IN"] + ((j + 1) % 2) * buf
            fv = self._prefetch(nb, t0 - T, b, n, ks, tid, mq, mk, mv, mf, mdy)

            # Recompute H_{t0} .. H_{t0+L} into shared memory.
            ck = self._ckpt_addr(mckpt, bn, ks, j, tid)
            x0, x1, x2, x3 = _ldg_v4(ck)
            x4, x5, x6, x7 = _ldg_v4(ck + TH * 16)
            xs = (x0, x1, x2, x3, x4, x5, x6, x7)
            for e in cutlass.range_constexpr(8):
                h[e] = xs[e]
            _sts_v4(st_me, h[0], h[1], h[2], h[3])
            _sts_v4(st_me + TH * 16, h[4], h[5], h[6], h[7])
            for i in cutlass.range(L, unroll=1):
                self._fwd_step(h, ib, i, lr0, c, bw)
                sl = st_me + (i + 1) * TH * 32
                _sts_v4(sl, h[0], h[1], h[2], h[3])
                _sts_v4(sl + TH * 16, h[4], h[5], h[6], h[7])

            # Walk the segment backwards; h holds H_t.
            for ii in cutlass.range(L, unroll=1):
                i = L - 1 - ii
                self._bwd_step(h, dH, dW, ib, sbase, st_me + i * TH * 32, i, w, lr0, c, bw, bwt)

            self._store_f(nb, tid, fv)
            cute.arch.sync_threads()
            self._flush(sbase, mdq, mdk, mdv, mdf, b, n, ks, t0, L, tid)

        for e in cutlass.range_constexpr(8):
            mdh0[row0 + ((e // 2) % 2) * 8 * V + 2 * c + e % 2 + 8 * (e // 4)] = dH[e]
        # dW: sum the warps' partials through shared memory (the states region is free now).
        red = sbase + lay["ST"]
        for e in cutlass.range_constexpr(8):
            a = g + 8 * ((e // 2) % 2)
            col = 8 * (e // 4) + 2 * c + e % 2
            _sts_f32(red + ((w * V + a) * V + col) * 4, dW[e])
        cute.arch.sync_threads()
        for it in cutlass.range_constexpr(-(-V * V // TH)):
            idx = cutlass.min(it * TH + tid, V * V - 1)
            acc = _lds_f32(red + idx * 4)
            for ww in cutlass.range_constexpr(1, NW):
                acc = acc + _lds_f32(red + (ww * V * V + idx) * 4)
            _stg_f32(mdW.iterator.toint() + cutlass.Int64(((ks * B * N + bn) * V * V + idx) * 4), acc,
                     it * TH + tid < V * V)

    def _bwd_step(self, h, dH, dW, ib, sbase, st_i, i, w, lr0, c, bw, bwt):
        R, NW, lay = self.R, self.NW, self.lay
        zero = F32(0.0)
        zeros = (zero, zero, zero, zero)
        x0, x1, x2, x3 = _lds_v4(st_i)
        x4, x5, x6, x7 = _lds_v4(st_i + self.THREADS * 16)
        hp = (x0, x1, x2, x3, x4, x5, x6, x7)                     # H_{t-1}
        hpa = [_pack(hp[2 * p], hp[2 * p + 1]) for p in range(4)]
        pre, vw0, vw1 = self._step_pre(hpa, ib, i, lr0, c, bw)
        z = [_tanh(pre[e], self.fast) for e in range(8)]
        f = _lds_f32(ib + lay["F"] + i * 4)
        omf = F32(1.0) - f
        q0 = _lds_bf16(ib + lay["Q"] + (i * R + lr0) * 2)
        q1 = _lds_bf16(ib + lay["Q"] + (i * R + lr0 + 8) * 2)
        dyw0 = _lds_u32(ib + lay["DY"] + (i * V + 2 * c) * 2)
        dyw1 = _lds_u32(ib + lay["DY"] + (i * V + 2 * c + 8) * 2)
        kw0 = _lds_u32(ib + lay["K"] + (i * R + 16 * w + 2 * c) * 2)
        kw1 = _lds_u32(ib + lay["K"] + (i * R + 16 * w + 2 * c + 8) * 2)
        dy0, dy1 = _unpack(dyw0)
        dy8, dy9 = _unpack(dyw1)
        dyc = (dy0, dy1, dy0, dy1, dy8, dy9, dy8, dy9)
        qr = (q0, q0, q1, q1, q0, q0, q1, q1)

        # dq_t = H_t dy_t (dy as a broadcast B column): rows lr0 (d[0]) and lr0 + 8 (d[2]).
        hta = [_pack(h[2 * p], h[2 * p + 1]) for p in range(4)]
        dq = _mma(hta, dyw0, dyw1, zeros)

        G = [dH[e] + qr[e] * dyc[e] for e in range(8)]
        dX = [G[e] * (omf * (F32(1.0) - z[e] * z[e])) for e in range(8)]
        dxa = [_pack(dX[2 * p], dX[2 * p + 1]) for p in range(4)]
        for j in range(2):                                        # the chain: dH = f G + dX W^T
            d = _mma(dxa, bwt[2 * j], bwt[2 * j + 1], [f * G[4 * j + e] for e in range(4)])
            for e in range(4):
                dH[4 * j + e] = d[e]
        dk = _mma(dxa, vw0, vw1, zeros)

        part = G[0] * (hp[0] - z[0])
        for e in range(1, 8):
            part = part + G[e] * (hp[e] - z[e])
        dfw = _bfly_sum(part)

        # Transposed fragments: A = H_{t-1}^T, B = dX (k = rows of H) for dW and dv.
        hpt = (_trans(hpa[0]), _trans(hpa[2]), _trans(hpa[1]), _trans(hpa[3]))
        dxt = [_trans(x) for x in dxa]
        ka = (kw0, kw0, kw1, kw1)
        dvs = []
        for j in range(2):
            d = _mma(hpt, dxt[2 * j], dxt[2 * j + 1], [dW[4 * j + e] for e in range(4)])
            for e in range(4):
                dW[4 * j + e] = d[e]
            dvs.append(_mma(ka, dxt[2 * j], dxt[2 * j + 1], zeros))

        # Stage (lanes that hold the same value store the same word).
        _sts_f32(sbase + lay["DQ"] + (i * R + lr0) * 4, dq[0])
        _sts_f32(sbase + lay["DQ"] + (i * R + lr0 + 8) * 4, dq[2])
        _sts_f32(sbase + lay["DK"] + (i * R + lr0) * 4, dk[0])
        _sts_f32(sbase + lay["DK"] + (i * R + lr0 + 8) * 4, dk[2])
        for j in range(2):
            col = 8 * j + 2 * c
            _sts_f32(sbase + lay["DV"] + ((i * NW + w) * V + col) * 4, dvs[j][0])
            _sts_f32(sbase + lay["DV"] + ((i * NW + w) * V + col + 1) * 4, dvs[j][1])
        _sts_f32(sbase + lay["DF"] + (i * NW + w) * 4, dfw)
        for e in range(8):
            h[e] = hp[e]

    def _flush(self, sbase, mdq, mdk, mdv, mdf, b, n, ks, t0, L, tid):
        """Write the segment's staged gradients (steps t0 .. t0 + L - 1) to the fp32 buffers."""
        B, S, N, K, T, R, NW, TH, lay = self.B, self.S, self.N, self.K, self.T, self.R, self.NW, self.THREADS, self.lay
        gq, gk, gv, gf = (m.iterator.toint() for m in (mdq, mdk, mdv, mdf))
        for it in range(-(-T * R // TH)):
            idx = cutlass.min(it * TH + tid, T * R - 1)
            s = idx // R
            g = cutlass.Int64((((b * S + t0 + s) * N + n) * K + ks * R + idx % R) * 4)
            ok = s < L
            _stg_f32(gq + g, _lds_f32(sbase + lay["DQ"] + idx * 4), ok)
            _stg_f32(gk + g, _lds_f32(sbase + lay["DK"] + idx * 4), ok)
        for it in range(-(-T * V // TH)):
            idx = cutlass.min(it * TH + tid, T * V - 1)
            s = idx // V
            col = idx % V
            acc = _lds_f32(sbase + lay["DV"] + (s * NW * V + col) * 4)
            for ww in range(1, NW):
                acc = acc + _lds_f32(sbase + lay["DV"] + ((s * NW + ww) * V + col) * 4)
            ok = (s < L) & (it * TH + tid < T * V)
            _stg_f32(gv + cutlass.Int64(((((ks * B + b) * S + t0 + s) * N + n) * V + col) * 4), acc, ok)
        for it in range(-(-T // TH)):
            s = cutlass.min(it * TH + tid, T - 1)
            acc = _lds_f32(sbase + lay["DF"] + s * NW * 4)
            for ww in range(1, NW):
                acc = acc + _lds_f32(sbase + lay["DF"] + (s * NW + ww) * 4)
            ok = (s < L) & (it * TH + tid < T)
            _stg_f32(gf + cutlass.Int64((((ks * B + b) * S + t0 + s) * N + n) * 4), acc, ok)


# ----------------------------------------------------------------------------------------------
# Compile / build
# ----------------------------------------------------------------------------------------------

_ARGS = ("q", "k", "v", "W", "f", "h0", "dy", "dhf", "ckpt", "dq", "dk", "dv", "df", "dW", "dh0")
_FP32_ARGS = ("ckpt", "dq", "dk", "dv", "df", "dW", "dh0")


def _compile(config: dict, shape: dict, target: str, backward: bool, options: str):
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    from cutlass.runtime import make_fake_stream
    ptrs = [make_ptr(F32 if a in _FP32_ARGS else BF16, 0, AddressSpace.gmem, assumed_align=16) for a in _ARGS]
    return cute.compile(M2rnn(config, shape, backward), *ptrs, make_fake_stream(),
                        options=f"--gpu-arch {target} {options}".strip())


def _compile_one(config, shape, target, backward):
    return _aot.compile_with_resources(lambda opts: _compile(config, shape, target, backward, opts),
                                       f"cute_m2rnn_{target}_", target)


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Both kernels for ``target`` (no GPU); smem_bytes / registers are the larger of the two."""
    config = {**DEFAULTS, **config}
    reason = config_reason(config, shape) or eligibility(target)
    if reason:
        raise ValueError(f"cannot compile for {target}: {reason}")
    _, fwd = _compile_one(config, shape, target, False)
    _, bwd = _compile_one(config, shape, target, True)
    return {"smem_bytes": max(fwd["smem_bytes"], bwd["smem_bytes"]),
            "registers": max(fwd["registers"] or 0, bwd["registers"] or 0) or None,
            "stack": max(fwd["stack"] or 0, bwd["stack"] or 0),
            "compile_s": fwd["compile_s"] + bwd["compile_s"], "binary": "cubin",
            "kernels": {"forward": fwd, "backward": bwd}}


def build(config: dict, shape: dict):
    """Compile both kernels for the current device; run() launches them, then torch folds the
    K slabs and shared heads into the outputs."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    config = {**DEFAULTS, **config}
    target = _targets.device_target()
    reason = config_reason(config, shape) or eligibility(target)
    if reason:
        raise ValueError(reason)
    fwd_fn, fwd = _compile_one(config, shape, target, False)
    bwd_fn, bwd = _compile_one(config, shape, target, True)
    info = {"smem_bytes": max(fwd["smem_bytes"], bwd["smem_bytes"]),
            "registers": max(fwd["registers"] or 0, bwd["registers"] or 0), "spills": None}
    B, S, N, K, KS = shape["B"], shape["S"], shape["N"], shape["K"], config["K_SPLIT"]
    d = _dims(config, shape)
    nseg = -(-S // config["CKPT"])
    work: dict = {}
    streams: dict = {}

    def run(inputs, outputs):
        i = inputs
        dev = i["v"].device
        if work.get("dev") != dev:
            f32 = {"dtype": torch.float32, "device": dev}
            work.update(dev=dev, ckpt=torch.empty(B * N * KS * nseg * d["THREADS"] * 8, **f32),
                        dq=torch.empty(B, S, N, K, **f32), dk=torch.empty(B, S, N, K, **f32),
                        dv=torch.empty(KS, B, S, N, V, **f32), df=torch.empty(KS, B, S, N, **f32),
                        dW=torch.empty(KS, B, N, V, V, **f32), dh0=torch.empty(B, N, K, V, **f32))
        w = work
        tensors = {"q": i["q"], "k": i["k"], "v": i["v"], "W": i["W"], "f": i["f"], "h0": i.get("h0", i["dh_final"]),
                   "dy": i["dy"], "dhf": i["dh_final"], **{a: w[a] for a in _FP32_ARGS}}
        for name, t in tensors.items():
            if not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(f"{name}: expected a contiguous, 16-byte aligned tensor")
        raw = torch.cuda.current_stream().cuda_stream
        s = streams.get(raw)
        if s is None:
            s = streams[raw] = cuda.CUstream(raw)
        ptrs = [make_ptr(F32 if a in _FP32_ARGS else BF16, tensors[a].data_ptr(), AddressSpace.gmem,
                         assumed_align=16) for a in _ARGS]
        fwd_fn(*ptrs, s)
        bwd_fn(*ptrs, s)
        grads = {"dq": w["dq"], "dk": w["dk"], "dv": w["dv"].sum(0) if KS > 1 else w["dv"][0],
                 "df": w["df"].sum(0) if KS > 1 else w["df"][0], "dW": w["dW"].sum(0) if KS > 1 else w["dW"][0],
                 "dh0": w["dh0"]}
        for name, value in m2.reduce_heads(grads, shape).items():
            outputs[name].copy_(value)
        return info
    return run
