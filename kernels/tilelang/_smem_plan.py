"""Shared memory of a TileLang kernel before compiling it, and a check of what the compiler made of it.

``planned_bytes`` replays TileLang 0.1.15's shared-memory planner (src/transform/
merge_shared_memory_allocations.cc in the installed package: ``SharedMemLinearAccessPatternFinder``,
the kill-point move and ``LinearScanPack``) on the kernel's own front-end program: one statement per
buffer store or tile operation in program order (the granularity of tl.enable_aggressive_shared_
memory_merge), or per top-level statement of the kernel body without it; first and last touch give
each buffer's lifetime; buffers are packed best-fit in order of first touch, larger first, then by
name. On sm_90 every buffer a T.gemm reads from shared memory is 1024-byte aligned (wgmma
descriptors), elsewhere buffers are 16-byte aligned. No lowering and no nvcc: building the program
takes ~0.2 s, the replay a few ms. Its figure is tested equal to the compiler's (tests/).

``alias_hazards`` reads the compiled layout: a statement that reads one shared buffer and writes
another is split by the lowering into sub-statements (and loop iterations), and the planner lets the
written buffer take the bytes of a read one whose last read comes first in that split, although a
later iteration of the same loop still reads it. Such a layout computes garbage (the TileLang
mamba_bwd_bwd scan at scan_stages = 0, 2026-11-24). A hazard found here refuses the config.
All sizes are bytes.
"""
from __future__ import annotations

import re

import tilelang  # noqa: F401  (loads the bundled tvm)
from tvm import tirx

_GEMM_ALIGN_SM90 = 1024
_ALIGN = 16


def shared_buffers(program) -> dict[str, int]:
    """name -> bytes of every shared buffer the program allocates (one pipeline stage)."""
    sizes: dict[str, int] = {}

    def visit(node):
        if type(node).__name__ == "SBlock":
            for b in node.alloc_buffers:
                if b.scope().startswith("shared"):
                    n = 1
                    for x in b.shape:
                        n *= int(x)
                    sizes[b.name] = n * b.dtype.bits // 8
    tirx.stmt_functor.post_order_visit(program.body, visit)
    return sizes


def _touched(node, names: set) -> list[str]:
    out: list[str] = []

    def visit(n):
        if type(n).__name__ in ("BufferLoad", "BufferStore") and n.buffer.name in names and n.buffer.name not in out:
            out.append(n.buffer.name)
    tirx.stmt_functor.post_order_visit(node, visit)
    return out


def _region_buffers(call) -> list[tuple[str, int]]:
    """(buffer, access mask: 1 read, 2 write, 3 both) of a tile operation's T.region arguments."""
    found = []
    for a in call.args:
        if type(a).__name__ == "Call" and getattr(a.op, "name", "") == "tl.region" and \
                type(a.args[0]).__name__ == "BufferLoad":
            found.append((a.args[0].buffer.name, int(a.args[1])))
    return found


def _wgmma_rows(gemm_call) -> bool:
    """Whether TileLang lowers this T.gemm to wgmma on sm_90: the accumulator has a multiple of 64 rows
    (smaller products take mma.sync, whose operands need no 1024-byte alignment)."""
    acc = [a for a in gemm_call.args if type(a).__name__ == "Call" and getattr(a.op, "name", "") == "tl.region"][2]
    return int(acc.args[2]) % 64 == 0


def _contains_seq(stmt) -> bool:
    kind = type(stmt).__name__
    if kind == "SeqStmt":
        return True
    if kind == "IfThenElse":
        return _contains_seq(stmt.then_case) or (stmt.else_case is not None and _contains_seq(stmt.else_case))
    return False


def _kernel_body(program):
    """The statements inside the thread-extent scope (where the shared buffers are allocated)."""
    node = program.body
    while True:
        kind = type(node).__name__
        if kind == "SBlockRealize":
            node = node.block
        elif kind == "SBlock":
            if any(b.scope().startswith("shared") for b in node.alloc_buffers):
                return node.body
            node = node.body
        elif kind in ("AttrStmt", "LetStmt", "For"):        # For: the blockIdx bindings
            node = node.body
        elif kind == "SeqStmt":                             # the threadIdx binds, then the block
            node = node.seq[-1]
        else:
            return node


def _workspace_name(i: int) -> str:
    return "workspace" + (f"_{i}" if i else "")


def _statements(program, names: set, aggressive: bool) -> tuple[list[tuple[int, list[str]]], set[str]]:
    """[(scope level, buffers touched)] in program order, and the buffers T.gemm reads. Each T.reduce
    also touches the workspace its lowering adds (named as TileLang names them)."""
    seq: list[tuple[int, list[str]]] = []
    gemm_operands: set[str] = set()
    reduces = [0]

    def is_reduce(stmt) -> bool:
        return getattr(getattr(stmt.value, "op", None), "name", "") == "tl.tileop.reduce"

    def add_workspace(touched):
        touched.append(_workspace_name(reduces[0]))
        reduces[0] += 1

    def note_gemm(stmt):
        call = stmt.value
        if type(call).__name__ == "Call" and "gemm" in getattr(call.op, "name", "") and _wgmma_rows(call):
            gemm_operands.update(n for n, mode in _region_buffers(call)[:2])

    def walk(stmt, level):
        kind = type(stmt).__name__
        if kind == "SeqStmt":
            for s in stmt.seq:
                walk(s, level)
        elif kind == "SBlockRealize":
            walk(stmt.block, level)
        elif kind in ("SBlock", "AttrStmt", "LetStmt"):
            walk(stmt.body, level)
        elif kind == "For":
            walk(stmt.body, level + _contains_seq(stmt.body))
        elif kind == "IfThenElse":
            walk(stmt.then_case, level)
            if stmt.else_case is not None:
                walk(stmt.else_case, level)
        else:
            if kind == "Evaluate":
                note_gemm(stmt)
            touched = _touched(stmt, names)
            if kind == "Evaluate" and is_reduce(stmt):
                add_workspace(touched)
            if touched:
                seq.append((level, touched))

    body = _kernel_body(program)
    top = body.seq if type(body).__name__ == "SeqStmt" else [body]
    for stmt in top:
        if aggressive:
            walk(stmt, 0)
        else:
            evaluates = []
            tirx.stmt_functor.post_order_visit(
                stmt, lambda n: evaluates.append(n) if type(n).__name__ == "Evaluate" else None)
            touched = _touched(stmt, names)
            for e in evaluates:
                note_gemm(e)
                if is_reduce(e):
                    add_workspace(touched)
            if touched:
                seq.append((0, touched))
    return seq, gemm_operands


def _lifetimes(seq: list[tuple[int, list[str]]]) -> dict[str, tuple[float, int]]:
    """name -> (first statement, one past the last) after the planner's kill-point move: a buffer
    last touched deeper than where it was first touched dies at the last statement with an event
    before the sequence returns to the first touch's level."""
    gen: dict[str, int] = {}
    kill: dict[str, int] = {}
    for i, (_, touched) in enumerate(seq):
        for n in touched:
            gen.setdefault(n, i)
            kill[n] = i
    events = sorted(set(gen.values()) | set(kill.values()))
    out = {}
    for n, g in gen.items():
        k, level = kill[n], seq[g][0]
        if seq[k][0] > level:
            pos = events.index(k)
            for j in range(pos, len(events)):
                if j + 1 == len(events) or seq[events[j + 1]][0] == level:
                    k = events[j]
                    break
        out[n] = (g, max(k + 1, g + 1))
    return out


def _align(v: int, a: int) -> int:
    return (v + a - 1) // a * a


class _FreeList:
    def __init__(self):
        self.blocks: list[list[int]] = []          # [offset, size], sorted, coalesced

    def free(self, off: int, size: int):
        if size == 0:
            return
        self.blocks.append([off, size])
        self.blocks.sort()
        i = 0
        while i < len(self.blocks) - 1:
            a, b = self.blocks[i], self.blocks[i + 1]
            if a[0] + a[1] >= b[0]:
                a[1] = max(a[0] + a[1], b[0] + b[1]) - a[0]
                del self.blocks[i + 1]
            else:
                i += 1

    def best_fit(self, need: int, align: int) -> int | None:
        best, waste = -1, None
        for i, (off, size) in enumerate(self.blocks):
            head = _align(off, align) - off
            if head > size or size - head < need:
                continue
            if waste is None or size - need < waste:
                best, waste = i, size - need
        if best < 0:
            return None
        off, size = self.blocks.pop(best)
        at = _align(off, align)
        self.free(at + need, size - (at - off) - need)
        self.free(off, at - off)
        return at

    def from_tail(self, align: int, top: int) -> int | None:
        if not self.blocks or sum(self.blocks[-1]) != top or _align(self.blocks[-1][0], align) >= top:
            return None
        off, _ = self.blocks.pop()
        at = _align(off, align)
        self.free(off, at - off)
        return at


def pack(lifetimes: dict[str, tuple[float, int]], sizes: dict[str, int], align: dict[str, int]) -> tuple[int, dict]:
    """LinearScanPack: (arena bytes, name -> offset)."""
    order = sorted(lifetimes, key=lambda n: (lifetimes[n][0], -sizes[n], n))
    free, active, top, offsets = _FreeList(), [], 0, {}
    for n in order:
        start, end = lifetimes[n]
        active.sort()
        while active and active[0][0] <= start:
            _, off, size = active.pop(0)
            free.free(off, size)
        a, size = align[n], sizes[n]
        off = free.best_fit(size, a)
        if off is None:
            off = free.from_tail(a, top)
            if off is not None:
                top = off + size
        if off is None:
            off = _align(top, a)
            free.free(top, off - top)
            top = off + size
        active.append((end, off, size))
        offsets[n] = off
    return top, offsets


def planned_bytes(program, target: str, aggressive: bool, stages: dict[str, int] | None = None,
                  workspaces: tuple[str, list[int]] | None = None, reduce_workspace: int = 0) -> int:
    """The dynamic shared memory TileLang will give ``program`` for ``target``, bytes.

    ``stages``: buffers a software pipeline (T.Pipelined, num_stages > 0) keeps that many copies of,
    in the order its prologue first touches them (before the loop's other buffers).
    ``workspaces``: (a buffer they live with, their sizes): the buffers TileLang's lowering adds for
    cross-warp reductions, which the front-end program does not show (named workspace,
    workspace_1, ... as TileLang names them).
    ``reduce_workspace``: the bytes of the workspace each T.reduce adds (one fp32 per thread of the
    CTA), live at that statement only; 0: not counted (``workspaces`` places them instead)."""
    sizes = shared_buffers(program)
    for n, k in (stages or {}).items():
        sizes[n] *= k
    seq, gemm_operands = _statements(program, set(sizes), aggressive)
    if not reduce_workspace:
        seq = [(level, [n for n in touched if n in sizes]) for level, touched in seq]
        seq = [(level, touched) for level, touched in seq if touched]
    for _, touched in seq:
        for n in touched:
            sizes.setdefault(n, reduce_workspace)
    lifetimes = _lifetimes(seq)
    piped = [n for n, k in (stages or {}).items() if k > 1 and n in lifetimes]
    for i, n in enumerate(piped):              # between the statement before the loop and the loop
        start, end = lifetimes[n]
        lifetimes[n] = (start - 1 + (i + 1) / (len(piped) + 1), end)
    if workspaces:
        like, extra = workspaces
        for i, size in enumerate(extra):
            name = "workspace" + (f"_{i}" if i else "")
            sizes[name], lifetimes[name] = size, lifetimes[like]
    sm90 = target.startswith("sm_90")
    align = {n: _GEMM_ALIGN_SM90 if sm90 and n in gemm_operands else _ALIGN for n in sizes}
    return pack(lifetimes, {n: sizes[n] for n in lifetimes}, align)[0]


# ------------------------------------------------------------------------------------------------
# the compiled layout


def compiled_offsets(source: str) -> dict[str, int]:
    """name -> byte offset of each shared buffer in TileLang's generated CUDA."""
    return {n: int(o) for n, o in re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)",
                                             source)}


def _loop_statements(program, names: set) -> list[tuple[set, set]]:
    """(read, written) shared buffers of each front-end statement: a T.Parallel nest, a tile
    operation, a plain store."""
    out = []

    def rw(stmt):
        reads, writes = set(), set()

        def visit(n):
            kind = type(n).__name__
            if kind == "BufferLoad" and n.buffer.name in names:
                reads.add(n.buffer.name)
            elif kind == "BufferStore" and n.buffer.name in names:
                writes.add(n.buffer.name)
            elif kind == "Call" and getattr(n.op, "name", "").startswith("tl.tileop"):
                for name, mode in _region_buffers(n):
                    if name in names:
                        (reads if mode & 1 else set()).add(name)
                        (writes if mode & 2 else set()).add(name)
        tirx.stmt_functor.post_order_visit(stmt, visit)
        return reads, writes

    def walk(stmt):
        kind = type(stmt).__name__
        if kind == "SeqStmt":
            for s in stmt.seq:
                walk(s)
        elif kind == "SBlockRealize":
            walk(stmt.block)
        elif kind in ("SBlock", "AttrStmt", "LetStmt"):
            walk(stmt.body)
        elif kind == "For" and int(stmt.kind) != 1:        # serial / pipelined loops: look inside
            walk(stmt.body)
        elif kind == "IfThenElse":
            walk(stmt.then_case)
            if stmt.else_case is not None:
                walk(stmt.else_case)
        else:
            reads, writes = rw(stmt)
            if reads and writes:
                out.append((reads, writes))
    walk(program.body)
    return out


def alias_hazards(program, source: str) -> list[tuple[str, str]]:
    """(written, read) pairs of shared buffers that one statement of ``program`` touches and the
    compiled ``source`` places on overlapping bytes."""
    sizes = shared_buffers(program)
    offsets = compiled_offsets(source)
    found = []
    for reads, writes in _loop_statements(program, set(sizes)):
        for w in sorted(writes):
            for r in sorted(reads - {w}):
                if w in offsets and r in offsets and \
                        offsets[w] < offsets[r] + sizes[r] and offsets[r] < offsets[w] + sizes[w]:
                    found.append((w, r))
    return found
