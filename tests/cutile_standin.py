"""A torch stand-in for ``cuda.tile``, shared by the cuTile lanes' CPU tests: a lane's own Python kernel
bodies run on CPU tensors, one program at a time, so the tests check the lanes' index arithmetic, tile
shapes, masking and launch schedules against the problems' references (not tileiras' lowering).

Usage (see tests/test_cutile_mamba.py):

    from tests import cutile_standin as standin

    def test_x(monkeypatch):
        standin.patch_torch(monkeypatch)            # Tile.astype on tensors, NaN-poisoned torch.empty, no CUDA
        ns, fake = standin.emulated(lane)            # the lane module executed with ``ct`` = the stand-in
        launches = standin.record_launches(fake)     # ct.launch loops over the grid; names kept in order
        run = ns["build"](config, shape)
        run(inputs, outputs)

Semantics (cuda-tile 1.7.0 ``cuda/tile/_stub.py``): ``load`` / ``store`` take tile-space indices and an
``order`` mapping tile axes to array axes; a tile partly outside the array reads ``padding_mode``
(ZERO) or the stand-in's ``undetermined`` value (NaN when asked, so a kernel that relies on undetermined
padding shows up), and stores drop the outside part; a tile wholly outside the array fails (undefined
on the GPU). ``gather`` returns ``padding_value`` where an index is out of bounds or masked. fp32 and
tf32 are fp64 here (exact products, fp64 accumulation); bf16 / fp16 stay rounded as on the GPU.
"""
from __future__ import annotations

import itertools
import types
from pathlib import Path

import torch

F64 = torch.float64


def fake_ct(undetermined: float = 0.0):
    """A namespace with the part of ``cuda.tile`` the lab's cuTile kernels use, on CPU torch tensors.
    ``undetermined``: what ``load`` reads outside the array when no padding mode is given."""
    t = types.SimpleNamespace()
    t.Constant = type("Constant", (), {"__class_getitem__": classmethod(lambda cls, item: item)})
    t.PaddingMode = types.SimpleNamespace(ZERO="zero", UNDETERMINED="undetermined")
    t.RoundingMode = types.SimpleNamespace(APPROX="approx", FULL="full")
    t.float32, t.tfloat32, t.float64 = F64, F64, F64
    t.bfloat16, t.float16, t.int32, t.int64 = torch.bfloat16, torch.float16, torch.int32, torch.int64
    t.pid = (0, 0, 0)
    t.grid = (1, 1, 1)
    t.bid = lambda axis: t.pid[axis]
    t.num_blocks = lambda axis: t.grid[axis]
    t.cdiv = lambda a, b: -(-a // b)

    def _window(arr, index, shape, order):
        """Array slices of the tile at grid ``index`` (tile axis j is array axis order[j])."""
        if order is None or order == "C":
            order = tuple(range(len(shape)))
        elif order == "F":
            order = tuple(reversed(range(len(shape))))
        assert len(index) == len(shape) == arr.dim(), (index, shape, tuple(arr.shape))
        src = [None] * len(shape)
        for j, a in enumerate(order):
            src[a] = slice(index[j] * shape[j], min((index[j] + 1) * shape[j], arr.shape[a]))
        return tuple(src), tuple(order)

    def load(arr, index, shape, order=None, padding_mode=None, **kw):
        src, order = _window(arr, index, shape, order)
        assert all(sl.stop > sl.start for sl in src), "tile wholly outside the array"
        fill = 0.0 if padding_mode == "zero" else undetermined
        out = torch.full(tuple(shape), fill, dtype=arr.dtype)
        part = arr[src].permute(order)
        out[tuple(slice(0, n) for n in part.shape)] = part
        return out

    def store(arr, index, tile, order=None, **kw):
        tile = torch.as_tensor(tile)
        dst, order = _window(arr, index, tuple(tile.shape), order)
        assert all(sl.stop > sl.start for sl in dst), "tile wholly outside the array"
        inv = [order.index(a) for a in range(len(order))]
        part = tile.permute(inv)
        arr[dst] = part[tuple(slice(0, sl.stop - sl.start) for sl in dst)].to(arr.dtype)

    def gather(arr, indices, mask=None, padding_value=0, check_bounds=True, **kw):
        if not isinstance(indices, tuple):
            indices = (indices,)
        assert len(indices) == arr.dim()
        idx = torch.broadcast_tensors(*[torch.as_tensor(i, dtype=torch.int64) for i in indices])
        ok = torch.ones(idx[0].shape, dtype=torch.bool)
        for i, n in zip(idx, arr.shape):
            ok &= (i >= 0) & (i < n)
        if not check_bounds:
            assert bool(ok.all()), "gather out of bounds with check_bounds=False"
        if mask is not None:
            ok = ok & torch.as_tensor(mask)
        safe = tuple(torch.where(ok, i, 0) for i in idx)
        return torch.where(ok, arr[safe], torch.as_tensor(padding_value, dtype=arr.dtype))

    def extract(x, index, shape):
        return x[tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, shape))].clone()

    def insert(x, index, value):
        out = x.clone()
        out[tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, value.shape))] = value
        return out

    def where(c, x, y):
        if not torch.is_tensor(x):
            x = torch.as_tensor(x, dtype=y.dtype)
        if not torch.is_tensor(y):
            y = torch.as_tensor(y, dtype=x.dtype)
        return torch.where(torch.as_tensor(c), x, y)

    def reduce_sum(x, axis=None, keepdims=False, **kw):
        x = torch.as_tensor(x)
        return x.sum() if axis is None else x.sum(axis, keepdim=keepdims)

    t.load, t.store, t.gather, t.extract, t.insert = load, store, gather, extract, insert
    t.zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype)
    t.ones = lambda shape, dtype: torch.ones(shape, dtype=dtype)
    t.full = lambda shape, fill_value, dtype: torch.full(shape, fill_value, dtype=dtype)
    t.arange = lambda n, dtype, start=0, step=1: torch.arange(start, start + n * step, step, dtype=dtype)
    t.where = where
    t.static_iter = lambda it: it
    t.mma = lambda a, b, acc: a.to(F64) @ b.to(F64) + acc
    t.matmul = lambda a, b: a.to(F64) @ b.to(F64)
    t.tanh = lambda x, rounding_mode=None: torch.tanh(x)
    t.exp = lambda x, **kw: torch.exp(torch.as_tensor(x))
    t.cos = lambda x: torch.cos(torch.as_tensor(x))
    t.sin = lambda x: torch.sin(torch.as_tensor(x))
    t.transpose = lambda x, axis0=None, axis1=None: x.transpose(-1 if axis0 is None else axis0,
                                                                -2 if axis1 is None else axis1)
    t.permute = lambda x, axes: x.permute(axes)
    t.reshape = lambda x, shape: torch.as_tensor(x).reshape(shape)
    t.broadcast_to = lambda x, shape: torch.broadcast_to(torch.as_tensor(x), shape)
    t.expand_dims = lambda x, axis: torch.as_tensor(x).unsqueeze(axis)
    t.cat = lambda tiles, axis: torch.cat(tiles, axis)
    t.sum = reduce_sum
    t.maximum, t.minimum = torch.maximum, torch.minimum
    t.kernel = lambda fn, **hints: fn
    return t


def emulated(module, fake=None, overrides: dict | None = None):
    """``module`` (a lane) executed again with ``ct`` the stand-in: (namespace, stand-in). ``overrides``
    replace names of the namespace after it ran (e.g. a launch-info helper that needs the real cuTile)."""
    fake = fake or fake_ct()
    src = Path(module.__file__).read_text().replace("import cuda.tile as ct\n", "")
    ns = {"__name__": f"_emulated_{module.__name__.rsplit('.', 1)[-1]}", "ct": fake}
    exec(compile(src, module.__file__, "exec"), ns)
    ns.update(overrides or {})
    return ns, fake


def record_launches(fake) -> list[str]:
    """Make ``fake.launch`` run every program of the grid, one at a time (axis 0 outermost, axis 2
    innermost), and return the list it appends each launched kernel's name to."""
    launches: list[str] = []

    def launch(stream, grid, kernel, args):
        launches.append(kernel.__name__)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        fake.grid = grid
        for pid in itertools.product(range(grid[0]), range(grid[1]), range(grid[2])):
            fake.pid = pid
            kernel(*args)

    fake.launch = launch
    return launches


def patch_torch(monkeypatch):
    """Tile.astype on torch tensors, for the kernel bodies; torch.empty poisoned with NaN so that a read
    of a scratch element no launch wrote shows up; no CUDA stream on the CPU."""
    monkeypatch.setattr(torch.Tensor, "astype", lambda self, dtype, **kw: self.to(dtype), raising=False)
    full = torch.full

    def empty(*size, **kw):
        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        return full(size, float("nan"), **kw)

    monkeypatch.setattr(torch, "empty", empty)
    stream = types.SimpleNamespace(wait_stream=lambda other: None, wait_event=lambda event: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda **kw: types.SimpleNamespace(**vars(stream)))
    monkeypatch.setattr(torch.cuda, "Event", lambda: types.SimpleNamespace(record=lambda stream: None))
