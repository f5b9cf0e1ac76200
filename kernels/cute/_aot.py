"""What the CuTe DSL lanes share: the ahead-of-time compile with its resource figures, the static shared
memory a launch counts, and the package versions their rows record. All sizes are bytes."""
from __future__ import annotations

import os
import re
import tempfile
import time

import torch

from kernels import _cubin, _launch_smem, _targets


def static_smem(target: str) -> int:
    """Static shared memory of a CuTe DSL kernel as a launch counts it, bytes: its .nv.shared section (the
    1 KiB ptxas puts there, which on sm_90+ is the per-block reservation the driver does not count:
    ``_launch_smem.driver_static``) plus the 64 B .nv.shared.reserved section on sm_100 and newer. Shared by
    the CuTe DSL lanes' estimates; the tests hold them to the compiled figures."""
    arch = _targets.cc(target)
    return (0 if arch >= 90 else _launch_smem.BLOCK_RESERVATION) + (64 if arch >= 100 else 0)


def compile_with_resources(compile_fn, prefix: str, target: str):
    """``compile_fn(options)`` -> compiled function; returns it with {"smem_bytes" (dynamic, from the host
    launch code, + static as the driver counts it and reserved, from the cubin: ``_launch_smem.driver_static``),
    "registers", "stack" (bytes per thread), "compile_s", "binary", "kernel"}. Dumping the cubin
    (--keep-cubin) also turns the DSL's file cache off, so no binary is reused across targets."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        t0 = time.perf_counter()
        fn = compile_fn(f"--keep-cubin --dump-dir {d}")
        seconds = time.perf_counter() - t0
        cubins = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")]
        if len(cubins) != 1:
            raise RuntimeError(f"expected one cubin in {d}, found {os.listdir(d)}")
        with open(cubins[0], "rb") as fh:
            res = _cubin.resources(fh.read())
        dynamic = launch_dynamic_smem(str(fn.ir_module))
    static = _launch_smem.driver_static(res, target) + res["reserved"]
    return fn, {"smem_bytes": dynamic + static, "smem_dynamic": dynamic, "smem_static": static,
                "registers": res["registers"], "stack": res["stack"], "compile_s": seconds, "binary": "cubin",
                "kernel": res["kernel"]}


_LAUNCH_STRUCT = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"


def launch_dynamic_smem(host_ir: str) -> int:
    """Dynamic shared memory of the kernel launch in the compiled host code.

    The host function fills a cudaLaunchConfig_t {gridDim, blockDim, dynamicSmemBytes, stream, attrs,
    numAttrs}; field 2 is stored from an i64 constant. Exactly one launch is expected.
    """
    host_ir = re.sub(r'@kernels_binary\("[^"]*"\)', "@kernels_binary(...)", host_ir)
    consts = dict(re.findall(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i64\) : i64", host_ir))
    slots = re.findall(r"(%\w+) = llvm\.getelementptr %\w+\[0, 2\] : \(!llvm\.ptr\) -> !llvm\.ptr, "
                       + re.escape(_LAUNCH_STRUCT), host_ir)
    values = []
    for slot in slots:
        m = re.search(r"llvm\.store (%\w+), " + re.escape(slot) + r" : i64, !llvm\.ptr", host_ir)
        if m and m.group(1) in consts:
            values.append(int(consts[m.group(1)]))
    if len(values) != 1:
        raise RuntimeError(f"could not read the launch's dynamic shared memory from the host IR ({values})")
    return values[0]


def versions() -> dict:
    from importlib.metadata import version
    return {"nvidia-cutlass-dsl": version("nvidia-cutlass-dsl"), "torch": torch.__version__}
