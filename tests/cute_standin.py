"""A CPU stand-in for the part of CuTe DSL the CuTe bwd_bwd kernels use (kernels/cute/_bwd_bwd_scan.py,
_bwd_bwd_chunk.py, _warp_mma.py, _wgmma.py): their own Python kernel bodies run on CPU tensors, 128 Python threads
per CTA (a barrier for sync_threads, a per-warp exchange for shuffles), one CTA after another, so the
tests check the kernels' index arithmetic, views, operand orientation, barriers and launch schedule
against the problem's reference. Not checked here: the DSL's lowering (ldmatrix, fragment ownership,
registers), which only the GPU shows.

Semantics: a tensor is a pointer (a flat torch tensor, held as a Python list while the kernels run and
copied back after each launch, and an element offset) with a layout (shape and stride, modes nested;
an integer index into a nested mode is split colexicographically, as in CuTe); an element outside the
flat tensor raises. Values are Python floats wrapped to carry ``.to(dtype)`` (bf16 / fp16 round to
nearest even, as on the GPU); arithmetic is fp64, and a store rounds to the tensor's type (fp32, bf16,
fp16). ``mma_ss`` is acc += A B^T over the two operand views, exact, after checking the tiled MMA's
granularity (M, N multiples of 32, K of 16); a thread's accumulator holds the elements
k = e * 128 + tid of the M x N product in row-major order (any one-to-one assignment would do: the
kernels only pair an accumulator with partitions of the same shape). _wgmma (PATH="wgmma") is the same
product for M = 64 rows over the same views (its swizzled layouts only place the views' elements
elsewhere in memory); its fences and waits are no-ops here. Shared memory starts as NaN, and
so do the lane's workspaces, so a read of an element nothing wrote shows up; a view larger than its
buffer raises.

Usage (tests/test_cute_mamba.py): ``run_lane(config, shape, inputs, outputs)``.
"""
from __future__ import annotations

import math
import struct as _bits
import sys
import threading
import types
from pathlib import Path

import torch

THREADS = 128
WAIT_S = 120  # a barrier that waits longer: a deadlock (a thread skipped a barrier the others reached)
_local = threading.local()
_block = types.SimpleNamespace(ctx=None)


# --------------------------------------------------------------------------------------------
# values and types


def _f(x) -> float:
    return x.v if isinstance(x, Val) else float(x)


class Val:
    """A scalar of a kernel: a float, with ``.to(dtype)`` and arithmetic."""
    __slots__ = ("v",)

    def __init__(self, v):
        self.v = float(v)

    def to(self, dtype):
        return Val(dtype.round(self.v))

    def __add__(self, o):
        return Val(self.v + _f(o))

    __radd__ = __add__

    def __sub__(self, o):
        return Val(self.v - _f(o))

    def __rsub__(self, o):
        return Val(_f(o) - self.v)

    def __mul__(self, o):
        return Val(self.v * _f(o))

    __rmul__ = __mul__

    def __truediv__(self, o):
        return Val(self.v / _f(o))

    def __rtruediv__(self, o):
        return Val(_f(o) / self.v)

    def __neg__(self):
        return Val(-self.v)

    def __float__(self):
        return self.v


class DType:
    def __init__(self, name: str, torch_dtype):
        self.__name__, self.torch = name, torch_dtype

    def __call__(self, x):
        return Val(_f(x))

    def round(self, v: float) -> float:
        """v converted to this type (round to nearest even), back as a float; fp32 math stays fp64."""
        if self.torch == torch.float32 or math.isnan(v) or math.isinf(v):
            return v
        if self.torch == torch.float16:
            try:
                return _bits.unpack("<e", _bits.pack("<e", v))[0]
            except OverflowError:
                return math.copysign(math.inf, v)
        try:
            bits = _bits.unpack("<I", _bits.pack("<f", v))[0]
        except OverflowError:
            return math.copysign(math.inf, v)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return _bits.unpack("<f", _bits.pack("<I", bits & 0xFFFFFFFF))[0]


F32, BF16, F16 = DType("Float32", torch.float32), DType("BFloat16", torch.bfloat16), DType("Float16", torch.float16)


def _exp(x):
    try:
        return Val(math.exp(_f(x)))
    except OverflowError:
        return Val(math.inf)


# --------------------------------------------------------------------------------------------
# layouts and tensors


def _size(shape) -> int:
    return math.prod(_size(s) for s in shape) if isinstance(shape, tuple) else shape


def _offset(c, shape, stride) -> int:
    if not isinstance(shape, tuple):
        return int(c) * stride
    if isinstance(c, tuple):
        return sum(_offset(ci, s, t) for ci, s, t in zip(c, shape, stride, strict=True))
    off, c = 0, int(c)
    for s, t in zip(shape, stride, strict=True):
        off += _offset(c % _size(s), s, t)
        c //= _size(s)
    return off


def _cosize(shape, stride) -> int:
    if not isinstance(shape, tuple):
        return (shape - 1) * stride
    return sum(_cosize(s, t) for s, t in zip(shape, stride, strict=True))


def _compact(shape) -> tuple:
    """Colexicographic (column-major) strides of a flat shape."""
    out, acc = [], 1
    for s in shape:
        out.append(acc)
        acc *= s
    return tuple(out)


class Layout:
    def __init__(self, shape, stride):
        self.shape = shape if isinstance(shape, tuple) else (shape,)
        self.stride = stride if isinstance(stride, tuple) else (stride,)
        self.flat = not any(isinstance(x, tuple) for x in self.shape)

    def offset(self, coord) -> int:
        coord = coord if isinstance(coord, tuple) else (coord,)
        if self.flat:
            return sum(int(c) * t for c, t in zip(coord, self.stride, strict=True))
        return _offset(coord, self.shape, self.stride)

    def cosize(self) -> int:
        return _cosize(self.shape, self.stride) + 1


class _Memory:
    """A flat torch tensor's values as a Python list, where the kernels read and write them (rounded to
    the tensor's type as it would store them); ``flush`` copies them back into the tensor."""
    _ROUND = {torch.bfloat16: lambda v: BF16.round(v), torch.float16: lambda v: F16.round(v),
              torch.float32: lambda v: _bits.unpack("<f", _bits.pack("<f", v))[0] if math.isfinite(v) else v}

    def __init__(self, flat: torch.Tensor):
        self.flat, self.vals, self.round, self.written = flat, flat.tolist(), self._ROUND[flat.dtype], False

    def numel(self) -> int:
        return len(self.vals)

    def write(self, i: int, v: float):
        self.vals[i] = self.round(v)
        self.written = True

    def tensor(self) -> torch.Tensor:
        return torch.tensor(self.vals, dtype=self.flat.dtype)

    def flush(self):
        if self.written:
            self.flat.copy_(self.tensor())


class Ptr:
    def __init__(self, flat, offset: int = 0):
        self.mem = flat if isinstance(flat, _Memory) else _Memory(flat)
        self.offset = offset

    def __add__(self, n):
        return Ptr(self.mem, self.offset + int(n))


class Tensor:
    def __init__(self, ptr: Ptr, layout: Layout):
        self.iterator, self.layout = ptr, layout

    def _at(self, coord) -> int:
        i = self.iterator.offset + self.layout.offset(coord)
        if not 0 <= i < self.iterator.mem.numel():
            raise IndexError(f"element {coord} at {i}: outside its buffer of {self.iterator.mem.numel()}")
        return i

    def __getitem__(self, coord):
        return Val(self.iterator.mem.vals[self._at(coord)])

    def __setitem__(self, coord, v):
        self.iterator.mem.write(self._at(coord), _f(v))

    def modes(self) -> tuple:
        return tuple(_size(s) for s in self.layout.shape)

    def matrix(self) -> torch.Tensor:
        """A 2-D view with flat modes as an fp64 matrix (an MMA operand)."""
        (m, k), (sm, sk) = self.layout.shape, self.layout.stride
        assert isinstance(m, int) and isinstance(k, int), self.layout.shape
        self._at((m - 1, k - 1))
        return torch.as_strided(self.iterator.mem.tensor(), (m, k), (sm, sk), self.iterator.offset).to(torch.float64)


class Identity:
    def __init__(self, shape):
        self.shape = shape

    def __getitem__(self, coord):
        return coord

    def modes(self) -> tuple:
        return tuple(_size(s) for s in self.shape)


class Part:
    """Thread ``tid``'s elements of an M x N tensor (or identity): element e is k = e * 128 + tid, row-major."""

    def __init__(self, target, tid: int):
        (self.M, self.N), self.target, self.tid = target.modes(), target, tid
        assert self.M * self.N % THREADS == 0, (self.M, self.N)
        self.shape = (self.M * self.N // THREADS, self.M, self.N)

    def coord(self, e: int) -> tuple:
        return divmod(e * THREADS + self.tid, self.N)

    def __getitem__(self, e):
        return self.target[self.coord(e)]

    def __setitem__(self, e, v):
        self.target[self.coord(e)] = v


class Frag:
    """A thread's accumulator (registers)."""

    def __init__(self, shape, dtype):
        self.count, self.M, self.N = shape
        self.vals = [Val(math.nan)] * self.count

    def fill(self, v):
        self.vals = [Val(_f(v))] * self.count

    def __getitem__(self, e):
        return self.vals[e]

    def __setitem__(self, e, v):
        self.vals[e] = v if isinstance(v, Val) else Val(v)

    def load(self):
        return _Loaded(self.vals)

    def store(self, vals):
        self.vals = list(vals)


class _Loaded(list):
    def __mul__(self, o):
        return _Loaded(v * o for v in self)


class TiledMma:
    def get_slice(self, tid):
        return types.SimpleNamespace(partition_C=lambda t: Part(t, int(tid)))

    def set(self, field, value):   # wgmma's ACCUMULATE: mma_ss always accumulates
        pass


def mma_ss(tiled_mma, tid, acc, sA, sB, a_mn_major, b_mn_major, dt):
    """acc += A B^T (exact) over the operand views A (M x K) and B (N x K). The product is formed once
    per CTA: by the first thread at its k-th call since its last barrier, for every thread's k-th call."""
    ctx = _block.ctx
    key = (_local.phase, _local.calls)
    _local.calls += 1
    with ctx.lock:
        prod = ctx.products.get(key)
        if prod is None:
            a, b = sA.matrix(), sB.matrix()
            (M, K), (N, K2) = a.shape, b.shape
            assert K == K2 and (M, N) == (acc.M, acc.N), (a.shape, b.shape, acc.M, acc.N)
            assert M % 32 == 0 and N % 32 == 0 and K % 16 == 0, (M, N, K)   # 2 x 2 warps of m16n8k16
            prod = ctx.products[key] = (N, (a @ b.T).flatten().tolist())
    N, flat = prod
    for e in range(acc.count):
        acc[e] = acc[e] + flat[e * THREADS + int(tid)]


def wgmma_ss(tiled_mma, tid, acc, sA, sB, a_mn_major, b_mn_major, dt):
    """_wgmma.mma_ss: mma_ss for one warpgroup, whose products have M = 64 rows."""
    assert sA.modes()[0] == 64, sA.modes()
    mma_ss(tiled_mma, tid, acc, sA, sB, a_mn_major, b_mn_major, dt)


def _cute_size(x, mode=None):
    """cute.size of an accumulator, or of one mode of a tensor."""
    return x.count if mode is None else x.modes()[mode[0]]


# --------------------------------------------------------------------------------------------
# shared memory, threads, launches


class _Spec:
    def __init__(self, dtype, count):
        self.dtype, self.count = dtype, count


class _Subscript:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, item):
        return self.fn(*item)


def struct(cls):
    """cute.struct: the fields' (type, count), annotations evaluated where the class was written."""
    frame = sys._getframe(1)
    fields = {}
    for name, spec in cls.__annotations__.items():
        if isinstance(spec, str):
            spec = eval(spec, frame.f_globals, frame.f_locals)  # noqa: S307 - the kernel module's own text
        fields[name] = spec
    cls._fields = fields
    return cls


struct.Align = _Subscript(lambda spec, align: spec)
struct.MemRange = _Subscript(lambda dtype, count: _Spec(dtype, count))


class _Buffer:
    def __init__(self, spec: _Spec):
        self.mem = _Memory(torch.full((spec.count,), math.nan, dtype=spec.dtype.torch))

    def data_ptr(self) -> Ptr:
        return Ptr(self.mem)

    def get_tensor(self, layout: Layout):
        if layout.cosize() > self.mem.numel():
            raise IndexError(f"a view of {layout.cosize()} elements on a buffer of {self.mem.numel()}")
        return Tensor(Ptr(self.mem), layout)


class SmemAllocator:
    def allocate(self, cls):
        ctx = _block.ctx
        with ctx.lock:
            if cls not in ctx.smem:
                ctx.smem[cls] = types.SimpleNamespace(**{n: _Buffer(s) for n, s in cls._fields.items()})
            return ctx.smem[cls]


def _sync():
    _block.ctx.barrier.wait(WAIT_S)
    _local.phase, _local.calls = _local.phase + 1, 0


def _shuffle_bfly(x, offset, mask=0xFFFFFFFF, mask_and_clamp=31):
    """One warp barrier per shuffle: slots alternate between calls, and no lane can write a slot again
    before every lane has read it (that write comes after the next call's barrier)."""
    ctx, tid = _block.ctx, _local.tid
    warp, lane = divmod(tid, 32)
    k = _local.shuffles = getattr(_local, "shuffles", 0) + 1
    slots = ctx.slots[warp][k % 2]
    slots[lane] = x
    ctx.warp_barriers[warp].wait(WAIT_S)
    return slots[lane ^ int(offset)]


class _Launch:
    def __init__(self, fn, obj, args):
        self.fn, self.obj, self.args = fn, obj, args

    def launch(self, grid, block, stream=None, **kw):
        assert list(block) == [THREADS, 1, 1], block
        grid = tuple(grid) + (1,) * (3 - len(grid))
        for bz in range(grid[2]):
            for by in range(grid[1]):
                for bx in range(grid[0]):
                    self._run_block((bx, by, bz))

    def _run_block(self, idx):
        ctx = types.SimpleNamespace(block=idx, lock=threading.Lock(), smem={}, barrier=threading.Barrier(THREADS),
                                    warp_barriers=[threading.Barrier(32) for _ in range(THREADS // 32)],
                                    slots=[[[None] * 32, [None] * 32] for _ in range(THREADS // 32)], errors=[],
                                    products={})
        _block.ctx = ctx

        def body(tid):
            _local.tid, _local.shuffles, _local.phase, _local.calls = tid, 0, 0, 0
            try:
                self.fn(self.obj, *self.args)
            except BaseException as exc:  # noqa: BLE001 - reported below, the other threads released
                ctx.errors.append((tid, exc))
                ctx.barrier.abort()
                for bar in ctx.warp_barriers:
                    bar.abort()
        threads = [threading.Thread(target=body, args=(t,), daemon=True) for t in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = [e for e in ctx.errors if not isinstance(e[1], threading.BrokenBarrierError)] or ctx.errors
        if first:
            tid, exc = first[0]
            raise RuntimeError(f"CTA {idx}, thread {tid}: {type(exc).__name__}: {exc}") from exc


class _KernelFn:
    """@cute.kernel: ``obj.kernel(*args).launch(grid=..., block=...)`` runs every CTA of the grid."""

    def __init__(self, fn):
        self.fn = fn

    def __get__(self, obj, cls):
        return lambda *args: _Launch(self.fn, obj, args)


_WARPGROUP = types.SimpleNamespace(   # what _wgmma.tiled names; its operands' majors are the views'
    MmaF16BF16Op=lambda *a: None, OperandSource=types.SimpleNamespace(SMEM="smem"),
    Field=types.SimpleNamespace(ACCUMULATE="accumulate"))


def fake_modules():
    """(cutlass, cute, cuda) namespaces with what the kernels use."""
    cutlass = types.SimpleNamespace(
        Float32=F32, BFloat16=BF16, Float16=F16, const_expr=lambda x: x,
        range=lambda *a, unroll=None, unroll_full=None: range(*(int(x) for x in a)),
        range_constexpr=lambda *a: range(*a), memory=types.SimpleNamespace(SmemAllocator=SmemAllocator))
    cute = types.SimpleNamespace(
        jit=lambda fn: fn, kernel=_KernelFn, struct=struct,
        make_layout=lambda shape, stride=None: Layout(shape, stride if stride is not None else _compact(shape)),
        make_tensor=lambda p, layout: Tensor(p, layout),
        make_identity_tensor=Identity, make_rmem_tensor=Frag, cosize=lambda layout: layout.cosize(),
        size=_cute_size, make_tiled_mma=lambda *a, **k: TiledMma(),
        nvgpu=types.SimpleNamespace(warp=types.SimpleNamespace(MmaF16BF16Op=lambda *a: None), warpgroup=_WARPGROUP,
                                    OperandMajorMode=types.SimpleNamespace(K="k", MN="mn")),
        math=types.SimpleNamespace(exp=_exp, cos=lambda x: Val(math.cos(_f(x))), sin=lambda x: Val(math.sin(_f(x)))),
        arch=types.SimpleNamespace(thread_idx=lambda: (_local.tid, 0, 0), block_idx=lambda: _block.ctx.block,
                                   sync_threads=_sync, shuffle_sync_bfly=_shuffle_bfly,
                                   fence_proxy=lambda *a, **k: None))   # one memory, one proxy
    cuda = types.SimpleNamespace(CUstream=object)
    return cutlass, cute, cuda


_IMPORTS = ("import cuda.bindings.driver as cuda\n", "import cutlass\n", "import cutlass.cute as cute\n",
            "from kernels.cute import _warp_mma as wm\n", "from kernels.cute import _wgmma as wg\n",
            "from kernels.cute import _bwd_bwd_chunk as chunk\n")


def _emulate(path: Path, names: dict) -> dict:
    src = path.read_text()
    for line in _IMPORTS:
        src = src.replace(line, "")
    ns = {"__name__": f"_standin_{path.stem}", **names}
    exec(compile(src, str(path), "exec"), ns)  # noqa: S102 - the lab's own kernel module
    return ns


def emulated() -> dict:
    """The scan and chunk modules executed on the stand-in: {"scan": namespace, "chunk": namespace}."""
    folder = Path(__file__).resolve().parent.parent / "kernels" / "cute"
    cutlass, cute, cuda = fake_modules()
    names = {"cutlass": cutlass, "cute": cute, "cuda": cuda}
    wm = types.SimpleNamespace(**{k: v for k, v in _emulate(folder / "_warp_mma.py", names).items()
                                  if not k.startswith("__")})
    wm.mma_ss = mma_ss
    names["wm"] = wm
    # _wgmma: its accumulator helpers as written; its operand views are _warp_mma's (the canonical layouts'
    # swizzle only permutes bytes in memory: the stand-in checks the views' coordinates, not the bytes).
    wg = types.SimpleNamespace(**{k: v for k, v in _emulate(folder / "_wgmma.py", names).items()
                                  if not k.startswith("__")})
    wg.mma_ss, wg.operand = wgmma_ss, lambda *a, **k: wm.operand(*a, **k)
    names["wg"] = wg
    chunk = _emulate(folder / "_bwd_bwd_chunk.py", names)
    names["chunk"] = types.SimpleNamespace(**{k: v for k, v in chunk.items() if not k.startswith("__")})
    return {"scan": _emulate(folder / "_bwd_bwd_scan.py", names), "chunk": chunk}


def run_lane(config: dict, shape: dict, inputs: dict, outputs: dict, modules: dict | None = None) -> list[str]:
    """The CuTe bwd_bwd lane's kernels on the stand-in, in the lane's order, with its own argument
    lists (kernels/cute/mamba_bwd_bwd.py: workspace, arguments); workspaces start as NaN. Returns the
    kernels launched."""
    from kernels.cute import mamba_bwd_bwd as lane
    config = {**lane.DEFAULTS, **config}
    m = modules or emulated()
    work = {k: v.fill_(math.nan) for k, v in lane.workspace(config, shape, inputs["Q"].dtype, "cpu").items()}
    programs = {"prep": m["scan"]["Prep"](config, shape), "scan": m["scan"]["Scan"](config, shape),
                "key": m["chunk"]["Key"](config, shape), "value": m["chunk"]["Value"](config, shape),
                "reduce": m["chunk"]["Reduce"](shape)}
    args = lane.arguments(inputs, outputs, work, shape)
    for name in lane.kernel_names(config):
        ptrs = [Ptr(t.view(-1)) for t in args[name]]
        programs[name](*ptrs, None)
        for p in ptrs:
            p.mem.flush()
    return list(lane.kernel_names(config))
