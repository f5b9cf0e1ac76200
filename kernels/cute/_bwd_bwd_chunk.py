"""CuTe DSL chunk kernels of mamba_bwd_bwd (the lane: kernels/cute/mamba_bwd_bwd.py), after the dS scan
(kernels/cute/_bwd_bwd_scan.py). The decomposition and every formula are the Triton lane's
(kernels/triton/mamba_bwd_bwd.py, _chunk_k / _chunk_v / _reduce), whose outputs are parity-checked; the
model is lab/problems/_mamba3.py. F = C*R fused rows f = t*R + r of a chunk (step t, rank r).

Key: grid (nc * N/2/KEY_BJ, H, B), one chunk on KEY_BJ rotary pairs. Its M2 = 2 KEY_BJ columns are the
pairs' two rotary halves (column m < KEY_BJ: coordinate j0 + m; else N/2 + j0 + m - KEY_BJ), so rotary,
its transpose and the angle gradient are elementwise between columns m and KEY_BJ + m.
  P loop (KEY_BP columns a step): dkq = PsiV dy^T (F x F), dks = PsiV dS^T, dqs = dy STATES^T (F x M2),
  and the pair block's sum(STATES * dS) (DDA's part).
  Then: q_hat, k_hat (= rot(k) factor), q, k of the pairs and dkq_m = dkq * decay (s < t), dqk (the
  same-step block of dkq^T, times gamma) in shared memory; dk_hat = er dks + dkq_m q_hat and
  dq_hat = ea dqs + dkq_m^T k_hat; the angle gradient and DK / DQ's rotary transposes; then
  DK = that + dqk^T q and DQ = that + dqk k, written from the accumulators. Row sums over the pairs
  (DDA_CS_REV, DFACTOR, DDA_CS) go per fused row to a workspace, DDA's part per pair block to another.
Value: grid (nc, H, B), one chunk. lkq = k_hat q_hat^T over all of N (F x F, kept in fp32 for DSSDA);
  A = lkq * decay + the same-step block gamma QK_DOT (they do not overlap, so one bf16 operand holds
  both); then P in BLOCK_P columns: dPsiV = er (k_hat dS) + D dy + A dy, from which DV and DMIMO_V's
  per-chunk part; dkq = PsiV dy^T accumulates. Then DSSDA, DGAMMA_DIAG, and DDA, DDA_CS, DDA_CS_REV,
  DFACTOR from the key side's workspaces.
Reduce: grid (H, B): DMIMO_V and DD summed over chunks (deterministic, no atomics).

Every product runs through the MMA helpers of the config's PATH (``mma_module``): warp-level mma.sync
m16n8k16 (kernels/cute/_warp_mma.py: 2 x 2 warps, operands by ldmatrix), which serves sm_90a and
sm_120a / sm_121a, or, with PATH="wgmma" (sm_90a, F = 64), warpgroup MMA (kernels/cute/_wgmma.py:
operand buffers in canonical swizzled layouts, written through those views, fenced for the async proxy
before the barrier that precedes a product). bf16 / fp16 operands from shared memory, fp32 accumulation.
Accumulators pass through shared memory (fp32) for the elementwise work, which threads do 128 at a time.

API learned from this lab's kernels/cute/gemm.py (mma_sync path) and _bwd_bwd_scan.py. Sizes in bytes.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from kernels.cute import _warp_mma as wm
from kernels.cute import _wgmma as wg
from lab.problems import _mamba3 as m3

THREADS = 128
WGMMA_KERNELS = ("key", "value", "scan")   # the kernels whose products run on wgmma under PATH="wgmma"
F32 = cutlass.Float32
ALIGN = 128  # bytes: each shared buffer's alignment


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def sigmoid(x):
    return F32(1.0) / (F32(1.0) + cute.math.exp(-x))


class Views:
    """Global tensors of the boundary and the workspaces, coordinates innermost first (row-major
    strides), and the per-element reads the kernels share (the scan's too)."""

    def __init__(self, shape: dict, nbj: int = 1):
        B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
        self.B, self.S, self.H, self.G, self.N, self.P, self.R, self.C, self.nc, self.nr = B, S, H, G, N, P, R, C, nc, nr
        self.F, self.NH, self.NBJ = C * R, N // 2, nbj
        self.dt = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[shape["dtype"]]
        self.has_z, self.has_d, self.reduce_o = bool(shape["hasZ"]), bool(shape["hasD"]), bool(shape["reduceO"])

    def qk(self, p):          # Q, K [B, S, R, G, N]
        N, G, R, S = self.N, self.G, self.R, self.S
        return cute.make_tensor(p, cute.make_layout((N, G, R, S, self.B),
                                                    stride=(1, N, G * N, R * G * N, S * R * G * N)))

    def per_rank(self, p, width):   # [H, R, width]: Q_BIAS, K_BIAS, MIMO_V, MIMO_O, MIMO_Z
        return cute.make_tensor(p, cute.make_layout((width, self.R, self.H), stride=(1, width, self.R * width)))

    def per_step(self, p):    # [B, H, S]
        return cute.make_tensor(p, cute.make_layout((self.S, self.H, self.B), stride=(1, self.S, self.H * self.S)))

    def step_head(self, p, width):  # [B, S, H, width]: V, Z, DOUT (reduceO), DV, ANGLES, DANGLES
        H, S = self.H, self.S
        return cute.make_tensor(p, cute.make_layout((width, H, S, self.B), stride=(1, width, H * width, S * H * width)))

    def dout(self, p):
        if cutlass.const_expr(self.reduce_o):
            return self.step_head(p, self.P)
        P, H, R, S = self.P, self.H, self.R, self.S
        return cute.make_tensor(p, cute.make_layout((P, H, R, S, self.B),
                                                    stride=(1, P, H * P, R * H * P, S * R * H * P)))

    def state(self, p):       # [B, H, nc, N, P]: STATES, dS
        N, P, nc, H = self.N, self.P, self.nc, self.H
        return cute.make_tensor(p, cute.make_layout((P, N, nc, H, self.B),
                                                    stride=(1, P, N * P, nc * N * P, H * nc * N * P)))

    def ops(self, p, width):  # [B, H, nc, F, width] -> indexed [w, f, c, h, b]: the scan's operands QS, DY
        F, nc, H = self.F, self.nc, self.H
        return cute.make_tensor(p, cute.make_layout((width, F, nc, H, self.B),
                                                    stride=(1, width, F * width, nc * F * width, H * nc * F * width)))

    def seg(self, p):         # [B, H, nc, C(t), C(s)] -> indexed [s, t, c, h, b]
        C, nc, H = self.C, self.nc, self.H
        return cute.make_tensor(p, cute.make_layout((C, C, nc, H, self.B),
                                                    stride=(1, C, C * C, nc * C * C, H * nc * C * C)))

    def row_ws(self, p):      # [B, H, nc, NBJ, 3, F] -> indexed [f, k, jb, c, h, b]
        F, nbj, nc, H = self.F, self.NBJ, self.nc, self.H
        return cute.make_tensor(p, cute.make_layout((F, 3, nbj, nc, H, self.B),
                                                    stride=(1, F, 3 * F, 3 * F * nbj, 3 * F * nbj * nc,
                                                            3 * F * nbj * nc * H)))

    def chunk_ws(self, p, inner: int):  # [B, H, nc, inner]: DDA_WS (inner = NBJ), DD_WS (1)
        nc, H = self.nc, self.H
        return cute.make_tensor(p, cute.make_layout((inner, nc, H, self.B),
                                                    stride=(1, inner, inner * nc, inner * nc * H)))

    def element(self, it, tid, width: int, c):
        """Element ``it * THREADS + tid`` of an F x ``width`` tile that the threads build or read together:
        its fused row f = t*R + r, its column, the rank r and the step s of chunk c (threads run along
        the columns)."""
        idx = it * THREADS + tid
        f = idx // width
        return f, idx % width, f % self.R, c * self.C + f // self.R

    @cute.jit
    def dy(self, mdo, mphi, mz, mzeta, p, h, r, s, b):
        """dL/dy (fp32) of fused row (step s, rank r), column p."""
        d = F32(0.0)
        if cutlass.const_expr(self.reduce_o):
            d = mdo[p, h, s, b].to(F32) * mphi[p, r, h]
        else:
            d = mdo[p, h, r, s, b].to(F32)
        if cutlass.const_expr(self.has_z):
            zz = mz[p, h, s, b].to(F32) * mzeta[p, r, h]
            d = d * zz * sigmoid(zz)
        return d

    @cute.jit
    def qk_rot(self, mq, mk, mqb, mkb, mang, g, h, b, r, s, n):
        """Biased q, k (fp32) at coordinates n (lo) and N/2 + n (hi), and cos, sin of the pair's angle."""
        NH = self.NH
        q_lo = mq[n, g, r, s, b].to(F32) + mqb[n, r, h]
        q_hi = mq[NH + n, g, r, s, b].to(F32) + mqb[NH + n, r, h]
        k_lo = mk[n, g, r, s, b].to(F32) + mkb[n, r, h]
        k_hi = mk[NH + n, g, r, s, b].to(F32) + mkb[NH + n, r, h]
        theta = F32(0.0)
        if n < self.nr:
            theta = mang[n, h, s, b]
        return q_lo, q_hi, k_lo, k_hi, cute.math.cos(theta), cute.math.sin(theta)

    @cute.jit
    def gates(self, s_gate, mdt, mtrap, mdar, mda, c, h, b, tid):
        """Per fused row f of chunk c (step c*C + f/R), into the fp32 table s_gate: gamma, factor,
        exp(DA_CS_REV) and, when ``mda`` is given, exp(DA_CS) (rows 0-3), so the elementwise passes read
        one value per row instead of recomputing them per element. Threads f < F (F <= 64 < THREADS)."""
        if tid < self.F:
            s = c * self.C + tid // self.R
            gamma = mdt[s, h, b] * sigmoid(mtrap[s, h, b].to(F32))
            shifted = F32(0.0)
            if s + 1 < self.S:
                shifted = mdt[s + 1, h, b] * sigmoid(-mtrap[s + 1, h, b].to(F32))
            s_gate[0, tid] = gamma
            s_gate[1, tid] = gamma + shifted
            s_gate[2, tid] = cute.math.exp(mdar[s, h, b])
            if cutlass.const_expr(mda is not None):
                s_gate[3, tid] = cute.math.exp(mda[s, h, b])

    @cute.jit
    def decay(self, mseg, c, h, b, x, y):
        """exp(SEGSUM[t, s]) for key row x (step s) and query column y (step t), s < t; else 0."""
        ts, tt = x // self.R, y // self.R
        d = F32(0.0)
        if ts < tt:
            d = cute.math.exp(mseg[ts, tt, c, h, b])
        return d


# --------------------------------------------------------------------------------------------
# key side


class Buffers:
    """A kernel's shared buffers, name -> (rows, cols, element bytes). The input-dtype buffers of each
    group in ``phases`` share one region ("ops"), laid out one group at a time: a group's buffers are dead
    (a barrier passed) before the next group's are written. Input-dtype buffers (the products' operands)
    are aligned to ``operand_align`` bytes (wgmma's canonical layouts: kernels/cute/_wgmma.py), come first
    and the region next; the fp32 buffers follow, each aligned to ALIGN bytes."""

    def __init__(self, buffers: dict, phases: tuple = (), operand_align: int = ALIGN):
        self.buffers, self.offsets, self.align, region = buffers, {}, operand_align, 0
        for group in phases:
            at = 0
            for name in group:
                r, c, b = buffers[name]
                assert b == 2, name
                self.offsets[name] = at // 2   # elements of the input dtype
                at += self._padded(r * c * b, b)
            region = max(region, at)
        self.region = region

    def _padded(self, nbytes: int, elem: int) -> int:
        align = self.align if elem == 2 else ALIGN
        return -(-nbytes // align) * align

    def _fields(self) -> list:
        """(name, (rows, cols, bytes)) of the buffers outside the region, operands first."""
        rest = [(n, v) for n, v in self.buffers.items() if n not in self.offsets]
        return sorted(rest, key=lambda item: item[1][2] != 2)

    def nbytes(self) -> int:
        """Dynamic shared memory of the kernel, bytes: the struct's, whose size is a multiple of its
        largest alignment."""
        total = self.region + sum(self._padded(r * c * b, b) for _, (r, c, b) in self._fields())
        return -(-total // max(self.align, ALIGN)) * max(self.align, ALIGN)

    def storage(self, dt):
        """A cute.struct with one aligned MemRange per buffer outside the shared region, and the region
        (after the operands, before the fp32 buffers)."""
        fields = {}
        for name, (r, c, b) in self._fields():
            if b != 2 and self.region and "ops" not in fields:
                fields["ops"] = cute.struct.Align[cute.struct.MemRange[dt, self.region // 2], self.align]
            fields[name] = cute.struct.Align[cute.struct.MemRange[dt if b == 2 else F32, r * c],
                                             self.align if b == 2 else ALIGN]
        if self.region and "ops" not in fields:
            fields["ops"] = cute.struct.Align[cute.struct.MemRange[dt, self.region // 2], self.align]
        return cute.struct(type("Buffers", (), {"__annotations__": fields}))

    def pointer(self, st, name: str):
        """The first element of buffer ``name`` of the allocated storage ``st``."""
        if name in self.offsets:
            return st.ops.data_ptr() + self.offsets[name]
        return getattr(st, name).data_ptr()

    def tensor(self, st, name: str, layout):
        """Buffer ``name`` of the allocated storage ``st`` seen through ``layout`` (at trace time)."""
        if name in self.offsets:
            return cute.make_tensor(self.pointer(st, name), layout)
        return getattr(st, name).get_tensor(layout)


def mma_module(config: dict, kernel: str, rows: int = wg.M):
    """The MMA helpers of ``kernel`` ("key", "value", "scan"), whose products have ``rows`` rows, under
    the config's PATH: _wgmma for the kernels WGMMA_KERNELS names under PATH="wgmma" when the rows are
    wgmma's M (the lane refuses PATH="wgmma" unless the chunk kernels' F is; the scan's rows are 2 SCAN_BJ),
    else _warp_mma."""
    wgmma = config.get("PATH", "mma_sync") == "wgmma" and kernel in WGMMA_KERNELS and rows == wg.M
    return wg if wgmma else wm


def operand_align(config: dict, kernel: str, rows: int = wg.M) -> int:
    """Alignment of the kernel's operand buffers, bytes."""
    return wg.OPERAND_ALIGN if mma_module(config, kernel, rows) is wg else ALIGN


def key_layout(config: dict, shape: dict) -> Buffers:
    """Shared buffers of the key kernel; the P loop's operands and the later products' operands share
    one region."""
    F, e = shape["C"] * shape["R"], 2
    m2, bp = 2 * config["KEY_BJ"], config["KEY_BP"]
    return Buffers({"pv": (F, bp, e), "dy": (F, bp, e), "ds": (m2, bp, e), "st": (m2, bp, e),
                    "dkq": (F, F, 4), "dks": (F, m2, 4), "dqs": (F, m2, 4),
                    "dkqm": (F, F, e), "dqk": (F, F, e), "qh": (F, m2, e), "kh": (F, m2, e), "q": (F, m2, e),
                    "k": (F, m2, e), "rows": (3, F, 4), "red": (1, THREADS, 4), "gate": (4, F, 4)},
                   (("pv", "dy", "ds", "st"), ("dkqm", "dqk", "qh", "kh", "q", "k")), operand_align(config, "key"))


def value_layout(config: dict, shape: dict) -> Buffers:
    """Shared buffers of the value kernel; q_hat (read by the first product only) shares its region with
    the P loop's operands."""
    F, N, R, e = shape["C"] * shape["R"], shape["N"], shape["R"], 2
    bp = config["BLOCK_P"]
    return Buffers({"kh": (F, N, e), "qh": (F, N, e), "lkq": (F, F, 4), "a": (F, F, e), "dy": (F, bp, e),
                    "pv": (F, bp, e), "ds": (N, bp, e), "dp": (F, max(bp, R), 4), "red": (1, THREADS, 4),
                    "gate": (3, F, 4)},
                   (("qh",), ("dy", "pv", "ds")), operand_align(config, "value"))


@cute.jit
def _block_sum(red, tid, x):
    """Sum of x over the CTA's threads, valid in thread 0 (``red``: THREADS fp32 of shared memory)."""
    red[0, tid] = x
    cute.arch.sync_threads()
    total = F32(0.0)
    if tid == 0:
        for i in cutlass.range(THREADS, unroll=8):
            total = total + red[0, i]
    return total


def _row_sum(x, width: int):
    """Sum over the ``width`` consecutive lanes (a power of two up to 32) that hold one row."""
    off = width // 2
    while off >= 1:
        x = x + cute.arch.shuffle_sync_bfly(x, off)
        off //= 2
    return x


class Key(Views):
    def __init__(self, config: dict, shape: dict):
        super().__init__(shape, shape["N"] // 2 // config["KEY_BJ"])
        self.BJ, self.BP = config["KEY_BJ"], config["KEY_BP"]
        self.unroll = config["UNROLL"]
        self.prep = bool(config.get("SCAN_PREP", False))   # dy read from the scan's Prep (DY), not built
        self.M2 = 2 * self.BJ
        self.buffers = key_layout(config, shape)
        self.mm = mma_module(config, "key")

    @cute.jit
    def __call__(self, q: cute.Pointer, k: cute.Pointer, qb: cute.Pointer, kb: cute.Pointer, v: cute.Pointer,
                 psi: cute.Pointer, ang: cute.Pointer, da: cute.Pointer, dar: cute.Pointer, dtp: cute.Pointer,
                 trap: cute.Pointer, seg: cute.Pointer, dout: cute.Pointer, phi: cute.Pointer, z: cute.Pointer,
                 zeta: cute.Pointer, dy: cute.Pointer, states: cute.Pointer, ds: cute.Pointer, dq: cute.Pointer,
                 dk: cute.Pointer, dang: cute.Pointer, row_ws: cute.Pointer, dda_ws: cute.Pointer,
                 stream: cuda.CUstream):
        t = (self.qk(q), self.qk(k), self.per_rank(qb, self.N), self.per_rank(kb, self.N),
             self.step_head(v, self.P), self.per_rank(psi, self.P), self.step_head(ang, self.nr),
             self.per_step(da), self.per_step(dar), self.per_step(dtp), self.per_step(trap), self.seg(seg),
             self.dout(dout), self.per_rank(phi, self.P), self.step_head(z, self.P), self.per_rank(zeta, self.P),
             self.ops(dy, self.P), self.state(states), self.state(ds), self.out_rows(dq), self.out_rows(dk),
             self.step_head(dang, self.nr), self.row_ws(row_ws), self.chunk_ws(dda_ws, self.NBJ))
        self.storage = self.buffers.storage(self.dt)
        self.kernel(*t, self.mm.tiled(self.dt)).launch(grid=(self.nc * self.NBJ, self.H, self.B),
                                                       block=[THREADS, 1, 1], stream=stream)

    def out_rows(self, p):    # DQ, DK [B, S*R, H, N]
        N, H, S, R = self.N, self.H, self.S, self.R
        return cute.make_tensor(p, cute.make_layout((N, H, S * R, self.B), stride=(1, N, H * N, S * R * H * N)))

    def _col(self, j0, m):
        """State coordinate n of column m of an M2-wide tile (the pairs' two halves side by side)."""
        return j0 + m % self.BJ + (m // self.BJ) * self.NH

    @cute.kernel
    def kernel(self, mq: cute.Tensor, mk: cute.Tensor, mqb: cute.Tensor, mkb: cute.Tensor, mv: cute.Tensor,
               mpsi: cute.Tensor, mang: cute.Tensor, mda: cute.Tensor, mdar: cute.Tensor, mdt: cute.Tensor,
               mtrap: cute.Tensor, mseg: cute.Tensor, mdo: cute.Tensor, mphi: cute.Tensor, mz: cute.Tensor,
               mzeta: cute.Tensor, mdy: cute.Tensor, mst: cute.Tensor, mds: cute.Tensor, mdq: cute.Tensor,
               mdk: cute.Tensor, mdang: cute.Tensor, mrows: cute.Tensor, mdda: cute.Tensor, tiled_mma: cute.TiledMma):
        tid, _, _ = cute.arch.thread_idx()
        pid, h, b = cute.arch.block_idx()
        F, R, C, BJ, BP, M2, NH, dt = self.F, self.R, self.C, self.BJ, self.BP, self.M2, self.NH, self.dt
        c = pid // self.NBJ
        jb = pid % self.NBJ
        j0 = jb * BJ
        g = h // (self.H // self.G)
        st = cutlass.memory.SmemAllocator().allocate(self.storage)
        buf = self.buffers

        def op(name, rows, cols, transposed=False):   # an operand buffer (canonical layout under wgmma)
            return self.mm.operand(buf, st, name, rows, cols, dt, transposed)
        s_pv, s_dy, s_ds, s_st = op("pv", F, BP), op("dy", F, BP), op("ds", M2, BP), op("st", M2, BP)
        s_dkq, s_dks, s_dqs = (st.dkq.get_tensor(wm.row_major(F, F)), st.dks.get_tensor(wm.row_major(F, M2)),
                               st.dqs.get_tensor(wm.row_major(F, M2)))
        s_dkqm, s_dqk = op("dkqm", F, F), op("dqk", F, F)
        s_qh, s_kh, s_q, s_k = op("qh", F, M2), op("kh", F, M2), op("q", F, M2), op("k", F, M2)
        s_rows, s_red = st.rows.get_tensor(wm.row_major(3, F)), st.red.get_tensor(wm.row_major(1, THREADS))
        s_ang = st.dkq.get_tensor(wm.row_major(F, BJ))   # the angle gradient per (row, pair), once dkq is used
        s_gate = st.gate.get_tensor(wm.row_major(4, F))
        self.gates(s_gate, mdt, mtrap, mdar, mda, c, h, b, tid)   # read after the P loop's barriers

        acc_dkq = self.mm.accumulator(tiled_mma, tid, F, F)
        acc_dks = self.mm.accumulator(tiled_mma, tid, F, M2)
        acc_dqs = self.mm.accumulator(tiled_mma, tid, F, M2)
        dda = F32(0.0)
        for p0 in cutlass.range(0, self.P, BP, unroll=1):
            for it in cutlass.range(F * BP // THREADS, unroll=self.unroll):
                f, p, r, s = self.element(it, tid, BP, c)
                pp = p0 + p
                s_pv[f, p] = (mv[pp, h, s, b].to(F32) * mpsi[pp, r, h]).to(dt)
                if cutlass.const_expr(self.prep):
                    s_dy[f, p] = mdy[pp, f, c, h, b]
                else:
                    s_dy[f, p] = self.dy(mdo, mphi, mz, mzeta, pp, h, r, s, b).to(dt)
            for it in cutlass.range(M2 * BP // THREADS, unroll=self.unroll):
                idx = it * THREADS + tid
                m, p = idx // BP, idx % BP
                n = self._col(j0, m)
                ds_v = mds[p0 + p, n, c, h, b]
                st_v = mst[p0 + p, n, c, h, b]
                s_ds[m, p] = ds_v
                s_st[m, p] = st_v.to(dt)
                dda = dda + ds_v.to(F32) * st_v.to(F32)
            self.mm.publish()
            cute.arch.sync_threads()
            self.mm.mma_ss(tiled_mma, tid, acc_dkq, s_pv, s_dy, False, False, dt)
            self.mm.mma_ss(tiled_mma, tid, acc_dks, s_pv, s_ds, False, False, dt)
            self.mm.mma_ss(tiled_mma, tid, acc_dqs, s_dy, s_st, False, False, dt)
            cute.arch.sync_threads()   # before the next step overwrites the operands
        self.mm.to_smem(tiled_mma, tid, acc_dkq, s_dkq)
        self.mm.to_smem(tiled_mma, tid, acc_dks, s_dks)
        self.mm.to_smem(tiled_mma, tid, acc_dqs, s_dqs)
        total = _block_sum(s_red, tid, dda)    # its barrier also publishes the tiles above
        if tid == 0:
            mdda[jb, c, h, b] = cute.math.exp(mda[c * C + C - 1, h, b]) * total

        # dkq_m = dkq * decay and dqk[x, y] = gamma_x dkq[y, x] on same-step (x, y), both in the input dtype.
        for it in cutlass.range(F * F // THREADS, unroll=self.unroll):
            idx = it * THREADS + tid
            x, y = idx // F, idx % F
            s_dkqm[x, y] = (s_dkq[x, y] * self.decay(mseg, c, h, b, x, y)).to(dt)
            same = F32(0.0)
            if x // R == y // R:
                same = s_gate[0, x] * s_dkq[y, x]
            s_dqk[x, y] = same.to(dt)
        # Operands of the pairs, and the row sums through dks, dqs; then dks, dqs scaled by er, ea per row.
        for it in cutlass.range(F * BJ // THREADS, unroll=self.unroll):
            f, j, r, s = self.element(it, tid, BJ, c)
            factor, er, ea = s_gate[1, f], s_gate[2, f], s_gate[3, f]
            q_lo, q_hi, k_lo, k_hi, cos, sin = self.qk_rot(mq, mk, mqb, mkb, mang, g, h, b, r, s, j0 + j)
            qh_lo, qh_hi = q_lo * cos - q_hi * sin, q_lo * sin + q_hi * cos
            kh_lo = ((k_lo * cos - k_hi * sin) * factor).to(dt)
            kh_hi = ((k_lo * sin + k_hi * cos) * factor).to(dt)
            s_qh[f, j], s_qh[f, BJ + j] = qh_lo.to(dt), qh_hi.to(dt)
            s_kh[f, j], s_kh[f, BJ + j] = kh_lo, kh_hi
            s_q[f, j], s_q[f, BJ + j] = q_lo.to(dt), q_hi.to(dt)
            s_k[f, j], s_k[f, BJ + j] = k_lo.to(dt), k_hi.to(dt)
            dks_lo, dks_hi, dqs_lo, dqs_hi = s_dks[f, j], s_dks[f, BJ + j], s_dqs[f, j], s_dqs[f, BJ + j]
            rev = _row_sum(kh_lo.to(F32) * dks_lo + kh_hi.to(F32) * dks_hi, BJ)
            fwd = _row_sum(qh_lo * dqs_lo + qh_hi * dqs_hi, BJ)
            if j == 0:
                s_rows[0, f] = rev
                s_rows[2, f] = fwd
            s_dks[f, j], s_dks[f, BJ + j] = er * dks_lo, er * dks_hi
            s_dqs[f, j], s_dqs[f, BJ + j] = ea * dqs_lo, ea * dqs_hi
        self.mm.publish()
        cute.arch.sync_threads()

        # dk_hat = er dks + dkq_m q_hat; dq_hat = ea dqs + dkq_m^T k_hat (back into s_dks, s_dqs).
        acc = self.mm.accumulator(tiled_mma, tid, F, M2)
        self.mm.from_smem(tiled_mma, tid, acc, s_dks)
        self.mm.mma_ss(tiled_mma, tid, acc, s_dkqm, op("qh", F, M2, True), False, True, dt)
        acc2 = self.mm.accumulator(tiled_mma, tid, F, M2)
        self.mm.from_smem(tiled_mma, tid, acc2, s_dqs)
        self.mm.mma_ss(tiled_mma, tid, acc2, op("dkqm", F, F, True), op("kh", F, M2, True), True, True, dt)
        cute.arch.sync_threads()   # every thread has read s_dks, s_dqs
        self.mm.to_smem(tiled_mma, tid, acc, s_dks)
        self.mm.to_smem(tiled_mma, tid, acc2, s_dqs)
        cute.arch.sync_threads()

        # Angle gradient, DFACTOR's row sums, and the rotary transposes of dk_hat factor and dq_hat.
        for it in cutlass.range(F * BJ // THREADS, unroll=self.unroll):
            f, j, r, s = self.element(it, tid, BJ, c)
            factor = s_gate[1, f]
            q_lo, q_hi, k_lo, k_hi, cos, sin = self.qk_rot(mq, mk, mqb, mkb, mang, g, h, b, r, s, j0 + j)
            dkh_lo, dkh_hi, dqh_lo, dqh_hi = s_dks[f, j], s_dks[f, BJ + j], s_dqs[f, j], s_dqs[f, BJ + j]
            kr_lo, kr_hi = k_lo * cos - k_hi * sin, k_lo * sin + k_hi * cos
            rot = _row_sum(kr_lo * dkh_lo + kr_hi * dkh_hi, BJ)
            if j == 0:
                s_rows[1, f] = rot
            dkr_lo, dkr_hi = dkh_lo * factor, dkh_hi * factor
            s_ang[f, j] = (dkr_lo * (-k_lo * sin - k_hi * cos) + dkr_hi * (k_lo * cos - k_hi * sin)
                           + dqh_lo * (-q_lo * sin - q_hi * cos) + dqh_hi * (q_lo * cos - q_hi * sin))
            s_dks[f, j], s_dks[f, BJ + j] = dkr_lo * cos + dkr_hi * sin, -dkr_lo * sin + dkr_hi * cos
            s_dqs[f, j], s_dqs[f, BJ + j] = dqh_lo * cos + dqh_hi * sin, -dqh_lo * sin + dqh_hi * cos
        cute.arch.sync_threads()

        # DK = rotary part + dqk^T q, DQ = rotary part + dqk k, from the accumulators to global memory.
        out_layout = cute.make_layout((F, (BJ, 2)), stride=(self.H * self.N, (1, NH)))
        row0 = (b * self.S * R + c * F) * self.H * self.N + h * self.N + j0
        for which in cutlass.range_constexpr(2):
            acc3 = self.mm.accumulator(tiled_mma, tid, F, M2)
            if cutlass.const_expr(which == 0):
                self.mm.from_smem(tiled_mma, tid, acc3, s_dks)
                self.mm.mma_ss(tiled_mma, tid, acc3, op("dqk", F, F, True), op("q", F, M2, True), True, True, dt)
                dst = cute.make_tensor(mdk.iterator + row0, out_layout)
            else:
                self.mm.from_smem(tiled_mma, tid, acc3, s_dqs)
                self.mm.mma_ss(tiled_mma, tid, acc3, s_dqk, op("k", F, M2, True), False, True, dt)
                dst = cute.make_tensor(mdq.iterator + row0, out_layout)
            part = self.mm.partition(tiled_mma, tid, dst)
            for e in cutlass.range_constexpr(cute.size(acc3)):
                part[e] = acc3[e].to(dt)

        # DANGLES of the pairs (summed over the R ranks of a step); the row sums to the workspace.
        for it in cutlass.range(C * BJ // THREADS if C * BJ >= THREADS else 1, unroll=1):
            idx = it * THREADS + tid
            if idx < C * BJ:
                t, j = idx // BJ, idx % BJ
                n = j0 + j
                if n < self.nr:
                    acc_a = F32(0.0)
                    for r in cutlass.range_constexpr(R):
                        acc_a = acc_a + s_ang[t * R + r, j]
                    mdang[n, h, c * C + t, b] = acc_a
        for it in cutlass.range(-(-3 * F // THREADS), unroll=1):
            idx = it * THREADS + tid
            if idx < 3 * F:
                mrows[idx % F, idx // F, jb, c, h, b] = s_rows[idx // F, idx % F]


# --------------------------------------------------------------------------------------------
# value side


class Value(Views):
    def __init__(self, config: dict, shape: dict):
        super().__init__(shape, shape["N"] // 2 // config["KEY_BJ"])
        self.BP = config["BLOCK_P"]
        self.unroll = config["UNROLL"]
        self.prep = bool(config.get("SCAN_PREP", False))   # dy read from the scan's Prep (DY), not built
        self.buffers = value_layout(config, shape)
        self.mm = mma_module(config, "value")

    @cute.jit
    def __call__(self, q: cute.Pointer, k: cute.Pointer, qb: cute.Pointer, kb: cute.Pointer, v: cute.Pointer,
                 psi: cute.Pointer, ang: cute.Pointer, dar: cute.Pointer, dtp: cute.Pointer, trap: cute.Pointer,
                 qkd: cute.Pointer, seg: cute.Pointer, dout: cute.Pointer, phi: cute.Pointer, z: cute.Pointer,
                 zeta: cute.Pointer, dy: cute.Pointer, dpar: cute.Pointer, ds: cute.Pointer, row_ws: cute.Pointer,
                 dda_ws: cute.Pointer, dv: cute.Pointer, dfactor: cute.Pointer, dgamma: cute.Pointer,
                 ddda: cute.Pointer, dda_cs: cute.Pointer, dda_cs_rev: cute.Pointer, dssda: cute.Pointer,
                 dpsi_ws: cute.Pointer, dd_ws: cute.Pointer, stream: cuda.CUstream):
        R, S, H, B, nc, P = self.R, self.S, self.H, self.B, self.nc, self.P
        mqkd = cute.make_tensor(qkd, cute.make_layout((R, R, S, H, B), stride=(1, R, R * R, S * R * R, H * S * R * R)))
        mdpar = cute.make_tensor(dpar, cute.make_layout((H,), stride=(1,)))
        mssda = self.seg(dssda)
        mdpsi = cute.make_tensor(dpsi_ws, cute.make_layout((P, R, nc, H, B),
                                                           stride=(1, P, R * P, nc * R * P, H * nc * R * P)))
        t = (self.qk(q), self.qk(k), self.per_rank(qb, self.N), self.per_rank(kb, self.N),
             self.step_head(v, P), self.per_rank(psi, P), self.step_head(ang, self.nr), self.per_step(dar),
             self.per_step(dtp), self.per_step(trap), mqkd, self.seg(seg), self.dout(dout), self.per_rank(phi, P),
             self.step_head(z, P), self.per_rank(zeta, P), self.ops(dy, P), mdpar, self.state(ds),
             self.row_ws(row_ws),
             self.chunk_ws(dda_ws, self.NBJ), self.step_head(dv, P), self.per_step(dfactor), self.per_step(dgamma),
             self.per_step(ddda), self.per_step(dda_cs), self.per_step(dda_cs_rev), mssda, mdpsi,
             self.chunk_ws(dd_ws, 1))
        self.storage = self.buffers.storage(self.dt)
        self.kernel(*t, self.mm.tiled(self.dt)).launch(grid=(nc, H, B), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mq: cute.Tensor, mk: cute.Tensor, mqb: cute.Tensor, mkb: cute.Tensor, mv: cute.Tensor,
               mpsi: cute.Tensor, mang: cute.Tensor, mdar: cute.Tensor, mdt: cute.Tensor, mtrap: cute.Tensor,
               mqkd: cute.Tensor, mseg: cute.Tensor, mdo: cute.Tensor, mphi: cute.Tensor, mz: cute.Tensor,
               mzeta: cute.Tensor, mdy: cute.Tensor, mdpar: cute.Tensor, mds: cute.Tensor, mrows: cute.Tensor,
               mdda: cute.Tensor,
               mdv: cute.Tensor, mdfactor: cute.Tensor, mdgamma: cute.Tensor, mddda: cute.Tensor,
               mdda_cs: cute.Tensor, mdda_cs_rev: cute.Tensor, mssda: cute.Tensor, mdpsi: cute.Tensor,
               mdd: cute.Tensor, tiled_mma: cute.TiledMma):
        tid, _, _ = cute.arch.thread_idx()
        c, h, b = cute.arch.block_idx()
        F, R, C, N, NH, BP, P, dt = self.F, self.R, self.C, self.N, self.NH, self.BP, self.P, self.dt
        g = h // (self.H // self.G)
        st = cutlass.memory.SmemAllocator().allocate(self.storage)
        buf = self.buffers

        def op(name, rows, cols, transposed=False):   # an operand buffer (canonical layout under wgmma)
            return self.mm.operand(buf, st, name, rows, cols, dt, transposed)
        s_kh, s_qh, s_a = op("kh", F, N), op("qh", F, N), op("a", F, F)
        s_dy, s_pv, s_ds = op("dy", F, BP), op("pv", F, BP), op("ds", N, BP)
        s_ds_t, s_dy_t = op("ds", N, BP, True), op("dy", F, BP, True)
        s_lkq, s_dp = st.lkq.get_tensor(wm.row_major(F, F)), st.dp.get_tensor(wm.row_major(F, BP))
        s_diag = st.dp.get_tensor(wm.row_major(F, R))    # dkq's same-step entries, after the P loop
        s_red = st.red.get_tensor(wm.row_major(1, THREADS))
        s_gate = st.gate.get_tensor(wm.row_major(3, F))
        self.gates(s_gate, mdt, mtrap, mdar, None, c, h, b, tid)
        cute.arch.sync_threads()

        # k_hat and q_hat over all of N (natural coordinate order), then lkq = k_hat q_hat^T.
        for it in cutlass.range(F * NH // THREADS, unroll=self.unroll):
            f, n, r, s = self.element(it, tid, NH, c)
            factor = s_gate[1, f]
            q_lo, q_hi, k_lo, k_hi, cos, sin = self.qk_rot(mq, mk, mqb, mkb, mang, g, h, b, r, s, n)
            s_qh[f, n], s_qh[f, NH + n] = (q_lo * cos - q_hi * sin).to(dt), (q_lo * sin + q_hi * cos).to(dt)
            s_kh[f, n] = ((k_lo * cos - k_hi * sin) * factor).to(dt)
            s_kh[f, NH + n] = ((k_lo * sin + k_hi * cos) * factor).to(dt)
        self.mm.publish()
        cute.arch.sync_threads()
        acc_lkq = self.mm.accumulator(tiled_mma, tid, F, F)
        self.mm.mma_ss(tiled_mma, tid, acc_lkq, s_kh, s_qh, False, False, dt)
        self.mm.to_smem(tiled_mma, tid, acc_lkq, s_lkq)
        cute.arch.sync_threads()
        # A = lkq * decay + gamma QK_DOT on the same-step blocks: A[x, y] = gamma_y QK_DOT[t, r_y, r_x].
        for it in cutlass.range(F * F // THREADS, unroll=self.unroll):
            idx = it * THREADS + tid
            x, y = idx // F, idx % F
            a = s_lkq[x, y] * self.decay(mseg, c, h, b, x, y)
            if x // R == y // R:
                a = s_gate[0, y] * mqkd[x % R, y % R, c * C + y // R, h, b].to(F32)
            s_a[x, y] = a.to(dt)

        dpar = F32(0.0)
        if cutlass.const_expr(self.has_d):
            dpar = mdpar[h]
        dd = F32(0.0)
        acc_dkq = self.mm.accumulator(tiled_mma, tid, F, F)
        for p0 in cutlass.range(0, P, BP, unroll=1):
            # Operands: dy, PsiV [F, BP] (input dtype), the dS columns [N, BP]; D dy (fp32) into s_dp.
            for it in cutlass.range(F * BP // THREADS, unroll=self.unroll):
                f, p, r, s = self.element(it, tid, BP, c)
                pp = p0 + p
                dy = F32(0.0)
                if cutlass.const_expr(self.prep):   # the D terms then take dy rounded as the GEMMs do
                    dy = mdy[pp, f, c, h, b].to(F32)
                else:
                    dy = self.dy(mdo, mphi, mz, mzeta, pp, h, r, s, b)
                pv = mv[pp, h, s, b].to(F32) * mpsi[pp, r, h]
                s_dy[f, p], s_pv[f, p] = dy.to(dt), pv.to(dt)
                s_dp[f, p] = dpar * dy
                dd = dd + dy * pv
            for it in cutlass.range(N * BP // THREADS, unroll=self.unroll):
                idx = it * THREADS + tid
                n, p = idx // BP, idx % BP
                s_ds[n, p] = mds[p0 + p, n, c, h, b]
            self.mm.publish()   # (and s_a's stores, before the first step)
            cute.arch.sync_threads()
            # dPsiV = er (k_hat dS) + D dy + A dy; er per accumulator row.
            acc = self.mm.accumulator(tiled_mma, tid, F, BP)
            coord = self.mm.coords(tiled_mma, tid, F, BP)
            self.mm.mma_ss(tiled_mma, tid, acc, s_kh, s_ds_t, False, True, dt)
            dp_part = self.mm.partition(tiled_mma, tid, s_dp)
            for e in cutlass.range_constexpr(cute.size(acc)):
                f = coord[e][0]
                acc[e] = acc[e] * s_gate[2, f] + dp_part[e]
            self.mm.mma_ss(tiled_mma, tid, acc, s_a, s_dy_t, False, True, dt)
            self.mm.mma_ss(tiled_mma, tid, acc_dkq, s_pv, s_dy, False, False, dt)
            cute.arch.sync_threads()   # every thread has read s_dp
            self.mm.to_smem(tiled_mma, tid, acc, s_dp)
            cute.arch.sync_threads()
            # DV[t, p] = sum_r dPsiV[(t, r), p] Psi[r, p]; DMIMO_V's part sum_t dPsiV[(t, r), p] V[t, p].
            for it in cutlass.range(-(-C * BP // THREADS), unroll=1):
                idx = it * THREADS + tid
                if idx < C * BP:
                    t, p = idx // BP, idx % BP
                    dv = F32(0.0)
                    for r in cutlass.range_constexpr(R):
                        dv = dv + s_dp[t * R + r, p] * mpsi[p0 + p, r, h]
                    mdv[p0 + p, h, c * C + t, b] = dv.to(dt)
            for it in cutlass.range(-(-R * BP // THREADS), unroll=1):
                idx = it * THREADS + tid
                if idx < R * BP:
                    r, p = idx // BP, idx % BP
                    dpsi = F32(0.0)
                    for t in cutlass.range(C, unroll=4):
                        dpsi = dpsi + s_dp[t * R + r, p] * mv[p0 + p, h, c * C + t, b].to(F32)
                    mdpsi[p0 + p, r, c, h, b] = dpsi
            cute.arch.sync_threads()   # before the next step overwrites the operands
        total = _block_sum(s_red, tid, dd)
        if cutlass.const_expr(self.has_d):
            if tid == 0:
                mdd[0, c, h, b] = total

        # lkq * dkq (in place, each element by the thread that holds it) and dkq's same-step entries.
        lkq_part = self.mm.partition(tiled_mma, tid, s_lkq)
        coord = self.mm.coords(tiled_mma, tid, F, F)
        for e in cutlass.range_constexpr(cute.size(acc_dkq)):
            x, y = coord[e][0], coord[e][1]
            lkq_part[e] = lkq_part[e] * acc_dkq[e]
            if x // R == y // R:
                s_diag[x, y % R] = acc_dkq[e]
        cute.arch.sync_threads()
        # DSSDA[s, t] = sum over the R x R block (key step s, query step t) of lkq * dkq.
        for it in cutlass.range(-(-C * C // THREADS), unroll=1):
            idx = it * THREADS + tid
            if idx < C * C:
                ts, tt = idx // C, idx % C
                ssda = F32(0.0)
                for i in cutlass.range(R * R, unroll_full=True):
                    ssda = ssda + s_lkq[ts * R + i // R, tt * R + i % R]
                mssda[tt, ts, c, h, b] = ssda
        # Per step: DGAMMA_DIAG = sum_{o,i} QK_DOT[t, o, i] dkq[(t, i), (t, o)]; DDA; the key side's row sums.
        for it in cutlass.range(-(-C // THREADS), unroll=1):
            t = it * THREADS + tid
            if t < C:
                s = c * C + t
                dg = F32(0.0)
                for i in cutlass.range(R * R, unroll_full=True):
                    dg = dg + mqkd[i % R, i // R, s, h, b].to(F32) * s_diag[t * R + i % R, i // R]
                mdgamma[s, h, b] = dg
                total_dda = F32(0.0)
                rev, fac, fwd = F32(0.0), F32(0.0), F32(0.0)
                for jb in cutlass.range(self.NBJ, unroll=1):
                    total_dda = total_dda + mdda[jb, c, h, b]
                    for r in cutlass.range_constexpr(R):
                        rev = rev + mrows[t * R + r, 0, jb, c, h, b]
                        fac = fac + mrows[t * R + r, 1, jb, c, h, b]
                        fwd = fwd + mrows[t * R + r, 2, jb, c, h, b]
                mddda[s, h, b] = total_dda
                mdda_cs_rev[s, h, b] = rev
                mdfactor[s, h, b] = fac
                mdda_cs[s, h, b] = fwd


# --------------------------------------------------------------------------------------------
# reduce


class Reduce:
    def __init__(self, shape: dict):
        B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
        self.B, self.H, self.P, self.R, self.nc = B, H, P, R, nc
        self.has_d = bool(shape["hasD"])

    @cute.jit
    def __call__(self, dpsi_ws: cute.Pointer, dd_ws: cute.Pointer, dpsi: cute.Pointer, dd: cute.Pointer,
                 stream: cuda.CUstream):
        B, H, P, R, nc = self.B, self.H, self.P, self.R, self.nc
        ws = cute.make_tensor(dpsi_ws, cute.make_layout((R * P, nc, H, B), stride=(1, R * P, nc * R * P, H * nc * R * P)))
        out = cute.make_tensor(dpsi, cute.make_layout((R * P, H, B), stride=(1, R * P, H * R * P)))
        dws = cute.make_tensor(dd_ws, cute.make_layout((nc, H, B), stride=(1, nc, H * nc)))
        dout = cute.make_tensor(dd, cute.make_layout((H, B), stride=(1, H)))
        self.kernel(ws, out, dws, dout).launch(grid=(H, B, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, ws: cute.Tensor, out: cute.Tensor, dws: cute.Tensor, dout: cute.Tensor):
        tid, _, _ = cute.arch.thread_idx()
        h, b, _ = cute.arch.block_idx()
        RP = self.R * self.P
        for it in cutlass.range(-(-RP // THREADS), unroll=1):
            i = it * THREADS + tid
            if i < RP:
                x = F32(0.0)
                for c in cutlass.range(self.nc, unroll=4):
                    x = x + ws[i, c, h, b]
                out[i, h, b] = x
        if cutlass.const_expr(self.has_d):
            if tid == 0:
                x = F32(0.0)
                for c in cutlass.range(self.nc, unroll=4):
                    x = x + dws[c, h, b]
                dout[h, b] = x
