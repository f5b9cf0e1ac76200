"""Output comparison against a higher-precision reference.

Errors are relative: rel_l2 = ||out - ref|| / ||ref|| and rel_max = max|out - ref| / max|ref|.
A non-finite element (NaN left by an unwritten output, Inf) never passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.problems import Tolerance


@dataclass
class OutputError:
    rel_l2: float
    rel_max: float
    nonfinite: int

    def ok(self, tol: Tolerance) -> bool:
        return self.nonfinite == 0 and self.rel_l2 <= tol.rel_l2 and self.rel_max <= tol.rel_max


def output_error(out: torch.Tensor, ref: torch.Tensor) -> OutputError:
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    o = out.detach().to(torch.float64)
    r = ref.detach().to(torch.float64).to(o.device)
    nonfinite = int((~torch.isfinite(o)).sum().item())
    diff = torch.nan_to_num(o - r, nan=float("inf"))
    ref_l2, ref_max = r.norm().item(), r.abs().max().item() if r.numel() else 0.0
    l2 = diff.norm().item()
    mx = diff.abs().max().item() if diff.numel() else 0.0
    rel_l2 = l2 / ref_l2 if ref_l2 > 0 else l2
    rel_max = mx / ref_max if ref_max > 0 else mx
    return OutputError(rel_l2, rel_max, nonfinite)


def compare(outputs: dict, reference: dict, tol: Tolerance,
            per_output: dict[str, Tolerance] | None = None) -> tuple[bool, dict[str, OutputError]]:
    """Compare every output against ``tol`` (or its own band in ``per_output``); returns (all ok,
    per-output errors)."""
    per_output = per_output or {}
    errors = {name: output_error(outputs[name], reference[name]) for name in reference}
    return all(e.ok(per_output.get(n, tol)) for n, e in errors.items()), errors


def describe_failure(errors: dict[str, OutputError], tol: Tolerance, where: str,
                     per_output: dict[str, Tolerance] | None = None) -> str:
    bad = []
    for name, e in errors.items():
        t = (per_output or {}).get(name, tol)
        if not e.ok(t):
            bad.append(f"{name}: rel_l2={e.rel_l2:.3g} (tol {t.rel_l2:g}) rel_max={e.rel_max:.3g} "
                       f"(tol {t.rel_max:g}) nonfinite={e.nonfinite}")
    return f"wrong result at {where}: " + "; ".join(bad)
