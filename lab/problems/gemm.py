"""GEMM: C[M, N] = A[M, K] @ B[K, N]; fp16/bf16/fp32 inputs, fp32 accumulation, C in the input dtype."""
from __future__ import annotations

import torch

from lab.problems import Problem, Tolerance

# Parity bands per input dtype. The output is rounded to the input dtype, so the band is a few
# units in the last place of that dtype: bf16 has 8 mantissa bits (2^-9 ~ 2e-3 rounding), fp16 11.
# fp32 allows tf32 (Triton's default fp32 dot: ~3e-4).
_TOL = {
    "bfloat16": Tolerance(rel_l2=8e-3, rel_max=1.6e-2),
    "float16": Tolerance(rel_l2=1e-3, rel_max=4e-3),
    "float32": Tolerance(rel_l2=2e-3, rel_max=8e-3),
}


class Gemm(Problem):
    name = "gemm"
    dims = ("M", "N", "K")
    dtypes = ("bfloat16", "float16", "float32")
    outputs = ("c",)

    def make_inputs(self, shape: dict, device: str, seed: int) -> dict:
        gen = torch.Generator(device=device).manual_seed(seed)
        dt = getattr(torch, shape["dtype"])
        M, N, K = shape["M"], shape["N"], shape["K"]
        # Unit-variance entries scaled by 1/sqrt(K) keep |C| ~ 1 whatever K is.
        scale = K ** -0.25
        a = torch.randn(M, K, generator=gen, device=device, dtype=torch.float32).mul_(scale)
        b = torch.randn(K, N, generator=gen, device=device, dtype=torch.float32).mul_(scale)
        return {"a": a.to(dt), "b": b.to(dt)}

    def alloc_outputs(self, shape: dict, device: str) -> dict:
        dt = getattr(torch, shape["dtype"])
        return {"c": torch.full((shape["M"], shape["N"]), float("nan"), dtype=dt, device=device)}

    def reference(self, inputs: dict, shape: dict) -> dict:
        a, b = inputs["a"], inputs["b"]
        small = shape["M"] * shape["N"] * shape["K"] <= 1 << 27
        hi = torch.float64 if small or a.device.type == "cpu" else torch.float32
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return {"c": torch.matmul(a.to(hi), b.to(hi))}
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev

    def tolerance(self, shape: dict) -> Tolerance:
        return _TOL[shape["dtype"]]

    def flops(self, shape: dict) -> float:
        return 2.0 * shape["M"] * shape["N"] * shape["K"]

    def bytes_moved(self, shape: dict) -> float:
        elem = torch.empty((), dtype=getattr(torch, shape["dtype"])).element_size()
        M, N, K = shape["M"], shape["N"], shape["K"]
        return float((M * K + K * N + M * N) * elem)

    def parity_shapes(self, shape: dict) -> list[dict]:
        # Ragged in M (odd), N and K multiples of 8 but not of 16 or of any tile size.
        return [{"M": 197, "N": 136, "K": 264, "dtype": shape["dtype"]}]


PROBLEM = Gemm()
