"""Mamba-3 MIMO chunked model: the math behind the ``mamba_bwd_bwd`` problem, in plain PyTorch.

Three things live here, all written from the model's definition (semantics read from the public
state-spaces/mamba TileLang kernels mamba3_mimo_bwd.py / mamba3_mimo_fwd.py; no code taken):

* :func:`forward_states` - the part of the forward pass the first backward kernel (bwd_fwd) hands
  to bwd_bwd: STATES (state entering each chunk) and QK_DOT (same-step R x R q.k products);
* :func:`bwd_bwd` - reference (2): the bwd_bwd boundary itself, written as explicit gradient
  formulas, vectorised over chunks (the only serial part is the N x P state-gradient scan);
* :func:`autograd_bwd_bwd` - reference (1): a plain chunked forward with every intermediate the
  boundary differentiates as its own leaf, differentiated by torch.autograd.

Conventions (per batch b and value head h; t a step, r a MIMO rank, c a chunk of C steps):
  q = Q + bq, k = K + bk (Q/K head h // (H / G)); rotary on the pairs (n, N/2 + n), n < N / rd:
  (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos) with the angle ANGLES[t, n];
  gamma_t = DT_t sigmoid(TRAP_t); shifted_t = DT_{t+1} sigmoid(-TRAP_{t+1}) (0 at t = S - 1);
  factor = gamma + shifted; q_hat = rot(q), k_hat = rot(k) * factor; PsiV_{t,r} = V_t * Psi_r;
  y_{t,r} = exp(DA_CS_t) q_hat_{t,r} S_c + sum_{s<t in c} (q_hat_{t,r}.k_hat_{s,r'}) exp(SEGSUM[t,s]) PsiV_{s,r'}
            + gamma_t sum_r' (q_{t,r}.k_{t,r'}) PsiV_{t,r'} + D PsiV_{t,r};
  S_{c+1} = exp(DA_CS[last step of c]) S_c + sum_{t in c} (exp(DA_CS_REV_t) k_hat_t)^T PsiV_t,  S_0 = 0;
  out_{t,r} = y_{t,r} * silu(Z_t * Zeta_r) (hasZ); reduceO: out_t = sum_r Phi_r * out_{t,r}.
  The loss gradient DOUT is dL/d out. dy ("dPhiO") = dL/dy.

Output definitions (the ones two implementations can silently disagree on):
  DDA_CS_t = exp(-DA_CS_t) dL/dDA_CS_t and DDA_CS_REV likewise (partials before the exp);
  DDA_t = dL/d(DA_CS at the chunk's last step, as it enters the state decay only), on every step of c;
  DSSDA[c, s, t] (row = key step s, column = query step t) = sum_{r,r'} (q_hat_{t,r}.k_hat_{s,r'})
      (dy_{t,r}.PsiV_{s,r'}) for ALL s, t: for s < t it is dL/dexp(SEGSUM[t,s]); the entries s >= t are
      written too (upstream writes the unmasked product) and are compared like the rest;
  DFACTOR = dL/dfactor through k_hat (off-diagonal paths); DGAMMA_DIAG = dL/dgamma through the
      same-step term only; DQ, DK = dL/dq, dL/dk per VALUE head, laid out [B, S*R, H, N] (row t*R + r);
  DMIMO_V = dL/dPsi and DD = dL/dD per batch element.
The sequence length must be a multiple of C (the upstream host code asserts the same).
"""
from __future__ import annotations

import torch

OUTPUTS = ("DQ", "DK", "DV", "DMIMO_V", "DD", "DANGLES", "DFACTOR", "DGAMMA_DIAG", "DDA", "DDA_CS",
           "DDA_CS_REV", "DSSDA")


def dims(shape: dict) -> tuple[int, ...]:
    """(B, S, H, G, N, P, R, C, nc, nr) of a problem shape; nr = N / rd rotary angles per step."""
    C = shape["C"]
    return (shape["B"], shape["S"], shape["H"], shape["G"], shape["N"], shape["P"], shape["R"], C,
            shape["S"] // C, shape["N"] // shape["rd"])


# --------------------------------------------------------------------------------------------
# elementwise pieces


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on pairs (n, N/2 + n), n < nr = cos.shape[-1]; the other coordinates pass through."""
    N, nr = x.shape[-1], cos.shape[-1]
    x0, x1 = x[..., :nr], x[..., N // 2:N // 2 + nr]
    return torch.cat([x0 * cos - x1 * sin, x[..., nr:N // 2], x0 * sin + x1 * cos, x[..., N // 2 + nr:]], -1)


def rotate_back(g: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gradient through :func:`rotate` (its transpose: the inverse rotation)."""
    N, nr = g.shape[-1], cos.shape[-1]
    g0, g1 = g[..., :nr], g[..., N // 2:N // 2 + nr]
    return torch.cat([g0 * cos + g1 * sin, g[..., nr:N // 2], -g0 * sin + g1 * cos, g[..., N // 2 + nr:]], -1)


def angle_grad(g: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """dL/dangle given g = dL/drotate(x) and the unrotated x: [..., nr]."""
    N, nr = x.shape[-1], cos.shape[-1]
    x0, x1 = x[..., :nr], x[..., N // 2:N // 2 + nr]
    g0, g1 = g[..., :nr], g[..., N // 2:N // 2 + nr]
    return g0 * (-x0 * sin - x1 * cos) + g1 * (x0 * cos - x1 * sin)


def gates(dt: torch.Tensor, trap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gamma, factor) over [..., S]: gamma_t = dt_t sigmoid(trap_t), factor = gamma + shifted gamma."""
    gamma = dt * torch.sigmoid(trap)
    shifted = torch.zeros_like(gamma)
    shifted[..., :-1] = dt[..., 1:] * torch.sigmoid(-trap[..., 1:])
    return gamma, gamma + shifted


def value_heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, S, R, G, N] per Q/K head -> [B, H, S, R, N] per value head (h uses Q/K head h // (H/G))."""
    G = x.shape[3]
    return x[:, :, :, torch.arange(H, device=x.device) // (H // G)].permute(0, 3, 1, 2, 4)


def dy_of(inp: dict, shape: dict, dtype) -> torch.Tensor:
    """dL/dy [B, H, S, R, P] from DOUT through the optional Phi contraction and SiLU(Z * Zeta) gate."""
    if shape["reduceO"]:
        d = inp["DOUT"].to(dtype).permute(0, 2, 1, 3)[:, :, :, None, :] * inp["MIMO_O"].to(dtype)[None, :, None]
    else:
        d = inp["DOUT"].to(dtype).permute(0, 3, 1, 2, 4)
    if shape["hasZ"]:
        zz = inp["Z"].to(dtype).permute(0, 2, 1, 3)[:, :, :, None, :] * inp["MIMO_Z"].to(dtype)[None, :, None]
        d = d * torch.nn.functional.silu(zz)
    return d


def _common(inp: dict, shape: dict, dtype) -> dict:
    """Biased q, k per value head [B,H,S,R,N], cos/sin [B,H,S,1,nr], v [B,H,S,P], gamma, factor."""
    B, S, H, G, N, P, R, C, nc, nr = dims(shape)
    f = lambda name: inp[name].to(dtype)  # noqa: E731
    q = value_heads(f("Q"), H) + f("Q_BIAS")[None, :, None]
    k = value_heads(f("K"), H) + f("K_BIAS")[None, :, None]
    ang = f("ANGLES").permute(0, 2, 1, 3)[:, :, :, None, :]
    gamma, factor = gates(f("DT"), f("TRAP"))
    return {"q": q, "k": k, "cos": torch.cos(ang), "sin": torch.sin(ang), "v": f("V").permute(0, 2, 1, 3),
            "gamma": gamma, "factor": factor}


def _per_rank(x: torch.Tensor, R: int) -> torch.Tensor:
    """[..., S] per-step scalars -> [..., S*R] (each repeated for the R ranks of its step)."""
    return x.repeat_interleave(R, dim=-1)


def _strict_lower(C: int, device) -> torch.Tensor:
    return torch.tril(torch.ones(C, C, dtype=torch.bool, device=device), diagonal=-1)


# --------------------------------------------------------------------------------------------
# the forward quantities bwd_fwd hands over


@torch.no_grad()
def forward_states(inp: dict, shape: dict, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """STATES [B,H,nc,N,P] (state entering each chunk) and QK_DOT [B,H,S,R,R] (q_{t,r}.k_{t,r'},
    biased, before rotary), both in ``dtype``, from the chunked forward recurrence."""
    B, S, H, G, N, P, R, C, nc, nr = dims(shape)
    m = _common(inp, shape, dtype)
    qk_dot = torch.einsum("bhsrn,bhsin->bhsri", m["q"], m["k"])
    k_hat = rotate(m["k"], m["cos"], m["sin"]) * m["factor"][..., None, None]
    k_hat = k_hat * torch.exp(inp["DA_CS_REV"].to(dtype))[..., None, None]
    psiv = m["v"][:, :, :, None, :] * inp["MIMO_V"].to(dtype)[None, :, None]
    kv = k_hat.reshape(B, H, nc, C * R, N).transpose(-1, -2) @ psiv.reshape(B, H, nc, C * R, P)
    decay = torch.exp(inp["DA_CS"].to(dtype).view(B, H, nc, C)[..., -1])
    states = torch.empty(B, H, nc, N, P, dtype=dtype, device=kv.device)
    run = torch.zeros(B, H, N, P, dtype=dtype, device=kv.device)
    for c in range(nc):
        states[:, :, c] = run
        run = decay[:, :, c, None, None] * run + kv[:, :, c]
    return states, qk_dot


# --------------------------------------------------------------------------------------------
# reference (2): the boundary as explicit gradient formulas


def reference_outputs(inp: dict, shape: dict) -> dict:
    """:func:`bwd_bwd` where the inputs live: fp64 on the CPU, fp32 on a GPU (TF32 off)."""
    on_cpu = inp["Q"].device.type == "cpu"
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return bwd_bwd(inp, shape, torch.float64 if on_cpu else torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def bwd_bwd(inp: dict, shape: dict, dtype=torch.float64) -> dict:
    """All bwd_bwd outputs in ``dtype`` (DD only when hasD), one batch element at a time."""
    parts = [_bwd_bwd_batch({k: (v[b:b + 1] if _batched(k) else v) for k, v in inp.items()}, shape, dtype)
             for b in range(shape["B"])]
    return {k: torch.cat([p[k] for p in parts], 0) for k in parts[0]}


_UNBATCHED = {"Q_BIAS", "K_BIAS", "MIMO_V", "MIMO_O", "MIMO_Z", "D"}


def _batched(name: str) -> bool:
    return name not in _UNBATCHED


def _state_grads(qc: torch.Tensor, dye: torch.Tensor, a_last: torch.Tensor) -> torch.Tensor:
    """dS [B, H, nc, N, P]: dS_c = dL/dS_{c+1} (the state leaving chunk c; zero for the last chunk, no
    final-state gradient), from q_hat [B, H, nc, F, N], exp(DA_CS) dy [B, H, nc, F, P], DA_CS at each
    chunk's last step [B, H, nc]: dS_{c-1} = exp(a_last_c) dS_c + q_hat_c^T (exp(DA_CS) dy_c)."""
    u = qc.transpose(-1, -2) @ dye
    dS = torch.empty_like(u)
    run = torch.zeros_like(u[:, :, 0])
    for c in range(u.shape[2] - 1, -1, -1):
        dS[:, :, c] = run
        run = torch.exp(a_last[:, :, c])[..., None, None] * run + u[:, :, c]
    return dS


def state_grads(inp: dict, shape: dict, dtype=torch.float64) -> torch.Tensor:
    """dS [B, H, nc, N, P] in ``dtype``: what a lane's dS scan writes (the recurrence in _state_grads)."""
    B, S, H, G, N, P, R, C, nc, nr = dims(shape)
    m = _common(inp, shape, dtype)
    F = C * R
    qc = rotate(m["q"], m["cos"], m["sin"]).reshape(B, H, nc, F, N)
    dye = (dy_of(inp, shape, dtype) * torch.exp(inp["DA_CS"].to(dtype))[..., None, None]).reshape(B, H, nc, F, P)
    return _state_grads(qc, dye, inp["DA_CS"].to(dtype).view(B, H, nc, C)[..., -1])


def _bwd_bwd_batch(inp: dict, shape: dict, dtype) -> dict:
    _, S, H, G, N, P, R, C, nc, nr = dims(shape)
    B, F = 1, C * R
    m = _common(inp, shape, dtype)
    q, k, cos, sin, v, gamma, factor = (m[x] for x in ("q", "k", "cos", "sin", "v", "gamma", "factor"))
    psi = inp["MIMO_V"].to(dtype)                                   # [H, R, P]
    q_hat = rotate(q, cos, sin)                                      # [B, H, S, R, N]
    k_rot = rotate(k, cos, sin)
    k_hat = k_rot * factor[..., None, None]
    psiv = v[:, :, :, None, :] * psi[None, :, None]                  # [B, H, S, R, P]
    dy = dy_of(inp, shape, dtype)                                    # [B, H, S, R, P]
    ea = torch.exp(inp["DA_CS"].to(dtype))                           # [B, H, S]
    er = torch.exp(inp["DA_CS_REV"].to(dtype))
    a_last = inp["DA_CS"].to(dtype).view(B, H, nc, C)[..., -1]       # [B, H, nc]
    states = inp["STATES"].to(dtype)                                 # [B, H, nc, N, P]
    qk_dot = inp["QK_DOT"].to(dtype).view(B, H, nc, C, R, R)

    chunk = lambda x: x.reshape(B, H, nc, F, x.shape[-1])  # noqa: E731  [..., S, R, X] -> [..., nc, F, X]
    qc, kc, psivc, dyc = chunk(q_hat), chunk(k_hat), chunk(psiv), chunk(dy)
    eaF = _per_rank(ea, R).view(B, H, nc, F, 1)
    erF = _per_rank(er, R).view(B, H, nc, F, 1)

    dS = _state_grads(qc, dyc * eaF, a_last)

    # Intra-chunk decay in (key s, query t) orientation, expanded to fused rows s*R + r.
    seg = inp["SEGSUM"].to(dtype)                                    # [B, H, nc, C(t), C(s)]
    decay_st = torch.where(_strict_lower(C, seg.device), torch.exp(seg), 0).transpose(-1, -2)
    decay_st = decay_st.repeat_interleave(R, -1).repeat_interleave(R, -2)   # [.., F(s), F(t)]

    lkq = kc @ qc.transpose(-1, -2)                                  # k_hat_s . q_hat_t  [F(s), F(t)]
    dpsiv = erF * (kc @ dS) + (lkq * decay_st) @ dyc                 # [B, H, nc, F, P]
    if shape["hasD"]:
        dpsiv = dpsiv + inp["D"].to(dtype)[None, :, None, None, None] * dyc
    dyR, psivR = dyc.view(B, H, nc, C, R, P), psivc.view(B, H, nc, C, R, P)
    gam = gamma.view(B, H, nc, C)
    dpsiv = dpsiv.view(B, H, nc, C, R, P) + gam[..., None, None] * torch.einsum("bhcton,bhctop->bhctnp", qk_dot, dyR)
    dpsiv_t = dpsiv.reshape(B, H, S, R, P)
    out = {"DV": (dpsiv_t * psi[None, :, None]).sum(3),                               # [B, H, S, P]
           "DMIMO_V": torch.einsum("bhsrp,bhsp->bhrp", dpsiv_t, v)}
    if shape["hasD"]:
        out["DD"] = (dy * psiv).sum((2, 3, 4))
    pv = torch.einsum("bhctop,bhctip->bhctoi", dyR, psivR)           # dy_{t,o} . PsiV_{t,i}
    out["DGAMMA_DIAG"] = (qk_dot * pv).sum((-1, -2)).reshape(B, H, S)
    dqk = gam[..., None, None] * pv                                   # same-step dL/d(q_{t,o}.k_{t,i})

    dk_state = psivc @ dS.transpose(-1, -2)                          # [B, H, nc, F, N]
    out["DDA_CS_REV"] = (kc * dk_state).view(B, H, nc, C, R * N).sum(-1).reshape(B, H, S)
    dkq = psivc @ dyc.transpose(-1, -2)                              # PsiV_s . dy_t  [F(s), F(t)]
    out["DSSDA"] = (lkq * dkq).view(B, H, nc, C, R, C, R).sum((4, 6))
    dkq_m = dkq * decay_st
    dk_hat = erF * dk_state + dkq_m @ qc
    out["DFACTOR"] = (chunk(k_rot) * dk_hat).view(B, H, nc, C, R * N).sum(-1).reshape(B, H, S)
    dk_rot = dk_hat.reshape(B, H, S, R, N) * factor[..., None, None]

    out["DDA"] = _per_step(torch.exp(a_last) * (states * dS).sum((-1, -2)), C)
    dq_state = dyc @ states.transpose(-1, -2)                        # [B, H, nc, F, N]
    out["DDA_CS"] = (qc * dq_state).view(B, H, nc, C, R * N).sum(-1).reshape(B, H, S)
    dq_hat = (eaF * dq_state + dkq_m.transpose(-1, -2) @ kc).reshape(B, H, S, R, N)

    out["DANGLES"] = (angle_grad(dk_rot, k, cos, sin) + angle_grad(dq_hat, q, cos, sin)).sum(3)
    qkd = dqk.reshape(B, H, S, R, R)
    dk = rotate_back(dk_rot, cos, sin) + torch.einsum("bhsoi,bhson->bhsin", qkd, q)
    dq = rotate_back(dq_hat, cos, sin) + torch.einsum("bhsoi,bhsin->bhson", qkd, k)
    return to_boundary(out, dq, dk, shape)


def _per_step(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, H, nc] per-chunk values -> [B, H, nc * C] on every step of the chunk."""
    return x.repeat_interleave(C, dim=-1)


def to_boundary(out: dict, dq: torch.Tensor, dk: torch.Tensor, shape: dict) -> dict:
    """Lay internal [B, H, S, ...] gradients out as the boundary's tensors."""
    B, S, H, R, N = dq.shape[0], dq.shape[2], dq.shape[1], dq.shape[3], dq.shape[4]
    res = {"DQ": dq.permute(0, 2, 3, 1, 4).reshape(B, S * R, H, N),
           "DK": dk.permute(0, 2, 3, 1, 4).reshape(B, S * R, H, N),
           "DV": out["DV"].permute(0, 2, 1, 3), "DANGLES": out["DANGLES"].permute(0, 2, 1, 3)}
    for name in OUTPUTS:
        if name not in res and name in out:
            res[name] = out[name]
    return {k: res[k].contiguous() for k in OUTPUTS if k in res}


# --------------------------------------------------------------------------------------------
# reference (1): autograd through the plain chunked forward


def autograd_bwd_bwd(inp: dict, shape: dict, dtype=torch.float64) -> tuple[dict, torch.Tensor]:
    """bwd_bwd outputs by differentiating the forward; also returns the forward's STATES."""
    B, S, H, G, N, P, R, C, nc, nr = dims(shape)
    F = C * R
    m = _common(inp, shape, dtype)
    leaf = lambda x: x.detach().clone().requires_grad_(True)  # noqa: E731
    q, k, v = leaf(m["q"]), leaf(m["k"]), leaf(m["v"])
    psi = leaf(inp["MIMO_V"].to(dtype)[None].expand(B, H, R, P))
    d = leaf(inp["D"].to(dtype)[None].expand(B, H)) if shape["hasD"] else None
    ang = leaf(inp["ANGLES"].to(dtype).permute(0, 2, 1, 3))            # [B, H, S, nr]
    factor, gamma = leaf(m["factor"]), leaf(m["gamma"])
    da_cs, da_cs_rev = leaf(inp["DA_CS"].to(dtype)), leaf(inp["DA_CS_REV"].to(dtype))
    a_last = leaf(inp["DA_CS"].to(dtype).view(B, H, nc, C)[..., -1])
    seg = inp["SEGSUM"].to(dtype)
    e = leaf(torch.where(_strict_lower(C, seg.device), torch.exp(seg), 0))   # [B, H, nc, C(t), C(s)]

    cos, sin = torch.cos(ang)[:, :, :, None], torch.sin(ang)[:, :, :, None]
    q_hat = rotate(q, cos, sin)
    k_hat = rotate(k, cos, sin) * factor[..., None, None]
    psiv = v[:, :, :, None, :] * psi[:, :, None]                      # [B, H, S, R, P]
    diag = gamma[..., None, None] * torch.einsum("bhsrn,bhsin,bhsip->bhsrp", q, k, psiv)
    y = diag + (d[..., None, None, None] * psiv if d is not None else 0)
    qc = q_hat.reshape(B, H, nc, F, N)
    kc = k_hat.reshape(B, H, nc, F, N)
    vc = psiv.reshape(B, H, nc, F, P)
    kc_in = kc * torch.exp(da_cs_rev).repeat_interleave(R, -1).view(B, H, nc, F, 1)
    qc_out = qc * torch.exp(da_cs).repeat_interleave(R, -1).view(B, H, nc, F, 1)
    e_full = e.repeat_interleave(R, -1).repeat_interleave(R, -2)      # [.., F(t), F(s)], used unmasked
    state = torch.zeros(B, H, N, P, dtype=dtype, device=seg.device)
    states, ys = [], []
    for c in range(nc):
        states.append(state.detach())
        ys.append(qc_out[:, :, c] @ state + ((qc[:, :, c] @ kc[:, :, c].transpose(-1, -2)) * e_full[:, :, c]) @ vc[:, :, c])
        state = torch.exp(a_last[:, :, c])[..., None, None] * state + kc_in[:, :, c].transpose(-1, -2) @ vc[:, :, c]
    y = y + torch.stack(ys, 2).reshape(B, H, S, R, P)
    if shape["hasZ"]:
        zz = inp["Z"].to(dtype).permute(0, 2, 1, 3)[:, :, :, None, :] * inp["MIMO_Z"].to(dtype)[None, :, None]
        y = y * torch.nn.functional.silu(zz)
    if shape["reduceO"]:
        o = (y * inp["MIMO_O"].to(dtype)[None, :, None]).sum(3)      # [B, H, S, P]
        loss = (o * inp["DOUT"].to(dtype).permute(0, 2, 1, 3)).sum()
    else:
        loss = (y * inp["DOUT"].to(dtype).permute(0, 3, 1, 2, 4)).sum()
    leaves = [q, k, v, psi, ang, factor, gamma, da_cs, da_cs_rev, a_last, e] + ([d] if d is not None else [])
    grads = dict(zip(["q", "k", "v", "psi", "ang", "factor", "gamma", "da_cs", "da_cs_rev", "a_last", "e", "d"],
                     torch.autograd.grad(loss, leaves)))
    out = {"DV": grads["v"], "DMIMO_V": grads["psi"], "DANGLES": grads["ang"], "DFACTOR": grads["factor"],
           "DGAMMA_DIAG": grads["gamma"], "DDA_CS": torch.exp(-da_cs.detach()) * grads["da_cs"],
           "DDA_CS_REV": torch.exp(-da_cs_rev.detach()) * grads["da_cs_rev"],
           "DDA": _per_step(grads["a_last"], C), "DSSDA": grads["e"].transpose(-1, -2)}
    if d is not None:
        out["DD"] = grads["d"]
    return to_boundary(out, grads["q"], grads["k"], shape), torch.stack(states, 2)
