"""Attackers against the asynchronous rules on a virtual clock (issue 39, items 4 and 6).

``N`` nodes (node ``100 + c``): the honest ones take 5-15 s per job and send Δ = a common drift
plus noise (norm ``STEP``, as :mod:`attacks`); the attackers (the last ``attackers`` nodes) take
``fast`` seconds per job (0.2 s: the fast node, 5-15 s otherwise) and send, every time, the
largest update the rule accepts in one direction orthogonal to the honest drift: 0.99 x the ratio
bound of one update (:meth:`AsyncRule.arrival_limit`), or 0.99 x ``max-update-norm`` while the
bounds have no reference. Influence: the distance of the model from the same run in which the
attackers' nodes reply honestly (same clock, same jobs), in units of STEP, at ``horizon`` seconds
and, per arrival, the largest one-arrival change of that distance. The loop follows FedCompass's
groups (no job for a node whose update waits for its group; its latest arrival times).
"""

from __future__ import annotations

import heapq
import logging
import uuid
from types import SimpleNamespace

import numpy as np
from replies import reply

from strategies import build_strategy, named_arrays

N, DIM, STEP, MODEL_NORM = 8, 16, 0.1, 12.0


def _run(spec: str, times: dict[int, float], bad: set[int], horizon: float, seed: int, fresh_ids: bool = False
         ) -> tuple[list[tuple[float, np.ndarray]], dict]:
    """One run: (time, model) after each arrival, and the counts of the ``bad`` nodes' arrivals
    (of every node's when ``bad`` is empty). ``fresh_ids``: each job of a ``bad`` client goes to
    a node id never used before (it registers anew per job, its old node gone), claiming its own
    client id."""
    direction = np.eye(DIM, dtype=np.float32)[1]
    x0 = np.zeros(DIM, np.float32)
    x0[2:] = MODEL_NORM / np.sqrt(DIM - 2)
    node_of = {c: 100 + c for c in range(N)}
    s = build_strategy(spec, num_clients=N, max_failed_rounds=0)
    s.begin(named_arrays({"w": x0}))
    noise = np.random.default_rng(seed + 1)
    holds = getattr(s, "holds", lambda node: False)  # FedCompass: an update waiting for its group
    events: list = []
    busy: set[int] = set()
    models: list[tuple[float, np.ndarray]] = []
    counts = {"arrivals": 0, "accepted": 0, "cut": 0, "held": 0, "rejected": 0}
    key = 0

    def dispatch(now: float) -> None:
        nonlocal key
        for c in range(N):
            if c not in busy and not holds(node_of[c]):
                if fresh_ids and c in bad:
                    node_of[c] = 10_000 + key
                msg, v = s.job(node_of[c], key + 1)
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                heapq.heappush(events, (now + times[c], key, c, msg, v))
                busy.add(c)
                key += 1
        deadline = getattr(s, "deadline", lambda: None)()
        if deadline is not None and all(e[2] is not None or e[0] != deadline for e in events):
            heapq.heappush(events, (deadline, key, None, None, None))  # FedCompass's latest arrival time
            key += 1

    dispatch(0.0)
    while events and events[0][0] <= horizon:
        now, _, c, msg, v = heapq.heappop(events)
        if c is None:
            s.at_deadline(now)
            dispatch(now)
            continue
        busy.discard(c)
        start = s.snapshots.get(v, s.current)
        u = noise.normal(0, 1, DIM).astype(np.float32)
        u[0] += 3.0
        delta = (u * STEP / np.linalg.norm(u)).astype(np.float32)
        if c in bad:
            limit = s.arrival_limit(SimpleNamespace(num_steps=None))
            size = 0.99 * (s.bounds.max_update_norm if limit is None else min(limit, s.bounds.max_update_norm))
            delta = (size * direction).astype(np.float32)
        o = s.arrive(reply(msg, start + delta, **{"client-id": c}), msg, v, set(node_of.values()), now)
        if c in bad or not bad:
            counts["arrivals"] += 1
            counts["accepted"] += not o.reason
            counts["rejected"] += bool(o.reason) and not o.unavailable
            counts["cut"] += o.cut
            counts["held"] += o.held
        models.append((now, s.current.astype(np.float64)))
        dispatch(now)
    return models, counts


def _times(attackers: int, fast: float | None, seed: int) -> dict[int, float]:
    rng = np.random.default_rng(seed)
    times = {c: float(rng.uniform(5, 15)) for c in range(N)}
    return times | ({c: fast for c in range(N - attackers, N)} if fast is not None else {})


def async_influence(spec: str, attackers: int = 1, fast: float | None = 0.2, horizon: float = 60.0,
                    seed: int = 0, fresh_ids: bool = False) -> dict:
    """The attackers' influence on an asynchronous rule (the module docstring); ``fresh_ids``:
    each of their jobs from a fresh node id."""
    times = _times(attackers, fast, seed)
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    try:
        hostile, counts = _run(spec, times, set(range(N - attackers, N)), horizon, seed, fresh_ids)
        honest, _ = _run(spec, times, set(), horizon, seed)
    finally:
        flwr_log.setLevel(level)
    distance = [float(np.linalg.norm(a - h)) / STEP for a, h in _aligned(hostile, honest)]
    steps = np.abs(np.diff([0.0, *distance]))
    return {"run": distance[-1], "largest": max(distance), "per-arrival": float(steps.max()), **counts}


def honest_cost(spec: str, off: str, fast: float | None = 0.2, horizon: float = 60.0, seed: int = 0) -> dict:
    """Every node honest, the last one's jobs taking ``fast`` seconds: the arrivals cut, held and
    rejected under ``spec``, and the final model's distance from the run under ``off`` (the
    bounds off) over that run's movement."""
    times = _times(1, fast, seed)
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    try:
        on, counts = _run(spec, times, set(), horizon, seed)
        ref, _ = _run(off, times, set(), horizon, seed)
    finally:
        flwr_log.setLevel(level)
    x0 = np.zeros(DIM)
    x0[2:] = MODEL_NORM / np.sqrt(DIM - 2)
    (x_on, x_off), = _aligned(on[-1:], ref[-1:])
    return {"relative": float(np.linalg.norm(x_on - x_off) / np.linalg.norm(x_off - x0)), **counts}


def _aligned(a: list[tuple[float, np.ndarray]], b: list[tuple[float, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The two runs' models at each arrival time of either (each run's latest model then): runs
    whose arrivals differ (FedCompass's groups follow the verdicts) compare at the same times."""
    out, i, j = [], 0, 0
    for t in sorted({t for t, _ in a} | {t for t, _ in b}):
        while i + 1 < len(a) and a[i + 1][0] <= t:
            i += 1
        while j + 1 < len(b) and b[j + 1][0] <= t:
            j += 1
        out.append((a[i][1], b[j][1]))
    return out
