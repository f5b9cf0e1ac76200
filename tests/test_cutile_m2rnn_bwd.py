"""The cuTile m2rnn_bwd lane on the CPU: ahead-of-time compiles (tileiras) of both kernels for sm_90a and
sm_121a at the default shapes and the parity shape, the lane's refusals, and the kernels' own Python
bodies run against the BPTT reference through a small torch stand-in for ``cuda.tile`` (checks the
chunk / segment / scratch index arithmetic and the head broadcasting; not tileiras' lowering)."""
from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.cutile import m2rnn_bwd as lane
from lab import space
from lab.problems import _m2rnn as m2
from lab.problems.m2rnn_bwd import PROBLEM

D = lane.DEFAULTS
# The chunk walk at T = 2, CKPT 64 with the chain / store knobs at their neutral values: the base of the
# configs below (the defaults are WALK = "chain").
BASE = {**D, **lane.NEUTRAL, "WALK": "chunk", "CKPT": 64, "T": 2}


def cfg(**kw):
    return {**BASE, **kw}


def _shape(name):
    return space.get_shape("m2rnn_bwd", name)


# ---- AOT compiles -------------------------------------------------------------------------------

_LIMIT = {"sm_90a": 232_448, "sm_121a": 101_376}


def _check(got, config, shape, target):
    assert got["binary"] == "cubin" and got["compile_s"] > 0
    assert set(got["kernels"]) == {"forward", "backward"}
    assert 0 < got["smem_bytes"] <= lane.smem_estimate(config, shape, target) <= _LIMIT[target], got
    assert got["registers"] and got["registers"] <= 255, got


@pytest.mark.parametrize("target,names", [("sm_90a", ["b8_n84", "parity"]), ("sm_121a", ["b4_n44", "parity"])])
def test_default_compiles(target, names):
    """The defaults compile for both targets within the target's shared memory; the forward's occupancy
    hint (3 CTAs per SM) caps it at 80 registers (the backward's hint does not bind: tileiras took 255
    registers at T = 8, sm_90a AOT)."""
    for name in names:
        shape = PROBLEM.parity_shapes(_shape("b4_n44"))[0] if name == "parity" else _shape(name)
        got = lane.compile_for(D, shape, target)
        _check(got, D, shape, target)
        assert got["kernels"]["forward"]["registers"] <= 80


def test_sweep_config_compiles():
    # fp32 at the ragged shape (fp32 products), fused roles, short chunks, 8 worker warps; the step walk
    # (the defaults compile the chunk walk).
    shape = {**_shape("ragged_h0"), "dtype": "float32"}
    c = cfg(T=4, T_FWD=8, WALK="step", ROLES="fused", FAST_TANH=False, num_worker_warps=8, occupancy=0, CKPT=16)
    _check(lane.compile_for(c, shape, "sm_90a"), c, shape, "sm_90a")


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_chain_and_store_compile(target):
    """The two walks with parallel gradient programs: WALK=chain (one kernel, three roles) at b2_n8, and
    WALK=store (three kernels, int64-indexed scratch of 2.8e9 elements) at b8_n84."""
    # At occupancy 1 tileiras gave the sm_121a chain kernel 101,828 bytes of shared memory, over the 101,376
    # a block may have there (the preflight refuses such a compile); two CTAs per SM fit.
    chain = cfg(WALK="chain", DZ_STORE=True, SCRATCH="bfloat16", T_G=4, G_SPLIT=2, occupancy=2)
    _check(lane.compile_for(chain, _shape("b2_n8"), target), chain, _shape("b2_n8"), target)
    store = cfg(WALK="store", DZ_STORE=True, SCRATCH="bfloat16", T_FWD=8, T_G=8, G_SPLIT=16, occupancy=4,
                g_occupancy=2)
    got = lane.compile_for(store, _shape("b8_n84"), target)
    assert set(got["kernels"]) == {"forward", "backward", "gradients"}
    assert 0 < got["smem_bytes"] <= _LIMIT[target] and got["registers"] <= 255, got
    # The occupancy hint of 4 CTAs per SM holds the chain kernel to 128 registers or fewer.
    assert got["kernels"]["backward"]["registers"] <= 128, got


# On sm_121a these repeat the store walk compiled for it above, with the H100 winners' knobs: slow.
@pytest.mark.parametrize("target", ["sm_90a", pytest.param("sm_121a", marks=pytest.mark.slow)])
def test_h100_store_walk_winners_compile(target):
    # The b4_n44 H100 winner of 2026-11-23 (block-diagonal dW, the chain in 8 pieces): the piece length and
    # the chunk-indexed scratch are compile-time; no spills in the gradient kernel.
    piped = cfg(WALK="store", DZ_STORE=True, SCRATCH="bfloat16", T=4, T_FWD=8, T_G=4, G_SPLIT=16, DW="diag",
                PIPE=8, occupancy=6, g_occupancy=2)
    got = lane.compile_for(piped, _shape("b4_n44"), target)
    assert 0 < got["smem_bytes"] <= _LIMIT[target] and got["kernels"]["gradients"]["stack_bytes"] == 0, got
    # The kernels of 2026-11-23 (evening): Z stored (the gradients rebuild the states from range checkpoints),
    # the chain over two batch rows per program, one-hot products in the forward only.
    for store in ("z", "h"):
        rows = cfg(WALK="store", STORE=store, DZ_STORE=store == "h", SCRATCH="bfloat16", T=2, T_FWD=8, T_G=4,
                   G_SPLIT=16, DW="diag", PIPE=8, KV="fwd", C_ROWS=2, occupancy=4, fwd_occupancy=2, g_occupancy=2)
        got = lane.compile_for(rows, _shape("b8_n84"), target)
        assert 0 < got["smem_bytes"] <= _LIMIT[target] and got["kernels"]["backward"]["stack_bytes"] == 0, got
    # The b8_n84 H100 best of 2026-11-23 (late): per-step stores in the forward, Z per step in the chain, bf16
    # per-head gradient buffers; on sm_90a neither the chain (40 registers) nor the gradients (80) spill.
    best = cfg(WALK="store", SCRATCH="bfloat16", T=2, T_FWD=16, T_G=4, G_SPLIT=8, DW="diag", PIPE=8, KV="fwd",
               STEP_MMA="fwd", DQ="fwd", FWD_STORE="step", CHAIN_Z="step", PARTIALS="bfloat16", occupancy=6,
               fwd_occupancy=3, g_occupancy=3)
    got = lane.compile_for(best, _shape("b8_n84"), target)
    assert 0 < got["smem_bytes"] <= _LIMIT[target], got
    if target == "sm_90a":
        assert got["kernels"]["backward"]["stack_bytes"] == got["kernels"]["gradients"]["stack_bytes"] == 0, got


@pytest.mark.slow    # pins SASS instruction counts; the compiles above cover the code paths
def test_fast_tanh_is_mufu():
    """FAST_TANH is real: APPROX lowers to MUFU.TANH (tanh.approx.f32), FULL to a software tanh."""
    import subprocess
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump in the Triton wheel to read the SASS")
    counts = {}
    for fast in (True, False):
        cubin = lane.compile_cubins(cfg(FAST_TANH=fast), _shape("b2_n8"), "sm_90a", which=("forward",))["forward"]
        path = Path(f"/tmp/_cutile_m2rnn_bwd_{os.getpid()}_{fast}.cubin")
        path.write_bytes(cubin)
        try:
            counts[fast] = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True,
                                          check=True).stdout.count("MUFU.TANH")
        finally:
            path.unlink()
    assert counts[True] > 0 and counts[False] == 0, counts


def _sass(config, shape):
    """{kernel name: sm_90a SASS text} of a store-walk config (cuobjdump from the Triton wheel)."""
    import subprocess
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        pytest.skip("no cuobjdump in the Triton wheel to read the SASS")
    out = {}
    for name, cubin in lane.compile_cubins(config, shape, "sm_90a", which=("forward", "backward", "gradients")).items():
        path = Path(f"/tmp/_cutile_m2rnn_bwd_{os.getpid()}_{name}.cubin")
        path.write_bytes(cubin)
        try:
            out[name] = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True,
                                       check=True).stdout
        finally:
            path.unlink()
    return out


@pytest.mark.slow    # pins SASS instruction counts; the compiles above cover the code paths
def test_chain_z_step_keeps_one_mma_layout():
    """CHAIN_Z is real: at the b8_n84 H100 best of 2026-11-23 (13.92 ms) the chain with Z per step has only
    warpgroup wgmmas (the per-step Z in the serial product's layout), the per-chunk recompute a warp-level
    mma.sync too, whose accumulator layout sends dz through shared memory with more block barriers. The
    storing forward with FWD_STORE = step holds one 16-byte global store per step and an mma.sync (dq)."""
    best = {**D, "CKPT": 64, "T": 2, "T_FWD": 16, "WALK": "store", "T_G": 4, "G_SPLIT": 8, "DZ_STORE": False,
            "DW": "diag", "PIPE": 8, "KV": "fwd", "STEP_MMA": "fwd", "DQ": "fwd", "FWD_STORE": "step",
            "CHAIN_Z": "step", "PARTIALS": "bfloat16", "occupancy": 6, "fwd_occupancy": 3, "g_occupancy": 3}
    step = _sass(best, _shape("b8_n84"))
    chunk = _sass({**best, "CHAIN_Z": "chunk"}, _shape("b8_n84"))
    assert "HGMMA" in step["backward"] and "HMMA" not in step["backward"]
    assert "HMMA" in chunk["backward"]
    assert step["backward"].count("BAR.SYNC") < chunk["backward"].count("BAR.SYNC")
    assert step["forward"].count("STG.E.128") == 16 and "HMMA" in step["forward"]


@pytest.mark.slow    # pins SASS instruction counts; the compiles above cover the code paths
def test_step_mma_batched_is_mma_sync():
    """STEP_MMA is real: at the b8_n84 H100 best of 2026-11-23 (WALK = store) the storing forward and the
    chain hold warpgroup wgmmas (HGMMA) with 2-D serial products and only warp-level HMMA where batched
    (both kernels with "batched", the forward alone with "fwd"); the gradient kernel, whose products are
    not serial, has the same wgmmas either way."""
    best = {**D, "CKPT": 64, "T": 2, "T_FWD": 8, "WALK": "store", "T_G": 4, "G_SPLIT": 16, "DZ_STORE": False,
            "DW": "diag", "PIPE": 8, "occupancy": 6, "fwd_occupancy": 3, "g_occupancy": 2}
    sass = {}
    for mode in lane.STEP_MMAS:
        for name, text in _sass({**best, "STEP_MMA": mode}, _shape("b8_n84")).items():
            sass[mode, name] = text
    for mode, name in (("batched", "forward"), ("batched", "backward"), ("fwd", "forward")):
        assert "HGMMA" in sass["2d", name] and "HGMMA" not in sass[mode, name] and "HMMA" in sass[mode, name]
    assert sass["fwd", "backward"].count("HGMMA") == sass["2d", "backward"].count("HGMMA") > 0
    assert len({sass[mode, "gradients"].count("HGMMA") for mode in lane.STEP_MMAS} - {0}) == 1


# ---- rules --------------------------------------------------------------------------------------

def test_config_rules():
    shape = _shape("b2_n8")
    assert lane.config_reason(D, shape) is None and lane.config_reason(BASE, shape) is None
    assert set(D) == set(lane.TUNABLES)
    assert "CKPT" in lane.config_reason(cfg(CKPT=24), shape)
    assert "CKPT" in lane.config_reason(cfg(CKPT=8), shape)
    assert "T=" in lane.config_reason(cfg(T=32, CKPT=32), shape)
    assert "T=" in lane.config_reason(cfg(T=3), shape)
    assert "T_FWD" in lane.config_reason(cfg(T_FWD=64), shape)
    assert "ROLES" in lane.config_reason(cfg(ROLES="both"), shape)
    assert "stacked" in lane.config_reason(cfg(T=16, CKPT=16), {**shape, "V": 32})
    assert "fwd_occupancy" in lane.config_reason(cfg(fwd_occupancy=33), shape)
    assert "DOT" in lane.config_reason(cfg(DOT="fp8"), shape)
    assert "STEP_MMA" in lane.config_reason(cfg(STEP_MMA="3d"), shape)
    assert "STEP_MMA" in lane.config_reason(cfg(STEP_MMA=["fwd"]), shape)
    assert "DQ=fwd" in lane.config_reason(cfg(DQ="fwd"), shape)
    assert "DQ=" in lane.config_reason(cfg(DQ=True, WALK="store"), shape)
    assert "DQ=" in lane.config_reason(cfg(DQ="dy", WALK="store"), shape)
    assert lane.config_reason(cfg(DQ="fwd", WALK="store"), shape) is None
    assert lane.config_reason(cfg(DQ="chain", WALK="store"), shape) is None
    assert "DQ=chain" in lane.config_reason(cfg(DQ="chain", WALK="store", STORE="z", DW="diag"), shape)
    assert "DQ=chain" in lane.config_reason(cfg(DQ="chain", WALK="store", DZ_STORE=True), shape)
    assert "FWD_STORE" in lane.config_reason(cfg(FWD_STORE="steps", WALK="store"), shape)
    assert "FWD_STORE=step" in lane.config_reason(cfg(FWD_STORE="step", WALK="chain"), shape)
    assert "FWD_STORE=step" in lane.config_reason(cfg(FWD_STORE="step", WALK="store", DQ="fwd", T_FWD=4), shape)
    assert lane.config_reason(cfg(FWD_STORE="step", WALK="store", DQ="fwd", T_FWD=8), shape) is None
    assert "CHAIN_Z=step" in lane.config_reason(cfg(CHAIN_Z="step", WALK="store", DZ_STORE=True), shape)
    assert "CHAIN_Z=step" in lane.config_reason(cfg(CHAIN_Z="step", WALK="store", DQ="chain"), shape)
    assert lane.config_reason(cfg(CHAIN_Z="step", WALK="store"), shape) is None
    assert "PARTIALS" in lane.config_reason(cfg(PARTIALS="float16", WALK="store"), shape)
    assert "PARTIALS=bfloat16" in lane.config_reason(cfg(PARTIALS="bfloat16", WALK="chain"), shape)
    assert "FAST_TANH" in lane.config_reason(cfg(FAST_TANH=1), shape)
    assert "num_worker_warps" in lane.config_reason(cfg(num_worker_warps=3), shape)
    assert "T_RE" in lane.config_reason(cfg(T_RE=32, CKPT=16), shape)
    assert "T_RE" in lane.config_reason(cfg(T_RE=2, T=4), shape)
    assert "KV" in lane.config_reason(cfg(KV="dot"), shape)
    assert "KV=mma" in lane.config_reason(cfg(KV="mma", T_RE=16), {**shape, "dtype": "float32"})
    assert lane.config_reason(cfg(KV="mma", T=2, T_RE=16), shape) is None
    assert "dtype" in lane.config_reason(D, {**shape, "dtype": "float16"})
    chain = cfg(WALK="chain")
    assert lane.config_reason(cfg(WALK="chain", SCRATCH="bfloat16", DZ_STORE=True, G_SPLIT=4, T_G=16), shape) is None
    assert "ROLES must be split" in lane.config_reason({**chain, "ROLES": "fused"}, shape)
    assert "WALK=chain / store only" in lane.config_reason(cfg(SCRATCH="bfloat16"), shape)
    assert "WALK=chain / store only" in lane.config_reason(cfg(G_SPLIT=2), shape)
    assert "WALK=chain / store only" in lane.config_reason(cfg(g_occupancy=2), shape)
    store = cfg(WALK="store", DZ_STORE=True, G_SPLIT=64, T_G=16, g_occupancy=4)
    assert lane.config_reason(store, shape) is None
    assert "CKPT must stay" in lane.config_reason({**store, "CKPT": 32}, shape)
    assert "T_RE 0" in lane.config_reason({**store, "T_RE": 8}, shape)
    assert lane.config_reason({**store, "DZ_STORE": False}, shape) is None
    assert "ROLES must be split" in lane.config_reason({**store, "ROLES": "fused"}, shape)
    assert "G_SPLIT" in lane.config_reason({**chain, "G_SPLIT": 3}, shape)
    assert "T_G" in lane.config_reason({**chain, "T_G": 32, "CKPT": 16}, shape)
    assert "SCRATCH" in lane.config_reason({**chain, "SCRATCH": "float16"}, shape)
    assert "DOT=input" in lane.config_reason({**chain, "SCRATCH": "bfloat16", "DOT": "tf32"}, shape)
    assert "bf16 inputs" in lane.config_reason({**chain, "SCRATCH": "bfloat16"}, {**shape, "dtype": "float32"})
    assert "DZ_STORE" in lane.config_reason({**chain, "DZ_STORE": 1}, shape)
    assert "exceeds" in lane.config_reason(D, {**shape, "K": 128})
    assert "exceeds" in lane.config_reason(D, _shape("fp32_k64_v64"))
    for name in ("b2_n8", "b4_n44", "b8_n84", "b4_n132", "ragged_h0"):
        assert lane.config_reason(D, _shape(name)) is None, name
        for parity in PROBLEM.parity_shapes(_shape(name)):
            assert lane.config_reason(D, parity) is None, name
    # The store walk's knobs of 2026-11-23 (evening).
    store = cfg(WALK="store", DZ_STORE=True, DW="diag", T_G=4, G_SPLIT=16, PIPE=8)
    assert lane.config_reason(store, _shape("b8_n84")) is None
    assert "KV=fwd" in lane.config_reason(cfg(KV="fwd"), shape)
    assert "bf16" in lane.config_reason({**store, "KV": "fwd"}, {**shape, "dtype": "float32"})
    assert "C_ROWS" in lane.config_reason(cfg(C_ROWS=2), shape)
    assert "divide B" in lane.config_reason({**store, "C_ROWS": 4}, shape)          # B = 2
    assert "C_ROWS=2" in lane.config_reason({**store, "C_ROWS": 2, "DZ_STORE": False}, shape)
    assert "C_ROWS=2" in lane.config_reason({**store, "C_ROWS": 2, "KV": "mma"}, shape)
    assert lane.config_reason({**store, "C_ROWS": 2}, shape) is None
    assert "STORE" in lane.config_reason(cfg(STORE="z"), shape)
    assert "DZ_STORE=false" in lane.config_reason({**store, "STORE": "z"}, shape)
    zs = {**store, "STORE": "z", "DZ_STORE": False}
    assert lane.config_reason(zs, shape) is None
    # 512-step pieces in 64 ranges of 8 steps: chunks of 16 steps do not fit a range.
    assert "whole chunks" in lane.config_reason({**zs, "T_G": 16, "G_SPLIT": 64}, _shape("b8_n84"))


def test_target_rules():
    assert lane.eligibility("sm_90a") is None and lane.eligibility("sm_121a") is None
    assert "sm_75" in lane.eligibility("sm_75")
    with pytest.raises(ValueError, match="CKPT"):
        lane.compile_for(cfg(CKPT=7), _shape("b2_n8"), "sm_90a")


# ---- the kernel bodies on torch -----------------------------------------------------------------

def _fake_ct():
    """Enough of cuda.tile's surface for the two kernels, on CPU torch tensors (fp64 math)."""
    f64 = torch.float64
    t = types.SimpleNamespace()
    t.Constant = type("Constant", (), {"__class_getitem__": classmethod(lambda cls, item: item)})
    t.PaddingMode = types.SimpleNamespace(ZERO="zero")
    t.RoundingMode = types.SimpleNamespace(APPROX="approx", FULL="full")
    t.float32, t.tfloat32, t.bfloat16, t.int32 = f64, f64, torch.bfloat16, torch.int32
    t.pid = (0, 0)
    t.bid = lambda axis: t.pid[axis]
    t.cdiv = lambda a, b: -(-a // b)

    def _window(arr, index, shape, order):
        """Array slices of the tile at grid ``index`` (tile axis j is array axis order[j])."""
        order = order or tuple(range(len(shape)))
        src = [None] * len(shape)
        for j, a in enumerate(order):
            src[a] = slice(index[j] * shape[j], min((index[j] + 1) * shape[j], arr.shape[a]))
        return tuple(src), order

    def load(arr, index, shape, order=None, padding_mode=None, **kw):
        src, order = _window(arr, index, shape, order)
        assert all(sl.stop > sl.start for sl in src), "tile wholly outside the array"
        out = torch.zeros(shape, dtype=arr.dtype)
        part = arr[src].permute(order)
        out[tuple(slice(0, n) for n in part.shape)] = part
        return out

    def store(arr, index, tile, order=None, **kw):
        dst, order = _window(arr, index, tile.shape, order)
        assert all(sl.stop > sl.start for sl in dst), "tile wholly outside the array"
        inv = [order.index(a) for a in range(len(order))]
        part = tile.permute(inv)
        arr[dst] = part[tuple(slice(0, sl.stop - sl.start) for sl in dst)].to(arr.dtype)

    def extract(x, index, shape):
        return x[tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, shape))].clone()

    def insert(x, index, value):
        out = x.clone()
        out[tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, value.shape))] = value
        return out

    t.load, t.store, t.extract, t.insert = load, store, extract, insert
    t.zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    t.arange = lambda n, dtype: torch.arange(n, dtype=dtype)
    t.where = lambda c, x, y: torch.where(c, x, torch.as_tensor(y, dtype=x.dtype))
    t.static_iter = lambda it: it
    t.mma = lambda a, b, acc: a.to(f64) @ b.to(f64) + acc
    t.tanh = lambda x, rounding_mode=None: torch.tanh(x)
    t.transpose = lambda x: x.transpose(-1, -2)
    t.permute = lambda x, axes: x.permute(axes)
    t.sum = lambda x, axis=None, keepdims=False: x.sum() if axis is None else x.sum(axis, keepdim=keepdims)
    return t


def _emulated_lane():
    src = Path(lane.__file__).read_text().replace("import cuda.tile as ct\n", "")
    fake = _fake_ct()
    ns = {"__name__": "_emulated_cutile_m2rnn_bwd", "ct": fake}
    exec(compile(src, lane.__file__, "exec"), ns)
    return ns, fake


@pytest.fixture
def tile_methods(monkeypatch):
    """Tile.astype on torch tensors, for the kernel bodies; torch.empty poisoned with NaN so that a read
    of a scratch element no launch wrote shows up; no CUDA stream on the CPU."""
    monkeypatch.setattr(torch.Tensor, "astype", lambda self, dtype: self.to(dtype), raising=False)
    full = torch.full
    monkeypatch.setattr(torch, "empty", lambda *size, **kw: full(size, float("nan"), **kw))
    stream = types.SimpleNamespace(wait_stream=lambda other: None, wait_event=lambda event: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: types.SimpleNamespace(**vars(stream)))
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda stream: None))


def _emulate(config, shape, inputs):
    """lane.build's own run (its launch schedule and buffer rotation) with ct.launch a loop over the
    programs, each kernel body run on torch."""
    ns, fake = _emulated_lane()
    launches = []

    def launch(stream, grid, kernel, args):
        launches.append(kernel.__name__)
        for pid in range(grid[0]):
            for role in range(grid[1]):
                fake.pid = (pid, role)
                kernel(*args)

    fake.launch = launch
    fake.kernel = lambda fn, **kw: fn
    run = ns["build"](config, shape)
    outputs = PROBLEM.alloc_outputs(shape, "cpu")
    info = run(inputs, outputs)
    nseg = ns["_nseg"]({**D, **config}, shape)
    chain = {**D, **config}["WALK"] == "chain"
    if {**D, **config}["WALK"] == "store":
        zs, rows = {**D, **config}["STORE"] == "z", {**D, **config}["C_ROWS"] > 1
        assert launches == ["_fwd_zs" if zs else "_fwd_store"] + \
            ["_chain_rows" if rows else "_chain_all", "_grads_zs_all" if zs else "_grads_all"] * \
            ns["pieces"]({**D, **config}, shape)
    else:
        assert launches == ["_fwd_ckpt"] + (["_seg3"] * (nseg + 2) if chain else ["_seg"] * (nseg + 1))
    assert info["launches"] == len(launches)
    return outputs


def test_schedule_orders_buffers_by_launches():
    """Every segment is recomputed once and walked once, last to first, walked in the launch after its
    recompute and from the scratch buffer that recompute wrote; no launch reads the buffer it writes."""
    for S, ck in ((29, 8), (4096, 32), (977, 64), (64, 64), (65, 64)):
        nseg = -(-S // ck)
        plan = lane.schedule(nseg, S, ck)
        assert len(plan) == nseg + 1
        written = {}
        for m, (jw, lw, jr, lr) in enumerate(plan):
            si, so = (nseg - m) % 2, (nseg - m + 1) % 2
            assert si != so
            if lw:
                assert jw == nseg - m and written[jw] == (m - 1, si) and lw == min(ck, S - jw * ck)
            if lr:
                assert jr == nseg - m - 1 and lr == min(ck, S - jr * ck) and jr % 2 == so
                written[jr] = (m, so)
        assert sorted(written) == list(range(nseg))
        assert sum(p[1] for p in plan) == S and sum(p[3] for p in plan) == S


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


_BODY_CONFIGS = [(cfg(CKPT=16, T=4, T_FWD=8, WALK="step"), "float32"),
                 (cfg(CKPT=16, T=8, T_FWD=4, WALK="step", ROLES="fused"), "float32"),
                 (cfg(CKPT=16, T=16, T_FWD=16, WALK="step"), "bfloat16"),
                 (cfg(CKPT=16, T=4, T_FWD=8, WALK="chunk"), "float32"),
                 (cfg(CKPT=16, T=2, T_FWD=4, WALK="chunk", ROLES="fused"), "float32"),
                 (cfg(CKPT=16, T=8, T_FWD=16, WALK="chunk"), "bfloat16"),
                 (cfg(CKPT=16, T=2, T_FWD=16, T_RE=16, KV="mma"), "bfloat16"),
                 (cfg(CKPT=16, T=4, T_FWD=16, T_RE=16, KV="mma", ROLES="fused"), "bfloat16"),
                 # chunks shorter than the 16-step window of the one-hot products
                 (cfg(CKPT=32, T=2, T_FWD=8, KV="mma"), "bfloat16"),
                 (cfg(CKPT=16, T=4, T_FWD=4, T_RE=8, KV="mma", ROLES="fused"), "bfloat16"),
                 # the chain walk: gradient chunks longer than the chain's and the
                 # recompute's (rows past S unwritten), split gradient programs
                 (cfg(CKPT=16, T=2, T_FWD=8, WALK="chain", T_G=8, G_SPLIT=2), "float32"),
                 (cfg(CKPT=16, T=4, T_RE=8, WALK="chain", T_G=4, DZ_STORE=True, G_SPLIT=4),
                  "float32"),
                 (cfg(CKPT=32, T=2, T_FWD=8, WALK="chain", T_G=16, KV="mma", DZ_STORE=True,
                      SCRATCH="bfloat16"), "bfloat16"),
                 (cfg(CKPT=16, T=8, T_FWD=16, WALK="chain", T_G=2, SCRATCH="bfloat16"),
                  "bfloat16"),
                 # every state stored: chunks of the forward, the chain and the
                 # gradients all different, more gradient programs than chunks
                 (cfg(WALK="store", DZ_STORE=True, T=2, T_FWD=8, T_G=4, G_SPLIT=8),
                  "float32"),
                 (cfg(WALK="store", DZ_STORE=True, T=4, T_FWD=2, T_G=16, G_SPLIT=2,
                      KV="mma", SCRATCH="bfloat16"), "bfloat16"),
                 (cfg(WALK="store", T=8, T_FWD=4, T_G=2, G_SPLIT=4), "float32"),
                 # dW as block-diagonal products: 4 steps each (two per chunk of 8),
                 # 2 (the whole chunk), bf16 scratch operands straight from the load
                 (cfg(WALK="store", DZ_STORE=True, T=2, T_FWD=8, T_G=8, G_SPLIT=2,
                      DW="diag"), "float32"),
                 (cfg(CKPT=16, T=4, WALK="chain", T_G=2, G_SPLIT=2, DW="diag"), "float32"),
                 (cfg(WALK="store", T=4, T_FWD=4, T_G=4, G_SPLIT=4, DW="diag",
                      SCRATCH="bfloat16"), "bfloat16"),
                 # the chain in pieces of 16 steps (the last one shorter when
                 # ragged), each piece's gradients after it
                 (cfg(WALK="store", DZ_STORE=True, T=4, T_FWD=8, T_G=8, G_SPLIT=2,
                      DW="diag", PIPE=2), "float32"),
                 (cfg(WALK="store", T=2, T_FWD=4, T_G=4, G_SPLIT=1, PIPE=4,
                      SCRATCH="bfloat16"), "bfloat16"),
                 # Z stored, the states rebuilt per gradient range from checkpoints:
                 # ranges of 16 steps (PL 32 / 2), of 4 in two pieces (PL 16 / 4),
                 # bf16 with one-hot k v^T
                 (cfg(WALK="store", STORE="z", T=4, T_FWD=8, T_G=4, G_SPLIT=2,
                      DW="diag"), "float32"),
                 (cfg(WALK="store", STORE="z", T=2, T_FWD=4, T_G=2, G_SPLIT=4, PIPE=2,
                      DW="diag"), "float32"),
                 (cfg(WALK="store", STORE="z", T=4, T_FWD=16, T_G=8, G_SPLIT=2, KV="mma",
                      DW="diag", SCRATCH="bfloat16"), "bfloat16"),
                 # one-hot products in the forward only; the chain over both batch
                 # rows of a head in one program (dz stored, or from Z)
                 (cfg(WALK="store", DZ_STORE=True, T=4, T_FWD=8, T_G=4, G_SPLIT=2,
                      KV="fwd", DW="diag", SCRATCH="bfloat16", PIPE=2), "bfloat16"),
                 (cfg(WALK="store", DZ_STORE=True, T=2, T_FWD=4, T_G=4, G_SPLIT=4,
                      C_ROWS=2, DW="diag", PIPE=2), "float32"),
                 (cfg(WALK="store", STORE="z", T=8, T_FWD=4, T_G=4, G_SPLIT=2, C_ROWS=2,
                      KV="fwd", DW="diag", SCRATCH="bfloat16"), "bfloat16"),
                 # the serial products as a batch of one (forward step, chain, walk)
                 (cfg(WALK="store", T=2, T_FWD=8, T_G=4, G_SPLIT=4, DW="diag", PIPE=2,
                      STEP_MMA="batched", SCRATCH="bfloat16"), "bfloat16"),
                 (cfg(WALK="store", DZ_STORE=True, T=2, T_FWD=4, T_G=4, G_SPLIT=4,
                      C_ROWS=2, DW="diag", STEP_MMA="batched"), "float32"),
                 (cfg(CKPT=16, T=4, T_FWD=8, WALK="chunk", STEP_MMA="batched"),
                  "float32"),
                 (cfg(WALK="store", T=4, T_FWD=8, T_G=4, G_SPLIT=2, DW="diag",
                      STEP_MMA="fwd"), "float32"),
                 # dq in the storing forward or in the chain (the gradient kernel
                 # takes none)
                 (cfg(WALK="store", T=2, T_FWD=4, T_G=4, G_SPLIT=2, DW="diag", PIPE=2,
                      DQ="fwd"), "float32"),
                 (cfg(WALK="store", DZ_STORE=True, T=4, T_FWD=8, T_G=2, G_SPLIT=4,
                      DW="diag", DQ="fwd", SCRATCH="bfloat16"), "bfloat16"),
                 (cfg(WALK="store", T=4, T_FWD=2, T_G=8, G_SPLIT=2, DW="diag", PIPE=2,
                      DQ="chain"), "float32"),
                 (cfg(WALK="store", T=2, T_FWD=8, T_G=4, G_SPLIT=4, DW="diag", KV="fwd",
                      DQ="chain", SCRATCH="bfloat16"), "bfloat16"),
                 # the storing forward with one store per step (dq as one-hot
                 # products; dz per step too)
                 (cfg(WALK="store", T=2, T_FWD=8, T_G=4, G_SPLIT=4, DW="diag", KV="fwd",
                      DQ="fwd", FWD_STORE="step", SCRATCH="bfloat16", PIPE=2),
                  "bfloat16"),
                 (cfg(WALK="store", DZ_STORE=True, T=4, T_FWD=16, T_G=2, G_SPLIT=2,
                      DW="diag", DQ="fwd", FWD_STORE="step"), "float32"),
                 (cfg(WALK="store", T=2, T_FWD=4, T_G=4, G_SPLIT=2, DW="diag",
                      FWD_STORE="step"), "float32"),
                 # the chain's Z per step
                 (cfg(WALK="store", T=2, T_FWD=16, T_G=4, G_SPLIT=4, DW="diag", KV="fwd",
                      DQ="fwd", FWD_STORE="step", CHAIN_Z="step", SCRATCH="bfloat16",
                      PIPE=2), "bfloat16"),
                 (cfg(WALK="store", T=4, T_FWD=8, T_G=2, G_SPLIT=2, DW="diag",
                      CHAIN_Z="step", STEP_MMA="batched"), "float32"),
                 # bf16 per-value-head gradient buffers
                 (cfg(WALK="store", T=2, T_FWD=8, T_G=4, G_SPLIT=2, DW="diag", KV="fwd",
                      DQ="fwd", FWD_STORE="step", CHAIN_Z="step", PARTIALS="bfloat16",
                      SCRATCH="bfloat16"), "bfloat16"),
                 (cfg(WALK="store", STORE="z", T=2, T_FWD=4, T_G=2, G_SPLIT=4, DW="diag",
                      PARTIALS="bfloat16"), "bfloat16")]


def _body_cases():
    """S = 29: ragged (not a multiple of T or CKPT), rows past S masked; S = 32: every chunk full, no mask.
    The chain and store walks take their unmasked branches at S = 32 (the RAG constant false); the step
    and chunk walks have no such constant, so at S = 32 they run the code S = 29 runs: those are slow."""
    for S in (29, 32):
        for i, (config, dtype) in enumerate(_BODY_CONFIGS):
            same_code = S == 32 and config["WALK"] not in ("chain", "store")
            yield pytest.param(config, dtype, S, id=f"{S}-config{i}-{dtype}",
                               marks=[pytest.mark.slow] if same_code else [])


@pytest.mark.parametrize("config,dtype,S", list(_body_cases()))
def test_kernel_bodies_match_bptt(config, dtype, S, tile_methods):
    if config["WALK"] in ("chain", "store"):
        assert lane._ragged({**D, **config}, _bodies_shape(S, dtype)) == (S == 29)
    _check_bodies(config, _bodies_shape(S, dtype))


def test_store_z_empty_range(tile_methods):
    """STORE = z at S = 20: ranges of 8 steps in a piece of 32, so the last gradient program has no steps
    (its checkpoint index clamped, its dW part zero) and the one before it 4."""
    config = cfg(WALK="store", STORE="z", T=2, T_FWD=4, T_G=2, G_SPLIT=4, DW="diag")
    assert lane.piece_len({**D, **config}, _bodies_shape(20, "float32")) == 32
    _check_bodies(config, _bodies_shape(20, "float32"))


def _bodies_shape(S, dtype):
    # Padded K and V, every head-sharing pattern, h0.
    return {"B": 2, "S": S, "N": 4, "Nq": 1, "Nk": 2, "Nw": 1, "Nf": 4, "K": 20, "V": 12, "h0": True,
            "dtype": dtype}


def _check_bodies(config, shape):
    # fp64 stands in for the kernels' fp32 math (the lane's buffers are fp32) and bf16 operands (DOT=input)
    # stay bf16-rounded, so the bound differs.
    inputs = {n: x.double() for n, x in m2.make_inputs(shape, "cpu", 3, backward=True).items()}
    got = _emulate(config, shape, inputs)
    ref = m2.bptt_backward(inputs, shape, torch.float64)
    assert set(got) == set(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape, name
        assert torch.isfinite(got[name]).all(), name
        err = (got[name].double() - ref[name]).norm() / ref[name].norm()
        assert err < (1e-5 if lane.dot_mode(config, shape) % 4 == 3 else 2e-2), (name, float(err))
