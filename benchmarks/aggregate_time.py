"""``aggregate_train`` time of every rule against Flower's own FedAvg (a benchmark, not a test).

The same R replies (real Flower Messages, default 100) of a d-parameter float32 model (default
10^6, in 4 arrays) go through ``aggregate_train`` of every registered rule (N = R clients, all
replying, every check of :mod:`strategies.replies` and :mod:`strategies.bounds` in place) and of
``flwr.serverapp.strategy.FedAvg``. Each is timed over ``--rounds`` rounds after one untimed
warm-up round (the tables become resident); the table prints the median time and
the ratio of the medians to Flower's, in wall-clock and in CPU (process) time, and the
machine's load average before and after (``os.getloadavg``). Every round of
a rule is timed right beside a round of Flower's FedAvg, so that the machine's load drifts alike
for both; on a shared machine the CPU-time ratio is the steadier figure.

A rule whose math is more than a weighted sum also gets its **inherent work** timed beside it
(:data:`INHERENT`): a minimal numpy implementation of that math on the same flat vectors (the
round's Δ_i stacked as an m × d float32 matrix, made untimed), with whole-array numpy and BLAS
calls: MIFA, Stale, FedVARP, FedStale, ClusterFedVARP the table's rows replaced and its mean
(two gemv of the old and new rows, one copy); FL-FDMS the similarity Gram D Dᵀ (one BLAS call);
FedAWARE the momentum update, the N × N Gram (one BLAS call), its min-norm solver and Σ λ_i m̂_i;
FedAWE and FedPBC the second model-sized array each reply carries (u_i): receiving it is a second
FedAvg-sized pass, timed as one more round of Flower's FedAvg on replies of the same size
(:data:`SECOND_ARRAY`), plus x̄'s float64 update. Their last ratio is then against twice
Flower's FedAvg (and x̄); their consistency check (``check-start``) is not counted as inherent.
SCAFFOLD and Amplified SCAFFOLD likewise receive Δc_i beside Δy_i (a second Flower FedAvg round,
which also computes c's update); their c_i bound's sketch is not counted as inherent.
Any rule must also receive the replies, which is what Flower's FedAvg does: the table's last
columns are the baseline Flower + inherent and the rule's ratio to it (CPU time).

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
import os
import time
import uuid

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity

from strategies import ORACLES, STRATEGIES, build_strategy, named_arrays
from strategies.payloads import Payload
from strategies.protocol import A_NORM, CLIENT_ID, LR, NUM_EXAMPLES, NUM_STEPS, TRAIN_LOSS

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

    def send_and_receive(self, messages, *, timeout=None) -> list:  # FedAWE's round-end broadcast: untimed, unanswered
        return []


def model_arrays(dim: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    sizes = [dim // 2, dim // 4, dim // 8, dim - dim // 2 - dim // 4 - dim // 8]
    return {f"layer{i}": rng.normal(size=s).astype(np.float32) for i, s in enumerate(sizes)}


def replies_for(sent: list[Message], x: dict[str, np.ndarray], payloads: tuple[Payload, ...],
                seed: int) -> list[Message]:
    """Honest replies to ``sent``: x + small noise, with every payload the rule declares it reads
    back (``Rule.reads``): a scalar as 1 (FedAWE's echo factor), a model-sized one as the reply's
    own change (FedAWE's u_i with factor 1, SCAFFOLD's Δc_i)."""
    rng = np.random.default_rng(seed)
    out = []
    for c, msg in enumerate(sent):
        arrays = {k: v + np.float32(0.01) * (rng.random(v.shape, np.float32) - np.float32(0.5)) for k, v in x.items()}
        for p in payloads:
            if p.scalar:
                arrays[p.key] = np.array([1.0], np.float32)
            else:
                arrays.update({p.key + k: arrays[k] - x[k] for k in x})
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
    replies = replies_for(sent, x, (), rnd)
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    strategy.aggregate_train(rnd, replies)
    return time.perf_counter() - start, time.process_time() - cpu


# ----------------------------------------------------------------- inherent work per rule
def table_update(state: dict, deltas: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """The stored-update rules' table: rows 0..m-1 replaced by the round's Δ_i (× scale), the
    running float64 sum following by the old and new rows' sums (two gemv), the mean returned."""
    table, total = state.setdefault("table", np.zeros_like(deltas)), state.setdefault("sum", np.zeros(deltas.shape[1]))
    ones = np.ones(len(deltas), np.float32)
    total -= ones @ table
    if scale == 1.0:
        np.copyto(table, deltas)
    else:
        np.multiply(deltas, np.float32(scale), out=table)
    total += ones @ table
    return total / len(table)


def fdms_similarity(state: dict, deltas: np.ndarray) -> np.ndarray:
    """FL-FDMS's pairwise cosine similarities of the round's updates: one Gram product."""
    gram = (deltas @ deltas.T).astype(np.float64)
    norms = np.sqrt(np.diag(gram))
    return gram / np.outer(norms, norms)


def fedaware_round(state: dict, deltas: np.ndarray, alpha: float = 0.5) -> np.ndarray:
    """FedAWARE: m_i ← α m_i − (1 − α) Δ_i, the N × N Gram of the momenta (one BLAS call), the
    min-norm weights of the normalised momenta, and Σ λ_i m_i / ‖m_i‖."""
    from strategies.rules.fedaware import min_norm_weights

    momenta = state.setdefault("momenta", np.zeros_like(deltas))
    for row, delta in zip(momenta, deltas, strict=True):
        row *= np.float32(alpha)
        row -= np.float32(1 - alpha) * delta
    gram = (momenta @ momenta.T).astype(np.float64)
    norms = np.sqrt(np.diag(gram))
    lam = min_norm_weights(gram / np.outer(norms, norms))
    return (lam / norms).astype(np.float32) @ momenta


def echo_round(state: dict, deltas: np.ndarray) -> np.ndarray:
    """FedAWE / FedPBC beyond receiving u_i (:data:`SECOND_ARRAY`): x̄'s update, three float64
    operations on d-vectors (as x̄ ← x̄ + (m x^{t+1} − Σ x_i^{t,0}) / N)."""
    u = np.asarray(deltas[0], np.float64)
    xbar = state.setdefault("xbar", np.zeros(deltas.shape[1]))
    xbar += (len(deltas) * u - u) / len(deltas)
    return xbar


def second_array_only(state: dict, deltas: np.ndarray) -> None:
    """SCAFFOLD / Amplified SCAFFOLD beyond receiving Δc_i (:data:`SECOND_ARRAY`): nothing (c's
    update is the mean of the Δc_i, which receiving them as a FedAvg round computes)."""


INHERENT = {  # rule -> its math beyond receiving the replies, on the stacked Δ_i
    "mifa": lambda st, d: table_update(st, d, 1 / 0.1),  # gradient units: Δ_i / lr
    "stale": table_update, "fedvarp": table_update, "fedstale": table_update, "cluster-fedvarp": table_update,
    "fl-fdms": fdms_similarity, "fedaware": fedaware_round, "fedawe": echo_round, "fedpbc": echo_round,
    "scaffold": second_array_only, "amplified-scaffold": second_array_only,
}
# rules whose replies carry a second model-sized array (FedAWE's u_i, SCAFFOLD's Δc_i): receiving
# it is inherent, timed as a second round of Flower's FedAvg on replies of the same size
SECOND_ARRAY = ("fedawe", "fedpbc", "scaffold", "amplified-scaffold")


def stacked_deltas(replies: list[Message], x: dict[str, np.ndarray]) -> np.ndarray:
    """The replies' Δ_i = x_i − x as one m × d float32 matrix (untimed)."""
    flat = np.concatenate([v.ravel() for v in x.values()])
    rows = [np.concatenate([a.numpy().ravel() for a in m.content.array_records["arrays"].values()]) for m in replies]
    return np.stack(rows) - flat


def time_side_by_side(spec: str, n: int, x: dict[str, np.ndarray],
                      rounds: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rule's, Flower FedAvg's, the rule's inherent work's or None) (wall, CPU) seconds per
    round, one round of each in turn, after one untimed round of each (the rule's tables and
    buffers become resident): the machine's load drifts alike for all."""
    extra = {"probabilities": (lambda t: np.full(n, 0.5))} if spec.split(":")[0] in ORACLES else {}
    strategy = build_strategy(spec, num_clients=n, **extra)
    flower, second = FedAvg(), FedAvg()
    nodes = list(range(1000, 1000 + n))
    ours, theirs, inherent = [], [], []
    math = INHERENT.get(spec.split(":")[0])
    state: dict = {}
    arrays = named_arrays(x)
    for rnd in range(1, rounds + 2):
        sent = list(strategy.configure_train(rnd, arrays, ConfigRecord(), Grid(nodes)))
        for m in sent:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        current = {k: arrays[k].numpy() for k in arrays.keys()}
        replies = replies_for(sent, current, strategy.reads, rnd)
        gc.collect()
        start, cpu = time.perf_counter(), time.process_time()
        out, _ = strategy.aggregate_train(rnd, replies)
        elapsed = (time.perf_counter() - start, time.process_time() - cpu)
        assert len(strategy.round_log.rejected) == 0, strategy.round_log.rejected[:3]
        arrays = out
        del replies
        gc.collect()
        flower_time = flower_round(flower, rnd, current, n)
        if math is not None:
            deltas = stacked_deltas(replies_for(sent, current, (), rnd), current)
            gc.collect()
            start, cpu = time.perf_counter(), time.process_time()
            math(state, deltas)
            spent = (time.perf_counter() - start, time.process_time() - cpu)
            del deltas
            if spec.split(":")[0] in SECOND_ARRAY:
                receive = flower_round(second, rnd, current, n)
                spent = (spent[0] + receive[0], spent[1] + receive[1])
            inherent.append(spent)
        if rnd > 1:
            ours.append(elapsed)
            theirs.append(flower_time)
    del strategy, state
    gc.collect()
    return np.array(ours), np.array(theirs), np.array(inherent[1:]) if inherent else None


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
    print(f"{args.replies} replies, d = {args.dim}: aggregate_train, median of {args.rounds} rounds, each beside a "
          "round of Flower's FedAvg on replies of the same size; wall and CPU (process) time in ms; "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    print(f"| {'rule':34s} | rule wall | flwr wall | ratio | rule CPU | flwr CPU | ratio | inherent CPU | "
          "flwr + inherent | ratio |")
    print(f"|{'-' * 36}|-----------|-----------|-------|----------|----------|-------|--------------|"
          "-----------------|-------|")
    for name in args.rules:
        spec = SPECS.get(name, name).format(r=args.replies)
        ours, theirs, inherent = time_side_by_side(spec, args.replies, x, args.rounds)
        (ow, oc), (tw, tc) = np.median(ours, axis=0), np.median(theirs, axis=0)
        extra = "|              |                 |       |"
        if inherent is not None:
            ic = np.median(inherent, axis=0)[1]
            extra = f"| {1e3 * ic:12.1f} | {1e3 * (tc + ic):15.1f} | {oc / (tc + ic):5.2f} |"
        print(f"| {spec:34s} | {1e3 * ow:9.1f} | {1e3 * tw:9.1f} | {ow / tw:5.2f} | {1e3 * oc:8.1f} | "
              f"{1e3 * tc:8.1f} | {oc / tc:5.2f} {extra}", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
