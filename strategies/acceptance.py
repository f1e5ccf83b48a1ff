"""Which replies of a round reach the rule: the intake half of Flower's train round.

Each reply alone first (:meth:`ReplyAcceptance.parse_reply`: :mod:`strategies.replies` turns it
into a :class:`ClientReport` or a rejection with its reason, then the rule's own
:meth:`~strategies.rule.Rule.check_report`), then the claims on client ids
(:mod:`strategies.client_binding`), then the norm bounds (:mod:`strategies.bounds`, one or more:
:meth:`ReplyAcceptance.norm_checks`). The accepted reports bind their client ids and join the
bounds' running medians; a reply rejected at any step leaves no trace in the state, and every
rejection is recorded with its reason (``round_log``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, RecordDict

from .bounds import REFERENCE_WINDOW, NormBounds, RatioBound
from .client_binding import ClientBinding
from .layout import Layout, Scratch, safe_norm
from .metrics import carries_client_id, claimed_client_id
from .options import RecordKeys
from .replies import ClientReport, ReplyParser, ReplyRejected, RoundLog, brief, destinations, source_node
from .robust import Robust
from .rule import Rule

log = logging.getLogger("flwr")  # Flower's logger: these lines appear where Flower's own do


def reply_slots(replies: Sequence[Message], nodes: list[int]) -> list[int]:
    """Each reply's rank by (the client id it claims, its node): its row of the round's reply
    memory (:meth:`strategies.layout.Scratch.begin`), so that the accepted replies, sorted by
    client id, are consecutive rows in that order whatever the order they arrived in."""
    keys = [(math.inf if m.has_error() else claimed_client_id(m.content), n) for m, n in zip(replies, nodes, strict=True)]
    slot = [0] * len(replies)
    for rank, i in enumerate(sorted(range(len(replies)), key=keys.__getitem__)):
        slot[i] = rank
    return slot


class ReplyAcceptance(Rule):
    """The reply intake of :class:`strategies.base.AvailabilityStrategy`, which sets the parts
    declared here (:meth:`collect` is what its ``aggregate_train`` calls)."""

    max_num_examples: int
    max_num_steps: int
    keys: RecordKeys
    bounds: NormBounds
    weighting: str
    examples_clipped: int
    norms_clipped: int  # this round's updates scaled down to the ratio bound (robust=clip)
    robust: Robust
    binding: ClientBinding
    connected: set[int]  # node ids the grid listed at this round's configure_train
    layout: Layout | None
    current: np.ndarray | None
    round_log: RoundLog
    _sent: list[Message]
    _accepted: list[RecordDict]  # this round's accepted reply contents
    _rows: dict[int, int]  # this round's rows for replies without a client id
    _ids_reported: bool  # some reply of this run named its client id
    _scratch: Scratch
    _open_rows: list[np.ndarray]  # rows handed out for the reply being read
    _answered: set[int]  # nodes that answered this round (error replies included)
    _received: int  # replies that are no errors, this round
    _metrics_of: dict[int, RecordDict]  # node -> its reply's records without arrays, this round

    @property
    def parser(self) -> ReplyParser:
        """This rule's requirements on a reply (rules may change ``required_metrics`` in __init__)."""
        key = (tuple(self.required_metrics), self.num_clients, self.max_num_examples, self.max_num_steps,
               self.keys.weighted_by_key, self.needs_client_ids)
        if getattr(self, "_parser_key", None) != key:  # one parser while the requirements stay
            self._parser_key = key
            self._parser = ReplyParser(self.name, key[0], dict(self.metric_hints), self.needs_client_ids,
                                       *key[1:5], self.row_of if self.needs_client_ids else None)
        return self._parser

    def row_of(self, node: int) -> int:
        """The client id (row in [0, N)) of a reply that reports none (:meth:`ClientBinding.row`)."""
        return self.binding.row(node, self.require_num_clients(), self._rows, self.name, self._ids_reported)

    def parse_reply(self, msg: Message, node: int) -> ClientReport:
        """One reply -> ClientReport, or ReplyRejected naming the problem."""
        assert self.layout is not None and self.current is not None
        report = self.parser.parse(msg.content, node, self.layout, self.current, self.reply_buffer())
        self.check_report(report)
        return report

    def reply_buffer(self) -> np.ndarray:
        """A flat float32 vector of the model's size for one reply of this round (:class:`Scratch`)."""
        assert self.layout is not None
        row = self._scratch.row(self.layout.size)
        self._open_rows.append(row)
        return row

    def collect(self, replies: Iterable[Message]) -> list[ClientReport]:
        """Validate every reply (:meth:`intake`) and end the round's intake (:meth:`end_intake`):
        the accepted reports, by client id (what a rule that holds every reply aggregates).

        The round's replies are all known here: each reply's vectors go to the row of its rank
        by claimed client id (:func:`reply_slots`, :meth:`Scratch.begin`), so the accepted Δ_i
        are consecutive rows in client order whatever the order they arrived in."""
        return self.end_intake(list(self.intake(list(replies), slotted=True)))

    def intake(self, replies: Iterable[Message], slotted: bool = False) -> Iterator[ClientReport]:
        """The accepted reports, as the replies arrive (a streaming rule folds each in and lets it go).

        Per reply, in arrival order: the reply alone (:meth:`parse_reply`), then who may claim
        which client id (:class:`strategies.client_binding.RoundClaims`), then the update norms
        (:meth:`check_norms`). The norms' references (the lower median of recent norms and this
        round's) take this round's values from its first :data:`REFERENCE_WINDOW` replies that
        pass the per-reply checks: those are held until the window is full (or the replies end),
        judged together, and every later reply is judged alone, at once, against the same
        references. A round with at most :data:`REFERENCE_WINDOW` such replies is judged on all
        of them. A reply rejected at any step reaches neither the rule nor its state; fills
        ``round_log`` (:meth:`end_intake` completes it).

        ``slotted`` (``replies`` a list: :meth:`collect`): rows by client id (:func:`reply_slots`);
        otherwise rows are handed out as replies arrive and reused once released (:meth:`release_report`).
        """
        node_of_message = destinations(self._sent)
        sent = set(self.round_log.sent) if self._sent else None
        slot: list[int] | None = None
        if slotted:
            assert isinstance(replies, list)
            nodes = [node if isinstance(node := source_node(msg, node_of_message), int)
                     else -(i + 1) for i, msg in enumerate(replies)]  # a mocked reply (create_mock_reply): no sender
            self._ids_reported |= any(not m.has_error() and carries_client_id(m.content) for m in replies)
            self._scratch.new_round(len(replies), self.layout.size if self.layout is not None else None)
            slot = reply_slots(replies, nodes)
        else:
            self._scratch.new_round()
        for bounds in self.round_bounds():
            bounds.new_round(fix=True)
        claims = self.binding.round(self.connected)
        self._answered, self._received, self._metrics_of = set(), 0, {}
        self.examples_clipped = self.norms_clipped = 0
        window: list[ClientReport] | None = []
        for i, msg in enumerate(replies):
            node = source_node(msg, node_of_message)
            if not isinstance(node, int):  # a mocked reply (Flower's create_mock_reply): no sender
                node = -(i + 1)
            self._answered.add(node)
            if slot is not None:
                self._scratch.begin(slot[i])
            if msg.has_error():
                self.round_log.unavailable.append(node)
                continue
            self._received += 1
            self._ids_reported |= carries_client_id(msg.content)
            report = self.read_reply(msg, node, sent, node_of_message)
            if report is None or not claims.take(report, self.reject):
                self.release_report(report)
                continue
            if self.keys.train_metrics_aggr_fn is not None:
                self._metrics_of[report.node_id] = metric_records(msg.content)
            if window is not None:
                window.append(report)
                if len(window) < REFERENCE_WINDOW:
                    continue
                batch, window = window, None
            else:
                batch = [report]
            yield from self.judge(batch)
        if window is not None:
            yield from self.judge(window)
        if sent is not None:
            self.round_log.unavailable += sorted(sent - self._answered)

    def read_reply(self, msg: Message, node: int, sent: set[int] | None,
                   node_of_message: dict[str, int]) -> ClientReport | None:
        """One reply, one verdict: its report, or None (rejected, with the reason; whatever goes
        wrong with it rejects it, never the round)."""
        self._open_rows = []
        try:
            if sent is not None and node not in sent:
                raise ReplyRejected("reply from a node this round did not address")
            if sent is not None and msg.metadata.reply_to_message_id not in node_of_message:
                raise ReplyRejected("reply to a message this round did not send")
            report = self.parse_reply(msg, node)
            self._open_rows = []
            return report
        except ReplyRejected as exc:
            self.reject(node, str(exc))
        except Exception as exc:  # noqa: BLE001
            self.reject(node, f"reply cannot be read: {type(exc).__name__}: {exc}")
            log.exception("round of %s: reading the reply of node %d raised (a bug, or a reply no check "
                          "foresaw)", self.name, node)
        for row in self._open_rows:
            self._scratch.release(row)
        self._open_rows = []
        return None

    def judge(self, batch: list[ClientReport]) -> list[ClientReport]:
        """The reports of ``batch`` within the norm bounds (data sizes cut under num-examples
        weighting); the round's first call fixes the references."""
        kept = self.check_norms(batch)
        if self.weighting == "num-examples":
            self.examples_clipped += self.bounds.clip_examples(kept)
        if len(kept) < len(batch):
            ids = {id(r) for r in kept}
            for r in batch:
                if id(r) not in ids:
                    self.release_report(r)
        return kept

    def release_report(self, report: ClientReport | None) -> None:
        """``report``'s vectors are read no more: their rows serve the next replies; the report
        keeps its counts (what :meth:`end_intake` and the integer arrays need)."""
        if report is None:
            return
        self._scratch.release(report.delta)
        report.delta = _EMPTY

    def end_intake(self, reports: list[ClientReport]) -> list[ClientReport]:
        """The round's accepted ``reports``: bind their ids, commit their norms, record the
        participants; returns them by client id."""
        self.accepted(reports)
        ordered = sorted(reports, key=lambda r: r.client_id)
        self.round_log.participants = [r.client_id for r in ordered]
        self._accepted = [self._metrics_of[r.node_id] for r in ordered if r.node_id in self._metrics_of]
        self._metrics_of = {}
        return ordered

    def round_bounds(self) -> list[Any]:
        """Every bound the rule keeps (:class:`NormBounds`, :class:`RatioBound`): each begins a
        round whose references its reference window fixes."""
        found: list[Any] = [bounds for bounds, _ in self.norm_checks()]
        found += [v for v in vars(self).values() if isinstance(v, (NormBounds, RatioBound)) and v not in found]
        return found

    def accepted(self, reports: list[ClientReport]) -> None:
        """The round's replies passed every check: bind their client ids and remember their norms
        (a rejected reply leaves no trace in the state)."""
        self.binding.bind(reports)
        for bounds, _ in self.norm_checks():
            bounds.commit(reports)

    def reject(self, node: int, reason: str) -> None:
        """Record a rejected reply (``round_log.rejected``; logged once per reason and round)."""
        self.round_log.rejected.append((node, brief(reason)))

    def norm_checks(self) -> list[tuple[NormBounds, Callable[[ClientReport], float]]]:
        """The bounds a round's reports go through, in order, each with the norm it compares
        (hook): ``self.bounds`` on :meth:`update_norm`; FedAWE adds the returned model's distance.
        Each keeps its own running median, committed for the accepted reports and checkpointed."""
        return [(self.bounds, self.update_norm)]

    def check_norms(self, reports: list[ClientReport]) -> list[ClientReport]:
        """Reject reports beyond any of the :meth:`norm_checks` (:meth:`NormBounds.check`)."""
        scale = safe_norm(self.current) if self.current is not None else 0.0  # ‖x^t‖: without a median
        for i, (bounds, norm_of) in enumerate(self.norm_checks()):
            clip = self.clip_report if i == 0 and self.robust.clips else None  # robust=clip: ‖Δ_i‖ only
            reports = bounds.check(reports, norm_of, lambda r: r.node_id, self.reject, scale, clip)
        return reports

    def clip_report(self, report: ClientReport, norm: float, limit: float) -> None:
        """``robust=clip``: Δ_i scaled to norm ``limit`` (a new array: the reply's buffer is shared)."""
        report.delta = report.delta * np.float32(limit / norm)
        report.norm = limit
        self.norms_clipped += 1

    def check_claims(self, reports: list[ClientReport]) -> list[ClientReport]:
        """One report per client id, from the node allowed to claim it (:meth:`ClientBinding.check`)."""
        return self.binding.check(reports, self.connected, self.reject)


_EMPTY = np.zeros(0, np.float32)


def metric_records(content: RecordDict) -> RecordDict:
    """``content`` without its arrays: what ``train_metrics_aggr_fn`` reads, kept for the round."""
    return RecordDict({k: v for k, v in content.items() if not isinstance(v, ArrayRecord)})
