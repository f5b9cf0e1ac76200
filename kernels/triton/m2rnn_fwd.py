"""Triton lane for m2rnn_fwd: one program per (batch row, value head, K slab), the state in registers
for all S steps (kernel in kernels/triton/_m2rnn.py).

Tunables:
  num_warps   warps per program (the step is a 64 x 16 x 16 product: few warps, short chain)
  K_SPLIT     K slabs per (b, n): more programs (B*N*K_SPLIT) and a shorter per-step product, at the
              cost of an fp32 y partial per slab summed afterwards (one more pass over y)
  DOT         operands of the per-step products (bf16 inputs; fp32 inputs always use IEEE fp32):
              input = state rounded to bf16 (upstream's choice), tf32, tf32x3 (~fp32), ieee
  FAST_TANH   tanh.approx.f32 (inline PTX) instead of the exp-based formula; under TRITON_INTERPRET the
              formula always runs (the interpreter has no PTX)
  PREFETCH    steps per group: the loop runs in groups of PREFETCH steps and loads the next group's
              k, v, f, q while it computes this one (1 = load each step's inputs just before it, the
              upstream pattern, which puts one global-load latency on every serial step)
num_stages is not a tunable: Triton's pipeliner only stages loads that feed a dot, and the loop carries
the state; PREFETCH is the hand-written equivalent (upstream's autotuning found num_stages irrelevant).
"""
from __future__ import annotations

import torch

from kernels.triton import _common, _m2rnn as m2k
from kernels.triton._common import versions  # noqa: F401  (the lane interface)

DSL = "triton"
KERNEL = "m2rnn_fwd"
TUNABLES = ("num_warps", "K_SPLIT", "DOT", "FAST_TANH", "PREFETCH")
DEFAULTS = {"num_warps": 4, "K_SPLIT": 1, "DOT": "input", "FAST_TANH": True, "PREFETCH": 4}
TARGETS = m2k.TARGETS
eligibility = m2k.eligibility


def config_reason(config: dict, shape: dict) -> str | None:
    config = {**DEFAULTS, **config}
    reason = m2k.common_reason(config, shape)
    if reason:
        return reason
    return m2k.ksplit_reason(config, shape)


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per program, bytes: the V x V W operand and the BLOCK_K x V state operand of the
    per-step product, in the dot's input dtype (Triton stages both through shared memory). Checked
    against Triton 3.6 AOT compiles: exact at fp32 K = V = 64 and at the ragged bf16 shape, 25% high
    at b8_n84 (2,048 B compiled): a pre-filter, the compiled figure decides."""
    config = {**DEFAULTS, **config}
    e = 2 if m2k.dot_mode(config, shape) == 0 else 4          # fp32 operands unless DOT = input
    bv = m2k.block(shape["V"])
    return e * (bv * bv + m2k.slab(config, shape) * bv)


def _consts(config: dict, shape: dict, fast: bool) -> dict:
    return {"N": shape["N"], "KSPLIT": config["K_SPLIT"], "K": shape["K"], "V": shape["V"],
            "BK": m2k.slab(config, shape), "BV": m2k.block(shape["V"]), "HAS_H0": shape["h0"], "WRITE_Y": True,
            "CKPT": 0, "DOT": m2k.dot_mode(config, shape), "FAST": fast, "U": config["PREFETCH"]}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    config = {**DEFAULTS, **config}
    return m2k.aot(m2k.m2rnn_forward, m2k.forward_signature(shape, config["K_SPLIT"] > 1),
                   _consts(config, shape, bool(config["FAST_TANH"])), target, config["num_warps"])


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    consts = _consts(config, shape, m2k.fast_tanh(config))
    B, S, N, ks = shape["B"], shape["S"], shape["N"], config["K_SPLIT"]
    grid = (B * N, ks)
    parts: dict = {}

    def run(inputs, outputs):
        i, o = inputs, outputs
        dev = i["v"].device
        if ks > 1 and parts.get("dev") != dev:
            parts.update(dev=dev, y=torch.empty(ks, B, S, N, shape["V"], dtype=torch.float32, device=dev))
        y = parts["y"] if ks > 1 else o["y"]
        h0 = i.get("h0", o["h_final"])   # unused pointer when there is no h0
        kern = m2k.m2rnn_forward[grid](i["q"], i["k"], i["v"], i["W"], i["f"], h0, y, o["h_final"], y,
                                       S, shape["Nq"], shape["Nk"], shape["Nf"], shape["Nw"], 1,
                                       num_warps=config["num_warps"], **consts)
        if ks > 1:
            torch.sum(y, 0, out=o["y"]) if o["y"].dtype == torch.float32 else o["y"].copy_(y.sum(0))
        return _common.launch_info(kern)
    return run
