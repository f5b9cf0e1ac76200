"""The TileLang bwd_bwd lane on the CPU: the three kernels lower and compile to cubins for sm_90a and
sm_121a (GB10), every named shape has a config that fits GB10's 99 KiB, the shared-memory estimate
equals the compiler, a layout that would compute garbage is refused, and the config rules refuse what
TileLang cannot lower."""
from __future__ import annotations

from pathlib import Path

import pytest

# Imported, not importorskip: a missing DSL must fail the run, never skip it silently.
from kernels.tilelang import _common as tl
from kernels.tilelang import _smem_plan as smem_plan
from kernels.tilelang import mamba_bwd_bwd as lane
from lab import space
from lab.devices import get_profile
from tests.test_space_values import harness_reason

GB10 = space.get_shape("mamba_bwd_bwd", "gb10")
D = lane.DEFAULTS
GB10_LIMIT = get_profile("gb10").smem_optin_bytes
NAMED = list(space.load_shapes("mamba_bwd_bwd")[0])
# The smallest scan tiles of the space (64 x 16; 32 x 64 where N = 32), then the chunk kernel's
# variants that keep less in shared memory.
SMALL_TILES = ({"scan_block_N": 64, "scan_block_P": 16}, {"scan_block_N": 32, "scan_block_P": 64})
FITTING_CANDIDATES = [{**tile, **extra} for tile in SMALL_TILES for extra in (
    {}, {"global_tables": True}, {"global_tables": True, "threads": 128}, {"global_tables": True, "scan_stages": 0})]


def _fitting(shape: dict, target: str) -> dict:
    """The first candidate that passes the rules and fits GB10 by estimate (None if none does)."""
    for cand in FITTING_CANDIDATES:
        cfg = {**D, **cand}
        if lane.config_reason(cfg, shape) or lane.shape_target_reason(cfg, shape, target) or \
                harness_reason("mamba_bwd_bwd", "tilelang", cfg, shape):
            continue
        if lane.smem_estimate(cfg, shape, target) <= GB10_LIMIT:
            return cfg
    return None


def _lowered_smem(config: dict, shape: dict, target: str) -> dict:
    """name -> dynamic shared memory (bytes) TileLang gives each kernel, and its layout hazards."""
    out = {}
    for name in ("scan", "chunk"):
        program = lane._PROGRAMS[name](config, shape)
        art = tl.lower(program, target, lane._pass_configs(config, name))
        assert not smem_plan.alias_hazards(program, art.kernel_source), name
        out[name] = tl.dynamic_smem(art)
    return out


# The shapes whose fitting config is the first candidate at sizes another such shape already checks
# (anchor_b2 is gb10's N, P, R, C; the three grid shapes vary them around h100_tuned's): slow. The others
# take their own candidate (global tables, 128 threads) or options, or are the sweep's default shapes.
_EXTRA_SHAPES = ("anchor_b2", "grid_n32_p64_r4_c16", "grid_n128_p64_r8_c8", "grid_n128_p64_r2_c32")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _EXTRA_SHAPES else n
                                  for n in NAMED])
def test_every_named_shape_fits_gb10_and_estimate_equals_compiler(name):
    """Issue 20: on GB10 (sm_121a) every named shape has a config within 101,376 B, and the preflight
    estimate of both big kernels is the byte count TileLang's lowering gives them."""
    shape = space.get_shape("mamba_bwd_bwd", name)
    cfg = _fitting(shape, "sm_121a")
    assert cfg is not None, f"no candidate fits {name} by estimate"
    got = _lowered_smem(cfg, shape, "sm_121a")
    assert max(got.values()) <= GB10_LIMIT, got
    for kernel, key in lane._SMEM_KEYS.items():
        est = lane._planned(kernel, tuple(cfg[x] for x in key), tuple(sorted(shape.items())), "sm_121a")
        assert est == got[kernel], (kernel, est, got)


_GLOBAL_TABLES = ("grid_n128_p64_r1_c64", {**SMALL_TILES[0], "global_tables": True})
_SEGMENTS = ("gb10", {"scan_threads": 128, "scan_block_P": 16, "scan_segments": 8})
# paired_tiles: one interleaved tile per rotary-pair operand (the training best's scan, DQ / DK staged).
_PAIRED = ("training", {"scan_threads": 256, "scan_block_P": 128, "stage_out": True, "paired_tiles": True})


# Each variant compiles for one target in the default run (both targets are covered); the other is slow.
@pytest.mark.parametrize("target,shape_name,config", [
    # global_tables: the C*R = 64, N = 128 shapes fit GB10 only with the tables read from global memory.
    ("sm_121a", *_GLOBAL_TABLES), pytest.param("sm_90a", *_GLOBAL_TABLES, marks=pytest.mark.slow),
    # scan_segments: a local scan pass over segments 1..K-1, then the scan from composed carries.
    ("sm_121a", *_SEGMENTS), ("sm_90a", *_SEGMENTS),
    ("sm_90a", *_PAIRED), ("sm_121a", "gb10", {"paired_tiles": True}),
])
def test_new_variants_compile_to_cubins(target, shape_name, config):
    shape = space.get_shape("mamba_bwd_bwd", shape_name)
    cfg = {**D, **config}
    res = lane.compile_for(cfg, shape, target)
    local = {"scan_local"} if cfg["scan_segments"] > 1 else set()
    assert set(res["kernels"]) == {"scan", "chunk", "reduce"} | local
    assert res["smem_bytes"] == max(k["smem_bytes"] for k in res["kernels"].values())
    assert 0 < res["registers"] <= 255
    assert lane.smem_estimate(cfg, shape, target) == res["smem_bytes"]
    if shape_name == "grid_n128_p64_r1_c64":
        assert res["smem_bytes"] <= GB10_LIMIT
        staged = lane.smem_estimate({**cfg, "global_tables": False}, shape, target)
        assert staged > GB10_LIMIT             # the staged tables would not fit at C = 64


_STAGE_OUT = {"stage_out": True}   # DQ / DK staged: 14 KiB more here


@pytest.mark.parametrize("target,config", [
    *((t, c) for t in ("sm_90a", "sm_121a") for c in ({"threads": 128}, {"global_tables": True})),
    ("sm_90a", _STAGE_OUT), pytest.param("sm_121a", _STAGE_OUT, marks=pytest.mark.slow),
    ("sm_90a", {"paired_tiles": True}), ("sm_121a", {"paired_tiles": True, "stage_out": True}),
])
def test_chunk_estimate_equals_lowering_at_h100_tuned(target, config):
    shape = space.get_shape("mamba_bwd_bwd", "h100_tuned")
    cfg = {**D, **config}
    art = tl.lower(lane._chunk_program(cfg, shape), target, lane._pass_configs(cfg, "chunk"))
    est = lane._planned("chunk", tuple(cfg[x] for x in lane._SMEM_KEYS["chunk"]), tuple(sorted(shape.items())), target)
    assert est == tl.dynamic_smem(art)


@pytest.mark.parametrize("target,tile", [("sm_90a", (64, 16, 0, 128)), ("sm_90a", (64, 32, 2, 256)),
                                         ("sm_121a", (32, 64, 2, 128)), ("sm_121a", (128, 16, 0, 256))])
def test_scan_estimate_equals_lowering(target, tile):
    bn, bp, stages, threads = tile
    shape = space.get_shape("mamba_bwd_bwd", "h100_tuned")
    cfg = {**D, "scan_block_N": bn, "scan_block_P": bp, "scan_stages": stages, "scan_threads": threads}
    art = tl.lower(lane._scan_program(cfg, shape), target, lane._pass_configs(cfg, "scan"))
    est = lane._planned("scan", tuple(cfg[x] for x in lane._SMEM_KEYS["scan"]), tuple(sorted(shape.items())), target)
    assert est == tl.dynamic_smem(art)


def test_scan_with_the_aggressive_merge_is_a_hazard_and_refused():
    """The bug behind issue 20 (commit 230c326): with tl.enable_aggressive_shared_memory_merge the
    scan's dy_s got the bytes of z_raw / do_raw, which the loop writing dy_s still reads (wrong dS at
    scan_stages = 0, every shape). The check sees it in the compiled layout; the lane's own pass
    configs keep the merge off the scan, and the same program then has no hazard."""
    cfg = {**D, "scan_stages": 0}
    program = lane._scan_program(cfg, GB10)
    merged = tl.lower(program, "sm_90a", tl.pass_configs(False, False, True, True))
    hazards = smem_plan.alias_hazards(program, merged.kernel_source)
    assert {"z_raw", "do_raw"} & {r for w, r in hazards if w == "dy_s"}, hazards
    with pytest.raises(RuntimeError, match="computes garbage"):
        lane._check_layout("scan", program, merged.kernel_source)
    assert not lane._pass_configs(cfg, "scan").get("tl.enable_aggressive_shared_memory_merge")
    own = tl.lower(program, "sm_90a", lane._pass_configs(cfg, "scan"))
    assert smem_plan.alias_hazards(program, own.kernel_source) == []


# The harness's parity shape of each case keeps its N, P, R, C and options (only B, S, H shrink): the
# same programs at the GB10 sizes are slow.
@pytest.mark.parametrize("at_parity_shape", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", [{"R": 1, "C": 64}, {"R": 8, "C": 8}, {"G": 2, "rd": 2, "hasZ": False,
                                                                      "hasD": False, "reduceO": False}])
def test_options_ranks_and_parity_shapes_lower(case, at_parity_shape):
    """Every option and rank lowers, and so does the harness's small parity shape of each (three
    chunks, odd head count: a fragment reduction over nc = 3 once failed to lower there)."""
    from lab.problems import get
    shape = {**GB10, **case}
    for sh in get("mamba_bwd_bwd").parity_shapes(shape) if at_parity_shape else [shape]:
        for name, prog in lane._PROGRAMS.items():
            art = tl.lower(prog(D, sh), "sm_90a", lane._pass_configs(D, name))
            assert "__global__" in art.kernel_source, name


@pytest.mark.parametrize("config,shape,msg", [
    ({"threads": 96}, GB10, "threads"),
    ({"scan_block_N": 48}, GB10, "scan_block_N"),
    ({"scan_block_P": 128}, GB10, "divide P"),
    ({"threads": 512}, {**GB10, "R": 1, "C": 16}, "too small"),
    ({"stage_out": 1}, GB10, "stage_out=1"),
    ({"threads": 512}, GB10, "threads=512"),
    ({"scan_segments": 3}, GB10, "scan_segments=3"),
    ({"paired_tiles": True, "threads": 128}, {**GB10, "C": 8}, "paired_tiles at C*R=32"),
    ({"paired_tiles": True, "threads": 512, "scan_block_N": 32, "scan_block_P": 64}, {**GB10, "N": 96},
     "multiple of 64"),
])
def test_config_rules(config, shape, msg):
    """Each refusal comes from the lane (what depends on the shape or on combinations) or, for a value
    the sweep file does not list, from the harness's check of the file (``harness_reason``)."""
    cfg = {**D, **config}
    assert msg in (lane.config_reason(cfg, shape) or "") or msg in (harness_reason("mamba_bwd_bwd", "tilelang", cfg, shape) or "")


@pytest.mark.parametrize("target,shape,threads,paired,lowers", [
    # The compiler's verdicts behind shape_target_reason (TileLang 0.1.15), checked both ways.
    ("sm_90a", "anchor_b2", 512, False, False),
    ("sm_90a", "anchor_b2", 256, False, True),
    ("sm_90a", "grid_n32_p64_r4_c16", 256, False, False),
    ("sm_90a", "grid_n32_p64_r4_c16", 128, False, True),
    ("sm_121a", "anchor_b2", 512, False, True),
    # one N = 32 tile gives each of two warpgroups 16 whole columns, where two half tiles gave 8
    ("sm_90a", "grid_n32_p64_r4_c16", 256, True, True),
])
def test_rotated_warpgroup_rule_matches_the_compiler(target, shape, threads, paired, lowers):
    sh = space.get_shape("mamba_bwd_bwd", shape)
    cfg = {**D, "threads": threads, "scan_block_N": 32, "scan_block_P": 64, "paired_tiles": paired}
    assert lane.config_reason(cfg, sh) is None
    refused = lane.shape_target_reason(cfg, sh, target)
    assert (refused is None) == lowers, refused
    try:
        tl.lower(lane._chunk_program(cfg, sh), target, lane._pass_configs(cfg, "chunk"))
        lowered = True
    except Exception:  # noqa: BLE001  (TileLang raises its own InternalError types)
        lowered = False
    assert lowered == lowers


def test_target_rules_and_eligibility():
    assert "scan_block_N=128" in lane.target_reason({**D, "scan_block_N": 128}, "sm_90a")
    assert lane.target_reason({**D, "scan_block_N": 128}, "sm_121a") is None
    assert lane.eligibility("sm_75") and lane.eligibility("sm_121a") is None
    chunk, scan = lane._pass_configs(D, "chunk"), lane._pass_configs(D, "scan")
    assert chunk["tl.enable_aggressive_shared_memory_merge"] and chunk["tl.disable_tma_lower"]
    assert "tl.enable_aggressive_shared_memory_merge" not in scan and scan["tl.disable_tma_lower"]


# The default run preflights a space of threads x global_tables x stage_out (the other tunables at their
# defaults); the sweep file's whole space is slow.
_SMALL_SPACE = """[params]
threads = [128, 256]
global_tables = [false, true]
stage_out = [false, true]
"""


@pytest.mark.parametrize("whole_space", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cli_preflight_lists_configs_that_fit_gb10(lab_env, whole_space):
    """`python -m lab preflight mamba_bwd_bwd --device gb10` per named shape: compiled for sm_121a,
    each compiled config listed as fits / over with its bytes; the estimate agrees with the compiler."""
    import subprocess
    import sys
    if not whole_space:
        (lab_env.sweeps / "mamba_bwd_bwd" / "tilelang.toml").write_text(_SMALL_SPACE)
    n = 2 if whole_space else 1      # the second compile goes through the --jobs pool (test_cli.py covers it)
    p = subprocess.run([sys.executable, "-m", "lab", "preflight", "mamba_bwd_bwd", "--device", "gb10",
                        "--dsl", "tilelang", "--shape", "gb10", "--compile-limit", str(n), "--jobs", "2"],
                       capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parent.parent)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "shape gb10" in p.stdout and "limit 101,376 B" in p.stdout and f"compiled {n} for sm_121a" in p.stdout
    listed = [ln for ln in p.stdout.splitlines() if ln.strip().startswith(("fits ", "over ", "error "))]
    assert len(listed) == n and all("B compiled" in ln for ln in listed if not ln.strip().startswith("error"))
    assert "0 on the wrong side of the limit" in p.stdout, p.stdout
    # Every DSL is accounted for: one without this kernel (the test's simulated DSL) says so in a typed line.
    p = subprocess.run([sys.executable, "-m", "lab", "list", "mamba_bwd_bwd", "--device", "gb10"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent)
    lines = {ln.split()[1]: ln for ln in p.stdout.splitlines() if ln.startswith("  mamba_bwd_bwd")}
    assert "missing: no kernels/sim/mamba_bwd_bwd.py" in lines["sim"], p.stdout
    assert all(lines[d].rstrip().endswith(" ok") for d in ("cute", "cutile", "tilelang", "torch", "triton")), p.stdout


def _barriers_in_elementwise_loops(source: str) -> int:
    """__syncthreads() inside the unrolled per-thread loops of a CUDA source, not counting the loops that
    run a cross-thread reduction (tl::AllReduce needs its barrier)."""
    lines, count, i = source.splitlines(), 0, 0
    while i < len(lines) - 1:
        if lines[i].strip() == "#pragma unroll" and lines[i + 1].lstrip().startswith("for ("):
            depth, j, body = 0, i + 1, []
            while True:
                depth += lines[j].count("{") - lines[j].count("}")
                body.append(lines[j])
                if depth <= 0 and j > i + 1:
                    break
                j += 1
            text = "\n".join(body)
            if "AllReduce" not in text:
                count += text.count("__syncthreads")
            i = j
        i += 1
    return count


@pytest.mark.slow      # pins generated text (issue 26): run before a GPU session, `pytest -m slow`
def test_rotary_gathers_lower_without_barriers_per_element():
    """The rotary partner of column n is column (n + N/2) mod N. Written as a select between n + N/2 and
    n - N/2, TileLang 0.1.15 could not prove the gather free of conflicts and put two __syncthreads()
    in every unrolled step of the loop (32 barriers per chunk step of the scan at the training shape,
    on the serial path); the modulo form lowers to vector loads without them. The scan of the training
    seed (the chunk kernel holds N in halves and gathers nothing)."""
    sh = space.get_shape("mamba_bwd_bwd", "training")
    seeds = [{**D, **dict(s)} for s in space.load_space("mamba_bwd_bwd", "tilelang", lane.TUNABLES).seeds]
    config = next(s for s in seeds if s["scan_block_P"] == 128)
    art = tl.lower(lane._PROGRAMS["scan"](config, sh), "sm_90a", lane._pass_configs(config, "scan"))
    assert "#pragma unroll" in art.kernel_source
    assert _barriers_in_elementwise_loops(art.kernel_source) == 0
