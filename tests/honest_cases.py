"""Honest heterogeneity through the real strategies (issue 39, item 1): the cases, the clients, the runs.

Honest clients train a softmax regression (5 classes, 8 features: 45 parameters) on their own
synthetic data with plain SGD (batches of 16, lr 0.05, as the ClientApp's solver) and reply as the
ClientApp does (model, ``num-examples``, ``num-steps``, ``a-norm`` = num-steps, ``train-loss``,
``client-id``; SCAFFOLD's and Amplified SCAFFOLD's clients keep c_i and correct every step by c − c_i,
Karimireddy et al. 2020 Alg. 1 option II; FedAWE's and FedPBC's clients are approximated as starting
from x^t, echo factor 1). A case is who replies in which round, with which data and local work
(:data:`CASES`); :func:`run_sync` runs it through any registered rule (mocked messages, the rule's
real ``configure_train`` / ``aggregate_train``), :func:`run_async` through FedAsync and FedBuff's
arrivals (job times per client, a virtual clock). Each returns the final model and every rejected
or cut reply, with the bounds at their defaults or off (``max-update-norm=0``, ``max-norm-ratio=0``,
``max-examples-ratio=0``, FedNova's ``max-steps-ratio=0``: the papers' rules).
"""

from __future__ import annotations

import heapq
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from flwr.supercore.task_identity import TaskIdentity
from replies import build_rule, rule_reply, start_round

from strategies import named_arrays
from strategies.protocol import SCAFFOLD_C_PREFIX, SCAFFOLD_DC_PREFIX

K, F = 5, 8  # classes, features
DIM = K * (F + 1)
MEANS = np.random.default_rng(0).normal(0, 3.0, (K, F))
LR, BATCH = 0.05, 16
SHIFT = np.array([3, 4, 0, 1, 2])  # the distribution shift's label permutation (no label kept)
OFF = "max-update-norm=0,max-norm-ratio=0,max-examples-ratio=0"


def loss_and_grad(w: np.ndarray, X: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    W, b = w[: K * F].reshape(K, F), w[K * F:]
    z = X @ W.T + b
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    loss = float(-np.log(p[np.arange(len(y)), y] + 1e-12).mean())
    p[np.arange(len(y)), y] -= 1.0
    p /= len(y)
    return loss, np.concatenate([(p.T @ X).ravel(), p.sum(axis=0)])


@dataclass
class Client:
    cid: int
    X: np.ndarray
    y: np.ndarray
    steps: int
    dtype: type = np.float32
    c: np.ndarray | None = None  # SCAFFOLD's c_i
    warm_up: int = 0  # the learning rate grows x10 over the first warm_up rounds (LR / 10 in round 1)
    shift_at: int = 0  # from this round on (0: never) every label y reads SHIFT[y] (a new task)

    def train(self, x: np.ndarray, t: int, c_server: np.ndarray | None = None) -> tuple[np.ndarray, dict, dict]:
        rng = np.random.default_rng((self.cid, t))
        lr = LR * 10.0 ** (min(t - 1, self.warm_up) / self.warm_up - 1.0) if self.warm_up else LR
        labels = SHIFT[self.y] if self.shift_at and t >= self.shift_at else self.y
        w = x.astype(np.float64)
        shift = None if c_server is None else c_server - (self.c if self.c is not None else 0.0)
        total, loss = np.zeros(DIM), 0.0
        for _ in range(self.steps):
            idx = rng.integers(0, len(self.y), min(BATCH, len(self.y)))
            loss, g = loss_and_grad(w, self.X[idx], labels[idx])
            total += g
            w = w - lr * (g if shift is None else g + shift)
            if self.dtype is not np.float32:
                w = w.astype(self.dtype).astype(np.float64)
        model = w.astype(self.dtype).astype(np.float32)
        extra = {}
        if c_server is not None:  # option II with plain SGD: c_i^+ = the mean raw gradient
            new = total / self.steps
            extra[SCAFFOLD_DC_PREFIX + "w"] = (new - (self.c if self.c is not None else 0.0)).astype(np.float32)
            self.c = new
        metrics = {"num-examples": len(self.y), "num-steps": self.steps, "a-norm": float(self.steps),
                   "train-loss": loss}
        return model, metrics, extra


def make_client(rng: np.random.Generator, cid: int, size: int, labels: list[int], steps: int = 10,
                noisy: bool = False, dtype: type = np.float32) -> Client:
    y = rng.choice(labels, size)
    X = MEANS[y] + rng.normal(0, 1.0, (size, F))
    if noisy:  # labels unrelated to the features, features 3x larger: a loss far above the others'
        y, X = rng.integers(0, K, size), 5 * X
    return Client(cid, X.astype(np.float64), y, steps, dtype)


@dataclass
class Case:
    """``who(t)``: the client ids replying in round t (1-based), in arrival order."""

    name: str
    clients: list[Client]
    rounds: int
    who: Callable[[int], list[int]]
    speeds: dict[int, float] = field(default_factory=dict)  # async: seconds per job


def dirichlet_labels(rng, n, alpha=0.5) -> list[list[int]]:
    out = []
    for _ in range(n):
        p = rng.dirichlet([alpha] * K)
        out.append(sorted({int(v) for v in rng.choice(K, 3, p=p)}))
    return out


def case(name: str) -> Case:
    rng = np.random.default_rng(sum(map(ord, name)))
    everyone = list(range(8))
    labels = dirichlet_labels(rng, 8)
    if name.startswith("back-"):  # client 7 trains in round 1 and returns after `away` rounds
        away = int(name.split("-")[1])
        clients = [make_client(rng, c, 60, labels[c]) for c in range(8)]
        return Case(name, clients, away + 3, lambda t: everyone if t == 1 or t >= away + 2 else everyone[:7],
                    {c: 5.0 + c for c in range(8)})
    if name == "steps-by-size":  # local epochs over the data: 1-250 steps
        sizes = [8, 16, 40, 100, 250, 600, 1500, 4000]
        clients = [make_client(rng, c, s, labels[c], steps=min(250, -(-s // BATCH))) for c, s in enumerate(sizes)]
        return Case(name, clients, 8, lambda t: everyone, {c: 1.0 + cl.steps / 10 for c, cl in enumerate(clients)})
    if name == "sizes-1-10000":
        sizes = [1, 3, 10, 30, 100, 1000, 3000, 10000]
        clients = [make_client(rng, c, s, labels[c]) for c, s in enumerate(sizes)]
        return Case(name, clients, 8, lambda t: everyone, {c: 5.0 + c for c in range(8)})
    if name == "newcomer-labels":  # client 7 joins in round 6 with the one label no other client has
        clients = [make_client(rng, c, 60, [0, 1, 2, 3]) for c in range(7)] + [make_client(rng, 7, 60, [4])]
        return Case(name, clients, 12, lambda t: everyone if t >= 6 else everyone[:7], {c: 5.0 + c for c in range(8)})
    if name == "fp16":
        clients = [make_client(rng, c, 60, labels[c], dtype=np.float16 if c == 3 else np.float32) for c in range(8)]
        return Case(name, clients, 8, lambda t: everyone, {c: 5.0 + c for c in range(8)})
    if name == "loss-100x":
        clients = [make_client(rng, c, 60, labels[c], noisy=c == 5) for c in range(8)]
        return Case(name, clients, 8, lambda t: everyone, {c: 5.0 + c for c in range(8)})
    if name == "mixed":  # the CI's compact case: steps with data size, fp16, a noisy client, a newcomer
        sizes = [8, 30, 60, 100, 250, 60, 600, 60]
        clients = [make_client(rng, c, s, [0, 1, 2, 3] if c < 7 else [4], steps=min(250, -(-s // BATCH)),
                               noisy=c == 5, dtype=np.float16 if c == 6 else np.float32) for c, s in enumerate(sizes)]
        return Case(name, clients, 10, lambda t: everyone if t >= 4 else everyone[:7], {c: 5.0 + c for c in range(8)})
    if name.startswith("warm-up"):  # every client's learning rate x10 over the first 5 rounds (LR / 10 to
        # LR); "warm-up-noisy": every client's labels unrelated to its features, so that its gradients
        # do not shrink as it trains and its update grows with the learning rate (x10)
        clients = [make_client(rng, c, 60, labels[c], noisy=name.endswith("noisy")) for c in range(8)]
        for cl in clients:
            cl.warm_up = 5
        return Case(name, clients, 12, lambda t: everyone, {c: 5.0 + c for c in range(8)})
    if name == "shift":  # every client's labels permuted from round 7 on (a new task mid-run)
        clients = [make_client(rng, c, 60, labels[c]) for c in range(8)]
        for cl in clients:
            cl.shift_at = 7
        return Case(name, clients, 14, lambda t: everyone, {c: 5.0 + c for c in range(8)})
    if name.startswith("round-"):  # n clients, all replying, lognormal data sizes, label skew
        n = int(name.split("-")[1])
        labels = dirichlet_labels(rng, n)
        sizes = np.clip(rng.lognormal(4.0, 1.0, n).astype(int), 2, 5000)
        clients = [make_client(rng, c, int(sizes[c]), labels[c]) for c in range(n)]
        order = list(range(n))
        return Case(name, clients, 3, lambda t: [int(i) for i in np.random.default_rng(t).permutation(order)],
                    {c: 5.0 + 10.0 * rng.random() for c in range(n)})
    raise ValueError(name)


CASES = ["back-10", "back-50", "back-150", "steps-by-size", "sizes-1-10000", "newcomer-labels", "fp16",
         "loss-100x", "warm-up", "warm-up-noisy", "shift", "round-200", "round-1000"]
TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = 1  # Message() needs them (conftest does too)
X0 = np.random.default_rng(1).normal(0, 0.1, DIM).astype(np.float32)


def off_spec(name: str) -> str:
    base = "pow-d:variant=rpow-d," if name == "pow-d" else f"{name}:"
    return base + OFF + (",max-steps-ratio=0" if name == "fednova" else "")


def spec_of(name: str, bounds: bool | str) -> str:
    if bounds is True:
        return ""
    base = "pow-d:variant=rpow-d," if name == "pow-d" else f"{name}:"
    return off_spec(name) if bounds is False else base + bounds


@dataclass
class Result:
    x: np.ndarray
    replies: int = 0
    rejected: list = field(default_factory=list)  # (round, node, reason)
    cut: int = 0  # num-examples cut, updates clipped or participation weights capped


def run_sync(name: str, c: Case, bounds: bool | str = True) -> Result:
    """``bounds``: True (the defaults), False (off: :func:`off_spec`) or a spec's keys (``max-norm-ratio=1e6``)."""
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    try:
        n = len(c.clients)
        s = build_rule(name, n=n, spec=spec_of(name, bounds), max_failed_rounds=0)
        x, out = X0.copy(), Result(X0)
        for t in range(1, c.rounds + 1):
            who = c.who(t)
            sent = start_round(s, t, x, [100 + i for i in who])
            replies = []
            for i in who:
                if 100 + i not in sent:
                    continue
                msg = sent[100 + i]
                arrays = msg.content["arrays"]
                c_server = arrays[SCAFFOLD_C_PREFIX + "w"].numpy().astype(np.float64) if SCAFFOLD_C_PREFIX + "w" in arrays else None
                model, metrics, extra = c.clients[i].train(x, t, c_server)
                replies.append(rule_reply(name, msg, model, i, model - x, arrays=extra or None, **metrics))
            arrays, metrics = s.aggregate_train(t, replies)
            x = arrays["w"].numpy()
            out.replies += len(replies)
            out.rejected += [(t, node, why) for node, why in s.round_log.rejected]
            out.cut += sum(int(metrics.get(k, 0)) for k in ("num-examples-clipped", "num-clipped", "weights-capped"))
        out.x = x
        return out
    finally:
        flwr_log.setLevel(level)


def run_async(name: str, c: Case, bounds: bool | str = True, horizon: float | None = None) -> Result:
    """Every client of the case that is in ``who`` at the time's round (one round per 10 s) keeps
    one job in flight; jobs take ``speeds[c]`` seconds; arrivals in time order."""
    from strategies import build_strategy

    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    try:
        n = len(c.clients)
        s = build_strategy(spec_of(name, bounds) or name, num_clients=n, max_failed_rounds=0)
        s.begin(named_arrays({"w": X0}))
        out = Result(X0)
        horizon = horizon or 10.0 * c.rounds
        events: list[tuple[float, int, int]] = []
        busy: set[int] = set()
        seq = 0

        def dispatch(now: float) -> None:
            nonlocal seq
            for i in c.who(int(now // 10) + 1):
                if i not in busy:
                    msg, version = s.job(100 + i, seq + 1)
                    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                    jobs[seq] = (i, msg, version, now)
                    heapq.heappush(events, (now + c.speeds[i], seq, i))
                    busy.add(i)
                    seq += 1

        jobs: dict[int, tuple] = {}
        dispatch(0.0)
        while events:
            now, key, i = heapq.heappop(events)
            if now > horizon:
                break
            _, msg, version, started = jobs.pop(key)
            busy.discard(i)
            start = s.snapshots.get(version, s.current)
            model, metrics, _ = c.clients[i].train(start, key + 1)
            from replies import reply
            o = s.arrive(reply(msg, model, **{"client-id": i, **metrics}), msg, version, {100 + j for j in range(n)}, now)
            out.replies += 1
            if o.reason and not o.unavailable:
                out.rejected.append((now, 100 + i, o.reason))
            dispatch(now)
        out.x = s.current.copy()
        return out
    finally:
        flwr_log.setLevel(level)


class Recorder:
    """While active, every reply a norm bound judges records ``norm / (reference x widening)``
    (the multiple of the reference the ratio test compares with ``max-norm-ratio``), per bound
    kind: ``update`` (the first norm check) and ``other`` (Δc_i, FedAWE's distance); and ``growth``,
    the largest latest / first of the update norms' references, and ``over_first``, the largest
    update norm / (the first norms' reference x widening): what ``max-norm-ratio`` x
    ``max-reference-growth`` must exceed; and among the update norms widened at all, the largest
    work factor, gap factor, their product (``work``, ``gap``, ``product``) and norm / reference
    without widening (``unwidened``): how much of the widening honest replies use."""

    def __init__(self) -> None:
        self.ratios: dict[str, list[float]] = {"update": [], "other": []}
        self.growth = 1.0  # the largest latest / first of the update norms' references (lower medians over nodes)
        self.over_first = 0.0  # the largest update norm / (the nodes' first norms' reference x widening)
        # the widenings honest replies used (update norms, replies widened at all): the largest work
        # factor, gap factor and their product, and the largest norm / reference WITHOUT widening
        self.work = self.gap = self.product = self.unwidened = 0.0

    def __enter__(self) -> Recorder:
        from strategies import bounds as bounds_module

        original = self._original = bounds_module.NormBounds.check
        recorder = self

        def check(bounds, reports, norm_of, node_of, reject, *args, **kwargs):
            kept = original(bounds, reports, norm_of, node_of, reject, *args, **kwargs)
            ref, work = bounds.last_reference, bounds.work.fixed
            first = None
            if getattr(norm_of, "__name__", "") == "update_norm" and bounds.ratio.settled and bounds.fresh.settled:
                latest, first = bounds.ratio.reference({}), bounds.fresh.reference({})
                if latest is not None and first:
                    recorder.growth = max(recorder.growth, latest / first)
            if ref:
                for r in reports:
                    try:
                        norm = float(norm_of(r))
                    except Exception:  # noqa: BLE001
                        continue
                    steps = kwargs.get("steps_of", lambda _: None)(r)
                    w = bounds.work_factor(steps, work) if bounds.widens else 1.0
                    g = bounds.gap_factor(node_of(r)) if kwargs.get("stateful") and bounds.widens else 1.0
                    widen = bounds.widening(w, g)
                    kind = "update" if getattr(norm_of, "__name__", "") == "update_norm" else "other"
                    if kind == "update" and widen > 1:
                        recorder.work, recorder.gap = max(recorder.work, w), max(recorder.gap, g)
                        recorder.product = max(recorder.product, w * g)
                        recorder.unwidened = max(recorder.unwidened, norm / ref)
                    recorder.ratios[kind].append(norm / (ref * widen))
                    if kind == "update" and first:
                        recorder.over_first = max(recorder.over_first, norm / (first * widen))
            return kept

        bounds_module.NormBounds.check = check  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from strategies import bounds as bounds_module

        bounds_module.NormBounds.check = self._original  # type: ignore[method-assign]
