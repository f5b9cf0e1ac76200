"""Triton lane for m2rnn_bwd: a forward pass that keeps the state every CKPT steps (fp32 checkpoints),
then one program per (batch row, value head) walking the segments last to first: recompute the
segment's states into a scratch buffer, backprop through them (kernels in kernels/triton/_m2rnn.py).
Per-value-head gradients land in fp32 buffers; shared q / k / W / f heads (and dW over batch) are
summed by torch afterwards.

Tunables:
  num_warps   warps per program
  K_SPLIT     K slabs per (b, n), one program each (rows of H and dH evolve independently): shorter
              per-step products and reductions, at the cost of fp32 partials of dv, df, dW per slab
  CKPT        checkpoint interval T: memory B*N*(S/T)*K*V*4 + scratch B*N*T*K*V*4 bytes, and the
              forward is recomputed once either way; small T: more checkpoint traffic, large T: the
              scratch falls out of L2
  DOT         operands of the per-step products (bf16 inputs; fp32 inputs always use IEEE fp32):
              input = state rounded to bf16 (upstream's choice), tf32, tf32x3 (~fp32), ieee
  FAST_TANH   tanh.approx.f32 (inline PTX); the exact formula under TRITON_INTERPRET
  PREFETCH    steps per group in both kernels' loops: each group's inputs (and, walking back, the
              scratch states) are loaded while the previous group computes (1 = per step, no overlap)
"""
from __future__ import annotations

import torch

from kernels.triton import _common, _m2rnn as m2k
from kernels.triton._common import versions  # noqa: F401  (the lane interface)
from lab.problems import _m2rnn as m2

DSL = "triton"
KERNEL = "m2rnn_bwd"
TUNABLES = ("num_warps", "K_SPLIT", "CKPT", "DOT", "FAST_TANH", "PREFETCH")
DEFAULTS = {"num_warps": 4, "K_SPLIT": 1, "CKPT": 64, "DOT": "input", "FAST_TANH": True, "PREFETCH": 4}
TARGETS = m2k.TARGETS
eligibility = m2k.eligibility


def config_reason(config: dict, shape: dict) -> str | None:
    config = {**DEFAULTS, **config}
    reason = m2k.common_reason(config, shape)
    if reason:
        return reason
    return m2k.ksplit_reason(config, shape)


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per program of the backward kernel, bytes: operands of its three products
    (H W, H^T dX, dX W^T) in the dot's input dtype. An approximation (Triton 3.6 AOT: 6,656 B on
    sm_90a and 7,168 B on sm_121a against 5,120 B at b8_n84; 3% low at fp32 K = V = 64): far below
    every limit here, and the compiled figure decides."""
    config = {**DEFAULTS, **config}
    e = 2 if m2k.dot_mode(config, shape) == 0 else 4          # fp32 operands unless DOT = input
    bk, bv = m2k.slab(config, shape), m2k.block(shape["V"])
    return e * (2 * bv * bv + 2 * bk * bv)


def _consts(config: dict, shape: dict, fast: bool) -> dict:
    return {"N": shape["N"], "K": shape["K"], "V": shape["V"], "BK": m2k.slab(config, shape),
            "BV": m2k.block(shape["V"]), "CKPT": config["CKPT"], "DOT": m2k.dot_mode(config, shape),
            "FAST": fast, "U": config["PREFETCH"]}


def _fwd_consts(config: dict, shape: dict, fast: bool) -> dict:
    c = _consts(config, shape, fast)
    return {"N": c["N"], "KSPLIT": config["K_SPLIT"], "K": c["K"], "V": c["V"], "BK": c["BK"], "BV": c["BV"],
            "HAS_H0": shape["h0"], "WRITE_Y": False, "CKPT": c["CKPT"], "DOT": c["DOT"], "FAST": fast, "U": c["U"]}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Both kernels for ``target``; smem_bytes / registers are the larger of the two."""
    config = {**DEFAULTS, **config}
    fast = bool(config["FAST_TANH"])
    fwd = m2k.aot(m2k.m2rnn_forward, m2k.forward_signature(shape, True), _fwd_consts(config, shape, fast),
                  target, config["num_warps"])
    bwd = m2k.aot(m2k.m2rnn_backward, m2k.backward_signature(shape), _consts(config, shape, fast), target,
                  config["num_warps"])
    return {"smem_bytes": max(fwd["smem_bytes"], bwd["smem_bytes"]),
            "registers": max(fwd["registers"] or 0, bwd["registers"] or 0) or None,
            "compile_s": fwd["compile_s"] + bwd["compile_s"], "binary": "cubin",
            "kernels": {"forward": fwd, "backward": bwd}}


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    fast = m2k.fast_tanh(config)
    consts, fconsts = _consts(config, shape, fast), _fwd_consts(config, shape, fast)
    B, S, N, K, V, T = shape["B"], shape["S"], shape["N"], shape["K"], shape["V"], config["CKPT"]
    ks = config["K_SPLIT"]
    nseg = -(-S // T)
    heads = (shape["Nq"], shape["Nk"], shape["Nf"], shape["Nw"])
    work: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        dev = i["v"].device
        if work.get("dev") != dev:
            f32 = {"dtype": torch.float32, "device": dev}
            work.update(dev=dev, ckpt=torch.empty(B, N, nseg, K, V, **f32), scratch=torch.empty(B * N, T, K, V, **f32),
                        dq=torch.empty(B, S, N, K, **f32), dk=torch.empty(B, S, N, K, **f32),
                        dv=torch.empty(ks, B, S, N, V, **f32), df=torch.empty(ks, B, S, N, **f32),
                        dW=torch.empty(ks, B, N, V, V, **f32), dh0=torch.empty(B, N, K, V, **f32))
        w = work
        h0 = i.get("h0", i["dh_final"])   # unused pointer when there is no h0
        m2k.m2rnn_forward[(B * N, ks)](i["q"], i["k"], i["v"], i["W"], i["f"], h0, w["ckpt"], i["dh_final"], w["ckpt"],
                                      S, *heads, nseg, num_warps=config["num_warps"], **fconsts)
        kern = m2k.m2rnn_backward[(B * N, ks)](i["q"], i["k"], i["v"], i["W"], i["f"], i["dy"], i["dh_final"],
                                           w["ckpt"], w["scratch"], w["dq"], w["dk"], w["dv"], w["df"], w["dW"],
                                           w["dh0"], S, *heads, nseg, num_warps=config["num_warps"], **consts)
        per_head = {n: (w[n].sum(0) if ks > 1 else w[n][0]) if n in ("dv", "df", "dW") else w[n]
                    for n in ("dq", "dk", "dv", "dW", "df", "dh0")}
        grads = m2.reduce_heads(per_head, shape)
        for name, value in grads.items():
            o[name].copy_(value)
        return _common.launch_info(kern)
    return run
