"""kernels/_targets.py: target names, opt-in shared memory, the lanes' default target rule."""
from __future__ import annotations

import pytest

from kernels import _targets
from lab.devices import PROFILES


def test_target_names_parse_and_bad_ones_fail():
    assert [_targets.cc(t) for t in ("sm_80", "sm_90a", "sm_100f", "sm_121a")] == [80, 90, 100, 121]
    for bad in ("sm90a", "sm_90ab", "compute_90", "gfx942"):
        with pytest.raises(ValueError, match="not an explicit compile target"):
            _targets.cc(bad)
    with pytest.raises(ValueError, match="no opt-in shared memory figure for sm_75"):
        _targets.smem_optin("sm_75")


def test_lane_limits_agree_with_the_device_profiles():
    """The lanes' per-architecture table and the harness's device profiles are two sources of one fact."""
    for p in PROFILES.values():
        assert _targets.smem_optin(p.target) == p.smem_optin_bytes, p.name


def test_a_lane_without_target_rules_needs_no_stub(lab_env, monkeypatch):
    from lab import preflight, registry
    lane = registry.get("sim", "gemm")
    monkeypatch.delattr(lane.module, "target_reason")
    assert lane.target_reason(dict(lane.module.DEFAULTS), "sm_90a") is None
    v = preflight.cheap_checks(lane, None, dict(lane.module.DEFAULTS), {"M": 8, "N": 8, "K": 8, "dtype": "float32"},
                               PROFILES["h100"])
    assert v.feasible
    monkeypatch.setattr(lane.module, "target_reason", lambda c, t: f"not on {t}", raising=False)
    assert lane.target_reason({}, "sm_90a") == "not on sm_90a"
