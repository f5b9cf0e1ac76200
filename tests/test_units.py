"""Small units: device profiles and detection, spaces, parity, timing statistics, registry,
requested-vs-actual device rules, packaging pins."""
from __future__ import annotations

import re
import time
import tomllib
from pathlib import Path

import pytest
import torch

from lab.devices import LabError, PresentGPU


def test_every_profile_names_its_sources():
    from lab.devices import PROFILES
    for p in PROFILES.values():
        assert p.sources.get("smem") and p.sources.get("sms"), p.name


@pytest.mark.parametrize("name, profile", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                           ("NVIDIA GB10", "gb10"), ("NVIDIA GeForce RTX 5090", "rtx5090"),
                                           ("NVIDIA B200", "b200"), ("NVIDIA A100-SXM4-80GB", None)])
def test_match_profile(name, profile):
    from lab.devices import match_profile
    assert match_profile(name) == profile


def test_resolve_mode_rules():
    from lab.sweep import resolve_mode
    h100 = PresentGPU("NVIDIA H100 80GB HBM3", (9, 0), 132, 50 << 20, "h100")
    m = resolve_mode("h100", h100, False, False)
    assert not m.emulated and m.run_target == "sm_90a"
    with pytest.raises(LabError, match="--emulate"):
        resolve_mode("gb10", h100, False, False)
    m = resolve_mode("gb10", h100, True, False)
    assert m.emulated and m.requested.smem_optin_bytes == 101_376 and m.run_target == "sm_90a"
    assert m.run_profile.name == "h100"
    m = resolve_mode("gb10", None, False, True)
    assert m.compile_only and m.run_target is None
    with pytest.raises(LabError, match="no GPU"):
        resolve_mode("h100", None, False, False)


def test_space_rules_and_errors(tmp_path):
    from lab.space import Space
    s = Space({"A": [1, 2, 4], "B": [8, 16]}, ["A * B <= 32", "not (A == 1 and B == 16)"], "t")
    allowed = [c for c in s.configs() if s.rule_reason(c) is None]
    assert s.size == 6 and len(allowed) == 4
    assert s.rule_reason({"A": 4, "B": 16}) == "restriction: A * B <= 32"
    with pytest.raises(LabError, match="unknown param"):
        Space({"A": [1]}, ["C > 1"], "t")
    with pytest.raises(LabError, match="calls a function"):
        Space({"A": [1]}, ["open('x')"], "t")
    with pytest.raises(LabError, match="uses Attribute"):
        Space({"A": [1]}, ["A.__class__"], "t")
    import pickle
    assert pickle.loads(pickle.dumps(s)).rule_reason({"A": 4, "B": 16})


def test_space_scan_samples_a_huge_space_without_enumerating_it():
    """A space of 10^12 points: the seeds first, then SCAN_LIMIT distinct random points, in well under a
    second (the sweep start once counted every point: 4.6e9 of them for the cuTile m2rnn_bwd file); a small
    space is enumerated whole, seeds not repeated."""
    import time
    from lab.space import SCAN_LIMIT, Space, config_key
    seed = {f"P{i}": 0 for i in range(12)}
    huge = Space({f"P{i}": list(range(10)) for i in range(12)}, [], "t", [seed])
    t0 = time.perf_counter()
    got, exhaustive = huge.scan()
    assert time.perf_counter() - t0 < 5
    assert not exhaustive and got[0] == seed and len(got) == SCAN_LIMIT + 1
    assert len({config_key(c) for c in got}) == len(got)
    assert huge.scan(seed=3)[0][1:5] != huge.scan(seed=4)[0][1:5] and huge.scan(seed=3) == huge.scan(seed=3)
    small = Space({"A": [1, 2, 4], "B": [8, 16]}, [], "t", [{"A": 2, "B": 16}])
    got, exhaustive = small.scan()
    assert exhaustive and got[0] == {"A": 2, "B": 16} and len(got) == 6
    assert sorted(map(config_key, got)) == sorted(map(config_key, small.configs()))


def test_parity_nan_and_tolerance():
    from lab.parity import compare, output_error
    from lab.problems import Tolerance
    ref = torch.randn(16, 16, dtype=torch.float64)
    tol = Tolerance(1e-3, 1e-3)
    ok, _ = compare({"c": ref.float()}, {"c": ref}, tol)
    assert ok
    bad = ref.clone()
    bad[3, 4] = float("nan")
    ok, errs = compare({"c": bad}, {"c": ref}, tol)
    assert not ok and errs["c"].nonfinite == 1
    e = output_error(ref * 1.01, ref)
    assert e.rel_l2 == pytest.approx(0.01, rel=1e-6) and e.rel_max == pytest.approx(0.01, rel=1e-6)


def test_gemm_problem_inputs_reference_and_counts():
    from lab.problems import get
    p = get("gemm")
    shape = {"M": 33, "N": 17, "K": 65, "dtype": "bfloat16"}
    a = p.make_inputs(shape, "cpu", 1)
    b = p.make_inputs(shape, "cpu", 1)
    c = p.make_inputs(shape, "cpu", 2)
    assert torch.equal(a["a"], b["a"]) and not torch.equal(a["a"], c["a"])
    assert a["a"].dtype == torch.bfloat16 and (a["a"] != 0).float().mean() > 0.99
    assert torch.isnan(p.alloc_outputs(shape, "cpu")["c"]).all()
    assert p.reference(a, shape)["c"].dtype == torch.float64
    assert p.flops(shape) == 2 * 33 * 17 * 65 and p.bytes_moved(shape) == (33 * 65 + 65 * 17 + 33 * 17) * 2
    with pytest.raises(LabError, match="dtype"):
        p.check_shape({"M": 1, "N": 1, "K": 1, "dtype": "int8"})


def test_median_ci_and_bench_on_cpu():
    from lab.timing import bench, median_ci, quartiles
    med, lo, hi = median_ci([float(x) for x in range(1, 102)])
    assert med == 51 and lo < 51 < hi
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 4.0)
    t = bench(lambda: time.sleep(0.002), device="cpu", warmup_ms=1, budget_ms=500, rel_ci=0.05)
    assert 1.9 <= t.median_ms <= 6 and t.n >= 10 and t.stop in ("converged", "budget", "max_samples")
    assert t.q1_ms <= t.median_ms <= t.q3_ms


def test_interleaved_timing_alternates_the_order_of_each_round():
    from lab.timing import bench_interleaved
    calls = []
    fns = [lambda: calls.append("A"), lambda: calls.append("B")]
    out = bench_interleaved(fns, device="cpu", warmup_ms=0, min_samples=6, max_samples=6, min_time_ms=0)
    rounds = ["".join(calls[i:i + 2]) for i in range(2, 14, 2)]  # after one warm-up call each
    assert rounds == ["AB", "BA", "AB", "BA", "AB", "BA"]
    assert len(out[0].samples_ms) == len(out[1].samples_ms) >= 6


def test_each_call_gets_a_head_start_sized_by_its_host_time(monkeypatch):
    """The GPU spin before a sample covers twice the call's host (launch) time from the warm-up, within
    its bounds: a host-bound call (a Python reference) gets a longer one than a few launches do."""
    from lab import timing
    seen = {}

    class Recorder(timing._Clock):
        def sample(self, flush, fn, headstart=timing.HEADSTART_CYCLES):
            seen.setdefault(fn, set()).add(headstart)
            return super().sample(flush, fn, headstart)

    monkeypatch.setattr(timing, "_Clock", Recorder)
    fast, slow = (lambda: None), (lambda: time.sleep(0.004))
    timing.bench_interleaved([fast, slow], device="cpu", warmup_ms=20, min_samples=4, max_samples=4, min_time_ms=0)
    assert seen[fast] == {timing.HEADSTART_CYCLES}
    (cycles,) = seen[slow]
    assert 2 * 4 * timing.CYCLES_PER_MS <= cycles <= 2 * 12 * timing.CYCLES_PER_MS
    assert timing.headstart_cycles(1e6) == timing.MAX_HEADSTART_CYCLES


def test_registry_typed_eligibility(lab_env):
    from lab import registry
    table = registry.eligibility_table("gemm", "sm_75")
    assert table["triton"].code == "ineligible" and "sm_75" in table["triton"].reason
    assert table["sim"].code == "ineligible" and table["torch"].ok
    lane = registry.get("triton", "gemm")
    with pytest.raises(LabError, match="unknown config key 'BLOCKM'"):
        lane.full_config({"BLOCKM": 64})
    with pytest.raises(LabError, match="unknown DSL"):
        registry.get("cobol", "gemm")


def test_unimportable_lane_is_unavailable_not_hidden(lab_env, tmp_path, monkeypatch):
    pkg = tmp_path / "brokenlanes" / "ghost"
    pkg.mkdir(parents=True)
    (tmp_path / "brokenlanes" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "gemm.py").write_text("import a_dsl_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("LAB_KERNEL_PACKAGES", "tests.fake_lanes,brokenlanes")
    from lab import registry
    registry._LANES.clear()
    e = registry.eligibility_table("gemm", "sm_90a")["ghost"]
    assert e.code == "unavailable" and "a_dsl_that_is_not_installed" in e.reason


def test_gpu_extra_equals_shared_requirements():
    root = Path(__file__).resolve().parent.parent
    req = root.parent / "shared" / "gpu" / "requirements-gpu.txt"
    if not req.exists():
        pytest.skip(f"{req} not beside this checkout")
    pins = sorted(l.strip() for l in req.read_text().splitlines() if l.strip() and not l.startswith("#"))
    extra = sorted(tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"])
    assert extra == pins
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-\[\]]+==[0-9][0-9A-Za-z.]*", p) for p in extra)
