"""What the driver counts as a kernel's static shared memory, against what the lab's cubin readers say.

    python scripts/smem_truth.py [--target sm_90a]       # on a GPU of that target

The lanes take the 1 KiB per-block reservation off a cubin's .nv.shared.<kernel> section on sm_90+
(kernels/_launch_smem.py, kernels/tilelang/_common.py); this script is the measurement behind that rule
(H100, 2026-11-25: results/logs/20261125T220405Z-mamba_bwd_bwd-h100-972-log.txt, read before the rule). This compiles one GEMM cubin per DSL (each lane's first seed at sq4096_bf16), loads it
with the CUDA driver (ctypes, libcuda) and prints, per cubin: the driver's CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
(static, bytes) and NUM_REGS beside the .nv.shared.<kernel> and .nv.shared.reserved.* section sizes and
the figure each lane's reader gives.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import _cubin, _launch_smem  # noqa: E402
from lab import space  # noqa: E402

CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, CU_FUNC_ATTRIBUTE_NUM_REGS = 1, 4


class Driver:
    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self._ok(self.cu.cuInit(0))
        dev, self.ctx = ctypes.c_int(), ctypes.c_void_p()
        self._ok(self.cu.cuDeviceGet(ctypes.byref(dev), 0))
        self._ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev))
        self._ok(self.cu.cuCtxSetCurrent(self.ctx))

    @staticmethod
    def _ok(rc):
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc}")

    def attrs(self, cubin: bytes, kernel: str) -> dict:
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._ok(self.cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(cubin)))
        self._ok(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, kernel.encode()))
        out = {}
        for name, attr in (("static", CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES), ("registers", CU_FUNC_ATTRIBUTE_NUM_REGS)):
            v = ctypes.c_int()
            self._ok(self.cu.cuFuncGetAttribute(ctypes.byref(v), attr, fn))
            out[name] = v.value
        self.cu.cuModuleUnload(mod)
        return out


def _seed(dsl: str, mod) -> dict:
    sp = space.load_space("gemm", dsl, mod.TUNABLES)
    return mod.full_config(sp.seeds[0]) if hasattr(mod, "full_config") else {**mod.DEFAULTS, **sp.seeds[0]}


def tilelang_cubin(shape: dict, target: str) -> tuple[bytes, str]:
    from kernels.tilelang import _common as tl, gemm
    cfg = _seed("tilelang", gemm)
    art = tl.lower(gemm._program(cfg, shape), target, gemm._pass_configs(cfg))
    cubin = tl.cubin_of(art.kernel_source, target, gemm._pass_configs(cfg), use_cache=False)
    return cubin, f"tilelang reader {tl.resource_usage(cubin, target)['static_smem']}"


def cute_cubin(shape: dict, target: str) -> tuple[bytes, str]:
    from kernels.cute import gemm
    cfg = _seed("cute", gemm)
    with tempfile.TemporaryDirectory() as d:
        gemm._compile(cfg, shape, target, f"--keep-cubin --dump-dir {d}")
        path = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")][0]
        cubin = Path(path).read_bytes()
        r = _cubin.resources(cubin)
        return cubin, f"cute reader {_launch_smem.driver_static(r, target) + r['reserved']}"


def cutile_cubin(shape: dict, target: str) -> tuple[bytes, str]:
    from kernels.cutile import gemm
    cfg = _seed("cutile", gemm)
    cubin = gemm._compile_cubin(cfg, shape, gemm._gpu_code(target))
    return cubin, f"cutile reader {gemm.cubin_resources(cubin, target)['smem_bytes']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="sm_90a")
    args = ap.parse_args(argv)
    shape = space.get_shape("gemm", "sq4096_bf16")
    drv = Driver()
    for name, make in (("tilelang", tilelang_cubin), ("cute", cute_cubin), ("cutile", cutile_cubin)):
        try:
            cubin, reader = make(shape, args.target)
            r = _cubin.resources(cubin)
            d = drv.attrs(cubin, r["kernel"])
            print(f"{name}: driver static {d['static']} B, registers {d['registers']}; sections: .nv.shared.<kernel> "
                  f"{r['static']} B, reserved {r['reserved']} B, registers {r['registers']}; {reader} B")
        except Exception as exc:  # one DSL failing must not hide the others' answers
            print(f"{name}: failed: {type(exc).__name__}: {str(exc)[:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
