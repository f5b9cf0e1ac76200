"""The CuTe DSL bwd_bwd lane (kernels/cute/mamba_bwd_bwd.py) on the CPU: its four kernels compile for
sm_90a and sm_121a at every named shape with the estimated shared memory (within GB10's 101,376 B on
sm_121a), no spills; what it cannot take is refused with a reason; every launch argument has the
element type its kernel was compiled for; and the kernels' own bodies, run on the CPU stand-in for
CuTe DSL (tests/cute_standin.py), match the reference on all 12 outputs at small shapes (index
arithmetic, views, operand orientation, barriers; the DSL's lowering is the GPU's to check)."""
from __future__ import annotations

import pytest
import torch

from lab import parity, space
from lab.problems import _mamba3 as m3
from lab.problems.mamba_bwd_bwd import MambaBwdBwd
from kernels.cute import mamba_bwd_bwd as lane
from tests import cute_standin as standin

GB10_SMEM = 101_376
PROBLEM = MambaBwdBwd()
SHAPES = space.load_shapes("mamba_bwd_bwd")[0]


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_named_shape_compiles_with_the_estimated_shared_memory(name, target, compiled):
    shape = space.get_shape("mamba_bwd_bwd", name)
    res = compiled(lane, dict(lane.DEFAULTS), shape, target)
    est = lane.smem_kernels(lane.DEFAULTS, shape, target)
    assert {k: v["smem_bytes"] for k, v in res["kernels"].items()} == est
    assert res["smem_bytes"] == lane.smem_estimate(lane.DEFAULTS, shape, target)
    assert target != "sm_121a" or res["smem_bytes"] <= GB10_SMEM, res["smem_bytes"]
    # No spills. At C*R = 32 ptxas keeps one 16 B loop-carried array of the value side in local memory
    # (sm_90a SASS: four floats stored before its P loop and read after it; 70 registers, no pressure).
    assert res["stack"] <= 16, {k: v["stack"] for k, v in res["kernels"].items()}


@pytest.mark.parametrize("target,path", [("sm_90a", "mma_sync"), ("sm_121a", "mma_sync"), ("sm_90a", "wgmma")])
def test_the_widest_tiles_compile_with_the_estimated_shared_memory(target, path, compiled):
    shape = space.get_shape("mamba_bwd_bwd", "h100_tuned")
    cfg = {"SCAN_BJ": 32, "SCAN_BP": 64, "KEY_BJ": 32, "KEY_BP": 64, "BLOCK_P": 64, "PATH": path}
    res = compiled(lane, cfg, shape, target)
    assert {k: v["smem_bytes"] for k, v in res["kernels"].items()} == lane.smem_kernels(cfg, shape, target)
    # The P loop's operands share a region with the later ones (key side), q_hat with the P loop's (value
    # side): even the widest tiles fit a GB10 at the largest named N.
    assert target != "sm_121a" or res["smem_bytes"] <= GB10_SMEM, res["smem_bytes"]


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_scan_prep_compiles_with_the_estimated_shared_memory(target, compiled):
    """SCAN_PREP: Prep is one more kernel, with no shared buffers (its figure is the static part); the
    scan that copies its operands keeps the scan's buffers."""
    shape = space.get_shape("mamba_bwd_bwd", "h100_tuned")
    cfg = {**lane.DEFAULTS, "SCAN_PREP": True}
    res = compiled(lane, cfg, shape, target)
    assert list(res["kernels"]) == list(lane.kernel_names(cfg)) == ["prep", *lane.KERNELS]
    assert {k: v["smem_bytes"] for k, v in res["kernels"].items()} == lane.smem_kernels(cfg, shape, target)
    assert res["stack"] <= 16, {k: v["stack"] for k, v in res["kernels"].items()}


WGMMA = {**lane.DEFAULTS, "PATH": "wgmma"}


def _ptx(kernel: str, cfg: dict, shape: dict, folder) -> str:
    """The PTX of one of the lane's kernels compiled for sm_90a (dumped into ``folder``)."""
    folder.mkdir(exist_ok=True)
    lane._compile(kernel, cfg, shape, "sm_90a", f"--keep-ptx --dump-dir {folder}")
    (ptx,) = [p.read_text() for p in folder.glob("*.ptx")]
    return ptx


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_wgmma_path_compiles_for_sm90a_with_the_estimated_shared_memory(name):
    """PATH=wgmma: the key and value kernels (their products on wgmma) compile for sm_90a at every
    named shape with C*R = 64 with the estimated shared memory, and emit wgmma; the other kernels are
    the mma_sync path's (their estimates do not depend on PATH). C*R = 32 is refused with its reason."""
    shape = space.get_shape("mamba_bwd_bwd", name)
    if shape["C"] * shape["R"] != 64:
        assert "PATH=wgmma takes 64 fused rows" in lane.config_reason(WGMMA, shape)
        return
    res = lane.compile_for(WGMMA, shape, "sm_90a", kernels=("key", "value"))
    est = lane.smem_kernels(WGMMA, shape, "sm_90a")
    assert {k: v["smem_bytes"] for k, v in res["kernels"].items()} == {k: est[k] for k in ("key", "value")}
    assert res["stack"] == 0, {k: v["stack"] for k, v in res["kernels"].items()}
    rest = lane.smem_kernels(lane.DEFAULTS, shape, "sm_90a")
    assert {k: v for k, v in est.items() if k not in ("key", "value")} == \
        {k: v for k, v in rest.items() if k not in ("key", "value")}


def test_the_scan_runs_wgmma_at_scan_bj_32(tmp_path):
    """PATH=wgmma with SCAN_BJ = 32 (M = 64 rows): the scan's q_hat^T dy on wgmma (both operands MN-major,
    K = C*R = 64: four m64n32k16 per chunk) with the estimated shared memory; with SCAN_BJ = 16 it stays
    on mma.sync."""
    shape = space.get_shape("mamba_bwd_bwd", "h100_tuned")
    for bj, count in ((32, 4), (16, 0)):
        cfg = {**WGMMA, "SCAN_BJ": bj}
        res = lane.compile_for(cfg, shape, "sm_90a", kernels=("scan",))
        assert res["smem_bytes"] == lane.smem_kernels(cfg, shape, "sm_90a")["scan"] and res["stack"] == 0, res
        ptx = _ptx("scan", cfg, shape, tmp_path / str(bj))
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n32k16") == count
        assert ("mma.sync" in ptx) == (count == 0)


def test_the_wgmma_path_emits_warpgroup_mma(tmp_path):
    """The PTX of the key kernel under PATH=wgmma: its products are wgmma (m64n64 for dkq, m64n32 for the
    pair products at KEY_BJ = 16), none is mma.sync, and the operand stores are fenced for the async proxy."""
    from cutlass.cute.runtime import make_fake_stream  # noqa: F401 (the DSL is importable)
    shape = space.get_shape("mamba_bwd_bwd", "gb10")
    ptx = _ptx("key", WGMMA, shape, tmp_path)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == 2      # dkq: K = KEY_BP = 32
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == 2 * 2 + 4 * 4
    assert "mma.sync" not in ptx and "ldmatrix" not in ptx
    assert ptx.count("fence.proxy.async.shared::cta") == 2


@pytest.mark.parametrize("target", ["sm_121a", "sm_120a"])
def test_the_wgmma_path_is_refused_off_sm90a(target):
    shape = space.get_shape("mamba_bwd_bwd", "gb10")
    why = lane.target_reason(WGMMA, target)
    assert why and "PATH=wgmma requires sm_90a" in why and target in why
    assert lane.target_reason(lane.DEFAULTS, target) is None and lane.target_reason(WGMMA, "sm_90a") is None
    with pytest.raises(ValueError, match=f"cannot compile for {target}: ineligible: PATH=wgmma"):
        lane.compile_for(WGMMA, shape, target)


def test_what_it_cannot_take_is_refused():
    sh = space.get_shape("mamba_bwd_bwd", "gb10")
    assert "C*R=128" in lane.config_reason({}, {**sh, "C": 32})
    assert "KEY_BJ=32" in lane.config_reason({"KEY_BJ": 32}, space.get_shape("mamba_bwd_bwd", "grid_n32_p64_r4_c16"))
    assert "BLOCK_P=64" in lane.config_reason({"BLOCK_P": 64}, {**sh, "P": 96})
    assert "dtype float32" in lane.config_reason({}, {**sh, "dtype": "float32"})
    assert "SCAN_BJ" in lane.config_reason({"SCAN_BJ": 64}, sh)   # the scan's own rule
    assert "no path for sm_80" in lane.eligibility("sm_80")
    assert "PATH 'tma' is not a path" in lane.config_reason({"PATH": "tma"}, sh)
    with pytest.raises(ValueError, match="cannot compile for sm_90a: C\\*R=128"):
        lane.compile_for({}, {**sh, "C": 32}, "sm_90a")


@pytest.mark.parametrize("prep", [False, True], ids=("split", "scan-prep"))
@pytest.mark.parametrize("opts", [
    {"hasZ": True, "hasD": True, "reduceO": True, "dtype": "bfloat16"},
    {"hasZ": False, "hasD": False, "reduceO": False, "dtype": "float16", "G": 2},
])
def test_every_argument_has_the_type_its_kernel_was_compiled_for(opts, prep):
    """The run-time pointers of each kernel, as ``run`` passes them, against the element types its
    program was compiled with: a tensor in the wrong place or of the wrong type shows here."""
    shape = {"B": 1, "S": 32, "H": 2, "G": 1, "N": 64, "P": 32, "R": 4, "C": 8, "rd": 4, **opts}
    prob = MambaBwdBwd()
    inputs, outputs = prob.make_inputs(shape, "cpu", 0), prob.alloc_outputs(shape, "cpu")
    config = {**lane.DEFAULTS, "SCAN_PREP": prep}
    work = lane.workspace(config, shape, inputs["Q"].dtype, "cpu")
    kinds = lane._kinds(shape)
    names = {torch.float32: "Float32", torch.bfloat16: "BFloat16", torch.float16: "Float16"}
    args = lane.arguments(inputs, outputs, work, shape)
    assert tuple(args) == lane.kernel_names(config)
    for kernel, tensors in args.items():
        got = [names[t.dtype] for t in tensors]
        assert got == [k.__name__ for k in kinds[kernel]], kernel
        assert all(t.is_contiguous() for t in tensors), kernel
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    assert work["rows"].shape == (B, H, nc, N // 2 // lane.DEFAULTS["KEY_BJ"], 3, C * R)


def _small(**kw) -> dict:
    base = {"B": 1, "S": 16, "H": 1, "G": 1, "N": 32, "P": 32, "R": 4, "C": 8, "rd": 4, "hasZ": True, "hasD": True,
            "reduceO": True, "dtype": "bfloat16"}
    return {**base, **kw}


WIDE = {"SCAN_BJ": 32, "SCAN_BP": 64, "KEY_BJ": 32, "KEY_BP": 64, "BLOCK_P": 64}
BODY_CASES = [
    pytest.param(_small(B=2, S=24), {}, id="bf16-options-on-b2-3-chunks"),
    pytest.param(_small(S=24, H=2, G=2, N=64, rd=2, hasZ=False, hasD=False, reduceO=False, dtype="float16"), {},
                 id="fp16-options-off-gqa-rd2-two-key-ctas"),
    pytest.param(_small(S=24, N=64, P=64, R=8, reduceO=False), WIDE, id="wide-tiles-r8-f64"),
    # SCAN_PREP: the scan copies Prep's q_hat * exp(DA_CS) and dy tiles (two pair blocks at N = 64).
    pytest.param(_small(B=2, S=24), {"SCAN_PREP": True}, id="bf16-scan-prep"),
    pytest.param(_small(S=24, H=2, G=2, N=64, rd=2, hasZ=False, hasD=False, reduceO=False, dtype="float16"),
                 {"SCAN_PREP": True}, id="fp16-options-off-gqa-scan-prep"),
    # PATH=wgmma (C*R = 64): the key, value and (SCAN_BJ = 32) scan kernels through _wgmma's helpers and
    # operand views (the bodies are the mma_sync path's otherwise: one case; two key CTAs a chunk).
    pytest.param(_small(S=32, N=64, C=16), {"PATH": "wgmma", "SCAN_BJ": 32}, id="wgmma-bf16-scan-too"),
]


@pytest.mark.parametrize("shape,config", BODY_CASES)
def test_kernel_bodies_match_the_reference(shape, config):
    """The lane's four kernels, their own bodies on the stand-in, against reference (2) in fp64."""
    PROBLEM.check_shape(shape)
    assert lane.config_reason(config, shape) is None
    inputs, outputs = PROBLEM.make_inputs(shape, "cpu", 5), PROBLEM.alloc_outputs(shape, "cpu")
    modules = standin.emulated()
    wgmma, full = config.get("PATH") == "wgmma", {**lane.DEFAULTS, **config}
    for ns, kernel in (("chunk", "Key"), ("chunk", "Value"), ("scan", "Scan")):   # the path's helpers
        assert (modules[ns][kernel](full, shape).mm.mma_ss is standin.wgmma_ss) == wgmma, kernel
    assert standin.run_lane(config, shape, inputs, outputs, modules) == \
        (["prep"] if config.get("SCAN_PREP") else []) + ["scan", "key", "value", "reduce"]
    ref = PROBLEM.reference(inputs, shape)
    tol, bands = PROBLEM.tolerance(shape), PROBLEM.output_tolerances(shape)
    ok, errors = parity.compare(outputs, ref, tol, bands)
    assert ok, parity.describe_failure(errors, tol, str(shape), bands)
    # With room: the stand-in multiplies exactly, so only the bf16 / fp16 operands' rounding is left
    # (measured: bf16 up to 4.5e-3, fp16 up to 5.4e-4).
    bound = 8e-3 if shape["dtype"] == "bfloat16" else 2e-3
    assert max(e.rel_l2 for e in errors.values()) < bound, errors


def _flip_factor(ns):
    good = ns["chunk"]["Views"].gates

    def bad(self, s_gate, *args):   # the per-row table with the factor's sign flipped
        good(self, s_gate, *args)
        tid = args[-1]
        if tid < self.F:
            s_gate[1, tid] = -s_gate[1, tid]
    ns["chunk"]["Views"].gates = bad
    return "DV"


def _untransposed_operands(ns):
    wm = ns["chunk"]["wm"]
    good = wm.operand

    def bad(buf, st, name, rows, cols, dt, transposed=False):   # a transposed operand view read as stored
        return buf.tensor(st, name, wm.row_major(cols, rows)) if transposed else good(buf, st, name, rows, cols, dt)
    wm.operand = bad     # _wgmma's views on the stand-in are these too
    return "DK"


@pytest.mark.parametrize("break_it,path", [(_flip_factor, "mma_sync"), (_untransposed_operands, "mma_sync"),
                                           (_untransposed_operands, "wgmma")],
                         ids=("gate-sign", "operand-view", "operand-view-wgmma"))
def test_the_stand_in_catches_a_wrong_body(break_it, path):
    """The check can fail: a sign in the gates, or a transposed operand view read as stored."""
    shape = _small(S=32, C=16) if path == "wgmma" else _small()
    modules = standin.emulated()
    wrong = break_it(modules)
    inputs, outputs = PROBLEM.make_inputs(shape, "cpu", 5), PROBLEM.alloc_outputs(shape, "cpu")
    standin.run_lane({"PATH": path}, shape, inputs, outputs, modules)
    ok, errors = parity.compare(outputs, PROBLEM.reference(inputs, shape), PROBLEM.tolerance(shape))
    assert not ok and not errors[wrong].ok(PROBLEM.tolerance(shape)), errors
