"""``python -m lab sweep ... --gpus all|0,1,...``: one sweep worker process per GPU on one study.

Each worker is the ordinary sweep (``python -m lab sweep`` with the same arguments) pinned to its GPU
by CUDA_VISIBLE_DEVICES, with LAB_GPU_INDEX naming that GPU in its rows; the workers share the study
(``--storage``, default the SQLite file under results/) through the claims of ``lab.study``. The
host's compile processes are split between them (--compile-workers each, at most the CPU count in
all). With one GPU the sweep runs in this process, as without --gpus.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from lab.devices import LabError


def gpu_list(spec: str, visible: int) -> list[int]:
    """GPU indices from ``all`` or a comma list, checked against the ``visible`` count."""
    if spec == "all":
        if visible < 1:
            raise LabError("--gpus all: no GPU on this machine")
        return list(range(visible))
    try:
        gpus = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise LabError(f"--gpus {spec!r}: expected all or a comma list of GPU indices") from None
    bad = [g for g in gpus if g < 0 or g >= visible]
    if not gpus or bad or len(set(gpus)) != len(gpus):
        raise LabError(f"--gpus {spec!r}: this machine has {visible} GPU(s) (indices 0..{visible - 1}), "
                       f"each named once")
    return gpus


def worker_argv(argv: list[str], compile_workers: int) -> list[str]:
    """The sweep's own arguments without --gpus, with this worker's share of the compile processes."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--gpus", "--compile-workers"):
            skip = True
            continue
        if a.startswith(("--gpus=", "--compile-workers=")):
            continue
        out.append(a)
    return out + ["--compile-workers", str(compile_workers), "--no-progress"]


def gpu_env(gpu: int) -> dict:
    """The environment of a process pinned to GPU ``gpu``: CUDA_VISIBLE_DEVICES, and LAB_GPU_INDEX, which its
    rows record."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu), "LAB_GPU_INDEX": str(gpu)}


def run_workers(argv: list[str], gpus: list[int], compile_workers: int, out=print) -> int:
    """Start one worker per GPU, prefix each output line with its GPU, wait; the worst exit status."""
    share = max(1, min(compile_workers, (os.cpu_count() or 1) // len(gpus)))
    procs = []
    for g in gpus:
        procs.append((g, subprocess.Popen([sys.executable, "-m", "lab", *worker_argv(argv, share)], env=gpu_env(g),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)))
    lock = threading.Lock()

    def relay(g, p):
        for line in p.stdout:
            with lock:
                out(f"[gpu {g}] {line.rstrip()}")
    threads = [threading.Thread(target=relay, args=(g, p), daemon=True) for g, p in procs]
    for t in threads:
        t.start()
    codes = [p.wait() for _, p in procs]
    for t in threads:
        t.join()
    return max(codes)
