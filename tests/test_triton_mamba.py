"""The Triton bwd_bwd lane: the harness's parity path under TRITON_INTERPRET=1 at small fp16 shapes (the
interpreter's bf16 dot is broken), typed refusals, ahead-of-time compiles for sm_90a / sm_121a, and the
shared-memory estimate against those compiles."""
from __future__ import annotations

import itertools
import json
import os
import random
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
# A config of the sweep space with the largest tiles (VALUE_BJ = 32 at C*R = 64) that takes estimate
# branches the seeds do not: KEY_BJ = 32, three scan stages, two chunk stages, a 4-warp value side.
# _fit cuts the blocks to the shape.
NEAR_GB10 = {"SCAN_BJ": 32, "SCAN_BP": 64, "scan_warps": 4, "scan_stages": 3, "KEY_BJ": 32, "KEY_BP": 16,
             "key_warps": 8, "VALUE_BJ": 32, "BLOCK_P": 32, "chunk_warps": 4, "chunk_stages": 2}

BASE = {"B": 1, "S": 12, "H": 2, "G": 1, "N": 32, "P": 16, "R": 4, "C": 4, "rd": 4, "hasZ": True, "hasD": True,
        "reduceO": True, "dtype": "float16"}
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
    steps, three or more chunks."""
    cases = [(BASE, SMALL),                                                               # R=4, 3 chunks
             ({**BASE, "R": 1, "C": 16, "S": 64, "P": 32, "hasD": False},                # R=1, 4 chunks, 2 P steps
              {**SMALL, "scan_stages": 1, "chunk_stages": 2}),
             ({**BASE, "G": 2, "H": 4, "N": 64, "R": 2, "C": 8, "S": 24, "rd": 2, "hasZ": False, "hasD": False,
               "reduceO": False}, {**SMALL, "SCAN_BJ": 16, "SCAN_BP": 16})]               # GQA, 2 x 1 scan tiles
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
    ({"SCAN_BJ": 32}, "SCAN_BJ=32"),          # N/2 = 16
    ({"BLOCK_P": 64}, "BLOCK_P=64"),          # P = 16
    ({"chunk_warps": 3}, "chunk_warps=3"),
    ({"scan_stages": 0}, "scan_stages=0"),
])
def test_configs_that_do_not_fit_the_shape_are_refused(config, msg):
    """Refused by the lane (what depends on the shape) or, for a value the sweep file does not list, by
    the harness's check of the file (``harness_reason``)."""
    cfg = {**SMALL, **config}
    assert msg in (lane.config_reason(cfg, BASE) or "") or msg in (harness_reason("mamba_bwd_bwd", "triton", cfg, BASE) or "")
    assert lane.eligibility("sm_75") and lane.eligibility("sm_121a") is None


@pytest.mark.parametrize("target,shape", [("sm_121a", n) for n in ("h100_tuned", "anchor_b2", "training", "gb10")]
                         + [("sm_90a", "h100_tuned")])
def test_compiles_within_the_gb10_limit(target, shape, compiled):
    """Every default shape has a config (the sweep file's first seed) whose four kernels compile for
    sm_121a within GB10's 101,376 B, and for sm_90a."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    seed = SPACE.seeds[0]
    assert lane.config_reason(seed, sh) is None
    res = compiled(lane, seed, sh, target)
    assert set(res["kernels"]) == {"scan", "key", "value", "reduce"}
    assert 0 < res["smem_bytes"] <= GB10_LIMIT, res


@pytest.mark.parametrize("knob,bad,good", [("KEY_BP", 64, 32), ("key_warps", 4, 8), ("BLOCK_P", 64, 32)])
def test_the_values_that_failed_on_the_gpu_are_refused(knob, bad, good):
    """Values that computed wrong or faulted on sm_90a (sweeps/mamba_bwd_bwd/triton.toml, header) are out
    of the sweep file, so a sweep never proposes them and `--config` refuses them; at a shape they fit."""
    sh = space.get_shape("mamba_bwd_bwd", "training")
    cfg = {**lane.DEFAULTS, "VALUE_BJ": 32}
    assert lane.config_reason({**cfg, knob: bad}, sh) is None
    assert f"{knob}={bad}" in (harness_reason("mamba_bwd_bwd", "triton", {**cfg, knob: bad}, sh) or "")
    assert harness_reason("mamba_bwd_bwd", "triton", {**cfg, knob: good}, sh) is None


def _fit(config: dict, shape: dict) -> dict:
    """Blocks no larger than N/2."""
    nh = shape["N"] // 2
    return {**config, **{k: min(config[k], nh) for k in ("SCAN_BJ", "KEY_BJ", "VALUE_BJ")}}


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


def _config(which: str, shape: dict) -> dict:
    return {"seed0": SPACE.seeds[0], "seed1": SPACE.seeds[1], "near_gb10": _fit(NEAR_GB10, shape)}[which]


# Every named shape x target x (both seeds, the GB10-fitting config) is a case; the default run keeps
# those whose compile another test shares (test_compiles_within_the_gb10_limit: seed0) and one case per
# estimate branch the others leave out: the near-limit config on both targets, seed1 (scan stages 3,
# 2 warps, BLOCK_P 16), C*R = 32, N = 32 (one-step N loops), C = 64, the options off (gqa). The rest
# repeat those paths at more shapes (slow).
_DEFAULT_CASES = {("h100_tuned", "sm_121a", "seed0"), ("anchor_b2", "sm_121a", "seed0"),
                  ("training", "sm_121a", "seed0"), ("gb10", "sm_121a", "seed0"), ("h100_tuned", "sm_90a", "seed0"),
                  ("h100_tuned", "sm_121a", "near_gb10"), ("h100_tuned", "sm_90a", "near_gb10"),
                  ("h100_tuned", "sm_121a", "seed1"), ("gqa_plain_rd2", "sm_90a", "seed1"),
                  ("grid_n128_p128_r4_c8", "sm_90a", "seed0"), ("grid_n32_p64_r4_c16", "sm_90a", "seed0"),
                  ("grid_n128_p64_r1_c64", "sm_90a", "seed0")}


def _scan_bound_may_top(config: dict, shape: str, target: str) -> bool:
    """Where the scan's bound may give the largest figure at a named shape (smem_estimate)."""
    return ((config["SCAN_BP"] >= 64 or config["scan_stages"] == 1)
            and (target != "sm_90a" or shape in ("grid_n128_p128_r4_c8", "training")))


SCAN_KEYS = ("SCAN_BJ", "SCAN_BP", "scan_warps", "scan_stages")
# The value side's tunables, and KEY_BJ, which sets the value kernel's NBJ.
VALUE_KEYS = ("VALUE_BJ", "BLOCK_P", "chunk_warps", "chunk_stages", "KEY_BJ")


def _tiles(shape: dict, keys: tuple):
    """Configs over the sweep's values of ``keys`` (the lane's defaults elsewhere) that fit the shape
    and the sweep's rule."""
    for values in itertools.product(*(SPACE.params[k] for k in keys)):
        config = {**lane.DEFAULTS, **dict(zip(keys, values))}
        if lane.config_reason(config, shape) is None and SPACE.rule_reason(config) is None:
            yield config


def _kernel_smem(name: str, config: dict, shape: dict, target: str) -> tuple[int, int]:
    """(estimate, compiled) shared memory of one kernel, compiled alone."""
    return (lane.smem_kernels(config, shape, target)[name],
            lane.compile_kernel(name, config, shape, target)["smem_bytes"])


def test_the_scan_bound_tops_the_estimate_only_where_documented():
    """Over the scan tunables of the sweep (the other kernels' from both seeds and the near-limit
    config) at every named shape: where the scan's figure is a bound and the largest, the scan has
    SCAN_BP >= 64 or one stage (on sm_90a only at grid_n128_p128_r4_c8 and training), and never on
    sm_90a's wgmma path (SCAN_BJ = 64, 4+ warps) with 2+ stages."""
    for name in NAMED:
        sh = space.get_shape("mamba_bwd_bwd", name)
        rest = [_config(which, sh) for which in ("seed0", "seed1", "near_gb10")]
        for scan, other, target in itertools.product(_tiles(sh, SCAN_KEYS), rest, TARGETS):
            config = {**other, **{k: scan[k] for k in SCAN_KEYS}}
            bound = lane.smem_inexact(config, sh, target)
            if target == "sm_90a" and config["SCAN_BJ"] == 64 and config["scan_warps"] >= 4 and config["scan_stages"] > 1:
                assert "scan" not in bound, (name, config)
            est = lane.smem_kernels(config, sh, target)
            top = max(est, key=est.get)
            assert top not in bound or (top == "scan" and _scan_bound_may_top(config, name, target)), (name, target, config, est)


# sm_90a's wgmma path (SCAN_BJ = 64, 4+ warps), 2+ stages: exp(DA) dy's operand plus the larger of the
# q_hat^T operand and the dS tile's conversion. shape, (SCAN_BP, scan_warps, scan_stages).
_SCAN_WGMMA_CASES = [
    ("grid_n128_p128_r4_c8", (128, 8, 2)),   # SCAN_BJ > C*R, the dS conversion decides (was 4 KB under)
    ("grid_n128_p128_r4_c8", (16, 4, 3)),    # SCAN_BJ > C*R, the q_hat^T operand decides
    ("h100_tuned", (32, 4, 2)),              # C*R = 16
]


@pytest.mark.parametrize("shape,tile", _SCAN_WGMMA_CASES)
def test_scan_smem_on_wgmma_is_the_compilers(shape, tile):
    """The scan compiled alone for sm_90a on the wgmma path: its shared memory is smem_kernels' figure."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    config = {**lane.DEFAULTS, "SCAN_BJ": 64, **dict(zip(("SCAN_BP", "scan_warps", "scan_stages"), tile))}
    assert lane.config_reason(config, sh) is None and SPACE.rule_reason(config) is None
    assert "scan" not in lane.smem_inexact(config, sh, "sm_90a")
    est, got = _kernel_smem("scan", config, sh, "sm_90a")
    assert est == got, (shape, config, est, got)


@pytest.mark.slow
@pytest.mark.parametrize("shape,target", list(itertools.product(NAMED, TARGETS)))
def test_scan_smem_with_stages_for_every_scan_tile(shape, target):
    """With 2+ stages the scan's figure is the compiler's for every scan tile of the sweep at every
    named shape, both targets, or an upper bound where smem_inexact names the scan."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    wrong = []
    for config in _tiles(sh, SCAN_KEYS):
        if config["scan_stages"] == 1:
            continue
        est, got = _kernel_smem("scan", config, sh, target)
        if not (est >= got if "scan" in lane.smem_inexact(config, sh, target) else est == got):
            wrong.append((config, est, got))
    assert not wrong, wrong


@pytest.mark.parametrize("shape,target,which", [
    pytest.param(*case, marks=() if case in _DEFAULT_CASES else pytest.mark.slow)
    for case in itertools.product(NAMED, TARGETS, ("seed0", "seed1", "near_gb10"))])
def test_smem_estimate_equals_the_compiler(shape, target, which, compiled):
    """Issue 22: the preflight's estimate is the compiler's figure (compile_for, Triton AOT) at every
    named shape for sm_90a and sm_121a: the sweep's seeds, and a config close to GB10's limit that
    compiles within it."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    config = _config(which, sh)
    assert lane.config_reason(config, sh) is None and SPACE.rule_reason(config) is None
    res = compiled(lane, config, sh, target)
    _check_estimate(config, sh, target, res)
    est = lane.smem_kernels(config, sh, target)
    top = max(est, key=est.get)
    # The only bound (smem_estimate) that may give the largest figure at a named shape: the scan's
    # (SCAN_BP >= 64 or one stage; on sm_90a only at grid_n128_p128_r4_c8 and training). The value
    # side's figure is exact at every named shape.
    assert top not in lane.smem_inexact(config, sh, target) or _scan_bound_may_top(config, shape, target), (config, est)
    if which == "near_gb10":
        assert res["smem_bytes"] <= GB10_LIMIT, res


@pytest.mark.parametrize("target", ["sm_90a", pytest.param("sm_121a", marks=pytest.mark.slow)])
def test_smem_estimate_on_random_configs(target, compiled):
    """A seeded sample of the sweep space at gb10's shape: exact, or an upper bound where the lane says so."""
    sh = space.get_shape("mamba_bwd_bwd", "gb10")
    rng = random.Random(22)
    picked = []
    while len(picked) < 3:
        config = {k: rng.choice(v) for k, v in SPACE.params.items()}
        if lane.config_reason(config, sh) is None and SPACE.rule_reason(config) is None:
            picked.append(config)
    for config in picked:
        _check_estimate(config, sh, target, compiled(lane, config, sh, target))


def test_the_value_side_is_exact_at_every_named_shape():
    """smem_kernels gives the value side's figure as exact (smem_inexact leaves it out) for every
    value-side tile of the sweep at every named shape on both targets; the compiles below check it."""
    for name in NAMED:
        sh = space.get_shape("mamba_bwd_bwd", name)
        for config in _tiles(sh, VALUE_KEYS):
            for target in TARGETS:
                assert "value" not in lane.smem_inexact(config, sh, target), (name, config, target)


# One case per branch and term of the value side's model (smem_kernels), where that term gives the
# figure: shape, target, (VALUE_BJ, BLOCK_P, chunk_warps, chunk_stages).
_VALUE_CASES = [
    ("h100_tuned", "sm_90a", (16, 32, 16, 1)),             # split wgmma: khds' conversion, 512 B a warp
    ("grid_n128_p64_r8_c8", "sm_90a", (16, 32, 8, 1)),     # split wgmma: dpsiv's conversion (R = 8)
    ("gb10", "sm_90a", (32, 32, 8, 2)),                    # split wgmma, one-step N loops: cp.async buffers
    ("h100_tuned", "sm_90a", (16, 32, 4, 1)),              # 4-warp wgmma: dpsiv's conversion
    ("grid_n128_p64_r1_c64", "sm_90a", (16, 16, 4, 1)),    # 4-warp wgmma, R = 1: an fp32 [F, F] conversion
    ("gb10", "sm_90a", (32, 16, 4, 2)),                    # 4-warp wgmma, one step: buffers, no dpsiv conversion
    ("h100_tuned", "sm_121a", (32, 16, 8, 1)),             # mma.sync: k_hat and q_hat tiles
    ("grid_n128_p128_r4_c8", "sm_90a", (16, 32, 4, 1)),    # mma.sync on sm_90a (C*R = 32): dpsiv's conversion
    ("gqa_plain_rd2", "sm_121a", (16, 32, 8, 1)),          # mma.sync, unreduced DOUT: dy staged
    ("gqa_plain_rd2", "sm_121a", (32, 32, 8, 2)),          # mma.sync, one step, unreduced DOUT
    ("grid_n32_p64_r4_c16", "sm_121a", (16, 32, 4, 2)),    # mma.sync, one step: tiles and buffers
]


@pytest.mark.parametrize("shape,target,tile", _VALUE_CASES)
def test_value_smem_is_the_compilers(shape, target, tile):
    """The value kernel compiled alone: its shared memory is smem_kernels' figure."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    config = {**lane.DEFAULTS, **dict(zip(("VALUE_BJ", "BLOCK_P", "chunk_warps", "chunk_stages"), tile))}
    assert lane.config_reason(config, sh) is None
    est, got = _kernel_smem("value", config, sh, target)
    assert est == got, (shape, target, config, est, got)


@pytest.mark.slow
@pytest.mark.parametrize("shape,target", list(itertools.product(NAMED, TARGETS)))
def test_value_smem_is_the_compilers_for_every_value_tile(shape, target):
    """The value side's figure equals the compiler's for every value-side tile of the sweep (and both
    KEY_BJ) at every named shape, both targets."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    wrong = []
    for config in _tiles(sh, VALUE_KEYS):
        est, got = _kernel_smem("value", config, sh, target)
        if est != got:
            wrong.append((config, est, got))
    assert not wrong, wrong
