"""On the GPU machine: Nsight Compute's report on one lane's kernels at a named shape, for what `lab profile`
cannot say (achieved occupancy, warp stall reasons, DRAM and SM throughput against peak). ncu wraps
scripts/call_lane.py and profiles only its last call (the NVTX range "lab_call"), with the clocks left
alone (--clock-control none: the device notes' METHOD.md) and the caches flushed before each kernel (ncu's
default). Prints ncu's text report; writes nothing under results/.

    python scripts/ncu_lane.py KERNEL DSL SHAPE ['{"config": "json"}'] [--dry-run]
"""
from __future__ import annotations

import glob
import shutil
import subprocess
import sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats", "MemoryWorkloadAnalysis")
CALLS = 2   # the first call compiles (cuTile, Triton JIT) and warms up; the second is profiled


def ncu_path() -> str:
    found = shutil.which("ncu") or sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))
    if not found:
        raise SystemExit("error: ncu (Nsight Compute) is not on this machine")
    return found if isinstance(found, str) else found[-1]


def command(ncu: str, kernel: str, dsl: str, shape: str, config: str = "{}") -> list[str]:
    sections = [arg for s in SECTIONS for arg in ("--section", s)]
    lane = Path(__file__).resolve().parent / "call_lane.py"
    return [ncu, "--clock-control", "none", "--nvtx", "--nvtx-include", "lab_call/", *sections,
            sys.executable, str(lane), kernel, dsl, shape, str(CALLS), config]


def main(argv: list[str]) -> int:
    dry = "--dry-run" in argv
    args = [a for a in argv if a != "--dry-run"]
    if len(args) not in (3, 4):
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    cmd = command("ncu" if dry else ncu_path(), *args)
    if dry:
        print(" ".join(cmd))
        return 0
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
