"""Per-GPU-kernel time of one lane at named shapes (torch.profiler), to see where a lane spends it.

    python scripts/profile_lane.py KERNEL DSL SHAPE[,SHAPE...] [CONFIG_JSON_WITHOUT_SPACES ...]

Prints, per config and shape, each CUDA kernel's total and per-call time (us) over 10 calls after a
warm-up (no parity check: a config that computes the wrong thing is timed all the same).
A debugging aid; the lab's tables come from `python -m lab sweep`."""
from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from lab import problems, registry, space


def main() -> int:
    kernel, dsl, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    mod = registry.get(dsl, kernel).module
    problem = problems.get(kernel)
    for arg in sys.argv[4:] or ["{}"]:
        config = {**mod.DEFAULTS, **json.loads(arg)}
        print(f"config {arg}", flush=True)
        try:
            _profile(mod, problem, kernel, config, names)
        except Exception as exc:  # noqa: BLE001  (report and go on to the next config)
            print(f"  failed: {type(exc).__name__}: {str(exc)[:300]}")
    return 0


def _profile(mod, problem, kernel, config, names):
    for name in names:
        shape = space.get_shape(kernel, name)
        run = mod.build(config, shape)
        inputs = problem.make_inputs(shape, "cuda", 0)
        outputs = problem.alloc_outputs(shape, "cuda")
        for _ in range(3):
            run(inputs, outputs)
        torch.cuda.synchronize()
        calls = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                run(inputs, outputs)
            torch.cuda.synchronize()
        print(f"{name}: per call, {calls} calls")
        rows = [e for e in prof.key_averages() if e.device_time_total > 0]
        for e in sorted(rows, key=lambda e: -e.device_time_total)[:6]:
            print(f"  {e.device_time_total / calls:10.1f} us  x{e.count // calls:<3d} {e.key[:90]}")


if __name__ == "__main__":
    sys.exit(main())
