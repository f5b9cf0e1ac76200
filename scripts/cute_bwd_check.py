"""GPU check of the CuTe DSL bwd_bwd lane (kernels/cute/mamba_bwd_bwd.py), kernel by kernel, before
and beside the lab's sweep: at each shape, the dS scan's workspace against
lab.problems._mamba3.state_grads (fp64), then every one of the 12 outputs against the reference (fp32
on the GPU, the lab's parity) with its rel_l2 / rel_max and band, so a wrong output names the kernel
that writes it (scan: dS; key: DQ, DK, DANGLES and the workspaces behind DDA, DDA_CS, DDA_CS_REV,
DFACTOR; value: the rest; reduce: DMIMO_V, DD). Then the lane's time and each kernel's (median of 20
calls after 3 warm-ups, CUDA events, L2 not flushed: a first look, not a lab row).

    python scripts/cute_bwd_check.py [SHAPE ...] [--config KEY=VALUE ...]   (default: the named shapes)"""
from __future__ import annotations

import statistics
import sys

import torch

from kernels.cute import mamba_bwd_bwd as lane
from lab import parity, space
from lab.problems import _mamba3 as m3
from lab.problems.mamba_bwd_bwd import MambaBwdBwd


def _time_ms(fn) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def check(name: str, config: dict) -> bool:
    shape = space.get_shape("mamba_bwd_bwd", name)
    why = lane.config_reason(config, shape)
    if why:
        print(f"{name}: refused: {why}", flush=True)
        return True
    prob = MambaBwdBwd()
    inputs = prob.make_inputs(shape, "cuda", 7)
    outputs = prob.alloc_outputs(shape, "cuda")
    run = lane.build(config, shape)
    torch.cuda.synchronize()
    run(inputs, outputs)
    torch.cuda.synchronize()
    launch = lane.launchers(config, shape)
    work = lane.workspace(config, shape, inputs["Q"].dtype, "cuda")   # the scan (after Prep), into a workspace of ours
    for name in lane.kernel_names(config)[:lane.kernel_names(config).index("scan") + 1]:   # Prep, if any
        launch[name](inputs, outputs, work)
    torch.cuda.synchronize()
    ref_ds = m3.state_grads(inputs, shape)
    ds = parity.output_error(work["ds"], ref_ds)
    ok = ds.rel_l2 < 1e-2 and ds.nonfinite == 0
    print(f"{name} {config}\n  scan   dS          rel_l2 {ds.rel_l2:.2e} rel_max {ds.rel_max:.2e} "
          f"nonfinite {ds.nonfinite}", flush=True)
    ref = prob.reference(inputs, shape)
    tol, bands = prob.tolerance(shape), prob.output_tolerances(shape)
    writer = {"DQ": "key", "DK": "key", "DANGLES": "key", "DMIMO_V": "reduce", "DD": "reduce"}
    for out, err in parity.compare(outputs, ref, tol, bands)[1].items():
        good = err.ok(bands.get(out, tol))
        ok = ok and good
        print(f"  {writer.get(out, 'value'):6s} {out:11s} rel_l2 {err.rel_l2:.2e} rel_max {err.rel_max:.2e} "
              f"nonfinite {err.nonfinite} {'ok' if good else 'WRONG'}", flush=True)
    each = {name: _time_ms(lambda f=launch[name]: f(inputs, outputs, work)) for name in lane.kernel_names(config)}
    print(f"  time {_time_ms(lambda: run(inputs, outputs)):.3f} ms (" +
          ", ".join(f"{name} {ms:.3f}" for name, ms in each.items()) + ")", flush=True)
    return ok


def main(argv: list[str]) -> int:
    config, names = dict(lane.DEFAULTS), []
    args = iter(argv)
    for a in args:
        if a == "--config":
            k, v = next(args).split("=")
            config[k] = int(v)
        else:
            names.append(a)
    names = names or list(space.load_shapes("mamba_bwd_bwd")[0])
    results = [check(n, config) for n in names]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
