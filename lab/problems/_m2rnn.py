"""M2RNN (non-linear matrix-state RNN) math shared by the m2rnn_fwd and m2rnn_bwd problems.

Per batch b and value head n (semantics of open-lm-engine/accelerated-model-architectures,
xma/layers/m2rnn/op.py; see ../shared/briefs/m2rnn.md):
    Z_t = tanh(H_{t-1} W + k_t v_t^T)      H [K, V], W [V, V]
    H_t = f_t H_{t-1} + (1 - f_t) Z_t      f_t a scalar per (b, t, n)
    y_t = H_t^T q_t                        y [V]
Layouts: q [B,S,Nq,K], k [B,S,Nk,K], v [B,S,N,V], W [Nw,V,V], f [B,S,Nf], h0 [B,N,K,V];
y [B,S,N,V], h_final [B,N,K,V]. Head n reads q head n // (N/Nq) (and likewise k, W, f): upstream's
repeat_interleave. Gradients of a shared head sum over the heads that read it; dW also sums over batch.

Two references: :func:`forward` (sequential, any dtype) with :func:`autograd_backward` through it, and
:func:`bptt_backward`, explicit backprop through time (the torch lane), tested against autograd.
"""
from __future__ import annotations

import torch

DIMS = ("B", "S", "N", "Nq", "Nk", "Nw", "Nf", "K", "V")
FLAGS = ("h0",)


def groups(shape: dict) -> dict:
    """Value heads per q / k / W / f head."""
    N = shape["N"]
    return {name: N // shape[name] for name in ("Nq", "Nk", "Nw", "Nf")}


def make_inputs(shape: dict, device: str, seed: int, backward: bool) -> dict:
    """Inputs of unit scale; f in (0, 1) as exp(-exp(A_log) * softplus(x + dt_bias)) gives it
    (mostly 0.6-0.99, a few small ones); dy and dh_final for the backward."""
    B, S, N, Nq, Nk, Nw, Nf, K, V = (shape[d] for d in DIMS)
    gen = torch.Generator(device=device).manual_seed(seed)
    dt, f32 = getattr(torch, shape["dtype"]), torch.float32

    def rnd(*size, scale=1.0):
        return torch.randn(*size, generator=gen, device=device, dtype=f32) * scale

    a_log = rnd(Nf, scale=0.5) - 1.0
    x = rnd(B, S, Nf) - 2.0
    # W at spectral norm ~1 (Gaussian V x V with entry variance 1/(4V)): with ~2 the recurrence was
    # chaotic over 4096 steps (H100, 2026-11-22: two correct bf16 kernels differing only in the order
    # of a sum disagreed by rel_max > 1 on h_final), and no parity check can hold there.
    inp = {"q": rnd(B, S, Nq, K, scale=K ** -0.5).to(dt), "k": rnd(B, S, Nk, K, scale=K ** -0.5).to(dt),
           "v": rnd(B, S, N, V).to(dt), "W": rnd(Nw, V, V, scale=0.5 * V ** -0.5).to(dt),
           "f": torch.exp(-torch.exp(a_log) * torch.nn.functional.softplus(x)).to(dt)}
    if shape["h0"]:
        inp["h0"] = rnd(B, N, K, V, scale=0.5).to(dt)
    if backward:
        inp["dy"] = rnd(B, S, N, V).to(dt)
        inp["dh_final"] = rnd(B, N, K, V, scale=0.5).to(dt)
    return inp


def expand(inputs: dict, shape: dict, dtype: torch.dtype) -> dict:
    """Per-value-head views in ``dtype``: q, k [B,S,N,K], v [B,S,N,V], W [N,V,V], f [B,S,N], h0 [B,N,K,V]."""
    g = groups(shape)
    B, N, K, V = shape["B"], shape["N"], shape["K"], shape["V"]
    out = {"q": inputs["q"].to(dtype).repeat_interleave(g["Nq"], dim=2),
           "k": inputs["k"].to(dtype).repeat_interleave(g["Nk"], dim=2),
           "v": inputs["v"].to(dtype), "W": inputs["W"].to(dtype).repeat_interleave(g["Nw"], dim=0),
           "f": inputs["f"].to(dtype).repeat_interleave(g["Nf"], dim=2)}
    h0 = inputs.get("h0")
    out["h0"] = h0.to(dtype) if h0 is not None else torch.zeros(B, N, K, V, dtype=dtype, device=out["v"].device)
    return out


def forward(x: dict, keep_states: bool = False):
    """Sequential forward on expanded inputs (see :func:`expand`). Returns y [B,S,N,V], the final
    state and, with ``keep_states``, every state H_0..H_S as [S+1, B, N, K, V]."""
    q, k, v, W, f, h = x["q"], x["k"], x["v"], x["W"], x["f"], x["h0"]
    S = q.shape[1]
    ys, states = [], [h] if keep_states else None
    for t in range(S):
        z = torch.tanh(h @ W + k[:, t, :, :, None] * v[:, t, :, None, :])
        ft = f[:, t, :, None, None]
        h = ft * h + (1 - ft) * z
        ys.append((q[:, t, :, :, None] * h).sum(-2))
        if keep_states:
            states.append(h)
    y = torch.stack(ys, 1)
    return (y, h, torch.stack(states)) if keep_states else (y, h)


def reduce_heads(grads: dict, shape: dict) -> dict:
    """Sum per-value-head gradients onto the heads the inputs actually have (and dW over batch)."""
    N = shape["N"]

    def fold(t, dim, n_heads):
        size = list(t.shape)
        size[dim:dim + 1] = [n_heads, N // n_heads]
        return t.reshape(size).sum(dim + 1)

    out = {"dq": fold(grads["dq"], 2, shape["Nq"]), "dk": fold(grads["dk"], 2, shape["Nk"]),
           "dv": grads["dv"], "dW": fold(grads["dW"], 1, shape["Nw"]).sum(0),
           "df": fold(grads["df"], 2, shape["Nf"])}
    if shape["h0"]:
        out["dh0"] = grads["dh0"]
    return out


def bptt_backward(inputs: dict, shape: dict, dtype: torch.dtype) -> dict:
    """Explicit backprop through time in ``dtype`` (the torch lane): every state kept from one forward,
    Z_t recomputed from H_{t-1} on the way back.
        dq_t = H_t dy_t;  G = dH + q_t dy_t^T;  df_t = sum(G (H_{t-1} - Z_t));  dX = (1 - f_t) G (1 - Z_t^2)
        dW += H_{t-1}^T dX;  dk_t = dX v_t;  dv_t = dX^T k_t;  dH = f_t G + dX W^T"""
    x = expand(inputs, shape, dtype)
    q, k, v, W, f = x["q"], x["k"], x["v"], x["W"], x["f"]
    _, _, states = forward(x, keep_states=True)
    dy = inputs["dy"].to(dtype)
    dH = inputs["dh_final"].to(dtype).clone()
    S = shape["S"]
    dq, dk, dv, df = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(f)
    dW = torch.zeros(shape["B"], *W.shape, dtype=dtype, device=W.device)
    for t in range(S - 1, -1, -1):
        h_prev, h_t = states[t], states[t + 1]
        z = torch.tanh(h_prev @ W + k[:, t, :, :, None] * v[:, t, :, None, :])
        ft = f[:, t, :, None, None]
        dq[:, t] = (h_t * dy[:, t, :, None, :]).sum(-1)
        G = dH + q[:, t, :, :, None] * dy[:, t, :, None, :]
        df[:, t] = (G * (h_prev - z)).sum((-1, -2))
        dX = (1 - ft) * G * (1 - z * z)
        dW += h_prev.transpose(-1, -2) @ dX
        dk[:, t] = (dX * v[:, t, :, None, :]).sum(-1)
        dv[:, t] = (dX * k[:, t, :, :, None]).sum(-2)
        dH = ft * G + dX @ W.transpose(-1, -2)
    return reduce_heads({"dq": dq, "dk": dk, "dv": dv, "dW": dW, "df": df, "dh0": dH}, shape)


def autograd_backward(inputs: dict, shape: dict, dtype: torch.dtype) -> dict:
    """Reference (1): torch.autograd through :func:`forward` (broadcasting included) in ``dtype``."""
    leaves = {n: inputs[n].detach().to(dtype).requires_grad_(True) for n in ("q", "k", "v", "W", "f", "h0")
              if n in inputs}
    y, h = forward(expand(leaves, shape, dtype))
    loss = (y * inputs["dy"].to(dtype)).sum() + (h * inputs["dh_final"].to(dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {"d" + n: g for n, g in zip(leaves, grads)}


def reference_dtype(device: torch.device) -> torch.dtype:
    return torch.float64 if device.type == "cpu" else torch.float32
