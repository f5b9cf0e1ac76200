"""Build one lane at a named shape and call it a few times (no parity, no timing): the process an
external profiler (ncu) wraps. The last call runs inside the NVTX range "lab_call", so that a profiler can
leave out the first calls' JIT compiles and warm-up (scripts/ncu_lane.py).

    python scripts/call_lane.py KERNEL DSL SHAPE CALLS ['{"config": "json"}']
"""
from __future__ import annotations

import json
import sys

import torch

from lab import problems, registry, space


def main() -> int:
    kernel, dsl, name, calls = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    config = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    mod = registry.get(dsl, kernel).module
    problem = problems.get(kernel)
    shape = space.get_shape(kernel, name)
    run = mod.build({**mod.DEFAULTS, **config}, shape)
    inputs = problem.make_inputs(shape, "cuda", 0)
    outputs = problem.alloc_outputs(shape, "cuda")
    for i in range(calls):
        if i == calls - 1:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("lab_call")
        run(inputs, outputs)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
