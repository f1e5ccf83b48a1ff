"""Round start under churn: the churn example of docs/deployment.md (4 SuperNodes, 10 rounds,
group-cyclic:groups=2,window=2) with the round-start signal (each round starts once its nodes are
registered), with the old fixed 3 s grace, and without churn. Prints the median round time
(rounds 2+) and the late nodes of each; asserts nothing.

    python benchmarks/round_start.py [--rounds 10] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from deploy.local import ProcessSite
from deploy.procs import exit_on_signals
from deploy.run import run_deployment

VARIANTS = {  # name -> run_deployment keyword arguments
    "churn, round-start signal": {"churn": "rounds"},
    "churn, fixed 3 s grace": {"churn": "rounds", "round_start_signal": False},
    "no churn": {},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    exit_on_signals()
    cfg = {"num-server-rounds": a.rounds, "availability": "group-cyclic:groups=2,window=2", "progress": False,
           "checkpoint-every": 0}
    out: dict[str, list[float]] = {k: [] for k in VARIANTS}
    late: dict[str, int] = dict.fromkeys(VARIANTS, 0)
    loads = []
    with tempfile.TemporaryDirectory(prefix="round-start-") as d:
        for k in range(a.repeats):
            for name, kw in VARIANTS.items():
                loads.append(os.getloadavg()[0])
                with ProcessSite(4, Path(d) / f"w{k}-{len(out[name])}-{hash(name) % 1000}") as dep:
                    res = run_deployment(dep, {**cfg, "results-dir": str(Path(d) / "results")}, **kw)
                if not res.ok:
                    print(f"{name}: {res.status}; {res.report and res.report.summary()}")
                times = [r["round-time"] for r in res.rows[1:]]
                out[name].append(statistics.median(times))
                if res.driver is not None:
                    late[name] += sum(len(v) for v in res.driver.late.values())
    print(f"\nchurn example (docs/deployment.md): 4 nodes, {a.rounds} rounds, {os.cpu_count()} CPUs, "
          f"load {min(loads):.1f}-{max(loads):.1f} (shared host: noisy)")
    print("| variant | median round, rounds 2+ (s), per repeat | late (round, node) |\n|---|---|---|")
    for name, meds in out.items():
        print(f"| {name} | {', '.join(f'{m:.2f}' for m in meds)} | {late[name]} |")


if __name__ == "__main__":
    main()
