"""scripts/device_run.sh on the CPU: with LAB_CALL_BUDGET each command gets at most what is left of the
call (less the stop-and-pack margin), a command with nothing left is skipped, and results.tgz is packed
after every command that ran; a later call on the same warm machine at the same commit starts from the
earlier call's results/."""
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_call_budget_cuts_and_skips_commands_and_keeps_the_packed_results(tmp_path):
    work = tmp_path / "tree"
    (work / "scripts").mkdir(parents=True)
    (work / "results").mkdir()
    shutil.copy(ROOT / "scripts" / "device_run.sh", work / "scripts" / "device_run.sh")
    # A "command" that writes a row file at once, then runs until it is stopped.
    (work / "scripts" / "long.py").write_text(
        "import pathlib, sys, time\n"
        "pathlib.Path('results', sys.argv[1]).write_text('row')\n"
        "time.sleep(60)\n")
    out = tmp_path / "out"
    # 80 s: the script's setup (it imports torch and every lane to list them) took 12 s on a loaded 2-core
    # CI machine, and at 65 s that left the first command under its 10 s minimum (skipped, not cut).
    env = {**os.environ, "OUT": str(out), "LAB_CALL_BUDGET": "80", "LAB_CMD_TIMEOUT": "0"}
    env.pop("LAB_BRANCH", None)
    t0 = time.monotonic()
    r = subprocess.run(["bash", "scripts/device_run.sh", "scripts/long.py a.txt", "scripts/long.py b.txt"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    log = (out / "log.txt").read_text()
    # The first command had 80 - 45 = 35 s at most (less the setup); the second nothing: skipped.
    assert "=== [1] exit 124" in log and "=== [2] skipped" in log, log
    assert elapsed < 80, elapsed   # the whole call, packing included, within its budget
    assert r.returncode == 124
    with tarfile.open(out / "results.tgz") as tgz:
        assert "results/a.txt" in tgz.getnames()


def _call(tree: Path, out: Path, keep: Path, branch: str, *cmds: str) -> str:
    env = {**os.environ, "OUT": str(out), "LAB_BRANCH": branch, "LAB_KEEP_DIR": str(keep)}
    env.pop("LAB_CALL_BUDGET", None)
    r = subprocess.run(["bash", "scripts/device_run.sh", *cmds], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return (out / "log.txt").read_text()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_later_call_on_the_warm_machine_sees_an_earlier_calls_rows_at_the_same_commit(tmp_path):
    tree, keep = tmp_path / "tree", tmp_path / "keep"
    (tree / "scripts").mkdir(parents=True)
    (tree / "results").mkdir()
    (tree / "results" / "committed.txt").write_text("row")
    shutil.copy(ROOT / "scripts" / "device_run.sh", tree / "scripts" / "device_run.sh")
    # A "command" that writes a row file, then lists what results/ holds.
    (tree / "scripts" / "w.py").write_text(
        "import pathlib, sys\n"
        "pathlib.Path('results', sys.argv[1]).write_text('row')\n"
        "print('holds', sorted(p.name for p in pathlib.Path('results').iterdir()))\n")
    branch = f"keep-{tmp_path.name}"
    git = ["git", "-c", "user.name=lab", "-c", "user.email=lab@example.invalid"]

    def bundle():
        (tree / ".gpu" / "git").mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "bundle", "create", "-q", ".gpu/git/repo.bundle", branch], cwd=tree, check=True)

    subprocess.run(["git", "init", "-q", "-b", branch], cwd=tree, check=True)
    subprocess.run(git + ["add", "scripts", "results"], cwd=tree, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "one"], cwd=tree, check=True)
    bundle()
    _call(tree, tmp_path / "c1", keep, branch, "scripts/w.py first.txt")
    log = _call(tree, tmp_path / "c2", keep, branch, "scripts/w.py second.txt")
    assert "holds ['committed.txt', 'first.txt', 'second.txt']" in log, log
    with tarfile.open(tmp_path / "c2" / "results.tgz") as tgz:
        assert {"results/first.txt", "results/second.txt"} <= set(tgz.getnames())
    # Another commit starts from its own tree: the first commit's extra rows stay out.
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "two"], cwd=tree, check=True)
    bundle()
    log = _call(tree, tmp_path / "c3", keep, branch, "scripts/w.py third.txt")
    assert "holds ['committed.txt', 'third.txt']" in log, log


def test_ncu_lane_profiles_only_the_last_call_with_the_clocks_left_alone():
    """scripts/ncu_lane.py's ncu command: the NVTX range scripts/call_lane.py opens around its last call
    only, no clock locking, and the lane's arguments passed through."""
    cmd = subprocess.run([sys.executable, "scripts/ncu_lane.py", "mamba_bwd_bwd", "cutile", "training",
                          '{"SCAN_PREP":true}', "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert cmd[cmd.index("--clock-control") + 1] == "none"
    assert cmd[cmd.index("--nvtx-include") + 1] == "lab_call/"
    assert cmd[-6:] == [str(ROOT / "scripts" / "call_lane.py"), "mamba_bwd_bwd", "cutile", "training", "2",
                        '{"SCAN_PREP":true}']
    calls = (ROOT / "scripts" / "call_lane.py").read_text()
    assert 'range_push("lab_call")' in calls and "range_pop()" in calls


def _fake_command(tmp_path) -> Path:
    script = tmp_path / "fake.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *a: (print('saved', flush=True), sys.exit(130)))\n"
        "print('on', os.environ['CUDA_VISIBLE_DEVICES'], os.environ['LAB_GPU_INDEX'], time.time(), flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"
        "print('done', time.time(), flush=True)\n"
        "sys.exit(int(sys.argv[2]))\n")
    return script


def test_on_gpus_runs_commands_side_by_side_one_per_gpu(tmp_path):
    """scripts/on_gpus.py with two GPUs and three commands: the first two start together on GPUs 0 and 1,
    the third on the GPU that frees first; every line is tagged; the exit status is the failing one's."""
    fake = _fake_command(tmp_path)
    env = {**os.environ, "LAB_GPUS": "2"}
    out = subprocess.run([sys.executable, "scripts/on_gpus.py", f"{fake} 1.5 0", f"{fake} 0.3 0", f"{fake} 0.3 3"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    on = {line.split("]")[0][1:]: float(line.split()[-1]) for line in out.stdout.splitlines() if " on " in line}
    done = {line.split("]")[0][1:]: float(line.split()[-1]) for line in out.stdout.splitlines() if " done " in line}
    assert set(on) == {"1 gpu0", "2 gpu1", "3 gpu1"}, out.stdout
    assert abs(on["1 gpu0"] - on["2 gpu1"]) < 1.0                 # side by side
    assert on["3 gpu1"] >= done["2 gpu1"] and on["3 gpu1"] < done["1 gpu0"]   # GPU 1's next, while GPU 0 works
    assert "[1 gpu0] on 0 0" in out.stdout and "[3 gpu1] exit 3" in out.stdout


def test_on_gpus_passes_an_interrupt_on_to_every_running_command(tmp_path):
    """SIGINT (device_run.sh's time limit) reaches each running command, which saves and exits; none is
    started after it."""
    fake = _fake_command(tmp_path)
    proc = subprocess.Popen([sys.executable, "scripts/on_gpus.py", f"{fake} 30 0", f"{fake} 30 0", f"{fake} 30 0"],
                            cwd=ROOT, env={**os.environ, "LAB_GPUS": "2"}, stdout=subprocess.PIPE, text=True)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert out.count("saved") == 2 and "[3 " not in out, out
    assert proc.returncode == 130


def test_on_gpus_takes_commands_between_separators_as_device_run_passes_them():
    """device_run.sh splits a command line into words: `::` separates the commands; a sweep gets
    --no-progress."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("on_gpus", ROOT / "scripts" / "on_gpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    words = "sweep mamba_bwd_bwd --config {\"A\":1} :: gate --run --shape gb10 ::".split()
    assert mod.split(words) == ['sweep mamba_bwd_bwd --config \'{"A":1}\'', "gate --run --shape gb10"]
    assert mod.split(["profile a", "check b"]) == ["profile a", "check b"]
    assert mod.argv(mod.split(words)[0])[-3:] == ["--config", '{"A":1}', "--no-progress"]
    assert mod.argv("gate --run")[-1] == "--run"
