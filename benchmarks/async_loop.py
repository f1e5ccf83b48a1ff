"""What the asynchronous loop itself costs per arrival (no training): ``python benchmarks/async_loop.py``.

An in-process run of FedAsync and FedBuff (K = 10) on the ``quadratic`` workload with N clients
whose ClientApp echoes the model it was sent (Δ = 0: no training, the reply checks still run), a
sine schedule on the default clock and uneven local steps. Prints, per N, the wall seconds per
arrival of the whole loop (events, dispatch, reply checks, the rule, the rows) and the process's
maximum resident memory so far. Figures vary with load: run it on an idle machine and say the load.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from flwr.app import Message, MessageType, MetricRecord, RecordDict

from client_app.app import app as client_app
from experiments.inprocess import run_inprocess
from server_app.results import read_metrics


def echo(msg: Message, context) -> Message:
    if msg.metadata.message_type != MessageType.TRAIN:  # identity queries: the project's ClientApp
        return client_app(msg, context)
    pid = int(context.node_config["partition-id"])
    content = RecordDict({"arrays": msg.content["arrays"],
                          "metrics": MetricRecord({"num-examples": 10, "client-id": pid, "num-steps": 1})})
    return Message(content, reply_to=msg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--aggregations", type=int, default=300)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}")
    for n in args.clients:
        for spec in ("fedasync", "fedbuff:k=10"):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                d = run_inprocess({"strategy": spec, "num-clients": n, "dataset": "quadratic", "model": "quadratic", "partition": "natural",
                                   "num-server-rounds": args.aggregations, "eval-every": 0, "checkpoint-every": 0,
                                   "local-steps": "epochs:min=1,max=3", "availability": "on-off:p=0.8,q=0.2,spread=0.1",
                                   "results-dir": tmp, "run-name": "b", "progress": False}, client_app=echo)
                wall = time.perf_counter() - t0
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                rows = read_metrics(d)
                arrivals = sum(len(r["arrivals"]) + len(r["rejected"]) + r["unavailable-nodes"] for r in rows)
                loop = rows[-1]["wall-time"]  # from the loop's start to the last row: no setup, no plots
                print(f"N={n:>6} {spec:<13} {len(rows)} aggregations, {arrivals} arrivals; loop {loop:.2f} s = "
                      f"{1e3 * loop / max(arrivals, 1):.2f} ms per arrival; whole run {wall:.1f} s; "
                      f"max RSS so far {peak:.0f} MiB")


if __name__ == "__main__":
    main()
