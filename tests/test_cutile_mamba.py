"""The cuTile mamba_bwd_bwd lane on the CPU: ahead-of-time compiles (tileiras) of its four kernels for
sm_90a and sm_121a at the named shapes (shared memory within sm_121a's 101,376 B), its refusals, and
its kernel bodies run on torch through the shared stand-in for ``cuda.tile`` (tests/cutile_standin.py)
against the problem's reference, compared as the harness compares (lab/parity.py, the problem's bands)."""
from __future__ import annotations

import pytest
import torch

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.cutile import mamba_bwd_bwd as lane
from lab import parity, space
from lab.problems.mamba_bwd_bwd import PROBLEM
from tests import cutile_standin as standin
from tests.test_space_values import harness_reason

D = lane.DEFAULTS
_LIMIT = {"sm_90a": 232_448, "sm_121a": 101_376}


def _shape(name):
    return space.get_shape("mamba_bwd_bwd", name)


# ---- AOT compiles -------------------------------------------------------------------------------

NAMED = ["h100_tuned", "anchor_b2", "training", "gb10", "grid_n32_p64_r4_c16", "grid_n128_p128_r4_c8",
         "grid_n128_p64_r8_c8", "grid_n128_p64_r2_c32", "grid_n128_p64_r1_c64", "gqa_plain_rd2"]


def test_named_shapes_are_the_sweep_files():
    import tomllib
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "sweeps" / "mamba_bwd_bwd" / "shapes.toml").read_text()
    assert sorted(tomllib.loads(text)["shapes"]) == sorted(NAMED)


def _check(got, config, shape, target):
    assert got["binary"] == "cubin" and got["compile_s"] > 0
    assert set(got["kernels"]) == set(lane.KERNELS)
    assert 0 < got["smem_bytes"] <= lane.smem_estimate(config, shape, target) <= _LIMIT[target], got
    assert got["registers"] and got["registers"] <= 255, got


# One compile of the four kernels takes 20-400 s of tileiras per shape and target on a 2-core CPU (the
# value side at N = P = 128, C = 8 the longest), so the default run compiles the GB10 shape and the
# options-off GQA shape (rd = 2, unreduced DOUT) for both targets; the other compiles are marked slow (python -m pytest -m slow tests/test_cutile_mamba.py). Every compile checks the
# lane's SMEM table, which holds the figures of all of them.
_DEFAULT_COMPILES = {("gb10", "sm_121a"), ("gb10", "sm_90a"), ("gqa_plain_rd2", "sm_121a"),
                     ("gqa_plain_rd2", "sm_90a")}


def _compile_cases():
    for name in NAMED:
        for target in ("sm_121a", "sm_90a"):
            yield pytest.param(name, target, id=f"{name}-{target}",
                               marks=[] if (name, target) in _DEFAULT_COMPILES else [pytest.mark.slow])


@pytest.mark.parametrize("name,target", list(_compile_cases()))
def test_named_shape_compiles(name, target, compiled):
    shape = _shape(name)
    config = lane.seed_for(shape)
    assert lane.config_reason(config, shape) is None
    got = compiled(lane, config, shape, target)
    _check(got, config, shape, target)
    assert got["smem_bytes"] == lane.SMEM[name][target], (name, target, got["smem_bytes"])


@pytest.mark.parametrize("target", ["sm_121a", pytest.param("sm_90a", marks=pytest.mark.slow)])
def test_segmented_scan_compiles(target, compiled):
    """SCAN_SEGMENTS = 4 at the GB10 shape (16 chunks): the local scan pass is a fifth kernel, within the
    limits; the other kernels are the defaults' (the largest figure unchanged)."""
    shape = _shape("gb10")
    config = {**lane.seed_for(shape), "SCAN_SEGMENTS": 4}
    got = compiled(lane, config, shape, target)
    assert set(got["kernels"]) == {"scan_local", *lane.KERNELS}
    assert 0 < got["kernels"]["scan_local"]["smem_bytes"] <= got["kernels"]["scan"]["smem_bytes"]
    assert got["smem_bytes"] == lane.SMEM["gb10"][target] and got["registers"] <= 255, got


@pytest.mark.parametrize("target", ["sm_121a", pytest.param("sm_90a", marks=pytest.mark.slow)])
def test_scan_prep_compiles(target, compiled):
    """SCAN_PREP at the GB10 shape: the operand kernel is one more cubin, no larger than the scan it feeds,
    and every kernel is within the target's limit."""
    shape = _shape("gb10")
    config = {**lane.seed_for(shape), "SCAN_PREP": True, "prep_occupancy": 8}   # _prep's own occupancy hint
    got = compiled(lane, config, shape, target)
    assert set(got["kernels"]) == {"prep", *lane.KERNELS}
    assert got["kernels"]["prep"]["smem_bytes"] <= got["kernels"]["scan"]["smem_bytes"], got
    assert got["smem_bytes"] == max(k["smem_bytes"] for k in got["kernels"].values()), got
    assert got["smem_bytes"] <= _LIMIT[target], got
    assert got["registers"] <= 255, got


# VALUE_QK = "recompute": the value side builds q_hat, k_hat of the whole N itself (F x N/2 halves held over
# its P loop) and the key side stores none; the sm_121a figures are the ones to watch (101,376 B).
@pytest.mark.parametrize("name,target", [("gb10", "sm_121a"), ("training", "sm_121a"),
                                         pytest.param("gb10", "sm_90a", marks=pytest.mark.slow),
                                         pytest.param("training", "sm_90a", marks=pytest.mark.slow)])
def test_value_qk_recompute_compiles(name, target, compiled):
    shape = _shape(name)
    config = {**lane.seed_for(shape), "VALUE_QK": "recompute"}
    assert lane.config_reason(config, shape) is None
    got = compiled(lane, config, shape, target)
    _check(got, config, shape, target)
    assert got["smem_bytes"] <= _LIMIT[target], got


def test_every_named_shape_has_a_config_and_a_figure():
    for name in NAMED:
        shape = _shape(name)
        assert lane.config_reason(lane.seed_for(shape), shape) is None, name
        assert lane.SMEM[name]["sm_121a"] <= _LIMIT["sm_121a"] and lane.SMEM[name]["sm_90a"] <= _LIMIT["sm_90a"]


def test_sweep_seeds_are_valid():
    """A seed is the defaults, which take every named shape; every seed takes the sweep's default shapes
    (a seed another named shape refuses, as a 32-pair block at N = 32, is recorded infeasible there)."""
    from lab import space as sp
    seeds = sp.load_space("mamba_bwd_bwd", "cutile", lane.TUNABLES).seeds
    assert lane.DEFAULTS in seeds
    for name in NAMED:
        assert lane.config_reason(lane.DEFAULTS, _shape(name)) is None, name
    for seed in seeds:
        for name in sp.load_shapes("mamba_bwd_bwd")[1]:
            assert lane.config_reason(seed, _shape(name)) is None, (seed, name)


# ---- rules --------------------------------------------------------------------------------------

def test_config_rules():
    shape = _shape("gb10")
    assert set(D) == set(lane.TUNABLES)
    assert lane.config_reason(D, shape) is None
    assert "dtype" in lane.config_reason(D, {**shape, "dtype": "float32"})
    assert "N=16" in lane.config_reason(D, {**shape, "N": 16})
    assert "C=" in lane.config_reason(D, {**shape, "C": 12, "S": 240})
    assert "C=" in lane.config_reason(D, {**shape, "C": 2, "R": 4, "S": 256})
    assert "P=" in lane.config_reason(D, {**shape, "P": 48})
    assert "KEY_BJ" in lane.config_reason({**D, "KEY_BJ": 64}, shape)       # N/2 = 32
    assert "BLOCK_P" in lane.config_reason({**D, "BLOCK_P": 8}, shape)
    assert "VALUE_QK" in lane.config_reason({**D, "VALUE_QK": "both"}, shape)
    assert harness_reason("mamba_bwd_bwd", "cutile", {**D, "VALUE_QK": "recompute"}, shape) is None
    assert "num_worker_warps" in harness_reason("mamba_bwd_bwd", "cutile", {**D, "num_worker_warps": 2}, shape)
    assert "occupancy" in harness_reason("mamba_bwd_bwd", "cutile", {**D, "occupancy": 33}, shape)
    assert "prep_occupancy" in harness_reason("mamba_bwd_bwd", "cutile", {**D, "prep_occupancy": 4}, shape)
    assert harness_reason("mamba_bwd_bwd", "cutile", {**D, "SCAN_PREP": True, "prep_occupancy": 4}, shape) is None
    assert "int64" in lane.config_reason(D, {**shape, "B": 64, "S": 65536, "H": 64})


def test_target_rules():
    assert lane.eligibility("sm_90a") is None and lane.eligibility("sm_121a") is None
    assert "sm_75" in lane.eligibility("sm_75")
    with pytest.raises(ValueError, match="N=16"):
        lane.compile_for(D, {**_shape("gb10"), "N": 16}, "sm_90a")


# ---- the kernel bodies on torch -----------------------------------------------------------------

def _small(**kw):
    base = {"B": 2, "S": 12, "H": 2, "G": 1, "N": 64, "P": 32, "R": 4, "C": 4, "rd": 4, "hasZ": True, "hasD": True,
            "reduceO": True, "dtype": "bfloat16"}
    return {**base, **kw}


SMALL = {"SCAN_BJ": 16, "SCAN_BP": 16, "KEY_BJ": 16, "KEY_BP": 16, "VALUE_BJ": 16, "BLOCK_P": 16}

# Three chunks or more everywhere; two pair blocks of 16 on N = 64 (with rd = 4 the second holds no
# rotary pair: angles padded / masked, its DANGLES store skipped), P in two column blocks.
BODY_CASES = [
    pytest.param(_small(), SMALL, id="r4-all-options"),
    pytest.param(_small(B=1, S=48, H=4, G=2, N=32, P=16, R=1, C=16, rd=2, hasZ=False, hasD=False, reduceO=False,
                        dtype="float16"), SMALL, id="r1-gqa-no-options-fp16"),
    pytest.param(_small(B=1, S=16, H=4, G=2, R=4, rd=2, hasZ=True, hasD=False, reduceO=False),
                 {**SMALL, "SCAN_BJ": 32, "SCAN_BP": 32, "VALUE_BJ": 32, "BLOCK_P": 32}, id="r4-gqa-z-rd2"),
    pytest.param(_small(B=1, S=24, H=1, R=2, C=8, hasZ=False, hasD=True, reduceO=True), {**SMALL, "KEY_BP": 32},
                 id="r2-d-only"),
    pytest.param(_small(B=1, S=8, H=2, G=2, N=32, P=16, R=8, C=2, rd=4, hasZ=True, hasD=True, reduceO=False), SMALL,
                 id="r8-c2-gqa-4-chunks"),
    # The segmented scan: 3 chunks in 3 ranges (a local pass over two), 4 chunks in 2 ranges of 2.
    pytest.param(_small(), {**SMALL, "SCAN_SEGMENTS": 4}, id="r4-3-segments"),
    pytest.param(_small(B=1, S=8, H=2, G=2, N=32, P=16, R=8, C=2, rd=4, hasZ=True, hasD=True, reduceO=False),
                 {**SMALL, "SCAN_SEGMENTS": 2}, id="r8-4-chunks-2-segments"),
    # SCAN_PREP: the scan reads _prep's q_hat / dy tiles (two pair blocks, two column blocks), also segmented,
    # and without Z and the reduced DOUT (dy then the raw DOUT rows).
    pytest.param(_small(), {**SMALL, "SCAN_PREP": True}, id="r4-scan-prep"),
    pytest.param(_small(B=1, S=16, H=4, G=2, R=4, rd=2, hasZ=False, hasD=False, reduceO=False, dtype="float16"),
                 {**SMALL, "SCAN_PREP": True, "SCAN_SEGMENTS": 2}, id="r4-gqa-prep-2-segments-fp16"),
    # VALUE_QK = "recompute": the value side's own q_hat / k_hat (whole N, the angles padded past rd), no QH / KH;
    # options on and off, R = 4 and 1, GQA heads, with and without SCAN_PREP (dS the placeholder without it).
    pytest.param(_small(), {**SMALL, "VALUE_QK": "recompute"}, id="r4-all-options-recompute"),
    pytest.param(_small(B=1, S=48, H=4, G=2, N=32, P=16, R=1, C=16, rd=2, hasZ=False, hasD=False, reduceO=False,
                        dtype="float16"), {**SMALL, "VALUE_QK": "recompute"}, id="r1-gqa-no-options-fp16-recompute"),
    pytest.param(_small(B=1, S=48, H=2, N=32, P=16, R=1, C=16), {**SMALL, "VALUE_QK": "recompute"},
                 id="r1-all-options-recompute"),
    pytest.param(_small(B=1, S=16, H=4, G=2, R=4, rd=2, hasZ=False, hasD=False, reduceO=False),
                 {**SMALL, "SCAN_PREP": True, "VALUE_QK": "recompute"}, id="r4-gqa-no-options-prep-recompute"),
]


@pytest.mark.parametrize("shape,config", BODY_CASES)
def test_kernel_bodies_match_reference(shape, config, monkeypatch):
    PROBLEM.check_shape(shape)
    config = {**D, **config}
    assert lane.config_reason(config, shape) is None
    standin.patch_torch(monkeypatch)
    ns, fake = standin.emulated(lane, standin.fake_ct(undetermined=float("nan")),
                                overrides={"_launch_info": lambda kernel, args: {}})
    launches = standin.record_launches(fake)
    inputs = PROBLEM.make_inputs(shape, "cpu", 5)
    outputs = PROBLEM.alloc_outputs(shape, "cpu")
    info = ns["build"](config, shape)(inputs, outputs)
    local = ["_scan"] if lane._segments(config, shape) > 1 else []       # the scan's local pass
    local = (["_prep"] if config["SCAN_PREP"] else []) + local
    assert launches == local + ["_scan", "_chunk_k", "_chunk_v", "_reduce"] and info["launches"] == len(launches)
    ref = PROBLEM.reference(inputs, shape)
    assert set(outputs) == set(ref)
    ok, errors = parity.compare(outputs, ref, PROBLEM.tolerance(shape), PROBLEM.output_tolerances(shape))
    assert ok, parity.describe_failure(errors, PROBLEM.tolerance(shape), str(shape), PROBLEM.output_tolerances(shape))
    # Inside the bands with room: the stand-in multiplies exactly (fp64), so only bf16 / fp16 operand rounding
    # is left (bf16 up to 5.7e-3 at R = 8, fp16 below 3e-3 over three seeds; DDA, a cancelling sum over N x P,
    # has its own wider band, see the problem).
    bound = 8e-3 if shape["dtype"] == "bfloat16" else 3e-3
    assert max(e.rel_l2 for n, e in errors.items() if n != "DDA") < bound, errors


@pytest.mark.parametrize("value_qk", lane.VALUE_QK)
def test_stand_in_catches_a_wrong_body(value_qk, monkeypatch):
    """The check can fail: the value side's gate sign flipped gives wrong DV / DFACTOR."""
    shape, config = _small(B=1, H=1), {**D, **SMALL, "VALUE_QK": value_qk}
    standin.patch_torch(monkeypatch)
    ns, fake = standin.emulated(lane, standin.fake_ct(undetermined=float("nan")),
                                overrides={"_launch_info": lambda kernel, args: {}})
    good = ns["_gates"]

    def bad(*args):
        gamma, factor, er = good(*args)
        return gamma, -factor, er
    ns["_gates"] = bad
    standin.record_launches(fake)
    inputs = PROBLEM.make_inputs(shape, "cpu", 5)
    outputs = PROBLEM.alloc_outputs(shape, "cpu")
    ns["build"](config, shape)(inputs, outputs)
    ok, errors = parity.compare(outputs, PROBLEM.reference(inputs, shape), PROBLEM.tolerance(shape))
    assert not ok and not errors["DV"].ok(PROBLEM.tolerance(shape))


@pytest.mark.parametrize("R,P,nc,elems", [(4, 64, 3, 256), (1, 16, 5, 32), (8, 128, 9, 4096)])
def test_reduce_sums_blocks_of_chunks(R, P, nc, elems):
    """_reduce with a smaller block than the lane's (several steps, the last padded past nc) and P split over
    programs: the per-chunk partials' sums, DD from one program per (b, h)."""
    ns, fake = standin.emulated(lane, standin.fake_ct(undetermined=float("nan")), overrides={"_REDUCE_ELEMS": elems})
    standin.record_launches(fake)
    rp, rb = ns["_reduce_blocks"]({"S": nc * 4, "C": 4, "R": R, "P": P})
    assert rb * R * rp <= elems and (rb < nc or elems == 4096)
    B, H = 2, 3
    ws, dd = torch.randn(B, H, nc, R, P), torch.randn(B, H, nc)
    out, dd_out = torch.full((B, H, R, P), float("nan")), torch.full((B, H), float("nan"))
    fake.launch(None, (P // rp, H, B), ns["_reduce"], (ws, dd, out, dd_out, R, rp, rb, True))
    assert torch.allclose(out, ws.sum(2), atol=1e-5) and torch.allclose(dd_out, dd.sum(2), atol=1e-5)


def test_stand_in_tile_semantics():
    """The shared stand-in's loads, stores and gathers follow cuda.tile's documented semantics."""
    ct = standin.fake_ct(undetermined=float("nan"))
    a = torch.arange(12.0).reshape(3, 4)
    # Tile (1, 0) of 2 x 4 tiles: row 2 and one padded row (NaN unless ZERO padding is asked for).
    t = ct.load(a, (1, 0), (2, 4))
    assert torch.equal(t[0], a[2]) and torch.isnan(t[1]).all()
    assert torch.equal(ct.load(a, (1, 0), (2, 4), padding_mode=ct.PaddingMode.ZERO)[1], torch.zeros(4))
    # order: tile axis j is array axis order[j] (a transposed load).
    assert torch.equal(ct.load(a, (0, 0), (4, 2), order=(1, 0)), a[:2].T)
    # Stores drop what falls outside; a tile wholly outside fails.
    out = torch.zeros(3, 4)
    ct.store(out, (1, 1), torch.ones(2, 2))
    assert out.sum() == 2 and out[2, 2:].sum() == 2
    with pytest.raises(AssertionError):
        ct.store(out, (2, 0), torch.ones(2, 2))
    # gather: padding_value out of bounds or masked.
    g = ct.gather(a, (2, torch.tensor([3, 4, -1])), padding_value=-1.0)
    assert g.tolist() == [11.0, -1.0, -1.0]
    assert ct.gather(a, (0, torch.tensor([1, 2])), mask=torch.tensor([True, False])).tolist() == [1.0, 0.0]
