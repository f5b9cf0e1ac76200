"""M2RNN backward: gradients of q, k, v, W, f (and h0 when given) from dy and d(final state).

The boundary takes the forward's inputs, not its saved states: whatever a lane keeps or recomputes
(all states, or checkpoints every T steps) is part of its time, so the figure compares with a
framework's forward-for-backward plus backward. Math, layouts and the BPTT formulas:
lab/problems/_m2rnn.py. Gradients are in the input dtype, summed over the value heads that share a
q / k / W / f head (dW also over batch).
"""
from __future__ import annotations

import torch

from lab.problems import _m2rnn as m2
from lab.problems._m2rnn_problem import M2RNNBase, tolerance


class M2RNNBackward(M2RNNBase):
    name = "m2rnn_bwd"
    outputs = ("dq", "dk", "dv", "dW", "df", "dh0")
    backward = True

    def alloc_outputs(self, shape: dict, device: str) -> dict:
        B, S, N, Nq, Nk, Nw, Nf, K, V = (shape[d] for d in m2.DIMS)
        dt = getattr(torch, shape["dtype"])
        sizes = {"dq": (B, S, Nq, K), "dk": (B, S, Nk, K), "dv": (B, S, N, V), "dW": (Nw, V, V),
                 "df": (B, S, Nf), "dh0": (B, N, K, V)}
        if not shape["h0"]:
            del sizes["dh0"]
        return {n: torch.full(s, float("nan"), dtype=dt, device=device) for n, s in sizes.items()}

    def reference(self, inputs: dict, shape: dict) -> dict:
        """Explicit BPTT (reference 2, the torch lane's math) in fp64 on the CPU, fp32 on a GPU."""
        dtype = m2.reference_dtype(inputs["v"].device)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return m2.bptt_backward(inputs, shape, dtype)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev

    def tolerance(self, shape: dict):
        return tolerance(shape["dtype"])

    def flops(self, shape: dict) -> float:
        """Per (b, n, t): the forward recomputed (2 K V^2 + 8 K V), dW and dX W^T (4 K V^2), the rest ~12 K V."""
        K, V = shape["K"], shape["V"]
        return float(shape["B"] * shape["N"] * shape["S"] * (6 * K * V * V + 20 * K * V))

    def bytes_moved(self, shape: dict) -> float:
        B, S, N, Nq, Nk, Nw, Nf, K, V = (shape[d] for d in m2.DIMS)
        grads = B * S * (Nq * K + Nk * K + N * V + Nf) + Nw * V * V + (B * N * K * V if shape["h0"] else 0)
        return float(self._elem(shape) * (self._input_elems(shape) + B * S * N * V + B * N * K * V + grads))


PROBLEM = M2RNNBackward()
