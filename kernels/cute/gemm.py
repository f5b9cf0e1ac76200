"""CuTe DSL GEMM lane: C[M, N] = A[M, K] @ B[K, N], fp16/bf16 inputs, fp32 accumulation, C in the input dtype.

Two device paths, named by the tunable ``PATH`` (a config says which one ran, also when a GB10 profile
is emulated on an H100, where both compile):

  * ``wgmma`` (Hopper, sm_90a only): TMA loads of A and B tiles into a ``STAGES``-deep ring of
    128-byte-swizzled shared buffers guarded by mbarriers, warpgroup MMA (wgmma) reading both operands
    straight from shared memory, one consumer warpgroup per 64 rows of the tile (BLOCK_M=128 uses two),
    optional thread-block clusters (``CLUSTER_M`` x ``CLUSTER_N``) that multicast the A tile along N and
    the B tile along M, and a TMA-store epilogue staged through the (by then idle) A buffers.
  * ``mma_sync`` (consumer Blackwell sm_120a / sm_121a; also compiles for sm_90a): the same TMA ring and
    epilogue, but one producer warp issues the TMA loads while four MMA warps (2 x 2) copy fragments with
    ldmatrix and multiply with warp-level mma.sync 16x8x16 (no wgmma / tcgen05 on these parts). Clusters
    are refused (no multicast on GeForce Blackwell).

Both paths read A as K-major and B as N-major (the problem's row-major layouts) without copies; 16-bit
wgmma and ldmatrix.trans accept MN-major operands, so bf16 and fp16 share one code path.
Ragged shapes: TMA zero-fills out-of-bounds loads and clips out-of-bounds stores, so any M works and
N, K only need 16-byte aligned rows (multiples of 8 elements), which config_reason enforces.

Written after reading NVIDIA/cutlass examples/python/CuTeDSL/cute/hopper/kernel/dense_gemm/dense_gemm.py
and .../blackwell_geforce/kernel/dense_gemm/dense_gemm.py (API usage: PipelineTmaAsync, tma_partition,
StMatrix epilogue); the kernels here are smaller (non-persistent, one output tile per CTA) and grouped
tile rasterization replaces the examples' cluster swizzle.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.hopper_helpers as sm90_utils
import torch

from kernels import _targets
from kernels.cute import _aot
from kernels.cute._aot import static_smem, versions  # noqa: F401 (versions: the lane interface)

DSL = "cute"
KERNEL = "gemm"
TUNABLES = ("PATH", "BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "CLUSTER_M", "CLUSTER_N", "GROUP_M")
DEFAULTS = {"PATH": "wgmma", "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "STAGES": 4,
            "CLUSTER_M": 1, "CLUSTER_N": 1, "GROUP_M": 8}
DTYPES = ("float16", "bfloat16")
TARGETS = ("sm_90a", "sm_120a", "sm_121a")
_MBAR_REGION = 1024  # mbarrier ring, padded: the operand buffers that follow are 1024-byte aligned
_EPI_N = 32          # epilogue sub-tile width (columns of C stored per TMA store)


# ----------------------------------------------------------------------------------------------
# Pure-Python rules
# ----------------------------------------------------------------------------------------------

PATHS = ("wgmma", "mma_sync")


def _epi_tile(path: str, bm: int) -> tuple[int, int]:
    # wgmma: one epilogue sub-tile spans all rows of the CTA tile (the consumer warpgroups stack in M);
    # mma_sync: 64-row sub-tiles, as the 2 x 2 warp layout covers 64 rows per warp row pair.
    return (bm, _EPI_N) if path == "wgmma" else (64, _EPI_N)


def _epi_stages(config: dict, path: str, elem: int) -> int:
    """Epilogue staging buffers; they alias the A ring, so they must fit in it."""
    em, en = _epi_tile(path, config["BLOCK_M"])
    a_ring = config["BLOCK_M"] * config["BLOCK_K"] * config["STAGES"] * elem
    return max(1, min(4, a_ring // (em * en * elem)))


def config_reason(config: dict, shape: dict) -> str | None:
    """Why ``config`` cannot run ``shape`` (None when it can). Pure arithmetic, no compile."""
    if shape["dtype"] not in DTYPES:
        return f"dtype {shape['dtype']} not supported (have {', '.join(DTYPES)}; fp32 would need a tf32 path)"
    # The values each knob may take are the sweep file's (sweeps/gemm/cute.toml); the harness checks them.
    path = config["PATH"]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    cm, cn = config["CLUSTER_M"], config["CLUSTER_N"]
    if path == "mma_sync":
        if bm * bn > 128 * 128:
            return (f"mma_sync path: a {bm}x{bn} tile needs {bm * bn // 128} fp32 accumulators per MMA thread "
                    f"(4 warps): above 128 it spills; use BLOCK_M*BLOCK_N <= 16384")
        if cm * cn > 1:
            return "mma_sync path has no cluster multicast: CLUSTER_M = CLUSTER_N = 1"
    elem = 2
    for dim in ("K", "N"):
        if (shape[dim] * elem) % 16:
            return f"TMA needs 16-byte aligned rows: {dim}={shape[dim]} x {elem} B is not a multiple of 16"
    return None


def eligibility(target: str) -> str | None:
    """Why this lane cannot compile for ``target`` (None when it can)."""
    if target not in TARGETS:
        return (f"cute gemm has no path for {target}: wgmma+TMA requires sm_90a, the warp-MMA+TMA path "
                f"targets sm_120a/sm_121a (has {', '.join(TARGETS)})")
    return None


def target_reason(config: dict, target: str) -> str | None:
    """Config rules that depend on the compile target."""
    reason = eligibility(target)
    if reason:
        return reason
    path = config["PATH"]
    if path not in PATHS:
        # Until 2026-11-27 PATH "auto" chose by the GPU present: its GB10-profile rows, emulated on an H100,
        # ran the wgmma path, which GB10 cannot run.
        return f"PATH {path!r} is not a path of this lane (have {', '.join(PATHS)})"
    if path == "wgmma" and _targets.cc(target) != 90:
        return f"ineligible: PATH=wgmma requires sm_90a (warpgroup MMA + TMA multicast); target is {target}"
    if _targets.cc(target) >= 120 and config["CLUSTER_M"] * config["CLUSTER_N"] > 1:
        return f"ineligible: clusters of {config['CLUSTER_M']}x{config['CLUSTER_N']} need TMA multicast, absent on {target}"
    if path == "mma_sync" and config["BLOCK_M"] * config["BLOCK_N"] > 128 * 128:
        return f"mma_sync path (the only one on {target}) takes tiles of at most 128x128"
    return None


def smem_estimate(config: dict, shape: dict, target: str) -> int:
    """Shared memory per CTA in bytes that the launch requests (dynamic + static), analytic.

    Dynamic part (the kernel's shared-storage struct, laid out by the DSL):
      1024 B for the mbarrier ring (2 x STAGES x 8 B, padded because the next member is 1024-B aligned)
      + STAGES x BLOCK_M x BLOCK_K x 2 B (A ring) + STAGES x BLOCK_N x BLOCK_K x 2 B (B ring).
    The epilogue's C staging buffers alias the A ring (the ring is idle by then), so they add nothing.
    Static part: ``static_smem`` (the .nv.shared sections as the driver counts them). The tests hold
    this to the compiled figure (equal).
    """
    elem = 2
    bm, bn, bk, st = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["STAGES"]
    dynamic = _MBAR_REGION + st * (bm * bk + bn * bk) * elem
    return dynamic + static_smem(target)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------

class Gemm:
    """One compiled GEMM: shapes, tile, stages and cluster are compile-time constants.

    The host function takes three global pointers (A, B, C) and a stream; it builds the row-major
    views, the TMA descriptors and launches ``kernel_wgmma`` or ``kernel_mma``.
    """

    def __init__(self, path, dtype, M, N, K, tile, stages, cluster, group_m, epi_stages):
        self.path, self.dtype, self.M, self.N, self.K = path, dtype, M, N, K
        self.bm, self.bn, self.bk = tile
        self.tile_mnk = tile
        self.stages, self.epi_stages, self.group_m = stages, epi_stages, group_m
        self.cluster_mn = cluster if path == "wgmma" else (1, 1)
        self.acc_dtype = cutlass.Float32
        self.epi_tile = _epi_tile(path, self.bm)
        if path == "wgmma":
            self.mma_warpgroups = self.bm // 64          # one consumer warpgroup per 64 rows
            self.mma_threads = 128 * self.mma_warpgroups
            self.threads = self.mma_threads              # warp 0 also issues the TMA loads
        else:
            self.mma_threads = 4 * 32                    # 2 x 2 MMA warps
            self.threads = self.mma_threads + 32         # + 1 TMA producer warp
        tiles_m = -(-M // self.bm)
        tiles_n = -(-N // self.bn)
        cm, cn = self.cluster_mn
        self.clusters_m = -(-tiles_m // cm)
        self.clusters_n = -(-tiles_n // cn)
        # Problem's layouts: A (M, K) row-major = K-major; B (K, N) row-major = N-major; C row-major.
        self.a_layout = LayoutEnum.ROW_MAJOR
        self.b_layout = LayoutEnum.COL_MAJOR
        self.c_layout = LayoutEnum.ROW_MAJOR

    # ---- host -------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, c_ptr: cute.Pointer,
                 stream: cuda.CUstream):
        M, N, K = self.M, self.N, self.K
        # CuTe convention: A is (M, K, L), B is (N, K, L), C is (M, N, L).
        mA = cute.make_tensor(a_ptr, cute.make_layout((M, K, 1), stride=(K, 1, 0)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((N, K, 1), stride=(1, N, 0)))
        mC = cute.make_tensor(c_ptr, cute.make_layout((M, N, 1), stride=(N, 1, 0)))

        a_sl = sm90_utils.make_smem_layout_a(self.a_layout, self.tile_mnk, self.dtype, self.stages)
        b_sl = sm90_utils.make_smem_layout_b(self.b_layout, self.tile_mnk, self.dtype, self.stages)
        epi_sl = sm90_utils.make_smem_layout_epi(self.dtype, self.c_layout, self.epi_tile, self.epi_stages)

        cm, cn = self.cluster_mn
        # A tiles are shared by the CTAs of a cluster row (same M), B tiles by a cluster column.
        op_a = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if cn == 1
                else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        op_b = (cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp() if cm == 1
                else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp())
        tma_atom_a, tma_a = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op_a, mA, cute.slice_(a_sl, (None, None, 0)), (self.bm, self.bk), num_multicast=cn)
        tma_atom_b, tma_b = cute.nvgpu.cpasync.make_tiled_tma_atom(
            op_b, mB, cute.slice_(b_sl, (None, None, 0)), (self.bn, self.bk), num_multicast=cm)
        tma_atom_c, tma_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(epi_sl, (None, None, 0)),
            self.epi_tile)

        if cutlass.const_expr(self.path == "wgmma"):
            tiled_mma = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, self.a_layout.sm90_mma_major_mode(),
                self.b_layout.sm90_mma_major_mode(), self.acc_dtype, (self.mma_warpgroups, 1, 1),
                tiler_mn=(64, self.bn))
        else:
            op = cute.nvgpu.warp.MmaF16BF16Op(self.dtype, self.acc_dtype, (16, 8, 16))
            # 2 x 2 warps; N doubled in the permutation so ldmatrix.x4 fills two 8-wide B atoms.
            tiled_mma = cute.make_tiled_mma(op, cute.make_layout((2, 2, 1)), permutation_mnk=(32, 32, 16))

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(a_sl)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(b_sl)], 1024]

        self.shared_storage = SharedStorage
        grid = (self.clusters_m * cm, self.clusters_n * cn, 1)
        cta_layout_mnk = cute.make_layout((cm, cn, 1))
        if cutlass.const_expr(self.path == "wgmma"):
            self.kernel_wgmma(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, tiled_mma,
                              cta_layout_mnk, a_sl, b_sl, epi_sl).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=(cm, cn, 1), stream=stream)
        else:
            self.kernel_mma(tma_atom_a, tma_a, tma_atom_b, tma_b, tma_atom_c, tma_c, tiled_mma,
                            cta_layout_mnk, a_sl, b_sl, epi_sl).launch(
                grid=grid, block=[self.threads, 1, 1], cluster=(1, 1, 1), stream=stream)

    # ---- shared device helpers ---------------------------------------------------------------
    @cute.jit
    def _tile_coords(self):
        """Grouped rasterization over clusters: GROUP_M cluster-rows walk one band of B columns."""
        cidx, cidy, _ = cute.arch.cluster_idx()
        ncm, ncn = self.clusters_m, self.clusters_n
        cid = cidx + cidy * ncm
        g = min(self.group_m, ncm)
        per_group = g * ncn
        first = (cid // per_group) * g
        rows = cutlass.min(ncm - first, g)
        local = cid % per_group
        cl_m = first + local % rows
        cl_n = local // rows
        in_cl = cute.arch.block_in_cluster_idx()
        return cl_m * self.cluster_mn[0] + in_cl[0], cl_n * self.cluster_mn[1] + in_cl[1]

    @cute.jit
    def _make_pipeline(self, storage, a_sl, b_sl, cta_layout_mnk, consumer_warps: cutlass.Constexpr):
        cm, cn = self.cluster_mn
        tx_bytes = (cute.size_in_bytes(self.dtype, cute.slice_(a_sl, (None, None, 0)))
                    + cute.size_in_bytes(self.dtype, cute.slice_(b_sl, (None, None, 0))))
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        # Every consumer warp releases a stage once per CTA that wrote into it (multicast peers).
        consumer = pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps * (cm + cn - 1))
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr(), num_stages=self.stages, producer_group=producer,
            consumer_group=consumer, tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)), defer_sync=True)

    @cute.jit
    def _epilogue(self, tiled_mma, acc, sC, gC, tma_atom_c, tidx, warp_idx, barrier_id: cutlass.Constexpr,
                  n_fastest: cutlass.Constexpr):
        """Registers -> swizzled smem (stmatrix) -> TMA store, one EPI_M x 32 sub-tile at a time.

        ``n_fastest``: order in which the accumulator fragments walk the sub-tiles (wgmma: along N,
        the warp-MMA layout: along M first).
        """
        copy_r2s_atom = sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=self.dtype,
                                                           elem_ty_acc=self.acc_dtype)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4),
                                       self.dtype)
        tiled_r2s = cute.make_tiled_copy_S(copy_r2s_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_r2s = tiled_r2s.get_slice(tidx)
        tRS_sC = thr_r2s.partition_D(sC)
        tRS_acc = tiled_r2s.retile(acc)
        rD_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(sC))[:3])
        rD = cute.make_rmem_tensor(rD_layout.shape, self.acc_dtype)
        n_vals = cute.size(rD)

        gC_epi = cute.zipped_divide(gC, self.epi_tile)
        bSG_s, bSG_g = cute.nvgpu.cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
        n_epi = cute.size(gC_epi, mode=[1])
        epi_shape = gC_epi.shape[1]
        if cutlass.const_expr(n_fastest):
            epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        else:
            epi_order = cute.make_layout(epi_shape, stride=(1, epi_shape[0]))
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads))
        for e in cutlass.range_constexpr(n_epi):
            for v in cutlass.range_constexpr(n_vals):
                rD[v] = tRS_acc[e * n_vals + v]
            out = cute.make_rmem_tensor(rD_layout.shape, self.dtype)
            out.store(rD.load().to(self.dtype))
            buf = e % self.epi_stages
            cute.copy(tiled_r2s, out, tRS_sC[(None, None, None, buf)])
            # Make the generic-proxy smem writes visible to the TMA (async proxy) before the store.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.mma_threads)
            if warp_idx == 0:
                cute.copy(tma_atom_c, bSG_s[(None, buf)], bSG_g[(None, epi_order.get_hier_coord(e))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=self.mma_threads)
        if warp_idx == 0:
            store_pipe.producer_tail()

    # ---- Hopper: TMA + wgmma -----------------------------------------------------------------
    @cute.kernel
    def kernel_wgmma(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
                     mB: cute.Tensor, tma_atom_c: cute.CopyAtom, mC: cute.Tensor, tiled_mma: cute.TiledMma,
                     cta_layout_mnk: cute.Layout, a_sl: cute.ComposedLayout, b_sl: cute.ComposedLayout,
                     epi_sl: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
        cm, cn = self.cluster_mn
        pid_m, pid_n = self._tile_coords()
        tile_coord = (pid_m, pid_n, None, 0)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cl_coord = cta_layout_mnk.get_flat_coord(cta_rank)
        a_mask = cute.make_layout_image_mask(cta_layout_mnk, cl_coord, mode=1) if cn > 1 else 0
        b_mask = cute.make_layout_image_mask(cta_layout_mnk, cl_coord, mode=0) if cm > 1 else 0

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe = self._make_pipeline(storage, a_sl, b_sl, cta_layout_mnk, self.threads // 32)
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_sl.outer, swizzle=a_sl.inner)
        sB = storage.sB.get_tensor(b_sl.outer, swizzle=b_sl.inner)
        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, epi_sl.inner, dtype=self.dtype), epi_sl.outer)

        gA = cute.local_tile(mA, self.tile_mnk, tile_coord, proj=(1, None, 1))   # (bM, bK, k)
        gB = cute.local_tile(mB, self.tile_mnk, tile_coord, proj=(None, 1, 1))   # (bN, bK, k)
        gC = cute.local_tile(mC, self.tile_mnk, tile_coord, proj=(1, 1, None))   # (bM, bN)

        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma = tiled_mma.get_slice(cute.make_layout(self.mma_warpgroups, stride=128)(wg_idx))
        tCgC = thr_mma.partition_C(gC)

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, cl_coord[1], cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, cl_coord[0], cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(tCgC.shape, self.acc_dtype)

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        k_tiles = cute.size(gA, mode=[2])
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # Prologue: fill the ring.
        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(self.stages, k_tiles), unroll=1):
                pipe.producer_acquire(prod)
                cute.copy(tma_atom_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod), mcast_mask=a_mask)
                cute.copy(tma_atom_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod), mcast_mask=b_mask)
                pipe.producer_commit(prod)
                prod.advance()

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        k_blocks = cute.size(tCrA, mode=[2])

        # First k-tile: zero-initialising MMAs (ACCUMULATE off for the first k-block).
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        pipe.consumer_wait(read)
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range(k_blocks, unroll_full=True):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.commit_group()
        read.advance()

        # Steady state: keep one wgmma batch in flight; release a stage once its batch retired,
        # then refill it with the k-tile STAGES ahead.
        for _ in cutlass.range(1, k_tiles, 1, unroll=1):
            pipe.consumer_wait(read)
            cute.nvgpu.warpgroup.fence()
            for kb in cutlass.range(k_blocks, unroll_full=True):
                cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, read.index)], tCrB[(None, None, kb, read.index)], acc)
            cute.nvgpu.warpgroup.commit_group()
            cute.nvgpu.warpgroup.wait_group(1)
            pipe.consumer_release(release)
            read.advance()
            release.advance()
            if warp_idx == 0 and prod.count < k_tiles:
                pipe.producer_acquire(prod)
                cute.copy(tma_atom_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod), mcast_mask=a_mask)
                cute.copy(tma_atom_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod), mcast_mask=b_mask)
                pipe.producer_commit(prod)
                prod.advance()

        cute.nvgpu.warpgroup.wait_group(0)
        # The C staging buffers alias the A ring: every warpgroup must be done reading it (and, in a
        # cluster, no peer may still signal our barriers) before the epilogue writes.
        if cutlass.const_expr(cm * cn > 1):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        self._epilogue(tiled_mma, acc, sC, gC, tma_atom_c, tidx, warp_idx, 1, True)

    # ---- consumer Blackwell (and any sm_90+): TMA + warp-level mma.sync -----------------------
    @cute.kernel
    def kernel_mma(self, tma_atom_a: cute.CopyAtom, mA: cute.Tensor, tma_atom_b: cute.CopyAtom,
                   mB: cute.Tensor, tma_atom_c: cute.CopyAtom, mC: cute.Tensor, tiled_mma: cute.TiledMma,
                   cta_layout_mnk: cute.Layout, a_sl: cute.ComposedLayout, b_sl: cute.ComposedLayout,
                   epi_sl: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        producer_warp = self.mma_threads // 32
        if warp_idx == producer_warp:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_atom_c)
        pid_m, pid_n = self._tile_coords()
        tile_coord = (pid_m, pid_n, None, 0)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        pipe = self._make_pipeline(storage, a_sl, b_sl, cta_layout_mnk, self.mma_threads // 32)
        pipeline.pipeline_init_arrive()

        sA = storage.sA.get_tensor(a_sl.outer, swizzle=a_sl.inner)
        sB = storage.sB.get_tensor(b_sl.outer, swizzle=b_sl.inner)
        sC = cute.make_tensor(cute.recast_ptr(sA.iterator, epi_sl.inner, dtype=self.dtype), epi_sl.outer)

        gA = cute.local_tile(mA, self.tile_mnk, tile_coord, proj=(1, None, 1))
        gB = cute.local_tile(mB, self.tile_mnk, tile_coord, proj=(None, 1, 1))
        gC = cute.local_tile(mC, self.tile_mnk, tile_coord, proj=(1, 1, None))
        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_atom_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_atom_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        pipeline.pipeline_init_wait()
        k_tiles = cute.size(gA, mode=[2])

        if warp_idx < producer_warp:
            thr_mma = tiled_mma.get_slice(tidx)
            tCsA = thr_mma.partition_A(sA)
            tCsB = thr_mma.partition_B(sB)
            tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
            tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
            acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape, self.acc_dtype)
            acc.fill(0.0)
            # ldmatrix: A is K-major (plain), B is N-major (transposed load).
            ld_a = cute.make_tiled_copy_A(cute.make_copy_atom(
                cute.nvgpu.warp.LdMatrix8x8x16bOp(self.a_layout.is_m_major_a(), 4), self.dtype), tiled_mma)
            ld_b = cute.make_tiled_copy_B(cute.make_copy_atom(
                cute.nvgpu.warp.LdMatrix8x8x16bOp(self.b_layout.is_n_major_b(), 4), self.dtype), tiled_mma)
            thr_ld_a = ld_a.get_slice(tidx)
            thr_ld_b = ld_b.get_slice(tidx)
            tXsA = thr_ld_a.partition_S(sA)
            tXrA = thr_ld_a.retile(tCrA)
            tXsB = thr_ld_b.partition_S(sB)
            tXrB = thr_ld_b.retile(tCrB)
            k_blocks = cute.size(tCrA, mode=[2])

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            for _ in cutlass.range(k_tiles, unroll=1):
                pipe.consumer_wait(read)
                sa = tXsA[None, None, None, read.index]
                sb = tXsB[None, None, None, read.index]
                # Software-pipelined over k-blocks: load fragments of k-block kb+1 while kb multiplies.
                cute.copy(ld_a, sa[None, None, 0], tXrA[None, None, 0])
                cute.copy(ld_b, sb[None, None, 0], tXrB[None, None, 0])
                for kb in cutlass.range_constexpr(k_blocks):
                    if cutlass.const_expr(kb + 1 < k_blocks):
                        cute.copy(ld_a, sa[None, None, kb + 1], tXrA[None, None, kb + 1])
                        cute.copy(ld_b, sb[None, None, kb + 1], tXrB[None, None, kb + 1])
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
                # All fragments of this stage are in registers: hand the buffer back to the producer.
                pipe.consumer_release(read)
                read.advance()

            # The C staging buffers alias the A ring: all MMA warps must be done with ldmatrix.
            cute.arch.barrier(barrier_id=1, number_of_threads=self.mma_threads)
            self._epilogue(tiled_mma, acc, sC, gC, tma_atom_c, tidx, warp_idx, 1, False)
        elif warp_idx == producer_warp:
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for _ in cutlass.range(k_tiles, unroll=1):
                pipe.producer_acquire(prod)
                cute.copy(tma_atom_a, tAgA[(None, prod.count)], tAsA[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod))
                cute.copy(tma_atom_b, tBgB[(None, prod.count)], tBsB[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod))
                pipe.producer_commit(prod)
                prod.advance()
            pipe.producer_tail(prod)


# ----------------------------------------------------------------------------------------------
# Compile / build
# ----------------------------------------------------------------------------------------------

def _dtype_cls(dtype: str):
    import cutlass
    return {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[dtype]


def _compile(config: dict, shape: dict, target: str, options: str):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace
    from cutlass.runtime import make_fake_stream

    path = config["PATH"]
    dt = _dtype_cls(shape["dtype"])
    gemm = Gemm(path=path, dtype=dt, M=shape["M"], N=shape["N"], K=shape["K"],
                tile=(config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]),
                stages=config["STAGES"], cluster=(config["CLUSTER_M"], config["CLUSTER_N"]),
                group_m=config["GROUP_M"], epi_stages=_epi_stages(config, path, 2))
    # Placeholder pointers (address 0) for tracing: the real addresses come at call time.
    ptrs = [make_ptr(dt, 0, AddressSpace.gmem, assumed_align=16) for _ in range(3)]
    return cute.compile(gemm, *ptrs, make_fake_stream(), options=f"--gpu-arch {target} {options}".strip())


def compile_for(config: dict, shape: dict, target: str) -> dict:
    """Ahead-of-time compile for ``target`` (no GPU needed).

    Returns ``_aot.compile_with_resources``'s figures: ``smem_bytes`` is what the launch will request,
    the dynamic size the DSL bakes into the host launch code plus the static shared memory of the
    kernel's cubin.
    """
    reason = config_reason(config, shape) or target_reason(config, target)
    if reason:
        raise ValueError(f"cannot compile for {target}: {reason}")
    _, res = _aot.compile_with_resources(lambda options: _compile(config, shape, target, options),
                                         f"cute_gemm_{target}_", target)
    return res


# ---- running -------------------------------------------------------------------------------------

def build(config: dict, shape: dict):
    """Compile once for the current device and return ``run(inputs, outputs)`` (launch only)."""
    import cuda.bindings.driver as cuda
    from cutlass.cute.runtime import make_ptr
    from cutlass.cute.typing import AddressSpace

    target = _targets.device_target()
    reason = config_reason(config, shape) or target_reason(config, target)
    if reason:
        raise ValueError(reason)
    fn, res = _aot.compile_with_resources(lambda options: _compile(config, shape, target, options),
                                          f"cute_gemm_{target}_", target)
    info = {"smem_bytes": res["smem_bytes"], "registers": res["registers"], "spills": None}
    dt = _dtype_cls(shape["dtype"])
    want = getattr(torch, shape["dtype"])
    M, N, K = shape["M"], shape["N"], shape["K"]
    streams: dict = {}

    def run(inputs, outputs):
        a, b, c = inputs["a"], inputs["b"], outputs["c"]
        for t, shp in ((a, (M, K)), (b, (K, N)), (c, (M, N))):
            if t.dtype != want or tuple(t.shape) != shp or not t.is_contiguous() or t.data_ptr() % 16:
                raise ValueError(f"expected a contiguous, 16-byte aligned {want} tensor of shape {shp}")
        raw = torch.cuda.current_stream().cuda_stream
        s = streams.get(raw)
        if s is None:
            s = streams[raw] = cuda.CUstream(raw)
        fn(make_ptr(dt, a.data_ptr(), AddressSpace.gmem, assumed_align=16),
           make_ptr(dt, b.data_ptr(), AddressSpace.gmem, assumed_align=16),
           make_ptr(dt, c.data_ptr(), AddressSpace.gmem, assumed_align=16), s)
        return info
    return run
