"""The cuTile m2rnn_bwd lane on the CPU: ahead-of-time compiles (tileiras) for sm_90a and sm_121a of the
configs the sweep file seeds with (the best recorded config at each shape among them), the lane's
refusals and its handling of retired knobs, and the kernels' own Python bodies run against the BPTT
reference through a small torch stand-in for ``cuda.tile`` (checks the chunk / segment / piece / scratch
index arithmetic and the head broadcasting of both walks; not tileiras' lowering)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.cutile import m2rnn_bwd as lane
from lab import registry, space
from lab.problems import _m2rnn as m2
from lab.problems.m2rnn_bwd import PROBLEM
from tests import cutile_standin as standin

D = lane.DEFAULTS
# The best recorded config of each shape, as the results tables hold it (a config recorded before a knob
# existed lacks it and ran with its default; knobs retired since are still named).
BEST = {
    "b2_n8": {"CKPT": 128, "DOT": "input", "DZ_STORE": True, "FAST_TANH": True, "G_SPLIT": 4, "KV": "outer",
              "ROLES": "split", "SCRATCH": "bfloat16", "T": 4, "T_FWD": 16, "T_G": 4, "T_RE": 0, "WALK": "chain",
              "fwd_occupancy": 3, "num_worker_warps": 0, "occupancy": 1},
    "b4_n44": {"CKPT": 64, "C_ROWS": 1, "DOT": "input", "DW": "diag", "DZ_STORE": True, "FAST_TANH": True,
               "G_SPLIT": 16, "KV": "outer", "PIPE": 8, "ROLES": "split", "SCRATCH": "bfloat16", "STEP_MMA": "fwd",
               "STORE": "h", "T": 4, "T_FWD": 8, "T_G": 4, "T_RE": 0, "WALK": "store", "fwd_occupancy": 3,
               "g_occupancy": 2, "num_worker_warps": 0, "occupancy": 6},
    "b8_n84": {"CHAIN_Z": "step", "CKPT": 64, "C_ROWS": 1, "DOT": "input", "DQ": "fwd", "DW": "diag",
               "DZ_STORE": False, "FAST_TANH": True, "FWD_STORE": "step", "G_SPLIT": 8, "KV": "fwd",
               "PARTIALS": "bfloat16", "PIPE": 8, "ROLES": "split", "SCRATCH": "bfloat16", "STEP_MMA": "fwd",
               "STORE": "h", "T": 2, "T_FWD": 16, "T_G": 4, "T_RE": 0, "WALK": "store", "fwd_occupancy": 3,
               "g_occupancy": 3, "num_worker_warps": 0, "occupancy": 6},
    "ragged_h0": {"CKPT": 64, "C_ROWS": 1, "DOT": "input", "DW": "diag", "DZ_STORE": True, "FAST_TANH": True,
                  "G_SPLIT": 16, "KV": "fwd", "PIPE": 8, "ROLES": "split", "SCRATCH": "bfloat16", "STORE": "h",
                  "T": 4, "T_FWD": 8, "T_G": 4, "T_RE": 0, "WALK": "store", "fwd_occupancy": 2, "g_occupancy": 2,
                  "num_worker_warps": 0, "occupancy": 6},
}
# The store walk's base for the rule and body cases below: the b4_n44 best's knobs.
STORE = {k: v for k, v in BEST["b4_n44"].items() if k not in lane.RETIRED}


def cfg(**kw):
    return {**D, **kw}


def store(**kw):
    return {**D, **STORE, **kw}


def _shape(name):
    return space.get_shape("m2rnn_bwd", name)


def _parity(name):
    return PROBLEM.parity_shapes(_shape(name))[0]


def _space():
    return space.load_space("m2rnn_bwd", "cutile", tuple(lane.TUNABLES))


# ---- AOT compiles -------------------------------------------------------------------------------

_LIMIT = {"sm_90a": 232_448, "sm_121a": 101_376}


def _check(got, config, shape, target):
    walk = {**D, **config}["WALK"]
    assert got["binary"] == "cubin" and got["compile_s"] > 0
    assert set(got["kernels"]) == ({"forward", "backward"} | ({"gradients"} if walk == "store" else set()))
    assert 0 < got["smem_bytes"] <= lane.smem_estimate(config, shape, target) <= _LIMIT[target], got
    assert got["registers"] and got["registers"] <= 255, got


# (target, best config of, shape): each best at its own shape and the b2_n8 (the defaults) and b8_n84 bests at
# their parity shape (ragged S, h0); on sm_121a the two walks once each, the rest slow (same code paths).
_COMPILES = [("sm_90a", name, name) for name in BEST] + [
    ("sm_90a", "b2_n8", "parity"), ("sm_90a", "b8_n84", "parity"),
    ("sm_121a", "b2_n8", "b4_n44"), ("sm_121a", "b4_n44", "b4_n44")] + [
    pytest.param("sm_121a", name, name, marks=pytest.mark.slow) for name in ("b2_n8", "b8_n84", "ragged_h0")]


@pytest.mark.parametrize("target,best,at", _COMPILES)
def test_best_configs_compile(target, best, at, compiled):
    """The best recorded configs compile as recorded (retired knobs named) within the target's shared memory.
    On sm_90a the store walk's chain and gradient kernels of the b4_n44 / b8_n84 bests do not spill, and the
    forward's occupancy hint (3 CTAs per SM) caps it at 80 registers."""
    config = BEST[best]
    shape = _parity(best) if at == "parity" else _shape(at)
    got = compiled(lane, config, shape, target)
    _check(got, config, shape, target)
    if config["fwd_occupancy"] == 3:
        assert got["kernels"]["forward"]["registers"] <= 80, got
    if target == "sm_90a" and best in ("b4_n44", "b8_n84") and at == best:
        assert got["kernels"]["gradients"]["stack_bytes"] == 0, got
        if best == "b8_n84":
            assert got["kernels"]["backward"]["stack_bytes"] == 0, got


@pytest.mark.slow    # every seed of the sweep file on sm_90a at b8_n84; the compiles above cover the code paths
def test_every_seed_compiles():
    shape = _shape("b8_n84")
    for seed in _space().seeds:
        _check(lane.compile_for(seed, shape, "sm_90a"), seed, shape, "sm_90a")


def _sass(config, shape, which=("forward", "backward", "gradients")):
    """{kernel name: sm_90a SASS text} (cuobjdump from the Triton wheel)."""
    import subprocess
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump in the Triton wheel to read the SASS")
    out = {}
    for name, cubin in lane.compile_cubins(config, shape, "sm_90a", which=which).items():
        path = Path(f"/tmp/_cutile_m2rnn_bwd_{os.getpid()}_{name}.cubin")
        path.write_bytes(cubin)
        try:
            out[name] = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True,
                                       check=True).stdout
        finally:
            path.unlink()
    return out


@pytest.mark.slow    # pins SASS instruction counts; the compiles above cover the code paths
def test_fast_tanh_is_mufu():
    """FAST_TANH is real: APPROX lowers to MUFU.TANH (tanh.approx.f32), FULL to a software tanh."""
    counts = {fast: _sass(cfg(FAST_TANH=fast), _shape("b2_n8"), ("forward",))["forward"].count("MUFU.TANH")
              for fast in (True, False)}
    assert counts[True] > 0 and counts[False] == 0, counts


@pytest.mark.slow    # pins SASS instruction counts; the compiles above cover the code paths
def test_store_walk_without_dz_keeps_one_mma_layout():
    """At the b8_n84 best (no dz stored) the chain recomputes each step's Z as a 2-D product in its step loop:
    warpgroup wgmmas only, no warp-level mma.sync (a per-chunk batched product would be one). The storing
    forward holds one 16-byte global store per step and an mma.sync (dq's one-hot products)."""
    sass = _sass(BEST["b8_n84"], _shape("b8_n84"))
    assert "HGMMA" in sass["backward"] and "HMMA" not in sass["backward"]
    assert sass["forward"].count("STG.E.128") == 16 and "HMMA" in sass["forward"]


@pytest.mark.slow    # pins SASS instruction counts; the compiles above cover the code paths
def test_step_mma_batched_is_mma_sync():
    """STEP_MMA is real: in the store walk with dz stored (the chain's only product is the serial one) the
    storing forward and the chain hold warpgroup wgmmas (HGMMA) with 2-D serial products and only warp-level
    HMMA where batched (both kernels with "batched", the forward alone with "fwd"); the gradient kernel, whose
    products are not serial, has the same wgmmas either way."""
    base = BEST["b4_n44"]
    sass = {}
    for mode in lane.STEP_MMAS:
        for name, text in _sass({**base, "STEP_MMA": mode}, _shape("b8_n84")).items():
            sass[mode, name] = text
    for mode, name in (("batched", "forward"), ("batched", "backward"), ("fwd", "forward")):
        assert "HGMMA" in sass["2d", name] and "HGMMA" not in sass[mode, name] and "HMMA" in sass[mode, name]
    assert sass["fwd", "backward"].count("HGMMA") == sass["2d", "backward"].count("HGMMA") > 0
    assert len({sass[mode, "gradients"].count("HGMMA") for mode in lane.STEP_MMAS} - {0}) == 1


# ---- rules --------------------------------------------------------------------------------------

def test_config_rules():
    shape = _shape("b2_n8")
    assert lane.config_reason(D, shape) is None and lane.config_reason(store(), shape) is None
    for name in ("b2_n8", "b4_n44", "b8_n84", "b4_n132", "ragged_h0"):
        for config in (D, store(), BEST["b8_n84"]):
            assert lane.config_reason(config, _shape(name)) is None, name
            assert lane.config_reason(config, _parity(name)) is None, name
    assert "dtype" in lane.config_reason(D, {**shape, "dtype": "float16"})
    assert "exceeds" in lane.config_reason(D, {**shape, "K": 128})
    assert "exceeds" in lane.config_reason(D, _shape("fp32_k64_v64"))
    assert "CKPT" in lane.config_reason(cfg(CKPT=32), shape)
    assert "CKPT must stay" in lane.config_reason(store(CKPT=128), shape)
    assert "T=" in lane.config_reason(cfg(T=8), shape)
    assert "T_FWD" in lane.config_reason(cfg(T_FWD=4), shape)
    assert "T_G" in lane.config_reason(cfg(T_G=8), shape)
    assert "G_SPLIT" in lane.config_reason(cfg(G_SPLIT=1), shape)
    assert "KV" in lane.config_reason(cfg(KV="mma"), shape)
    assert "KV=fwd" in lane.config_reason(cfg(KV="fwd"), shape)
    assert "bf16" in lane.config_reason(store(KV="fwd"), {**shape, "dtype": "float32"})
    assert "WALK" in lane.config_reason(cfg(WALK="chunk"), shape)
    assert "DZ_STORE must be true" in lane.config_reason(cfg(DZ_STORE=False), shape)
    assert lane.config_reason(store(DZ_STORE=False), shape) is None
    assert "DZ_STORE" in lane.config_reason(store(DZ_STORE=1), shape)
    assert "PIPE" in lane.config_reason(cfg(PIPE=8), shape)
    assert "PIPE" in lane.config_reason(store(PIPE=4), shape)
    assert lane.config_reason(store(PIPE=1), shape) is None
    assert "PARTIALS=bfloat16" in lane.config_reason(cfg(PARTIALS="bfloat16"), shape)
    assert "PARTIALS=bfloat16" in lane.config_reason(store(PARTIALS="bfloat16"), {**shape, "dtype": "float32"})
    assert "PARTIALS" in lane.config_reason(store(PARTIALS="float16"), shape)
    assert "DOT" in lane.config_reason(cfg(DOT="fp8"), shape)
    assert "STEP_MMA" in lane.config_reason(cfg(STEP_MMA="3d"), shape)
    assert "STEP_MMA" in lane.config_reason(cfg(STEP_MMA=["fwd"]), shape)
    assert "FAST_TANH" in lane.config_reason(cfg(FAST_TANH=1), shape)
    assert "occupancy" in lane.config_reason(cfg(occupancy=3), shape)
    assert "fwd_occupancy" in lane.config_reason(cfg(fwd_occupancy=4), shape)
    assert "g_occupancy" in lane.config_reason(store(g_occupancy=5), shape)


def test_retired_knobs():
    """A config recorded before a knob was retired still names it: accepted with the value the code has
    for it (TUNABLES lists it, DEFAULTS does not), refused with any other."""
    assert set(lane.TUNABLES) == set(D) | set(lane.RETIRED) and not set(D) & set(lane.RETIRED)
    cutile = registry.get("cutile", "m2rnn_bwd")
    for name, config in BEST.items():
        full = cutile.full_config(config)
        assert lane.config_reason(full, _shape(name)) is None, name
        named = {k: v for k, v in full.items() if k in lane.RETIRED}
        assert named == {k: v for k, v in lane.retired_values(full, _shape(name)).items() if k in config}, name
    shape = _shape("b2_n8")
    chain, no_dz = BEST["b2_n8"], store(DZ_STORE=False)
    assert lane.retired_values(store(), shape)["DW"] == "diag" and lane.retired_values(D, shape)["DW"] == "pad"
    for base, key, value in ((chain, "T_RE", 16), (chain, "T_RE", False), (chain, "ROLES", "fused"),
                             (chain, "num_worker_warps", 4), (chain, "SCRATCH", "float32"), (chain, "DW", "diag"),
                             (store(), "STORE", "z"), (store(), "C_ROWS", 2), (store(), "DW", "pad"),
                             (store(), "DQ", "fwd"), (store(), "CHAIN_Z", "step"), (no_dz, "DQ", "grads"),
                             (no_dz, "FWD_STORE", "chunk"), (no_dz, "CHAIN_Z", "chunk"),
                             ({**chain, "DOT": "tf32"}, "SCRATCH", "bfloat16")):
        assert f"{key}={value!r}" in lane.config_reason({**base, key: value}, shape), (key, value)
    # SCRATCH follows DOT: bf16 with bf16 products, fp32 otherwise (and for fp32 inputs).
    assert lane.config_reason({**chain, "SCRATCH": "float32", "DOT": "tf32"}, shape) is None
    assert lane.config_reason({**chain, "SCRATCH": "float32"}, {**shape, "dtype": "float32"}) is None
    with pytest.raises(Exception, match="unknown config key"):
        cutile.full_config({**chain, "LOADS": "chunk"})


def test_sweep_file():
    """The sweep file's header says what the pruning removed; its space names no retired knob; its seeds
    pass the rules and the lane at every named bf16 shape, and hold each shape's best recorded config."""
    path = space.sweeps_dir() / "m2rnn_bwd" / "cutile.toml"
    assert path.read_text().startswith("# Pruned ")
    sp = _space()
    assert not set(sp.params) & set(lane.RETIRED) and set(sp.params) <= set(D)
    assert 5 <= len(sp.seeds) <= 12
    cutile = registry.get("cutile", "m2rnn_bwd")
    for seed in sp.seeds:
        for name in ("b2_n8", "b4_n44", "b8_n84", "b4_n132", "ragged_h0"):
            full = cutile.full_config(seed)
            assert sp.rule_reason(full) is None and lane.config_reason(full, _shape(name)) is None, (seed, name)
    for name, config in BEST.items():
        full = cutile.full_config(config)
        assert sp.rule_reason(full) is None, name
        assert {k: full[k] for k in sp.params} in sp.seeds, name
    # The rules keep each walk's own values.
    assert "PIPE" in sp.rule_reason(cutile.full_config(store(PIPE=1)))
    assert "occupancy" in sp.rule_reason(cutile.full_config(cfg(occupancy=6)))


def test_target_rules():
    assert lane.eligibility("sm_90a") is None and lane.eligibility("sm_121a") is None
    assert "sm_75" in lane.eligibility("sm_75")
    with pytest.raises(ValueError, match="CKPT"):
        lane.compile_for(cfg(CKPT=7), _shape("b2_n8"), "sm_90a")


# ---- the kernel bodies on torch -----------------------------------------------------------------

def _emulated_lane():
    return standin.emulated(lane)


@pytest.fixture
def tile_methods(monkeypatch):
    """Tile.astype on torch tensors, for the kernel bodies; torch.empty poisoned with NaN so that a read
    of a scratch element no launch wrote shows up; no CUDA stream on the CPU."""
    standin.patch_torch(monkeypatch)


def _emulate(config, shape, inputs):
    """lane.build's own run (its launch schedule and buffer rotation) with ct.launch a loop over the
    programs, each kernel body run on torch."""
    ns, fake = _emulated_lane()
    launches = standin.record_launches(fake)
    run = ns["build"](config, shape)
    outputs = PROBLEM.alloc_outputs(shape, "cpu")
    info = run(inputs, outputs)
    full = {**D, **config}
    if full["WALK"] == "store":
        assert launches == ["_fwd_store"] + ["_chain_all", "_grads_all"] * ns["pieces"](full, shape)
    else:
        assert launches == ["_fwd_ckpt"] + ["_seg3"] * (ns["_nseg"](full, shape) + 2)
    assert info["launches"] == len(launches)
    return outputs


def test_schedule3_runs_each_role_once_per_segment_in_order():
    """WALK = chain: segment j is recomputed at launch NSEG - j - 1, its chain walked at NSEG - j and its
    gradients taken at NSEG - j + 1, each once with its full length; the three segments a launch touches
    use distinct state (mod 3), dz and G (mod 2) buffers."""
    for S, ck in ((29, 8), (4096, 64), (977, 128), (64, 64), (65, 64)):
        nseg = -(-S // ck)
        plan = lane.schedule3(nseg, S, ck)
        assert len(plan) == nseg + 2
        seen = {"c": {}, "r": {}, "g": {}}
        for m, (jc, lc, jr, lr, jg, lg) in enumerate(plan):
            for role, j, n in (("c", jc, lc), ("r", jr, lr), ("g", jg, lg)):
                if n:
                    assert n == min(ck, S - j * ck)
                    seen[role][j] = m
            j = nseg - m
            assert len({(j - 1) % 3, j % 3, (j + 1) % 3}) == 3 and (j - 1) % 2 != j % 2 != (j + 1) % 2
        for j in range(nseg):
            assert (seen["r"][j], seen["c"][j], seen["g"][j]) == (nseg - j - 1, nseg - j, nseg - j + 1)
        assert sum(p[1] for p in plan) == sum(p[3] for p in plan) == sum(p[5] for p in plan) == S


# At S = 70 (B = 2, N = 4): two segments of CKPT 64 (the last 6 steps: gradient chunks past S masked), one
# of 128; pieces of 16 steps at PIPE 8 and 16 (five, the last 6), one at PIPE 1; forward chunks past S. At
# S = 64 every chunk, piece and CKPT 64 segment is full (RAG / RAGF false). fp32 inputs and DOT other than
# input run the fp32 scratch; bf16 inputs with DOT = input the bf16 one.
_BODY_CONFIGS = [
    # WALK = chain: the defaults (the b2_n8 best), shorter chunks and more gradient programs
    (cfg(CKPT=64), "bfloat16"),
    (cfg(CKPT=64, T=2, T_FWD=8, T_G=2, G_SPLIT=2), "float32"),
    (cfg(T=2, G_SPLIT=16, STEP_MMA="batched"), "bfloat16"),
    (cfg(CKPT=64, DOT="tf32", STEP_MMA="fwd", G_SPLIT=8), "bfloat16"),
    # WALK = store, dz stored (the b4_n44 and ragged_h0 bests), then without (the b8_n84 best)
    (store(), "bfloat16"),
    (store(KV="fwd", STEP_MMA="2d", fwd_occupancy=2), "bfloat16"),
    ({**D, **{k: v for k, v in BEST["b8_n84"].items() if k not in lane.RETIRED}}, "bfloat16"),
    (store(T=2, T_FWD=16, T_G=2, G_SPLIT=2, PIPE=16), "float32"),
    (store(DZ_STORE=False, T_G=4, G_SPLIT=4, PIPE=1, STEP_MMA="batched"), "float32"),
    (store(DZ_STORE=False, T=2, T_G=2, G_SPLIT=2, PIPE=16, DOT="ieee"), "bfloat16"),
    (store(KV="fwd", T=2, T_FWD=16, G_SPLIT=4, DOT="tf32x3", STEP_MMA="batched"), "bfloat16"),
]


# At S = 64 (RAG / RAGF false) the default run takes one config of each WALK (configs 0 and 4); every config
# runs ragged at S = 70, where its first CKPT 64 segment is full too. The rest at S = 64 are marked slow.
_FULL_S_DEFAULT = (0, 4)


@pytest.mark.parametrize("config,dtype,S", [
    pytest.param(c, d, S, id=f"{S}-config{i}-{d}",
                 marks=() if S == 70 or i in _FULL_S_DEFAULT else pytest.mark.slow)
    for S in (70, 64) for i, (c, d) in enumerate(_BODY_CONFIGS)])
def test_kernel_bodies_match_bptt(config, dtype, S, tile_methods):
    shape = _bodies_shape(S, dtype)
    assert lane.config_reason(config, shape) is None
    _check_bodies(config, shape)


def _bodies_shape(S, dtype):
    # Padded K and V, every head-sharing pattern, h0.
    return {"B": 2, "S": S, "N": 4, "Nq": 1, "Nk": 2, "Nw": 1, "Nf": 4, "K": 20, "V": 12, "h0": True,
            "dtype": dtype}


def _check_bodies(config, shape):
    # fp64 stands in for the kernels' fp32 math (the lane's buffers are fp32); bf16 operands (DOT=input) stay
    # bf16-rounded, and bf16 inputs get bf16 outputs (rounded: ~2e-3), so the bound differs.
    inputs = {n: x.double() for n, x in m2.make_inputs(shape, "cpu", 3, backward=True).items()}
    got = _emulate(config, shape, inputs)
    ref = m2.bptt_backward(inputs, shape, torch.float64)
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert torch.isfinite(got[name]).all(), name
        err = (got[name].double() - ref[name]).norm() / ref[name].norm()
        bound = 1e-5 if shape["dtype"] == "float32" else 5e-3 if lane.dot_mode(config, shape) % 4 else 2e-2
        assert err < bound, (name, float(err))
