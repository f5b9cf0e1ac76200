"""TileLang lane for m2rnn_fwd: Z_t = tanh(H_{t-1} W + k_t v_t^T), H_t = f_t H_{t-1} + (1 - f_t) Z_t,
y_t = H_t^T q_t (math and layouts: lab/problems/_m2rnn.py; ../shared/briefs/m2rnn.md).

Design (TileLang 0.1.15; generated CUDA read with ``lower``, see tests/test_tilelang_m2rnn_fwd.py):
  * grid (N, B, K_SPLIT): one CTA per (value head, batch row, K slab of R = K / K_SPLIT rows);
    ``threads / 32`` warps split the slab's rows (T.gemm policy FullRow), each warp owning 16 or more
    whole rows. Rows of H evolve independently (W multiplies from the right, f is a scalar), so warps
    never exchange state; only y needs a sum over rows.
  * The state H (R x V, fp32) is a register fragment for all S steps, in the mma accumulator layout.
    Per step: H is rounded to a bf16 fragment of the same thread ownership (the m16n8k16 C tiles are
    the A tile), T.gemm with that register A operand and W as a register B fragment (V <= 32; loaded
    once by ldmatrix; V = 64 reads W from shared memory per step), then k_t v_t^T, tanh and the gate
    elementwise on the accumulator. The chain cvt -> mma.sync -> add -> tanh -> FMA touches no shared
    memory and has no barrier (checked in the generated source).
  * Inputs arrive per chunk of CHUNK steps: q, k, v rows by cp.async (T.async_copy, one commit group
    each) into STAGES shared buffers, issued STAGES-1 chunks ahead and waited with wait_group once per
    chunk; f (a 2-byte strided column, not cp.async-able) is loaded into registers at the top of a chunk
    and stored to shared at its end, so its DRAM latency hides behind the chunk's steps.
  * y: per step each warp sums its rows in registers and with shuffles (T.reduce_sum over the
    in-warp row axis of a [warps, rows per warp, V] view; no cross-warp workspace) and stores its
    partial to shared memory (fp32, [CHUNK, warps, V]); once per chunk, after a barrier, the warp
    partials are summed and y written (K_SPLIT > 1: fp32 partials per slab, summed by torch after).
  * TileLang's automatic shared-memory barrier pass (tl.disable_thread_storage_sync) is OFF: with it
    on, 0.1.15 put a __syncthreads before every step's W ldmatrix and before every y-partial store
    (it cannot tell the per-step buffers apart in the merged shared buffer). The kernel places its own
    barriers instead: after W is staged (before the buffers that may alias it are refilled), after each
    chunk's wait_group, and after the chunk's y partials are stored: two per chunk, none per step.
  * Operand precision (PREC): bf16 rounds H to bf16 for the product (upstream's choice); bf16x2 adds
    the bf16 residual of H as a second product (W is exact in bf16 inputs): ~16-bit H operand; fp32
    inputs use bf16x3 (hi.Whi + lo.Whi + hi.Wlo, about fp32 accuracy for the tolerance band).
  * FAST_TANH: tanh.approx.f32 through an inline-PTX device function in the kernel prelude (TileLang
    0.1.15 has no fast tanh intrinsic; T.tanh lowers to tanhf), else tanhf.

Tunables:
  threads     32 / 64 / 128 (1, 2 or 4 warps; each warp needs >= 16 rows of the slab)
  K_SPLIT     1 / 2 / 4 K slabs per (b, n): B*N*K_SPLIT CTAs; > 1 writes fp32 y partials that torch sums
  CHUNK       steps per staged chunk (16 / 32 / 64 / 128): prefetch granularity, two barriers per chunk
  STAGES      2 / 3 / 4 chunk buffers (prefetch distance STAGES - 1 chunks)
  FAST_TANH   tanh.approx.f32 vs tanhf
  PREC        bf16 / bf16x2 (bf16 inputs); bf16x3 (required for fp32 inputs)
Heads per CTA are not a tunable: warps of one CTA are already independent, and (b, n) pairs share no
operand but q/k when Nq = Nk = 1, which L2 serves.

Sources read (API only; code written here): TileLang 0.1.15 installed sources (language/gemm_op.py,
copy_op.py async_copy, builtin.py sync_threads, reduce_op.py, transform/pass_config.py,
src/tl_templates/cuda/math.h), the lab's Triton M2RNN lane (kernels/triton/_m2rnn.py) for the I/O
contract, and the lab's other TileLang lanes (gemm.py, mamba_bwd_bwd.py) for compile plumbing.
"""

import time

import torch
import tilelang
import tilelang.language as T
from tilelang.transform import PassConfigKey

from kernels.tilelang import _common as tl

DSL = "tilelang"
KERNEL = "m2rnn_fwd"
TUNABLES = ("threads", "K_SPLIT", "CHUNK", "STAGES", "FAST_TANH", "PREC")
DEFAULTS = {"threads": 128, "K_SPLIT": 1, "CHUNK": 32, "STAGES": 2, "FAST_TANH": True, "PREC": "bf16"}
TARGETS = tl.TARGETS
DTYPES = ("float32", "bfloat16")
F32 = "float32"
BF16 = "bfloat16"

_TANH_PRELUDE = r"""
__device__ __forceinline__ float m2rnn_tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def _geometry(config: dict, shape: dict) -> dict:
    R = shape["K"] // config["K_SPLIT"]
    warps = config["threads"] // 32
    return {"R": R, "warps": warps, "RW": R // warps if warps else 0,
            "nc": -(-shape["S"] // config["CHUNK"]), "w_regs": shape["V"] <= 32}


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    c = {**DEFAULTS, **config}
    dt = shape["dtype"]
    if dt not in DTYPES:
        return f"dtype {dt} not supported (have {', '.join(DTYPES)})"
    # The values each knob may take are the sweep file's (sweeps/m2rnn_fwd/tilelang.toml); the harness checks them.
    if dt == "float32" and c["PREC"] != "bf16x3":
        return f"PREC={c['PREC']!r}: float32 inputs need PREC = bf16x3 (fp32-accurate product)"
    if dt == "bfloat16" and c["PREC"] not in ("bf16", "bf16x2"):
        return f"PREC={c['PREC']!r} must be bf16 or bf16x2 for bfloat16 inputs (W is exact in bf16)"
    K, V = shape["K"], shape["V"]
    if V % 16 or V > 64:
        return f"V={V} must be a multiple of 16 up to 64 (mma n/k tiles; W and the state in registers)"
    g = _geometry(c, shape)
    if K % c["K_SPLIT"] or g["R"] % (16 * g["warps"]):
        return (f"K={K} / K_SPLIT={c['K_SPLIT']} = {K / c['K_SPLIT']:g} rows must give each of "
                f"{g['warps']} warps a multiple of 16 rows")
    if g["RW"] * V > 1024:
        # fp32 state, product and y operand per thread scale with rows per warp x V: at 32 x 64 ptxas
        # needs 254 registers (sm_90a), so a warp holds at most 1024 state elements.
        return f"{g['RW']} rows per warp x V={V} over 1024 state elements per warp (register budget): use more warps"
    return None


def eligibility(target: str) -> str | None:
    return tl.eligibility(KERNEL, target)


def _pass_configs(config: dict) -> dict:
    pc = tl.pass_configs(tma=False, warp_specialized=False, aggressive_smem_merge=False)
    pc[PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC.value] = True   # barriers are placed by hand
    pc[PassConfigKey.TL_DISABLE_WGMMA.value] = True   # mma.sync on every target, as GB10 runs it
    return pc


def _elem(shape: dict) -> int:
    return 4 if shape["dtype"] == "float32" else 2


def _align(n: int, a: int = 16) -> int:
    return -(-n // a) * a


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA, bytes (all dynamic; no static shared variables): STAGES buffers of the
    chunk's q and k rows (CHUNK x R) and v rows (CHUNK x V) and f (CHUNK) in the input dtype, the fp32
    y partials (CHUNK x warps x V) and W (V x V in the input dtype; fp32 inputs add its bf16 hi and lo
    halves). When W is moved to registers (V <= 32) TileLang 0.1.15 reuses its staging
    buffer for the chunk buffers, so it adds nothing. Each buffer is 16-byte aligned. Exact against
    the compiler for the bf16 configs compiled in tests/test_tilelang_m2rnn_fwd.py; for fp32 with
    V = 64 the planner may place f on the dead fp32 W buffer, up to STAGES * CHUNK * 4 B below this."""
    c = {**DEFAULTS, **config}
    g = _geometry(c, shape)
    e, C, V, st = _elem(shape), c["CHUNK"], shape["V"], c["STAGES"]
    chunk = st * (2 * _align(C * g["R"] * e) + _align(C * V * e) + _align(C * e)) + _align(C * g["warps"] * V * 4)
    w = _align(V * V * e) + (2 * _align(V * V * 2) if shape["dtype"] == "float32" else 0)
    return chunk if g["w_regs"] else chunk + w


# --------------------------------------------------------------------------------------------
# kernel


def _program(config: dict, shape: dict):
    c = {**DEFAULTS, **config}
    B, S, N, K, V = shape["B"], shape["S"], shape["N"], shape["K"], shape["V"]
    Nq, Nk, Nw, Nf = shape["Nq"], shape["Nk"], shape["Nw"], shape["Nf"]
    gq, gk, gw, gf = N // Nq, N // Nk, N // Nw, N // Nf
    dtype = shape["dtype"]
    fp32_in = dtype == "float32"
    has_h0 = bool(shape["h0"])
    KS, C, st, threads = c["K_SPLIT"], c["CHUNK"], c["STAGES"], c["threads"]
    g = _geometry(c, shape)
    R, WP, RW, nc, w_regs = g["R"], g["warps"], g["RW"], g["nc"], g["w_regs"]
    d = st - 1                       # chunks in flight ahead of the one being walked
    groups = 3                       # cp.async commit groups per chunk (q, k, v)
    prec = c["PREC"]
    fast = c["FAST_TANH"]
    y_dtype = F32 if KS > 1 else dtype
    y_shape = (KS, B, S, N, V) if KS > 1 else (B, S, N, V)
    policy = T.GemmWarpPolicy.FullRow

    def tanh(x):
        return T.call_extern(F32, "m2rnn_tanh_approx", x) if fast else T.tanh(x)

    @T.macro
    def load_chunk(Q, Kx, Vx, q_s, k_s, v_s, b, n, r0, ci):
        s = ci % st
        T.async_copy(Q[b, ci * C:(ci + 1) * C, n // gq, r0:r0 + R], q_s[s, :, :])
        T.async_copy(Kx[b, ci * C:(ci + 1) * C, n // gk, r0:r0 + R], k_s[s, :, :])
        T.async_copy(Vx[b, ci * C:(ci + 1) * C, n, :], v_s[s, :, :])

    @T.macro
    def body(Q, Kx, Vx, W, Fx, H0, Y, HF):
        with T.Kernel(N, B, KS, threads=threads, prelude=_TANH_PRELUDE if fast else None) as (n, b, ks):
            r0 = ks * R
            q_s = T.alloc_shared((st, C, R), dtype)
            k_s = T.alloc_shared((st, C, R), dtype)
            v_s = T.alloc_shared((st, C, V), dtype)
            f_s = T.alloc_shared((st, C), dtype)
            yw = T.alloc_shared((C, WP, V), F32)
            w_s = T.alloc_shared((V, V), dtype)
            f_r = T.alloc_fragment((C,), dtype)
            h = T.alloc_fragment((R, V), F32)
            hb = T.alloc_fragment((R, V), BF16)
            acc = T.alloc_fragment((R, V), F32)
            p = T.alloc_fragment((WP, RW, V), F32)
            yf = T.alloc_fragment((WP, V), F32)
            if prec != "bf16":
                hl = T.alloc_fragment((R, V), BF16)
            if fp32_in:
                wh_s = T.alloc_shared((V, V), BF16)
                wl_s = T.alloc_shared((V, V), BF16)
            if w_regs:
                wh_f = T.alloc_fragment((V, V), BF16)
                if fp32_in:
                    wl_f = T.alloc_fragment((V, V), BF16)

            # W (and its bf16 halves for fp32 inputs) staged once; into registers when small.
            T.copy(W[n // gw, :, :], w_s)
            T.sync_threads()
            if fp32_in:
                for i, j in T.Parallel(V, V):
                    wh_s[i, j] = T.cast(w_s[i, j], BF16)
                    wl_s[i, j] = T.cast(w_s[i, j] - T.cast(T.cast(w_s[i, j], BF16), F32), BF16)
                T.sync_threads()
            if w_regs:
                if fp32_in:
                    T.copy(wh_s, wh_f)
                    T.copy(wl_s, wl_f)
                else:
                    T.copy(w_s, wh_f)
            T.sync_threads()       # W read by every warp before its buffer may be reused
            if has_h0:
                T.copy(H0[b, n, r0:r0 + R, :], h)
            else:
                T.clear(h)

            for c0 in T.serial(d):
                load_chunk(Q, Kx, Vx, q_s, k_s, v_s, b, n, r0, c0)
                T.copy(Fx[b, c0 * C:(c0 + 1) * C, n // gf], f_s[c0, :])
            for ci in T.serial(nc):
                load_chunk(Q, Kx, Vx, q_s, k_s, v_s, b, n, r0, ci + d)
                T.copy(Fx[b, (ci + d) * C:(ci + d + 1) * C, n // gf], f_r)   # held in registers over the chunk
                T.ptx_wait_group(groups * d)
                T.sync_threads()   # chunk ci's cp.async data (and f) visible to every thread
                s = ci % st
                for i in T.serial(T.min(C, S - ci * C)):
                    # ---- the serial chain: H -> bf16 operand(s) -> mma -> tanh -> gate
                    if prec == "bf16":
                        T.copy(h, hb)
                    else:
                        for r, j in T.Parallel(R, V):
                            hb[r, j] = T.cast(h[r, j], BF16)
                            hl[r, j] = T.cast(h[r, j] - T.cast(T.cast(h[r, j], BF16), F32), BF16)
                    wh = (wh_f if w_regs else (wh_s if fp32_in else w_s))
                    T.gemm(hb, wh, acc, clear_accum=True, policy=policy)
                    if prec != "bf16":
                        T.gemm(hl, wh, acc, policy=policy)
                    if fp32_in:
                        T.gemm(hb, wl_f if w_regs else wl_s, acc, policy=policy)
                    ft = T.cast(f_s[s, i], F32)
                    for r, j in T.Parallel(R, V):
                        z = tanh(acc[r, j] + T.cast(k_s[s, i, r], F32) * T.cast(v_s[s, i, j], F32))
                        h[r, j] = ft * h[r, j] + (1.0 - ft) * z
                    # ---- y partial per warp (off the chain): rows summed in-warp, stored to shared
                    for w, r, j in T.Parallel(WP, RW, V):
                        p[w, r, j] = h[w * RW + r, j] * T.cast(q_s[s, i, w * RW + r], F32)
                    T.reduce_sum(p, yf, dim=1)
                    T.copy(yf, yw[i, :, :])
                T.copy(f_r, f_s[(ci + d) % st, :])
                T.sync_threads()   # y partials complete; chunk ci's buffers free for chunk ci + STAGES
                for i, j in T.Parallel(C, V):
                    if ci * C + i < S:
                        tot = T.alloc_var(F32)
                        tot = 0.0
                        for w in T.serial(WP):
                            tot += yw[i, w, j]
                        if KS > 1:
                            Y[ks, b, ci * C + i, n, j] = tot
                        else:
                            Y[b, ci * C + i, n, j] = T.cast(tot, dtype)
            T.copy(h, HF[b, n, r0:r0 + R, :])

    if has_h0:
        @T.prim_func
        def m2rnn_fwd(Q: T.Tensor((B, S, Nq, K), dtype), Kx: T.Tensor((B, S, Nk, K), dtype),
                      Vx: T.Tensor((B, S, N, V), dtype), W: T.Tensor((Nw, V, V), dtype),
                      Fx: T.Tensor((B, S, Nf), dtype), H0: T.Tensor((B, N, K, V), dtype),
                      Y: T.Tensor(y_shape, y_dtype), HF: T.Tensor((B, N, K, V), dtype)):
            body(Q, Kx, Vx, W, Fx, H0, Y, HF)
    else:
        @T.prim_func
        def m2rnn_fwd(Q: T.Tensor((B, S, Nq, K), dtype), Kx: T.Tensor((B, S, Nk, K), dtype),
                      Vx: T.Tensor((B, S, N, V), dtype), W: T.Tensor((Nw, V, V), dtype),
                      Fx: T.Tensor((B, S, Nf), dtype),
                      Y: T.Tensor(y_shape, y_dtype), HF: T.Tensor((B, N, K, V), dtype)):
            body(Q, Kx, Vx, W, Fx, None, Y, HF)

    return m2rnn_fwd


# --------------------------------------------------------------------------------------------
# compile


def lower(config: dict, shape: dict, target: str):
    """TileLang lowering (no nvcc): the artifact; ``.kernel_source`` is the generated CUDA."""
    config = {**DEFAULTS, **config}
    return tl.lower(_program(config, shape), target, _pass_configs(config))


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile for ``target`` (no GPU): lowering, then nvcc through TileLang's own
    callback with its binary cache off. smem_bytes = dynamic size of the launch + the cubin's static
    shared memory (net of the 1 KiB sm_90+ reservation: see _common.resource_usage)."""
    config = {**DEFAULTS, **config}
    t0 = time.perf_counter()
    art = lower(config, shape, target)
    cubin = tl.cubin_of(art.kernel_source, target, _pass_configs(config), use_cache=False)
    seconds = time.perf_counter() - t0
    usage = tl.resource_usage(cubin, target)
    dyn = tl.dynamic_smem(art)
    return {"smem_bytes": dyn + usage["static_smem"], "registers": usage["registers"], "compile_s": seconds,
            "binary": "cubin", "dynamic_smem": dyn, "static_smem": usage["static_smem"],
            "spills": usage["spill_bytes"]}


# --------------------------------------------------------------------------------------------
# launch


def build(config: dict, shape: dict):
    """Compile for the current GPU's explicit target and return ``run(inputs, outputs)``; the static
    shape is baked in (build per shape). K_SPLIT > 1: an fp32 buffer of per-slab y partials is kept
    per device and summed into ``outputs["y"]`` after the kernel."""
    config = {**DEFAULTS, **config}
    why = config_reason(config, shape)
    if why:
        raise RuntimeError(why)
    target = tl.device_target()
    why = eligibility(target)
    if why:
        raise RuntimeError(why)
    kernel = tilelang.compile(_program(config, shape), target=tl.tvm_target(target), execution_backend="tvm_ffi",
                              pass_configs=_pass_configs(config))
    info = _launch_info(kernel, config, shape, target)
    ks = config["K_SPLIT"]
    parts: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        args = [i["q"], i["k"], i["v"], i["W"], i["f"]] + ([i["h0"]] if shape["h0"] else [])
        if ks > 1:
            dev = i["v"].device
            if parts.get("dev") != dev:
                parts.update(dev=dev, y=torch.empty(ks, shape["B"], shape["S"], shape["N"], shape["V"],
                                                    dtype=torch.float32, device=dev))
            kernel(*args, parts["y"], o["h_final"])
            torch.sum(parts["y"], 0, out=o["y"]) if o["y"].dtype == torch.float32 else o["y"].copy_(parts["y"].sum(0))
        else:
            kernel(*args, o["y"], o["h_final"])
        return info
    return run


def _launch_info(kernel, config: dict, shape: dict, target: str) -> dict:
    """Shared memory (dynamic + static) and registers of the built kernel (best effort, as gemm.py)."""
    try:
        art = kernel.artifact if getattr(kernel, "artifact", None) is not None else lower(config, shape, target)
        cubin = tl.cubin_of(kernel.get_kernel_source(), target, _pass_configs(config), use_cache=True)
        usage = tl.resource_usage(cubin, target)
        return {"smem_bytes": tl.dynamic_smem(art) + usage["static_smem"], "registers": usage["registers"],
                "spills": None}
    except Exception:
        return {"smem_bytes": None, "registers": None, "spills": None}


def versions() -> dict:
    import tvm_ffi
    return {"tilelang": tilelang.__version__, "apache-tvm-ffi": getattr(tvm_ffi, "__version__", "?"),
            "torch": torch.__version__}
