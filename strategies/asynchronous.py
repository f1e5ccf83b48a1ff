"""Asynchronous rules: arrivals, model versions, staleness, and the staleness functions.

An asynchronous rule (FedBuff, FedAsync: :mod:`strategies.rules.fedbuff`, ``fedasync``) sees one
update at a time, an :class:`Arrival`: Δ_i = x_i − x^τ from the version τ it was sent, and its
staleness t − τ (t: the number of aggregations so far, the current version). The rule says after each
arrival whether it aggregates now (:meth:`AsyncRule.add`), then applies what it holds
(:meth:`AsyncRule.apply`); the version counts aggregations.

Two drivers use the same two hooks:

- the asynchronous loop (:mod:`server_app.asynchronous`): each job is a train message with the
  model of the current version (:meth:`AsyncRule.job`); each reply, when it arrives (virtual or
  real time), goes through :meth:`AsyncRule.arrive`: the staleness bound ``max_staleness``, then
  the same checks as every rule's replies (:meth:`ReplyAcceptance.collect`: parsing, client
  binding, the norm bounds against the version the client started from), then the rule.
  Versions that jobs still train from are kept (one float32 copy per such version, at most
  ``min(jobs in flight, max_staleness + 1)`` copies);
- a synchronous loop (Flower's ``Strategy.start``, a drop-in app): the round's accepted replies
  are arrivals from this round's version, in client-id order (staleness 0 until the rule
  aggregates within the round, then 1, ...), and x^{t+1} is the model after the last of them.

Two guards of the bounds, off with ``max-norm-ratio=0`` (the papers' rules; ``docs/threat-model.md``,
"A fast asynchronous node", with their cost to honest runs):

- **one client's share of a window**: one client identity's accepted updates (from any node id)
  among the last ``share_window`` accepted arrivals (FedBuff: its K; FedAsync: 10) have a norm of at
  most one update's bound (``max-norm-ratio`` x the reference x its work factor): beyond what it has
  left an arrival is cut to it (``share-cut`` in the row), or rejected when nothing is left;
- **the start-up hold**: until a majority of the run's clients (3 to 64 distinct client identities,
  of ``num_clients`` or of the nodes connected) have an entry in the bounds,
  the rule's aggregations wait (``held``, at most ``max_staleness`` + 1 arrivals); the first one
  after it applies them, each arrival of the hold cut to that majority's bound, never rejected by
  it (then the share limit). Nothing honest is dropped: the first arrivals are applied later than in the paper.

The staleness functions s(δ) live in :mod:`strategies.staleness`. What the loops call of a rule
is declared here, with its defaults (:class:`AsyncRule`: ``buffer_size``, ``job_steps``,
``holds``, ``deadline``, ``at_deadline``; FedCompass overrides the last four), never looked up
with ``getattr``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType

from .base import AvailabilityStrategy
from .bounds import MIN_POOL, REFERENCE_WINDOW
from .intake import RoundIntake
from .protocol import CLIENT_RULE, IGNORE_AVAILABILITY, PLAIN_RULE, SERVER_ROUND
from .replies import ClientReport

log = logging.getLogger("flwr")

@dataclass
class Arrival:
    """One accepted update as an asynchronous rule sees it."""

    report: ClientReport  # its delta is Δ_i = x_i − x^τ, owned by the arrival (a copy)
    version: int  # τ: the version the client trained from
    staleness: int  # t − τ at arrival
    start: np.ndarray  # x^τ (FedAsync mixes the client's model x^τ + Δ_i)
    time: float = 0.0  # when it arrived (virtual or real seconds since the run's start)
    judged: bool = True  # False: accepted during the start-up hold, judged when it ends


@dataclass
class ArrivalOutcome:
    """What one arrival did: rejected (``reason``), accepted, and whether the rule aggregated."""

    node: int
    client: int | None = None
    staleness: int | None = None
    reason: str = ""  # "" = accepted; else why not (stale, rejected, unavailable)
    unavailable: bool = False
    aggregated: bool = False
    held: bool = False  # accepted and held until the bounds have a reference (the start-up hold)
    cut: bool = False  # scaled down to what its node had left of its share of the window


@dataclass
class AsyncState:
    """The version, the rule's buffer (arrivals not applied yet) and the kept versions."""

    version: int = 0
    pending: list[Arrival] = field(default_factory=list)
    snapshots: dict[int, np.ndarray] = field(default_factory=dict)
    held: list[Arrival] = field(default_factory=list)  # the start-up hold
    recent: list[tuple[int, float]] = field(default_factory=list)  # the share window: (client id, norm applied)
    released: bool = False  # the start-up hold is over


class AsyncRule(AvailabilityStrategy):
    """Base of the asynchronous rules: :meth:`add` and :meth:`apply` are the rule's math.

    ``max_staleness``: an arrival older than this many versions is rejected (recorded as
    ``stale``) and reaches neither the rule nor the bounds' history. ``concurrency``: at most
    this many jobs in flight in the asynchronous loop (0: every idle available client).
    ``share_window``: the accepted arrivals over which one node's updates together are bounded as
    one update (the module docstring; 0: the rule's own, :attr:`own_share_window`; 1: no limit).
    """

    asynchronous: ClassVar[bool] = True
    State: ClassVar[type] = AsyncState
    own_share_window: ClassVar[int] = 10  # FedAsync's window of recent arrivals (FedBuff: its K)
    start_up_hold: ClassVar[bool] = True  # hold arrivals while the bounds have no reference

    def __init__(self, *, max_staleness: int = 100, concurrency: int = 0, share_window: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_staleness < 0:
            raise ValueError(f"strategy '{self.name}': max-staleness={max_staleness} must be >= 0")
        if concurrency < 0:
            raise ValueError(f"strategy '{self.name}': concurrency={concurrency} must be >= 0 (0: no limit)")
        if share_window < 0:
            raise ValueError(f"strategy '{self.name}': share-window={share_window} must be >= 0 (0: the rule's "
                             f"own, 1: no limit on a client's share)")
        self.max_staleness = int(max_staleness)
        self.concurrency = int(concurrency)
        self._share_window = int(share_window)
        self.held: list[Arrival] = []  # accepted before the bounds had a reference (the start-up hold)
        self.recent: deque[tuple[int, float]] = deque()  # the share window's last arrivals: (client id, norm applied)
        self.share_cuts = 0  # arrivals cut to their client's share (since the last aggregation)
        self.version = 0
        self.pending: list[Arrival] = []
        self.snapshots: dict[int, np.ndarray] = {}
        self._users: dict[int, int] = {}  # version -> jobs in flight from it
        self.applied: list[Arrival] = []  # the arrivals of the last aggregation

    # ------------------------------------------- what the loops ask the rule (declared defaults)
    @property
    def buffer_size(self) -> int:
        """The arrivals one aggregation waits for (FedBuff's K; 1: each arrival is applied)."""
        return 1

    def job_steps(self, node: int, default: int) -> int:
        """The local steps of the job just sent to ``node`` (``default``: the workload's)."""
        return default

    def holds(self, node: int) -> bool:
        """Whether ``node``'s update waits for an aggregation of the rule's, so it gets no job now."""
        return False

    def deadline(self) -> float | None:
        """The next time (run seconds) at which the rule acts by itself (None: none)."""
        return None

    def at_deadline(self, now: float) -> bool:
        """Act on the times up to ``now`` (:meth:`deadline`); True when the rule aggregated."""
        return False

    # ---------------------------------------------------------------- the rule (override)
    def add(self, arrival: Arrival) -> bool:
        """Take one accepted arrival; True when the rule aggregates now."""
        raise NotImplementedError

    def apply(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        """Aggregate the held arrivals (``self.pending``) into x; the base then clears them."""
        raise NotImplementedError

    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]) -> tuple[np.ndarray, dict[str, float]]:
        """A synchronous round: its reports are arrivals from this round's version, in client-id order."""
        start, versions = x, 0
        for r in reports:
            arrival = Arrival(_owned(r), self._round_version, self.version - self._round_version, start)
            if self.add(arrival):
                x = self._aggregate_now(x)
                versions += 1
        return x, {"aggregations": versions, "buffered": len(self.pending)}

    # ---------------------------------------------------------- synchronous (Flower's start)
    _round_version = 0

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Any
                        ) -> Iterable[Message]:
        self._round_version = self.version
        return super().configure_train(server_round, arrays, config, grid)

    # ------------------------------------------------------------ the asynchronous loop
    def begin(self, arrays: ArrayRecord) -> None:
        """Take ``arrays`` as version ``self.version``'s model (the loop's start)."""
        self.set_global(arrays)

    def job(self, node: int, job_round: int) -> tuple[Message, int]:
        """A train message to ``node`` with the current model, and its version. ``job_round`` is
        the message's ``server-round`` (the client keys its data order and lr by it)."""
        assert self.current is not None and self.layout is not None
        if self.version not in self.snapshots:
            self.snapshots[self.version] = self.current.copy()
        self._users[self.version] = self._users.get(self.version, 0) + 1
        return self._train_message(node, job_round, self.current), self.version

    def resume_job(self, node: int, job_round: int, version: int) -> Message:
        """The train message of a job in flight that a checkpoint holds (sent from ``version``,
        whose model the restored state keeps), to ``node``; counted as :meth:`job` counts it, so
        its arrival releases the version as in the run that wrote the checkpoint. ValueError when
        the state does not keep that version."""
        x = self.snapshots.get(version)
        if x is None:
            raise ValueError(f"strategy '{self.name}': a job in flight started from version {version}, and the "
                             f"checkpoint's state keeps versions {sorted(self.snapshots)}")
        self._users[version] = self._users.get(version, 0) + 1
        return self._train_message(node, job_round, x)

    def _train_message(self, node: int, job_round: int, x: np.ndarray) -> Message:
        config = ConfigRecord({SERVER_ROUND: job_round, CLIENT_RULE: PLAIN_RULE, IGNORE_AVAILABILITY: True})
        for key, value in self.train_config(job_round - 1, [node]).items():
            config[key] = value
        content = self.keys.content(self.arrays_of(x), config)
        return Message(content, dst_node_id=node, message_type=MessageType.TRAIN)

    def release(self, version: int) -> None:
        """A job from ``version`` is over (arrived, lost or timed out): drop versions no job needs."""
        left = self._users.get(version, 0) - 1
        if left > 0:
            self._users[version] = left
            return
        self._users.pop(version, None)
        if version != self.version:
            self.snapshots.pop(version, None)

    def arrive(self, reply: Message, sent: Message, version: int, connected: set[int], now: float = 0.0
               ) -> ArrivalOutcome:
        """One reply to the job ``sent`` (from ``version``): checked, then given to the rule.

        Never raises on what the reply holds: a bad reply is an ArrivalOutcome with its reason (also in
        ``round_log``, which the loop reads and resets per aggregation)."""
        node = sent.metadata.dst_node_id
        staleness = self.version - version
        try:
            if staleness > self.max_staleness:
                reason = f"stale: staleness {staleness} > max-staleness {self.max_staleness}"
                self.round_log.rejected.append((node, reason))
                return ArrivalOutcome(node, staleness=staleness, reason=reason)
            report = self._check_one(reply, sent, version, connected)
            start = self.snapshots.get(version, self.current)  # x^τ, before release may drop it
        finally:
            self.release(version)
        if report is None:
            log = self.round_log
            why = next((r for n, r in reversed(log.rejected) if n == node), "")
            return ArrivalOutcome(node, staleness=staleness, reason=why or "unavailable", unavailable=not why)
        assert start is not None
        arrival = Arrival(_owned(report), version, staleness, start, now)
        self._nodes = max(self.num_clients or 0, len(connected))
        outcome = ArrivalOutcome(node, report.client_id, staleness, held=self._holding())
        if outcome.held:  # judged when the hold ends (the scheduler of a rule still sees it now)
            arrival.judged = False
        else:
            outcome.reason, outcome.cut = self._share(arrival, judge=False)
            if outcome.reason:
                self.round_log.rejected.append((node, outcome.reason))
                return outcome
        before = self.version
        if self.add(arrival):
            assert self.current is not None
            self.current = self._aggregate_now(self.current, hold=True)
        outcome.aggregated = self.version > before
        return outcome

    def _holding(self) -> bool:
        """Whether the start-up hold is on: until a majority of the run's clients (:data:`MIN_POOL`
        to :data:`REFERENCE_WINDOW` client identities: a client's node ids count once) have an entry
        in the bounds, so that the reference that judges the held arrivals is a majority's even
        when the fastest nodes are hostile; and at most ``max_staleness`` + 1 held arrivals (churn may keep most nodes
        away): then it ends against the reference there is, or, with fewer than 3 nodes heard,
        none (``max-update-norm`` alone, logged: the honest side)."""
        if self._released or not (self.start_up_hold and self.bounds.max_norm_ratio and self._nodes >= MIN_POOL):
            return False
        majority = min(max(MIN_POOL, self._nodes // 2 + 1), REFERENCE_WINDOW)
        if len(self.bounds.ratio.entries) < majority and len(self.held) <= self.max_staleness:
            return True
        self._released = True
        if self.bounds.reference({}) is None:
            log.warning("%s: the start-up hold ends after %d held arrivals from fewer than %d nodes: they and the "
                        "next ones are bounded by max-update-norm alone until %d nodes have replied", self.name,
                        len(self.held), MIN_POOL, MIN_POOL)
        return False

    _released = False  # the start-up hold is over (for the run)
    _nodes = 0  # the run's nodes (num_clients, or the nodes connected at the last arrival)

    @property
    def share_window(self) -> int:
        """The accepted arrivals over which a node's updates are bounded as one (``share_window``,
        or the rule's own)."""
        return self._share_window or self.own_share_window

    def arrival_limit(self, report: ClientReport) -> float | None:
        """The ratio bound one update of ``report``'s node has now (:meth:`NormBounds.check`'s
        ``max-norm-ratio`` x the reference x the work factor, against the nodes' entries); inf
        when the ratio test is off; None while the bounds have no reference."""
        bounds = self.bounds
        if not bounds.max_norm_ratio:
            return math.inf
        reference = bounds.reference({})
        if reference is None:
            return None
        return bounds.max_norm_ratio * reference * bounds.work_factor(report.num_steps, bounds.work.reference({}))

    def _share(self, arrival: Arrival, judge: bool) -> tuple[str, bool]:
        """One client's share of the window (every node id speaking for it shares one): ("", cut?)
        with ``arrival``'s Δ_i scaled down to what it has left, or (why, False) when rejected.
        ``judge``: a held arrival (it came before any reference), cut to the bound that released it."""
        report, client = arrival.report, arrival.report.client_id
        limit = self.arrival_limit(report)
        if limit is None:  # no reference and no hold (fewer than 3 nodes, or the rule holds nothing)
            return "", False
        norm = float(report.norm) if report.norm is not None else float(np.linalg.norm(report.delta))
        left = limit - sum(n for who, n in self.recent if who == client)
        cut = norm > left
        if cut and left <= 0:
            return (f"the client's share of the last {self.share_window} arrivals is spent (its updates there "
                    f"together reach one update's bound {limit:.2g})"), False
        if cut and judge and norm > limit:  # held before any reference: cut, not rejected (strategies.bounds)
            self.round_log.cut.append((report.node_id, f"update norm {norm:.2g} > max-norm-ratio x the reference, "
                                       f"{limit:.2g}, judged when the bounds first had one (start-up hold): cut"))
        if cut:
            report.delta = report.delta * np.float32(left / norm)
            report.norm, norm = left, left
            self.share_cuts += 1
            self.round.norms_clipped += 1
        self.recent.append((client, norm))
        while len(self.recent) >= self.share_window:
            self.recent.popleft()
        return "", cut

    def _check_one(self, reply: Message, sent: Message, version: int, connected: set[int]) -> ClientReport | None:
        """The reply through the checks every rule's replies go through (:class:`ReplyIntake`),
        against x^τ, as a round of its own whose verdicts join the aggregation window's record."""
        one = self.intake.new_round([sent], set(connected) | {sent.metadata.dst_node_id},
                                    self.snapshots.get(version, self.current), self.layout)
        try:
            reports = self.intake.collect(one, [reply])
        finally:
            self.round.absorb(one)
        return reports[0] if reports else None

    def new_window(self) -> None:
        """The next aggregation's record starts empty (the asynchronous loop, after each row)."""
        self.round = RoundIntake()

    def _aggregate_now(self, x: np.ndarray, hold: bool = False) -> np.ndarray:
        """Apply the held arrivals (``self.pending``) to x, a new version; ``hold`` (an
        asynchronous arrival or deadline): while the start-up hold is on they wait in ``held``
        instead, and when it is over the arrivals accepted during it are judged first."""
        if hold and self._holding():
            self.held += self.pending
            self.pending = []
            return x
        waiting, self.held = [*self.held, *self.pending], []
        self.pending = []
        for a in waiting:
            why = "" if a.judged else self._share(a, judge=True)[0]
            if why:
                self.round_log.rejected.append((a.report.node_id, why))
            else:
                a.judged = True
                self.pending.append(a)
        if not self.pending:
            return x
        new, self.last_metrics = self.apply(x)
        if self.share_cuts:
            self.last_metrics = {**self.last_metrics, "share-cut": float(self.share_cuts)}
            self.share_cuts = 0
        new = np.asarray(new, dtype=np.float32)
        if not np.all(np.isfinite(new)):
            new = x  # as aggregate_train: a non-finite model is never taken
        self.applied, self.pending = self.pending, []
        old = self.version
        self.version += 1
        if old not in self._users:
            self.snapshots.pop(old, None)
        self.current = new
        return new

    last_metrics: dict[str, float] = {}

    def get_state(self) -> Any:
        return AsyncState(self.version, [*self.pending], {v: s.copy() for v, s in self.snapshots.items()},
                          [*self.held], [*self.recent], self._released)

    def set_state(self, state: Any) -> None:
        self.version, self.pending = int(state.version), list(state.pending)
        self.snapshots = {int(v): np.asarray(s, np.float32) for v, s in state.snapshots.items()}
        self.held = list(getattr(state, "held", []))
        self.recent = deque((int(n), float(v)) for n, v in getattr(state, "recent", []))
        self._released = bool(getattr(state, "released", False))


def _owned(report: ClientReport) -> ClientReport:
    """The report with its own copy of Δ_i (the parser's buffer is reused by the next reply)."""
    report.delta = np.array(report.delta, dtype=np.float32, copy=True)
    return report
