"""Pinpoint a wrong cuTile m2rnn_bwd lane on the GPU in one call.

    python scripts/debug_cutile_m2rnn_bwd.py [SHAPE[,SHAPE...]] ['{"CKPT": 32, ...}'] [--inject]

Per shape (default b2_n8,ragged_h0) it runs the lane once with a trace hook after every launch and checks,
against an fp32 forward / BPTT of the same inputs on the GPU (lab/problems/_m2rnn.py math, per value head):
  1. the checkpoints H_{j*CKPT - 1} the forward kernel wrote (first bad segment);
  2. after each segment launch: the states the recompute wrote to scratch, then dH and dW (per batch row and
     value head) after that launch's walk (first bad segment, in walk order: last to first);
  3. per step t, the per-value-head dq, dk, dv, df (first bad t in walk order, i.e. the largest);
  4. the final outputs against lab.problems' reference (the `python -m lab check` verdict).
With --inject the reference checkpoints and states overwrite the lane's after each launch,
so the walk runs on exact states: if the gradients turn right, the forward / recompute is at fault, else the walk.
"Bad" is rel_l2 > 2e-2 (the bf16 band) or any non-finite value.
"""
from __future__ import annotations

import json
import sys

import torch

from kernels.cutile import m2rnn_bwd as lane
from lab import parity, problems, space
from lab.problems import _m2rnn as m2

BAD = 2e-2


def rel(got, ref):
    got, ref = got.float(), ref.float()
    nonfinite = int((~torch.isfinite(got)).sum())
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30)) if nonfinite == 0 else float("inf")
    return err, nonfinite


def flag(err, nonfinite):
    return nonfinite > 0 or err > BAD


def reference(inputs, shape, ckpt):
    """fp32 per-value-head forward states and BPTT with dH / dW recorded at segment starts."""
    x = m2.expand(inputs, shape, torch.float32)
    _, _, states = m2.forward(x, keep_states=True)          # [S+1, B, N, K, V]; states[t] = H_{t-1}
    q, k, v, W, f = x["q"], x["k"], x["v"], x["W"], x["f"]
    S, nseg = shape["S"], -(-shape["S"] // ckpt)
    dy = inputs["dy"].float()
    dH = inputs["dh_final"].float().clone()
    dW = torch.zeros(shape["B"], *W.shape, device=W.device)
    g = {n: torch.empty_like(t) for n, t in (("dq", q), ("dk", k), ("dv", v), ("df", f))}
    dh_at, dw_at = [None] * nseg, [None] * nseg
    for t in range(S - 1, -1, -1):
        hp, ht = states[t], states[t + 1]
        z = torch.tanh(hp @ W + k[:, t, :, :, None] * v[:, t, :, None, :])
        ft = f[:, t, :, None, None]
        g["dq"][:, t] = (ht * dy[:, t, :, None, :]).sum(-1)
        G = dH + q[:, t, :, :, None] * dy[:, t, :, None, :]
        g["df"][:, t] = (G * (hp - z)).sum((-1, -2))
        dX = (1 - ft) * G * (1 - z * z)
        dW += hp.transpose(-1, -2) @ dX
        g["dk"][:, t] = (dX * v[:, t, :, None, :]).sum(-1)
        g["dv"][:, t] = (dX * k[:, t, :, :, None]).sum(-2)
        dH = ft * G + dX @ W.transpose(-1, -2)
        if t % ckpt == 0:
            dh_at[t // ckpt], dw_at[t // ckpt] = dH.clone(), dW.clone()
    return states, g, dh_at, dw_at


def check(name, config, inject):
    problem = problems.get("m2rnn_bwd")
    shape = space.get_shape("m2rnn_bwd", name)
    config = {**lane.DEFAULTS, **config}
    why = lane.config_reason(config, shape)
    if why:
        print(f"{name}: config refused: {why}")
        return True
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    ck = config["CKPT"]
    nseg = -(-S // ck)
    plan = lane.schedule(nseg, S, ck)
    inputs = problem.make_inputs(shape, "cuda", 0)
    states, g, dh_at, dw_at = reference(inputs, shape, ck)
    flat = lambda t: t.reshape(B * N, K, V)  # noqa: E731
    print(f"== {name} {shape} config {config}{' INJECT' if inject else ''}: {nseg} segments, {nseg + 2} launches")
    first = {}

    def trace(m, w):
        torch.cuda.synchronize()
        if m < 0:                                            # after the checkpoint forward
            for j in range(nseg):
                e, nf = rel(w["ckpt"][:, j, :K, :V], flat(states[j * ck]))
                if flag(e, nf) and "ckpt" not in first:
                    first["ckpt"] = (j, e, nf)
                    print(f"  ckpt: first bad segment j={j} (state H_{j * ck - 1}): rel_l2={e:.3e} nonfinite={nf}")
            if "ckpt" not in first:
                worst = max(rel(w["ckpt"][:, j, :K, :V], flat(states[j * ck]))[0] for j in range(nseg))
                print(f"  ckpt: all {nseg} ok (worst rel_l2 {worst:.3e})")
            if inject:
                for j in range(nseg):
                    w["ckpt"][:, j, :K, :V] = flat(states[j * ck])
            return
        jw, lw, jr, lr = plan[m]
        so, si = (nseg - m + 1) % 2, (nseg - m) % 2
        if lr:
            errs = [rel(w["sc"][so][:, i, :K, :V], flat(states[jr * ck + i])) for i in range(lr)]
            bad = [(i, e) for i, e in enumerate(errs) if flag(*e)]
            if bad and "scratch" not in first:
                i, (e, nf) = bad[0]
                first["scratch"] = (jr, i)
                print(f"  launch {m}: recompute of segment {jr} wrote a bad state at row {i} (t={jr * ck + i}): "
                      f"rel_l2={e:.3e} nonfinite={nf}; {len(bad)} of {lr} rows bad")
            if inject:
                for i in range(lr):
                    w["sc"][so][:, i, :K, :V] = flat(states[jr * ck + i])
        if lw:
            dz = (m + 1) % 2
            eh = rel(w["dh"][dz][:, :K, :V], flat(dh_at[jw]))
            ew = rel(w["dw"][dz][:, :V, :V], dw_at[jw].reshape(B * N, V, V))
            if (flag(*eh) or flag(*ew)) and "walk" not in first:
                first["walk"] = jw
                print(f"  launch {m}: after walking segment {jw} (t={jw * ck}..{jw * ck + lw - 1}): "
                      f"dH rel_l2={eh[0]:.3e} nonfinite={eh[1]}, dW rel_l2={ew[0]:.3e} nonfinite={ew[1]}")

    run = lane.build(config, shape)
    outputs = problem.alloc_outputs(shape, "cuda")
    info = run(inputs, outputs, trace=trace)
    torch.cuda.synchronize()
    print(f"  launch info {info}; first problems: {first or 'none in ckpt / scratch / dH / dW'}")
    w = run_work(run)
    got = {"dq": w["dq"], "dk": w["dk"], "dv": w["dv"], "df": w["df"]}
    for n, ref in g.items():
        x, r = got[n].float().transpose(0, 1).reshape(S, -1), ref.float().transpose(0, 1).reshape(S, -1)
        nonfinite_t = (~torch.isfinite(x)).sum(1)
        err_t = (x - r).norm(dim=1) / r.norm(dim=1).clamp_min(1e-30)
        bad = ((nonfinite_t > 0) | (err_t > BAD)).nonzero().flatten().tolist()
        e_all = rel(got[n], ref)
        if bad:
            t = bad[-1]
            print(f"  {n} (per value head): rel_l2={e_all[0]:.3e} nonfinite={e_all[1]}; {len(bad)} of {S} steps bad, "
                  f"first in walk order t={t} (segment {t // ck}, row {t % ck}): rel_l2={float(err_t[t]):.3e} "
                  f"nonfinite={int(nonfinite_t[t])}; last bad t={bad[0]}")
            print(f"    got[0, {t}, 0, :4] = {got[n][0, t].flatten()[:4].tolist()}")
            print(f"    ref[0, {t}, 0, :4] = {ref[0, t].flatten()[:4].tolist()}")
        else:
            print(f"  {n} (per value head): ok, rel_l2={e_all[0]:.3e}")
    ok, errors = parity.compare(outputs, problem.reference(inputs, shape), problem.tolerance(shape),
                                problem.output_tolerances(shape))
    for out, e in errors.items():
        print(f"  final {out:5s} rel_l2={e.rel_l2:.3e} rel_max={e.rel_max:.3e} nonfinite={e.nonfinite}")
    print(f"  parity {'ok' if ok else 'FAILED'}")
    return ok


def run_work(run):
    """The lane's buffers from build's closure (the run function closes over ``work``)."""
    names = run.__code__.co_freevars
    return run.__closure__[names.index("work")].cell_contents


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--inject"]
    inject = "--inject" in sys.argv
    names = args[0].split(",") if args else ["b2_n8", "ragged_h0"]
    config = json.loads(args[1]) if len(args) > 1 else {}
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        results = [check(n, config, inject) for n in names]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
