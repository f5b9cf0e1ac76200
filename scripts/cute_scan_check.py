"""GPU check of the CuTe DSL dS scan (kernels/cute/_bwd_bwd_scan.py) before it joins a lane: its dS
against lab.problems._mamba3.state_grads (fp64) at every named shape and both tiles, and its time
(median of 20 calls after 3 warm-ups, CUDA events, L2 not flushed: a first look, not a lab row).

    python scripts/cute_scan_check.py [SHAPE ...]      (default: the named shapes)"""
from __future__ import annotations

import statistics
import sys

import torch

from kernels.cute import _bwd_bwd_scan as scan
from lab import space
from lab.problems import _mamba3 as m3
from lab.problems.mamba_bwd_bwd import MambaBwdBwd

TILES = ({"SCAN_BJ": 16, "SCAN_BP": 32}, {"SCAN_BJ": 32, "SCAN_BP": 64})


def main(names: list[str]) -> int:
    names = names or list(space.load_shapes("mamba_bwd_bwd")[0])
    worst = 0.0
    for name in names:
        shape = space.get_shape("mamba_bwd_bwd", name)
        inputs = MambaBwdBwd().make_inputs(shape, "cuda", 7)
        ref = m3.state_grads(inputs, shape)
        for tile in TILES:
            why = scan.reason(tile, shape)
            if why:
                print(f"{name:22s} {tile}: refused: {why}", flush=True)
                continue
            run = scan.build(tile, shape)
            ds = run(inputs)
            torch.cuda.synchronize()
            err = float((ds.double() - ref).norm() / ref.norm())
            worst = max(worst, err)
            for _ in range(3):
                run(inputs)
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run(inputs)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            print(f"{name:22s} {tile}: rel_l2 {err:.2e}  {statistics.median(times) * 1000:.1f} us", flush=True)
    print(f"worst rel_l2 {worst:.2e}")
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
