"""Build one lane at named shapes, check every output against the problem's reference and time it.

    python scripts/check_lane.py KERNEL DSL SHAPE[,SHAPE...] ['{"config": "json"}' ...]

Per config and shape: one line per output (rel_l2, rel_max) and the median time (ms) of a short
CUDA-event loop; a config that fails to build is reported and the next one runs.
A debugging aid for lane authors on the GPU; the lab's tables come from `python -m lab sweep`."""
from __future__ import annotations

import json
import sys
import time

import torch

from lab import parity, problems, registry, space


def main() -> int:
    kernel, dsl, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    problem = problems.get(kernel)
    mod = registry.get(dsl, kernel).module
    bad = 0
    for arg in sys.argv[4:] or ["{}"]:
        print(f"config {arg}", flush=True)
        try:
            bad += _check(mod, problem, kernel, json.loads(arg), names)
        except Exception as exc:  # noqa: BLE001  (report and go on to the next config)
            bad += 1
            print(f"  failed: {type(exc).__name__}: {str(exc)[:300]}")
    return 1 if bad else 0


def _check(mod, problem, kernel, config, names) -> int:
    bad = 0
    for name in names:
        shape = space.get_shape(kernel, name)
        why = mod.config_reason({**mod.DEFAULTS, **config}, shape)
        if why:
            print(f"{name}: config does not apply: {why}")
            continue
        t0 = time.perf_counter()
        run = mod.build({**mod.DEFAULTS, **config}, shape)
        inputs = problem.make_inputs(shape, "cuda", 0)
        outputs = problem.alloc_outputs(shape, "cuda")
        info = run(inputs, outputs)
        torch.cuda.synchronize()
        print(f"{name}: built+first call {time.perf_counter() - t0:.1f} s, launch info {info}")
        ok, errors = parity.compare(outputs, problem.reference(inputs, shape), problem.tolerance(shape),
                                    problem.output_tolerances(shape))
        bad += not ok
        for out, e in errors.items():
            print(f"  {out:12s} rel_l2={e.rel_l2:.3e} rel_max={e.rel_max:.3e} nonfinite={e.nonfinite}")
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        times = []
        for _ in range(20):
            ev[0].record()
            run(inputs, outputs)
            ev[1].record()
            torch.cuda.synchronize()
            times.append(ev[0].elapsed_time(ev[1]))
        print(f"  parity {'ok' if ok else 'FAILED'}; median {sorted(times)[10]:.4f} ms (20 calls, no L2 flush)",
              flush=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
