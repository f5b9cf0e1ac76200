"""The Triton bwd_bwd lane: the harness's parity path under TRITON_INTERPRET=1 at small fp16 shapes (the
interpreter's bf16 dot is broken), typed refusals, ahead-of-time compiles for sm_90a / sm_121a, and the
shared-memory estimate against those compiles."""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab import space
from kernels.triton import mamba_bwd_bwd as lane
from tests.test_space_values import harness_reason

ROOT = str(Path(__file__).resolve().parent.parent)
GB10_LIMIT = 101_376
TARGETS = ("sm_90a", "sm_121a")
NAMED = list(space.load_shapes("mamba_bwd_bwd")[0])
SPACE = space.load_space("mamba_bwd_bwd", "triton", lane.TUNABLES)

BASE = {"B": 1, "S": 12, "H": 2, "G": 1, "N": 32, "P": 16, "R": 4, "C": 4, "rd": 4, "hasZ": True, "hasD": True,
        "reduceO": True, "dtype": "float16"}
# Blocks of 16, below the sweep file's (the lane takes any power of two >= 16 that fits): several scan
# tiles and P steps at the interpreter's small shapes.
SMALL = {"SCAN_BJ": 16, "SCAN_BP": 16, "KEY_BP": 16, "BLOCK_P": 16}

_INTERPRET = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from lab.worker import execute
    out = []
    for shape, cfg in json.loads(sys.argv[2]):
        r = execute({"kind": "trial", "kernel": "mamba_bwd_bwd", "dsl": "triton", "config": cfg, "shape": shape,
                     "seed": 3, "device": "cpu", "no_timing": True})
        out.append({k: r.get(k) for k in ("status", "error", "parity_rel_l2", "parity", "parity_shapes")})
    print("RESULT " + json.dumps(out))
""")


def test_interpreter_parity_through_the_harness():
    """Every output against reference (2) at the timed shape and the problem's parity shape (B=1, three
    chunks, odd head count): R=4 and R=1, GQA with every option off and rd=2, several scan tiles and P
    steps, three or more chunks, the scan in segments of one chunk (three) and of two (two); each with the
    split chunk kernels and with the fused one. dy_prep (_prep's dy loaded by the chunk kernels): R=4 with
    every option on, split; R=1 with GQA and every option off, fused; three chunks each."""
    cases = [(BASE, {**SMALL, "scan_segments": 4}),                                     # R=4, 3 chunks, 3 segments
             ({**BASE, "R": 1, "C": 16, "S": 64, "P": 32, "hasD": False},
              {**SMALL, "scan_segments": 2}),                                            # R=1, 4 chunks, 2 P steps
             ({**BASE, "G": 2, "H": 4, "N": 64, "R": 2, "C": 8, "S": 24, "rd": 2, "hasZ": False, "hasD": False,
               "reduceO": False}, {**SMALL, "SCAN_BJ": 16, "SCAN_BP": 16})]               # GQA, 2 x 1 scan tiles
    # The fused chunk kernel (fused_chunk) on the same three shapes.
    cases += [(shape, {**config, "fused_chunk": True}) for shape, config in cases]
    cases += [(BASE, {**SMALL, "dy_prep": True}),
              ({**cases[2][0], "R": 1, "C": 16, "S": 48}, {**SMALL, "dy_prep": True, "fused_chunk": True})]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", _INTERPRET, ROOT, json.dumps(cases)], env=env, capture_output=True,
                       text=True, timeout=900)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    for case, r in zip(cases, json.loads(line[0][7:])):
        assert r["status"] == "ok", (case, r)
        assert r["parity_shapes"] and len(r["parity_shapes"]) >= 2, r
        assert r["parity_rel_l2"] < 2e-3, (case, r)
        assert set(r["parity"]) >= {"DQ", "DK", "DV", "DMIMO_V", "DANGLES", "DSSDA", "DDA"}, r


@pytest.mark.parametrize("change,msg", [
    ({"N": 16}, "N/2 a power of two >= 16"),
    ({"C": 4, "R": 2}, "C*R >= 16"),
    ({"P": 48}, "P=48"),
])
def test_shapes_the_lane_cannot_take_are_refused(change, msg):
    assert msg in (lane.config_reason(SMALL, {**BASE, **change}) or "")


@pytest.mark.parametrize("config,msg", [
    ({"VALUE_BJ": 32}, "VALUE_BJ=32"),        # N/2 = 16
    ({"SCAN_BP": 128}, "SCAN_BP=128"),        # P = 16
    ({"chunk_warps": 3}, "chunk_warps=3"),
    ({"scan_stages": 0}, "scan_stages=0"),
])
def test_configs_that_do_not_fit_the_shape_are_refused(config, msg):
    """Refused by the lane (what depends on the shape) or, for a value the sweep file does not list, by
    the harness's check of the file (``harness_reason``, on the lane's defaults)."""
    lane_says = lane.config_reason({**SMALL, **config}, BASE) or ""
    assert msg in lane_says or msg in (harness_reason("mamba_bwd_bwd", "triton", {**lane.DEFAULTS, **config}, BASE) or "")
    assert lane.eligibility("sm_75") and lane.eligibility("sm_121a") is None


@pytest.mark.parametrize("target,shape", [("sm_121a", n) for n in ("h100_tuned", "anchor_b2", "training", "gb10")]
                         + [("sm_90a", "h100_tuned")])
def test_compiles_within_the_gb10_limit(target, shape, compiled):
    """Every default shape has a config (the sweep file's first seed, dy_prep) whose six kernels compile
    for sm_121a within GB10's 101,376 B, and for sm_90a."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    seed = SPACE.seeds[0]
    assert lane.config_reason(seed, sh) is None
    res = compiled(lane, seed, sh, target)
    assert set(res["kernels"]) == {"prep", "angles", "scan", "key", "value", "reduce"}
    assert 0 < res["smem_bytes"] <= GB10_LIMIT, res


@pytest.mark.parametrize("knob,bad,good", [("KEY_BP", 64, 32), ("key_warps", 4, 8), ("BLOCK_P", 64, 32)])
def test_the_values_that_failed_on_the_gpu_are_refused(knob, bad, good):
    """Values that computed wrong or faulted on sm_90a (sweeps/mamba_bwd_bwd/triton.toml, header) are out
    of the sweep file (BLOCK_P = 64: out of the split kernels' configs, by a rule), so a sweep never
    proposes them and `--config` refuses them; at a shape they fit."""
    sh = space.get_shape("mamba_bwd_bwd", "training")
    cfg = {**lane.DEFAULTS, "VALUE_BJ": 32}
    assert lane.config_reason({**cfg, knob: bad}, sh) is None
    why = harness_reason("mamba_bwd_bwd", "triton", {**cfg, knob: bad}, sh) or ""
    assert f"{knob}={bad}" in why or (why.startswith("restriction") and knob in why), why
    assert harness_reason("mamba_bwd_bwd", "triton", {**cfg, knob: good}, sh) is None


def _space_configs(shape: dict) -> list[dict]:
    """Every config of the sweep space (a few: it is listed whole) that fits the shape."""
    return [c for c in SPACE.configs() if lane.config_reason(c, shape) is None and SPACE.rule_reason(c) is None]


def _check_estimate(config: dict, shape: dict, target: str, res: dict):
    """Each kernel's estimate equals its compiled shared memory, or bounds it from above where the lane
    says its figure is an upper bound; the preflight's figure (the largest) likewise."""
    got = {k: v["smem_bytes"] for k, v in res["kernels"].items()}
    est = lane.smem_kernels(config, shape, target)
    bound = lane.smem_inexact(config, shape, target)
    for k in got:
        assert est[k] >= got[k] if k in bound else est[k] == got[k], (k, config, est, got, target)
    top = max(est, key=est.get)
    total = lane.smem_estimate(config, shape, target)
    assert total >= res["smem_bytes"] if top in bound else total == res["smem_bytes"], (config, est, got)


def test_every_named_shape_has_configs_that_fit_gb10():
    """Every named shape takes a config of the sweep space, and every config that fits the shape is
    estimated within GB10's 101,376 B for sm_121a (the estimate is the compiler's figure or above it)."""
    for name in NAMED:
        sh = space.get_shape("mamba_bwd_bwd", name)
        configs = _space_configs(sh)
        assert configs, name
        for config in configs:
            assert lane.smem_estimate(config, sh, "sm_121a") <= GB10_LIMIT, (name, config)


def test_the_scan_bound_tops_the_estimate_only_where_documented():
    """Over the sweep space at every named shape, both targets: the only bounds (smem_inexact) that give
    the largest figure are the fused chunk kernel's (smem_kernels) and the scan's with SCAN_BP = 128, at
    grid_n128_p128_r4_c8 (smem_estimate) and on sm_121a at training, where the bound is the compiler's
    figure (12,548 B, checked by test_smem_estimate_equals_the_compiler)."""
    for name in NAMED:
        sh = space.get_shape("mamba_bwd_bwd", name)
        for config, target in itertools.product(_space_configs(sh), TARGETS):
            est = lane.smem_kernels(config, sh, target)
            top = max(est, key=est.get)
            documented = (top == "scan" and config["SCAN_BP"] == 128 and (
                name == "grid_n128_p128_r4_c8" or (name, target) == ("training", "sm_121a"))) or (
                top == "chunk" and config["fused_chunk"])
            assert top not in lane.smem_inexact(config, sh, target) or documented, (name, target, config, est)


def test_the_value_side_is_exact_at_every_named_shape():
    """smem_kernels gives the value side's figure as exact (smem_inexact leaves it out) for every config
    of the sweep space at every named shape on both targets; the compiles below check it."""
    for name in NAMED:
        sh = space.get_shape("mamba_bwd_bwd", name)
        for config, target in itertools.product(_space_configs(sh), TARGETS):
            assert "value" not in lane.smem_inexact(config, sh, target), (name, config, target)


# Every named shape x target is a case (each compiles every config of the space that fits); the
# default run keeps the four default shapes on sm_121a (GB10) and one case for each term of the model
# (smem_kernels) that gives a kernel's figure and the others leave out: sm_90a's split wgmma (h100_tuned,
# with the value side's N loops of two VALUE_BJ = 32 steps; training, with one-step N loops and the
# scan's SCAN_BP = 128 bound), C*R = 32 on sm_90a (mma.sync key side, where the scan's bound tops the
# estimate), the scan's R = 8 stage and R = 1 bound, one-step N loops at N = 32 on both targets (the
# fp32 [F, F] conversion on sm_90a, the half tiles beside dy on sm_121a), and no D with unreduced DOUT and
# no Z (gqa). The rest repeat those terms at more shapes (slow). dy_prep's configs are compiled at gb10
# and training (_DY_PREP_SHAPES, both targets: its terms in smem_kernels on wgmma and mma.sync, split and
# fused); elsewhere only the estimate's tests above take them.
_DEFAULT_CASES = {("h100_tuned", "sm_121a"), ("anchor_b2", "sm_121a"), ("training", "sm_121a"), ("gb10", "sm_121a"),
                  ("h100_tuned", "sm_90a"), ("training", "sm_90a"), ("grid_n128_p128_r4_c8", "sm_90a"),
                  ("grid_n128_p64_r8_c8", "sm_90a"), ("grid_n128_p64_r1_c64", "sm_121a"),
                  ("grid_n32_p64_r4_c16", "sm_90a"), ("grid_n32_p64_r4_c16", "sm_121a"), ("gqa_plain_rd2", "sm_121a"),
                  ("gb10", "sm_90a")}
_DY_PREP_SHAPES = ("gb10", "training")


@pytest.mark.parametrize("shape,target", [
    pytest.param(*case, marks=() if case in _DEFAULT_CASES else pytest.mark.slow)
    for case in itertools.product(NAMED, TARGETS)])
def test_smem_estimate_equals_the_compiler(shape, target, compiled):
    """Issue 22: the preflight's estimate is the compiler's figure (compile_for, Triton AOT), or an upper
    bound where the lane says so, for every config of the sweep space at every named shape (dy_prep's at
    _DY_PREP_SHAPES), sm_90a and sm_121a; for sm_121a each compiles within GB10's limit."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    configs = [c for c in _space_configs(sh) if not c["dy_prep"] or shape in _DY_PREP_SHAPES]
    assert configs
    for config in configs:
        res = compiled(lane, config, sh, target)
        _check_estimate(config, sh, target, res)
        if target == "sm_121a":
            assert res["smem_bytes"] <= GB10_LIMIT, (config, res)
