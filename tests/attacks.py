"""A persistent, adaptive attacker against any registered rule (issue 27, items 3 and 9).

``N`` clients, node ``100 + c``, all reply every round with mocked replies (:mod:`replies`):
honest clients send Δ_i = a common direction plus noise (median norm ``STEP``, about 1% of the
model's norm, as in the project's runs), and the attacker (the last client) sends, every round,
the strongest reply the rule ACCEPTS: each round it tries, from the most aggressive down, the
update's size (a multiple of the largest honest norm, in one fixed direction orthogonal to the
honest drift), then ``num-examples``, then (FedNova) ``num-steps`` with the largest ``a-norm`` the
rule allows, each on a copy of the strategy, and keeps the first accepted. Its influence is the
distance of the model from the same run without the attacker's replies (the attacker's node
replies honestly there), in units of ``STEP``: per round (the largest one-round change of that
distance) and over the run.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
from replies import build_rule, rule_reply, start_round

from strategies.protocol import SCAFFOLD_DC_PREFIX

N, DIM, STEP, MODEL_NORM = 8, 16, 0.1, 12.0
SIZES = (1e6, 1e4, 3e3, 1e3, 300.0, 100.0, 30.0, 20.0, 10.0, 7.0, 5.0, 3.0, 2.0, 1.5, 1.0)  # x the honest max
EXAMPLES = (10**9, 10**6, 10**4, 1000, 300, 100, 30, 10)
STEPS = ((10**7, 10.0), (10**4, 10.0), (1000, 10.0), (100, 10.0), (20, 10.0), (20, 1.0), (2, 1.0))  # (τ, a/τ)


@dataclass
class Attack:
    size: float = 1.0  # x the round's largest honest norm
    num_examples: int = 10
    steps: tuple[int, float] = (2, 1.0)

    def metrics(self) -> dict:
        tau, ratio = self.steps
        return {"num-examples": self.num_examples, "num-steps": tau, "a-norm": tau * ratio}


def honest_updates(rounds: int, seed: int, n: int = N) -> list[np.ndarray]:
    """Per round an (n, DIM) array: drift along e_0 plus noise, median norm about STEP."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rounds):
        u = rng.normal(0, 1, (n, DIM))
        u[:, 0] += 3.0
        u *= STEP / np.median(np.linalg.norm(u, axis=1))
        out.append(u.astype(np.float32))
    return out


def node_of(c: int, t: int, n: int, attackers: int, fresh_ids: bool) -> int:
    """Client ``c``'s node id in round ``t``: 100 + c, or, for an attacker with ``fresh_ids``, a
    node id never used before (it registers anew each round; its old node is gone)."""
    return 10_000 * t + c if fresh_ids and c >= n - attackers else 100 + c


def play_round(s, name: str, t: int, x: np.ndarray, ups: np.ndarray, attack: Attack | None, attackers: int = 1,
               silent: bool = False, steady_c: bool = False, fresh_ids: bool = False):
    """One round; returns (new x, whether the (first) attacker's reply was accepted). The last
    ``attackers`` clients all send ``attack`` (None: they reply honestly; ``silent``: they are
    offline, neither sent to nor replying); ``len(ups)`` clients. ``steady_c``: SCAFFOLD's honest
    Δc_i is 0 after round 1 (c_i stays at its first scale, as a mean gradient does; the default
    0.5 Δy_i every round makes c_i grow by it, past the c_i bound after about 20 rounds).
    ``fresh_ids``: the attackers reply from a fresh node id each round, claiming their own client
    ids (the node-id churn of issue 47)."""
    n = len(ups)
    nodes = {c: node_of(c, t, n, attackers, fresh_ids) for c in range(n)}
    sent = start_round(s, t, x, [nodes[c] for c in range(n - attackers if silent else n)])
    honest = dict(**{"num-examples": 10, "num-steps": 2, "a-norm": 2.0, "train-loss": 1.0})
    steady = {SCAFFOLD_DC_PREFIX + "w": np.zeros(DIM, np.float32)} if steady_c and t > 1 and name.endswith("scaffold") else None
    replies = [rule_reply(name, sent[nodes[c]], x + ups[c], c, ups[c], arrays=steady, **honest)
               for c in range(n - attackers) if nodes[c] in sent]
    direction = np.zeros(DIM, np.float32)
    direction[1] = 1.0  # orthogonal to the honest drift
    for a in range(n - attackers, n):
        if nodes[a] not in sent:  # not picked (power-of-choice)
            continue
        if attack is None:
            replies.append(rule_reply(name, sent[nodes[a]], x + ups[a], a, ups[a], arrays=steady, **honest))
        else:
            delta = (attack.size * float(np.linalg.norm(ups, axis=1).max()) * direction).astype(np.float32)
            # SCAFFOLD: Δc_i = 0, its c_i kept within its bound (the Δc_i channel: tests/test_scaffold_channel.py)
            dc = {SCAFFOLD_DC_PREFIX + "w": np.zeros(DIM, np.float32)} if name.endswith("scaffold") else None
            replies.append(rule_reply(name, sent[nodes[a]], x + delta, a, delta, arrays=dc, **attack.metrics(),
                                      **{"train-loss": 1.0}))
    out, _ = s.aggregate_train(t, replies)
    return out["w"].numpy(), n - attackers in s.round_log.participants


def strongest(s, name: str, t: int, x: np.ndarray, ups: np.ndarray, attackers: int = 1, refine: int = 0,
              fresh_ids: bool = False, smallest: bool = False) -> Attack:
    """The strongest attack the rule accepts this round (greedy, on copies of the strategy);
    ``refine``: the size's bisections past the grid (:func:`largest_size`); ``smallest``: the
    smallest update instead (0), to drag the references down."""
    if smallest:
        return Attack(size=0.0)
    attack = Attack()
    if refine:
        attack.size = largest_size(lambda v: play_round(copy.deepcopy(s), name, t, x, ups, Attack(v), attackers,
                                                        fresh_ids=fresh_ids)[1], refine) or 1.0
    choices = ([] if refine else [("size", SIZES)]) + [("num_examples", EXAMPLES)]
    choices += [("steps", STEPS)] if name == "fednova" else []
    for field, values in choices:
        for value in values:
            trial = Attack(**{**attack.__dict__, field: value})
            _, accepted = play_round(copy.deepcopy(s), name, t, x, ups, trial, attackers, fresh_ids=fresh_ids)
            if accepted:
                attack = trial
                break
    return attack


def influence(spec: str, rounds: int = 30, seed: int = 0, search_every: int = 1, attackers: int = 1, n: int = N,
              refine: int = 0, fresh_ids: bool = False, smallest: bool = False, **kwargs) -> dict:
    """The attackers' influence on ``spec`` over ``rounds`` rounds, in units of STEP (``attackers``
    of the ``n`` clients, the last ones, all sending the same attack). The attack is searched anew
    every ``search_every`` rounds (and whenever the last one is rejected); ``refine``: its size
    bisected that many times past the grid of :data:`SIZES`; ``fresh_ids``: from a fresh node id
    each round; ``smallest``: a zero update every round (to drag the references down). Also
    returns ``honest-accepted``: the honest replies accepted in the attacked run's last round."""
    name = spec.split(":")[0]
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    try:
        ups = honest_updates(rounds, seed, n)
        x0 = np.zeros(DIM, np.float32)
        x0[2:] = MODEL_NORM / np.sqrt(DIM - 2)
        honest = build_rule(name, n=n, spec=spec if ":" in spec else "", max_failed_rounds=0, **kwargs)
        hostile = build_rule(name, n=n, spec=spec if ":" in spec else "", max_failed_rounds=0, **kwargs)
        xh, xa = x0.copy(), x0.copy()
        per_round, distance, accepted, attacks = [], 0.0, 0, []
        attack = None
        for t in range(1, rounds + 1):
            if attack is None or (t - 1) % search_every == 0:
                attack = strongest(hostile, name, t, xa, ups[t - 1], attackers, refine, fresh_ids, smallest)
            elif not play_round(copy.deepcopy(hostile), name, t, xa, ups[t - 1], attack, attackers,
                                fresh_ids=fresh_ids)[1]:
                attack = strongest(hostile, name, t, xa, ups[t - 1], attackers, refine, fresh_ids, smallest)
            xa, ok = play_round(hostile, name, t, xa, ups[t - 1], attack, attackers, fresh_ids=fresh_ids)
            xh, _ = play_round(honest, name, t, xh, ups[t - 1], None)
            accepted += ok
            attacks.append(attack)
            new = float(np.linalg.norm(xa.astype(np.float64) - xh))
            per_round.append(abs(new - distance) / STEP)
            distance = new
    finally:
        flwr_log.setLevel(level)
    honest_accepted = len([c for c in hostile.round_log.participants if c < n - attackers])
    return {"per-round": max(per_round), "round-1": per_round[0], "run": distance / STEP, "accepted": accepted,
            "finite": bool(np.all(np.isfinite(xa))), "attacks": attacks, "honest-accepted": honest_accepted}


# ------------------------------------ the widening channels: declared work and silence (issue 39, item 6)
DECLARED = (10**4, 600, 400, 200, 100, 20, 2)  # num-steps (a-norm = num-steps), x the honest 2: 5,000 x down to 1 x


def largest_size(accepts, refine: int = 8) -> float:
    """The largest update size (x the round's largest honest norm) that ``accepts(size)`` takes
    (acceptance falls with the size: a norm bound): the largest of :data:`SIZES` accepted, found
    by bisection over the grid, then ``refine`` geometric bisections towards the next larger one
    (the grid is 1.3-100 x coarse); 0 when none is."""
    grid = sorted(SIZES)
    if not accepts(grid[0]):
        return 0.0
    if accepts(grid[-1]):
        return grid[-1]
    lo, hi = 0, len(grid) - 1  # grid[lo] accepted, grid[hi] not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if accepts(grid[mid]) else (lo, mid)
    low, high = grid[lo], grid[hi]
    for _ in range(refine):
        mid = float(np.sqrt(low * high))
        low, high = (mid, high) if accepts(mid) else (low, mid)
    return low


def widening(spec: str, gap: int = 0, declare: bool = False, rounds: int | None = None, seed: int = 0) -> dict:
    """The adaptive attacker of the widening channels (1 of ``N``, synchronous): it replies in
    round 1 and then after every ``gap`` silent rounds (offline: not sent to; ``gap = 0``: every
    round), over ``rounds`` rounds (default: two replies, round 1 and round ``gap + 2``). Each reply
    is the strongest the rule accepts: ``declare``: first the largest ``num-steps`` (and a-norm)
    accepted (:data:`DECLARED`; the bound's work factor grows with it), then the largest update
    (:func:`largest_size`, refined), then the largest ``num-examples``. Influence as
    :func:`influence` (in STEP) against the same run with the attacker replying honestly in the
    same rounds; also ``"reply"``: the model's move in the attacker's largest reply round."""
    name = spec.split(":")[0]
    rounds = rounds or gap + 2
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    try:
        ups = honest_updates(rounds, seed)
        x0 = np.zeros(DIM, np.float32)
        x0[2:] = MODEL_NORM / np.sqrt(DIM - 2)
        honest, hostile = (build_rule(name, n=N, spec=spec if ":" in spec else "", max_failed_rounds=0) for _ in range(2))
        xh, xa = x0.copy(), x0.copy()
        per_round, distance, accepted, attacks, replies, rejected = [], 0.0, 0, [], 0, 0
        for t in range(1, rounds + 1):
            silent = (t - 1) % (gap + 1) != 0
            attack = None
            if not silent:
                replies += 1

                def accepts(a: Attack, t=t, xa=xa) -> bool:
                    return play_round(copy.deepcopy(hostile), name, t, xa, ups[t - 1], a, steady_c=True)[1]

                attack = Attack()
                if declare:
                    tau = next((v for v in DECLARED if accepts(Attack(steps=(v, 1.0)))), 2)
                    attack = Attack(steps=(tau, 1.0))
                attack.size = largest_size(lambda v, a=attack: accepts(Attack(v, a.num_examples, a.steps))) or 1.0
                attack.num_examples = next((v for v in EXAMPLES if accepts(Attack(attack.size, v, attack.steps))), 10)
                attacks.append(attack)
            xa, ok = play_round(hostile, name, t, xa, ups[t - 1], attack, silent=silent, steady_c=True)
            xh, _ = play_round(honest, name, t, xh, ups[t - 1], None, silent=silent, steady_c=True)
            rejected += sum(node != 100 + N - 1 for node, _ in hostile.round_log.rejected + honest.round_log.rejected)
            accepted += ok and not silent
            new = float(np.linalg.norm(xa.astype(np.float64) - xh))
            per_round.append(abs(new - distance) / STEP)
            distance = new
    finally:
        flwr_log.setLevel(level)
    return {"per-round": max(per_round), "run": distance / STEP, "replies": replies, "accepted": accepted,
            "honest-rejected": rejected,
            "finite": bool(np.all(np.isfinite(xa))), "attacks": attacks}


def silent_then_one(name: str, silent: int = 100, new: bool = False, seed: int = 0) -> float:
    """The model's move (in STEP) from one reply of the attacker (the last client), the strongest
    accepted, claiming 1e6 examples, after ``silent`` rounds in which only the others replied: it
    took part in round 1 (``new``: never before, a new id). Against the same run without it."""
    ups = honest_updates(silent + 1, seed)
    x0 = np.zeros(DIM, np.float32)
    x0[2:] = MODEL_NORM / np.sqrt(DIM - 2)
    direction = np.eye(DIM, dtype=np.float32)[1]

    def play(s, t, x, who, size):
        sent = start_round(s, t, x, [100 + c for c in who])
        replies = [rule_reply(name, sent[100 + c], x + ups[t - 1][c], c, ups[t - 1][c]) for c in who if c != N - 1]
        if N - 1 in who:
            d = ups[t - 1][N - 1] if size is None else size * float(np.linalg.norm(ups[t - 1], axis=1).max()) * direction
            replies.append(rule_reply(name, sent[100 + N - 1], x + d, N - 1, d, **{"num-examples": 10**6}))
        out, _ = s.aggregate_train(t, replies)
        return out["w"].numpy(), N - 1 in s.round_log.participants

    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    try:
        hostile, honest = (build_rule(name, n=N, max_failed_rounds=0) for _ in range(2))
        xa = xh = x0
        for t in range(1, silent + 2):
            last = t == silent + 1
            who = list(range(N)) if (t == 1 and not new) or last else list(range(N - 1))
            size = next((v for v in SIZES if play(copy.deepcopy(hostile), t, xa, who, v)[1]), None) if last else None
            before = float(np.linalg.norm(xa - xh))
            xa, _ = play(hostile, t, xa, who, size)
            xh, _ = play(honest, t, xh, who, None)
    finally:
        flwr_log.setLevel(level)
    return (float(np.linalg.norm(xa - xh)) - before) / STEP


def fast_node(spec: str, horizon: float = 300.0, fast: float = 0.2, seed: int = 0) -> dict:
    """An asynchronous run on a virtual clock: N − 1 honest nodes with jobs of 5-15 s and one
    attacker whose jobs take ``fast`` seconds, replying each time the largest update the rule
    accepts (searched on a copy) in one direction orthogonal to the honest drift. Influence:
    the distance from the same run with the attacker's node replying honestly, in STEP."""
    import heapq
    import uuid

    from replies import reply

    from strategies import build_strategy, named_arrays

    rng = np.random.default_rng(seed)
    times = {c: float(rng.uniform(5, 15)) for c in range(N - 1)} | {N - 1: fast}
    direction = np.eye(DIM, dtype=np.float32)[1]
    x0 = np.zeros(DIM, np.float32)
    x0[2:] = MODEL_NORM / np.sqrt(DIM - 2)
    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level  # setLevel, not .level: it clears logging's cache
    flwr_log.setLevel(logging.ERROR)
    out = {}
    try:
        for hostile in (True, False):
            s = build_strategy(spec, num_clients=N)
            s.begin(named_arrays({"w": x0}))
            events, key, arrivals, accepted = [], 0, 0, 0
            noise = np.random.default_rng(seed + 1)
            for c in range(N):
                msg, v = s.job(100 + c, 1)
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                heapq.heappush(events, (times[c], key, c, msg, v))
                key += 1
            while events and events[0][0] <= horizon:
                now, _, c, msg, v = heapq.heappop(events)
                start = s.snapshots.get(v, s.current)
                u = noise.normal(0, 1, DIM).astype(np.float32)
                u[0] += 3.0
                honest_u = (u * STEP / np.linalg.norm(u) * 1.0).astype(np.float32)
                if hostile and c == N - 1:
                    arrivals += 1
                    for size in SIZES:
                        trial = copy.deepcopy(s)
                        d = (size * STEP * direction).astype(np.float32)
                        if not trial.arrive(reply(msg, start + d, **{"client-id": c}), msg, v, set(range(100, 100 + N)), now).reason:
                            break
                    o = s.arrive(reply(msg, start + d, **{"client-id": c}), msg, v, set(range(100, 100 + N)), now)
                    accepted += not o.reason
                else:
                    s.arrive(reply(msg, start + honest_u, **{"client-id": c}), msg, v, set(range(100, 100 + N)), now)
                msg, v = s.job(100 + c, key + 1)
                msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                heapq.heappush(events, (now + times[c], key, c, msg, v))
                key += 1
            out[hostile] = (s.current.copy(), arrivals, accepted)
    finally:
        flwr_log.setLevel(level)
    (xa, arrivals, accepted), (xh, _, _) = out[True], out[False]
    return {"run": float(np.linalg.norm(xa.astype(np.float64) - xh)) / STEP, "arrivals": arrivals, "accepted": accepted}
