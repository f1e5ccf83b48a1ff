"""FedBuff in a real deployment with churn next to its simulation (issue 29, item 6): the same run
config on N SuperNode processes whose churn driver stops and starts nodes by the schedule
(``deploy.run.run_deployment(churn="rounds")``, real time, no round barrier), and in process on the
virtual clock. Keeps both run folders (``--results``) for ``benchmarks/virtual_time_study.py``'s
report, which computes its numbers from them; prints a short comparison.

    python benchmarks/fedbuff_deployment.py [--nodes 4] [--aggregations 16] [--results results/virtual-time-study]

The two time bases differ: the churn driver follows the server's rows, so in the deployment a
schedule round is one aggregation; the simulation's asynchronous loop reads the schedule in slots
of one synchronous round (``server_app/async_clock.py``: the slowest client's round-1 job, local
steps x 1 virtual s without devices). With equal local steps, two groups of two nodes and K = 2,
a slot is one aggregation there too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_config(a: argparse.Namespace, name: str) -> dict:
    return {"num-server-rounds": a.aggregations, "strategy": f"fedbuff:k={a.k}", "availability": a.availability,
            "dataset": "digits", "model": "logreg", "local-steps": f"steps:n={a.steps}", "partition": "iid",
            "round-timeout": 120.0, "checkpoint-every": 0, "device": "cpu", "progress": False, "eval-every": 1,
            "results-dir": str(Path(a.results).resolve()), "run-name": name, "train-seed": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--aggregations", type=int, default=16)
    ap.add_argument("--k", type=int, default=2, help="FedBuff's buffer size K")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--availability", default="group-cyclic:groups=2,window=4")
    ap.add_argument("--results", default=str(ROOT / "results" / "virtual-time-study"))
    a = ap.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from deploy.local import ProcessSite
    from deploy.procs import exit_on_signals
    from deploy.run import run_deployment
    from experiments.inprocess import run_inprocess

    exit_on_signals()
    results = Path(a.results)
    for name in ("deploy-fedbuff", "sim-fedbuff"):
        shutil.rmtree(results / name, ignore_errors=True)
    load0, t0 = os.getloadavg()[0], time.monotonic()
    with ProcessSite(a.nodes) as site:
        out = run_deployment(site, run_config(a, "deploy-fedbuff"), churn="rounds", timeout=1500)
    wall = time.monotonic() - t0
    if not out.completed:
        raise SystemExit(f"the deployment did not complete: {out.status}")
    sim = run_inprocess({**run_config(a, "sim-fedbuff"), "num-clients": a.nodes, "availability-gate": "server"})
    note = {"nodes": a.nodes, "k": a.k, "steps": a.steps, "availability": a.availability,
            "aggregations": a.aggregations, "load-before": round(load0, 2), "load-after": round(os.getloadavg()[0], 2),
            "deployment-wall-s": round(wall, 1), "command": " ".join(sys.argv)}
    (results / "deploy-fedbuff" / "study-note.json").write_text(json.dumps(note, indent=1))
    for name, run_dir in (("deployment", out.run_dir), ("simulation", sim)):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        last = rows[-1]
        print(f"{name}: {len(rows)} aggregations, final accuracy {last.get('test-accuracy')}, "
              f"time {last.get('virtual-time')} ({'real' if name == 'deployment' else 'virtual'} s), "
              f"arrivals per client {[sum(c == i for r in rows for c in r['participants']) for i in range(a.nodes)]}")
    print(json.dumps(note))


if __name__ == "__main__":
    main()
