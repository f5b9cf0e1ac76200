"""M2RNN on the CPU: the explicit BPTT (torch lane) equals autograd through the sequential forward at
fp64 round-off; shape rules; the Triton forward and backward under TRITON_INTERPRET=1 through the
harness's parity path (a timed shape and small parity shapes chosen per case); ahead-of-time compiles for
sm_90a and sm_121a; parity fails on a wrong gradient."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lab import parity, space
from lab.devices import LabError
from lab.problems import _m2rnn as m2
from lab.problems import get

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = {"B": 2, "S": 13, "N": 4, "Nq": 1, "Nk": 2, "Nw": 4, "Nf": 2, "K": 20, "V": 9, "h0": True,
         "dtype": "float32"}


@pytest.mark.parametrize("case", [
    {},                                                         # q shared, k in pairs, V not a tile size
    {"Nq": 4, "Nk": 4, "Nw": 1, "Nf": 4, "h0": False},          # one W for all heads, no initial state
    {"Nq": 2, "Nk": 1, "Nw": 2, "Nf": 1, "S": 1},               # a single step
    {"K": 16, "V": 16, "N": 3, "Nq": 3, "Nk": 3, "Nw": 3, "Nf": 3},
])
def test_bptt_equals_autograd(case):
    shape = {**SMALL, **case}
    p = get("m2rnn_bwd")
    p.check_shape(shape)
    inp = p.make_inputs(shape, "cpu", 3)
    ref1 = m2.autograd_backward(inp, shape, torch.float64)
    ref2 = m2.bptt_backward(inp, shape, torch.float64)
    assert set(ref2) == set(p.outputs) - ({"dh0"} if not shape["h0"] else set())
    for name in ref2:
        assert ref2[name].shape == ref1[name].shape, name
        torch.testing.assert_close(ref2[name], ref1[name], rtol=1e-9, atol=1e-11, msg=name)


def test_forward_matches_a_plain_loop():
    """The vectorised reference against a per-(b, n) loop written from the recurrence directly."""
    shape = SMALL
    inp = get("m2rnn_fwd").make_inputs(shape, "cpu", 1)
    ref = get("m2rnn_fwd").reference(inp, shape)
    g = m2.groups(shape)
    d = {k: v.double() for k, v in inp.items()}
    for b in range(shape["B"]):
        for n in range(shape["N"]):
            h = d["h0"][b, n].clone()
            W = d["W"][n // g["Nw"]]
            for t in range(shape["S"]):
                f = d["f"][b, t, n // g["Nf"]]
                z = torch.tanh(h @ W + torch.outer(d["k"][b, t, n // g["Nk"]], d["v"][b, t, n]))
                h = f * h + (1 - f) * z
                torch.testing.assert_close(ref["y"][b, t, n], h.T @ d["q"][b, t, n // g["Nq"]])
            torch.testing.assert_close(ref["h_final"][b, n], h)


def test_shape_rules_and_named_shapes():
    for kernel in ("m2rnn_fwd", "m2rnn_bwd"):
        p = get(kernel)
        with pytest.raises(LabError, match="must divide N"):
            p.check_shape({**SMALL, "Nq": 3})
        shapes, default = space.load_shapes(kernel)
        assert {"b2_n8", "b4_n44", "b8_n84"} <= set(default)
        assert shapes["b4_n44"]["Nq"] == shapes["b4_n44"]["Nk"] == 1 and shapes["b8_n84"]["N"] == 84
        assert any(s["S"] % 64 for s in shapes.values())            # a ragged sequence length
        for s in shapes.values():
            p.check_shape(s)
        assert any(s["S"] == 977 for s in p.parity_shapes(shapes["b4_n44"]))


def test_parity_fails_on_a_wrong_gradient():
    p = get("m2rnn_bwd")
    inp = p.make_inputs(SMALL, "cpu", 0)
    ref = p.reference(inp, SMALL)
    good = {k: v.float() for k, v in ref.items()}
    ok, _ = parity.compare(good, ref, p.tolerance(SMALL))
    assert ok
    bad = dict(good, df=good["df"] * 1.05)                        # a 5% error in one output
    ok, errors = parity.compare(bad, ref, p.tolerance(SMALL))
    assert not ok and not errors["df"].ok(p.tolerance(SMALL))


_INTERPRET = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from lab.worker import execute
    out = []
    for kernel, shape, cfg, parity_shapes in json.loads(sys.argv[2]):
        r = execute({"kind": "trial", "kernel": kernel, "dsl": "triton", "config": cfg, "shape": shape,
                     "parity_shapes": parity_shapes, "seed": 2, "device": "cpu", "no_timing": True})
        out.append({k: r.get(k) for k in ("status", "error", "parity_rel_l2", "parity_shapes")})
    print("RESULT " + json.dumps(out))
""")


def _small(**kw):
    """One batch row and two value heads: the interpreter runs every (program, step) in Python, so the
    longer parity shapes below keep the grid small (SMALL, the timed shape, has B = 2, N = 4)."""
    return {**SMALL, "B": 1, "N": 2, "Nq": 2, "Nk": 1, "Nw": 1, "Nf": 2, "h0": False, **kw}


def test_triton_interpreter_parity_forward_and_backward():
    """fp32 through the harness's parity path (timed shape SMALL + the parity shapes each case names in
    place of the problem's S = 977 one, which would take the interpreter ~10 minutes); the fast tanh is
    replaced by the exact formula in interpreter mode. Together the shapes cover the loops' paths: PREFETCH
    groups with and without a ragged tail and S shorter than one group, K split (rows past K masked),
    checkpoint segments that are full, ragged, shorter than a group or a single step, with and without
    an initial state, and q / k / W / f heads shared by all, some (Nk = 2 of 4) or none of the value heads."""
    cases = [
        # SMALL: one prefetched group of 8 then a 5-step tail; S = 16: two groups, no tail (W shared, no
        # h0); S = 5: no full group, the tail alone.
        ("m2rnn_fwd", SMALL, {"num_warps": 4, "K_SPLIT": 1, "FAST_TANH": True, "PREFETCH": 8},
         [_small(S=16), _small(S=5)]),
        # K split in two 16-row slabs of K = 20 (y summed over slabs), one step per group; again without h0.
        ("m2rnn_fwd", SMALL, {"num_warps": 4, "K_SPLIT": 2, "DOT": "input", "FAST_TANH": False, "PREFETCH": 1},
         [_small(S=3)]),
        # CKPT 5 at SMALL: segments 5, 5, 3 (walked with a 1-step tail after groups of 2); S = 11: a last
        # segment of one step; S = 10: CKPT divides S.
        ("m2rnn_bwd", SMALL, {"num_warps": 4, "CKPT": 5, "FAST_TANH": True, "PREFETCH": 2, "K_SPLIT": 2},
         [_small(S=11), _small(S=10)]),
        # CKPT 64 at S = 13: one segment shorter than CKPT, no h0; S = 67: a full 64-step segment (a
        # multiple of the group of 8: no tail) then one of 3 steps (shorter than a group), with h0.
        ("m2rnn_bwd", {**SMALL, "h0": False},
         {"num_warps": 4, "CKPT": 64, "DOT": "tf32", "FAST_TANH": False, "PREFETCH": 8},
         [_small(S=67, h0=True, Nq=1, Nw=2, Nf=1)]),
    ]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", _INTERPRET, ROOT, json.dumps(cases)], env=env,
                       capture_output=True, text=True, timeout=1800)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    for case, r in zip(cases, json.loads(line[0][7:])):
        assert r["status"] == "ok", (case, r)
        assert r["parity_rel_l2"] < 1e-5, (case, r)
        assert len(r["parity_shapes"]) == 1 + len(case[3]), (case, r)     # none skipped by the config's rules


def test_a_task_chooses_its_parity_shapes():
    """The worker checks the problem's own parity shapes unless the task names others (validated)."""
    from lab.worker import parity_shapes
    p = get("m2rnn_fwd")
    assert parity_shapes(p, {"shape": SMALL}) == p.parity_shapes(SMALL)
    assert parity_shapes(p, {"shape": SMALL, "parity_shapes": [_small(S=5)]}) == [_small(S=5)]
    assert parity_shapes(p, {"shape": SMALL, "parity_shapes": []}) == []
    with pytest.raises(LabError, match="must divide N"):
        parity_shapes(p, {"shape": SMALL, "parity_shapes": [_small(Nq=3)]})


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
def test_triton_compiles_for_explicit_targets(target):
    from kernels.triton import m2rnn_bwd, m2rnn_fwd
    for lane in (m2rnn_fwd, m2rnn_bwd):
        for name in ("b8_n84", "fp32_k64_v64"):
            shape = space.get_shape(lane.KERNEL, name)
            res = lane.compile_for(lane.DEFAULTS, shape, target)
            assert 0 < res["smem_bytes"] <= 101376, (lane.KERNEL, name, res)
