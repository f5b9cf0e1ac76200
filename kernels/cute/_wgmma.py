"""Warpgroup MMA (wgmma, sm_90a only) from shared memory for the CuTe DSL bwd_bwd kernels
(kernels/cute/_bwd_bwd_chunk.py, _bwd_bwd_scan.py; PATH="wgmma"): the interface of _warp_mma.py
(accumulator, coords, partition, mma_ss, to_smem, from_smem, operand, publish) for one warpgroup (the CTA's 128 threads), m64nNk16 with both operands
read by descriptor from shared memory, fp32 accumulators.

wgmma reads shared memory through the async proxy and only in its canonical layouts, so:
  * an operand buffer is a row-major [rows, cols] matrix of the input dtype held in the canonical K-major
    layout with the widest swizzle its row allows (cols * 2 bytes: 128 -> 128-byte swizzle, 64 -> 64-byte,
    32 -> 32-byte), ``operand``; seen transposed (``transposed=True``) the same bytes are the canonical
    MN-major layout of the transposed matrix, so one buffer serves as a K-major operand and, transposed,
    as an MN-major one. Every elementwise store goes through these views (the swizzle is on the pointer,
    applied to byte addresses), and each buffer starts at an OPERAND_ALIGN-byte boundary (the swizzle
    pattern repeats every 8 rows of 128 bytes);
  * threads that stored operands with ordinary stores call ``publish`` (fence.proxy.async.shared::cta)
    before the barrier after which wgmma reads them;
  * the tiled MMA depends on the product's N and the operands' majors, so each helper builds its own
    (at trace time: they run inside the kernels' bodies); the accumulator's thread layout of m64nNk16
    does not depend on the majors or the operand type;
  * mma_ss is synchronous: wgmma.fence, the k-blocks, commit, wait for all, so its accumulator and its
    operands' buffers are free when it returns (the callers' barriers then order the reuse).

M (the products' rows: the chunk kernels' F = C*R fused rows, the scan's 2 SCAN_BJ) must be 64. Checked
on the CPU only through tests/cute_standin.py (views, orientation) and the compiled PTX (wgmma present,
transpose flags); not yet run on a GPU.

API learned from the installed CuTe DSL package (cutlass/cute/nvgpu/warpgroup/helpers.py and mma.py:
make_smem_layout_atom, MmaF16BF16Op, fence / commit_group / wait_group; cutlass/utils/hopper_helpers.py:
make_trivial_tiled_mma, get_smem_layout_atom; cutlass/cute/arch/nvvm_wrappers.py: fence_proxy) and
this lab's kernels/cute/gemm.py (wgmma path: swizzled get_tensor, fragments, ACCUMULATE). Sizes in bytes.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

F32 = cutlass.Float32
M = 64                 # rows of every wgmma product (one warpgroup)
OPERAND_ALIGN = 1024   # bytes: alignment of an operand buffer (one 128-byte-swizzle period)


def _atom_kind(cols: int, dt):
    wg = cute.nvgpu.warpgroup
    row_bytes = cols * dt.width // 8
    if row_bytes % 128 == 0:
        return wg.SmemLayoutAtomKind.K_SW128
    return {64: wg.SmemLayoutAtomKind.K_SW64, 32: wg.SmemLayoutAtomKind.K_SW32}[row_bytes]


def canonical(rows: int, cols: int, dt):
    """The canonical K-major layout (swizzle o outer) of a [rows, cols] operand buffer."""
    atom = cute.nvgpu.warpgroup.make_smem_layout_atom(_atom_kind(cols, dt), dt)
    return cute.tile_to_shape(atom, (rows, cols), (0, 1))


def operand(buf, st, name: str, rows: int, cols: int, dt, transposed: bool = False):
    """Buffer ``name`` ([rows, cols], input dtype) of the storage ``st`` in its canonical layout: a
    (rows, cols) view, or with ``transposed`` the (cols, rows) view of the same bytes (MN-major)."""
    lay = canonical(rows, cols, dt)
    outer = cute.select(lay.outer, mode=[1, 0]) if transposed else lay.outer
    return cute.make_tensor(cute.recast_ptr(buf.pointer(st, name), lay.inner, dtype=dt), outer)


def publish():
    """Orders this thread's ordinary stores to shared memory before wgmma's (async proxy) reads; call
    before the barrier that precedes the product."""
    cute.arch.fence_proxy("async.shared", space="cta")


def tiled(dt, n: int = M, a_mn_major: bool = False, b_mn_major: bool = False):
    """The tiled MMA of an M x n product (one m64nNk16 atom), accumulating into its C."""
    wg = cute.nvgpu.warpgroup
    major = {False: cute.nvgpu.OperandMajorMode.K, True: cute.nvgpu.OperandMajorMode.MN}
    op = wg.MmaF16BF16Op(dt, F32, (M, n, 16), wg.OperandSource.SMEM, major[a_mn_major], major[b_mn_major])
    tm = cute.make_tiled_mma(op)
    tm.set(wg.Field.ACCUMULATE, True)
    return tm


def _c_tiled(n: int):
    return tiled(cutlass.BFloat16, n)   # the C layout is the same for every operand type and major


def mma_ss(_tiled_mma, tid, acc, sA, sB, a_mn_major: bool, b_mn_major: bool, dt):
    """acc += sA (M x K) . sB (N x K)^T, both operands in shared memory in canonical layouts (``operand``;
    ``a_mn_major`` / ``b_mn_major``: the operand is a transposed view). ``_tiled_mma`` is unused (the
    interface of _warp_mma.mma_ss)."""
    tm = tiled(dt, cute.size(sB, mode=[0]), a_mn_major, b_mn_major)
    thr = tm.get_slice(tid)
    rA = tm.make_fragment_A(thr.partition_A(sA))
    rB = tm.make_fragment_B(thr.partition_B(sB))
    cute.nvgpu.warpgroup.fence()
    for kb in range(cute.size(rA, mode=[2])):   # trace-time loop: helpers are not preprocessed
        cute.gemm(tm, acc, rA[None, None, kb], rB[None, None, kb], acc)
    cute.nvgpu.warpgroup.commit_group()
    cute.nvgpu.warpgroup.wait_group(0)


def partition(_tiled_mma, tid, t):
    """This thread's elements of ``t`` (M x N) in the order of its accumulator of an M x N product."""
    return _c_tiled(cute.size(t, mode=[1])).get_slice(tid).partition_C(t)


def coords(_tiled_mma, tid, rows: int, N: int):
    """The (row, column) of each element of this thread's accumulator of an M x N product."""
    assert rows == M, rows
    return _c_tiled(N).get_slice(tid).partition_C(cute.make_identity_tensor((rows, N)))


def accumulator(_tiled_mma, tid, rows: int, N: int):
    """A zeroed fp32 accumulator of an M x N product."""
    acc = cute.make_rmem_tensor(coords(_tiled_mma, tid, rows, N).shape, F32)
    acc.fill(0.0)
    return acc


def to_smem(_tiled_mma, tid, acc, s):
    """Accumulator -> the fp32 shared tile ``s`` of its shape."""
    part = partition(_tiled_mma, tid, s)
    for e in range(cute.size(acc)):
        part[e] = acc[e]


def from_smem(_tiled_mma, tid, acc, s):
    """The fp32 shared tile ``s`` -> accumulator."""
    part = partition(_tiled_mma, tid, s)
    for e in range(cute.size(acc)):
        acc[e] = part[e]
