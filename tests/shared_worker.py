"""One worker of a shared study, for tests/test_shared_study.py: a real sweep process on the study at
STORAGE (sim and torch GEMM lanes at the tiny shape), with a simulated GPU runner whose
trials take DELAY seconds.

    python -m tests.shared_worker STORAGE RESULTS TRIALS DELAY DSL[,DSL...]"""
from __future__ import annotations

import sys
from pathlib import Path

from lab import sweep
from tests.test_sweep_engine import FAST_TIMING, SimRunner, present_h100


def main() -> int:
    storage, results, trials, delay = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    dsls = sys.argv[5].split(",")
    # The same sampler seed in every worker: they propose the same configs in the same order, so the
    # claims are contended on every trial.
    req = sweep.SweepRequest(kernel="gemm", device="h100", dsls=dsls, shapes=["tiny"], trials=trials,
                             results_dir=results, sampler="random", seed=3, storage=storage, baseline=False,
                             confirm=True, progress=False, prefetch=0, timing=FAST_TIMING, timeout_s=120.0)
    sweep.run(req, present_h100(), runner=SimRunner(delay_s=delay), out=print)
    return 0


if __name__ == "__main__":
    sys.exit(main())
