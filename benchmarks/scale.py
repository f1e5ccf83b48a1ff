"""Seconds per round and peak memory of an in-process run at 1,000 to 100,000 clients (a benchmark).

Every size runs in a fresh process (its peak RSS is that run's): the real ServerApp loop and the
real ClientApp in process (``experiments.inprocess.run_inprocess``), the FedAvg "2NN" MLP on
generated data (:func:`blobs`: ``per`` examples per client, ``dim`` features, 10 classes) with
an ``iid`` partition, so every client has data, 5 local steps, sine availability (about 16 % of
the clients per round), fedavg-active, central evaluation only after the last round, no
checkpoints. Seconds per round: the median ``round-time`` (wall) of the rounds after the first;
CPU s/round: the process's CPU time over the whole run (setup included) / rounds, the figure to
trust on a loaded machine.

    python benchmarks/scale.py                                  # 1,000 and 10,000 clients, both engines
    python benchmarks/scale.py --clients 100000 --engine cohort --rounds 3
    python benchmarks/scale.py --clients 1000 --strategy fedavg-active:stream=false   # hold every reply

Peak memory: ``ru_maxrss`` of the run's process; ``--tracemalloc`` adds the peak of Python's
allocations during the rounds (slower).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def blobs(seed: int, num_clients: int, per: int = 4, dim: int = 32, classes: int = 10):
    """``per`` examples per client of 10 Gaussian blobs in ``dim`` features (and a 2,000-example
    test set): (x_train, y_train, x_test, y_test) as float32 / int64 arrays."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 2, (classes, dim)).astype(np.float32)

    def draw(n: int):
        y = rng.integers(0, classes, n)
        return (centres[y] + rng.normal(0, 1, (n, dim)).astype(np.float32)), y.astype(np.int64)

    return (*draw(num_clients * per), *draw(2000))


def one_run(clients: int, engine: str, rounds: int, strategy: str, use_tracemalloc: bool) -> dict:
    """One run in this process; its figures."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from experiments.inprocess import run_inprocess

    overrides = {
        "num-clients": clients, "num-server-rounds": rounds, "strategy": strategy, "engine": engine,
        "dataset": "scale:blobs:per=4,dim=32", "partition": "iid", "model": "mlp",
        "local-steps": "steps:n=5", "batch-size": 4, "lr": 0.05, "availability": "sine:gamma=0.3,period=20",
        "eval-every": 0, "checkpoint-every": 0, "progress": False,
        "results-dir": tempfile.mkdtemp(prefix="scale-"), "wait-for-nodes": 0.0,
    }
    if use_tracemalloc:
        import tracemalloc

        tracemalloc.start()
    t0, cpu0 = time.monotonic(), time.process_time()
    folder = run_inprocess(overrides)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    traced = tracemalloc.get_traced_memory()[1] if use_tracemalloc else None
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["round-time"] for r in rows[1:]] or [rows[0]["round-time"]]
    config = json.loads((folder / "config.json").read_text())
    return {"clients": clients, "engine": config.get("engine-used", engine), "rounds": rounds,
            "participants": float(np.mean([len(r["participants"]) for r in rows])),
            "s_per_round": float(np.median(times)), "first_round_s": rows[0]["round-time"], "wall_s": wall,
            "cpu_s_per_round": cpu / rounds,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "traced_peak_gb": None if traced is None else traced / 2**30,
            "aggregation": config.get("aggregation", "(not recorded)"), "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--engine", nargs="+", default=["per-client", "cohort"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--strategy", default="fedavg-active")
    ap.add_argument("--tracemalloc", action="store_true")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args()
    if args.one:
        sys.path.insert(0, str(HERE))  # the loader "scale:blobs"
        print(json.dumps(one_run(args.clients[0], args.engine[0], args.rounds, args.strategy, args.tracemalloc)))
        return
    print(f"{'clients':>8} {'engine':>10} {'particip.':>9} {'s/round':>8} {'round 1 s':>9} {'CPU s/rnd':>9} {'peak RSS GB':>11} "
          f"{'traced GB':>9} {'load':>5}  aggregation")
    for n in args.clients:
        for engine in args.engine:
            cmd = [sys.executable, __file__, "--one", "--clients", str(n), "--engine", engine,
                   "--rounds", str(args.rounds), "--strategy", args.strategy] + (["--tracemalloc"] * args.tracemalloc)
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.environ.get(
                "PYTHONPATH", str(HERE.parent))})
            if out.returncode:
                print(f"{n:>8} {engine:>10} failed: {out.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(out.stdout.strip().splitlines()[-1])
            traced = "-" if r["traced_peak_gb"] is None else f"{r['traced_peak_gb']:.2f}"
            print(f"{n:>8} {r['engine']:>10} {r['participants']:>9.0f} {r['s_per_round']:>8.2f} {r['first_round_s']:>9.2f} "
                  f"{r['cpu_s_per_round']:>9.2f} {r['peak_rss_gb']:>11.2f} {traced:>9} {r['load']:>5.1f}  {r['aggregation']}", flush=True)


if __name__ == "__main__":
    main()
