"""Which replies reach the rule: the reply intake, one object the strategy holds.

:class:`ReplyIntake` is the part of :class:`strategies.base.AvailabilityStrategy` that judges
replies; it keeps what lives across rounds (the node <-> client binding, the reused reply memory,
whether replies report client ids). Each round, or each asynchronous arrival, is one value,
:class:`RoundIntake`, made by :meth:`ReplyIntake.new_round` from what was sent and returned with
the verdicts: the messages sent, who answered, what was received, accepted and rejected (its
:class:`RoundLog`), the model the replies are judged against, and the round's problems. The
synchronous round (:meth:`collect` or :meth:`stream`) and an asynchronous arrival (the same
:meth:`collect` on a value of its own, judged against the version the client started from) use
it the same way: nothing is swapped on the strategy to judge one arrival.

Per reply, in arrival order: the reply alone (:meth:`ReplyIntake.parse`: :mod:`strategies.replies`
turns it into a :class:`ClientReport`, with the rule's declared payloads, or a rejection with its
reason, then the rule's ``check_report``), then the claims on client ids (:mod:`strategies.client_binding`), then the
rule's count checks (``check_counts``: FedNova's steps) and the norm bounds (:mod:`strategies.bounds`,
one or more: the rule's ``norm_checks``). The accepted reports bind their client ids and join the
bounds' references at :meth:`ReplyIntake.finish`; a reply rejected at any step leaves no trace in
the state, and every rejection is recorded with its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
from flwr.app import Message, RecordDict

from .bounds import REFERENCE_WINDOW, NormBounds, RatioBound
from .client_binding import ClientBinding
from .failures import client_failure
from .layout import Layout, Scratch, safe_norm
from .metrics import carries_client_id
from .options import RecordKeys
from .payloads import Payload, model_part, read_payloads
from .replies import (
    ClientReport,
    ReplyParser,
    ReplyRejected,
    RoundLog,
    brief,
    destinations,
    keeps_client_state,
    metric_records,
    reply_slots,
    source_node,
    split,
)
from .robust import Robust

log = logging.getLogger("flwr")  # Flower's logger: these lines appear where Flower's own do

_EMPTY = np.zeros(0, np.float32)


@dataclass(frozen=True)
class Probe:
    """A rule's probe stage before a round's training (power-of-choice): the base sends ``nodes``
    the current model in an evaluate message carrying ``config`` and waits ``timeout`` seconds;
    the answers' metrics reach the rule's ``select_nodes`` as ``self.round.probe_answers``.
    ``send=False`` names the candidates without probing them (rpow-d)."""

    nodes: list[int]
    config: dict[str, Any] = field(default_factory=dict)
    timeout: float = 60.0
    send: bool = True


@dataclass
class RoundIntake:
    """One round's (or one asynchronous arrival's) intake, as a value: made when the messages
    are sent (:meth:`ReplyIntake.new_round`), filled while the replies are judged.

    sent : the train messages of the round (an arrival: its one job's message).
    connected : node ids the grid listed when the round was configured (whose claims on their
        client ids stand against a newcomer's).
    current : x^τ, the model the replies' Δ_i are taken against (None before the first round).
    log : who was addressed, answered, accepted (participants) and rejected, with reasons.
    problems : reasons the rule could not run this round (each names a fix).
    probe, probe_answers : the rule's probe stage of the round (:class:`Probe`) and the metrics of
        each node that answered it (valid evaluate replies, Flower's metric names made canonical).
    """

    sent: list[Message] = field(default_factory=list)
    connected: set[int] = field(default_factory=set)
    current: np.ndarray | None = None
    layout: Layout | None = None
    log: RoundLog = field(default_factory=RoundLog)
    problems: list[str] = field(default_factory=list)
    probe: Probe | None = None
    probe_answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    rows: dict[int, int] = field(default_factory=dict)  # rows for replies without a client id
    answered: set[int] = field(default_factory=set)  # nodes that answered (error replies included)
    received: int = 0  # replies that are no errors
    metrics_of: dict[int, RecordDict] = field(default_factory=dict)  # node -> its reply without arrays
    accepted_metrics: list[RecordDict] = field(default_factory=list)  # the accepted, by client id
    examples_clipped: int = 0  # num-examples cut to the data-size bound
    norms_clipped: int = 0  # updates scaled down to the ratio bound (a newcomer's, robust=clip, a share)
    model_norm: float | None = None  # ‖current‖ (max-model-ratio), once computed
    stateful: bool = False  # the clients run a client rule (:func:`keeps_client_state`), set by stream()
    scratch: Scratch | None = field(default=None, repr=False)
    open_rows: list[np.ndarray] = field(default_factory=list, repr=False)  # rows of the reply being read

    def reject(self, node: int, reason: str) -> None:
        """Record a rejected reply (logged once per reason and round by the failure policy)."""
        self.log.rejected.append((node, brief(reason)))

    def buffer(self) -> np.ndarray:
        """A flat float32 vector of the model's size for the reply being read (:class:`Scratch`)."""
        assert self.layout is not None and self.scratch is not None
        row = self.scratch.row(self.layout.size)
        self.open_rows.append(row)
        return row

    def absorb(self, other: RoundIntake) -> None:
        """Add ``other``'s verdicts (one asynchronous arrival's) to this value's record."""
        for name in ("rejected", "unavailable", "errors", "cut"):  # the record's lists, in arrival order
            getattr(self.log, name).extend(getattr(other.log, name))
        self.received += other.received
        self.examples_clipped += other.examples_clipped
        self.norms_clipped += other.norms_clipped


class IntakeRule(Protocol):
    """What the intake reads of the strategy that holds it: the rule's declarations and hooks
    (:class:`strategies.rule.Rule`, :class:`strategies.base.AvailabilityStrategy`)."""

    @property
    def name(self) -> str: ...
    @property
    def metric_hints(self) -> dict[str, str]: ...
    @property
    def needs_client_ids(self) -> bool: ...

    required_metrics: tuple[str, ...]
    num_clients: int | None
    max_num_examples: int
    max_num_steps: int
    keys: RecordKeys
    weighting: str
    bounds: NormBounds
    robust: Robust
    robust_clip: ClassVar[bool]
    @property
    def namespace(self) -> str: ...
    @property
    def reads(self) -> tuple[Payload, ...]: ...

    def require_num_clients(self) -> int: ...
    def parse_reply(self, msg: Message, node: int, rnd: RoundIntake) -> ClientReport: ...
    def check_report(self, report: ClientReport) -> None: ...
    def check_counts(self, rnd: Any, reports: list[ClientReport]) -> list[ClientReport]: ...
    def commit_counts(self, accepted: list[ClientReport]) -> None: ...
    def state_references(self) -> list[Any]: ...
    def norm_checks(self) -> list[tuple[NormBounds, Callable[[ClientReport], float]]]: ...


class ReplyIntake:
    """The reply intake of one strategy (``strategy.intake``): what lives across rounds, and the
    steps that judge one round's replies (:class:`RoundIntake`)."""

    def __init__(self, rule: IntakeRule) -> None:
        self.rule = rule
        self.binding = ClientBinding()
        self.scratch = Scratch()  # the replies' vectors, reused across rounds
        self.ids_reported = False  # some reply of this run named its client id
        self._parser_key: tuple[Any, ...] | None = None
        self._parser: ReplyParser | None = None
        self._rows: dict[int, int] = {}  # the rows of the round being read (:meth:`_read`)

    # ------------------------------------------------------------------ the round's value
    def new_round(self, sent: list[Message], connected: set[int], current: np.ndarray | None,
                  layout: Layout | None) -> RoundIntake:
        """The value of a round whose train messages are ``sent``."""
        rnd = RoundIntake(sent=list(sent), connected=set(connected), current=current, layout=layout,
                          scratch=self.scratch)
        failures = getattr(self.rule, "failures", None)  # the failure policy counts N's clients (strategies.failures)
        if failures is not None and self.rule.num_clients:
            failures.num_clients = int(self.rule.num_clients)
        rnd.log.sent = [m.metadata.dst_node_id for m in sent]
        return rnd

    @property
    def parser(self) -> ReplyParser:
        """The rule's requirements on a reply (rules may change ``required_metrics`` in __init__)."""
        r = self.rule
        key = (tuple(r.required_metrics), r.num_clients, r.max_num_examples, r.max_num_steps,
               r.keys.weighted_by_key, r.needs_client_ids)
        if self._parser is None or self._parser_key != key:  # one parser while the requirements stay
            self._parser_key = key
            self._parser = ReplyParser(r.name, key[0], dict(r.metric_hints), r.needs_client_ids, *key[1:5],
                                       self.row_of if r.needs_client_ids else None)
        return self._parser

    def row_of(self, node: int) -> int:
        """The client id (row in [0, N)) of a reply that reports none (:meth:`ClientBinding.row`)."""
        return self.binding.row(node, self.rule.require_num_clients(), self._rows, self.rule.name,
                                self.ids_reported)

    def parse(self, msg: Message, node: int, rnd: RoundIntake) -> ClientReport:
        """One reply -> ClientReport: its model and metrics (:class:`ReplyParser`), then the
        rule's declared payloads (``reads``: :func:`strategies.replies.read_payloads`) into
        ``report.payloads``; keys in the rule's ``namespace`` that it does not declare are a
        rejection."""
        assert rnd.layout is not None and rnd.current is not None
        r = self.rule
        if not r.reads and not r.namespace:
            return self.parser.parse(msg.content, node, rnd.layout, rnd.current, rnd.buffer())
        _, record, metrics = split(msg.content)
        model = model_part(record, rnd.layout, r.namespace, r.reads, type(r).__name__)
        report = self.parser.report(model, metrics, node, rnd.layout, rnd.current, rnd.buffer())
        report.payloads, report.payload_norms = read_payloads(record, rnd.layout, r.reads, rnd.buffer)
        return report

    # ------------------------------------------------------------------------ the intake
    def collect(self, rnd: RoundIntake, replies: Iterable[Message]) -> list[ClientReport]:
        """Validate every reply (:meth:`stream`) and end the round's intake (:meth:`finish`):
        the accepted reports, by client id (what a rule that holds every reply aggregates).

        The round's replies are all known here: each reply's vectors go to the row of its rank
        by claimed client id (:func:`reply_slots`, :meth:`Scratch.begin`), so the accepted Δ_i
        are consecutive rows in client order whatever the order they arrived in."""
        return self.finish(rnd, list(self.stream(rnd, list(replies), slotted=True)))

    def stream(self, rnd: RoundIntake, replies: Iterable[Message], slotted: bool = False) -> Iterator[ClientReport]:
        """The accepted reports, as the replies arrive (a streaming rule folds each in and lets it go).

        Per reply, in arrival order: the reply alone, then who may claim which client id
        (:class:`strategies.client_binding.RoundClaims`), then the counts and the norms
        (:meth:`judge`). The bounds' references hold one entry per client identity and come from earlier
        rounds once 3 nodes have one (:mod:`strategies.bounds`); before that they take this
        round's values from its first :data:`REFERENCE_WINDOW` replies that pass the per-reply
        checks. A reply whose verdict reads such a reference is held until the window is full
        (or the replies end) and judged with the window's others; every other reply (every reply
        once the references are settled: :func:`settled`) is judged alone, at once, against the
        same references, so a streaming round holds one reply, not the window. A reply rejected
        at any step reaches neither the rule nor its state; fills ``rnd.log`` (:meth:`finish`
        completes it).

        ``slotted`` (``replies`` a list: :meth:`collect`): rows by client id (:func:`reply_slots`);
        otherwise rows are handed out as replies arrive and reused once released (:meth:`release`).
        """
        node_of_message = destinations(rnd.sent)
        sent = set(rnd.log.sent) if rnd.sent else None
        slot: list[int] | None = None
        if slotted:
            assert isinstance(replies, list)
            nodes = [node if isinstance(node := source_node(msg, node_of_message), int)
                     else -(i + 1) for i, msg in enumerate(replies)]  # a mocked reply (create_mock_reply): no sender
            self.ids_reported |= any(not m.has_error() and carries_client_id(m.content) for m in replies)
            self.scratch.new_round(len(replies), rnd.layout.size if rnd.layout is not None else None)
            slot = reply_slots(replies, nodes)
        else:
            self.scratch.new_round()
        rnd.stateful = keeps_client_state(rnd.sent)
        round_bounds = self.round_bounds()
        for bounds in round_bounds:
            bounds.new_round(fix=True)
        claims = self.binding.round(rnd.connected)
        window: list[ClientReport] | None = []  # replies held until the window closes
        in_window = 0  # replies of the window so far (held or judged at once)
        for i, msg in enumerate(replies):
            node = source_node(msg, node_of_message)
            if not isinstance(node, int):  # a mocked reply (Flower's create_mock_reply): no sender
                node = -(i + 1)
            rnd.answered.add(node)
            if slot is not None:
                self.scratch.begin(slot[i])
            if msg.has_error():
                rnd.log.unavailable.append(node)
                if (failure := client_failure(msg)) is not None:
                    rnd.log.errors.append((node, failure))
                continue
            rnd.received += 1
            self.ids_reported |= carries_client_id(msg.content)
            report = self._read(rnd, msg, node, sent, node_of_message)
            if report is None or not claims.take(report, rnd.reject):
                self.release(report)
                continue
            if self.rule.keys.train_metrics_aggr_fn is not None:
                rnd.metrics_of[report.node_id] = metric_records(msg.content)
            if window is None or settled(round_bounds, report):
                yield from self.judge(rnd, [report])
            else:
                window.append(report)
            if window is not None:
                in_window += 1
                if in_window >= REFERENCE_WINDOW:
                    held, window = window, None
                    if held:
                        yield from self.judge(rnd, held)
        if window:
            yield from self.judge(rnd, window)
        if sent is not None:
            rnd.log.unavailable += sorted(sent - rnd.answered)

    def _read(self, rnd: RoundIntake, msg: Message, node: int, sent: set[int] | None,
              node_of_message: dict[str, int]) -> ClientReport | None:
        """One reply, one verdict: its report, or None (rejected, with the reason; whatever goes
        wrong with it rejects it, never the round)."""
        rnd.open_rows = []
        self._rows = rnd.rows
        try:
            if sent is not None and node not in sent:
                raise ReplyRejected("reply from a node this round did not address")
            if sent is not None and msg.metadata.reply_to_message_id not in node_of_message:
                raise ReplyRejected("reply to a message this round did not send")
            report = self.rule.parse_reply(msg, node, rnd)
            self.rule.check_report(report)
            rnd.open_rows = []
            return report
        except ReplyRejected as exc:
            rnd.reject(node, str(exc))
        except Exception as exc:  # noqa: BLE001
            rnd.reject(node, f"reply cannot be read: {type(exc).__name__}: {exc}")
            log.exception("round of %s: reading the reply of node %d raised (a bug, or a reply no check "
                          "foresaw)", self.rule.name, node)
        for row in rnd.open_rows:
            self.scratch.release(row)
        rnd.open_rows = []
        return None

    def judge(self, rnd: RoundIntake, batch: list[ClientReport]) -> list[ClientReport]:
        """The reports of ``batch`` within the rule's count checks and norm bounds (data sizes
        cut under num-examples weighting); the round's first call fixes the references."""
        kept = self.check_norms(rnd, self.rule.check_counts(rnd, batch))
        if self.rule.weighting == "num-examples":
            rnd.examples_clipped += self.rule.bounds.clip_examples(kept)
        ids = {id(r) for r in kept}
        for r in (r for r in batch if id(r) not in ids):
            self.release(r)
        return kept

    def check_norms(self, rnd: RoundIntake, reports: list[ClientReport]) -> list[ClientReport]:
        """Reject reports beyond any of the rule's ``norm_checks`` (:meth:`NormBounds.check`), each
        against its bound's reference (one entry per client identity) widened by its declared num-steps
        and, for a rule whose client keeps state (:func:`keeps_client_state`), the rounds since its
        client was last judged. A newcomer's beyond the first (Δ_i's, with ``robust_clip``) is cut
        instead (robust=clip: anyone's), counted and named if no later check rejects it."""
        checks = self.rule.norm_checks()
        scale = 0.0  # ‖x^τ‖, for max-model-ratio (a bound without a median): once a round, where it is on
        if rnd.current is not None and any(bounds.max_model_ratio for bounds, _ in checks):
            scale = rnd.model_norm = safe_norm(rnd.current) if rnd.model_norm is None else rnd.model_norm
        cut: dict[int, str] = {}  # id(report) -> why it was cut (counted if no later check rejects it)

        def clip(report: ClientReport, norm: float, limit: float, why: str) -> None:
            report.delta = report.delta * np.float32(limit / norm)  # a new array: the buffer is shared
            report.norm, cut[id(report)] = limit, why

        for i, (bounds, norm_of) in enumerate(checks):  # Δ_i alone is cut (strategies.bounds says why)
            reports = bounds.check(reports, norm_of, lambda r: r.node_id, rnd.reject, scale,
                                   clip if i == 0 and self.rule.robust_clip else None,
                                   steps_of=lambda r: r.num_steps, stateful=rnd.stateful,
                                   identity_of=lambda r: r.client_id, clip_known=self.rule.robust.clips)
        rnd.log.cut += [(r.node_id, cut[id(r)]) for r in reports if id(r) in cut]
        rnd.norms_clipped += sum(id(r) in cut for r in reports)
        return reports

    def release(self, report: ClientReport | None) -> None:
        """``report``'s vectors are read no more: their rows serve the next replies; the report
        keeps its counts (what :meth:`finish` and the integer arrays need)."""
        if report is None:
            return
        self.scratch.release(report.delta)
        report.delta = _EMPTY
        for name, vector in report.payloads.items():
            if vector.dtype == np.float32:  # a model-sized payload: a row of the reply memory
                self.scratch.release(vector)
                report.payloads[name] = _EMPTY

    def finish(self, rnd: RoundIntake, reports: list[ClientReport]) -> list[ClientReport]:
        """The round's accepted ``reports``: bind their ids, commit their norms (and the rule's
        counts), record the participants; returns them by client id."""
        self.binding.bind(reports)
        for bounds, _ in self.rule.norm_checks():
            bounds.commit(reports)
        self.rule.commit_counts(reports)
        ordered = sorted(reports, key=lambda r: r.client_id)
        rnd.log.participants = [r.client_id for r in ordered]
        rnd.accepted_metrics = [rnd.metrics_of[r.node_id] for r in ordered if r.node_id in rnd.metrics_of]
        rnd.metrics_of = {}
        return ordered

    def round_bounds(self) -> list[Any]:
        """Every bound the rule keeps (:class:`NormBounds`, :class:`RatioBound`): each begins a
        round whose references its reference window fixes."""
        found: list[Any] = [bounds for bounds, _ in self.rule.norm_checks()]
        found += [v for v in vars(self.rule).values() if isinstance(v, (NormBounds, RatioBound)) and v not in found]
        found += [v for v in self.rule.state_references() if v not in found]  # a rule value's (its state's)
        return found


def settled(bounds: Iterable[Any], report: ClientReport) -> bool:
    """Whether ``report``'s verdict reads only references that earlier rounds' entries fix
    (:attr:`RatioBound.settled`, :meth:`NormBounds.settled_for`): judged at once, it gets the
    verdict it would get judged with the round's reference window."""
    return all(b.settled_for(report.num_steps) if isinstance(b, NormBounds) else b.settled for b in bounds)
