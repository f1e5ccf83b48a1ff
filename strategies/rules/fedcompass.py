"""FedCompass: semi-asynchronous rounds with a computing-power-aware scheduler (Compass).

Li, Chaturvedi, He, Chen, Singh, Kindratenko, Huerta, Kim and Madduri, "FedCompass: Efficient
Cross-Silo Federated Learning on Heterogeneous Client Devices Using a Computing Power-Aware
Scheduler", ICLR 2024 (arXiv:2309.14675), Alg. 1-2; the official code is APPFL's
``CompassScheduler`` and ``FedCompassAggregator`` (APPFL/FedCompass, APPFL/APPFL), whose choices
this module follows where the paper leaves them open.

The scheduler keeps, per client, a speed estimate ŝ_i (seconds per local step), an exponential
average with weight ``speed_momentum`` μ on the newest job's elapsed time / steps:
ŝ_i ← (1 − μ) ŝ_i + μ (elapsed / Q_i). Clients are placed in *arrival groups*, each with an
expected arrival time T_g and a latest arrival time L_g = start + λ (T_g − start) (λ =
``latest_time_factor``). A client that reports (or is new) gets Q_i ∈ [Q_min, Q_max] local steps:

- it joins the existing group g where ⌊(T_g − now) / ŝ_i⌋ lies in [Q_min, Q_max] (the most steps
  among those), with that many steps;
- else it opens a group with Q_i = the most steps ⌊(L_h + ŝ_fast(h) Q_max − now) / ŝ_i⌋ <= Q_max
  over the groups h still open (ŝ_fast(h): the fastest client of h), raised to Q_min, or Q_max when
  no group is open; T = now + Q_i ŝ_i, L = now + λ Q_i ŝ_i.

A group aggregates when its last member arrives, or at L_g with the members that arrived (the
others, when they arrive, go to the general buffer, which joins the next group aggregation, and get
the current model at once). Members that arrived wait for their group's aggregation, then get the
new model and their next assignment (fastest first). A client's very first update is applied alone
at once. Each aggregation applies, with α (``alpha``), p_i = 1/N and the staleness function s of
FedAsync (``staleness``, ``staleness-a``, ``staleness-b``; δ_i = versions since the client's model):

    x ← x + η_g α Σ_i p_i s(δ_i) Δ_i

(``FedCompassAggregator`` with ``gradient_based``: the client sends its change; η_g the server
learning rate, 1 in the paper). Defaults are the official example's (``server_fedcompass.yaml``):
μ = 0.9, λ = 1.5, α = 0.9, s = (1 + δ)^(−0.5) (APPFL's polynomial; the FedCompass repository's
copy lacks the minus sign, fixed in APPFL), and its Q_min / Q_max = 20 / 100 as a ratio: Q_max =
the workload's local steps (``local-steps``; the first job's) and Q_min = Q_max / 5 unless
``q-max`` / ``q-min`` are given. A client's first job has Q_max steps.

The step count Q_i travels in the train message (config ``local-steps``) and the client trains
exactly that many steps. The asynchronous loop, on the virtual clock (``server_app.asynchronous``)
or on real time (``server_app.async_realtime``: no job_steps there, the device takes its time),
asks the rule for each job's steps (:meth:`FedCompass.job_steps`), whether a client's update waits
for its group (:meth:`FedCompass.holds`), and when a group's latest arrival time comes
(:meth:`FedCompass.deadline`, :meth:`FedCompass.at_deadline`). In synchronous rounds (Flower's
``start``) a round's replies are one group that all arrived.
"""

from __future__ import annotations

import copy
import heapq
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..asynchronous import Arrival, AsyncRule, AsyncState
from ..protocol import LOCAL_STEPS
from ..staleness import check_staleness_params, staleness_weight
from ..weighting import weighted_sum

MIN_SPEED = 1e-9  # s per step: a job of no time (a clock without compute) still divides


@dataclass
class Group:
    """One arrival group: members still expected, members arrived, its two times."""

    expected: float
    latest: float
    members: list[int] = field(default_factory=list)
    arrived: list[int] = field(default_factory=list)


@dataclass
class ClientPlan:
    """What the scheduler knows of one client (a node)."""

    speed: float  # ŝ_i, seconds per local step
    steps: int  # Q_i of its current job
    start: float = 0.0  # when its current job was assigned
    group: int | None = None


class Compass:
    """The Compass scheduler, on a clock given by the caller (virtual seconds)."""

    def __init__(self, q_min: int, q_max: int, momentum: float, latest_factor: float) -> None:
        self.q_min, self.q_max, self.momentum, self.latest_factor = q_min, q_max, momentum, latest_factor
        self.plans: dict[int, ClientPlan] = {}
        self.groups: dict[int, Group] = {}
        self.timers: list[tuple[float, int]] = []  # heap of (L_g, g) of the groups whose L_g is not handled
        self.counter = 0

    def __eq__(self, other: object) -> bool:  # a checkpoint's state compares by value
        return isinstance(other, Compass) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def steps(self, node: int) -> int:
        plan = self.plans.get(node)
        return self.q_max if plan is None else plan.steps

    def record(self, node: int, now: float) -> None:
        """Update ŝ_i from the job that just ended."""
        plan = self.plans.get(node)
        if plan is None:  # its first job: sent at the run's start with Q_max steps
            self.plans[node] = ClientPlan(max(now / self.q_max, MIN_SPEED), self.q_max)
            return
        plan.speed = (1 - self.momentum) * plan.speed + self.momentum * max((now - plan.start) / plan.steps, MIN_SPEED)

    def _open(self, node: int, now: float, steps: int) -> None:
        plan = self.plans[node]
        span = steps * plan.speed
        g = self.counter
        self.counter += 1
        self.groups[g] = Group(now + span, now + span * self.latest_factor, [node])
        heapq.heappush(self.timers, (self.groups[g].latest, g))
        plan.group, plan.steps, plan.start = g, steps, now

    def assign(self, node: int, now: float) -> None:
        """Give ``node`` its next group and step count (the module docstring)."""
        plan = self.plans[node]
        if not self.groups:
            self._open(node, now, self.q_max)
            return
        best, best_steps = None, -1
        for g, group in self.groups.items():
            q = math.floor((group.expected - now) / plan.speed)
            if self.q_min <= q <= self.q_max and q >= best_steps:
                best, best_steps = g, q
        if best is not None:
            self.groups[best].members.append(node)
            plan.group, plan.steps, plan.start = best, best_steps, now
            return
        steps = -1
        for group in self.groups.values():
            if now < group.latest:
                fastest = min(self.plans[c].speed for c in group.members + group.arrived)
                q = math.floor((group.latest + fastest * self.q_max - now) / plan.speed)
                if q <= self.q_max:
                    steps = max(steps, q)
        self._open(node, now, self.q_max if steps < 0 else max(steps, self.q_min))

    def arrive(self, node: int, now: float) -> str:
        """``node`` reports at ``now``: "first" (apply alone), "late" (general buffer), "wait"
        (its group is not complete) or "group" (the last member: the group aggregates)."""
        self.record(node, now)
        plan = self.plans[node]
        if plan.group is None:
            return "first"
        group = self.groups[plan.group]
        group.members.remove(node)
        if now > group.latest:
            if not group.members:
                del self.groups[plan.group]
            return "late"
        group.arrived.append(node)
        return "group" if not group.members else "wait"

    def close(self, g: int, now: float) -> list[int]:
        """Group ``g`` aggregated at ``now``: its arrived members get their next assignment, fastest
        first; returns them."""
        group = self.groups[g]
        done = sorted(group.arrived, key=lambda c: self.plans[c].speed)
        group.expected = group.latest = 0.0
        for c in done:
            self.assign(c, now)
        group.arrived = []
        if not group.members:
            del self.groups[g]
        return done


@dataclass
class CompassState(AsyncState):
    """The asynchronous state plus the scheduler and the updates waiting in its buffers."""

    compass: Compass | None = None
    general: list[Arrival] = field(default_factory=list)
    group_buffer: dict[int, list[Arrival]] = field(default_factory=dict)


class FedCompass(AsyncRule):
    """FedCompass (Li et al., ICLR 2024): Compass groups, then x ← x + η_g α Σ (1/N) s(δ_i) Δ_i."""

    name = "fedcompass"
    State: ClassVar[type] = CompassState
    # the share window (10 arrivals) and the start-up hold of the base: its buffers keep one update
    # per client per aggregation, but a fast client alone in its group aggregates at its own pace;
    # the hold defers aggregations, the scheduler sees every arrival (docs/threat-model.md)
    paper_weighting = "equal"  # p_i = 1/N (APPFL's "equal")
    needs_num_clients = True

    def __init__(self, *, q_min: int = 0, q_max: int = 0, speed_momentum: float = 0.9,
                 latest_time_factor: float = 1.5, alpha: float = 0.9, staleness: str = "poly",
                 staleness_a: float = 0.5, staleness_b: float = 4.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if q_max and not q_min:
            q_min = max(1, q_max // 5)
        if q_min < 0 or q_max < 0 or (q_max and not 1 <= q_min <= q_max):
            raise ValueError(f"strategy 'fedcompass': q-min={q_min} and q-max={q_max} need 1 <= q-min <= q-max "
                             "(0: from the workload's local steps)")
        if not 0 < speed_momentum <= 1:
            raise ValueError(f"strategy 'fedcompass': speed-momentum={speed_momentum} must be in (0, 1]")
        if not (math.isfinite(latest_time_factor) and latest_time_factor >= 1):
            raise ValueError(f"strategy 'fedcompass': latest-time-factor={latest_time_factor} must be >= 1")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"strategy 'fedcompass': alpha={alpha} must be > 0")
        if self.weighting != "equal":
            raise ValueError(f"strategy 'fedcompass': weighting={self.weighting!r}; FedCompass weighs each update "
                             "1/N (weighting=equal)")
        check_staleness_params(self.name, staleness, staleness_a, staleness_b)
        self.alpha, self.staleness = float(alpha), staleness
        self.staleness_a, self.staleness_b = float(staleness_a), float(staleness_b)
        self.compass = Compass(int(q_min), int(q_max), float(speed_momentum), float(latest_time_factor))
        self.general: list[Arrival] = []  # late updates, for the next group aggregation
        self.group_buffer: dict[int, list[Arrival]] = {}
        self.aggregation_kind = ""  # of the last aggregation: first, group or deadline

    # ------------------------------------------------------------ the loop's hooks
    def job_steps(self, node: int, default: int) -> int:
        """Q_i of the job the rule just sent to ``node``; ``default`` is the workload's steps for it,
        which sets Q_max (and Q_min = Q_max / 5) on the first call when they are not given."""
        c = self.compass
        if not c.q_max:
            c.q_max = int(default)
            c.q_min = c.q_min or max(1, c.q_max // 5)
            if not 1 <= c.q_min <= c.q_max:
                raise ValueError(f"strategy 'fedcompass': q-min={c.q_min} > q-max={c.q_max} (the workload's local "
                                 "steps); give q-max")
        return c.steps(node)

    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        if len(node_ids) != 1 or not self.compass.q_max:
            return {}  # a synchronous round, or the first jobs before Q_max is known: the workload's steps
        return {LOCAL_STEPS: self.compass.steps(node_ids[0])}

    def holds(self, node: int) -> bool:
        """Whether ``node``'s update waits for its group's aggregation (no new job until then)."""
        plan = self.compass.plans.get(node)
        group = None if plan is None or plan.group is None else self.compass.groups.get(plan.group)
        return group is not None and node in group.arrived

    def job(self, node: int, job_round: int) -> Any:
        if self.holds(node):
            raise RuntimeError(f"strategy 'fedcompass': a job for node {node}, whose update waits for its group: "
                               "this loop does not follow FedCompass's groups (it must ask holds())")
        return super().job(node, job_round)

    def deadline(self) -> float | None:
        """The next latest arrival time not handled yet (None: none)."""
        return self.compass.timers[0][0] if self.compass.timers else None

    def at_deadline(self, now: float) -> bool:
        """Handle the latest arrival times up to ``now`` (a group with arrived members aggregates
        them and the general buffer); True when a group aggregated."""
        aggregated = False
        while self.compass.timers and self.compass.timers[0][0] <= now:
            _, g = heapq.heappop(self.compass.timers)
            if g in self.compass.groups and self.group_buffer.get(g):
                self._take_group(g, now, "deadline")
                assert self.current is not None
                before = self.version
                self.current = self._aggregate_now(self.current, hold=True)
                aggregated |= self.version > before
        return aggregated

    # ------------------------------------------------------------ the rule
    def add(self, arrival: Arrival) -> bool:
        node, now = arrival.report.node_id, arrival.time
        kind = self.compass.arrive(node, now)
        if kind == "first":
            self.pending, self.superseded = [arrival], 0
            self.aggregation_kind = "first"
            self.compass.assign(node, now)
            return True
        if kind == "late":
            self.general.append(arrival)
            self.compass.assign(node, now)
            return False
        g = self.compass.plans[node].group
        assert g is not None
        self.group_buffer.setdefault(g, []).append(arrival)
        if kind == "wait":
            return False
        self._take_group(g, now, "group")
        return True

    def _take_group(self, g: int, now: float, kind: str) -> None:
        """The general buffer and group g's updates become the pending ones, one per client (a
        client's newer update replaces its older one, as the official code's dict merge does)."""
        merged = {a.report.node_id: a for a in self.general}
        group = self.group_buffer.pop(g)
        merged.update({a.report.node_id: a for a in group})
        self.superseded = len(self.general) + len(group) - len(merged)
        self.pending, self.general = list(merged.values()), []
        self.aggregation_kind = kind
        self.compass.close(g, now)

    superseded = 0

    def apply(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        n = self.num_clients or 1
        for a in self.pending:
            a.staleness = self.version - a.version  # at the aggregation (an update may wait for its group)
        s = [staleness_weight(self.staleness, a.staleness, self.staleness_a, self.staleness_b) for a in self.pending]
        u = weighted_sum([self.alpha * si / n for si in s], (a.report.delta for a in self.pending))
        return x + np.float32(self.server_lr) * u, {"mean-staleness-weight": float(np.mean(s)),
                                                    "groups": float(len(self.compass.groups)),
                                                    "superseded": float(self.superseded),
                                                    "local-steps": float(np.mean([a.report.num_steps or 0
                                                                                  for a in self.pending]))}

    def get_state(self) -> Any:
        base = super().get_state()
        return CompassState(base.version, base.pending, base.snapshots, base.held, base.recent, base.released,
                            compass=copy.deepcopy(self.compass), general=[*self.general],
                            group_buffer={g: [*v] for g, v in self.group_buffer.items()})

    def set_state(self, state: Any) -> None:
        super().set_state(state)
        if isinstance(state, CompassState) and state.compass is not None:
            self.compass = copy.deepcopy(state.compass)
            self.general = [*state.general]
            self.group_buffer = {int(g): [*v] for g, v in state.group_buffer.items()}

    def aggregate(self, t: int, x: np.ndarray, reports: list[Any]) -> tuple[np.ndarray, dict[str, float]]:
        """Synchronous rounds (Flower's ``start``, a drop-in app): a round's replies are one group
        that all arrived (staleness 0, the workload's local steps): x + η_g α Σ (1/N) Δ_i."""
        if not reports:
            return x, {"aggregations": 0}
        self.pending, self.superseded, self.aggregation_kind = [Arrival(r, self.version, 0, x) for r in reports], 0, "round"
        return self._aggregate_now(x), {"aggregations": 1, **self.last_metrics}
