"""The TileLang M2RNN forward lane on the CPU: what the generated CUDA does on the serial chain (no
barrier, no shared-memory round trip, W in registers), ahead-of-time cubins for sm_90a and sm_121a at
the default shapes and their parity shapes (registers, no spills, shared memory held to the
estimate), and the config / target rules. No GPU here: numerics are checked on one by
`python -m lab check`. Each nvcc compile costs several seconds on two cores: the list is short."""
from __future__ import annotations

import re

import pytest

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.tilelang import m2rnn_fwd as lane
from lab import space
from lab.devices import get_profile
from lab.problems import get
from tests.test_space_values import harness_reason

D = lane.DEFAULTS
SHAPES = {name: space.get_shape("m2rnn_fwd", name) for name in ("b2_n8", "b4_n44", "b8_n84", "ragged_h0",
                                                                 "fp32_k64_v64")}
PARITY = {name: get("m2rnn_fwd").parity_shapes(SHAPES[name])[0] for name in ("b2_n8", "b4_n44", "ragged_h0")}


def _step_loop(src: str) -> str:
    """Body of the per-step loop: the innermost loop around the product that also holds the tanh."""
    anchor = src.find("mma_sync")
    assert anchor > 0
    heads = [m.start() for m in re.finditer(r"for \(int i_\d+ = 0; i_\d+ < [^;]+; \+\+i_\d+\) \{", src)
             if m.start() < anchor]
    for start in reversed(heads):
        open_ = src.index("{", start)
        depth = 0
        for end in range(open_, len(src)):
            depth += (src[end] == "{") - (src[end] == "}")
            if depth == 0:
                break
        body = src[open_:end]
        if end > anchor and ("m2rnn_tanh_approx" in body or "tanhf" in body):
            return body
    raise AssertionError("no step loop found")


@pytest.mark.slow    # pins the generated CUDA text; the compiles below cover the code paths
@pytest.mark.parametrize("target,config,n_mma", [
    ("sm_90a", {}, 2),
    ("sm_121a", {"threads": 32, "K_SPLIT": 4}, 2),
    ("sm_90a", {"PREC": "bf16x2", "FAST_TANH": False}, 4),
])
def test_serial_chain_has_no_barrier_or_shared_round_trip(target, config, n_mma):
    src = lane.lower(config, SHAPES["b2_n8"], target).kernel_source
    body = _step_loop(src)
    # No barrier of any kind and no cross-warp reduction workspace inside the step loop.
    assert "__syncthreads" not in body and "sync_thread_partial" not in body and "bar.sync" not in body
    assert "workspace" not in src
    # y's row sum stays inside the warp (AllReduce over 32 lanes, no shared workspace argument).
    assert re.search(r"AllReduce<tl::SumOp, 32, 4, 0, tl::NamedBarrier<\d+>>::run\(yf\[i_\d+\]\)", body)
    # W lives in registers: no ldmatrix per step; the state's bf16 copy is the register A operand.
    assert "ldmatrix" not in body and body.count("mma_sync") == n_mma
    assert "__float22bfloat162_rn" in body
    fast = config.get("FAST_TANH", D["FAST_TANH"])
    assert ("m2rnn_tanh_approx" in body) == fast and ("tanhf" in body) == (not fast)
    assert ("tanh.approx.f32" in src) == fast
    # Two barriers per chunk and two while staging W; the chunk waits for STAGES - 1 chunks of 3 groups.
    assert src.count("__syncthreads") == 4
    assert "tl::cp_async_wait<3>()" in src and "cp_async_gs_conditional<16>" in src


@pytest.mark.slow    # pins the generated CUDA text; the compiles below cover the code paths
def test_stages_option_and_mma_sync_on_sm90a():
    src = lane.lower({"STAGES": 3}, SHAPES["b2_n8"], "sm_90a").kernel_source
    body = _step_loop(src)
    assert "mma_sync" in body and "wgmma" not in src and "__syncthreads" not in body
    assert "tl::cp_async_wait<6>()" in src                 # 2 chunks ahead x (q, k, v)


def test_ragged_sequence_is_guarded():
    """S = 977 (not a multiple of CHUNK): the last chunk walks 977 - 15 * 64 steps, prefetches of rows
    past S are predicated off, and y stores are guarded."""
    src = lane.lower({"CHUNK": 64}, PARITY["ragged_h0"], "sm_90a").kernel_source
    assert "min(64, (977 - (ci * 64)))" in src
    assert "< 913)" in src and "< 977)" in src and "H0" in src


# (target, shape name, config overrides): defaults at every default shape and parity shape on both
# targets would be ~20 compiles; these cover each shape once per target plus the sweep's other axes.
_AOT = [
    ("sm_90a", "b2_n8", {}),
    ("sm_121a", "b2_n8", {}),
    ("sm_90a", "b8_n84", {}),
    ("sm_121a", "b4_n44", {}),
    ("sm_90a", "p:ragged_h0", {}),
    ("sm_121a", "p:b4_n44", {}),
    ("sm_90a", "p:b2_n8", {"threads": 32, "K_SPLIT": 4, "CHUNK": 128, "STAGES": 3}),
    ("sm_121a", "ragged_h0", {"threads": 64, "K_SPLIT": 2, "CHUNK": 32, "PREC": "bf16x2", "FAST_TANH": False}),
    ("sm_90a", "b4_n44", {"STAGES": 3}),
    ("sm_121a", "fp32_k64_v64", {"PREC": "bf16x3", "CHUNK": 16, "STAGES": 3}),
]


@pytest.mark.parametrize("target,name,over", _AOT, ids=[f"{t}-{n}-{i}" for i, (t, n, _) in enumerate(_AOT)])
def test_aot_compiles_without_spills_and_smem_matches_estimate(target, name, over):
    shape = PARITY[name[2:]] if name.startswith("p:") else SHAPES[name]
    cfg = {**D, **over}
    assert lane.config_reason(cfg, shape) is None
    got = lane.compile_for(cfg, shape, target)
    assert got["binary"] == "cubin" and got["compile_s"] > 0
    assert 0 < got["registers"] <= 255 and got["spills"] == 0, got
    assert got["static_smem"] == 0
    assert got["smem_bytes"] <= get_profile("gb10" if target == "sm_121a" else "h100").smem_optin_bytes
    est = lane.smem_estimate(cfg, shape, target)
    if shape["dtype"] == "float32":
        assert est - cfg["STAGES"] * cfg["CHUNK"] * 4 <= got["smem_bytes"] <= est, (est, got)
    else:
        assert got["smem_bytes"] == est, (est, got)


@pytest.mark.parametrize("config,shape,msg", [
    ({"threads": 96}, "b2_n8", "threads"),
    ({"K_SPLIT": 3}, "b2_n8", "K_SPLIT"),
    ({"threads": 128, "K_SPLIT": 2}, "b2_n8", "multiple of 16 rows"),
    ({"CHUNK": 48}, "b2_n8", "CHUNK"),
    ({"STAGES": 1}, "b2_n8", "STAGES"),
    ({"FAST_TANH": 1}, "b2_n8", "FAST_TANH=1"),
    ({"PREC": "bf16x3"}, "b2_n8", "bfloat16 inputs"),
    ({"PREC": "bf16"}, "fp32_k64_v64", "float32 inputs need"),
    ({"PREC": "bf16x3", "threads": 64}, "fp32_k64_v64", "register budget"),
])
def test_config_rules(config, shape, msg):
    """Each refusal comes from the lane (what depends on the shape or on combinations) or, for a value
    the sweep file does not list, from the harness's check of the file (``harness_reason``)."""
    cfg, shp = {**D, **config}, SHAPES[shape]
    assert msg in (lane.config_reason(cfg, shp) or "") or msg in (harness_reason("m2rnn_fwd", "tilelang", cfg, shp) or "")


def test_shapes_the_lane_must_run_are_accepted():
    for name, shape in {**SHAPES, **{f"p:{k}": v for k, v in PARITY.items()}}.items():
        cfg = {**D, "PREC": "bf16x3"} if shape["dtype"] == "float32" else D
        assert lane.config_reason(cfg, shape) is None, name
    assert "V=8" in lane.config_reason(D, {**SHAPES["b2_n8"], "V": 8})
    assert "dtype" in lane.config_reason(D, {**SHAPES["b2_n8"], "dtype": "float16"})


def test_target_rules_and_eligibility():
    assert lane.eligibility("sm_75") and lane.eligibility("sm_121a") is None and lane.eligibility("sm_90a") is None
    pc = lane._pass_configs(D)
    assert pc["tl.disable_thread_storage_sync"] and pc["tl.disable_wgmma"]
    assert set(lane.versions()) >= {"tilelang", "torch"}


def test_sweep_file_seeds_are_valid():
    sp = space.load_space("m2rnn_fwd", "tilelang", lane.TUNABLES)
    assert sp.seeds and all(set(s) | set(sp.fixed_names) == set(lane.TUNABLES) for s in sp.seeds)
    for s in sp.seeds[:2]:
        for name in ("b2_n8", "b4_n44", "b8_n84", "ragged_h0"):
            assert lane.config_reason(s, SHAPES[name]) is None
    assert lane.config_reason(sp.seeds[2], SHAPES["fp32_k64_v64"]) is None
