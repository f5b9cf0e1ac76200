"""cuTile lane for m2rnn_bwd: a checkpointing forward, then backprop through time per (batch row,
value head) in segment launches. Math and layouts: lab/problems/_m2rnn.py; the contract copies
kernels/triton/m2rnn_bwd.py (fp32 per-value-head gradient buffers; shared q / k / W / f heads and dW's
batch sum folded by lab.problems._m2rnn.reduce_heads afterwards).

Both kernels follow what the forward lane (kernels/cutile/m2rnn_fwd.py) learned from tileiras' sm_90a
SASS: steps unrolled inside a chunk (``ct.static_iter``) so rows come out of chunk tiles at constant
indices, per-step values stacked into chunk tiles with ``ct.insert`` and reduced once per chunk
(a reduction over the BK rows crosses warps through shared memory with block barriers; one per step
was the cost), one load and one store per chunk and array.

Kernel 1 (``_fwd_ckpt``), grid B*N: the fp32 state H [BK, BV] is carried through chunks of T_FWD
steps. It stores the state before every CKPT-th step to ``ckpt`` [B*N, NSEG, BK, BV] and, since dy is
an input, the whole of dq_t = H_t dy_t (the states after each step stacked, reduced over V once per
chunk), so the walk below has no dq work.

Kernel 2 (``_seg``), launched NSEG + 1 times (``schedule``): launch m recomputes segment
NSEG - m - 1 from its checkpoint into a global fp32 scratch [B*N, CKPT, BK, BV] (row i: the state
before the segment's step i; one [T, BK, BV] store per chunk) and walks segment NSEG - m backwards
from the scratch the previous launch wrote. Scratch buffers alternate by segment parity and dH / dW
move between two buffer pairs, so every store -> load dependence crosses a kernel boundary (cuTile
orders no weak memory accesses across a program's threads: its memory_model page; the first version of
this lane read back scratch it had stored in the same program and failed parity on the H100).
ROLES = "split" runs the recompute and the walk as two programs (grid B*N x 2) that proceed side by
side; "fused" runs both in one program, one after the other. The walk, per chunk of T steps
(k, q as [BK, T], v, dy as [T, BV], f as [1, T], one load each), from the last step to the first:
    H_{t-1} and its transpose loaded from the scratch (independent of the chain)
    Z = tanh(H_{t-1} W + k_t v_t^T)      (recomputed; off the chain)
    G = dH + q_t dy_t^T;  dX = (1 - f_t) G (1 - Z^2);  dH = dX W^T + f_t G   (the serial chain)
    dW += H_{t-1}^T dX (one product per step, off the chain)
    dk_t = sum_V dX v_t and the df partial sum_V G (H_{t-1} - Z) (row sums, stacked [BK, T]);
    dv_t = sum_K dX k_t (a column sum, stacked [T, BV])
and one store per chunk of dk, dv and df. A first version of this walk loaded the chunk's states as one
[T, BK, BV] tile and stacked dX for per-chunk dv / dW: 12.5 KB of stack per thread (sm_90a AOT) and
83 ms at b2_n8 on the H100; per-step loads and products brought the stack to 1.3 KB and 9 ms.
Measured (H100, 2026-11-22, scripts/profile_lane.py at b2_n8, T = 4): the 129 segment launches take
7.4 ms (1.8 us per walked step, against 0.3 us per step of the forward lane), the checkpoint forward
1.8 ms. The walk is the gap to the other DSLs; where tileiras spends it (the per-step column sum for
dv crosses warps; the per-step dW product) is not yet profiled at instruction level.
WALK = "chunk" (``_walk_chunk``, 2026-11-23) came from the sm_90a SASS of that walk: tileiras lowered the
16-row dW product to FFMA (512 FFMA plus bf16 unpacking per chunk of 4 steps) and the per-step row /
column sums crossed warps (about 8 block barriers per step). The chunk walk batches Z, dk, dv, df and dW
per chunk (dW as a 64-row wgmma on zero-padded transposed states), leaving one HGMMA and one barrier per
step. Measured (H100, 2026-11-23, sweep results/h100/m2rnn_bwd/20261123T031047Z-*, parity ok): 5.90 /
10.35 / 28.18 ms at b2_n8 / b4_n44 / b8_n84 against the step walk's 8.77 / 20.10 / 61.74. The profile
(results/logs/m2rnn-s5-device-11-*) puts b2_n8 at 4.2 ms in the 65 segment launches (1.0 us per walked
step) and 1.75 ms in the checkpoint forward. Loading the next chunk's inputs ahead (tried, reverted) was
slower (5.5 ms of segments) and hung at T = 4 (results/logs/m2rnn-s5-device-16-*).
KV = "mma" (2026-11-23) takes the forward lane's fix for the broadcast outer products (``_pair`` / ``_outer``):
k v^T in the checkpoint forward, the recompute and the walk's Z, and q dy^T in the walk, as one-hot masked
products over 16-step windows; T_RE sets the recompute's chunk (0: T). Measured (H100, 2026-11-23, sweep
results/h100/m2rnn_bwd/20261123T054926Z-*, parity ok): 6.30 / 10.05 / 29.45 ms at b2_n8 / b4_n44 / b8_n84
(best KV = mma seeds) against 5.92 / 12.36 / 37.53 for the default (KV = outer, occupancy 1) in the same run
and 28.18 for KV = outer at occupancy 3 (031047Z-*) at b8_n84. The profile (results/logs/m2rnn-s6-device-5-*)
puts the checkpoint forward at 1.39 ms against 1.76 at b2_n8 but the 65 segment launches at 5.1 ms against
4.2 with T_RE = 16: the walk, not the forward, is the gap, so the default stays KV = "outer".
Tried and reverted (2026-11-23, commits e8b92d9 / 8ae6d73): a "window" walk that gathered dk (bf16(dX) times
the window's v, one column kept by a select), df (row sums selected into a [BK, 16] accumulator) and dv (a
product of one-hot k rows with the stacked dX) over 16-step windows, to drop the per-chunk cross-warp sums
that take about half of the chunk walk's sm_90a instructions. With the window store behind a branch in the
chunk loop it did not finish within 300 s on the H100 (results/logs/m2rnn-s7-device-5-*); with the chunks
unrolled inside a window loop it took 13.2 ms at b2_n8 against 5.96 for this walk in the same run and gave
wrong results in 5 of its 7 trials (dk in all five; dv, dW and df too with KV = mma; rows in
results/h100/m2rnn_bwd/20261123T090139Z-*; the CPU stand-in of the same bodies matched). The SASS of the first
version (sm_90a AOT) still had 10 block barriers per chunk of 2 steps and many shared-memory store / load
pairs (layout conversions of the extra tiles). Fused roles at occupancy 3 (half the programs) gave 28.15 ms at
b8_n84, the same as split (20261123T091223Z-*).
WALK = "chain" (``_seg3``, 2026-11-23) takes everything but the serial chain out of the walking program: per
launch (``schedule3``, NSEG + 2 launches, grid B*N x (2 + G_SPLIT)) role 0 walks the chain of one segment
(G = dH + q dy^T, dX = dz G, dH = dX W^T + f G; dz = (1 - f)(1 - Z^2) stored by the recompute with DZ_STORE,
else recomputed per chunk), storing G; role 1 recomputes the segment before it (states, and dz); roles 2..
take the gradients of the segment after it, whose chain ran in the previous launch (``_grads``: Z again,
dX = dz G, dk / dv / df as batched reductions, dW as a 64-row product, one dW part per program and
segment, summed by torch). SCRATCH = bfloat16 halves the scratch traffic and is exact for the products
(DOT = input rounds the states to bf16 there anyway). sm_90a SASS (AOT, b2_n8): the chain loop has 176
instructions and 2 block barriers per chunk of 2 steps, against 846 and 11 for the chunk walk. Measured
(H100, 2026-11-23, parity ok): 3.82 ms at b2_n8 with CKPT 128, T = 4, bf16, dz stored, 4 gradient programs
(results/h100/m2rnn_bwd/20261123T111757Z-*), against 5.89 for the chunk walk's best; at b8_n84 38.9 ms at
occupancy 1 (20261123T112817Z-*; the occupancy 2 / 3 seeds and b4_n44 were not reached before the device
call ended): one kernel for three roles takes the register and shared memory needs of the largest (the
gradients: 168 registers, 226 KB at occupancy 1), so 672 x 4 programs run in ~20 waves per launch.
WALK = "store" (``_fwd_store``, ``_chain_all``, ``_grads_all``; 2026-11-23) drops the checkpoints: the
forward keeps every state before its step and dz ([B*N, S, BK, BV] each, int64-indexed: 2.8e9 elements,
5.6 GB in bf16 at b8_n84; dz only with DZ_STORE, else the chain recomputes Z per chunk), then the chain
walks per (batch row, head) and B*N x G_SPLIT programs take all gradients (dq too, from
H_t = f H_{t-1} + (1 - f) Z), each kernel with its own occupancy hint (fwd_occupancy, occupancy,
g_occupancy). PIPE cuts the chain into pieces, one launch each on a high-priority stream; each piece's
gradients run on the caller's stream once its chain is done, beside the next piece's chain. The cost is the
traffic (states, dz and G written and read once each: ~34 GB at b8_n84 in bf16, ~11 ms at 3 TB/s).
Measured (H100, 2026-11-23, profiles in results/logs/m2rnn-s9-device-{11,16,17}-*, sweeps parity ok):
  - the first version, one piece and DW = "pad": 30.2 / 9.37 ms at b8_n84 / b4_n44 (20261123T133919Z-*,
    134237Z-*); at b8_n84 the gradients took 11.2 ms, the forward 6.1 and the chain 12.3 at occupancy 1 (T = 2),
    4.6 at 6 (T = 4; 672 programs in one wave);
  - DW = "diag" (block-diagonal dW products, no transposed reload; 1323 against 1774 sm_90a instructions per
    gradient chunk of 4 steps): gradients 7.65 ms at b8_n84; 18.98 / 6.97 ms (20261123T140039Z-*, 140155Z-*);
  - PIPE = 8: 18.26 ms at b8_n84 (20261123T141010Z-*; five chain CTAs fill an SM's registers there, so little
    overlaps) and 5.86 at b4_n44 (20261123T144007Z-*: T = 4, dz stored, T_G = 4, G_SPLIT = 16, occupancy
    6 / 3 / 2), where 176 chain programs leave most of the GPU to the gradients.
Three more store-walk knobs (2026-11-23, evening; H100 sweeps parity ok, rel L2 <= 0.0029; profiles in
results/logs/m2rnn-s10-device-7-*), none faster at b8_n84 than the 18.26 ms above:
  - KV = "fwd": one-hot k v^T in the storing forward only. The forward (dz stored, T_FWD 8, fwd_occupancy 2)
    took 7.6 ms against 6.1 with broadcast products at occupancy 3; 19.1-20.0 ms in all
    (20261123T164336Z-*). At ragged_h0 it gave 1.097 ms against 1.516 (20261123T165111Z-*).
  - C_ROWS (``_chain_rows``): R batch rows of a head per chain program, stacked [R*BK, BV], so that fewer
    chain CTAs leave registers to the gradients of the piece before. The chain itself got slower (6.2 ms
    at R = 2 against 4.9, 9.6 at R = 4 with PIPE 1); best 19.1 ms at R = 2.
  - STORE = "z" (``_fwd_zs``, ``_grads_zs_all``): the forward keeps Z (half the writes of states + dz) and
    one fp32 checkpoint per gradient range; each gradient program rebuilds its range's states,
    H_t = f H_{t-1} + (1 - f) Z_t. That serial scan over the steps of a chunk moves data between threads
    in tileiras' layouts (sm_90a AOT: 1907 instructions and 19 block barriers per chunk of 4 steps with
    [T, BK, BV] tiles, 1710 and 16 with the [BK, T*BV] tiles kept here, against 1320 and 7 for the
    stored states): gradients 17.9 ms against 7.5-11 ms, 25.0 ms in all.
Two more (2026-11-23, night; H100 sweeps parity ok, rel L2 <= 0.0024; per-kernel profiles at PIPE 1 of the
b8_n84 best in results/logs/m2rnn-s11-device-{5,10,15,20}-*):
  - STEP_MMA (``_serial``): the serial products as a batch of one (mma.sync) instead of wgmma. No gain: the
    forward 4.35 / 4.31 ms against 4.29, the chain 6.68 / 6.65; 18.33 / 18.32 ms in all (20261123T190734Z-*,
    191532Z-*). The time is in the stores and the traffic, not in the wgmma waits.
  - DQ: the kernel that takes dq. The gradient kernel is instruction-bound; dq's sum over V is about a
    quarter of its chunk (sm_90a AOT: 1003 against 1320 instructions per chunk of 4 steps without it).
    DQ = "fwd" (a sum over V per step in the storing forward): gradients 6.18 ms against 7.52, forward 5.22
    against 4.31; 17.45 ms at b8_n84 (20261123T193100Z-*, then named DQ_FWD) and 17.00, the best of this lane
    there, with KV = fwd, G_SPLIT 8 and 3 gradient CTAs per SM (20261123T195200Z-*).
    DQ = "chain" (per chunk from the chain's states and recomputed Z): the chain's 40 registers at
    occupancy 6 spill (120 bytes of stack), chain 11.97 ms against 6.67; 18.50 ms at best (occupancy 4,
    20261123T194309Z-*).
Four more (2026-11-23, late; H100 sweeps parity ok, rel L2 <= 0.0029; per-kernel profiles at PIPE 1 of the
b8_n84 best in results/logs/m2rnn-s12-device-{5,10,15}-*), which together bring b8_n84 to 13.92 ms:
  - FWD_STORE = "step" (``_fwd_steps``): the storing forward keeps no [T, BK, BV] stack; each step's state
    goes out as its own store and dq_t = H_t dy_t is a one-hot product per step into a [BK, T] accumulator
    (a batch of one, mma.sync: a wgmma would read the per-step masked dy from shared memory behind a block
    barrier). Forward 3.89 / 3.83 ms at T_FWD 8 / 16 against 4.82 for the stacked one; 15.91 ms in all
    (20261123T211853Z-*). Storing dz per step as well (DZ_STORE) made the chain 5.13 ms but the forward
    5.73: 16.16 at best (20261123T213511Z-*).
  - The recompute takes the bf16 scratch tile as its mma operand as loaded (``_recompute_z``; it went
    through fp32 and back): sm_90a AOT at b8_n84, 1160 against 1200 chain instructions and 1728 against
    1824 gradient instructions, whose 112 bytes of spills at 80 registers went away.
  - CHAIN_Z = "step": the chain recomputes each step's Z as a 2-D product in the step loop instead of one
    batched product per chunk, whose warp-level accumulator layout differs from the serial wgmma's, so dz
    crossed shared memory with block barriers (1048 against 1160 instructions, 4 against 7 barriers).
    Chain 5.40 ms against 6.68, gradients 5.13 against 5.98; 14.35 ms at b8_n84 with CHAIN_Z step against
    15.14 with chunk, both with the operand change (20261123T215007Z-*).
  - PARTIALS = "bfloat16": the per-value-head dq / dk / dv / df buffers that the shared heads are summed
    from (lab.problems._m2rnn.reduce_heads) in bf16, which halves the sums' reads: 0.29 ms of torch
    reductions against 0.50. 13.92 ms at b8_n84 (rel L2 0.0029 against 0.0024 with fp32 buffers).
  At the other shapes these b8_n84 seeds did not beat the earlier bests (b4_n44 5.86, ragged_h0 1.25,
  b2_n8 4.44 ms; 20261123T215530Z-*, 215812Z-*, 220124Z-*).
Steps past a ragged S read zero q / k / v / dy and get f = 1, so they leave dH unchanged and add
nothing; stores drop rows past S. K and V are padded to powers of two >= 16 (BK, BV): zero-padded
loads keep padded rows / columns of H and dH at zero.

Scratch traffic: every state is written once and read once (B*N*S*BK*BV*4 bytes each way, 11 GB at
b8_n84); a small CKPT keeps a segment's scratch (B*N*CKPT*BK*BV*4 bytes) in L2 between launches, a
large one means fewer launches.

cuTile gives no control of threads, registers or shared memory; tileiras decides them under the
occupancy hints. Tunables:
  CKPT              checkpoint interval (steps): ceil(S/CKPT) + 2 launches
  T, T_FWD          steps per chunk of the walk / recompute and of the forward (unrolled)
  ROLES             "split" (recompute and walk as separate programs) or "fused" (WALK = step / chunk)
  WALK              "step", "chunk", "chain" or "store" (above)
  T_G, G_SPLIT      WALK = chain / store: the gradient programs' chunk (steps) and programs per (batch row,
                    head) and segment (chain) or sequence (store)
  SCRATCH, DZ_STORE WALK = chain / store: scratch dtype (float32, bfloat16); the recompute stores dz
  DW                WALK = chain / store: the gradient programs' dW product: "pad" (states loaded again
                    transposed, padded to 64 rows) or "diag" (block-diagonal product of the chunk's tiles)
  PIPE              WALK = store: pieces of the chain, each one launch, whose gradients run beside the
                    next piece's chain (two streams)
  STORE             WALK = store: what the forward keeps per step, the state ("h") or Z ("z", with
                    range checkpoints; G_SPLIT programs then take contiguous ranges)
  C_ROWS            WALK = store: batch rows per chain program
  STEP_MMA          the serial products (the forward / recompute step, the walks' and chain's dH): "2d"
                    (tileiras picks wgmma on sm_90a), "batched" (a batch of one: mma.sync) or "fwd"
                    (batched in the forward / recompute step only); ``_serial`` (no gain measured)
  DQ                WALK = store, STORE = h: which kernel takes dq_t = H_t dy_t: "grads", "fwd" (the storing
                    forward, a sum over V per step) or "chain" (per chunk from the states and the Z it
                    recomputes; no dz store)
  FWD_STORE         WALK = store, STORE = h: the storing forward stacks a chunk's states and stores them once
                    ("chunk") or stores each step's state from its registers ("step"; dq as one-hot products)
  CHAIN_Z           WALK = store, STORE = h: the chain recomputes Z per chunk ("chunk") or per step ("step")
  PARTIALS          WALK = store, bf16 inputs: dtype of the per-value-head dq / dk / dv / df buffers
  g_occupancy       WALK = store: the gradient kernel's CTAs-per-SM hint
  DOT               operands of the products for bf16 inputs: input (bf16, upstream's choice), tf32,
                    tf32x3 (hi/lo split, ~fp32), ieee (fp32 mma); fp32 inputs always use ieee
  FAST_TANH         ct.tanh(rounding_mode=APPROX) (MUFU.TANH) vs RoundingMode.FULL
  num_worker_warps  @ct.kernel hint for both kernels: 0 (compiler), 4 or 8 (cuda-tile 1.7.0 emits
                    bytecode 13.4, where other values are refused)
  occupancy, fwd_occupancy  @ct.kernel CTAs-per-SM hints of the backward / forward (0 = compiler)

Read to learn the API (no code copied): cuda-tile 1.7.0 installed source (cuda/tile/_stub.py docstrings
of load (order) / store / extract / insert / static_iter / mma / tanh, _memory_model.py, _execution.py
kernel hints, _compile.py bytecode versions), NVIDIA/cutile-python samples AttentionFMHA.py, docs
performance.rst and memory_model.rst; kernels/cutile/gemm.py (export) and m2rnn_fwd.py (this lab).
"""
from __future__ import annotations

import time

import torch
import cuda.tile as ct

from kernels import _targets
from kernels.cutile.gemm import ARCHS, _gpu_code, cubin_resources, export_cubin, versions  # noqa: F401
from lab.problems import _m2rnn as m2

DSL = "cutile"
KERNEL = "m2rnn_bwd"
TUNABLES = ("CKPT", "T", "T_FWD", "T_RE", "KV", "WALK", "ROLES", "T_G", "G_SPLIT", "SCRATCH", "DZ_STORE", "DW",
            "PIPE", "STORE", "C_ROWS", "STEP_MMA", "DQ", "FWD_STORE", "CHAIN_Z", "PARTIALS", "DOT", "FAST_TANH",
            "num_worker_warps", "occupancy", "fwd_occupancy", "g_occupancy")
# Default: WALK = "chain" at CKPT 128, T = 4, bf16 scratch, dz stored, 4 gradient programs per segment, the
# fastest parity-ok config of the H100 sweep of 2026-11-23 at b2_n8: 3.82 ms (results/h100/m2rnn_bwd/
# 20261123T111757Z-*), against 5.89 for the chunk walk's best (20261123T031047Z-*). The step walk (WALK =
# "step") is the 2026-11-22 lane. Its config T = 8, ROLES split, occupancy 2 (255 registers, sm_90a) gives
# wrong dk / dv / dW / df at every shape while dq is right: scripts/debug_cutile_m2rnn_bwd.py on the H100
# (results/logs/m2rnn-s4-device-7-*) found the checkpoints right and, in the first walked chunk, steps right
# until unrolled step 5, from which dk and dv are exactly 64x the reference. The CPU emulation of the same
# bodies matches and other configs of the same code pass, which points at tileiras' lowering of that config;
# it stays in the space so the parity check keeps reporting it.
# The values the knobs of WALK = "chain" / "store" must keep for the other walks (they do not apply there).
NEUTRAL = {"T_G": 8, "G_SPLIT": 1, "SCRATCH": "float32", "DZ_STORE": False, "DW": "pad", "g_occupancy": 0}
# WALK = "store" keeps no checkpoints: CKPT stays at this value (one config per distinct kernel).
STORE_CKPT = 64
DEFAULTS = {"CKPT": 128, "T": 4, "T_FWD": 16, "T_RE": 0, "KV": "outer", "WALK": "chain", "ROLES": "split",
            "T_G": 4, "G_SPLIT": 4, "SCRATCH": "bfloat16", "DZ_STORE": True, "DW": "pad", "PIPE": 1,
            "STORE": "h", "C_ROWS": 1, "STEP_MMA": "2d", "DQ": "grads", "FWD_STORE": "chunk", "CHAIN_Z": "chunk",
            "PARTIALS": "float32", "DOT": "input",
            "FAST_TANH": True, "num_worker_warps": 0, "occupancy": 1, "fwd_occupancy": 3, "g_occupancy": 0}
TARGETS = tuple(f"sm_{a}a" if a in (90, 100, 103, 110, 120, 121) else f"sm_{a}" for a in ARCHS)
DTYPES = ("float32", "bfloat16")
DOTS = ("input", "tf32", "tf32x3", "ieee")
ROLES = ("split", "fused")
WALKS = ("step", "chunk", "chain", "store")
KERNEL_NAMES = ("forward", "backward", "gradients")
SCRATCHES = ("float32", "bfloat16")
DWS = ("pad", "diag")
PIPES = (1, 2, 4, 8, 16, 32)
STORES = ("h", "z")
C_ROWS = (1, 2, 4, 8)
# STEP_MMA: the bits of DOT (``dot_mode``) that batch the serial products (``_serial``): 4 the forward /
# recompute step, 8 dH of the walks and the chain.
STEP_MMAS = {"2d": 0, "batched": 12, "fwd": 4}
DQS = ("grads", "fwd", "chain")
FWD_STORES = ("chunk", "step")
CHAIN_ZS = ("chunk", "step")
PARTIALS = ("float32", "bfloat16")
G_SPLITS = (1, 2, 4, 8, 16, 32, 64)
KVS = ("outer", "mma", "fwd")
CKPTS = (16, 32, 64, 128, 256)
CHUNKS = (2, 4, 8, 16)
MAX_BK, MAX_BV = 64, 32
_CT = {"float32": ct.float32, "bfloat16": ct.bfloat16}
_ELEM = {"float32": 4, "bfloat16": 2}

C = ct.Constant[int]
CB = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
F32 = ct.float32


# ---- device code --------------------------------------------------------------------------------

def _tanh(x, FAST):
    if FAST:
        return ct.tanh(x, rounding_mode=ct.RoundingMode.APPROX)
    return ct.tanh(x, rounding_mode=ct.RoundingMode.FULL)


def _prod(a, b, acc, DOT, B_EXACT):
    """acc + a @ b for fp32 tiles a, b. DOT % 4 (the higher bits are ``_serial``'s): 0 bf16 operands, 1 tf32, 2 three
    tf32 products (hi/lo split; two when B_EXACT, i.e. b is a bf16 value and so exact in tf32), 3 fp32 mma."""
    mode = DOT % 4
    if mode == 0:
        return ct.mma(a.astype(ct.bfloat16), b.astype(ct.bfloat16), acc)
    if mode == 3:
        return ct.mma(a, b, acc)
    ah = a.astype(ct.tfloat32)
    bh = b.astype(ct.tfloat32)
    acc = ct.mma(ah, bh, acc)
    if mode == 2:
        acc = ct.mma((a - ah.astype(F32)).astype(ct.tfloat32), bh, acc)
        if not B_EXACT:
            acc = ct.mma(ah, (b - bh.astype(F32)).astype(ct.tfloat32), acc)
    return acc


def _recompute_z(hs, w, acc, DOT, FAST, SCB):
    """Z = tanh(H W + acc) for stacked states hs [T, BK, BV] as loaded from the scratch: with bf16 operands
    (DOT input) and a bf16 scratch the loaded tile is the product's operand as it is (no round trip
    through fp32, which cost the chain and the gradient kernel unpack and repack instructions)."""
    if SCB and DOT % 4 == 0:
        return _tanh(ct.mma(hs, w.astype(ct.bfloat16), acc), FAST)
    return _tanh(_prod(hs.astype(F32), w, acc, DOT, True), FAST)


def _serial(a, b, acc, DOT, B_EXACT, BIT):
    """``_prod`` for the products on a serial chain, [M, K] x [K, N]: BIT 4 for the forward / recompute step,
    8 for dH = dX W^T + f G of the walks and the chain. With that bit of DOT set (``dot_mode``) as a batch
    of one, [1, M, K] x [1, K, N]: for a 2-D product of this size tileiras emits a warpgroup wgmma on sm_90a
    (HGMMA, with its fence / arrive / commit / wait each step), for a batched one warp-level mma.sync (HMMA),
    as in the forward lane's step (sm_90a AOT: 1726 instructions and 64 HMMA per 16-step chunk; 2.84 ms at
    b8_n84 on the H100, results/h100/m2rnn_fwd/20261123T053146Z-*). Measured (H100, 2026-11-23, b8_n84, the
    store walk's best config at PIPE 1, results/logs/m2rnn-s11-device-{5,10}-*): no gain. The storing
    forward took 4.35 / 4.31 ms batched against 4.29 with wgmma (results/logs/m2rnn-s9-device-16-*), the chain
    6.68 batched against 6.65; sweeps 18.33 / 18.32 ms against 18.26 (20261123T190734Z-*, 191532Z-*). So
    the wgmma's wait is not what bounds these loops; the storing forward's cost is its stores (6.1 ms when
    it also stores dz)."""
    M = a.shape[0]
    K = a.shape[1]
    N = b.shape[1]
    if (DOT // BIT) % 2 == 1:
        a = a.reshape((1, M, K))
        b = b.reshape((1, K, N))
        acc = acc.reshape((1, M, N))
    return _prod(a, b, acc, DOT, B_EXACT).reshape((M, N))


def _load_w(W, nw, BV):
    return ct.load(W, (nw, 0, 0), (1, BV, BV), padding_mode=ZERO).reshape((BV, BV)).astype(F32)


def _cols(x, b, h, c, T, BX):
    """Steps [c*T, c*T + T) of head h of x [B, S, H, X] as a [BX, T] fp32 tile (one step per column;
    zeros past S and X)."""
    return ct.load(x, (b, h, 0, c), (1, 1, BX, T), order=(0, 2, 3, 1), padding_mode=ZERO).reshape((BX, T)).astype(F32)


def _rows(x, b, h, c, T, BX):
    """The same steps as a [T, BX] fp32 tile (one step per row)."""
    return ct.load(x, (b, h, c, 0), (1, 1, T, BX), order=(0, 2, 1, 3), padding_mode=ZERO).reshape((T, BX)).astype(F32)


def _gates(f, b, h, c, T, S):
    """f of steps [c*T, c*T + T) as [1, T] fp32, 1 past S (a step that keeps the state as it is)."""
    fc = ct.load(f, (b, h, c), (1, 1, T), order=(0, 2, 1), padding_mode=ZERO).reshape((1, T)).astype(F32)
    pos = ct.arange(T, dtype=ct.int32).reshape((1, T)) + c * T
    return ct.where(pos < S, fc, 1.0)


KW = 16   # steps of the window the one-hot products take as their K (the bf16 mma's K is 16)


def _pair(x, y, b, hx, hy, c, T, BX, BY, KV):
    """Chunk c's x as [BX, T] and y as [T, BY] (one step per column / row), and where step i of the chunk is
    in them. With KV the tiles are bf16 (exact: the inputs are bf16) and, for chunks shorter than KW, those of
    the KW-step window holding the chunk (the one-hot product needs K >= 16), at offset (c*T) % KW."""
    if KV:
        if T < KW:
            cw = (c * T) // KW
            return (_cols(x, b, hx, cw, KW, BX).astype(ct.bfloat16), _rows(y, b, hy, cw, KW, BY).astype(ct.bfloat16),
                    (c * T) % KW)
        return _cols(x, b, hx, c, T, BX).astype(ct.bfloat16), _rows(y, b, hy, c, T, BY).astype(ct.bfloat16), 0
    return _cols(x, b, hx, c, T, BX), _rows(y, b, hy, c, T, BY), 0


def _outer(xc, yc, off, i, BX, BY, T, KV):
    """x_i y_i^T [BX, BY] fp32 for step i of a chunk from ``_pair``'s tiles. With KV it is the product of x's
    tile with its columns other than off + i zeroed and y's tile: tileiras writes that straight into the mma
    accumulator layout, where the broadcast outer product cost about 70 shuffles and selects per step (sm_90a
    SASS of the forward lane). Exact either way: one bf16 x bf16 product per element."""
    if KV:
        W = max(T, KW)
        xm = ct.where(ct.arange(W, dtype=ct.int32).reshape((1, W)) == off + i, xc, ct.zeros((BX, W), dtype=ct.bfloat16))
        return ct.mma(xm, yc, ct.zeros((BX, BY), dtype=F32))
    return ct.extract(xc, (0, i), (BX, 1)) * ct.extract(yc, (i, 0), (1, BY))


def _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, KV):
    """(Z, H') of step i of a chunk from the state h: Z = tanh(h W + k v^T), H' = f h + (1 - f) Z."""
    ft = ct.extract(ff, (0, i), (1, 1))
    z = _tanh(_serial(h, w, _outer(kc, vc, off, i, BK, BV, T, KV), DOT, True, 4), FAST)
    return z, ft * h + (1.0 - ft) * z


def _program(v, W, N, GW, BV):
    """(bn, b, n, S, w) of a program on grid axis 0 = batch row x value head: its index, batch row, head,
    the sequence length and the head's W [BV, BV] in fp32."""
    bn = ct.bid(0)
    n = bn % N
    return bn, bn // N, n, v.shape[1], _load_w(W, n // GW, BV)


def _initial_state(h0, b, n, BK, BV, HAS_H0):
    """The state before step 0, [BK, BV] fp32: h0's (zero-padded) or zeros."""
    if HAS_H0:
        return ct.load(h0, (b, n, 0, 0), (1, 1, BK, BV), padding_mode=ZERO).reshape((BK, BV)).astype(F32)
    return ct.zeros((BK, BV), dtype=F32)


def _fwd_chunk(h, w, k, v, f, b, n, c, S, GK, GF, BK, BV, T, DOT, FAST, KV, KEEP_Z):
    """Chunk c (T steps) of the forward from the state h before it: (the chunk's Z with KEEP_Z, else its
    states after each step, stacked [T, BK, BV]; the state after the chunk)."""
    kc, vc, off = _pair(k, v, b, n // GK, n, c, T, BK, BV, KV)
    ff = _gates(f, b, n // GF, c, T, S)
    out = ct.zeros((T, BK, BV), dtype=F32)
    for i in ct.static_iter(range(T)):
        z, h = _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, KV)
        out = ct.insert(out, (i, 0, 0), (z if KEEP_Z else h).reshape((1, BK, BV)))
    return out, h


def _fwd_ckpt(k, v, W, f, dy, h0, ckpt, dq,
              N: C, GK: C, GW: C, GF: C, BK: C, BV: C, CKPT: C, T: C, HAS_H0: CB, DOT: C, FAST: CB, KV: CB):
    """Grid B*N. States H_{j*CKPT - 1} into ckpt [B*N, NSEG, BK, BV]; dq_t = H_t dy_t (per value head)
    into dq [B, S, N, K] fp32."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    h = _initial_state(h0, b, n, BK, BV, HAS_H0)
    per = CKPT // T
    nch = ct.cdiv(S, T)
    for j in range(ct.cdiv(S, CKPT)):
        ct.store(ckpt, (bn, j, 0, 0), h.reshape((1, 1, BK, BV)))
        for cc in range(min(per, nch - j * per)):
            c = j * per + cc
            hs, h = _fwd_chunk(h, w, k, v, f, b, n, c, S, GK, GF, BK, BV, T, DOT, FAST, KV, False)
            dqc = ct.sum(hs * _rows(dy, b, n, c, T, BV).reshape((T, 1, BV)), axis=2)        # [T, BK]
            ct.store(dq, (b, n, c, 0), dqc.reshape((1, 1, T, BK)), order=(0, 2, 1, 3))


def _recompute(k, v, w, f, ckpt, sc, dzo, b, n, bn, jr, Lr, S,
               GK, GF, BK, BV, CKPT, T, DOT, FAST, KV, DZ, SCB):
    """sc[bn, i] = the state before step jr*CKPT + i, for the Lr steps of segment jr (whole chunks of T,
    the recompute's own chunk: the scratch rows do not depend on it). T is a power-of-two multiple of the
    walk's chunk (config_reason), so these chunks cover every row the walk's chunks read (rows past S keep
    the state: f = 1 there) and none starts past S. With DZ also dzo[bn, i] = (1 - f)(1 - Z^2) of that step
    (the chain walk's factor); with SCB both are stored as bf16."""
    h = ct.load(ckpt, (bn, jr, 0, 0), (1, 1, BK, BV)).reshape((BK, BV))
    _replay(k, v, w, f, h, sc, dzo, f, sc, b, n, bn, jr * (CKPT // T), ct.cdiv(Lr, T), S, GK, GF, BK, BV, T, DOT,
            FAST, KV, DZ, SCB, False)


def _replay(k, v, w, f, h, sc, dzo, dy, dq, b, n, bn, c0, nch, S, GK, GF, BK, BV, T, DOT, FAST, KV, DZ, SCB, DQ):
    """From the state h before chunk c0 (global chunks of T steps), run nch chunks; chunk c's states before
    each step go to sc[bn, c*T + i] and, with DZ, (1 - f)(1 - Z^2) to dzo (one store per chunk each). With
    DQ also dq_t = H_t dy_t into dq [B, S, N, K] (a sum over V per step, one store per chunk; dy and dq are
    not read otherwise)."""
    for c in range(nch):
        cg = c0 + c
        kc, vc, off = _pair(k, v, b, n // GK, n, cg, T, BK, BV, KV)
        ff = _gates(f, b, n // GF, cg, T, S)
        hs = ct.zeros((T, BK, BV), dtype=F32)
        dzs = ct.zeros((T, BK, BV), dtype=F32)
        dqs = ct.zeros((T, BK), dtype=F32)
        if DQ:
            dyc = _rows(dy, b, n, cg, T, BV)
        for i in ct.static_iter(range(T)):
            hs = ct.insert(hs, (i, 0, 0), h.reshape((1, BK, BV)))
            z, h = _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, KV)
            if DZ:
                ft = ct.extract(ff, (0, i), (1, 1))
                dzs = ct.insert(dzs, (i, 0, 0), ((1.0 - ft) * (1.0 - z * z)).reshape((1, BK, BV)))
            if DQ:
                dqs = ct.insert(dqs, (i, 0), ct.sum(h * ct.extract(dyc, (i, 0), (1, BV)), axis=1).reshape((1, BK)))
        ct.store(sc, (bn, c, 0, 0), _scr(hs, SCB).reshape((1, T, BK, BV)))
        if DZ:
            ct.store(dzo, (bn, c, 0, 0), _scr(dzs, SCB).reshape((1, T, BK, BV)))
        if DQ:
            ct.store(dq, (b, n, cg, 0), dqs.reshape((1, 1, T, BK)).astype(dq.dtype), order=(0, 2, 1, 3))


def _scr(x, SCB):
    """x as stored in the scratch: bf16 with SCB, else fp32 as it is."""
    if SCB:
        return x.astype(ct.bfloat16)
    return x


def _outer_stack(x, y, b, hx, hy, cg, T, BX, BY, KV):
    """[T, BX, BY] fp32: x_t y_t^T for the T steps of chunk cg (``_outer`` per step with KV, else one
    broadcast product of the chunk's rows)."""
    if KV:
        xw, yw, off = _pair(x, y, b, hx, hy, cg, T, BX, BY, KV)
        out = ct.zeros((T, BX, BY), dtype=F32)
        for i in ct.static_iter(range(T)):
            out = ct.insert(out, (i, 0, 0), _outer(xw, yw, off, i, BX, BY, T, KV).reshape((1, BX, BY)))
        return out
    return _rows(x, b, hx, cg, T, BX).reshape((T, BX, 1)) * _rows(y, b, hy, cg, T, BY).reshape((T, 1, BY))


def _walk(q, k, v, w, f, dy, sc, dh_in, dw_in, dh_out, dw_out, dk, dv, df, b, n, bn, jw, Lw, S,
          GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST):
    """Backprop through the Lw steps of segment jw from the states in sc; dH / dW in from dh_in / dw_in,
    out to dh_out / dw_out."""
    wt = ct.transpose(w)
    dH = ct.load(dh_in, (bn, 0, 0), (1, BK, BV)).reshape((BK, BV))
    dw = ct.load(dw_in, (bn, 0, 0), (1, BV, BV)).reshape((BV, BV))
    per = CKPT // T
    nch = ct.cdiv(Lw, T)
    for cc in range(nch):
        c = nch - 1 - cc
        cg = jw * per + c
        kc = _cols(k, b, n // GK, cg, T, BK)
        qc = _cols(q, b, n // GQ, cg, T, BK)
        vc = _rows(v, b, n, cg, T, BV)
        dyc = _rows(dy, b, n, cg, T, BV)
        ff = _gates(f, b, n // GF, cg, T, S)
        dks = ct.zeros((BK, T), dtype=F32)
        dfs = ct.zeros((BK, T), dtype=F32)
        dvs = ct.zeros((T, BV), dtype=F32)
        for ii in ct.static_iter(range(T)):
            i = T - 1 - ii
            # H_{t-1} from the scratch, and its transpose for dW (a second, transposed load rather than a
            # layout conversion); neither depends on the chain, so they can be issued early.
            hp = ct.load(sc, (bn, c * T + i, 0, 0), (1, 1, BK, BV)).reshape((BK, BV))
            hpt = ct.load(sc, (bn, c * T + i, 0, 0), (1, 1, BV, BK), order=(0, 1, 3, 2)).reshape((BV, BK))
            ft = ct.extract(ff, (0, i), (1, 1))
            kt = ct.extract(kc, (0, i), (BK, 1))
            vt = ct.extract(vc, (i, 0), (1, BV))
            z = _tanh(_prod(hp, w, kt * vt, DOT, True), FAST)
            G = dH + ct.extract(qc, (0, i), (BK, 1)) * ct.extract(dyc, (i, 0), (1, BV))
            dX = (1.0 - ft) * G * (1.0 - z * z)
            dH = _serial(dX, wt, ft * G, DOT, True, 8)
            dw = _prod(hpt, dX, dw, DOT, False)
            dks = ct.insert(dks, (0, i), ct.sum(dX * vt, axis=1, keepdims=True))
            dfs = ct.insert(dfs, (0, i), ct.sum(G * (hp - z), axis=1, keepdims=True))
            dvs = ct.insert(dvs, (i, 0), ct.sum(dX * kt, axis=0, keepdims=True))
        ct.store(dk, (b, n, 0, cg), dks.reshape((1, 1, BK, T)), order=(0, 2, 3, 1))
        ct.store(dv, (b, n, cg, 0), dvs.reshape((1, 1, T, BV)), order=(0, 2, 1, 3))
        ct.store(df, (b, n, cg), ct.sum(dfs, axis=0).reshape((1, 1, T)), order=(0, 2, 1))
    ct.store(dh_out, (bn, 0, 0), dH.reshape((1, BK, BV)))
    ct.store(dw_out, (bn, 0, 0), dw.reshape((1, BV, BV)))


def _walk_chunk(q, k, v, w, f, dy, sc, dh_in, dw_in, dh_out, dw_out, dk, dv, df, b, n, bn, jw, Lw, S,
                GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, KV):
    """The walk of ``_walk`` with everything that is not on the chain batched per chunk of T steps: the
    chunk's states [T, BK, BV] in one load, Z = tanh(H W + k v^T) as one batched product, then only
    G = dH + q dy^T, dX = (1 - f)(1 - Z^2) G, dH = dX W^T + f G per unrolled step (dX and G stacked),
    and per chunk dk, dv, df (one reduction each over the stacks) and dW. dW = sum_t H_{t-1}^T dX_t is one
    product [MP, T*BK] x [T*BK, BV] per chunk whose A operand is the states loaded transposed with
    their BV columns zero-padded to MP = 64 rows: a 16-row product was lowered to FFMA (sm_90a AOT),
    a 64-row one is the wgmma shape; rows >= BV of the accumulator stay zero."""
    MP = max(64, BV)
    wt = ct.transpose(w)
    dH = ct.load(dh_in, (bn, 0, 0), (1, BK, BV)).reshape((BK, BV))
    dwp = ct.load(dw_in, (bn, 0, 0), (1, MP, BV), padding_mode=ZERO).reshape((MP, BV))
    per = CKPT // T
    nch = ct.cdiv(Lw, T)
    for cc in range(nch):
        c = nch - 1 - cc
        cg = jw * per + c
        hc = ct.load(sc, (bn, c, 0, 0), (1, T, BK, BV)).reshape((T, BK, BV))
        kr = _rows(k, b, n // GK, cg, T, BK).reshape((T, BK, 1))
        vr = _rows(v, b, n, cg, T, BV).reshape((T, 1, BV))
        ff = _gates(f, b, n // GF, cg, T, S).reshape((T, 1, 1))
        if KV:
            kv = _outer_stack(k, v, b, n // GK, n, cg, T, BK, BV, KV)
        else:
            kv = kr * vr
        qdy = _outer_stack(q, dy, b, n // GQ, n, cg, T, BK, BV, KV)
        z = _tanh(_prod(hc, w, kv, DOT, True), FAST)
        dz = (1.0 - ff) * (1.0 - z * z)
        e = hc - z
        dxs = ct.zeros((T, BK, BV), dtype=F32)
        gs = ct.zeros((T, BK, BV), dtype=F32)
        for ii in ct.static_iter(range(T)):
            i = T - 1 - ii
            G = dH + ct.extract(qdy, (i, 0, 0), (1, BK, BV)).reshape((BK, BV))
            dX = ct.extract(dz, (i, 0, 0), (1, BK, BV)).reshape((BK, BV)) * G
            ft = ct.extract(ff, (i, 0, 0), (1, 1, 1)).reshape((1, 1))
            dH = _serial(dX, wt, ft * G, DOT, True, 8)
            dxs = ct.insert(dxs, (i, 0, 0), dX.reshape((1, BK, BV)))
            gs = ct.insert(gs, (i, 0, 0), G.reshape((1, BK, BV)))
        # Row / column sums only here, once per chunk: one per step crossed warps (block barriers).
        ct.store(dk, (b, n, cg, 0), ct.sum(dxs * vr, axis=2).reshape((1, 1, T, BK)), order=(0, 2, 1, 3))
        ct.store(dv, (b, n, cg, 0), ct.sum(dxs * kr, axis=1).reshape((1, 1, T, BV)), order=(0, 2, 1, 3))
        ct.store(df, (b, n, cg), ct.sum(ct.sum(gs * e, axis=2), axis=1).reshape((1, 1, T)), order=(0, 2, 1))
        hpt = ct.load(sc, (bn, 0, c, 0), (1, MP, T, BK), order=(0, 3, 1, 2), padding_mode=ZERO)
        dwp = _prod(hpt.reshape((MP, T * BK)), dxs.reshape((T * BK, BV)), dwp, DOT, False)
    ct.store(dh_out, (bn, 0, 0), dH.reshape((1, BK, BV)))
    ct.store(dw_out, (bn, 0, 0), ct.extract(dwp, (0, 0), (BV, BV)).reshape((1, BV, BV)))


def _seg(q, k, v, W, f, dy, ckpt, sc_in, sc_out, dh_in, dw_in, dh_out, dw_out, dk, dv, df,
         jw: int, Lw: int, jr: int, Lr: int,
         N: C, GQ: C, GK: C, GW: C, GF: C, BK: C, BV: C, CKPT: C, T: C, TR: C, DOT: C, FAST: CB, SPLIT: CB,
         CHUNKW: CB, KV: CB):
    """One segment launch for one (batch row, value head): recompute segment jr (Lr steps, none when
    Lr = 0) into sc_out, and walk segment jw (Lw steps, none when Lw = 0) from sc_in (``_walk_chunk``
    when CHUNKW, else ``_walk``); the recompute runs in chunks of TR steps, the walk of T.
    With SPLIT the grid is B*N x 2 and bid(1) picks the role. No array is both read and written here."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    if SPLIT:
        if ct.bid(1) == 0:
            _recompute(k, v, w, f, ckpt, sc_out, sc_out, b, n, bn, jr, Lr, S, GK, GF, BK, BV, CKPT, TR, DOT, FAST, KV,
                       False, False)
        else:
            _walk_any(q, k, v, w, f, dy, sc_in, dh_in, dw_in, dh_out, dw_out, dk, dv, df, b, n, bn, jw, Lw, S,
                      GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, CHUNKW, KV)
    else:
        _recompute(k, v, w, f, ckpt, sc_out, sc_out, b, n, bn, jr, Lr, S, GK, GF, BK, BV, CKPT, TR, DOT, FAST, KV,
                       False, False)
        _walk_any(q, k, v, w, f, dy, sc_in, dh_in, dw_in, dh_out, dw_out, dk, dv, df, b, n, bn, jw, Lw, S,
                  GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, CHUNKW, KV)


def _walk_any(q, k, v, w, f, dy, sc, dh_in, dw_in, dh_out, dw_out, dk, dv, df, b, n, bn, jw, Lw, S,
              GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, CHUNKW, KV):
    if CHUNKW:
        _walk_chunk(q, k, v, w, f, dy, sc, dh_in, dw_in, dh_out, dw_out, dk, dv, df, b, n, bn, jw, Lw, S,
                    GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, KV)
    else:
        _walk(q, k, v, w, f, dy, sc, dh_in, dw_in, dh_out, dw_out, dk, dv, df, b, n, bn, jw, Lw, S,
              GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST)


def _chain(q, k, v, w, f, dy, sc, dzi, dh_in, dh_out, go, dq, b, n, bn, jc, Lc, S,
           GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, KV, DZ, SCB, GL, ZS, DQ, ZSTEP):
    """WALK = "chain": only the serial chain of segment jc (Lc steps), per chunk of T from the last
    (GL: the scratch holds every step, indexed by the global chunk; else the segment's alone):
    G = dH + q dy^T, dX = dz G, dH = dX W^T + f G, with dz = (1 - f)(1 - Z^2) loaded from dzi (DZ) or
    recomputed per chunk from the states in sc (one batched product, off the chain), or with ZS from the
    forward's Z that sc then holds (rows past S read as zero: dz = 0 there, f being 1); the chunk's G
    stacked and stored to go. dk, dv, df and dW are left to ``_grads`` in the next launch. With DQ (Z
    recomputed only) also dq_t = H_t dy_t, H_t = f H_{t-1} + (1 - f) Z, one batched sum per chunk into dq.
    ZSTEP (Z recomputed, no DQ): each step's Z as its own 2-D product inside the step loop, off the chain,
    instead of one batched product per chunk. The batched one is a warp-level mma whose accumulator layout
    is not the serial wgmma's, so dz went through shared memory with block barriers (sm_90a AOT at
    b8_n84, T 2: 1048 against 1160 instructions, 4 against 7 block barriers, no spills)."""
    wt = ct.transpose(w)
    dH = ct.load(dh_in, (bn, 0, 0), (1, BK, BV)).reshape((BK, BV))
    per = CKPT // T
    nch = ct.cdiv(Lc, T)
    for cc in range(nch):
        c = nch - 1 - cc
        cg = jc * per + c
        cs = cg if GL else c
        ff = _gates(f, b, n // GF, cg, T, S).reshape((T, 1, 1))
        if DZ:
            dz = ct.load(dzi, (bn, cs, 0, 0), (1, T, BK, BV)).reshape((T, BK, BV)).astype(F32)
        elif ZS:
            z = ct.load(sc, (bn, cs, 0, 0), (1, T, BK, BV), padding_mode=ZERO).reshape((T, BK, BV)).astype(F32)
            dz = (1.0 - ff) * (1.0 - z * z)
        else:
            hraw = ct.load(sc, (bn, cs, 0, 0), (1, T, BK, BV)).reshape((T, BK, BV))
            if not ZSTEP:
                z = _recompute_z(hraw, w, _outer_stack(k, v, b, n // GK, n, cg, T, BK, BV, KV), DOT, FAST, SCB)
                dz = (1.0 - ff) * (1.0 - z * z)
            if DQ:
                hc = hraw.astype(F32)
                dyr = _rows(dy, b, n, cg, T, BV).reshape((T, 1, BV))
                dqc = ct.sum((ff * hc + (1.0 - ff) * z) * dyr, axis=2)
                ct.store(dq, (b, n, cg, 0), dqc.reshape((1, 1, T, BK)).astype(dq.dtype), order=(0, 2, 1, 3))
        qdy = _outer_stack(q, dy, b, n // GQ, n, cg, T, BK, BV, KV)
        gs = ct.zeros((T, BK, BV), dtype=F32)
        if ZSTEP:
            kvs = _outer_stack(k, v, b, n // GK, n, cg, T, BK, BV, KV)
        for ii in ct.static_iter(range(T)):
            i = T - 1 - ii
            ft = ct.extract(ff, (i, 0, 0), (1, 1, 1)).reshape((1, 1))
            G = dH + ct.extract(qdy, (i, 0, 0), (1, BK, BV)).reshape((BK, BV))
            if ZSTEP:
                zi = _recompute_z(ct.extract(hraw, (i, 0, 0), (1, BK, BV)).reshape((BK, BV)), w,
                                  ct.extract(kvs, (i, 0, 0), (1, BK, BV)).reshape((BK, BV)), DOT, FAST, SCB)
                dX = (1.0 - ft) * (1.0 - zi * zi) * G
            else:
                dX = ct.extract(dz, (i, 0, 0), (1, BK, BV)).reshape((BK, BV)) * G
            dH = _serial(dX, wt, ft * G, DOT, True, 8)
            gs = ct.insert(gs, (i, 0, 0), G.reshape((1, BK, BV)))
        ct.store(go, (bn, cs, 0, 0), _scr(gs, SCB).reshape((1, T, BK, BV)))
    ct.store(dh_out, (bn, 0, 0), dH.reshape((1, BK, BV)))


def _grads(k, v, w, f, dy, sc, gi, dq, dk, dv, df, dwo, b, n, bn, jg, Lg, part, S,
           GK, GF, GS, BK, BV, CKPT, TG, DOT, FAST, KV, DQ, SUB, RAG, GL, SCB):
    """WALK = "chain": the gradients of segment jg that are not on the chain, from its states (sc) and
    the chain's G (gi), in chunks of TG steps; program ``part`` of GS takes chunks part, part + GS, ...
    Per chunk Z is recomputed (one batched product), dX = (1 - f)(1 - Z^2) G, and dk = dX v, dv = k^T dX,
    df = sum G (H - Z) are batched reductions. dW += H^T dX: with SUB > 0 (``dw_sub``), per SUB steps one
    [SUB*BV, BK] x [BK, SUB*BV] product of the chunk's own states and dX (transposed in registers), whose
    diagonal [BV, BV] blocks t = t' are the steps' H_t^T dX_t; the off-diagonal ones are summed along and
    dropped once per program. Else one [MP, TG*BK] x [TG*BK, BV] product of the states loaded again
    transposed and zero-padded to 64 rows (as ``_walk_chunk``). The segment's dW part goes to
    dwo[bn, jg*GS + part]. With RAG (S not a multiple of the segment / chunk) rows past S are zeroed: a
    chunk longer than the chain's or the recompute's may read scratch rows no launch wrote. With DQ also
    dq_t = H_t dy_t, H_t = f H_{t-1} + (1 - f) Z (WALK = "store", whose forward writes no dq). GL as
    ``_chain``."""
    MP = max(64, BV)
    if SUB:
        dwp = ct.zeros((SUB * BV, SUB * BV), dtype=F32)
    else:
        dwp = ct.zeros((MP, BV), dtype=F32)
    per = CKPT // TG
    nch = ct.cdiv(Lg, TG)
    for cc in range(ct.cdiv(nch - part, GS)):
        c = part + cc * GS
        cg = jg * per + c
        cs = cg if GL else c
        hraw = ct.load(sc, (bn, cs, 0, 0), (1, TG, BK, BV)).reshape((TG, BK, BV))
        g = ct.load(gi, (bn, cs, 0, 0), (1, TG, BK, BV)).reshape((TG, BK, BV)).astype(F32)
        hc = hraw.astype(F32)
        if RAG:
            live = ct.arange(TG, dtype=ct.int32).reshape((TG, 1, 1)) + cg * TG < S
            hc = ct.where(live, hc, 0.0)
            g = ct.where(live, g, 0.0)
        kr = _rows(k, b, n // GK, cg, TG, BK).reshape((TG, BK, 1))
        vr = _rows(v, b, n, cg, TG, BV).reshape((TG, 1, BV))
        ff = _gates(f, b, n // GF, cg, TG, S).reshape((TG, 1, 1))
        if KV:
            kv = _outer_stack(k, v, b, n // GK, n, cg, TG, BK, BV, KV)
        else:
            kv = kr * vr
        # Rows past S were never written (any bits): with RAG their Z comes from the zeroed states.
        z = _recompute_z(hc if RAG else hraw, w, kv, DOT, FAST, SCB and not RAG)
        dxs = _grad_sums(hc, z, g, ff, kr, vr, dy, dq, dk, dv, df, b, n, cg, BK, BV, TG, DQ)
        if SUB:
            # bf16 operands straight from a bf16 scratch when no row needs zeroing (no round trip via fp32).
            dwp = _dw_diag(dwp, hraw if DOT % 4 == 0 and not RAG else hc, dxs, BK, BV, TG, DOT, SUB)
        else:
            hpt = ct.load(sc, (bn, 0, cs, 0), (1, MP, TG, BK), order=(0, 3, 1, 2), padding_mode=ZERO)
            hpt = hpt.reshape((MP, TG, BK)).astype(F32)
            if RAG:
                hpt = ct.where(live.reshape((1, TG, 1)), hpt, 0.0)
            dwp = _prod(hpt.reshape((MP, TG * BK)), dxs.reshape((TG * BK, BV)), dwp, DOT, False)
    if SUB:
        dw = _dw_fold(dwp, BV, SUB)
    else:
        dw = ct.extract(dwp, (0, 0), (BV, BV))
    ct.store(dwo, (bn, jg * GS + part, 0, 0), dw.reshape((1, 1, BV, BV)))


def _grad_sums(hc, z, g, ff, kr, vr, dy, dq, dk, dv, df, b, n, cg, BK, BV, TG, DQ):
    """Chunk cg's gradients off the chain from its states before each step hc, Z, G (each [TG, BK, BV]),
    f [TG, 1, 1], k [TG, BK, 1] and v [TG, 1, BV]: dk = dX v, dv = k^T dX, df = sum G (H - Z) and, with DQ,
    dq = H_t dy_t (H_t = f H_{t-1} + (1 - f) Z), each one batched reduction and one store. Returns dX
    [TG, BK, BV]."""
    dxs = (1.0 - ff) * (1.0 - z * z) * g
    ct.store(dk, (b, n, cg, 0), ct.sum(dxs * vr, axis=2).reshape((1, 1, TG, BK)).astype(dk.dtype), order=(0, 2, 1, 3))
    ct.store(dv, (b, n, cg, 0), ct.sum(dxs * kr, axis=1).reshape((1, 1, TG, BV)).astype(dv.dtype), order=(0, 2, 1, 3))
    ct.store(df, (b, n, cg),
             ct.sum(ct.sum(g * (hc - z), axis=2), axis=1).reshape((1, 1, TG)).astype(df.dtype), order=(0, 2, 1))
    if DQ:
        hn = ff * hc + (1.0 - ff) * z
        dyr = _rows(dy, b, n, cg, TG, BV).reshape((TG, 1, BV))
        ct.store(dq, (b, n, cg, 0),
                 ct.sum(hn * dyr, axis=2).reshape((1, 1, TG, BK)).astype(dq.dtype), order=(0, 2, 1, 3))
    return dxs


def _dw_diag(dwp, hs, dxs, BK, BV, TG, DOT, SUB):
    """dwp + per SUB steps of the chunk the [SUB*BV, SUB*BV] product of its states hs (transposed in
    registers) and dX; its diagonal [BV, BV] blocks are the steps' H_{t-1}^T dX_t (``_dw_fold``)."""
    for s in ct.static_iter(range(TG // SUB)):
        ha = ct.permute(ct.extract(hs, (s, 0, 0), (SUB, BK, BV)), (0, 2, 1)).reshape((SUB * BV, BK))
        xb = ct.permute(ct.extract(dxs, (s, 0, 0), (SUB, BK, BV)), (1, 0, 2)).reshape((BK, SUB * BV))
        dwp = _prod(ha, xb, dwp, DOT, False)
    return dwp


def _dw_fold(dwp, BV, SUB):
    """The sum of the diagonal [BV, BV] blocks of ``_dw_diag``'s accumulator."""
    step = ct.arange(SUB, dtype=ct.int32)
    eye = step.reshape((SUB, 1, 1, 1)) == step.reshape((1, 1, SUB, 1))
    return ct.sum(ct.sum(ct.where(eye, dwp.reshape((SUB, BV, SUB, BV)), 0.0), axis=2), axis=0)


def _seg3(q, k, v, W, f, dy, ckpt, h_re, h_ch, h_gr, dz_re, dz_ch, g_ch, g_gr, dh_in, dh_out, dk, dv, df, dwo,
          jc: int, Lc: int, jr: int, Lr: int, jg: int, Lg: int,
          N: C, GQ: C, GK: C, GW: C, GF: C, BK: C, BV: C, CKPT: C, T: C, TR: C, TG: C, GS: C, DOT: C, FAST: CB,
          KV: CB, DZ: CB, SCB: CB, SUB: C, RAG: CB):
    """One launch of WALK = "chain" (``schedule3``), grid B*N x (2 + GS): role 0 walks the chain of
    segment jc, role 1 recomputes segment jr, roles 2.. take the gradients of segment jg (jc's successor,
    whose chain ran in the previous launch). A role with no steps does nothing. No array is both read
    and written here."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    role = ct.bid(1)
    if role == 0:
        if Lc > 0:
            _chain(q, k, v, w, f, dy, h_ch, dz_ch, dh_in, dh_out, g_ch, dk, b, n, bn, jc, Lc, S,
                   GQ, GK, GF, BK, BV, CKPT, T, DOT, FAST, KV, DZ, SCB, False, False, False, False)
    elif role == 1:
        if Lr > 0:
            _recompute(k, v, w, f, ckpt, h_re, dz_re, b, n, bn, jr, Lr, S, GK, GF, BK, BV, CKPT, TR, DOT, FAST,
                       KV, DZ, SCB)
    else:
        if Lg > 0:
            _grads(k, v, w, f, dy, h_gr, g_gr, dk, dk, dv, df, dwo, b, n, bn, jg, Lg, role - 2, S,
                   GK, GF, GS, BK, BV, CKPT, TG, DOT, FAST, KV, False, SUB, RAG, False, SCB)


def schedule3(nseg: int, S: int, ckpt: int) -> list[tuple[int, int, int, int, int, int]]:
    """(jc, Lc, jr, Lr, jg, Lg) of the NSEG + 2 launches of WALK = "chain": launch m walks the chain of
    segment jc = NSEG - m, recomputes jr = jc - 1 and takes the gradients of jg = jc + 1 (L = 0 where
    the segment does not exist). The lane picks buffers by segment: states j % 3 (written at launch
    NSEG - j - 1, read at NSEG - j and NSEG - j + 1), dz and G j % 2, so within a launch the three
    segments' buffers are distinct."""
    def seg_len(j):
        return min(ckpt, S - j * ckpt) if 0 <= j < nseg else 0
    return [(nseg - m, seg_len(nseg - m), nseg - m - 1, seg_len(nseg - m - 1), nseg - m + 1, seg_len(nseg - m + 1))
            for m in range(nseg + 2)]


def _fwd_store(k, v, W, f, dy, h0, hs: ct.IndexedWithInt64, dzs: ct.IndexedWithInt64, dq,
               N: C, GK: C, GW: C, GF: C, BK: C, BV: C, T: C, HAS_H0: CB, DOT: C, FAST: CB, KV: CB, DZ: CB,
               SCB: CB, DQF: CB, FS: CB, RAGF: CB):
    """WALK = "store", grid B*N: the forward through all S steps, storing every state before its step to
    hs [B*N, S, BK, BV] and, with DZ, (1 - f)(1 - Z^2) to dzs (int64 indexing: 2.8e9 elements at b8_n84);
    with DQF (DQ = "fwd") dq_t = H_t dy_t to dq. Stacked per chunk (``_replay``) or with FS per step
    (``_fwd_steps``)."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    h = _initial_state(h0, b, n, BK, BV, HAS_H0)
    if FS:
        _fwd_steps(k, v, w, f, dy, h, hs, dzs, dq, b, n, bn, S, GK, GF, BK, BV, T, DOT, FAST, KV, DZ, SCB, DQF, RAGF)
    else:
        _replay(k, v, w, f, h, hs, dzs, dy, dq, b, n, bn, 0, ct.cdiv(S, T), S, GK, GF, BK, BV, T, DOT, FAST, KV, DZ,
                SCB, DQF)


def _fwd_steps(k, v, w, f, dy, h, hs, dzs, dq, b, n, bn, S, GK, GF, BK, BV, T, DOT, FAST, KV, DZ, SCB, DQF, RAGF):
    """FWD_STORE = "step": ``_replay``'s forward with one [BK, BV] store per step from the step's registers
    (no [T, BK, BV] stack: tileiras moves the step's tile to a store layout through shared memory, one block
    barrier, then one 16-byte global store per thread), and dq as a one-hot product per step into a [BK, T]
    accumulator: dq[:, i] += H_t (dy chunk [BV, T] with every column but i zeroed), exact products of the
    bf16-rounded state (K = BV), one store per chunk. The chunk's inputs are loaded one chunk ahead. With RAGF (S not a multiple of T) steps past S store
    nothing (a tile wholly outside an array is undefined)."""
    nch = ct.cdiv(S, T)
    kc, vc, off = _pair(k, v, b, n // GK, n, 0, T, BK, BV, KV)
    ff = _gates(f, b, n // GF, 0, T, S)
    dyc = _cols(dy, b, n, 0, T, BV)
    col = ct.arange(T, dtype=ct.int32).reshape((1, T))
    for c in range(nch):
        cn = min(c + 1, nch - 1)
        kn, vn, offn = _pair(k, v, b, n // GK, n, cn, T, BK, BV, KV)
        fn = _gates(f, b, n // GF, cn, T, S)
        dyn = _cols(dy, b, n, cn, T, BV)
        dqa = ct.zeros((BK, T), dtype=F32)
        for i in ct.static_iter(range(T)):
            t = c * T + i
            _store_step(hs, bn, t, h, S, BK, BV, SCB, RAGF)
            z, h = _step(h, w, kc, vc, off, ff, i, BK, BV, T, DOT, FAST, KV)
            if DZ:
                ft = ct.extract(ff, (0, i), (1, 1))
                _store_step(dzs, bn, t, (1.0 - ft) * (1.0 - z * z), S, BK, BV, SCB, RAGF)
            if DQF:
                # A batch of one: mma.sync with both operands in registers (a wgmma reads B from shared
                # memory, which the per-step mask would have to be written to, with a block barrier).
                dqa = _prod(h.reshape((1, BK, BV)), ct.where(col == i, dyc, 0.0).reshape((1, BV, T)),
                            dqa.reshape((1, BK, T)), DOT, True).reshape((BK, T))
        if DQF:
            ct.store(dq, (b, n, 0, c), dqa.reshape((1, 1, BK, T)).astype(dq.dtype), order=(0, 2, 3, 1))
        kc, vc, off, ff, dyc = kn, vn, offn, fn, dyn


def _store_step(x, bn, t, tile, S, BK, BV, SCB, RAGF):
    """tile [BK, BV] as row t of x [B*N, S, BK, BV]; with RAGF only when t < S."""
    if RAGF:
        if t < S:
            ct.store(x, (bn, t, 0, 0), _scr(tile, SCB).reshape((1, 1, BK, BV)))
    else:
        ct.store(x, (bn, t, 0, 0), _scr(tile, SCB).reshape((1, 1, BK, BV)))


def _chain_all(q, k, v, W, f, dy, hs: ct.IndexedWithInt64, dzs: ct.IndexedWithInt64, dh_in, dh_out,
               gs: ct.IndexedWithInt64, dq, jp: int, Lp: int,
               N: C, GQ: C, GK: C, GW: C, GF: C, BK: C, BV: C, T: C, DOT: C, FAST: CB, KV: CB, DZ: CB, SCB: CB,
               PL: C, ZS: CB, DQC: CB, ZSTEP: CB):
    """WALK = "store", grid B*N: ``_chain`` through piece jp (Lp steps from step jp*PL) in one program (dz
    loaded with DZ, from the stored Z in hs with ZS, else Z recomputed from the stored states), G to gs
    [B*N, S, BK, BV]; with DQC (DQ = "chain") dq too."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    _chain(q, k, v, w, f, dy, hs, dzs, dh_in, dh_out, gs, dq, b, n, bn, jp, Lp, S,
           GQ, GK, GF, BK, BV, PL, T, DOT, FAST, KV, DZ, SCB, True, ZS, DQC, ZSTEP)


def _chain_rows(q, W, f, dy, hs5: ct.IndexedWithInt64, dzs5: ct.IndexedWithInt64, dh_in4, dh_out4,
                gs5: ct.IndexedWithInt64, jp: int, Lp: int,
                N: C, GQ: C, GW: C, GF: C, BK: C, BV: C, T: C, DOT: C, SCB: CB, PL: C, ZS: CB, R: C):
    """WALK = "store" with C_ROWS = R > 1, grid (B/R)*N: the chain of ``_chain_all`` for R batch rows of one
    head in one program, their states stacked as [R*BK, BV] rows (the rows of a state never mix; the rows
    share W). dz from dzs5, or from the Z in hs5 with ZS; hs5 / dzs5 / gs5 are the [B, N, S, BK, BV] views
    of the scratch, dh_* the [B, N, BK, BV] views. Fewer, fuller programs: 672 chain CTAs of b8_n84 fill
    every SM's registers (256 threads x 40 each, sm_90a AOT) and leave no room for the gradients of the
    piece before, which is what PIPE overlaps."""
    bb = ct.bid(0) // N
    n = ct.bid(0) % N
    S = dy.shape[1]
    wt = ct.transpose(_load_w(W, n // GW, BV))
    dH = ct.load(dh_in4, (bb, n, 0, 0), (R, 1, BK, BV)).reshape((R * BK, BV))
    nch = ct.cdiv(Lp, T)
    for cc in range(nch):
        cg = jp * (PL // T) + nch - 1 - cc
        fr = ct.load(f, (bb, cg, n // GF), (R, T, 1), padding_mode=ZERO).reshape((R, T)).astype(F32)
        pos = ct.arange(T, dtype=ct.int32).reshape((1, T)) + cg * T
        fr = ct.where(pos < S, fr, 1.0).reshape((R, T, 1, 1))
        if ZS:
            z = ct.load(hs5, (bb, n, cg, 0, 0), (R, 1, T, BK, BV), padding_mode=ZERO).reshape((R, T, BK, BV))
            z = z.astype(F32)
            dz = (1.0 - fr) * (1.0 - z * z)
        else:
            dz = ct.load(dzs5, (bb, n, cg, 0, 0), (R, 1, T, BK, BV), padding_mode=ZERO).reshape((R, T, BK, BV))
            dz = dz.astype(F32)
        qr = ct.load(q, (bb, cg, n // GQ, 0), (R, T, 1, BK), padding_mode=ZERO).reshape((R, T, BK, 1)).astype(F32)
        dyr = ct.load(dy, (bb, cg, n, 0), (R, T, 1, BV), padding_mode=ZERO).reshape((R, T, 1, BV)).astype(F32)
        qdy = qr * dyr
        gs = ct.zeros((R, T, BK, BV), dtype=F32)
        for ii in ct.static_iter(range(T)):
            i = T - 1 - ii
            G = dH.reshape((R, 1, BK, BV)) + ct.extract(qdy, (0, i, 0, 0), (R, 1, BK, BV))
            dX = ct.extract(dz, (0, i, 0, 0), (R, 1, BK, BV)) * G
            fG = ct.extract(fr, (0, i, 0, 0), (R, 1, 1, 1)) * G
            dH = _serial(dX.reshape((R * BK, BV)), wt, fG.reshape((R * BK, BV)), DOT, True, 8)
            gs = ct.insert(gs, (0, i, 0, 0), G)
        ct.store(gs5, (bb, n, cg, 0, 0), _scr(gs, SCB).reshape((R, 1, T, BK, BV)))
    ct.store(dh_out4, (bb, n, 0, 0), dH.reshape((R, 1, BK, BV)))


def _grads_all(k, v, W, f, dy, hs: ct.IndexedWithInt64, gs: ct.IndexedWithInt64, dq, dk, dv, df, dwo,
               jp: int, Lp: int,
               N: C, GK: C, GW: C, GF: C, GS: C, BK: C, BV: C, TG: C, DOT: C, FAST: CB, KV: CB, SUB: C, RAG: CB,
               PL: C, DQG: CB, SCB: CB):
    """WALK = "store", grid B*N x GS: ``_grads`` (with dq when DQ = "grads", DQG) over piece jp (as
    ``_chain_all``), program bid(1) taking every GS-th chunk of TG steps; dW parts to dwo [B*N, PIPE*GS, BV,
    BV]."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    _grads(k, v, w, f, dy, hs, gs, dq, dk, dv, df, dwo, b, n, bn, jp, Lp, ct.bid(1), S,
           GK, GF, GS, BK, BV, PL, TG, DOT, FAST, KV, DQG, SUB, RAG, True, SCB)


def _fwd_zs(k, v, W, f, h0, zs: ct.IndexedWithInt64, ck,
            N: C, GK: C, GW: C, GF: C, BK: C, BV: C, T: C, HAS_H0: CB, DOT: C, FAST: CB, KV: CB, SCB: CB, CK: C):
    """WALK = "store", STORE = "z", grid B*N: the forward through all S steps, storing every step's
    Z = tanh(H_{t-1} W + k v^T) to zs [B*N, S, BK, BV] and the state before every CK-th step, fp32, to
    ck [B*N, ceil(S/CK), BK, BV] (one gradient program's range each)."""
    bn, b, n, S, w = _program(v, W, N, GW, BV)
    h = _initial_state(h0, b, n, BK, BV, HAS_H0)
    per = CK // T
    nch = ct.cdiv(S, T)
    for j in range(ct.cdiv(S, CK)):
        ct.store(ck, (bn, j, 0, 0), h.reshape((1, 1, BK, BV)))
        for cc in range(min(per, nch - j * per)):
            c = j * per + cc
            zc, h = _fwd_chunk(h, w, k, v, f, b, n, c, S, GK, GF, BK, BV, T, DOT, FAST, KV, True)
            ct.store(zs, (bn, c, 0, 0), _scr(zc, SCB).reshape((1, T, BK, BV)))


def _grads_zs_all(k, v, f, dy, zs: ct.IndexedWithInt64, gs: ct.IndexedWithInt64, ck, dq, dk, dv, df, dwo,
                  jp: int, Lp: int,
                  N: C, GK: C, GF: C, GS: C, BK: C, BV: C, TG: C, DOT: C, SUB: C, PL: C, CK: C):
    """WALK = "store", STORE = "z", grid B*N x GS: the gradients of piece jp (Lp steps from jp*PL) from the
    forward's Z and the chain's G. Program part = bid(1) takes the CK contiguous steps of range
    j = jp*GS + part and rebuilds their states from the range's checkpoint, H_t = f H_{t-1} + (1 - f) Z_t
    (no product, no tanh). A chunk's tiles are [BK, TG*BV], step t in columns [t*BV, t*BV + BV): tileiras
    keeps a thread's columns of every step in its registers, so the scan over steps moves no data between
    threads (with [TG, BK, BV] tiles the steps sat in different warps: 1907 against 1320 sm_90a
    instructions per chunk of 4 steps, 19 block barriers against 7). Then dk, dv, df, dq as batched
    reductions and dW as block-diagonal products (``_dw_diag`` on the same columns). Rows past S read as
    zero (Z = G = 0, f = 1 there: nothing changes, nothing adds)."""
    bn = ct.bid(0)
    part = ct.bid(1)
    n = bn % N
    b = bn // N
    S = v.shape[1]
    j = jp * GS + part
    h = ct.load(ck, (bn, min(j, ck.shape[1] - 1), 0, 0), (1, 1, BK, BV)).reshape((BK, BV))
    dwp = ct.zeros((SUB * BV, SUB * BV), dtype=F32)
    c0 = j * (CK // TG)
    for cc in range(ct.cdiv(max(min(CK, Lp - part * CK), 0), TG)):
        cg = c0 + cc
        z = _wide(zs, bn, cg, TG, BK, BV)
        g = _wide(gs, bn, cg, TG, BK, BV)
        fr = _gates(f, b, n // GF, cg, TG, S)
        hc = ct.zeros((BK, TG * BV), dtype=F32)
        for i in ct.static_iter(range(TG)):
            hc = ct.insert(hc, (0, i), h)
            ft = ct.extract(fr, (0, i), (1, 1))
            h = ft * h + (1.0 - ft) * ct.extract(z, (0, i), (BK, BV))
        ff = fr.reshape((1, TG, 1))
        z3, g3, h3 = z.reshape((BK, TG, BV)), g.reshape((BK, TG, BV)), hc.reshape((BK, TG, BV))
        dx3 = (1.0 - ff) * (1.0 - z3 * z3) * g3
        vr = _rows(v, b, n, cg, TG, BV).reshape((1, TG, BV))
        dyr = _rows(dy, b, n, cg, TG, BV).reshape((1, TG, BV))
        kc = _cols(k, b, n // GK, cg, TG, BK).reshape((BK, TG, 1))
        ct.store(dk, (b, n, 0, cg),
                 ct.sum(dx3 * vr, axis=2).reshape((1, 1, BK, TG)).astype(dk.dtype), order=(0, 2, 3, 1))
        ct.store(dv, (b, n, cg, 0),
                 ct.sum(dx3 * kc, axis=0).reshape((1, 1, TG, BV)).astype(dv.dtype), order=(0, 2, 1, 3))
        ct.store(df, (b, n, cg),
                 ct.sum(ct.sum(g3 * (h3 - z3), axis=2), axis=0).reshape((1, 1, TG)).astype(df.dtype), order=(0, 2, 1))
        hn = ff * h3 + (1.0 - ff) * z3
        ct.store(dq, (b, n, 0, cg),
                 ct.sum(hn * dyr, axis=2).reshape((1, 1, BK, TG)).astype(dq.dtype), order=(0, 2, 3, 1))
        dx = dx3.reshape((BK, TG * BV))
        for s in ct.static_iter(range(TG // SUB)):
            ha = ct.transpose(ct.extract(hc, (0, s), (BK, SUB * BV)))
            dwp = _prod(ha, ct.extract(dx, (0, s), (BK, SUB * BV)), dwp, DOT, False)
    ct.store(dwo, (bn, j, 0, 0), _dw_fold(dwp, BV, SUB).reshape((1, 1, BV, BV)))


def _wide(x, bn, cg, TG, BK, BV):
    """Chunk cg (TG steps) of x [B*N, S, BK, BV] as a [BK, TG*BV] fp32 tile, step t in columns
    [t*BV, t*BV + BV); rows past S zero."""
    t = ct.load(x, (bn, 0, cg, 0), (1, BK, TG, BV), order=(0, 2, 1, 3), padding_mode=ZERO)
    return t.reshape((BK, TG * BV)).astype(F32)


def schedule(nseg: int, S: int, ckpt: int) -> list[tuple[int, int, int, int]]:
    """(jw, Lw, jr, Lr) of the NSEG + 1 segment launches: launch m walks segment NSEG - m (none at
    m = 0) and recomputes segment NSEG - m - 1 (none at m = NSEG). Segment j's states live in scratch
    buffer j % 2, dH / dW move from buffer m % 2 to (m + 1) % 2: every read of a buffer is in a later
    launch than its write, so the kernel boundary orders them."""
    seg_len = lambda j: min(ckpt, S - j * ckpt)  # noqa: E731
    out = []
    for m in range(nseg + 1):
        jw, jr = nseg - m, nseg - m - 1
        out.append((jw if m else 0, seg_len(jw) if m else 0, max(jr, 0), seg_len(jr) if jr >= 0 else 0))
    return out


_KERNELS: dict = {}


def _kernels(config: dict) -> dict:
    """{"forward", "backward"[, "gradients"]}: the ``ct.kernel`` objects of the config's walk with its
    compiler hints (0 = compiler's choice); "backward" is the segment kernel, or with WALK = "store" the
    chain, and "gradients" that walk's gradient kernel."""
    nww = config["num_worker_warps"] or None
    fns = {"step": (_fwd_ckpt, _seg), "chunk": (_fwd_ckpt, _seg), "chain": (_fwd_ckpt, _seg3),
           "store": (_fwd_store, _chain_all, _grads_all)}[config["WALK"]]
    if config["STORE"] == "z":
        fns = (_fwd_zs, _chain_all, _grads_zs_all)
    if config["C_ROWS"] > 1:
        fns = (fns[0], _chain_rows, fns[2])
    hints = (config["fwd_occupancy"], config["occupancy"], config["g_occupancy"])
    key = (hints, nww, tuple(fn.__name__ for fn in fns))
    if key not in _KERNELS:
        _KERNELS[key] = {name: ct.kernel(fn, occupancy=occ or None, num_worker_warps=nww)
                         for name, fn, occ in zip(KERNEL_NAMES, fns, hints)}
    return _KERNELS[key]


# ---- lane interface -----------------------------------------------------------------------------

def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _t_re(config: dict) -> int:
    """The recompute's chunk (steps): T_RE, or T when T_RE = 0 (the lane before T_RE existed)."""
    return config["T_RE"] or config["T"]


def dot_mode(config: dict, shape: dict) -> int:
    """The kernels' DOT: the operand mode (DOTS index; fp32 inputs always multiply in fp32, as the
    problem's fp32 band assumes) plus STEP_MMA's bits (``_serial``)."""
    mode = 3 if shape["dtype"] == "float32" else DOTS.index(config["DOT"])
    return mode + STEP_MMAS[config["STEP_MMA"]]


def config_reason(config: dict, shape: dict) -> str | None:
    config = {**DEFAULTS, **config}
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)})"
    if _block(shape["K"]) > MAX_BK or _block(shape["V"]) > MAX_BV:
        return (f"K={shape['K']}, V={shape['V']}: the padded state tile [{_block(shape['K'])}, {_block(shape['V'])}] "
                f"exceeds [{MAX_BK}, {MAX_BV}]: the chunk stacks of T such tiles would spill")
    if config["CKPT"] not in CKPTS:
        return f"CKPT={config['CKPT']} must be one of {', '.join(map(str, CKPTS))}"
    for key in ("T", "T_FWD"):
        if config[key] not in CHUNKS or config[key] > config["CKPT"]:
            return f"{key}={config[key]} must be one of {', '.join(map(str, CHUNKS))} and at most CKPT={config['CKPT']}"
    if config["T_RE"] != 0 and (config["T_RE"] not in CHUNKS or not config["T"] <= config["T_RE"] <= config["CKPT"]):
        # A recompute chunk shorter than the walk's would have to load tiles wholly past a ragged S.
        return (f"T_RE={config['T_RE']} must be 0 (= T) or one of {', '.join(map(str, CHUNKS))}, at least "
                f"T={config['T']} and at most CKPT={config['CKPT']}")
    if config["KV"] not in KVS:
        return f"KV={config['KV']!r} must be one of {', '.join(KVS)}"
    if config["KV"] != "outer" and shape["dtype"] != "bfloat16":
        return f"KV={config['KV']}: the one-hot products need bf16 inputs (exact products)"
    if config["KV"] == "fwd" and config["WALK"] != "store":
        return "KV=fwd (one-hot products in the forward only) applies to WALK=store"
    if _block(shape["K"]) * _block(shape["V"]) * max(config["T"], _t_re(config)) > 16_384:
        return (f"T={config['T']} stacked states of [{_block(shape['K'])}, {_block(shape['V'])}] exceed 16K fp32 "
                f"(a CTA's registers)")
    if config["WALK"] not in WALKS:
        return f"WALK={config['WALK']!r} must be one of {', '.join(WALKS)}"
    if config["ROLES"] not in ROLES:
        return f"ROLES={config['ROLES']!r} must be one of {', '.join(ROLES)}"
    reason = _chain_reason(config, shape)
    if reason:
        return reason
    if config["DOT"] not in DOTS:
        return f"DOT={config['DOT']!r} must be one of {', '.join(DOTS)}"
    if not isinstance(config["STEP_MMA"], str) or config["STEP_MMA"] not in STEP_MMAS:
        return f"STEP_MMA={config['STEP_MMA']!r} must be one of {', '.join(STEP_MMAS)}"
    if not isinstance(config["FAST_TANH"], bool):
        return "FAST_TANH must be true or false"
    if config["num_worker_warps"] not in (0, 4, 8):
        # cuda-tile 1.7.0 emits bytecode 13.4, where tileiras takes only 4 or 8 (other values: 13.5+).
        return f"num_worker_warps={config['num_worker_warps']} must be 0 (auto), 4 or 8"
    for key in ("occupancy", "fwd_occupancy", "g_occupancy"):
        if config[key] not in range(0, 33):
            return f"{key}={config[key]} must be 0 (auto) or in [1, 32]"
    B, S, N = shape["B"], shape["S"], shape["N"]
    tile = _block(shape["K"]) * _block(shape["V"])
    # The scratch of WALK = "store" (every state) is indexed in int64; the others' arrays are not.
    rows = config["G_SPLIT"] if config["WALK"] == "store" else max(_nseg(config, shape) * config["G_SPLIT"],
                                                                   config["CKPT"])
    if max(B * S * N * _block(max(shape["K"], shape["V"])), B * N * rows * tile) >= 2**31:
        return "arrays with 2^31 or more elements need int64 indexing, which this lane does not specialize"
    return None


def _chain_reason(config: dict, shape: dict) -> str | None:
    """The rules of the knobs of WALK = "chain" / "store"; they must stay at their NEUTRAL values for the
    other walks, and the checkpoint knobs at STORE_CKPT / 0 for WALK = "store"."""
    walk = config["WALK"]
    if config["T_G"] not in CHUNKS or config["T_G"] > config["CKPT"] and walk != "store":
        return f"T_G={config['T_G']} must be one of {', '.join(map(str, CHUNKS))} and at most CKPT={config['CKPT']}"
    if _block(shape["K"]) * _block(shape["V"]) * config["T_G"] > 16_384:
        return (f"T_G={config['T_G']} stacked states of [{_block(shape['K'])}, {_block(shape['V'])}] exceed 16K "
                f"fp32 (a CTA's registers)")
    if config["G_SPLIT"] not in G_SPLITS:
        return f"G_SPLIT={config['G_SPLIT']} must be one of {', '.join(map(str, G_SPLITS))}"
    if config["SCRATCH"] not in SCRATCHES:
        return f"SCRATCH={config['SCRATCH']!r} must be one of {', '.join(SCRATCHES)}"
    if not isinstance(config["DZ_STORE"], bool):
        return "DZ_STORE must be true or false"
    if config["DW"] not in DWS:
        return f"DW={config['DW']!r} must be one of {', '.join(DWS)}"
    if config["PIPE"] not in PIPES or (walk != "store" and config["PIPE"] != 1):
        return f"PIPE={config['PIPE']} must be one of {', '.join(map(str, PIPES))}, and 1 unless WALK=store"
    if walk in ("chain", "store") and config["ROLES"] != "split":
        return f"WALK={walk} runs its chain and gradients as separate programs: ROLES must be split"
    if walk not in ("chain", "store") and any(config[k] != NEUTRAL[k] for k in NEUTRAL):
        return f"{', '.join(NEUTRAL)} apply to WALK=chain / store only (WALK={walk!r})"
    if config["STORE"] not in STORES or (walk != "store" and config["STORE"] != "h"):
        return f"STORE={config['STORE']!r} must be one of {', '.join(STORES)}, and h unless WALK=store"
    if config["STORE"] == "z":
        if config["DZ_STORE"] or config["DW"] != "diag":
            return "STORE=z: the chain takes dz from the stored Z and dW is block-diagonal: DZ_STORE=false, DW=diag"
        pl, per = piece_len(config, shape), config["G_SPLIT"] * max(config["T_G"], config["T_FWD"])
        if pl % per:
            # Each gradient program takes PL / G_SPLIT contiguous steps from a checkpoint the forward
            # stores at a chunk boundary.
            return (f"STORE=z: the piece of {pl} steps (S={shape['S']}, PIPE={config['PIPE']}) must split into "
                    f"G_SPLIT={config['G_SPLIT']} ranges of whole chunks of T_G={config['T_G']} and "
                    f"T_FWD={config['T_FWD']}")
    if config["C_ROWS"] not in C_ROWS or (walk != "store" and config["C_ROWS"] != 1):
        return f"C_ROWS={config['C_ROWS']} must be one of {', '.join(map(str, C_ROWS))}, and 1 unless WALK=store"
    if config["C_ROWS"] > 1:
        if shape["B"] % config["C_ROWS"]:
            return f"C_ROWS={config['C_ROWS']} batch rows per chain program must divide B={shape['B']}"
        if not (config["DZ_STORE"] or config["STORE"] == "z") or config["KV"] == "mma":
            return (f"C_ROWS={config['C_ROWS']}: the stacked chain loads dz (DZ_STORE or STORE=z) and takes "
                    f"KV=outer / fwd")
    if not isinstance(config["DQ"], str) or config["DQ"] not in DQS:
        return f"DQ={config['DQ']!r} must be one of {', '.join(DQS)}"
    if config["DQ"] != "grads" and (walk, config["STORE"]) != ("store", "h"):
        return f"DQ={config['DQ']} applies to WALK=store with STORE=h (elsewhere DQ=grads)"
    if config["DQ"] == "chain" and (config["DZ_STORE"] or config["C_ROWS"] > 1):
        return "DQ=chain: the chain takes dq from the states and Z it recomputes: DZ_STORE=false, C_ROWS=1"
    if not isinstance(config["FWD_STORE"], str) or config["FWD_STORE"] not in FWD_STORES:
        return f"FWD_STORE={config['FWD_STORE']!r} must be one of {', '.join(FWD_STORES)}"
    if config["FWD_STORE"] == "step":
        if (walk, config["STORE"]) != ("store", "h"):
            return "FWD_STORE=step applies to WALK=store with STORE=h"
        if config["DQ"] == "fwd" and config["T_FWD"] < 8:
            return f"FWD_STORE=step with DQ=fwd: dq's one-hot product has T_FWD={config['T_FWD']} columns, at least 8"
    if not isinstance(config["CHAIN_Z"], str) or config["CHAIN_Z"] not in CHAIN_ZS:
        return f"CHAIN_Z={config['CHAIN_Z']!r} must be one of {', '.join(CHAIN_ZS)}"
    if config["CHAIN_Z"] == "step" and ((walk, config["STORE"], config["C_ROWS"]) != ("store", "h", 1)
                                        or config["DZ_STORE"] or config["DQ"] == "chain"):
        return ("CHAIN_Z=step: the chain recomputes Z per step: WALK=store, STORE=h, C_ROWS=1, DZ_STORE=false, "
                "DQ grads or fwd")
    if config["PARTIALS"] not in PARTIALS:
        return f"PARTIALS={config['PARTIALS']!r} must be one of {', '.join(PARTIALS)}"
    if config["PARTIALS"] != "float32" and (walk != "store" or shape["dtype"] != "bfloat16"):
        return "PARTIALS=bfloat16 (per-value-head dq / dk / dv / df in bf16) applies to WALK=store with bf16 inputs"
    if walk == "store" and (config["CKPT"], config["T_RE"]) != (STORE_CKPT, 0):
        return f"WALK=store keeps every state (no checkpoints): CKPT must stay {STORE_CKPT} and T_RE 0"
    if config["SCRATCH"] == "bfloat16" and (shape["dtype"] != "bfloat16" or config["DOT"] != "input"):
        # With bf16 operands the recomputed Z from a bf16 state is the recompute's own Z.
        return "SCRATCH=bfloat16 needs bf16 inputs and DOT=input (the products already round the states to bf16)"
    return None


def eligibility(target: str) -> str | None:
    if _targets.cc(target) not in ARCHS:
        return f"cuTile (tileiras 13.5) has no code generation for {target} (has {', '.join(TARGETS)})"
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA, bytes: an upper bound, the target's opt-in per-block limit. tileiras alone
    decides what it stages (TMA landing buffers of the chunk tiles and the [T, BK, BV] scratch chunk,
    layout conversions for the per-step rows and the once-per-chunk reductions), sized to the target and
    the occupancy hint, so the analytic figure is only this bound; ``compile_for`` gives the exact one
    and the preflight uses it."""
    return _targets.smem_optin(target)


def _consts(config: dict, shape: dict) -> dict:
    N = shape["N"]
    return {"N": N, "GQ": N // shape["Nq"], "GK": N // shape["Nk"], "GW": N // shape["Nw"], "GF": N // shape["Nf"],
            "BK": _block(shape["K"]), "BV": _block(shape["V"]), "CKPT": config["CKPT"], "T": config["T"],
            "T_FWD": config["T_FWD"], "TR": _t_re(config), "KV": config["KV"] == "mma",
            "KVF": config["KV"] != "outer",
            "DOT": dot_mode(config, shape), "FAST": bool(config["FAST_TANH"]),
            "SPLIT": config["ROLES"] == "split", "CHUNKW": config["WALK"] == "chunk", "TG": config["T_G"],
            "GS": config["G_SPLIT"], "DZ": config["DZ_STORE"], "SCB": config["SCRATCH"] == "bfloat16",
            "SUB": dw_sub(config, shape), "RAG": _ragged(config, shape), "PL": piece_len(config, shape),
            "ZS": config["STORE"] == "z", "CK": range_len(config, shape), "R": config["C_ROWS"],
            "DQF": config["DQ"] == "fwd", "DQC": config["DQ"] == "chain", "DQG": config["DQ"] == "grads",
            "FS": config["FWD_STORE"] == "step", "RAGF": shape["S"] % config["T_FWD"] != 0,
            "ZSTEP": config["CHAIN_Z"] == "step"}


def piece_len(config: dict, shape: dict) -> int:
    """WALK = "store": steps per chain / gradient piece, S / PIPE rounded up to a multiple of 16 (of every
    chunk length), so that pieces start on chunk boundaries; the last piece may be shorter."""
    return -(-shape["S"] // (16 * config["PIPE"])) * 16


def pieces(config: dict, shape: dict) -> int:
    return -(-shape["S"] // piece_len(config, shape))


def dw_sub(config: dict, shape: dict) -> int:
    """DW = "diag": steps per dW product of the gradient programs, so that its [SUB*BV, SUB*BV] result has
    at most 64 rows (one wgmma M); 0 for DW = "pad"."""
    return max(1, min(config["T_G"], 64 // _block(shape["V"]))) if config["DW"] == "diag" else 0


def _ragged(config: dict, shape: dict) -> bool:
    """Whether a gradient chunk can reach past S: S not a multiple of the store walk's chunk or of the
    chain walk's segment (CKPT, a multiple of T_G); only then are its rows masked."""
    return shape["S"] % (config["T_G"] if config["WALK"] == "store" else config["CKPT"]) != 0


_FWD_CONSTS = ("N", "GK", "GW", "GF", "BK", "BV", "CKPT", "T_FWD", "HAS_H0", "DOT", "FAST", "KV")
_BWD_CONSTS = ("N", "GQ", "GK", "GW", "GF", "BK", "BV", "CKPT", "T", "TR", "DOT", "FAST", "SPLIT", "CHUNKW", "KV")
_CHAIN_CONSTS = ("N", "GQ", "GK", "GW", "GF", "BK", "BV", "CKPT", "T", "TR", "TG", "GS", "DOT", "FAST", "KV", "DZ",
                 "SCB", "SUB", "RAG")


# KVF: the forward's KV (KV = "fwd": one-hot products there, broadcast ones in the chain and the gradients).
_STORE_CONSTS = {"forward": ("N", "GK", "GW", "GF", "BK", "BV", "T_FWD", "HAS_H0", "DOT", "FAST", "KVF", "DZ", "SCB",
                             "DQF", "FS", "RAGF"),
                 "backward": ("N", "GQ", "GK", "GW", "GF", "BK", "BV", "T", "DOT", "FAST", "KV", "DZ", "SCB", "PL",
                              "ZS", "DQC", "ZSTEP"),
                 "gradients": ("N", "GK", "GW", "GF", "GS", "BK", "BV", "TG", "DOT", "FAST", "KV", "SUB", "RAG",
                               "PL", "DQG", "SCB")}
# STORE = "z": the forward stores Z and range checkpoints, the gradients rebuild the states (no W there).
_ZS_CONSTS = {"forward": ("N", "GK", "GW", "GF", "BK", "BV", "T_FWD", "HAS_H0", "DOT", "FAST", "KVF", "SCB", "CK"),
              "gradients": ("N", "GK", "GF", "GS", "BK", "BV", "TG", "DOT", "SUB", "PL", "CK")}


_ROWS_CONSTS = ("N", "GQ", "GW", "GF", "BK", "BV", "T", "DOT", "SCB", "PL", "ZS", "R")


def _store_consts(config: dict) -> dict:
    """The compile-time arguments of the WALK = "store" kernels, by kernel name."""
    out = {**_STORE_CONSTS, **_ZS_CONSTS} if config["STORE"] == "z" else dict(_STORE_CONSTS)
    if config["C_ROWS"] > 1:
        out["backward"] = _ROWS_CONSTS
    return out


def range_len(config: dict, shape: dict) -> int:
    """STORE = "z": steps per gradient program (CK), PL / G_SPLIT; the forward checkpoints every CK steps."""
    return piece_len(config, shape) // config["G_SPLIT"]


def _ck_dims(config: dict, shape: dict) -> tuple:
    """STORE = "z": the range checkpoints [B*N, ceil(S/CK), BK, BV] (fp32)."""
    return shape["B"] * shape["N"], -(-shape["S"] // range_len(config, shape)), _block(shape["K"]), _block(shape["V"])


def _bwd_consts(config: dict) -> tuple:
    return _CHAIN_CONSTS if config["WALK"] == "chain" else _BWD_CONSTS


def _nseg(config: dict, shape: dict) -> int:
    return -(-shape["S"] // config["CKPT"])


def _array(dtype: str, size: tuple, index64: bool = False):
    """The ArrayConstraint cuTile's JIT derives for a contiguous, 16-byte aligned torch tensor (the rules
    of kernels/cutile/gemm.py's _array_constraint, any rank); index64 for a parameter annotated
    ``ct.IndexedWithInt64``."""
    from cuda.tile.compilation import ArrayConstraint
    elem = _ELEM[dtype]
    strides = [1]
    for s in reversed(size[1:]):
        strides.insert(0, strides[0] * s)
    return ArrayConstraint(_CT[dtype], len(size), index_dtype=ct.int64 if index64 else ct.int32,
                           stride_lower_bound_incl=0, alias_groups=(),
                           may_alias_internally=False, stride_constant=tuple(1 if s == 1 else None for s in strides),
                           stride_divisible_by=tuple(16 // elem if s * elem % 16 == 0 else 1 for s in strides),
                           shape_divisible_by=tuple(16 if d % 16 == 0 else 1 for d in size),
                           base_addr_divisible_by=16)


def _scratch_dims(config: dict, shape: dict) -> tuple:
    """One scratch buffer of states (and of G with WALK = "chain"): [B*N, CKPT, BK, BV]; with
    WALK = "store" all S steps: [B*N, S, BK, BV]."""
    rows = shape["S"] if config["WALK"] == "store" else config["CKPT"]
    return shape["B"] * shape["N"], rows, _block(shape["K"]), _block(shape["V"])


def _dz_dims(config: dict, shape: dict) -> tuple:
    """One dz buffer of WALK = "chain": a scratch buffer with DZ_STORE, else a placeholder never read."""
    return _scratch_dims(config, shape) if config["DZ_STORE"] else (1, 1, _block(shape["K"]), _block(shape["V"]))


def _dw_dims(config: dict, shape: dict) -> tuple:
    """dW parts of WALK = "chain" / "store": one [BV, BV] per (batch row and head, segment (chain only),
    gradient program)."""
    bv = _block(shape["V"])
    segs = pieces(config, shape) if config["WALK"] == "store" else _nseg(config, shape)
    return shape["B"] * shape["N"], segs * config["G_SPLIT"], bv, bv


def _signatures(config: dict, shape: dict):
    from cuda.tile.compilation import CallingConvention, KernelSignature, ScalarConstraint
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    dt, bk, bv, nseg = shape["dtype"], _block(K), _block(V), _nseg(config, shape)
    c = {**_consts(config, shape), "HAS_H0": bool(shape["h0"])}
    i32 = ScalarConstraint(ct.int32)
    g = lambda *s: _array("float32", s)  # noqa: E731
    k, v, dy = _array(dt, (B, S, shape["Nk"], K)), _array(dt, (B, S, N, V)), _array(dt, (B, S, N, V))
    W, f = _array(dt, (shape["Nw"], V, V)), _array(dt, (B, S, shape["Nf"]))
    ck = g(B * N, nseg, bk, bv)
    fwd = [k, v, W, f, dy, _array(dt, (B, N, K, V)), ck, g(B, S, N, K)] + [c[n] for n in _FWD_CONSTS]
    sc, dh, dw = g(B * N, config["CKPT"], bk, bv), g(B * N, bk, bv), g(B * N, bv, bv)
    grads = [g(B, S, N, K), g(B, S, N, V), g(B, S, N)]
    if config["WALK"] == "chain":
        h = _array(config["SCRATCH"], _scratch_dims(config, shape))
        dz = _array(config["SCRATCH"], _dz_dims(config, shape))
        bwd = [_array(dt, (B, S, shape["Nq"], K)), k, v, W, f, dy, ck, h, h, h, dz, dz, h, h, dh, dh, *grads,
               g(*_dw_dims(config, shape)), *[i32] * 6] + [c[n] for n in _CHAIN_CONSTS]
    else:
        bwd = [_array(dt, (B, S, shape["Nq"], K)), k, v, W, f, dy, ck, sc, sc, dh, dw, dh, dw, *grads,
               *[i32] * 4] + [c[n] for n in _BWD_CONSTS]
    if config["WALK"] == "store":
        big = _array(config["SCRATCH"], _scratch_dims(config, shape), index64=True)
        dzb = _array(config["SCRATCH"], _dz_dims(config, shape), index64=True)
        con = {name: [c[n] for n in names] for name, names in _store_consts(config).items()}
        part = lambda *s: _array(config["PARTIALS"], s)  # noqa: E731
        grads = [part(B, S, N, K), part(B, S, N, V), part(B, S, N)]
        bwd = [_array(dt, (B, S, shape["Nq"], K)), k, v, W, f, dy, big, dzb, dh, dh, big, grads[0], i32, i32] + \
            con["backward"]
        if config["C_ROWS"] > 1:
            five = lambda d: _array(config["SCRATCH"], (B, N, *d[1:]) if d[0] == B * N else (1, *d), True)  # noqa: E731
            dh4 = g(B, N, bk, bv)
            bwd = [_array(dt, (B, S, shape["Nq"], K)), W, f, dy, five(_scratch_dims(config, shape)),
                   five(_dz_dims(config, shape)), dh4, dh4, five(_scratch_dims(config, shape)), i32, i32] + \
                con["backward"]
        if config["STORE"] == "z":
            ckz = g(*_ck_dims(config, shape))
            fwd = [k, v, W, f, _array(dt, (B, N, K, V)), big, ckz] + con["forward"]
            gr = [k, v, f, dy, big, big, ckz, *grads[:1], *grads, g(*_dw_dims(config, shape)), i32, i32] + \
                con["gradients"]
        else:
            fwd = [k, v, W, f, dy, _array(dt, (B, N, K, V)), big, dzb, grads[0]] + con["forward"]
            gr = [k, v, W, f, dy, big, big, *grads[:1], *grads, g(*_dw_dims(config, shape)), i32, i32] + \
                con["gradients"]
    cc = CallingConvention.cutile_python_v1()
    sigs = {"forward": KernelSignature(fwd, cc), "backward": KernelSignature(bwd, cc)}
    if config["WALK"] == "store":
        sigs["gradients"] = KernelSignature(gr, cc)
    return sigs


def compile_cubins(config: dict, shape: dict, target: str, which=("forward", "backward")) -> dict:
    """{"forward": cubin, "backward": cubin} (those in ``which``) for ``target`` (no GPU needed)."""
    config = {**DEFAULTS, **config}
    reason = eligibility(target) or config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    kernels = _kernels(config)
    sigs = _signatures(config, shape)
    which = [name for name in which if name in kernels] + (["gradients"] if "gradients" in kernels else [])
    return {name: export_cubin(kernels[name], sigs[name], _gpu_code(target)) for name in which}


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Every kernel of the config for ``target``; smem_bytes / registers / stack_bytes are the largest."""
    t0 = time.perf_counter()
    cubins = compile_cubins(config, shape, target)
    seconds = time.perf_counter() - t0
    res = {name: cubin_resources(c) for name, c in cubins.items()}
    top = {key: max(r[key] or 0 for r in res.values()) for key in ("smem_bytes", "registers", "stack_bytes")}
    return {**top, "compile_s": seconds, "binary": "cubin", "kernels": res}


def build(config: dict, shape: dict):
    config = {**DEFAULTS, **config}
    reason = config_reason(config, shape)
    if reason:
        raise ValueError(reason)
    kernels = _kernels(config)
    fwd, bwd = kernels["forward"], kernels["backward"]
    c = {**_consts(config, shape), "HAS_H0": bool(shape["h0"])}
    B, S, N, K, V = (shape[d] for d in ("B", "S", "N", "K", "V"))
    bk, bv, nseg = c["BK"], c["BV"], _nseg(config, shape)
    grid_fwd = (B * N, 1, 1)
    chain, store = config["WALK"] == "chain", config["WALK"] == "store"
    grid = (B * N, 2 + config["G_SPLIT"] if chain else 1 if store or not c["SPLIT"] else 2, 1)
    plan = [] if store else (schedule3 if chain else schedule)(nseg, S, config["CKPT"])
    work: dict = {}

    def alloc(dev):
        f32 = {"dtype": torch.float32, "device": dev}
        part = {"dtype": getattr(torch, config["PARTIALS"]), "device": dev}
        work.clear()
        work.update(dev=dev, ckpt=torch.empty(B * N, nseg, bk, bv, **f32),
                    dh=[torch.zeros(B * N, bk, bv, **f32) for _ in range(2)],
                    dq=torch.empty(B, S, N, K, **part), dk=torch.empty(B, S, N, K, **part),
                    dv=torch.empty(B, S, N, V, **part), df=torch.empty(B, S, N, **part))
        if store:
            scr = {"dtype": getattr(torch, config["SCRATCH"]), "device": dev}
            work.update(h=torch.empty(*_scratch_dims(config, shape), **scr),
                        dz=torch.empty(*_dz_dims(config, shape), **scr),
                        g=torch.empty(*_scratch_dims(config, shape), **scr),
                        dwp=torch.empty(*_dw_dims(config, shape), **f32))
            if config["STORE"] == "z":
                work.update(ckz=torch.empty(*_ck_dims(config, shape), **f32))
            if pieces(config, shape) > 1:
                # Highest priority: the chain is the critical path; its CTAs go before waiting gradient CTAs.
                work.update(chain_stream=torch.cuda.Stream(device=dev, priority=-5),
                            events=[torch.cuda.Event() for _ in range(pieces(config, shape))])
        elif chain:
            scr = {"dtype": getattr(torch, config["SCRATCH"]), "device": dev}
            work.update(h=[torch.empty(*_scratch_dims(config, shape), **scr) for _ in range(3)],
                        dz=[torch.empty(*_dz_dims(config, shape), **scr) for _ in range(2)],
                        g=[torch.empty(*_scratch_dims(config, shape), **scr) for _ in range(2)],
                        dwp=torch.empty(*_dw_dims(config, shape), **f32))
        else:
            work.update(sc=[torch.empty(*_scratch_dims(config, shape), **f32) for _ in range(2)],
                        dw=[torch.zeros(B * N, bv, bv, **f32) for _ in range(2)])

    def walk(i, stream, trace):
        """The segment launches; returns (dW [B*N, BV, BV], dh0 [B*N, BK, BV]) in the work buffers."""
        w = work
        args = (i["q"], i["k"], i["v"], i["W"], i["f"], i["dy"], w["ckpt"])
        consts = [c[n] for n in _bwd_consts(config)]
        for m, p in enumerate(plan):
            if chain:
                j = nseg - m            # the chain's segment; buffers by segment, also where a role is idle
                bufs = (w["h"][(j - 1) % 3], w["h"][j % 3], w["h"][(j + 1) % 3], w["dz"][(j - 1) % 2],
                        w["dz"][j % 2], w["g"][j % 2], w["g"][(j + 1) % 2], w["dh"][(m + 1) % 2], w["dh"][m % 2],
                        w["dk"], w["dv"], w["df"], w["dwp"])
            else:
                a, z = m % 2, (m + 1) % 2
                si, so = (nseg - m) % 2, (nseg - m + 1) % 2     # segment j's states: buffer j % 2
                bufs = (w["sc"][si], w["sc"][so], w["dh"][a], w["dw"][a], w["dh"][z], w["dw"][z],
                        w["dk"], w["dv"], w["df"])
            ct.launch(stream, grid, bwd, (*args, *bufs, *p, *consts))
            if trace is not None:
                trace(m, w)
        if chain:
            return w["dwp"].sum(1), w["dh"][nseg % 2]
        last = len(plan) % 2
        return w["dw"][last], w["dh"][last]

    def run(inputs, outputs, trace=None):
        """``trace(m, work)``, if given, is called after the forward (m = -1) and after segment launch m
        (scripts/debug_cutile_m2rnn_bwd.py's hook; it may overwrite ckpt / scratch)."""
        i, o = inputs, outputs
        if work.get("dev") != i["v"].device:
            alloc(i["v"].device)
        w = work
        stream = torch.cuda.current_stream()
        h0 = i.get("h0", i["dh_final"])        # not read when there is no h0
        # dH starts at dh_final (in dh[0] for every schedule), dW at zero; padded rows / columns stay zero.
        w["dh"][0].zero_()
        w["dh"][0][:, :K, :V].copy_(i["dh_final"].reshape(B * N, K, V))
        if store:
            return run_store(i, o, stream, h0)
        ct.launch(stream, grid_fwd, fwd, (i["k"], i["v"], i["W"], i["f"], i["dy"], h0, w["ckpt"], w["dq"],
                                          *(c[n] for n in _FWD_CONSTS)))
        if trace is not None:
            trace(-1, w)
        if not chain:
            w["dw"][0].zero_()
        dw, dh0 = walk(i, stream, trace)
        finish(o, dw, dh0)
        return {"grid": list(grid[:2]), "launches": 1 + len(plan)}

    def run_store(i, o, stream, h0):
        """WALK = "store": the storing forward, then per piece (last first) the chain on a high-priority
        stream and, once it is done, the piece's gradients on the caller's stream, so that the gradients of
        piece p run beside the chain of piece p - 1. 1 + 2 * PIPE launches."""
        w = work
        con = {name: [c[n] for n in names] for name, names in _store_consts(config).items()}
        zs = config["STORE"] == "z"
        if zs:
            ct.launch(stream, grid_fwd, fwd, (i["k"], i["v"], i["W"], i["f"], h0, w["h"], w["ckz"], *con["forward"]))
        else:
            ct.launch(stream, grid_fwd, fwd, (i["k"], i["v"], i["W"], i["f"], i["dy"], h0, w["h"], w["dz"], w["dq"],
                                              *con["forward"]))
        npc, pl = pieces(config, shape), c["PL"]
        side = w["chain_stream"] if npc > 1 else stream
        if side is not stream:
            side.wait_stream(stream)
        rows = config["C_ROWS"]

        def five(x):
            """The [B, N, ...] view of a [B*N, ...] buffer (C_ROWS > 1); a placeholder gets a leading 1."""
            return x.view(B, N, *x.shape[1:]) if x.shape[0] == B * N else x.view(1, *x.shape)
        for m in range(npc):
            p = npc - 1 - m
            lp = min(pl, S - p * pl)
            if rows > 1:
                ct.launch(side, (B // rows * N, 1, 1), bwd,
                          (i["q"], i["W"], i["f"], i["dy"], five(w["h"]), five(w["dz"]), five(w["dh"][m % 2]),
                           five(w["dh"][(m + 1) % 2]), five(w["g"]), p, lp, *con["backward"]))
            else:
                ct.launch(side, grid_fwd, bwd, (i["q"], i["k"], i["v"], i["W"], i["f"], i["dy"], w["h"], w["dz"],
                                                w["dh"][m % 2], w["dh"][(m + 1) % 2], w["g"], w["dq"], p, lp,
                                                *con["backward"]))
            if side is not stream:
                w["events"][m].record(side)
                stream.wait_event(w["events"][m])
            sums = (w["dq"], w["dk"], w["dv"], w["df"], w["dwp"], p, lp, *con["gradients"])
            if zs:
                gargs = (i["k"], i["v"], i["f"], i["dy"], w["h"], w["g"], w["ckz"], *sums)
            else:
                gargs = (i["k"], i["v"], i["W"], i["f"], i["dy"], w["h"], w["g"], *sums)
            ct.launch(stream, (B * N, config["G_SPLIT"], 1), kernels["gradients"], gargs)
        finish(o, w["dwp"].sum(1), w["dh"][npc % 2])
        return {"grid": [B * N, config["G_SPLIT"]], "launches": 1 + 2 * npc}

    def finish(o, dw, dh0):
        w = work
        parts = {n: w[n] for n in ("dq", "dk", "dv", "df")}
        parts["dW"] = dw[:, :V, :V].reshape(B, N, V, V)
        parts["dh0"] = dh0[:, :K, :V].reshape(B, N, K, V)
        grads = m2.reduce_heads(parts, shape)
        for name, value in grads.items():
            o[name].copy_(value)
    return run
