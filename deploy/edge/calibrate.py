"""``python -m deploy.edge.calibrate RUN_CONFIG_JSON CLIENT``: seconds per local step of ``CLIENT``'s
local training under the run config's workload, measured in the calling process (the launcher
starts it inside a device class's cgroup and namespace). Prints one JSON line:
``{"seconds-per-step": s, "num-steps": k, "peak-rss-mb": m}``. The first training call warms up
(lazy initialisation); the second is timed."""

from __future__ import annotations

import json
import resource
import sys
import time

from runconfig import WorkloadConfig, from_run_config
from workloads.workload import get_workload


def main(argv: list[str]) -> int:
    run_config, client = json.loads(argv[0]), int(argv[1])
    wl = get_workload(from_run_config(WorkloadConfig, run_config))
    model = wl.new_model()
    wl.train_client(model, client, 0)
    t0 = time.monotonic()
    result = wl.train_client(model, client, 1)
    seconds = time.monotonic() - t0
    print(json.dumps({"seconds-per-step": round(seconds / max(1, result.num_steps), 5),
                      "num-steps": result.num_steps,
                      "peak-rss-mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
