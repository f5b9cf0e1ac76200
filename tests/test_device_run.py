"""scripts/device_run.sh on the CPU: with LAB_CALL_BUDGET each command gets at most what is left of the
call (less the stop-and-pack margin), a command with nothing left is skipped, and results.tgz is packed
after every command that ran."""
import os
import shutil
import subprocess
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
