"""``python -m lab check`` and ``python -m lab profile``: one lane, a few configs, named shapes, now.

``check`` runs the sweep's own trial (``lab.worker.run_trial``: build, parity on every output at the
timed shape and the problem's parity shapes, then timing with the harness's L2 flush and adaptive
stop) in this process and prints each output's error and the median time (ms). ``profile`` splits a
lane's GPU time per kernel it launches (torch.profiler), flushing L2 between calls as the timing does.
Both are debugging aids for lane authors; tables come from ``python -m lab sweep``.
"""
from __future__ import annotations

import json

from lab import problems, registry, space, timing, worker
from lab.devices import LabError, detect


def parse_configs(texts: list[str] | None, lane: registry.Lane) -> list[dict]:
    """Full configs (defaults filled in) from JSON objects on the command line; one default config when
    none is given. Unknown keys, malformed JSON and a config outside the lane's sweep file (a value it
    does not list, a restriction broken: ``Lane.space_reason``) are one-line errors."""
    sp = space.load_space(lane.kernel, lane.dsl, tuple(lane.module.TUNABLES))
    out = []
    for text in texts or ["{}"]:
        try:
            cfg = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LabError(f"--config {text!r} is not JSON: {exc.msg}") from None
        if not isinstance(cfg, dict):
            raise LabError(f"--config {text!r} must be a JSON object")
        full = lane.full_config(cfg)
        why = lane.space_reason(sp, full)
        if why:
            raise LabError(f"--config {text!r} refused: {why}")
        out.append(full)
    return out


def _device_and_l2(device: str | None) -> tuple[str, int]:
    """(torch device, L2 bytes to flush). cuda needs a GPU; cpu runs lanes that can run there."""
    gpu = detect()
    device = device or ("cuda" if gpu else None)
    if device is None:
        raise LabError("no GPU here: check and profile run kernels (--device cpu for lanes that run on the CPU)")
    if device.startswith("cuda") and gpu is None:
        raise LabError(f"--device {device}: no GPU here")
    return device, (gpu.l2_bytes if device.startswith("cuda") and gpu else 0)


def _cases(lane: registry.Lane, cfgs: list[dict], named: dict, out):
    """(config, shape name, shape) for each pair the lane takes, configs first; prints each config and
    each refusal (with its reason) as it goes."""
    for cfg in cfgs:
        out(f"config {json.dumps(cfg, sort_keys=True)}")
        for name, shape in named.items():
            why = lane.module.config_reason(cfg, shape)
            if why:
                out(f"  {name}: refused: {why}")
                continue
            yield cfg, name, shape


def check(kernel: str, dsl: str, shapes: list[str], configs: list[str] | None = None, device: str | None = None,
          traceback: bool = False, out=print) -> int:
    """Exit status 0 when every (config, shape) is ok, 1 otherwise."""
    lane = registry.get(dsl, kernel)
    problems.get(kernel)
    named = {s: space.get_shape(kernel, s) for s in shapes}
    cfgs = parse_configs(configs, lane)  # refusals need no GPU: before the device check
    device, l2 = _device_and_l2(device)
    bad = 0
    for cfg, name, shape in _cases(lane, cfgs, named, out):
        res = worker.run_trial({"kernel": kernel, "dsl": dsl, "config": cfg, "shape": shape, "seed": 7,
                                "device": device, "l2_bytes": l2, "timing": {}})
        bad += res["status"] != "ok"
        for output, e in sorted(res.get("parity", {}).items()):
            out(f"  {name} {output:14s} rel_l2 {e['rel_l2']:.3e}  rel_max {e['rel_max']:.3e}"
                + (f"  non-finite {e['nonfinite']}" if e.get("nonfinite") else ""))
        if res["status"] == "ok":
            out(f"  {name}: ok (parity at {', '.join(res.get('parity_shapes', []))}); median {res['time_ms']:.4f} ms "
                f"(IQR {res['time_q1_ms']:.4f}-{res['time_q3_ms']:.4f}, {res['samples']} samples, {res['timing_stop']})")
        else:
            out(f"  {name}: {res['status']}: {res.get('error', '')}")
            if traceback and res.get("traceback"):
                out(res["traceback"])
    return 1 if bad else 0


def profile(kernel: str, dsl: str, shapes: list[str], configs: list[str] | None = None, device: str | None = None,
            calls: int = 10, top: int = 8, out=print) -> int:
    """Per launched kernel: total time per lane call (us) and launches per call, over ``calls`` calls
    after a warm-up, each call preceded by the L2 flush. No parity check: run ``check`` for that."""
    import torch

    lane = registry.get(dsl, kernel)
    problem = problems.get(kernel)
    named = {s: space.get_shape(kernel, s) for s in shapes}
    cfgs = parse_configs(configs, lane)  # refusals need no GPU: before the device check
    device, l2 = _device_and_l2(device)
    cuda = device.startswith("cuda")
    flush = timing._flusher(device, l2)
    for cfg, name, shape in _cases(lane, cfgs, named, out):
        run = lane.module.build(cfg, shape)
        inputs, outputs = problem.make_inputs(shape, device, 7), problem.alloc_outputs(shape, device)
        for _ in range(3):
            run(inputs, outputs)
        if cuda:
            torch.cuda.synchronize()
        lane_t = _per_kernel(cuda, calls, lambda: (flush(), run(inputs, outputs)))
        flush_t = _per_kernel(cuda, calls, flush)  # subtracted: the flush's own kernels
        rows = {k: (t - flush_t.get(k, (0, 0))[0], n - flush_t.get(k, (0, 0))[1]) for k, (t, n) in lane_t.items()}
        out(f"  {name}: per call (us), {calls} calls, L2 flushed before each")
        for key, (t, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
            if n > 0 and t > 0:
                out(f"    {t / calls:10.1f}  x{n / calls:<4g} {key[:90]}")
    return 0


def _per_kernel(cuda: bool, calls: int, fn) -> dict[str, tuple[float, int]]:
    """{kernel name: (total us, launches)} of ``calls`` calls of ``fn`` (CPU ops on a CPU device)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    return {e.key: ((e.device_time_total if cuda else e.self_cpu_time_total), e.count) for e in prof.key_averages()
            if (e.device_time_total if cuda else e.self_cpu_time_total) > 0}
