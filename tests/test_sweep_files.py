"""The committed sweep files against the committed results: pruning a space (`python -m lab prune`) must
keep every lane's best measured config of every shape and device inside it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab import gate, registry, results, space
from lab.devices import get_profile

ROOT = Path(__file__).resolve().parent.parent


def _bests():
    df = gate.ok_rows(results.load(ROOT / "results"))
    for (kernel, dsl, device, shape), rows in df.groupby(["kernel", "dsl", "requested_profile", "shape"]):
        # Among the configs today's lane accepts for the profile's target: a value the lane retired with a
        # reason (the CuTe DSL GEMM's PATH "auto") is not one a pruning took from the sweep file.
        lane, target = registry.get(dsl, kernel), get_profile(device).target
        rows = rows[[gate.refused_today(lane, c, target) is None for c in rows["config_json"]]]
        if rows.empty:
            continue
        best = rows.loc[rows["time_ms"].idxmin()]
        yield kernel, dsl, device, shape, json.loads(best["config_json"])


BESTS = sorted(_bests(), key=lambda b: b[:4])
# Baseline lanes (torch) have nothing to tune.
TUNED = sorted({(k, d) for k, d, *_ in BESTS if not registry.get(d, k).is_baseline})


@pytest.mark.parametrize("kernel,dsl", TUNED)
def test_best_committed_configs_stay_in_the_space(kernel, dsl):
    lane = registry.get(dsl, kernel)
    sp = space.load_space(kernel, dsl, tuple(lane.module.TUNABLES))
    outside = []
    for k, d, device, shape, config in BESTS:
        if (k, d) != (kernel, dsl):
            continue
        # Keys the lane no longer tunes, and precision keys (not params), say nothing about the space.
        cfg = {key: v for key, v in config.items() if key in sp.params}
        bad = [f"{key}={v!r}" for key, v in cfg.items() if v not in sp.params[key]]
        full = lane.full_config(cfg)
        why = ", ".join(bad) or sp.rule_reason(full)
        if why:
            outside.append(f"{device} {shape}: {why}")
    assert not outside, f"{dsl}/{kernel}: best configs outside {sp.source}: " + "; ".join(outside)
