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
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import Message, RecordDict

from .bounds import NormBounds
from .client_binding import ClientBinding
from .layout import Layout, Scratch, safe_norm
from .metrics import carries_client_id, claimed_client_id
from .options import RecordKeys
from .replies import ClientReport, ReplyParser, ReplyRejected, RoundLog, brief, destinations, source_node
from .robust import Robust
from .rule import Rule

log = logging.getLogger("flwr")  # Flower's logger: these lines appear where Flower's own do


def reply_slots(replies: list[Message], nodes: list[int]) -> list[int]:
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
        return self._scratch.row(self.layout.size)

    def collect(self, replies: Iterable[Message]) -> list[ClientReport]:
        """Validate replies; fill ``round_log``; return the valid reports, by client id.

        Order: each reply alone (:meth:`parse_reply`), then who may claim which client id
        (:meth:`check_claims`), then the update norms against the round (:meth:`check_norms`).
        A reply rejected at any step reaches neither the rule nor its state.
        """
        replies = list(replies)
        node_of_message = destinations(self._sent)
        sent = set(self.round_log.sent) if self._sent else None
        answered: set[int] = set()
        parsed: list[ClientReport] = []
        content_of: dict[int, RecordDict] = {}
        self._ids_reported |= any(not m.has_error() and carries_client_id(m.content) for m in replies)
        nodes = [node if isinstance(node := source_node(msg, node_of_message), int)
                 else -(i + 1) for i, msg in enumerate(replies)]  # a mocked reply (create_mock_reply): no sender
        self._scratch.new_round(len(replies), self.layout.size if self.layout is not None else None)
        slot = reply_slots(replies, nodes)
        for i, msg in enumerate(replies):
            node = nodes[i]
            answered.add(node)
            self._scratch.begin(slot[i])
            if msg.has_error():
                self.round_log.unavailable.append(node)
                continue
            content_of[node] = msg.content
            try:  # one reply, one verdict: whatever goes wrong with it rejects it, never the round
                if sent is not None and node not in sent:
                    raise ReplyRejected("reply from a node this round did not address")
                if sent is not None and msg.metadata.reply_to_message_id not in node_of_message:
                    raise ReplyRejected("reply to a message this round did not send")
                parsed.append(self.parse_reply(msg, node))
            except ReplyRejected as exc:
                self.reject(node, str(exc))
            except Exception as exc:  # noqa: BLE001
                self.reject(node, f"reply cannot be read: {type(exc).__name__}: {exc}")
                log.exception("round of %s: reading the reply of node %d raised (a bug, or a reply no check "
                              "foresaw)", self.name, node)
        reports = self.check_norms(self.check_claims(parsed))
        self.examples_clipped = self.bounds.clip_examples(reports) if self.weighting == "num-examples" else 0
        self.accepted(reports)
        if sent is not None:
            self.round_log.unavailable += sorted(sent - answered)
        ordered = sorted(reports, key=lambda r: r.client_id)
        self.round_log.participants = [r.client_id for r in ordered]
        self._accepted = [content_of[r.node_id] for r in ordered]
        return ordered

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
        self.norms_clipped = 0
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
