"""The cuTile M2RNN forward lane on the CPU: ahead-of-time compiles (tileiras) for sm_90a and sm_121a at
the default shapes and a parity shape, resources read from the cubins, the lane's refusals, and the
kernel body run under a NumPy model of the cuTile ops it uses (indexing, chunk padding, head
sharing, K slabs against the reference).

No GPU is needed: cuTile exports cubins for an explicit target (``export_kernel(gpu_code=...)``)."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.cutile import m2rnn_fwd as lane
from lab import space
from lab.problems import _m2rnn as m2

SHAPES, DEFAULT = space.load_shapes("m2rnn_fwd")
D = lane.DEFAULTS


def parity(shape: dict) -> dict:
    share = {n: (1 if shape[n] < shape["N"] else 4) for n in ("Nq", "Nk", "Nw", "Nf")}
    return {**shape, "B": 2, "S": 977, "N": 4, **share, "h0": True}


def check_resources(got: dict, config: dict, shape: dict, target: str, spills_ok: bool = False):
    assert got["binary"] == "cubin" and got["compile_s"] > 0
    assert 0 < got["smem_bytes"] <= lane.smem_estimate(config, shape, target), got
    assert got["registers"] and got["registers"] <= 255, got
    if not spills_ok:
        assert got["stack_bytes"] == 0, got


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("shape", ["b8_n84", "ragged_parity"])
def test_default_compiles(target, shape):
    """The default config at a default shape and at the parity shape of ragged_h0 (h0, a ragged S,
    Nk < N and one shared W): no spills, shared memory within the target's bound."""
    s = parity(SHAPES["ragged_h0"]) if shape == "ragged_parity" else SHAPES[shape]
    assert lane.config_reason(D, s) is None
    check_resources(lane.compile_for(D, s, target), D, s, target)


def test_seeds_compile_sm90():
    """Every [[seed]] of sweeps/m2rnn_fwd/cutile.toml compiles for sm_90a at b2_n8 (the parity shape of
    b4_n44 for one of them: shared q/k); all are accepted for every default shape."""
    sp = space.load_space("m2rnn_fwd", "cutile", lane.TUNABLES)
    assert sp.seeds and sp.seeds[0] == {k: v for k, v in D.items() if k in sp.params}
    for i, seed in enumerate(sp.seeds[1:]):
        assert sp.rule_reason(seed) is None
        for name in DEFAULT:
            assert lane.config_reason(seed, SHAPES[name]) is None, (seed, name)
        s = parity(SHAPES["b4_n44"]) if i == 0 else SHAPES["b2_n8"]
        check_resources(lane.compile_for(seed, s, "sm_90a"), seed, s, "sm_90a")


def test_fp32_compiles():
    """fp32 inputs (K = V = 64): an fp32 product (FFMA) on 16-row slabs; sm_121a too."""
    s = SHAPES["fp32_k64_v64"]
    cfg = {**D, "K_SPLIT": 4, "T": 8, "occupancy": 0, "KV": "outer"}   # fp32: no exact bf16 k v^T product
    assert lane.config_reason(D, s)          # the stacked 64 x 64 states do not fit
    assert lane.config_reason(cfg, s) is None
    for target in ("sm_90a", "sm_121a"):
        check_resources(lane.compile_for(cfg, s, target), cfg, s, target, spills_ok=True)


def test_config_rules():
    b = SHAPES["b2_n8"]
    assert set(D) == set(lane.TUNABLES)
    assert "num_worker_warps" in lane.config_reason({"num_worker_warps": 2}, b)
    assert "occupancy" in lane.config_reason({"occupancy": 33}, b)
    assert "T=12" in lane.config_reason({"T": 12}, b)
    assert "K_SPLIT" in lane.config_reason({"K_SPLIT": 8}, b)
    assert "HEADS=3" in lane.config_reason({"HEADS": 3}, b)
    assert "DOT" in lane.config_reason({"DOT": "fp8"}, b)
    assert "FAST_TANH" in lane.config_reason({"FAST_TANH": 1}, b)
    assert "dtype" in lane.config_reason(D, {**b, "dtype": "float16"})
    assert "powers of two" in lane.config_reason(D, {**b, "K": 48})
    # A head block must share one k head or own one each: Nk = 4 of N = 8 gives 2 value heads per k head.
    assert "Nk" in lane.config_reason({"HEADS": 4, "YSTACK": False}, SHAPES["ragged_h0"])
    assert lane.config_reason({"HEADS": 4, "YSTACK": False, "K_SPLIT": 4}, SHAPES["b4_n44"]) is None
    assert lane.eligibility("sm_90a") is None and lane.eligibility("sm_121a") is None
    with pytest.raises(ValueError, match="sm_75"):
        lane.compile_for(D, b, "sm_75")


# ---- the kernel body under a NumPy model of the cuTile ops -------------------------------------

def _round(x, bits):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    drop = 23 - bits
    u = ((u + (1 << (drop - 1)) - 1 + ((u >> drop) & 1)) >> drop) << drop
    return u.astype(np.uint32).view(np.float32)


class _Tile(np.ndarray):
    def astype(self, dt, **_):
        a = np.asarray(self, np.float32)
        return (_round(a, {"bf16": 7, "tf32": 10}[dt]) if dt in ("bf16", "tf32") else a).view(_Tile)

    def reshape(self, shape):
        return np.reshape(np.asarray(self), shape).view(_Tile)

    def permute(self, axes):
        return np.transpose(self, axes).view(_Tile)


def _t(a):
    return np.asarray(a, np.float32).view(_Tile)


def _fake_ct(bid):
    """The documented semantics (cuda-tile 1.7.0 _stub.py) of the ops the kernel calls: load/store
    permute the array axes by ``order`` and address the tile space; out-of-bounds reads give zeros
    (padding ZERO), out-of-bounds writes are dropped; extract/insert address the sub-tile grid."""
    def box(index, shape, dims):
        return tuple(slice(i * s, min((i + 1) * s, d)) for i, s, d in zip(index, shape, dims))

    def load(arr, index, shape, order=None, **_):
        a = np.transpose(arr, order) if order else arr
        src = box(index, shape, a.shape)
        assert all(s.start < s.stop for s in src), "a tile wholly outside the array is undefined"
        out = np.zeros(shape, np.float32)
        out[tuple(slice(0, s.stop - s.start) for s in src)] = a[src]
        return _t(out)

    def store(arr, index, tile, order=None):
        a = np.transpose(arr, order) if order else arr
        dst = box(index, tile.shape, a.shape)
        a[dst] = np.asarray(tile)[tuple(slice(0, s.stop - s.start) for s in dst)]

    def insert(x, index, v):
        x = np.array(x)
        x[tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, v.shape))] = v
        return _t(x)

    return types.SimpleNamespace(
        float32="f32", bfloat16="bf16", tfloat32="tf32", int32="i32",
        PaddingMode=types.SimpleNamespace(ZERO=0), RoundingMode=types.SimpleNamespace(APPROX=0),
        bid=lambda ax: bid[ax], cdiv=lambda a, b: -(-a // b), static_iter=lambda r: r,
        tanh=lambda x, **_: _t(np.tanh(x)), where=lambda c, a, b: _t(np.where(c, a, b)),
        arange=lambda n, **_: np.arange(n), zeros=lambda s, **_: _t(np.zeros(s)),
        sum=lambda x, axis, keepdims=False: _t(np.sum(x, axis=axis, keepdims=keepdims)),
        mma=lambda a, b, acc: _t(np.matmul(np.asarray(a, np.float64), b) + acc),
        cat=lambda tiles, axis: _t(np.concatenate(tiles, axis)),
        load=load, store=store, insert=insert,
        extract=lambda x, index, shape: _t(np.asarray(x)[tuple(slice(i * s, (i + 1) * s)
                                                             for i, s in zip(index, shape))]))


def _emulate(config: dict, shape: dict, inputs: dict):
    config = {**D, **config}
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    ks = config["K_SPLIT"]
    arr = {n: t.float().numpy() for n, t in inputs.items()}
    y = np.full((ks * B, S, N, V), np.nan, np.float32)
    h_out = np.full((B, N, K, V), np.nan, np.float32)
    for bx in range(B * N // config["HEADS"]):
        for by in range(ks):
            g = {**vars(lane), "ct": _fake_ct((bx, by))}
            for name in ("_load_chunk", "_step_product", "_m2rnn_fwd"):
                g[name] = types.FunctionType(getattr(lane, name).__code__, g, name)
            g["_m2rnn_fwd"](arr["q"], arr["k"], arr["v"], arr["W"], arr["f"], arr.get("h0", h_out), y, h_out,
                            *lane._consts(config, shape))
    return torch.from_numpy(y.reshape(ks, B, S, N, V).sum(0)), torch.from_numpy(h_out)


_SMALL = {"B": 2, "S": 37, "N": 4, "Nq": 4, "Nk": 4, "Nw": 4, "Nf": 4, "K": 64, "V": 16, "h0": True,
          "dtype": "bfloat16"}


@pytest.mark.parametrize("shape,config", [
    (_SMALL, {}),
    (_SMALL, {"T": 8, "PREFETCH": False, "YSTACK": False}),
    ({**_SMALL, "Nq": 1, "Nk": 1, "h0": False}, {"K_SPLIT": 4, "T": 32, "DOT": "f32"}),
    ({**_SMALL, "N": 8, "Nq": 8, "Nk": 4, "Nw": 1, "Nf": 8, "S": 23}, {"HEADS": 2, "K_SPLIT": 2}),
    ({**_SMALL, "Nq": 1, "Nk": 1, "Nw": 1, "S": 16}, {"HEADS": 4, "YSTACK": False, "DOT": "tf32x3"}),
    (_SMALL, {"KV": "mma"}),
    ({**_SMALL, "Nq": 1, "Nk": 1, "S": 53}, {"KV": "cat", "PREFETCH": False}),
    ({**_SMALL, "N": 8, "Nq": 8, "Nk": 4, "Nw": 1, "Nf": 8, "S": 41}, {"KV": "mma", "T": 32, "DOT": "f32"}),
])
def test_kernel_body_matches_reference(shape, config):
    """Chunking, the padded tail (f = 1 keeps the state), head broadcasting, K slabs and HEADS blocks,
    run under the NumPy model with the kernel's own operand rounding: the error is that rounding's
    (bf16 H in the product), and the fp32 products agree to ~1e-6."""
    inputs = {n: t.float() for n, t in m2.make_inputs(shape, "cpu", 0, False).items()}
    y_ref, h_ref = m2.forward(m2.expand(inputs, shape, torch.float64))
    y, h = _emulate(config, shape, inputs)
    tol = 1e-3 if {**D, **config}["DOT"] in ("bf16", "tf32") else 1e-5
    for got, ref in ((y, y_ref), (h, h_ref)):
        assert torch.isfinite(got).all()
        assert float((got.double() - ref).norm() / ref.norm()) < tol
