"""The part of the m2rnn_fwd and m2rnn_bwd problems they share: shape rules, inputs, sizes."""
from __future__ import annotations

import torch

from lab.devices import LabError
from lab.problems import Problem, Tolerance
from lab.problems import _m2rnn as m2


class M2RNNBase(Problem):
    dims = m2.DIMS + m2.FLAGS
    flags = m2.FLAGS
    dtypes = ("float32", "bfloat16")
    backward = False

    def check_shape(self, shape: dict) -> None:
        super().check_shape(shape)
        bad = [n for n in ("Nq", "Nk", "Nw", "Nf") if shape["N"] % shape[n]]
        if bad:
            raise LabError(f"{self.name} shape: {', '.join(bad)} must divide N={shape['N']}")

    def make_inputs(self, shape: dict, device: str, seed: int) -> dict:
        return m2.make_inputs(shape, device, seed, self.backward)

    def _elem(self, shape: dict) -> int:
        return torch.empty((), dtype=getattr(torch, shape["dtype"])).element_size()

    def _input_elems(self, shape: dict) -> int:
        B, S, N, Nq, Nk, Nw, Nf, K, V = (shape[d] for d in m2.DIMS)
        return B * S * (Nq * K + Nk * K + N * V + Nf) + Nw * V * V + (B * N * K * V if shape["h0"] else 0)

    def parity_shapes(self, shape: dict) -> list[dict]:
        # A ragged sequence length (977, as upstream's tests), two batch rows, few heads, with an
        # initial state, and the shape's own head sharing pattern kept where it divides N = 4.
        share = {n: (1 if shape[n] < shape["N"] else 4) for n in ("Nq", "Nk", "Nw", "Nf")}
        return [{**shape, "B": 2, "S": 977, "N": 4, **share, "h0": True}]


def tolerance(dtype: str) -> Tolerance:
    """fp32: exact math but tanh.approx.f32 (2^-11 relative) when a lane uses the fast tanh, carried
    through the recurrence. bf16: the state is rounded to bf16 for each step's H W product and the
    outputs are bf16; errors are damped by f < 1 rather than accumulated over S."""
    return {"float32": Tolerance(rel_l2=2e-3, rel_max=1e-2),
            "bfloat16": Tolerance(rel_l2=2e-2, rel_max=5e-2)}[dtype]
