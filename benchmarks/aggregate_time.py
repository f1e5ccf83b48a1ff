"""``aggregate_train`` time of every rule against Flower's own FedAvg (a benchmark, not a test).

The same R replies (real Flower Messages, default 100) of a d-parameter float32 model (default
10^6, in 4 arrays) go through ``aggregate_train`` of every registered rule (N = R clients, all
replying, every check of :mod:`strategies.replies` and :mod:`strategies.bounds` in place) and of
``flwr.serverapp.strategy.FedAvg``. Each is timed over ``--rounds`` rounds after one untimed
warm-up round (the tables become resident); the table prints the best time and
the ratio of the best to Flower's best, in wall-clock and in CPU (process) time. Every round of
a rule is timed right beside a round of Flower's FedAvg, so that the machine's load drifts alike
for both; on a shared machine the CPU-time ratio is the steadier figure.

    python benchmarks/aggregate_time.py                       # every rule, R = 100, d = 10^6
    python benchmarks/aggregate_time.py --rules fedavg-active mifa --rounds 5
    python benchmarks/aggregate_time.py --rules fedavg-active fedavg-active:robust=median   # robust rows
    OPENBLAS_NUM_THREADS=1 python benchmarks/aggregate_time.py   # on a shared host: BLAS threads
                                                                 # inflate the CPU time of norms
"""

from __future__ import annotations

import argparse
import gc
import logging
import time
import uuid

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from strategies import ORACLES, STRATEGIES, build_strategy, named_arrays
from strategies.protocol import (
    A_NORM,
    CLIENT_ID,
    FEDAWE_ECHO_FACTOR,
    FEDAWE_UPDATE_PREFIX,
    LR,
    NUM_EXAMPLES,
    NUM_STEPS,
    TRAIN_LOSS,
)

# how a rule is built here: every node trains (power-of-choice without probes, d = m = R)
SPECS = {"pow-d": "pow-d:variant=rpow-d,d={r},m={r}", "mifa": "mifa:gradient-units=true"}
# extra rows: the optional robust aggregation (spec key robust, strategies/robust.py)
ROBUST_ROWS = ("fedavg-active:robust=median", "fedavg-active:robust=trimmed-mean", "fedavg-active:robust=clip",
               "fednova:robust=median")


class Grid:
    """The smallest grid ``configure_train`` needs."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return self.nodes


def model_arrays(dim: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    sizes = [dim // 2, dim // 4, dim // 8, dim - dim // 2 - dim // 4 - dim // 8]
    return {f"layer{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(sizes)}


def replies_for(sent: list[Message], x: dict[str, np.ndarray], fedawe: bool, seed: int) -> list[Message]:
    rng = np.random.default_rng(seed)
    out = []
    for c, msg in enumerate(sent):
        arrays = {k: v + np.float32(0.01) * (rng.random(v.shape, np.float32) - np.float32(0.5)) for k, v in x.items()}
        if fedawe:
            arrays[FEDAWE_ECHO_FACTOR] = np.array([1.0], np.float32)
            arrays.update({FEDAWE_UPDATE_PREFIX + k: arrays[k] - x[k] for k in x})
        metrics = {NUM_EXAMPLES: 50 + c, CLIENT_ID: c, NUM_STEPS: 10, A_NORM: 10.0, LR: 0.1, TRAIN_LOSS: 1.0}
        reply = Message(RecordDict({"arrays": named_arrays(arrays), "metrics": MetricRecord(metrics)}),
                        reply_to=msg)
        out.append(reply)
    return out


def flower_round(strategy: FedAvg, rnd: int, x: dict[str, np.ndarray], n: int) -> tuple[float, float]:
    """One timed ``aggregate_train`` of Flower's FedAvg on n plain replies to x."""
    sent = [Message(RecordDict({"arrays": named_arrays(x), "config": ConfigRecord()}), dst_node_id=1000 + i,
                    message_type="train") for i in range(n)]
    for m in sent:
        m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    replies = replies_for(sent, x, False, rnd)
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    strategy.aggregate_train(rnd, replies)
    return time.perf_counter() - start, time.process_time() - cpu


def time_side_by_side(spec: str, n: int, x: dict[str, np.ndarray], rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """(rule's, Flower FedAvg's) (wall, CPU) seconds per round, one round of each in turn, after one
    untimed round of each (the rule's tables and buffers become resident): the machine's load
    drifts alike for both."""
    extra = {"probabilities": (lambda t: np.full(n, 0.5))} if spec.split(":")[0] in ORACLES else {}
    strategy = build_strategy(spec, num_clients=n, **extra)
    flower = FedAvg()
    nodes = list(range(1000, 1000 + n))
    ours, theirs = [], []
    arrays = named_arrays(x)
    for rnd in range(1, rounds + 2):
        sent = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)))
        for m in sent:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        current = {k: arrays[k].numpy() for k in arrays.keys()}
        replies = replies_for(sent, current, spec.startswith("fedawe"), rnd)
        gc.collect()
        start, cpu = time.perf_counter(), time.process_time()
        out, _ = strategy.aggregate_train(rnd, replies)
        elapsed = (time.perf_counter() - start, time.process_time() - cpu)
        assert len(strategy.round_log.rejected) == 0, strategy.round_log.rejected[:3]
        arrays = out
        del replies
        gc.collect()
        flower_time = flower_round(flower, rnd, current, n)
        if rnd > 1:
            ours.append(elapsed)
            theirs.append(flower_time)
    del strategy
    gc.collect()
    return np.array(ours), np.array(theirs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replies", type=int, default=100)
    ap.add_argument("--dim", type=int, default=10**6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rules", nargs="*", default=[*sorted(STRATEGIES), *ROBUST_ROWS],
                    help="rule names or specs (e.g. fedavg-active:robust=median)")
    args = ap.parse_args()
    TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = 1  # Message() needs them
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's FedAvg logs every round
    x = model_arrays(args.dim, np.random.default_rng(0))
    print(f"{args.replies} replies, d = {args.dim}: aggregate_train, best of {args.rounds} rounds, each beside a "
          "round of Flower's FedAvg on replies of the same size; wall and CPU (process) time in ms")
    print(f"| {'rule':34s} | rule wall | flwr wall | ratio | rule CPU | flwr CPU | ratio |")
    print(f"|{'-' * 36}|-----------|-----------|-------|----------|----------|-------|")
    for name in args.rules:
        spec = SPECS.get(name, name).format(r=args.replies)
        ours, theirs = time_side_by_side(spec, args.replies, x, args.rounds)
        (ow, oc), (tw, tc) = ours.min(axis=0), theirs.min(axis=0)
        print(f"| {spec:34s} | {1e3 * ow:9.1f} | {1e3 * tw:9.1f} | {ow / tw:5.2f} | {1e3 * oc:8.1f} | "
              f"{1e3 * tc:8.1f} | {oc / tc:5.2f} |", flush=True)

if __name__ == "__main__":
    main()
