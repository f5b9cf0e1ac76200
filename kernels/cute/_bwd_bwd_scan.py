"""CuTe DSL dS scan of mamba_bwd_bwd, the first of the CuTe lane's four kernels (kernels/cute/mamba_bwd_bwd.py;
scripts/cute_bwd_check.py checks its dS on the GPU against lab.problems._mamba3.state_grads).

The only serial part of bwd_bwd: dS_c (N x P, the gradient of the state leaving chunk c; zero for the
last chunk) walks the chunks last to first in fp32,
    dS_{c-1} = exp(DA_CS[c*C + C - 1]) dS_c + q_hat_c^T (exp(DA_CS) * dy_c),
and is written in the input dtype to a workspace [B, H, nc, N, P] (the chunk kernels' GEMM operand).
The same recurrence as the Triton and TileLang lanes' scans (kernels/triton/mamba_bwd_bwd.py, _scan).

Grid (N/2/BJ * P/BP, H, B), 128 threads (4 warps). A CTA owns BJ rotary pairs (rows j0 + j and
N/2 + j0 + j of dS, stacked as the M = 2 BJ rows of one accumulator, so the rotation is elementwise
between the two halves) and BP columns. Per chunk, the threads build q_hat^T (M x F, F = C*R fused
rows t*R + r) and exp(DA_CS) dy (F x BP) in shared memory in the input dtype, and the 2 x 2 warps
multiply them (q_hat^T is stored M-major and dy N-major, the orders the threads build them in) through
the MMA helpers ``chunk.mma_module`` picks: warp-level mma.sync m16n8k16 (ldmatrix, transposed for both
operands), which compiles for sm_90a and sm_120a / sm_121a; or, with PATH="wgmma" and SCAN_BJ = 32 (M =
64 rows, wgmma's M), warpgroup MMA m64nNk16 with both operands MN-major from canonical swizzled buffers
(kernels/cute/_wgmma.py; sm_90a only). Under PATH="wgmma" with SCAN_BJ = 16 the scan stays on mma.sync.

With SCAN_PREP a kernel before it, ``Prep`` (grid (nc, H, B), 128 threads), builds those operands of
every chunk at once, off the serial chain: q_hat * exp(DA_CS) (QS [B, H, nc, F, N]) and dy (DY [B, H, nc,
F, P]), input dtype; the scan's loop then copies its tiles of them into shared memory instead of
computing cos / sin, the Z gate and exp per element on the chain (the cuTile lane's scan went from 8-10 to
under 1 us a step with the same split: kernels/cutile/mamba_bwd_bwd.py, SCAN_PREP).

API learned from this lab's kernels/cute/gemm.py (mma_sync path: TiledMma, LdMatrix partitions) and
m2rnn_fwd.py (tensor indexing, fragments); the model is lab/problems/_mamba3.py. Sizes in bytes.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from kernels.cute import _aot
from kernels.cute import _bwd_bwd_chunk as chunk
from kernels.cute._aot import static_smem
from lab.problems import _mamba3 as m3

THREADS = 128
F32 = cutlass.Float32
TARGETS = ("sm_90a", "sm_120a", "sm_121a")


def reason(config: dict, shape: dict) -> str | None:
    """Why the scan cannot take this shape / tile (None: it can)."""
    B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
    bj, bp, F = config["SCAN_BJ"], config["SCAN_BP"], C * R
    if S % C:
        return f"S={S} must be a multiple of C={C}"
    if F % 16:
        return f"C*R={F} must be a multiple of 16 (the MMA's K step)"
    if bj not in (16, 32) or (N // 2) % bj:
        return f"SCAN_BJ={bj} must be 16 or 32 and divide N/2={N // 2}"
    if bp not in (32, 64) or P % bp:
        return f"SCAN_BP={bp} must be 32 or 64 and divide P={P}"
    if B * H * nc * N * P >= 2 ** 31:
        return f"dS has {B * H * nc * N * P} elements: beyond the kernel's 32-bit offsets"
    return None


def layout(config: dict, shape: dict) -> chunk.Buffers:
    """The scan's shared buffers: q_hat^T stored M-major ([F, 2 BJ]) and dy stored N-major ([F, BP]),
    input dtype."""
    F, m = shape["C"] * shape["R"], 2 * config["SCAN_BJ"]
    return chunk.Buffers({"a": (F, m, 2), "b": (F, config["SCAN_BP"], 2)},
                         operand_align=chunk.operand_align(config, "scan", m))


def smem_bytes(config: dict, shape: dict, target: str) -> int:
    """Shared memory of one CTA as the launch counts it: its buffers (``layout``: 2 F (2 BJ + BP) bytes)
    plus the static part (kernels/cute/_aot.py static_smem)."""
    return layout(config, shape).nbytes() + static_smem(target)


class Prep(chunk.Views):
    """The scan's operands of every chunk (SCAN_PREP): QS = q_hat * exp(DA_CS) per fused row, DY = dy."""

    def __init__(self, config: dict, shape: dict):
        super().__init__(shape)
        self.unroll = config["UNROLL"]

    @cute.jit
    def __call__(self, q: cute.Pointer, qb: cute.Pointer, ang: cute.Pointer, da: cute.Pointer,
                 dout: cute.Pointer, phi: cute.Pointer, z: cute.Pointer, zeta: cute.Pointer,
                 qs: cute.Pointer, dy: cute.Pointer, stream: cuda.CUstream):
        P = self.P
        t = (self.qk(q), self.per_rank(qb, self.N), self.step_head(ang, self.nr), self.per_step(da), self.dout(dout),
             self.per_rank(phi, P), self.step_head(z, P), self.per_rank(zeta, P), self.ops(qs, self.N),
             self.ops(dy, P))
        self.kernel(*t).launch(grid=(self.nc, self.H, self.B), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mq: cute.Tensor, mqb: cute.Tensor, mang: cute.Tensor, mda: cute.Tensor, mdo: cute.Tensor,
               mphi: cute.Tensor, mz: cute.Tensor, mzeta: cute.Tensor, mqs: cute.Tensor, mdy: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        c, h, b = cute.arch.block_idx()
        F, NH = self.F, self.NH
        g = h // (self.H // self.G)
        for it in cutlass.range(F * NH // THREADS, unroll=self.unroll):
            f, n, r, s = self.element(it, tid, NH, c)
            q_lo = mq[n, g, r, s, b].to(F32) + mqb[n, r, h]
            q_hi = mq[NH + n, g, r, s, b].to(F32) + mqb[NH + n, r, h]
            theta = F32(0.0)
            if n < self.nr:
                theta = mang[n, h, s, b]
            cos = cute.math.cos(theta)
            sin = cute.math.sin(theta)
            e = cute.math.exp(mda[s, h, b])
            mqs[n, f, c, h, b] = ((q_lo * cos - q_hi * sin) * e).to(self.dt)
            mqs[NH + n, f, c, h, b] = ((q_lo * sin + q_hi * cos) * e).to(self.dt)
        for it in cutlass.range(F * self.P // THREADS, unroll=self.unroll):
            f, p, r, s = self.element(it, tid, self.P, c)
            mdy[p, f, c, h, b] = self.dy(mdo, mphi, mz, mzeta, p, h, r, s, b).to(self.dt)


class Scan(chunk.Views):
    def __init__(self, config: dict, shape: dict):
        super().__init__(shape)
        self.BJ, self.BP = config["SCAN_BJ"], config["SCAN_BP"]
        self.unroll = config["UNROLL"]
        self.prep = bool(config.get("SCAN_PREP", False))
        self.M = 2 * self.BJ
        self.mm = chunk.mma_module(config, "scan", self.M)
        self.buffers = layout(config, shape)

    @cute.jit
    def __call__(self, q: cute.Pointer, qb: cute.Pointer, ang: cute.Pointer, da: cute.Pointer,
                 dout: cute.Pointer, phi: cute.Pointer, z: cute.Pointer, zeta: cute.Pointer,
                 qs: cute.Pointer, dy: cute.Pointer, ds: cute.Pointer, stream: cuda.CUstream):
        P = self.P
        t = (self.qk(q), self.per_rank(qb, self.N), self.step_head(ang, self.nr), self.per_step(da), self.dout(dout),
             self.per_rank(phi, P), self.step_head(z, P), self.per_rank(zeta, P), self.ops(qs, self.N),
             self.ops(dy, P), self.state(ds))
        self.storage = self.buffers.storage(self.dt)
        grid = ((self.NH // self.BJ) * (P // self.BP), self.H, self.B)
        self.kernel(*t, self.mm.tiled(self.dt)).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mq: cute.Tensor, mqb: cute.Tensor, mang: cute.Tensor, mda: cute.Tensor, mdo: cute.Tensor,
               mphi: cute.Tensor, mz: cute.Tensor, mzeta: cute.Tensor, mqs: cute.Tensor, mdy: cute.Tensor,
               mds: cute.Tensor, tiled_mma: cute.TiledMma):
        tid, _, _ = cute.arch.thread_idx()
        tile, h, b = cute.arch.block_idx()
        BJ, BP, F, C, NH, nr = self.BJ, self.BP, self.F, self.C, self.NH, self.nr
        npb = self.P // BP
        j0 = (tile // npb) * BJ
        p0 = (tile % npb) * BP
        g = h // (self.H // self.G)

        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        # q_hat^T as (M, F), M-major, and dy as (BP, F), N-major: transposed views of [F, M], [F, BP].
        sA = self.mm.operand(self.buffers, storage, "a", F, self.M, self.dt, True)
        sB = self.mm.operand(self.buffers, storage, "b", F, BP, self.dt, True)

        # This CTA's dS tile of one chunk as (M, BP): row m < BJ is pair row j0 + m, row BJ + m is N/2 + j0 + m.
        ds_layout = cute.make_layout(((BJ, 2), BP), stride=((self.P, NH * self.P), 1))
        acc = self.mm.accumulator(tiled_mma, tid, self.M, BP)

        for i in cutlass.range(self.nc, unroll=1):
            c = self.nc - 1 - i
            # dS_c: what the later chunks sent back (zero for the last chunk), in the input dtype.
            gds = cute.make_tensor(mds.iterator + (((b * self.H + h) * self.nc + c) * self.N + j0) * self.P + p0,
                                   ds_layout)
            tCgds = self.mm.partition(tiled_mma, tid, gds)
            for e in cutlass.range_constexpr(cute.size(acc)):
                tCgds[e] = acc[e].to(self.dt)
            a_last = cute.math.exp(mda[c * C + C - 1, h, b])
            cute.arch.sync_threads()      # the previous chunk's operand reads are done
            if cutlass.const_expr(self.prep):
                for it in cutlass.range(F * BJ // THREADS, unroll=self.unroll):
                    f, j, r, s = self.element(it, tid, BJ, c)
                    sA[j, f] = mqs[j0 + j, f, c, h, b]
                    sA[BJ + j, f] = mqs[NH + j0 + j, f, c, h, b]
                for it in cutlass.range(F * BP // THREADS, unroll=self.unroll):
                    f, p, r, s = self.element(it, tid, BP, c)
                    sB[p, f] = mdy[p0 + p, f, c, h, b]
            else:
                for it in cutlass.range(F * BJ // THREADS, unroll=self.unroll):
                    f, j, r, s = self.element(it, tid, BJ, c)
                    n = j0 + j
                    q_lo = mq[n, g, r, s, b].to(F32) + mqb[n, r, h]
                    q_hi = mq[NH + n, g, r, s, b].to(F32) + mqb[NH + n, r, h]
                    theta = F32(0.0)
                    if n < nr:
                        theta = mang[n, h, s, b]
                    cos = cute.math.cos(theta)
                    sin = cute.math.sin(theta)
                    sA[j, f] = (q_lo * cos - q_hi * sin).to(self.dt)
                    sA[BJ + j, f] = (q_lo * sin + q_hi * cos).to(self.dt)
                for it in cutlass.range(F * BP // THREADS, unroll=self.unroll):
                    f, p, r, s = self.element(it, tid, BP, c)
                    pp = p0 + p
                    d = self.dy(mdo, mphi, mz, mzeta, pp, h, r, s, b)
                    sB[p, f] = (d * cute.math.exp(mda[s, h, b])).to(self.dt)
            self.mm.publish()
            cute.arch.sync_threads()
            acc.store(acc.load() * a_last)
            self.mm.mma_ss(tiled_mma, tid, acc, sA, sB, True, True, self.dt)   # q_hat^T M-major, dy N-major


def arg_kinds(shape: dict, kernel: str = "scan") -> tuple:
    """Element types of the pointer arguments: q, qb, ang, da, dout, phi, z, zeta, qs, dy (and ds: the scan)."""
    dt = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[shape["dtype"]]
    return (dt, F32, F32, F32, dt, F32, dt, F32, dt, dt) + ((dt,) if kernel == "scan" else ())


def _compile(config: dict, shape: dict, target: str, options: str, kernel: str = "scan"):
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    from cutlass.runtime import make_fake_stream
    ptrs = [make_ptr(k, 0, AddressSpace.gmem, assumed_align=16) for k in arg_kinds(shape, kernel)]
    program = Scan(config, shape) if kernel == "scan" else Prep(config, shape)
    return cute.compile(program, *ptrs, make_fake_stream(), options=f"--gpu-arch {target} {options}".strip())


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """The scan kernel for ``target`` (no GPU): {"smem_bytes", "registers", "stack", ...} (kernels/cute/_aot.py)."""
    why = reason(config, shape) or (None if target in TARGETS else f"no path for {target}")
    if why:
        raise ValueError(f"cannot compile for {target}: {why}")
    _, res = _aot.compile_with_resources(lambda opts: _compile(config, shape, target, opts),
                                         f"cute_bwd_scan_{target}_", target)
    return res
