"""Ahead-of-time compile of a CuTe DSL kernel with its resource figures (the M2RNN lanes share it)."""
from __future__ import annotations

import os
import tempfile
import time

from kernels import _cubin, _launch_smem
from kernels.cute.gemm import _launch_dynamic_smem


def compile_with_resources(compile_fn, prefix: str, target: str):
    """``compile_fn(options)`` -> compiled function; returns it with {"smem_bytes" (dynamic, from the host
    launch code, + static as the driver counts it and reserved, from the cubin: ``_launch_smem.driver_static``), "registers", "stack" (bytes per thread),
    "compile_s", "binary", "kernel"}."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        t0 = time.perf_counter()
        fn = compile_fn(f"--keep-cubin --dump-dir {d}")
        seconds = time.perf_counter() - t0
        cubins = [os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin")]
        if len(cubins) != 1:
            raise RuntimeError(f"expected one cubin in {d}, found {os.listdir(d)}")
        with open(cubins[0], "rb") as fh:
            res = _cubin.resources(fh.read())
        dynamic = _launch_dynamic_smem(str(fn.ir_module))
    static = _launch_smem.driver_static(res, target) + res["reserved"]
    return fn, {"smem_bytes": dynamic + static, "smem_dynamic": dynamic, "smem_static": static,
                "registers": res["registers"], "stack": res["stack"], "compile_s": seconds, "binary": "cubin",
                "kernel": res["kernel"]}
