"""TileLang lane for m2rnn_bwd: a checkpointing forward, then backprop through time per (batch, head).

Two kernels, one CTA per (batch row b, value head n), ``threads`` threads; each warp owns 16 rows of the
K x V state (K = 64, V = 16: 4 warps), which lives in registers (fp32 fragments) the whole time.

1. ``fwd``: the recurrence over all S steps, writing only the state before every CKPT-th step (fp32) to a
   checkpoint buffer [B*N, NSP, K, V]. Inputs come in chunks of CHUNK steps (k, v and the gate, which the
   lane hands over as an fp32 [B, Nf, S_pad] copy padded with ones) through ``T.Pipelined`` copies
   (cp.async, ``num_stages`` buffers), so no step waits on global memory. Per step: the state is cast to
   a bf16 fragment that is the A operand of ``T.gemm`` (with the FullRow warp policy the accumulator
   layout equals the A layout, so the cast is thread-local and nothing on the chain touches shared
   memory), H W is one 64 x 16 x 16 product (mma.sync on every target, as GB10 runs it), then tanh
   and the gate. No barrier in the step loop (checked in the generated CUDA).
2. ``bwd``: the segments of CKPT steps, last to first, in a ``T.Pipelined`` loop (the next segment's
   checkpoint, q, k, v, dy and gate are copied by cp.async while this one runs; v and dy travel as int32
   pairs of bf16 so that their 32-byte rows still make 4-byte cp.async copies). Per segment:
   a. recompute the segment's states from its checkpoint with the forward's exact step (bf16 product,
      same tanh: the states are the forward's bit for bit); keep each H_{t-1} (bf16) and the row sums of
      dq_t = H_t dy_t in registers, then store them to shared memory after the loop: ``hs`` in a
      stacked layout [(t, r), (p, i)] = H_{t-1}[16 p + r, i] (p = K/16 row blocks).
   b. walk the segment backwards, dH in a fragment: Z_t from hs (one more product and tanh, independent
      of dH, so the unrolled steps overlap it with the chain), G = dH + q dy^T, dX = (1 - f) G (1 - Z^2),
      dH = f G, then ``T.gemm(dX (bf16 fragment), W, dH, transpose_B)`` adds dX W^T in place: the
      serial chain is FMA, MUL, cvt, one MMA. dX and the row sums of G (H_{t-1} - Z_t) (for df) stay in
      registers until the loop ends, then go to shared memory (``dxs``, same layout as hs).
      A shared store inside either step loop makes TileLang's sync planner put a __syncthreads on
      every step (it cannot tell those stores from the ldmatrix reads of W); staging in
      registers (3-D fragments, fully unrolled loops) is what keeps both loops barrier-free.
   c. one GEMM over the stacked segment, C[(p, i), (p', j)] += sum_{t, r} hs[(t, r), (p, i)]
      dxs[(t, r), (p', j)], accumulated in a fragment over all segments: its diagonal 16 x 16 blocks
      (p = p') summed over p are dW = sum_t H_{t-1}^T dX_t (a 16 x 16 product cannot be split over 4
      warps; this one can, at 4x the MMA work, which is tiny). dk, dv, df from dxs and the row sums,
      and dq, are written to global memory after the walk (off the chain).
   The per-value-head gradients land in fp32 buffers (dq, dk [B,S,N,K], dv [B,S,N,V], df [B,S,N],
   the dW blocks [B,N,K/16*V,K/16*V], dh0); torch takes the diagonal blocks, then
   lab.problems._m2rnn.reduce_heads sums shared q / k / W / f heads and dW over batch (the Triton
   lane's contract).
Padded steps past S (the last segment, the last chunk) are exact no-ops: the gate is 1 there (the
padded copy) and the out-of-range k, v, q, dy copies are zero-filled (cp.async with src-size 0), so
H and dH pass through unchanged and dX = 0; their outputs are not stored (guarded stores).

Precision: bf16 inputs only. Operands of every product are bf16 (state and dX rounded, as upstream
does), accumulation, state, dH and all reductions fp32; dd = H_{t-1} - Z_t for df uses the bf16 H_{t-1}
kept in hs. fp32 inputs are refused (the problem's fp32 band needs fp32-accurate products, which this
lane's bf16 fragments cannot give), and so is V != 16.

Tunables:
  threads     threads per CTA, both kernels (at most 32 per 16 rows of K: 128 for K = 64)
  CKPT        checkpoint interval (steps): shared memory (hs, dxs, staged inputs) and registers (the
              per-step values staged in registers: 6 * CKPT per thread) of the backward grow with it;
              checkpoint traffic B*N*(S/CKPT)*K*V*4 bytes each way shrinks with it
  CHUNK       steps per pipelined input copy of the forward (a multiple of CKPT)
  num_stages  T.Pipelined buffers of the input copies (both kernels; 1 = no prefetch)
  min_blocks  CTAs per SM the backward is compiled for (__launch_bounds__): caps its registers at
              65536 / (min_blocks * threads); more resident CTAs is what B*N = 336 / 672 needs
  FAST_TANH   tanh.approx.f32 (inline PTX, MUFU) vs tanhf
Operand precision is not a tunable: the bf16 A fragment is what keeps the chain in registers.

Read for the API (TileLang 0.1.15 installed source, read only): tilelang/language/gemm_op.py and
cuda/language/gemm_op.py (T.gemm operands, fragment A), language/kernel.py (T.Kernel prelude),
transform/pass_config.py (tl.disable_wgmma), src/tl_templates/cuda/copy.h (cp_async_gs_conditional
zero fill); the lab's kernels/tilelang/gemm.py and mamba_bwd_bwd.py (T.Pipelined copies, build and
compile plumbing); the Triton lane kernels/triton/_m2rnn.py (same algorithm and output contract).
"""

import time

import torch
import tilelang
import tilelang.language as T
from tilelang.transform import PassConfigKey

from kernels.tilelang import _common as tl
from lab.problems import _m2rnn as m2

DSL = "tilelang"
KERNEL = "m2rnn_bwd"
TUNABLES = ("threads", "CKPT", "CHUNK", "num_stages", "min_blocks", "FAST_TANH")
DEFAULTS = {"threads": 128, "CKPT": 8, "CHUNK": 64, "num_stages": 2, "min_blocks": 3, "FAST_TANH": True}
TARGETS = tl.TARGETS
BF, F32, I32 = "bfloat16", "float32", "int32"
# tanh.approx.f32: one MUFU op, ~2^-11 relative error (sm_75+). Plain asm (not volatile): nvcc may schedule it.
PRELUDE = ('\n__device__ __forceinline__ float m2rnn_tanh_approx(float x) '
           '{ float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }\n')


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    c = {**DEFAULTS, **config}
    if shape["dtype"] != BF:
        return (f"dtype {shape['dtype']} not supported: bf16 tensor-core operands only (the fp32 band needs "
                "fp32-accurate products)")
    K, V = shape["K"], shape["V"]
    if V != 16:
        return f"V={V} not supported: the lane is written for V = 16 (one 16-wide MMA tile per step)"
    if K % 16 or not 16 <= K <= 64:
        # the dW blocks are a (K/16 V)^2 fp32 fragment: 32 registers per thread at K = 64, 128 at 128
        return f"K={K} must be a multiple of 16 in 16..64"
    # The values each knob may take are the sweep file's (sweeps/m2rnn_bwd/tilelang.toml); the harness checks them.
    if c["threads"] // 32 > K // 16:
        return f"threads={c['threads']} too many for K={K}: each warp needs 16 rows of the state"
    if c["CHUNK"] % c["CKPT"]:
        return f"CHUNK={c['CHUNK']} must be a multiple of CKPT={c['CKPT']}"
    return None


def eligibility(target: str) -> str | None:
    return tl.eligibility(KERNEL, target)


def _pass_configs(config: dict) -> dict:
    # cp.async pipelines, no TMA / producer warps: the copies are small and the CTA is latency bound.
    pc = tl.pass_configs(tma=False, warp_specialized=False, aggressive_smem_merge=False)
    pc[PassConfigKey.TL_DISABLE_WGMMA.value] = True
    return pc


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA, bytes: the larger of the two kernels (both exact against the compiler for
    every config tried; tests/test_tilelang_m2rnn_bwd.py and the preflight hold them to it).

    Backward: W (bf16 V x V); per pipeline stage the checkpoint (fp32 K x V), the segment's q and k
    (bf16 CKPT x K), v and dy (bf16 CKPT x V) and gate (fp32 CKPT); hs and dxs (bf16 CKPT x K x V each);
    the staged dq and df row sums (fp32 CKPT x K each). Forward: W, and per stage a chunk of k (bf16
    CHUNK x K), v (bf16 CHUNK x V) and the gate (fp32 CHUNK). Every buffer 16-byte aligned."""
    c = {**DEFAULTS, **config}
    K, V, L, CH, st = shape["K"], shape["V"], c["CKPT"], c["CHUNK"], c["num_stages"]
    stage = sum(_align(x) for x in (4 * K * V, 2 * L * K, 2 * L * K, 2 * L * V, 2 * L * V, 4 * L))
    head = _align(2 * V * V) + st * stage
    tail = 2 * _align(2 * L * K * V) + 2 * _align(4 * L * K)
    bwd = head + tail
    fwd = _align(2 * V * V) + st * (_align(2 * CH * K) + _align(2 * CH * V) + _align(4 * CH))
    return max(bwd, fwd)


# --------------------------------------------------------------------------------------------
# kernels


def _dims(config: dict, shape: dict):
    S, CH, L = shape["S"], config["CHUNK"], config["CKPT"]
    nch = -(-S // CH)
    return nch, nch * CH, nch * CH // L, -(-S // L)      # chunks, padded S, checkpoints, segments


def _tanh(config: dict):
    if config["FAST_TANH"]:
        return lambda x: T.call_extern(F32, "m2rnn_tanh_approx", x)
    return T.tanh


def _bf16_at(word, c):
    """Element c of a row of bf16 pairs read as int32 words (little endian: even c is the low half), fp32."""
    bits = T.if_then_else(c % 2 == 0, T.shift_left(word, 16), T.bitwise_and(word, -65536))
    return T.reinterpret(bits, F32)


def _fwd_program(config: dict, shape: dict):
    B, S, N, Nk, Nw, Nf, K, V = (shape[d] for d in ("B", "S", "N", "Nk", "Nw", "Nf", "K", "V"))
    CH, L, threads, stages = config["CHUNK"], config["CKPT"], config["threads"], config["num_stages"]
    nch, SP, NSP, _ = _dims(config, shape)
    gk, gw, gf = N // Nk, N // Nw, N // Nf
    has_h0 = shape["h0"]
    tanh = _tanh(config)
    row = T.GemmWarpPolicy.FullRow

    @T.prim_func
    def fwd(Kin: T.Tensor((B, S, Nk, K), BF), Vin: T.Tensor((B, S, N, V), BF), W: T.Tensor((Nw, V, V), BF),
            Fp: T.Tensor((B, Nf, SP), F32), H0: T.Tensor((B, N, K, V), BF), CK: T.Tensor((B * N, NSP, K, V), F32)):
        with T.Kernel(B * N, threads=threads, prelude=PRELUDE) as bn:
            b = bn // N
            n = bn % N
            w_s = T.alloc_shared((V, V), BF)
            k_s = T.alloc_shared((CH, K), BF)
            v_s = T.alloc_shared((CH, V), BF)
            f_s = T.alloc_shared((CH,), F32)
            h = T.alloc_fragment((K, V), F32)
            hb = T.alloc_fragment((K, V), BF)
            acc = T.alloc_fragment((K, V), F32)
            T.copy(W[n // gw, :, :], w_s)
            if has_h0:
                T.copy(H0[b, n, :, :], h)
            else:
                T.clear(h)
            for c in T.Pipelined(nch, num_stages=stages):
                T.copy(Kin[b, c * CH:(c + 1) * CH, n // gk, :], k_s)
                T.copy(Vin[b, c * CH:(c + 1) * CH, n, :], v_s)
                T.copy(Fp[b, n // gf, c * CH:(c + 1) * CH], f_s)
                for s in T.serial(CH // L):
                    T.copy(h, CK[bn, c * (CH // L) + s, :, :])
                    for istep in T.serial(L):
                        t = s * L + istep
                        for r, j in T.Parallel(K, V):
                            hb[r, j] = h[r, j]
                        T.gemm(hb, w_s, acc, clear_accum=True, policy=row)
                        for r, j in T.Parallel(K, V):
                            z = tanh(acc[r, j] + T.cast(k_s[t, r], F32) * T.cast(v_s[t, j], F32))
                            h[r, j] = f_s[t] * h[r, j] + (1.0 - f_s[t]) * z

    return fwd


def _bwd_program(config: dict, shape: dict):
    B, S, N, Nq, Nk, Nw, Nf, K, V = (shape[d] for d in m2.DIMS)
    L, threads, stages = config["CKPT"], config["threads"], config["num_stages"]
    _, SP, NSP, NSEG = _dims(config, shape)
    gq, gk, gw, gf = N // Nq, N // Nk, N // Nw, N // Nf
    P = K // 16
    PV = P * V
    V2 = V // 2
    tanh = _tanh(config)
    row = T.GemmWarpPolicy.FullRow
    min_blocks = config["min_blocks"]

    @T.prim_func
    def bwd(Q: T.Tensor((B, S, Nq, K), BF), Kin: T.Tensor((B, S, Nk, K), BF), Vin: T.Tensor((B, S, N, V2), I32),
            W: T.Tensor((Nw, V, V), BF), Fp: T.Tensor((B, Nf, SP), F32), DY: T.Tensor((B, S, N, V2), I32),
            DHF: T.Tensor((B, N, K, V), BF), CK: T.Tensor((B * N, NSP, K, V), F32),
            DQ: T.Tensor((B, S, N, K), F32), DK: T.Tensor((B, S, N, K), F32), DV: T.Tensor((B, S, N, V), F32),
            DF: T.Tensor((B, S, N), F32), DWB: T.Tensor((B, N, PV, PV), F32), DH0: T.Tensor((B, N, K, V), F32)):
        with T.Kernel(B * N, threads=threads, prelude=PRELUDE) as bn:
            if min_blocks > 1:
                T.annotate_min_blocks_per_sm(min_blocks)
            b = bn // N
            n = bn % N
            w_s = T.alloc_shared((V, V), BF)
            ck_s = T.alloc_shared((K, V), F32)
            q_s = T.alloc_shared((L, K), BF)
            k_s = T.alloc_shared((L, K), BF)
            v_s = T.alloc_shared((L, V2), I32)        # bf16 pairs: 4-byte words let short rows use cp.async
            dy_s = T.alloc_shared((L, V2), I32)
            f_s = T.alloc_shared((L,), F32)
            hs = T.alloc_shared((L * 16, PV), BF)       # H_{t-1}[16 p + r, i] at [t * 16 + r, p * V + i]
            dxs = T.alloc_shared((L * 16, PV), BF)      # dX_t in the same layout
            dq_s = T.alloc_shared((L, K), F32)
            dfr_s = T.alloc_shared((L, K), F32)

            h = T.alloc_fragment((K, V), F32)
            hb = T.alloc_fragment((K, V), BF)
            acc = T.alloc_fragment((K, V), F32)
            dH = T.alloc_fragment((K, V), F32)
            dxb = T.alloc_fragment((K, V), BF)
            prod = T.alloc_fragment((K, V), F32)
            rsum = T.alloc_fragment((K,), F32)
            # Per-step values of a segment stay in registers until the step loop ends: a shared-memory
            # store inside the loop makes TileLang put __syncthreads on every step.
            stage_l = T.alloc_fragment((L, K, V), BF)
            rows_l = T.alloc_fragment((L, K), F32)
            dwacc = T.alloc_fragment((PV, PV), F32)     # dW blocks, summed over segments
            dk_f = T.alloc_fragment((L, K), F32)
            dv_f = T.alloc_fragment((L, V), F32)
            df_f = T.alloc_fragment((L,), F32)

            T.copy(W[n // gw, :, :], w_s)
            T.copy(DHF[b, n, :, :], dH)
            T.clear(dwacc)
            for jj in T.Pipelined(NSEG, num_stages=stages):
                j = NSEG - 1 - jj
                t0 = j * L
                T.copy(CK[bn, j, :, :], ck_s)
                T.copy(Q[b, t0:t0 + L, n // gq, :], q_s)
                T.copy(Kin[b, t0:t0 + L, n // gk, :], k_s)
                T.copy(Vin[b, t0:t0 + L, n, :], v_s)
                T.copy(DY[b, t0:t0 + L, n, :], dy_s)
                T.copy(Fp[b, n // gf, t0:t0 + L], f_s)
                # (a) recompute the segment's states (H_{t-1} kept as bf16, dq_t = H_t dy_t)
                T.copy(ck_s, h)
                for ir in T.unroll(L):
                    for r, c in T.Parallel(K, V):
                        hb[r, c] = h[r, c]
                    for r, c in T.Parallel(K, V):
                        stage_l[ir, r, c] = hb[r, c]
                    T.gemm(hb, w_s, acc, clear_accum=True, policy=row)
                    for r, c in T.Parallel(K, V):
                        z = tanh(acc[r, c] + T.cast(k_s[ir, r], F32) * _bf16_at(v_s[ir, c // 2], c))
                        h[r, c] = f_s[ir] * h[r, c] + (1.0 - f_s[ir]) * z
                        prod[r, c] = h[r, c] * _bf16_at(dy_s[ir, c // 2], c)
                    T.reduce_sum(prod, rsum, dim=1)
                    for r in T.Parallel(K):
                        rows_l[ir, r] = rsum[r]
                for i, r, c in T.Parallel(L, K, V):
                    hs[i * 16 + r % 16, (r // 16) * V + c] = stage_l[i, r, c]
                T.copy(rows_l, dq_s)
                # (b) walk it backwards: Z_t again from hs (off the chain), then the dH chain
                for ii in T.unroll(L):
                    i = L - 1 - ii
                    for r, c in T.Parallel(K, V):
                        hb[r, c] = hs[i * 16 + r % 16, (r // 16) * V + c]
                    T.gemm(hb, w_s, acc, clear_accum=True, policy=row)
                    for r, c in T.Parallel(K, V):
                        g = dH[r, c] + T.cast(q_s[i, r], F32) * _bf16_at(dy_s[i, c // 2], c)
                        z = tanh(acc[r, c] + T.cast(k_s[i, r], F32) * _bf16_at(v_s[i, c // 2], c))
                        dxb[r, c] = (1.0 - f_s[i]) * g * (1.0 - z * z)
                        prod[r, c] = g * (T.cast(hb[r, c], F32) - z)
                        dH[r, c] = f_s[i] * g
                    T.gemm(dxb, w_s, dH, transpose_B=True, policy=row)      # dH = f G + dX W^T
                    for r, c in T.Parallel(K, V):
                        stage_l[i, r, c] = dxb[r, c]
                    T.reduce_sum(prod, rsum, dim=1)
                    for r in T.Parallel(K):
                        rows_l[i, r] = rsum[r]
                for i, r, c in T.Parallel(L, K, V):
                    dxs[i * 16 + r % 16, (r // 16) * V + c] = stage_l[i, r, c]
                T.copy(rows_l, dfr_s)
                # (c) the segment's dW blocks and per-step gradients, off the chain
                T.gemm(hs, dxs, dwacc, transpose_A=True)
                T.clear(dk_f)
                T.clear(dv_f)
                T.clear(df_f)
                for i, r in T.Parallel(L, K):
                    for c in T.serial(V):
                        dk_f[i, r] = dk_f[i, r] + T.cast(dxs[i * 16 + r % 16, (r // 16) * V + c], F32) * \
                            _bf16_at(v_s[i, c // 2], c)
                for i, c in T.Parallel(L, V):
                    for r in T.serial(K):
                        dv_f[i, c] = dv_f[i, c] + T.cast(dxs[i * 16 + r % 16, (r // 16) * V + c], F32) * \
                            T.cast(k_s[i, r], F32)
                for i in T.Parallel(L):
                    for r in T.serial(K):
                        df_f[i] = df_f[i] + dfr_s[i, r]
                T.copy(dk_f, DK[b, t0:t0 + L, n, :])
                T.copy(dv_f, DV[b, t0:t0 + L, n, :])
                T.copy(df_f, DF[b, t0:t0 + L, n])
                T.copy(dq_s, DQ[b, t0:t0 + L, n, :])
            T.copy(dH, DH0[b, n, :, :])
            T.copy(dwacc, DWB[b, n, :, :])

    return bwd


_PROGRAMS = {"fwd": _fwd_program, "bwd": _bwd_program}


# --------------------------------------------------------------------------------------------
# compile


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile of both kernels for ``target`` (no GPU); smem_bytes and registers are the
    larger of the two (the backward's in practice), per-kernel figures and spill bytes ride along."""
    config = {**DEFAULTS, **config}
    pc = _pass_configs(config)
    t0 = time.perf_counter()
    per = {}
    for name, prog in _PROGRAMS.items():
        art = tl.lower(prog(config, shape), target, pc)
        cubin = tl.cubin_of(art.kernel_source, target, pc, use_cache=False)
        usage = tl.resource_usage(cubin, target)
        per[name] = {"smem_bytes": tl.dynamic_smem(art) + usage["static_smem"], "registers": usage["registers"],
                     "spill_bytes": usage["spill_bytes"]}
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] for v in per.values()),
            "compile_s": time.perf_counter() - t0, "binary": "cubin", "kernels": per}


# --------------------------------------------------------------------------------------------
# launch


def build(config: dict, shape: dict):
    """Compile both kernels for the current GPU's explicit target and return ``run``. Workspaces (fp32
    checkpoints, padded gate, per-value-head gradients) are allocated once per device."""
    config = {**DEFAULTS, **config}
    reason = config_reason(config, shape)
    if reason:
        raise RuntimeError(reason)
    target = tl.device_target()
    if eligibility(target):
        raise RuntimeError(eligibility(target))
    pc = _pass_configs(config)
    kernels = {name: tilelang.compile(prog(config, shape), target=tl.tvm_target(target), execution_backend="tvm_ffi",
                                      pass_configs=pc) for name, prog in _PROGRAMS.items()}
    info = _launch_info(kernels, config, shape, target)
    B, S, N, Nf, K, V = (shape[d] for d in ("B", "S", "N", "Nf", "K", "V"))
    _, SP, NSP, _ = _dims(config, shape)
    P = K // 16
    work: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        dev = i["v"].device
        if work.get("dev") != dev:
            f32 = {"dtype": torch.float32, "device": dev}
            work.update(dev=dev, ck=torch.empty(B * N, NSP, K, V, **f32), fp=torch.ones(B, Nf, SP, **f32),
                        dq=torch.empty(B, S, N, K, **f32), dk=torch.empty(B, S, N, K, **f32),
                        dv=torch.empty(B, S, N, V, **f32), df=torch.empty(B, S, N, **f32),
                        dwb=torch.empty(B, N, P * V, P * V, **f32), dh0=torch.empty(B, N, K, V, **f32))
        w = work
        w["fp"][:, :, :S].copy_(i["f"].transpose(1, 2))    # the padding stays 1: padded steps are no-ops
        h0 = i.get("h0", i["dh_final"])                    # not read when the shape has no h0
        kernels["fwd"](i["k"], i["v"], i["W"], w["fp"], h0, w["ck"])
        kernels["bwd"](i["q"], i["k"], i["v"].view(torch.int32), i["W"], w["fp"], i["dy"].view(torch.int32),
                       i["dh_final"], w["ck"],
                       w["dq"], w["dk"], w["dv"], w["df"], w["dwb"], w["dh0"])
        grads = {n: w[n] for n in ("dq", "dk", "dv", "df", "dh0")}
        grads["dW"] = w["dwb"].view(B, N, P, V, P, V).diagonal(dim1=2, dim2=4).sum(-1)
        for name, value in m2.reduce_heads(grads, shape).items():
            o[name].copy_(value)
        return info
    return run


def _launch_info(kernels: dict, config: dict, shape: dict, target: str) -> dict:
    """Largest shared memory (dynamic + static) and registers over the built kernels (best effort)."""
    try:
        smem, regs, spills = 0, 0, 0
        pc = _pass_configs(config)
        for name, k in kernels.items():
            art = k.artifact if getattr(k, "artifact", None) is not None else \
                tl.lower(_PROGRAMS[name](config, shape), target, pc)
            cubin = tl.cubin_of(k.get_kernel_source(), target, pc, use_cache=True)
            usage = tl.resource_usage(cubin, target)
            smem = max(smem, tl.dynamic_smem(art) + usage["static_smem"])
            regs = max(regs, usage["registers"])
            spills += usage["spill_bytes"]
        return {"smem_bytes": smem, "registers": regs, "spills": spills}
    except Exception:
        return {"smem_bytes": None, "registers": None, "spills": None}


def versions() -> dict:
    import tvm_ffi
    return {"tilelang": tilelang.__version__, "apache-tvm-ffi": getattr(tvm_ffi, "__version__", "?"),
            "torch": torch.__version__}
