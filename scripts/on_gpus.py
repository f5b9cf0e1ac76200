"""On a machine of several GPUs: run lab commands side by side, one per GPU at a time, for work that one
command cannot spread over GPUs itself (`lab sweep --gpus` can; `lab gate --run` and `lab profile` cannot).

    python scripts/on_gpus.py 'gate --run --device h200 --dsl tilelang --shape training' 'profile ...'
    python scripts/on_gpus.py gate --run --device h200 --shape training :: profile ...

Each argument is one `python -m lab ...` command line (or a `*.py` script and its arguments); or, where
any argument is `::`, the commands are the words between them (scripts/device_run.sh splits a command
line into words, so quoted commands do not survive it). A sweep gets --no-progress. A command
runs with CUDA_VISIBLE_DEVICES (and LAB_GPU_INDEX, which its rows record) set to the GPU it got; a GPU
takes the next command when its own ends. LAB_GPUS overrides the GPU count (default: nvidia-smi's).
Output lines are prefixed with the command's number and GPU. SIGINT / SIGTERM (scripts/device_run.sh's
time limit) are passed on to every running command, so that each saves what it finished. Exit status:
the first non-zero one of the commands, else 0.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading

from lab.multi import gpu_env


def gpu_count() -> int:
    if os.environ.get("LAB_GPUS"):
        return int(os.environ["LAB_GPUS"])
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    return max(1, sum(line.startswith("GPU ") for line in out.splitlines()))


def split(args: list[str]) -> list[str]:
    """The command lines in ``args``: each argument, or the words between ``::`` separators."""
    if "::" not in args:
        return list(args)
    out, words = [], []
    for a in args + ["::"]:
        if a == "::":
            if words:
                out.append(shlex.join(words))
            words = []
        else:
            words.append(a)
    return out


def argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0].endswith(".py"):
        return [sys.executable, *words]
    return [sys.executable, "-m", "lab", *words, *(["--no-progress"] if words[0] == "sweep" else [])]


def main(args: list[str]) -> int:
    commands = split(args)
    if not commands:
        raise SystemExit(__doc__.strip().splitlines()[2].strip())
    pending = list(enumerate(commands, 1))
    lock, running, codes = threading.Lock(), {}, {}

    def stop(signum, _frame):
        with lock:
            pending.clear()
            for proc in running.values():
                proc.send_signal(signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)

    def lane(gpu: int) -> None:
        while True:
            with lock:
                if not pending:
                    return
                i, command = pending.pop(0)
                proc = subprocess.Popen(argv(command), env=gpu_env(gpu), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, start_new_session=True)
                running[i] = proc
            print(f"[{i} gpu{gpu}] start: {command}", flush=True)
            for line in proc.stdout:
                print(f"[{i} gpu{gpu}] {line}", end="", flush=True)
            codes[i] = proc.wait()
            print(f"[{i} gpu{gpu}] exit {codes[i]}", flush=True)
            with lock:
                running.pop(i)

    threads = [threading.Thread(target=lane, args=(g,)) for g in range(min(gpu_count(), len(commands)))]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)   # a timed join: the signal handler runs in the main thread meanwhile
    return next((codes[i] for i in sorted(codes) if codes[i]), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
