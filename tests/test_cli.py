"""The command line: bad input gives one clear line and exit status 2; the main commands work on a
machine without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def lab(*args, env=None, timeout=600):
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "lab", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def assert_one_line_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("args, needles", [
    (["sweep", "nokernel", "--device", "h100"], ["unknown kernel 'nokernel'", "gemm"]),
    (["sweep", "gemm", "--device", "nodevice"], ["unknown device 'nodevice'", "gb10"]),
    (["sweep", "gemm", "--device", "h100", "--shape", "noshape"], ["unknown shape 'noshape'", "sq4096_bf16"]),
    (["sweep", "gemm", "--device", "h100", "--dsl", "nodsl"], ["unknown DSL 'nodsl'"]),
    (["sweep", "gemm", "--device", "gb10"], ["no GPU on this machine", "--compile-only"]),
    (["preflight", "gemm", "--device", "gb10", "--shape", "noshape"], ["unknown shape"]),
    (["list", "nokernel"], ["unknown kernel"]),
    (["report", "no/such/folder"], ["no such results folder"]),
    (["check", "gemm", "--dsl", "torch", "--shape", "sq4096_bf16"], ["no GPU here", "--device cpu"]),
    (["check", "gemm", "--dsl", "triton", "--shape", "tiny", "--device", "cpu", "--config", '{"BLOK_M": 64}'],
     ["unknown config key 'BLOK_M'"]),
    (["profile", "gemm", "--dsl", "torch", "--shape", "tiny", "--device", "cpu", "--config", "{bad"], ["not JSON"]),
])
def test_bad_input_one_line_exit_2(lab_env, args, needles):
    assert_one_line_error(lab(*args), *needles)


def test_malformed_sweep_file(lab_env):
    (lab_env.sweeps / "gemm" / "triton.toml").write_text("[params\nBLOCK_M = [64]\n")
    assert_one_line_error(lab("preflight", "gemm", "--device", "gb10", "--dsl", "triton"), "malformed sweep file")


def test_unknown_config_key_in_sweep_file(lab_env):
    (lab_env.sweeps / "gemm" / "triton.toml").write_text("[params]\nBLOCK_Q = [64]\n")
    assert_one_line_error(lab("preflight", "gemm", "--device", "gb10", "--dsl", "triton"),
                          "unknown config key 'BLOCK_Q'", "BLOCK_M")


def test_bad_restriction(lab_env):
    (lab_env.sweeps / "gemm" / "triton.toml").write_text(
        '[params]\nBLOCK_M = [64]\n[restrictions]\nrules = ["__import__(\'os\')"]\n')
    assert_one_line_error(lab("preflight", "gemm", "--device", "gb10", "--dsl", "triton"), "restriction")


def test_malformed_shapes_file(lab_env):
    (lab_env.sweeps / "gemm" / "shapes.toml").write_text('default = ["x"]\n[shapes.y]\nM = 1\nN = 1\nK = 1\ndtype = "bfloat16"\n')
    assert_one_line_error(lab("sweep", "gemm", "--device", "gb10", "--compile-only"), "default names unknown shape")


def test_devices_lists_profiles_and_present(lab_env):
    p = lab("devices")
    assert p.returncode == 0
    for name in ("h100", "h200", "b200", "gb10", "rtx5090"):
        assert f" {name} " in p.stdout
    assert "101,376 B (99 KiB)" in p.stdout and "present GPU: none" in p.stdout


def test_list_shows_typed_eligibility(lab_env):
    p = lab("list", "gemm", "--device", "gb10")
    assert p.returncode == 0
    assert "triton     ok" in p.stdout and "torch      ok" in p.stdout and "sim        ok" in p.stdout


# Every named shape repeats the same Triton compiles at other sizes (a compile pool each): slow.
@pytest.mark.parametrize("shapes", [["--shape", "sq4096_bf16"], pytest.param([], marks=pytest.mark.slow)],
                         ids=["one_shape", "every_shape"])
def test_preflight_gb10_reports_fit_and_agreement(lab_env, shapes):
    p = lab("preflight", "gemm", "--device", "gb10", "--dsl", "triton", "--compile-limit", "6", *shapes)
    assert p.returncode == 0, p.stderr
    assert "limit 101,376 B" in p.stdout and "fit by estimate" in p.stdout
    assert "compiled 6 for sm_121a" in p.stdout and "estimate == compiler for 6/6" in p.stdout
    assert "0 on the wrong side of the limit" in p.stdout
    p = lab("preflight", "gemm", "--device", "gb10", "--dsl", "torch", *shapes)
    assert p.returncode == 0 and "no compile-verified figure" in p.stdout


def test_compile_only_sweep_runs_without_gpu(lab_env):
    p = lab("sweep", "gemm", "--device", "gb10", "--compile-only", "--dsl", "triton", "--shape", "sq4096_bf16",
            "--trials", "3", "--results", str(lab_env.results), "--no-progress", "--prefetch", "0")
    assert p.returncode == 0, p.stderr[-3000:]
    from lab.results import load
    df = load(lab_env.results)
    tri = df[(df["dsl"] == "triton") & (df["status"] == "compiled")]
    assert len(tri) == 3 and tri["compile_only"].all() and (tri["smem_compiled_bytes"] <= 101_376).all()
    assert set(tri["preflight_target"]) == {"sm_121a"} and tri["time_ms"].isna().all()
    # The baseline has nothing to compile ahead of time: it says so in a row instead of vanishing.
    base = df[df["dsl"] == "torch"]
    assert len(base) == 1 and base["status"].iloc[0] == "infeasible" and "compile" in base["error"].iloc[0]


def test_check_and_profile_a_lane_on_the_cpu(lab_env):
    # The sim lane: MODE picks its behaviour (ok / wrong results / a build error); it runs on the CPU.
    ok, wrong = '{"MODE": "ok"}', '{"MODE": "wrong"}'
    p = lab("check", "gemm", "--dsl", "sim", "--shape", "tiny", "--device", "cpu", "--config", ok, "--config", wrong)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "tiny: ok (parity at timed" in p.stdout and "median" in p.stdout and "rel_l2" in p.stdout, p.stdout
    assert "tiny: wrong_result" in p.stdout, p.stdout
    # A config the lane refuses at a shape is named with its reason, is not run and is no failure.
    p = lab("check", "gemm", "--dsl", "sim", "--shape", "tiny", "--device", "cpu", "--config", ok,
            "--config", '{"MODE": "refused"}')
    assert p.returncode == 0, p.stdout + p.stderr[-2000:]
    assert p.stdout.count("tiny: ok (parity") == 1 and "tiny: refused: MODE=refused is refused" in p.stdout, p.stdout
    p = lab("profile", "gemm", "--dsl", "torch", "--shape", "tiny", "--device", "cpu", "--calls", "3")
    assert p.returncode == 0 and "per call (us), 3 calls" in p.stdout and "aten::" in p.stdout, p.stdout + p.stderr
