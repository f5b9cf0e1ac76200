"""M2RNN forward: (q, k, v, W, f, optional h0) -> (y, h_final). Math and layouts: lab/problems/_m2rnn.py.

Shape keys: B, S, N (value heads), Nq, Nk, Nw, Nf (heads of q, k, W, f; each divides N), K, V, h0
(true: an initial state is given), dtype (float32 / bfloat16; y and h_final in that dtype).
"""
from __future__ import annotations

import torch

from lab.problems import _m2rnn as m2
from lab.problems._m2rnn_problem import M2RNNBase, tolerance


class M2RNNForward(M2RNNBase):
    name = "m2rnn_fwd"
    outputs = ("y", "h_final")

    def alloc_outputs(self, shape: dict, device: str) -> dict:
        B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
        dt = getattr(torch, shape["dtype"])
        return {"y": torch.full((B, S, N, V), float("nan"), dtype=dt, device=device),
                "h_final": torch.full((B, N, K, V), float("nan"), dtype=dt, device=device)}

    def reference(self, inputs: dict, shape: dict) -> dict:
        """Sequential forward in fp64 on the CPU, fp32 on a GPU (TF32 off)."""
        dtype = m2.reference_dtype(inputs["v"].device)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            y, h = m2.forward(m2.expand(inputs, shape, dtype))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        return {"y": y, "h_final": h}

    def tolerance(self, shape: dict):
        return tolerance(shape["dtype"])

    def flops(self, shape: dict) -> float:
        """Per (b, n, t): H W (2 K V^2), k v^T (K V), tanh and gating (~5 K V), y (2 K V)."""
        K, V = shape["K"], shape["V"]
        return float(shape["B"] * shape["N"] * shape["S"] * (2 * K * V * V + 8 * K * V))

    def bytes_moved(self, shape: dict) -> float:
        B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
        return float(self._elem(shape) * (self._input_elems(shape) + B * S * N * V + B * N * K * V))


PROBLEM = M2RNNForward()
