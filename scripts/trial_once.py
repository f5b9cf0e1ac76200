"""Run one harness trial (lab.worker.run_trial: build, parity at every shape, timing) in this process
and print its outcome, error and traceback included. A debugging aid for lane authors on the GPU.

    python scripts/trial_once.py KERNEL DSL SHAPE [CONFIG_JSON_WITHOUT_SPACES]"""
from __future__ import annotations

import json
import sys

from lab import registry, space, worker


def main() -> int:
    kernel, dsl, name = sys.argv[1:4]
    mod = registry.get(dsl, kernel).module
    config = {**mod.DEFAULTS, **(json.loads(sys.argv[4]) if len(sys.argv) > 4 else {})}
    task = {"kernel": kernel, "dsl": dsl, "config": config, "shape": space.get_shape(kernel, name), "seed": 7,
            "device": "cuda", "l2_bytes": 100 * 2**20, "timing": {}}
    res = worker.run_trial(task)
    res.pop("samples_ms", None)
    print(json.dumps({k: v for k, v in res.items() if k != "traceback"}, indent=1, default=str)[:6000])
    print(res.get("traceback", ""))
    return 0 if res["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
