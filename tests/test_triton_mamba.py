"""The Triton bwd_bwd lane: the harness's parity path under TRITON_INTERPRET=1 at small fp16 shapes (the
interpreter's bf16 dot is broken), typed refusals, and ahead-of-time compiles for sm_90a / sm_121a."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab import space
from kernels.triton import mamba_bwd_bwd as lane

ROOT = str(Path(__file__).resolve().parent.parent)
GB10_LIMIT = 101_376

BASE = {"B": 1, "S": 12, "H": 2, "G": 1, "N": 32, "P": 16, "R": 4, "C": 4, "rd": 4, "hasZ": True, "hasD": True,
        "reduceO": True, "dtype": "float16"}
SMALL = {"SCAN_BJ": 16, "SCAN_BP": 16, "KEY_BP": 16, "BLOCK_P": 16}

_INTERPRET = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from lab.worker import execute
    out = []
    for shape, cfg in json.loads(sys.argv[2]):
        r = execute({"kind": "trial", "kernel": "mamba_bwd_bwd", "dsl": "triton", "config": cfg, "shape": shape,
                     "seed": 3, "device": "cpu", "no_timing": True})
        out.append({k: r.get(k) for k in ("status", "error", "parity_rel_l2", "parity", "parity_shapes")})
    print("RESULT " + json.dumps(out))
""")


def test_interpreter_parity_through_the_harness():
    """Every output against reference (2) at the timed shape and the problem's parity shape (B=1, three
    chunks, odd head count): R=4 and R=1, GQA with every option off and rd=2, several scan tiles and P
    steps, three or more chunks."""
    cases = [(BASE, SMALL),                                                               # R=4, 3 chunks
             ({**BASE, "R": 1, "C": 16, "S": 64, "P": 32, "hasD": False},                # R=1, 4 chunks, 2 P steps
              {**SMALL, "scan_stages": 1, "chunk_stages": 2}),
             ({**BASE, "G": 2, "H": 4, "N": 64, "R": 2, "C": 8, "S": 24, "rd": 2, "hasZ": False, "hasD": False,
               "reduceO": False}, {**SMALL, "SCAN_BJ": 16, "SCAN_BP": 16})]               # GQA, 2 x 1 scan tiles
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", _INTERPRET, ROOT, json.dumps(cases)], env=env, capture_output=True,
                       text=True, timeout=900)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stdout[-2000:] + p.stderr[-4000:]
    for case, r in zip(cases, json.loads(line[0][7:])):
        assert r["status"] == "ok", (case, r)
        assert r["parity_shapes"] and len(r["parity_shapes"]) >= 2, r
        assert r["parity_rel_l2"] < 2e-3, (case, r)
        assert set(r["parity"]) >= {"DQ", "DK", "DV", "DMIMO_V", "DANGLES", "DSSDA", "DDA"}, r


@pytest.mark.parametrize("change,msg", [
    ({"N": 16}, "N/2 a power of two >= 16"),
    ({"C": 4, "R": 2}, "C*R >= 16"),
    ({"P": 48}, "P=48"),
])
def test_shapes_the_lane_cannot_take_are_refused(change, msg):
    assert msg in (lane.config_reason(SMALL, {**BASE, **change}) or "")


@pytest.mark.parametrize("config,msg", [
    ({"SCAN_BJ": 32}, "SCAN_BJ=32"),          # N/2 = 16
    ({"BLOCK_P": 64}, "BLOCK_P=64"),          # P = 16
    ({"chunk_warps": 3}, "chunk_warps=3"),
    ({"scan_stages": 0}, "scan_stages=0"),
])
def test_configs_that_do_not_fit_the_shape_are_refused(config, msg):
    assert msg in (lane.config_reason({**SMALL, **config}, BASE) or "")
    assert lane.eligibility("sm_75") and lane.eligibility("sm_121a") is None


@pytest.mark.parametrize("target,shape", [("sm_121a", n) for n in ("h100_tuned", "anchor_b2", "training", "gb10")]
                         + [("sm_90a", "h100_tuned")])
def test_compiles_within_the_gb10_limit(target, shape):
    """Every default shape has a config (the sweep file's first seed) whose four kernels compile for
    sm_121a within GB10's 101,376 B, and for sm_90a."""
    sh = space.get_shape("mamba_bwd_bwd", shape)
    seed = space.load_space("mamba_bwd_bwd", "triton", lane.TUNABLES).seeds[0]
    assert lane.config_reason(seed, sh) is None
    res = lane.compile_for(seed, sh, target)
    assert set(res["kernels"]) == {"scan", "key", "value", "reduce"}
    assert 0 < res["smem_bytes"] <= GB10_LIMIT, res


def test_the_key_side_p_block_that_failed_on_the_gpu_is_refused():
    sh = space.get_shape("mamba_bwd_bwd", "h100_tuned")
    assert "KEY_BP=64" in (lane.config_reason({"KEY_BP": 64}, sh) or "")
    assert lane.config_reason({"KEY_BP": 32}, sh) is None
