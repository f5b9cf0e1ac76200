"""CuTe DSL lane for mamba_bwd_bwd (the Mamba-3 MIMO backward kernel "bwd_bwd"): four kernels, the
Triton lane's decomposition (kernels/triton/mamba_bwd_bwd.py), the products on warp-level mma.sync or,
on sm_90a with PATH="wgmma", the chunk kernels' on warpgroup MMA.

1. dS scan (kernels/cute/_bwd_bwd_scan.py): grid (tiles of dS, H, B), chunks last to first. With
   SCAN_PREP a kernel before it (Prep, grid (nc, H, B)) writes its operands of every chunk, q_hat *
   exp(DA_CS) and dy (QS [B, H, nc, C*R, N], DY [B, H, nc, C*R, P], input dtype), and the scan only
   copies them into shared memory; the chunk kernels' P loops copy DY too instead of building dy (the
   value side's D terms, DD and D dy in DV, then take dy rounded to the input dtype).
2. Key side (kernels/cute/_bwd_bwd_chunk.py, Key): grid (nc * N/2/KEY_BJ, H, B): DQ, DK, DANGLES of
   KEY_BJ rotary pairs and the pairs' parts of the row sums over N and of DDA.
3. Value side (Value): grid (nc, H, B): DV, DSSDA, DGAMMA_DIAG, the per-step sums, DMIMO_V / DD parts.
4. Reduce: grid (H, B): DMIMO_V and DD over chunks.

Two code paths for the chunk kernels' products, the tunable PATH:
  mma_sync (default)  warp MMA (m16n8k16 on 2 x 2 warps, ldmatrix from shared memory, kernels/cute/
                      _warp_mma.py), which sm_90a, sm_120a and sm_121a all run, so what a GB10 runs is
                      what the H100 parity-checks and times.
  wgmma               sm_90a only (target_reason refuses it elsewhere), C*R = 64 only (config_reason):
                      every product of the key side (the P loop's dkq, dks, dqs; dk_hat, dq_hat; the DK
                      and DQ products) and of the value side (lkq; k_hat dS and A dy of dPsiV; dkq) on
                      warpgroup MMA m64nNk16, both operands by descriptor from shared memory in canonical
                      swizzled layouts (kernels/cute/_wgmma.py), the CTA's 128 threads one warpgroup; the
                      scan's product (q_hat^T dy) too when SCAN_BJ = 32 (its M = 2 SCAN_BJ rows must be
                      64; with SCAN_BJ = 16 it stays on mma_sync). Prep and Reduce multiply nothing. No
                      TMA yet.
The mma_sync path is compiled for sm_90a and sm_121a at every named shape, and the kernels' own bodies
match the reference on all 12 outputs when run on the CPU stand-in for CuTe DSL (tests/test_cute_mamba.py,
tests/cute_standin.py). On the H100 (2026-11-26, commit dcc3287) scripts/cute_bwd_check.py found every
kernel's outputs within their bands at every named shape, and the lab's sweeps parity-checked every trial
(results/logs/20261126T083114Z-mamba_bwd_bwd-h100-1717-log.txt). The wgmma path (2026-11-28) is compiled
for sm_90a at every named shape with C*R = 64 (its PTX holds wgmma, no mma.sync) and checked on the
stand-in; on the H200 (2026-11-28) every trial of both paths was parity-ok on all 12 outputs at the four
default shapes (run 20261128T105204Z-mamba_bwd_bwd-h200-759).

Tunables (values in sweeps/mamba_bwd_bwd/cute.toml):
  PATH               "mma_sync" or "wgmma" (above)
  SCAN_BJ, SCAN_BP   dS tile of one scan CTA: SCAN_BJ rotary pairs (2 SCAN_BJ rows) x SCAN_BP columns
  KEY_BJ             rotary pairs per key-side CTA (its products are F x 2 KEY_BJ)
  KEY_BP, BLOCK_P    P columns per step of the key side's and the value side's P loops
  UNROLL             unroll factor of the loops in which the 128 threads build shared-memory operands
                     from global memory (each iteration loads and converts one element per thread):
                     the global loads in flight per thread, against registers
  SCAN_PREP          the scan's operands built by Prep first, off its serial chain, and dy read by the
                     chunk kernels from them (above)
Shared memory per CTA (bytes) is what each kernel's buffers take (smem_kernels; under wgmma the operand
buffers are 1024-byte aligned, which adds up to 768 B); the largest is the lane's figure. Every kernel
runs 128 threads.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch

from kernels import _targets
from kernels.cute import _aot
from kernels.cute import _bwd_bwd_chunk as chunk
from kernels.cute import _bwd_bwd_scan as scan
from kernels.cute._aot import static_smem, versions  # noqa: F401 (versions: lane interface)
from lab.problems import _mamba3 as m3

DSL = "cute"
KERNEL = "mamba_bwd_bwd"
TUNABLES = ("PATH", "SCAN_BJ", "SCAN_BP", "KEY_BJ", "KEY_BP", "BLOCK_P", "UNROLL", "SCAN_PREP")
DEFAULTS = {"PATH": "mma_sync", "SCAN_BJ": 16, "SCAN_BP": 32, "KEY_BJ": 16, "KEY_BP": 32, "BLOCK_P": 32, "UNROLL": 2,
            "SCAN_PREP": False}
PATHS = ("mma_sync", "wgmma")
TARGETS = scan.TARGETS
F32 = cutlass.Float32
_DT = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def config_reason(config: dict, shape: dict) -> str | None:
    """Shapes the lane cannot take and configs that do not divide the shape (typed, never computed)."""
    c = {**DEFAULTS, **config}
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    F = C * R
    if shape["dtype"] not in _DT:
        return f"dtype {shape['dtype']}: the products run on bf16 / fp16 mma.sync"
    if c["PATH"] not in PATHS:
        return f"PATH {c['PATH']!r} is not a path of this lane (have {', '.join(PATHS)})"
    if H % G:
        return f"H={H} must be a multiple of G={G}"
    if F not in (32, 64):
        return f"C*R={F}: the chunk kernels take 32 or 64 fused rows (F x F products of 2 x 2 warps, in registers)"
    if c["PATH"] == "wgmma" and F != chunk.wg.M:
        return f"C*R={F}: PATH=wgmma takes {chunk.wg.M} fused rows (the M of one warpgroup's m64nNk16)"
    if N % 32:
        return f"N={N} must be a multiple of 32"
    if P % 32:
        return f"P={P} must be a multiple of 32"
    if (N // 2) % c["KEY_BJ"]:
        return f"KEY_BJ={c['KEY_BJ']} must divide N/2={N // 2}"
    for key in ("KEY_BP", "BLOCK_P"):
        if P % c[key]:
            return f"{key}={c[key]} must divide P={P}"
    if B * S * R * H * N >= 2 ** 31:
        return f"DQ has {B * S * R * H * N} elements: beyond the kernels' 32-bit offsets"
    return scan.reason(c, shape)


def eligibility(target: str) -> str | None:
    if target not in TARGETS:
        return f"cute mamba_bwd_bwd has no path for {target} (warp mma.sync; has {', '.join(TARGETS)})"
    return None


def target_reason(config: dict, target: str) -> str | None:
    """Config rules that depend on the compile target: PATH=wgmma only on sm_90a."""
    reason = eligibility(target)
    if reason:
        return reason
    path = {**DEFAULTS, **config}["PATH"]
    if path == "wgmma" and _targets.cc(target) != 90:
        return f"ineligible: PATH=wgmma requires sm_90a (warpgroup MMA); target is {target}"
    return None


def smem_kernels(config: dict, shape: dict, target: str) -> dict:
    """Shared memory per CTA of each kernel, bytes: its buffers (128-byte aligned) plus the static part."""
    c = {**DEFAULTS, **config}
    static = static_smem(target)
    return {**({"prep": static} if c["SCAN_PREP"] else {}),
            "scan": scan.smem_bytes(c, shape, target),
            "key": chunk.key_layout(c, shape).nbytes() + static,
            "value": chunk.value_layout(c, shape).nbytes() + static,
            "reduce": static}


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """The largest of the kernels' shared memory per CTA, bytes (equal to the compiled figure:
    tests/test_cute_mamba.py)."""
    return max(smem_kernels(config, shape, target).values())


# --------------------------------------------------------------------------------------------
# compile


def _ptrs(kinds) -> list:
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    return [make_ptr(k, 0, AddressSpace.gmem, assumed_align=16) for k in kinds]


def _kinds(shape: dict) -> dict:
    """Element types of each kernel's pointer arguments, in the order of ``arguments``."""
    e, f, bf = _DT[shape["dtype"]], F32, cutlass.BFloat16
    key = (e, e, f, f, e, f, f, f, f, f, e, f, e, f, e, f, e, bf, e, e, e, f, f, f)
    value = (e, e, f, f, e, f, f, f, f, e, e, f, e, f, e, f, e, f, e, f, f, e, f, f, f, f, f, f, f, f)
    return {"prep": scan.arg_kinds(shape, "prep"), "scan": scan.arg_kinds(shape), "key": key, "value": value,
            "reduce": (f, f, f, f)}


def _program(name: str, config: dict, shape: dict):
    if name == "key":
        return chunk.Key(config, shape)
    if name == "value":
        return chunk.Value(config, shape)
    return chunk.Reduce(shape)


def _compile(name: str, config: dict, shape: dict, target: str, options: str):
    from cutlass.runtime import make_fake_stream
    if name in ("prep", "scan"):
        return scan._compile(config, shape, target, options, name)
    return cute.compile(_program(name, config, shape), *_ptrs(_kinds(shape)[name]), make_fake_stream(),
                        options=f"--gpu-arch {target} {options}".strip())


KERNELS = ("scan", "key", "value", "reduce")


def kernel_names(config: dict) -> tuple:
    """The kernels a config launches, in order (Prep first with SCAN_PREP)."""
    return (("prep",) if {**DEFAULTS, **config}["SCAN_PREP"] else ()) + KERNELS


def _refuse(config: dict, shape: dict, target: str) -> dict:
    config = {**DEFAULTS, **config}
    why = config_reason(config, shape) or target_reason(config, target)
    if why:
        raise ValueError(f"cannot compile for {target}: {why}")
    return config


def compile_for(config: dict, shape: dict, target: str, kernels=None) -> dict:
    """The kernels for ``target`` (no GPU); smem_bytes / registers / stack are the largest of them."""
    config = _refuse(config, shape, target)
    per = {}
    for name in kernels or kernel_names(config):
        _, per[name] = _aot.compile_with_resources(lambda opts, n=name: _compile(n, config, shape, target, opts),
                                                   f"cute_bwd_{name}_{target}_", target)
    return {"smem_bytes": max(v["smem_bytes"] for v in per.values()),
            "registers": max(v["registers"] or 0 for v in per.values()) or None,
            "stack": max(v["stack"] or 0 for v in per.values()),
            "compile_s": sum(v["compile_s"] for v in per.values()), "binary": "cubin", "kernels": per}


# --------------------------------------------------------------------------------------------
# run


def workspace(config: dict, shape: dict, dtype, device) -> dict:
    """The lane's intermediate buffers: dS (input dtype), fp32 partials and, with SCAN_PREP, the scan's
    operands QS and DY (input dtype)."""
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    config = {**DEFAULTS, **config}
    nbj, f32 = N // 2 // config["KEY_BJ"], {"dtype": torch.float32, "device": device}
    prep = {"qs": torch.empty(B, H, nc, C * R, N, dtype=dtype, device=device),
            "dy": torch.empty(B, H, nc, C * R, P, dtype=dtype, device=device)} if config["SCAN_PREP"] else {}
    return {"ds": torch.empty(B, H, nc, N, P, dtype=dtype, device=device), "dda": torch.empty(B, H, nc, nbj, **f32),
            "rows": torch.empty(B, H, nc, nbj, 3, C * R, **f32), "dpsi": torch.empty(B, H, nc, R, P, **f32),
            "dd": torch.empty(B, H, nc, **f32), "dd_out": torch.empty(B, H, **f32), **prep}


def arguments(inputs: dict, outputs: dict, work: dict, shape: dict) -> dict:
    """Each kernel's tensor arguments, in order (their dtypes are _kinds'); "prep" only where the work
    holds its outputs (SCAN_PREP)."""
    i, o, w = inputs, outputs, work
    z, zeta = (i["Z"], i["MIMO_Z"]) if shape["hasZ"] else (i["V"], i["MIMO_V"])   # not read without Z
    dpar = i["D"] if shape["hasD"] else i["MIMO_V"]                                 # not read without D
    scan_in = (i["Q"], i["Q_BIAS"], i["ANGLES"], i["DA_CS"], i["DOUT"], i["MIMO_O"], z, zeta)
    qs, dy = (w["qs"], w["dy"]) if "qs" in w else (w["ds"], w["ds"])               # not read without SCAN_PREP
    return {**({"prep": scan_in + (qs, dy)} if "qs" in w else {}),
            "scan": scan_in + (qs, dy, w["ds"]),
            "key": (i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["V"], i["MIMO_V"], i["ANGLES"], i["DA_CS"],
                    i["DA_CS_REV"], i["DT"], i["TRAP"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, dy,
                    i["STATES"], w["ds"], o["DQ"], o["DK"], o["DANGLES"], w["rows"], w["dda"]),
            "value": (i["Q"], i["K"], i["Q_BIAS"], i["K_BIAS"], i["V"], i["MIMO_V"], i["ANGLES"], i["DA_CS_REV"],
                      i["DT"], i["TRAP"], i["QK_DOT"], i["SEGSUM"], i["DOUT"], i["MIMO_O"], z, zeta, dy, dpar, w["ds"],
                      w["rows"], w["dda"], o["DV"], o["DFACTOR"], o["DGAMMA_DIAG"], o["DDA"], o["DDA_CS"],
                      o["DDA_CS_REV"], o["DSSDA"], w["dpsi"], w["dd"]),
            "reduce": (w["dpsi"], w["dd"], o["DMIMO_V"], o["DD"] if shape["hasD"] else w["dd_out"])}


def launchers(config: dict, shape: dict) -> dict:
    """Each kernel compiled for the current GPU: name -> launch(inputs, outputs, work) on the current
    stream (scripts/cute_bwd_check.py runs the scan alone to check dS)."""
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    target = _targets.device_target()
    config = _refuse(config, shape, target)
    kinds = {torch.float32: F32, torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}

    def ptr(t):
        if not t.is_contiguous() or t.data_ptr() % 16:
            raise ValueError("expected contiguous, 16-byte aligned tensors")
        return make_ptr(kinds[t.dtype], t.data_ptr(), AddressSpace.gmem, assumed_align=16)

    def launcher(name):
        fn = _compile(name, config, shape, target, "")

        def launch(inputs, outputs, work):
            tensors = arguments(inputs, outputs, work, shape)[name]
            fn(*(ptr(t) for t in tensors), cuda.CUstream(torch.cuda.current_stream().cuda_stream))
        return launch
    return {name: launcher(name) for name in kernel_names(config)}


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    launch = launchers(config, shape)
    info = {"smem_bytes": smem_estimate(config, shape, _targets.device_target()), "kernels": list(kernel_names(config))}
    work: dict = {}

    def run(inputs, outputs):
        dev = inputs["Q"].device
        if work.get("dev") != dev:
            work.update(workspace(config, shape, inputs["Q"].dtype, dev), dev=dev)
        for name in kernel_names(config):
            launch[name](inputs, outputs, work)
        return info
    return run
