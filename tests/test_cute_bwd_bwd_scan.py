"""The CuTe DSL dS scan of mamba_bwd_bwd (kernels/cute/_bwd_bwd_scan.py, issue 23's first kernel): it
compiles for sm_90a and sm_121a with the estimated shared memory, refuses what it cannot tile, and the
reference recurrence it is checked against on the GPU (lab.problems._mamba3.state_grads) agrees with
the Triton lane's scan, GPU-checked through that lane's parity, run here under the interpreter."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab import space
from kernels.cute import _bwd_bwd_scan as scan
from kernels.cute import mamba_bwd_bwd as lane

ROOT = str(Path(__file__).resolve().parent.parent)
TILES = ({**lane.DEFAULTS, "SCAN_BJ": 16, "SCAN_BP": 32}, {**lane.DEFAULTS, "SCAN_BJ": 32, "SCAN_BP": 64})


@pytest.mark.parametrize("target", ["sm_90a", "sm_121a"])
@pytest.mark.parametrize("tile", TILES, ids=("16x32", "32x64"))
def test_compiles_with_the_estimated_shared_memory(target, tile, compiled):
    sh = space.get_shape("mamba_bwd_bwd", "gb10")
    res = compiled(scan, tile, sh, target)
    assert res["smem_bytes"] == scan.smem_bytes(tile, sh, target), res
    assert res["stack"] == 0, res   # no spills: the operand-building loops are not fully unrolled


def test_tiles_it_cannot_take_are_refused():
    sh = space.get_shape("mamba_bwd_bwd", "grid_n32_p64_r4_c16")
    assert "SCAN_BJ=32" in scan.reason({"SCAN_BJ": 32, "SCAN_BP": 32}, sh)
    assert "SCAN_BP=16" in scan.reason({"SCAN_BJ": 16, "SCAN_BP": 16}, sh)
    assert scan.reason({"SCAN_BJ": 16, "SCAN_BP": 32}, {**sh, "S": sh["S"] - 1})
    assert "32-bit" in scan.reason({"SCAN_BJ": 16, "SCAN_BP": 32}, {**sh, "B": 2 ** 20})
    with pytest.raises(ValueError, match="no path for sm_80"):
        scan.compile_for({"SCAN_BJ": 16, "SCAN_BP": 32}, sh, "sm_80")


_TRITON_SCAN = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    import triton
    from lab.problems import _mamba3 as m3
    from lab.problems.mamba_bwd_bwd import MambaBwdBwd as Problem
    from kernels.triton import mamba_bwd_bwd as tri
    out = []
    for shape in json.loads(sys.argv[2]):
        i = Problem().make_inputs(shape, "cpu", 5)
        B, S, H, G, N, P, R, C, nc, nr = m3.dims(shape)
        cfg = {**tri.DEFAULTS, "SCAN_BJ": 16, "SCAN_BP": 16}
        kc = tri._kernel_consts(cfg, shape)
        ds = torch.empty(B, H, nc, N, P, dtype=i["Q"].dtype)
        cos, sin = torch.empty(B, S, H, nr), torch.empty(B, S, H, nr)
        carry, decay = torch.empty(B, H, 1, N, P), torch.empty(B, H, 1)
        z, zeta = (i["Z"], i["MIMO_Z"]) if shape["hasZ"] else (i["Q"], i["MIMO_V"])
        tri._angles[(triton.cdiv(cos.numel(), tri.ANGLE_BLOCK),)](i["ANGLES"], cos, sin, cos.numel(), **kc["angles"])
        tri._scan[(tri._scan_tiles(cfg, shape), H, B)](i["Q"], i["Q_BIAS"], cos, sin, i["DA_CS"], i["DOUT"],
                                                       i["MIMO_O"], z, zeta, ds, carry, decay, S, H, G, nc,
                                                       **kc["scan"])
        ref = m3.state_grads(i, shape)
        err = (ds.double() - ref).norm() / ref.norm()
        out.append(float(err))
    print("RESULT " + json.dumps(out))
""")


def test_the_reference_recurrence_matches_the_triton_scan():
    """state_grads (fp64) against the Triton lane's _scan under TRITON_INTERPRET=1 at small fp16 shapes:
    options on and off, R = 1 and 4, GQA, rd = 2, four chunks."""
    base = {"B": 1, "S": 16, "H": 2, "G": 1, "N": 32, "P": 16, "R": 4, "C": 4, "rd": 4, "hasZ": True, "hasD": True,
            "reduceO": True, "dtype": "float16"}
    shapes = [base, {**base, "hasZ": False, "reduceO": False, "G": 2, "H": 4, "rd": 2},
              {**base, "R": 1, "C": 16, "S": 32}]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, "-c", _TRITON_SCAN, ROOT, json.dumps(shapes)], env=env, capture_output=True,
                         text=True, timeout=600)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, res.stdout[-2000:] + res.stderr[-3000:]
    errs = json.loads(line[0][len("RESULT "):])
    assert all(e < 2e-3 for e in errs), errs   # fp16 operands of the scan's products
