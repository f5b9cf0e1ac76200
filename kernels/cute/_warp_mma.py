"""Warp-level MMA from shared memory for the CuTe DSL bwd_bwd kernels (kernels/cute/_bwd_bwd_scan.py,
_bwd_bwd_chunk.py): mma.sync m16n8k16 on 2 x 2 warps (128 threads), bf16 / fp16 operands loaded by
ldmatrix, fp32 accumulators, and the moves of an accumulator to and from an fp32 shared tile.

These run at trace time inside the kernels (plain Python loops over static sizes; the DSL preprocesses
only @cute.jit / @cute.kernel bodies). tests/cute_standin.py gives their meaning on the CPU:
mma_ss is acc += A B^T over the operands' views, whatever their order in memory.

API learned from this lab's kernels/cute/gemm.py (mma_sync path: TiledMma, LdMatrix partitions).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

F32 = cutlass.Float32


def mma_ss(tiled_mma, tid, acc, sA, sB, a_mn_major: bool, b_mn_major: bool, dt):
    """acc += sA (M x K) . sB (N x K)^T, both operands in shared memory (ldmatrix, transposed for an
    operand stored M- / N-major)."""
    thr = tiled_mma.get_slice(tid)
    rA = tiled_mma.make_fragment_A(thr.partition_A(sA))
    rB = tiled_mma.make_fragment_B(thr.partition_B(sB))
    ld_a = cute.make_tiled_copy_A(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(a_mn_major, 4), dt),
                                  tiled_mma)
    ld_b = cute.make_tiled_copy_B(cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(b_mn_major, 4), dt),
                                  tiled_mma)
    ta, tb = ld_a.get_slice(tid), ld_b.get_slice(tid)
    sa, ra, sb, rb = ta.partition_S(sA), ta.retile(rA), tb.partition_S(sB), tb.retile(rB)
    for kb in range(cute.size(rA, mode=[2])):   # trace-time loops: helpers are not preprocessed
        cute.copy(ld_a, sa[None, None, kb], ra[None, None, kb])
        cute.copy(ld_b, sb[None, None, kb], rb[None, None, kb])
        cute.gemm(tiled_mma, acc, rA[None, None, kb], rB[None, None, kb], acc)


def accumulator(tiled_mma, tid, M: int, N: int):
    """A zeroed fp32 accumulator of an M x N product."""
    acc = cute.make_rmem_tensor(coords(tiled_mma, tid, M, N).shape, F32)
    acc.fill(0.0)
    return acc


def coords(tiled_mma, tid, M: int, N: int):
    """The (row, column) of each element of this thread's accumulator of an M x N product."""
    return tiled_mma.get_slice(tid).partition_C(cute.make_identity_tensor((M, N)))


def to_smem(tiled_mma, tid, acc, s):
    """Accumulator -> the fp32 shared tile ``s`` of its shape."""
    part = tiled_mma.get_slice(tid).partition_C(s)
    for e in range(cute.size(acc)):
        part[e] = acc[e]


def from_smem(tiled_mma, tid, acc, s):
    """The fp32 shared tile ``s`` -> accumulator."""
    part = tiled_mma.get_slice(tid).partition_C(s)
    for e in range(cute.size(acc)):
        acc[e] = part[e]


def operand(buf, st, name: str, rows: int, cols: int, dt, transposed: bool = False):
    """Buffer ``name`` ([rows, cols], row-major) of the storage ``st``: a (rows, cols) view, or with
    ``transposed`` the (cols, rows) view of the same elements (read M- / N-major by ldmatrix.trans)."""
    return buf.tensor(st, name, col_major(cols, rows) if transposed else row_major(rows, cols))


def publish():
    """Nothing to order: ldmatrix reads shared memory through the generic proxy, after the barrier."""


def partition(tiled_mma, tid, t):
    """This thread's elements of ``t`` (M x N) in the order of its accumulator of an M x N product."""
    return tiled_mma.get_slice(tid).partition_C(t)


def row_major(rows: int, cols: int):
    return cute.make_layout((rows, cols), stride=(cols, 1))


def col_major(rows: int, cols: int):
    """(rows, cols) over a row-major [cols, rows] buffer: the transposed view."""
    return cute.make_layout((rows, cols), stride=(1, rows))


def tiled(dt):
    op = cute.nvgpu.warp.MmaF16BF16Op(dt, F32, (16, 8, 16))
    return cute.make_tiled_mma(op, cute.make_layout((2, 2, 1)), permutation_mnk=(32, 32, 16))
