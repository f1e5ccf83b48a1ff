"""Attackers against the asynchronous rules on a virtual clock (issue 39, items 4 and 6).

``N`` nodes (node ``100 + c``): the honest ones take 5-15 s per job and send Δ = a common drift
plus noise (norm ``STEP``, as :mod:`attacks`); the attackers (the last ``attackers`` nodes) take
``fast`` seconds per job (0.2 s: the fast node, 5-15 s otherwise) and send, every time, the
largest update the rule accepts in one direction orthogonal to the honest drift: 0.99 x the ratio
bound of one update (:meth:`AsyncRule.arrival_limit`), or 0.99 x ``max-update-norm`` while the
bounds have no reference. Influence: the distance of the model from the same run in which the
attackers' nodes reply honestly (same clock, same jobs), in units of STEP, at ``horizon`` seconds
and, per arrival, the largest one-arrival change of that distance.
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


def async_influence(spec: str, attackers: int = 1, fast: float | None = 0.2, horizon: float = 60.0,
                    seed: int = 0) -> dict:
    """The attackers' influence on an asynchronous rule (the module docstring)."""
    rng = np.random.default_rng(seed)
    bad = set(range(N - attackers, N))
    times = {c: float(rng.uniform(5, 15)) for c in range(N)}
    if fast is not None:
        times |= {c: fast for c in bad}
    direction = np.eye(DIM, dtype=np.float32)[1]
    x0 = np.zeros(DIM, np.float32)
    x0[2:] = MODEL_NORM / np.sqrt(DIM - 2)
    connected = set(range(100, 100 + N))
    flwr_log = logging.getLogger("flwr")
    level, flwr_log.level = flwr_log.level, logging.ERROR
    runs: dict[bool, list[np.ndarray]] = {}
    counts = {"arrivals": 0, "accepted": 0, "cut": 0, "held": 0}
    try:
        for hostile in (True, False):
            s = build_strategy(spec, num_clients=N, max_failed_rounds=0)
            s.begin(named_arrays({"w": x0}))
            noise = np.random.default_rng(seed + 1)
            events, key, models = [], 0, []
            for c in range(N):
                msg, v = s.job(100 + c, key + 1)
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                heapq.heappush(events, (times[c], key, c, msg, v))
                key += 1
            while events and events[0][0] <= horizon:
                now, _, c, msg, v = heapq.heappop(events)
                start = s.snapshots.get(v, s.current)
                u = noise.normal(0, 1, DIM).astype(np.float32)
                u[0] += 3.0
                delta = (u * STEP / np.linalg.norm(u)).astype(np.float32)
                if hostile and c in bad:
                    limit = s.arrival_limit(SimpleNamespace(num_steps=None))
                    size = 0.99 * (s.bounds.max_update_norm if limit is None else min(limit, s.bounds.max_update_norm))
                    delta = (size * direction).astype(np.float32)
                o = s.arrive(reply(msg, start + delta, **{"client-id": c}), msg, v, connected, now)
                if hostile and c in bad:
                    counts["arrivals"] += 1
                    counts["accepted"] += not o.reason
                    counts["cut"] += o.cut
                    counts["held"] += o.held
                models.append(s.current.astype(np.float64))
                msg, v = s.job(100 + c, key + 1)
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                heapq.heappush(events, (now + times[c], key, c, msg, v))
                key += 1
            runs[hostile] = models
    finally:
        flwr_log.level = level
    hostile_models, honest_models = runs[True], runs[False]
    distance = [float(np.linalg.norm(a - h)) / STEP for a, h in zip(hostile_models, honest_models, strict=True)]
    steps = np.abs(np.diff([0.0, *distance]))
    return {"run": distance[-1], "largest": max(distance), "per-arrival": float(steps.max()), **counts}
