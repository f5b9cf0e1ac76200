"""CuTe DSL lane for m2rnn_fwd: Z_t = tanh(H_{t-1} W + k_t v_t^T), H_t = f_t H_{t-1} + (1 - f_t) Z_t,
y_t = H_t^T q_t (math and layouts: lab/problems/_m2rnn.py).

Design (one kernel launch, every dimension a compile-time constant):
  * grid: B * N / HEADS_PER_CTA CTAs; a CTA runs HEADS_PER_CTA value heads of one batch row, each head
    with K / ROWS_PER_WARP warps, one warp per ROWS_PER_WARP-row slab of the K x V state (rows evolve
    independently: W multiplies from the right and f is a scalar). At K = 64 and 16 rows per warp a
    head's four warps sit on the four SM sub-partitions, so its 1024 tanh per step use all four MUFUs.
  * the state lives in registers (fp32) for the whole sequence in the accumulator layout of the warp
    MMA m16n8k16 (thread (g, t) of a warp owns rows g, g+8 and columns 2t, 2t+1, 8+2t, 9+2t of each
    16 x 16 tile). PRODUCT = mma_bf16: H W on tensor cores with bf16 operands and fp32 accumulation
    (upstream's precision). The accumulator initialised with k_t v_t^T is the MMA's C operand, and the
    two 16 x 8 accumulator tiles of step t, rounded to bf16, are exactly the 16 x 16 A fragment of step
    t+1, so the serial chain is cvt -> mma -> tanh -> gate in registers, no shared memory; W's B
    fragments are loaded once. PRODUCT = fma_fp32: the same ownership, each thread gathers its two
    full rows from its quad with shuffles and does 16 fp32 FMAs per element (fp32 inputs; V = 16).
  * per-step inputs are prefetched in chunks of CHUNK steps into a STAGES-deep shared-memory ring:
    k, q, v rows with 16-byte cp.async (issued STAGES-1 chunks ahead), f (a strided scalar) with plain
    loads held in registers across the chunk and stored to shared memory at its end. One CTA barrier
    per chunk.
  * the step loop is software-pipelined so that shared-memory latency and the y reduction stay off the
    chain: step t's k, v, q, f were loaded into registers during step t-1, and step t-1's y partials
    are reduced and stored while step t's MMA and tanh are in flight (one basic block per UNROLL steps,
    no branches, so ptxas interleaves them).
  * y_t: per thread a partial over its rows, a halving butterfly over the warp's 8 row groups
    (4 shuffles at V = 16), one shared store per warp and step; per chunk the warps' partials are
    summed and written to y (contiguous rows of HEADS_PER_CTA * V elements).
  * FAST_TANH: tanh.approx.f32 (cute.math.tanh approx=True) or the accurate math.tanh lowering.

API usage learnt from NVIDIA/cutlass examples/python/CuTeDSL/cute/ampere/kernel/attention/
flash_attention_v2.py (warp MmaF16BF16Op tiled MMA, accumulator-to-A-operand layout regrouping, cp.async
copy atoms and groups, quad shuffles) and kernels/cute/gemm.py (AOT compile, cubin resources); the
fragment ownership is the PTX ISA's for mma.m16n8k16 and is checked at trace time against CuTe's
partitions (``_frag_tables``). Code written for this lab.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import torch
from cutlass.cute.nvgpu import cpasync

from kernels import _targets
from kernels.cute import _aot
from kernels.cute._aot import static_smem, versions  # noqa: F401 (versions: lane interface)

DSL = "cute"
KERNEL = "m2rnn_fwd"
TUNABLES = ("ROWS_PER_WARP", "HEADS_PER_CTA", "CHUNK", "STAGES", "UNROLL", "FAST_TANH", "PRODUCT")
DEFAULTS = {"ROWS_PER_WARP": 16, "HEADS_PER_CTA": 1, "CHUNK": 32, "STAGES": 2, "UNROLL": 2,
            "FAST_TANH": True, "PRODUCT": "auto"}
TARGETS = ("sm_90a", "sm_100a", "sm_120a", "sm_121a")
DTYPES = ("float32", "bfloat16")
_NAMES = ("q", "k", "v", "W", "f", "h0", "y", "h_final")


# ----------------------------------------------------------------------------------------------
# Pure-Python rules
# ----------------------------------------------------------------------------------------------

def _product(config: dict, shape: dict) -> str:
    if config["PRODUCT"] != "auto":
        return config["PRODUCT"]
    return "mma_bf16" if shape["dtype"] == "bfloat16" else "fma_fp32"


def _elem(shape: dict) -> int:
    return 4 if shape["dtype"] == "float32" else 2


def _threads(config: dict, shape: dict) -> int:
    return 32 * (shape["K"] // config["ROWS_PER_WARP"]) * config["HEADS_PER_CTA"]


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    config = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    # The values each knob may take are the sweep file's (sweeps/m2rnn_fwd/cute.toml); the harness checks them.
    prod = config["PRODUCT"]
    if prod == "mma_bf16" and shape["dtype"] == "float32":
        return ("PRODUCT=mma_bf16 rounds the state to bf16: below the fp32 tolerance (2e-3); fp32 shapes "
                "take fma_fp32 (or auto)")
    K, V, N = shape["K"], shape["V"], shape["N"]
    rows, hpc = config["ROWS_PER_WARP"], config["HEADS_PER_CTA"]
    if K % rows:
        return f"K={K} must be a multiple of ROWS_PER_WARP={rows} (each warp owns whole 16-row MMA tiles)"
    if _product(config, shape) == "mma_bf16":
        if V not in (16, 32, 64):
            return f"V={V}: the bf16 MMA path needs V in 16, 32, 64 (V is the MMA's K and N; more spills)"
    elif V != 16:
        return (f"V={V}: the fp32 FMA path keeps a thread's 16 x 4 slice of W and two full state rows in "
                f"registers, written for V = 16 only")
    if N % hpc:
        return f"HEADS_PER_CTA={hpc} must divide N={N}"
    if _threads(config, shape) > 1024:
        return f"{_threads(config, shape)} threads per CTA (K/ROWS_PER_WARP warps x HEADS_PER_CTA) exceed 1024"
    T, un = config["CHUNK"], config["UNROLL"]
    if T % un:
        return f"UNROLL={un} must divide CHUNK={T}"
    B, S = shape["B"], shape["S"]
    if max(B * S * N * max(K, V), B * N * K * V) >= 2 ** 31:
        return "tensors of 2^31 elements or more (32-bit indexing)"
    return None


def eligibility(target: str) -> str | None:
    if target not in TARGETS:
        return (f"cute m2rnn_fwd has no path for {target} (warp mma.sync + cp.async kernel compiled for "
                f"{', '.join(TARGETS)})")
    return None


def _smem_parts(config: dict, shape: dict) -> dict:
    config = {**DEFAULTS, **config}
    e, T, st, hpc = _elem(shape), config["CHUNK"], config["STAGES"], config["HEADS_PER_CTA"]
    K, V = shape["K"], shape["V"]
    wph = K // config["ROWS_PER_WARP"]
    return {"k": st * hpc * T * K * e, "q": st * hpc * T * K * e, "v": st * hpc * T * V * e,
            "f": st * hpc * T * 4, "y": 2 * hpc * (T + 1) * wph * V * 4}


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA in bytes: the input ring (k, q, v rows in the input dtype, f in fp32, STAGES
    chunks of CHUNK steps per head) plus two chunks of per-warp fp32 y partials, each array padded to
    128 B, plus the static part (kernels/cute/_aot.py ``static_smem``). The tests hold it to the compiled
    figure."""
    dynamic = sum(-(-b // 128) * 128 for b in _smem_parts(config, shape).values())
    return dynamic + static_smem(target)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

def _frag_tables(tiled_mma, R: int, V: int):
    """Trace-time tables of the per-lane fragments, read from CuTe's own partitions of identity tensors:
    C element i -> (row, column) delta from the lane's base (g, 2t) (g = lane / 4, t = lane % 4); the A
    view of a C-ordered fragment (checked element by element); B element -> (k, n) delta from (2t, g).
    Every lane is checked against these bases, so the kernel's index arithmetic is CuTe's layout."""
    def coords(part, n):
        return [tuple(int(x) for x in part[i]) for i in range(n)]

    mt, kb = R // 16, V // 16
    nfrag, nb_frag = R * V // 32, V * V // 32
    # C is ((2 cols, 2 row halves), MT, NB) compact; A regroups pairs of N atoms into one K block.
    a_view = cute.make_layout(((2, 2, 2), mt, kb), stride=((1, 2, 4 * mt), 4, 8 * mt))
    base_c = base_b = None
    for lane in range(32):
        thr = tiled_mma.get_slice(lane)
        g, t = lane // 4, lane % 4
        c = [(r - g, col - 2 * t) for r, col in coords(thr.partition_C(cute.make_identity_tensor((R, V))), nfrag)]
        a = [(r - g, col - 2 * t) for r, col in coords(thr.partition_A(cute.make_identity_tensor((R, V))), nfrag)]
        b = [(k - 2 * t, n - g) for n, k in coords(thr.partition_B(cute.make_identity_tensor((V, V))), nb_frag)]
        base_c, base_b = base_c or c, base_b or b
        if c != base_c or b != base_b or any(c[a_view(j)] != a[j] for j in range(nfrag)):
            raise AssertionError(f"mma.m16n8k16 fragment ownership differs from the kernel's at lane {lane}")
    b_shape = tiled_mma.get_slice(0).partition_B(cute.make_identity_tensor((V, V))).shape
    return base_c, a_view, base_b, b_shape


class M2RNNForward:
    def __init__(self, shape: dict, config: dict):
        self.dt = cutlass.Float32 if shape["dtype"] == "float32" else cutlass.BFloat16
        self.e = _elem(shape)
        for d in ("B", "S", "N", "Nq", "Nk", "Nw", "Nf", "K", "V"):
            setattr(self, d, shape[d])
        self.has_h0 = bool(shape["h0"])
        self.R, self.HPC = config["ROWS_PER_WARP"], config["HEADS_PER_CTA"]
        self.T, self.STAGES, self.UNROLL = config["CHUNK"], config["STAGES"], config["UNROLL"]
        self.fast = bool(config["FAST_TANH"])
        self.mma = _product(config, shape) == "mma_bf16"
        self.WPH = self.K // self.R
        self.threads = _threads(config, shape)
        self.vec = 16 // self.e                       # elements per 16-byte cp.async
        self.nchunks = -(-self.S // self.T)
        self.tail = self.S - (self.nchunks - 1) * self.T   # steps of the last chunk (1..T)

    # ---- host -------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, q_ptr: cute.Pointer, k_ptr: cute.Pointer, v_ptr: cute.Pointer, w_ptr: cute.Pointer,
                 f_ptr: cute.Pointer, h0_ptr: cute.Pointer, y_ptr: cute.Pointer, hf_ptr: cute.Pointer,
                 stream: cuda.CUstream):
        B, S, N, K, V, vec = self.B, self.S, self.N, self.K, self.V, self.vec
        # Global views, innermost first, the 16-byte vector as its own mode for the cp.async copies.
        mq = cute.make_tensor(q_ptr, cute.make_layout((vec, K // vec, self.Nq, S, B),
                                                      stride=(1, vec, K, self.Nq * K, S * self.Nq * K)))
        mk = cute.make_tensor(k_ptr, cute.make_layout((vec, K // vec, self.Nk, S, B),
                                                      stride=(1, vec, K, self.Nk * K, S * self.Nk * K)))
        mv = cute.make_tensor(v_ptr, cute.make_layout((vec, V // vec, N, S, B),
                                                      stride=(1, vec, V, N * V, S * N * V)))
        mw = cute.make_tensor(w_ptr, cute.make_layout((V, V, self.Nw), stride=(V, 1, V * V)))   # [j, c, nw]
        mf = cute.make_tensor(f_ptr, cute.make_layout((self.Nf, S, B), stride=(1, self.Nf, S * self.Nf)))
        state = cute.make_layout((V, K, N, B), stride=(1, V, K * V, N * K * V))                  # [c, r, n, b]
        mh0 = cute.make_tensor(h0_ptr, state)
        mhf = cute.make_tensor(hf_ptr, state)
        my = cute.make_tensor(y_ptr, cute.make_layout((V, N, S, B), stride=(1, V, N * V, S * N * V)))

        T, HPC, ST = self.T, self.HPC, self.STAGES
        dt = self.dt

        @cute.struct
        class SharedStorage:
            sk: cute.struct.Align[cute.struct.MemRange[dt, ST * HPC * T * K], 128]
            sq: cute.struct.Align[cute.struct.MemRange[dt, ST * HPC * T * K], 128]
            sv: cute.struct.Align[cute.struct.MemRange[dt, ST * HPC * T * V], 128]
            sf: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, ST * HPC * T], 128]
            sy: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, 2 * HPC * (T + 1) * self.WPH * V], 128]

        self.storage = SharedStorage
        op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16))
        tiled_mma = cute.make_tiled_mma(op, cute.make_layout((1, 1, 1)), permutation_mnk=(16, 16, 16))
        # ptxas left alone keeps 128-thread CTAs near 80 registers (6 CTAs per SM: b8_n84 in one wave)
        # but squeezes 512-thread CTAs to 64 registers and spills; .minnctapersm 1 lifts that cap.
        self.kernel(mq, mk, mv, mw, mf, mh0, my, mhf, tiled_mma).launch(
            grid=[B * N // HPC, 1, 1], block=[self.threads, 1, 1],
            min_blocks_per_mp=1 if self.threads >= 512 else 0, stream=stream)

    # ---- device -----------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mq: cute.Tensor, mk: cute.Tensor, mv: cute.Tensor, mw: cute.Tensor, mf: cute.Tensor,
               mh0: cute.Tensor, my: cute.Tensor, mhf: cute.Tensor, tiled_mma: cute.TiledMma):
        K, V, T, HPC, ST, R, WPH, vec = self.K, self.V, self.T, self.HPC, self.STAGES, self.R, self.WPH, self.vec
        f32 = cutlass.Float32
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        g = lane // 4
        tq = lane % 4
        hc = warp // WPH                       # head within the CTA
        rb = warp % WPH                        # row slab of that head
        b = bidx // (self.N // HPC)
        n0 = (bidx % (self.N // HPC)) * HPC
        n = n0 + hc

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        ring_kq = cute.make_layout((K, T, HPC, ST))
        sk = storage.sk.get_tensor(ring_kq)
        sq = storage.sq.get_tensor(ring_kq)
        sv = storage.sv.get_tensor(cute.make_layout((V, T, HPC, ST)))
        sf = storage.sf.get_tensor(cute.make_layout((T, HPC, ST)))
        sy = storage.sy.get_tensor(cute.make_layout((V, WPH, T + 1, HPC, 2)))   # row T: spare
        # The same rings seen as 16-byte vectors for cp.async.
        sk_v = storage.sk.get_tensor(cute.make_layout((vec, K // vec, T, HPC, ST)))
        sq_v = storage.sq.get_tensor(cute.make_layout((vec, K // vec, T, HPC, ST)))
        sv_v = storage.sv.get_tensor(cute.make_layout((vec, V // vec, T, HPC, ST)))
        cp_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), self.dt,
                                      num_bits_per_copy=128)

        # ---- fragment tables and per-thread constants
        c_coords, a_view, b_kn, b_shape = _frag_tables(tiled_mma, R, V)
        thr = tiled_mma.get_slice(lane)
        c_shape = thr.partition_C(cute.make_identity_tensor((R, V))).shape
        nfrag = R * V // 32
        row0 = rb * R + g                      # row of the thread's first element within the head
        col0 = 2 * tq
        drs = sorted({c[0] for c in c_coords})
        dcs = sorted({c[1] for c in c_coords})
        assert dcs == [8 * (s // 2) + s % 2 for s in range(len(dcs))], dcs

        H = cute.make_rmem_tensor(c_shape, f32)
        acc = cute.make_rmem_tensor(c_shape, f32)
        if cutlass.const_expr(self.has_h0):
            for i in cutlass.range_constexpr(nfrag):
                H[i] = mh0[col0 + c_coords[i][1], row0 + c_coords[i][0], n, b].to(f32)
        else:
            for i in cutlass.range_constexpr(nfrag):
                H[i] = f32(0.0)
        nw = n // (self.N // self.Nw)
        rA = cute.make_rmem_tensor(c_shape, cutlass.BFloat16)
        tA = cute.make_tensor(rA.iterator, a_view)
        rB = cute.make_rmem_tensor(b_shape, cutlass.BFloat16)
        wr = None
        if cutlass.const_expr(self.mma):
            for i in cutlass.range_constexpr(V * V // 32):
                rB[i] = mw[2 * tq + b_kn[i][0], g + b_kn[i][1], nw]
        else:
            # fp32 FMA path: W[2 (t ^ x) + dh, 2 t + dw] for quad partner x, its column dh and own column dw.
            wr = cute.make_rmem_tensor((4, len(dcs), len(dcs)), f32)
            for x in cutlass.range_constexpr(4):
                for ih in cutlass.range_constexpr(len(dcs)):
                    for iw in cutlass.range_constexpr(len(dcs)):
                        wr[x, ih, iw] = mw[2 * (tq ^ x) + dcs[ih], col0 + dcs[iw], nw].to(f32)

        p = (b, n0, hc, rb, row0, col0, tidx, lane)
        tabs = (c_coords, drs, dcs, tA, rA, rB, wr)
        regs = (H, acc, cute.make_rmem_tensor(c_shape, f32),
                cute.make_rmem_tensor((2 * len(drs) + len(dcs) + 1,), f32),   # next step's k, v, q, f
                cute.make_rmem_tensor((len(dcs),), f32))                      # previous step's y partials
        srings = (sk, sq, sv, sf, sy, sk_v, sq_v, sv_v)
        gm = (mq, mk, mv, mf, my)

        # ---- prologue: chunks 0..STAGES-2 in flight
        for c in cutlass.range_constexpr(ST - 1):
            if cutlass.const_expr(c < self.nchunks):
                self._issue(cp_atom, gm, srings, p, c, c % ST)
                fr = self._load_f(gm, p, c)
                self._store_f(srings, p, fr, c % ST)
            cute.arch.cp_async_commit_group()

        nfull = self.nchunks - 1 if self.tail < T else self.nchunks
        for c in cutlass.range(nfull, unroll=1):
            self._chunk(cp_atom, tiled_mma, gm, srings, p, tabs, regs, c, T)
        if cutlass.const_expr(self.tail < T):
            self._chunk(cp_atom, tiled_mma, gm, srings, p, tabs, regs, self.nchunks - 1, self.tail)
        cute.arch.sync_threads()
        self._flush_y(srings, gm, p, self.nchunks - 1, self.tail)

        for i in cutlass.range_constexpr(nfrag):
            mhf[col0 + c_coords[i][1], row0 + c_coords[i][0], n, b] = H[i].to(self.dt)

    def _ok(self, idx, total: int):
        """idx < total as a DSL predicate (always true when the threads tile ``total`` evenly)."""
        return (idx < total) if total % self.threads else (idx >= 0)

    @cute.jit
    def _issue(self, cp_atom, gm, srings, p, c, st):
        """cp.async of chunk c's k, q, v rows into ring stage st (steps past S skipped)."""
        mq, mk, mv, mf, my = gm
        sk, sq, sv, sf, sy, sk_v, sq_v, sv_v = srings
        b, n0, hc, rb, row0, col0, tidx, lane = p
        K, V, T, HPC, vec, nth = self.K, self.V, self.T, self.HPC, self.vec, self.threads
        kvecs, vvecs = K // vec, V // vec
        per_step = HPC * (2 * kvecs + vvecs)
        total = T * per_step
        for it in cutlass.range_constexpr(-(-total // nth)):
            idx = tidx + it * nth
            t = idx // per_step
            r = idx % per_step
            h = r // (2 * kvecs + vvecs)
            j = r % (2 * kvecs + vvecs)
            tt = c * T + t
            if self._ok(idx, total) & (tt < self.S):
                n = n0 + h
                if j < kvecs:
                    cute.copy(cp_atom, mk[None, j, n // (self.N // self.Nk), tt, b], sk_v[None, j, t, h, st])
                elif j < 2 * kvecs:
                    cute.copy(cp_atom, mq[None, j - kvecs, n // (self.N // self.Nq), tt, b],
                              sq_v[None, j - kvecs, t, h, st])
                else:
                    cute.copy(cp_atom, mv[None, j - 2 * kvecs, n, tt, b], sv_v[None, j - 2 * kvecs, t, h, st])

    @cute.jit
    def _load_f(self, gm, p, c):
        """Plain loads of chunk c's gates (one scalar per step and head), kept in registers."""
        mq, mk, mv, mf, my = gm
        b, n0, hc, rb, row0, col0, tidx, lane = p
        T, HPC, nth = self.T, self.HPC, self.threads
        fr = cute.make_rmem_tensor((-(-T * HPC // nth),), cutlass.Float32)
        for it in cutlass.range_constexpr(-(-T * HPC // nth)):
            idx = tidx + it * nth
            t = idx // HPC
            tt = c * T + t
            fr[it] = cutlass.Float32(1.0)
            if self._ok(idx, T * HPC) & (tt < self.S):
                fr[it] = mf[(n0 + idx % HPC) // (self.N // self.Nf), tt, b].to(cutlass.Float32)
        return fr

    @cute.jit
    def _store_f(self, srings, p, fr, st):
        sk, sq, sv, sf, sy, sk_v, sq_v, sv_v = srings
        b, n0, hc, rb, row0, col0, tidx, lane = p
        T, HPC, nth = self.T, self.HPC, self.threads
        for it in cutlass.range_constexpr(-(-T * HPC // nth)):
            idx = tidx + it * nth
            if self._ok(idx, T * HPC):
                sf[idx // HPC, idx % HPC, st] = fr[it]

    @cute.jit
    def _flush_y(self, srings, gm, p, c, L: cutlass.Constexpr):
        """y rows of chunk c (L steps): the sum of the warps' partials, written as the output dtype."""
        sk, sq, sv, sf, sy, sk_v, sq_v, sv_v = srings
        mq, mk, mv, mf, my = gm
        b, n0, hc, rb, row0, col0, tidx, lane = p
        V, T, HPC, WPH, nth = self.V, self.T, self.HPC, self.WPH, self.threads
        total = L * HPC * V
        for it in cutlass.range_constexpr(-(-total // nth)):
            idx = tidx + it * nth
            if self._ok(idx, total):
                col = idx % V
                h = (idx // V) % HPC
                t = idx // (V * HPC)
                s = sy[col, 0, t, h, c % 2]
                for w in cutlass.range_constexpr(1, WPH):
                    s = s + sy[col, w, t, h, c % 2]
                my[col, n0 + h, c * T + t, b] = s.to(self.dt)

    @cute.jit
    def _chunk(self, cp_atom, tiled_mma, gm, srings, p, tabs, regs, c, L: cutlass.Constexpr):
        """One chunk of L steps: wait for its inputs, write the previous chunk's y, start the copies of
        chunk c + STAGES - 1, then the serial steps."""
        ST = self.STAGES
        H, acc, acc2, nx, P = regs
        cute.arch.cp_async_wait_group(ST - 2)
        cute.arch.sync_threads()
        if c > 0:
            self._flush_y(srings, gm, p, c - 1, self.T)
        nxt = c + ST - 1
        st_next = nxt % ST
        if nxt < self.nchunks:
            self._issue(cp_atom, gm, srings, p, nxt, st_next)
        cute.arch.cp_async_commit_group()
        fr = self._load_f(gm, p, nxt)
        st = c % ST
        self._load_inputs(srings, p, tabs, nx, 0, st)
        for i in cutlass.range_constexpr(len(tabs[2])):
            P[i] = cutlass.Float32(0.0)
        for i in cutlass.range(L, unroll=self.UNROLL if L % self.UNROLL == 0 else 1):
            self._step(tiled_mma, srings, p, tabs, regs, i, L, st, c % 2)
        self._y_store(srings, p, tabs, P, L - 1, c % 2)
        self._store_f(srings, p, fr, st_next)

    @cute.jit
    def _load_inputs(self, srings, p, tabs, dst, t, st):
        """Step t's k (rows), v (columns), q (rows) and f from the ring into registers ``dst``."""
        sk, sq, sv, sf, sy, sk_v, sq_v, sv_v = srings
        b, n0, hc, rb, row0, col0, tidx, lane = p
        c_coords, drs, dcs, tA, rA, rB, wr = tabs
        nr, nc = len(drs), len(dcs)
        for j in cutlass.range_constexpr(nr):
            dst[j] = sk[row0 + drs[j], t, hc, st].to(cutlass.Float32)
            dst[nr + nc + j] = sq[row0 + drs[j], t, hc, st].to(cutlass.Float32)
        for j in cutlass.range_constexpr(nc):
            dst[nr + j] = sv[col0 + dcs[j], t, hc, st].to(cutlass.Float32)
        dst[2 * nr + nc] = sf[t, hc, st]

    @cute.jit
    def _y_store(self, srings, p, tabs, P, t, ybuf):
        """Sum the per-column partials P over the warp's 8 row groups and store them as sy[:, warp, t].

        A halving butterfly over lane bits 4, 3, 2: each round a lane keeps half of its slots and receives
        its partner's sums for them (V = 16: 2 + 1 + 1 shuffles instead of 3 x 4). Slot s is column
        col0 + dcs[s] = col0 + 8 (s // 2) + s % 2. With 4 slots the last round is a plain sum and lanes l,
        l ^ 4 store the same value to the same address (no branch: the unrolled steps stay one basic block).
        """
        sk, sq, sv, sf, sy, sk_v, sq_v, sv_v = srings
        b, n0, hc, rb, row0, col0, tidx, lane = p
        f32 = cutlass.Float32
        vals = [P[i] for i in range(len(tabs[2]))]
        slot = cutlass.Int32(0)
        for off in (16, 8, 4):
            upper = (lane & off) != 0
            if cutlass.const_expr(len(vals) > 1):
                half = len(vals) // 2
                new = []
                for j in cutlass.range_constexpr(half):
                    send = f32(cutlass.select_(upper, vals[j], vals[j + half]))
                    keep = f32(cutlass.select_(upper, vals[j + half], vals[j]))
                    new.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
                slot = slot + cutlass.Int32(cutlass.select_(upper, half, 0))
                vals = new
            else:
                vals = [vals[0] + cute.arch.shuffle_sync_bfly(vals[0], offset=off)]
        for j in cutlass.range_constexpr(len(vals)):
            sj = slot + j
            sy[col0 + (sj // 2) * 8 + sj % 2, rb, t, hc, ybuf] = vals[j]

    @cute.jit
    def _step(self, tiled_mma, srings, p, tabs, regs, t, L: cutlass.Constexpr, st, ybuf):
        """Step t of a chunk, software-pipelined: its inputs were loaded into ``nx`` during step t-1
        (or at the chunk start), step t+1's are loaded first thing, and the y partials of step t-1 (P)
        are reduced and stored while this step's MMA and tanh run; this step's partials go to P."""
        b, n0, hc, rb, row0, col0, tidx, lane = p
        c_coords, drs, dcs, tA, rA, rB, wr = tabs
        H, acc, acc2, nx, P = regs
        f32 = cutlass.Float32
        nfrag, nr, nc = len(c_coords), len(drs), len(dcs)
        cur = [nx[j] for j in range(2 * nr + nc + 1)]
        # The last step of the chunk reloads its own row (in bounds, unused): no branch in the body.
        self._load_inputs(srings, p, tabs, nx, cutlass.min(t + 1, L - 1), st)
        # acc = k_t v_t^T, the C operand of the product (cute.gemm with D != C lost the MMA in this
        # DSL version, so C is D).
        for i in cutlass.range_constexpr(nfrag):
            acc[i] = cur[drs.index(c_coords[i][0])] * cur[nr + dcs.index(c_coords[i][1])]
        if cutlass.const_expr(self.mma):
            rA.store(H.load().to(cutlass.BFloat16))
            cute.gemm(tiled_mma, acc, tA, rB, acc)
        else:
            # Full rows g + dr from the quad: partner x holds columns 2 (t ^ x) + dc. Two partial sums
            # (partners 0, 1 and 2, 3) halve the dependent FMA chain.
            for i in cutlass.range_constexpr(nfrag):
                acc2[i] = f32(0.0)
            for x in cutlass.range_constexpr(4):
                part = acc if x < 2 else acc2
                for i in cutlass.range_constexpr(nfrag):
                    hx = H[i]
                    if cutlass.const_expr(x > 0):
                        hx = cute.arch.shuffle_sync_bfly(H[i], offset=x)
                    dr, dh = c_coords[i]
                    ih = dcs.index(dh)
                    for o in cutlass.range_constexpr(nfrag):
                        if cutlass.const_expr(c_coords[o][0] == dr):
                            part[o] = part[o] + hx * wr[x, ih, dcs.index(c_coords[o][1])]
            for i in cutlass.range_constexpr(nfrag):
                acc[i] = acc[i] + acc2[i]
        # y of step t-1; at t = 0 the partials are zeros and go to the spare row T.
        self._y_store(srings, p, tabs, P, cutlass.Int32(cutlass.select_(t == 0, self.T, t - 1)), ybuf)
        ft = cur[2 * nr + nc]
        for i in cutlass.range_constexpr(nfrag):
            z = cute.math.tanh(acc[i], approx=self.fast)
            H[i] = z + (H[i] - z) * ft
        # This step's partials of y_t = H_t^T q_t over the thread's rows, per column slot.
        for j in cutlass.range_constexpr(nc):
            s = f32(0.0)
            for i in cutlass.range_constexpr(nfrag):
                if cutlass.const_expr(c_coords[i][1] == dcs[j]):
                    s = s + H[i] * cur[nr + nc + drs.index(c_coords[i][0])]
            P[j] = s


# ----------------------------------------------------------------------------------------------
# Compile / build
# ----------------------------------------------------------------------------------------------

def _compile(config: dict, shape: dict, target: str, options: str):
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    from cutlass.runtime import make_fake_stream

    config = {**DEFAULTS, **config}
    fwd = M2RNNForward(shape, config)
    # Placeholder pointers (address 0) for tracing: the real addresses come at call time.
    ptrs = [make_ptr(fwd.dt, 0, AddressSpace.gmem, assumed_align=16) for _ in _NAMES]
    return cute.compile(fwd, *ptrs, make_fake_stream(), options=f"--gpu-arch {target} {options}".strip())


def _compile_with_resources(config: dict, shape: dict, target: str):
    return _aot.compile_with_resources(lambda opts: _compile(config, shape, target, opts),
                                       f"cute_m2rnn_fwd_{target}_", target)


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile for ``target`` (no GPU). Returns {"smem_bytes" (dynamic, from the host launch
    code, + static, from the cubin), "registers", "stack" (bytes of local memory per thread: > 0 means
    spills or a register array indexed at run time), "compile_s", "binary": "cubin", ...}."""
    config = {**DEFAULTS, **config}
    reason = config_reason(config, shape) or eligibility(target)
    if reason:
        raise ValueError(f"cannot compile for {target}: {reason}")
    return _compile_with_resources(config, shape, target)[1]


def build(config: dict, shape: dict):
    """Compile once for the current device and return ``run(inputs, outputs)`` (one launch)."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    config = {**DEFAULTS, **config}
    target = _targets.device_target()
    reason = config_reason(config, shape) or eligibility(target)
    if reason:
        raise ValueError(reason)
    fn, res = _compile_with_resources(config, shape, target)
    info = {"smem_bytes": res["smem_bytes"], "registers": res["registers"], "spills": res["stack"]}
    want = getattr(torch, shape["dtype"])
    dt = cutlass.Float32 if shape["dtype"] == "float32" else cutlass.BFloat16
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    sizes = {"q": (B, S, shape["Nq"], K), "k": (B, S, shape["Nk"], K), "v": (B, S, N, V),
             "W": (shape["Nw"], V, V), "f": (B, S, shape["Nf"]), "h0": (B, N, K, V), "y": (B, S, N, V),
             "h_final": (B, N, K, V)}
    streams: dict = {}

    def run(inputs, outputs):
        ts = {**inputs, **outputs}
        if "h0" not in ts:
            ts["h0"] = outputs["h_final"]     # never read: the kernel is compiled without h0
        for name in _NAMES:
            t = ts[name]
            if t.dtype != want or tuple(t.shape) != sizes[name] or not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(f"{name}: expected a contiguous, 16-byte aligned {want} tensor of shape "
                                 f"{sizes[name]}")
        raw = torch.cuda.current_stream().cuda_stream
        s = streams.get(raw)
        if s is None:
            s = streams[raw] = cuda.CUstream(raw)
        fn(*(make_ptr(dt, ts[name].data_ptr(), AddressSpace.gmem, assumed_align=16) for name in _NAMES), s)
        return info
    return run
