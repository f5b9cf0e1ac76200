"""mamba_bwd_bwd on the CPU: reference (2) (explicit gradient formulas, the torch lane) against
reference (1) (autograd through the plain chunked forward), fp64, over ranks, GQA, rotary divisors
and every option; the inputs' decay and states; shape validation; the parity comparison fails on a
wrong output."""
from __future__ import annotations

import pytest
import torch

from lab.devices import LabError
from lab.problems import _mamba3 as m3
from lab.problems import get

PROBLEM = get("mamba_bwd_bwd")
BASE = dict(B=2, S=32, H=2, G=1, N=16, P=8, R=4, C=8, rd=4, hasZ=True, hasD=True, reduceO=True, dtype="bfloat16")

CASES = [
    {},
    {"R": 1, "C": 16, "S": 48},
    {"R": 2},
    {"R": 8, "C": 4},
    {"G": 2, "H": 4},
    {"rd": 2},
    {"hasZ": False},
    {"hasD": False},
    {"reduceO": False},
    {"hasZ": False, "hasD": False, "reduceO": False, "R": 2, "rd": 2},
    {"B": 1, "S": 24, "H": 3, "N": 32, "P": 16, "dtype": "float16"},
]


def _exact_inputs(shape, seed=0):
    """Inputs with STATES and QK_DOT recomputed in fp64 from the same forward (no bf16 rounding),
    so that the two references must agree to fp64 round-off."""
    inp = PROBLEM.make_inputs(shape, "cpu", seed)
    inp["STATES"], inp["QK_DOT"] = m3.forward_states(inp, shape, torch.float64)
    return inp


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "base")
def test_explicit_reference_equals_autograd(case):
    shape = {**BASE, **case}
    PROBLEM.check_shape(shape)
    inp = _exact_inputs(shape)
    auto, states = m3.autograd_bwd_bwd(inp, shape)
    expl = m3.bwd_bwd(inp, shape)
    expected = set(m3.OUTPUTS) - (set() if shape["hasD"] else {"DD"})
    assert set(auto) == set(expl) == expected
    torch.testing.assert_close(states, inp["STATES"], rtol=1e-12, atol=1e-12)
    for name in expected:
        a, e = auto[name], expl[name]
        assert a.shape == e.shape, name
        assert a.abs().max() > 0, f"{name} is all zeros: the comparison would prove nothing"
        torch.testing.assert_close(e, a, rtol=1e-9, atol=1e-9 * float(a.abs().max()), msg=name)


def test_output_layouts_match_the_boundary():
    shape = dict(BASE)
    out = PROBLEM.alloc_outputs(shape, "cpu")
    ref = PROBLEM.reference(PROBLEM.make_inputs(shape, "cpu", 1), shape)
    assert set(out) == set(ref)
    for name in ref:
        assert out[name].shape == ref[name].shape, name
    B, S, H, N, P, R, C = (shape[k] for k in "BSHNPRC")
    assert out["DQ"].shape == (B, S * R, H, N) and out["DQ"].dtype == torch.bfloat16
    assert out["DSSDA"].shape == (B, H, S // C, C, C) and out["DMIMO_V"].shape == (B, H, R, P)


def test_inputs_are_consistent_with_a_negative_decay():
    shape = dict(BASE)
    inp = PROBLEM.make_inputs(shape, "cpu", 3)
    B, H, S, C = shape["B"], shape["H"], shape["S"], shape["C"]
    da = inp["DA_CS"].view(B, H, S // C, C)
    assert (da.diff(dim=-1) <= 0).all() and (da[..., 0] <= 0).all()        # cumsum of dA <= 0
    torch.testing.assert_close(inp["DA_CS_REV"].view_as(da), da[..., -1:] - da)
    seg = inp["SEGSUM"]
    torch.testing.assert_close(seg[..., 5, 2], da[..., 5] - da[..., 2])
    # STATES are make_inputs' own m3.forward_states call (comparing the two could not fail);
    # test_explicit_reference_equals_autograd checks them against autograd's plain forward.
    assert inp["STATES"].dtype == torch.bfloat16 and inp["STATES"][:, :, 1:].abs().max() > 0


@pytest.mark.parametrize("bad,msg", [
    ({"S": 30}, "multiple of C"), ({"G": 3}, "multiple of G"), ({"rd": 3}, "rd"), ({"R": 3}, "R must"),
    ({"hasZ": 1}, "flags"), ({"N": 0}, "positive"), ({"dtype": "float32"}, "dtype"),
])
def test_bad_shapes_are_refused(bad, msg):
    with pytest.raises(LabError, match=msg):
        PROBLEM.check_shape({**BASE, **bad})


def test_parity_fails_on_a_wrong_output():
    """DSSDA written untransposed, DDA without exp(DA_CS_last), a DQ row left unwritten: each fails the
    comparison, and only in the output it corrupts. The base is the torch lane's output (reference (2)
    copied into the NaN-filled buffers), so an output the lane left unwritten fails too; that base alone
    against the reference would compare the reference with itself."""
    from lab import parity, registry
    shape = {**BASE, "R": 2}
    inp = PROBLEM.make_inputs(shape, "cpu", 5)
    out = PROBLEM.alloc_outputs(shape, "cpu")
    registry.get("torch", "mamba_bwd_bwd").module.build({}, shape)(inp, out)
    ref = PROBLEM.reference(inp, shape)
    tol = PROBLEM.tolerance(shape)
    for name, corrupt in [("DSSDA", lambda t: t.transpose(-1, -2)),
                          ("DDA", lambda t: t / torch.exp(inp["DA_CS"].view(2, 2, 4, 8)[..., -1:]).expand(2, 2, 4, 8)
                           .reshape(2, 2, 32)),
                          ("DQ", lambda t: t.index_fill(1, torch.tensor([3]), float("nan")))]:
        bad = dict(out)
        bad[name] = corrupt(out[name].clone())
        ok, errors = parity.compare(bad, ref, tol)
        assert not ok and not errors[name].ok(tol), name
        assert [n for n, e in errors.items() if not e.ok(tol)] == [name]


@pytest.mark.parametrize("name", ["gb10", "h100_tuned"])
def test_dda_from_a_bf16_state_gradient_is_within_its_tolerance(name):
    """A lane may take DDA = exp(a_last) sum(S_c * dS_c) from the bf16 dS its chunk kernels read (the
    TileLang and Triton lanes do) rather than from the scan's fp32 dS: that rounding alone costs
    rel_l2 ~1.5e-3 at the named shape and its parity shape, well inside DDA's bf16 tolerance (it fails
    if dS is rounded to fp8, 2^-4 per element)."""
    from lab import space
    shape = space.get_shape("mamba_bwd_bwd", name)
    tol = PROBLEM.output_tolerances(shape)["DDA"].rel_l2
    for s in [shape] + PROBLEM.parity_shapes(shape):
        inp = PROBLEM.make_inputs(s, "cpu", 7)
        B, S, H, G, N, P, R, C, nc, nr = m3.dims(s)
        dS = m3.state_grads(inp, s, torch.float64)
        states = inp["STATES"].to(torch.float64)
        a_last = torch.exp(inp["DA_CS"].to(torch.float64).view(B, H, nc, C)[..., -1])
        exact = a_last * (states * dS).sum((-1, -2))
        err = {dt: float((a_last * (states * dS.to(dt).double()).sum((-1, -2)) - exact).norm() / exact.norm())
               for dt in (torch.bfloat16, torch.float8_e4m3fn)}
        assert err[torch.bfloat16] < tol / 5 < err[torch.float8_e4m3fn], (s, err)
