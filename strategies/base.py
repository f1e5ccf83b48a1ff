"""The Flower adapter every aggregation rule shares: messages in and out, done once.

A rule subclasses :class:`AvailabilityStrategy` and writes only :meth:`aggregate`, the math:
``(round t, global flat vector x, reports) -> (new flat vector, metrics)``, and declares its
state (``State``, a dataclass; :mod:`strategies.state`). The base turns Flower messages into
:class:`ClientReport` objects and back, composing small parts:

- :mod:`strategies.replies`: one reply -> a report or a rejection with its reason;
- :mod:`strategies.identity`: which node may speak for which client id;
- :mod:`strategies.bounds`: the update-norm bounds;
- :mod:`strategies.layout` and :mod:`strategies.weighting`: flat float32 vectors and weights;
- :mod:`strategies.state`: the one checkpoint layout.

It addresses every connected node (never Flower's ``sample_nodes``, which waits forever for
``min_available_nodes``); the caller's ``send_and_receive`` timeout is the round deadline. Error
replies and missing replies both mean "unavailable". A rejected reply never reaches the rule, its
state or the model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from . import state as rule_state
from .bounds import NormBounds
from .identity import Identities
from .layout import Layout, named_arrays, safe_norm
from .protocol import NUM_EXAMPLES, SERVER_ROUND
from .replies import (
    SUPERLINK_NODE_ID,
    ClientReport,
    ReplyParser,
    ReplyRejected,
    RoundLog,
    destinations,
    source_node,
)
from .weighting import AUTO_WEIGHTING, WEIGHTINGS, client_weights, resolve_weighting

__all__ = ["SUPERLINK_NODE_ID", "WEIGHTINGS", "AvailabilityStrategy", "ClientReport", "Layout",
           "ReplyRejected", "RoundLog", "named_arrays", "safe_norm"]

log = logging.getLogger(__name__)


class AvailabilityStrategy(Strategy):
    """Base of every rule here: the Flower adapter around reply parsing, identities and bounds.

    Parameters
    ----------
    num_clients : total number of clients N (needed by rules that average over all
        clients; also bounds the ``client-id`` a reply may claim).
    server_lr : η_g, the server step applied to the rule's update.
    weighting : "equal" (the FedAU/FedAWE convention), "num-examples" (p_i = n_i / n), or
        "auto" (the default): the rule's ``paper_weighting``, resolved here (``self.weighting``
        holds the resolved value).
    seed : seeds the strategy's own generator (node sampling, power-of-choice...).
    max_num_examples, max_num_steps : replies claiming more are rejected as absurd.
    federated_evaluation : also ask clients to evaluate the global model each round.
    max_update_norm, max_norm_ratio : the update-norm bounds (:class:`NormBounds`, which says
        how the defaults 1e6 and 1e3 were measured); spec keys ``max-update-norm`` and
        ``max-norm-ratio``.
    """

    name: ClassVar[str] = ""
    required_metrics: ClassVar[tuple[str, ...]] = (NUM_EXAMPLES,)
    # a missing metric's own reason (FedNova: what a-norm is)
    metric_hints: ClassVar[dict[str, str]] = {}
    # rules that keep per-client state in rows 0..N-1 need the reported client id, not a node id
    needs_client_ids: ClassVar[bool] = False
    # rules whose paper weights every client 1/N refuse data-size weighting
    equal_weights_only: ClassVar[bool] = False
    # the weighting of the rule's paper, what weighting="auto" resolves to
    paper_weighting: ClassVar[str] = "equal"
    # the rule's state (a dataclass whose fields name the attributes a resumed run needs)
    State: ClassVar[type] = rule_state.NoState
    # format-1 checkpoints kept this rule's state in a dict under this key (None: at the top)
    legacy_key: ClassVar[str | None] = None

    def __init__(
        self,
        *,
        num_clients: int | None = None,
        server_lr: float = 1.0,
        weighting: str = AUTO_WEIGHTING,
        seed: int = 0,
        max_num_examples: int = 10**9,
        max_num_steps: int = 10**7,
        federated_evaluation: bool = False,
        max_update_norm: float = 1e6,
        max_norm_ratio: float = 1e3,
    ) -> None:
        weighting = resolve_weighting(weighting, self.paper_weighting)
        self.bounds = NormBounds(float(max_update_norm), float(max_norm_ratio))
        if not server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        if num_clients is not None and num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        if self.equal_weights_only and weighting != "equal":
            raise ValueError(f"strategy '{self.name}' weights clients equally (1/N, as its paper); "
                             f"weighting={weighting!r} is not supported")
        self.num_clients = num_clients
        self.server_lr = float(server_lr)
        self.weighting = weighting
        self.max_num_examples = max_num_examples
        self.max_num_steps = max_num_steps
        self.federated_evaluation = federated_evaluation
        self.rng = np.random.default_rng(seed)
        self.identities = Identities()
        self.connected: set[int] = set()  # node ids the grid listed at this round's configure_train
        self.layout: Layout | None = None
        self.current: np.ndarray | None = None  # x^t, flat
        self.round_log = RoundLog()
        self._sent: list[Message] = []

    @property
    def parser(self) -> ReplyParser:
        """This rule's requirements on a reply (rules may change ``required_metrics`` in __init__)."""
        return ReplyParser(self.name, tuple(self.required_metrics), dict(self.metric_hints),
                           self.needs_client_ids, self.num_clients, self.max_num_examples, self.max_num_steps)

    @property
    def max_update_norm(self) -> float:
        return self.bounds.max_update_norm

    @property
    def max_norm_ratio(self) -> float:
        return self.bounds.max_norm_ratio

    @property
    def client_of_node(self) -> dict[int, int]:
        return self.identities.client_of_node

    @property
    def node_of_client(self) -> dict[int, int]:
        return self.identities.node_of_client

    # ----------------------------------------------------------------- the rule (override)
    def aggregate(
        self, t: int, x: np.ndarray, reports: list[ClientReport]
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Return x^{t+1} and the rule's metrics; t is 0-based (Flower round − 1)."""
        raise NotImplementedError

    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        """Extra config entries sent with round t's train messages (hook)."""
        return {}

    def configure_broadcast(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> list[Message]:
        """Messages to deliver right after aggregation (hook; FedAWE's postponed broadcast)."""
        return []

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model to evaluate after a round (hook; FedExP evaluates an average)."""
        return arrays

    def extra_evaluation_arrays(self, arrays: ArrayRecord) -> dict[str, ArrayRecord]:
        """Other models this rule's paper scores, name -> arrays (hook; FedAWE: the mean of the
        clients' copies). The ServerApp evaluates each and records test-<metric>-<name>."""
        return {}

    def select_nodes(self, server_round: int, arrays: ArrayRecord, connected: list[int],
                     grid: Grid) -> list[int]:
        """The connected nodes to train this round (hook; power-of-choice probes and picks)."""
        return connected

    def update_norm(self, report: ClientReport) -> float:
        """The norm the sanity bounds compare (hook): ‖Δ_i‖₂ (:func:`safe_norm`: it cannot
        overflow). A rule whose replies are not updates of x^t (FedAWE's echoed models) may
        return a norm that means "how big is this client's own step"."""
        return safe_norm(report.delta)

    def check_report(self, report: ClientReport) -> None:
        """Rule-specific checks of one parsed reply (hook): raise ReplyRejected to reject it."""

    def parse_reply(self, msg: Message, node: int) -> ClientReport:
        """One reply -> ClientReport, or ReplyRejected naming the problem."""
        assert self.layout is not None and self.current is not None
        report = self.parser.parse(msg.content, node, self.layout, self.current)
        self.check_report(report)
        return report

    # ------------------------------------------------------------------ shared helpers
    def weights(self, reports: list[ClientReport]) -> np.ndarray:
        """Per-report weights summing to 1 over the reports (equal or by num-examples)."""
        return client_weights(self.weighting, [r.num_examples for r in reports])

    def require_num_clients(self) -> int:
        if self.num_clients is None:
            raise ValueError(f"strategy '{self.name}' needs num_clients (N)")
        return self.num_clients

    def set_global(self, arrays: ArrayRecord) -> None:
        """Take ``arrays`` as x^t (what configure_train does; tests call it directly)."""
        self.layout = Layout.of(arrays)
        self.current = self.layout.flatten(arrays)

    # ------------------------------------------------------------- Flower: train round
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.set_global(arrays)
        connected = sorted(grid.get_node_ids())
        self.connected = set(connected)
        node_ids = sorted(self.select_nodes(server_round, arrays, connected, grid))
        config[SERVER_ROUND] = server_round
        for key, value in self.train_config(server_round - 1, node_ids).items():
            config[key] = value
        content = RecordDict({"arrays": arrays, "config": config})
        self._sent = [
            Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in node_ids
        ]
        self.round_log = RoundLog(sent=node_ids)
        return self._sent

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current is None or self.layout is None:
            raise RuntimeError("aggregate_train before configure_train/set_global")
        reports = self.collect(replies)
        new, metrics = self.aggregate(server_round - 1, self.current, reports)
        if not np.all(np.isfinite(new)):
            log.error("round %d: %s produced a non-finite model; keeping x^t", server_round, self.name)
            new = self.current
        metrics = {
            "num-participants": len(reports),
            "num-unavailable": len(self.round_log.unavailable),
            "num-rejected": len(self.round_log.rejected),
            "update-norm": safe_norm(np.asarray(new, np.float64) - self.current),
            **metrics,
        }
        losses = [r.train_loss for r in reports if r.train_loss is not None]
        if losses:
            metrics["train-loss"] = float(np.mean(losses))
        return self.layout.unflatten(new), MetricRecord(metrics)

    def collect(self, replies: Iterable[Message]) -> list[ClientReport]:
        """Validate replies; fill ``round_log``; return the valid reports, by client id.

        Order: each reply alone (:meth:`parse_reply`), then who may claim which client id
        (:meth:`check_identities`), then the update norms against the round (:meth:`check_norms`).
        A reply rejected at any step reaches neither the rule nor its state.
        """
        node_of_message = destinations(self._sent)
        sent = set(self.round_log.sent) if self._sent else None
        answered: set[int] = set()
        parsed: list[ClientReport] = []
        for msg in replies:
            node = source_node(msg, node_of_message)
            answered.add(node)
            if msg.has_error():
                self.round_log.unavailable.append(node)
                log.info("node %d unavailable: %s", node, msg.error.reason[:200])
                continue
            try:
                if sent is not None and node not in sent:
                    raise ReplyRejected("reply from a node this round did not address")
                parsed.append(self.parse_reply(msg, node))
            except ReplyRejected as exc:
                self.reject(node, str(exc))
        reports = self.check_norms(self.check_identities(parsed))
        self.identities.bind(reports)  # only accepted replies bind: a rejected one leaves no trace
        if sent is not None:
            self.round_log.unavailable += sorted(sent - answered)
        ordered = sorted(reports, key=lambda r: r.client_id)
        self.round_log.participants = [r.client_id for r in ordered]
        return ordered

    def reject(self, node: int, reason: str) -> None:
        """Record and log a rejected reply (``round_log.rejected``)."""
        self.round_log.rejected.append((node, reason))
        log.warning("rejected reply from node %d: %s", node, reason)

    def check_identities(self, reports: list[ClientReport]) -> list[ClientReport]:
        """One report per client id, from the node allowed to claim it (:meth:`Identities.check`)."""
        return self.identities.check(reports, self.connected, self.reject)

    def check_norms(self, reports: list[ClientReport]) -> list[ClientReport]:
        """Reject reports whose :meth:`update_norm` is beyond the bounds (:meth:`NormBounds.check`)."""
        return self.bounds.check(reports, self.update_norm, lambda r: r.node_id, self.reject)

    # ---------------------------------------------------------- Flower: evaluate round
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.federated_evaluation:
            return []
        config[SERVER_ROUND] = server_round
        content = RecordDict({"arrays": arrays, "config": config})
        return [
            Message(content, dst_node_id=n, message_type=MessageType.EVALUATE)
            for n in sorted(grid.get_node_ids())
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        rows = []
        for msg in replies:
            if msg.has_error() or len(msg.content.metric_records) != 1:
                continue
            m = next(iter(msg.content.metric_records.values()))
            n, loss = m.get("num-examples"), m.get("eval-loss")
            if isinstance(n, int) and n > 0 and isinstance(loss, float) and math.isfinite(loss):
                rows.append((n, loss, m.get("eval-accuracy")))
        if not rows:
            return None
        n = np.array([r[0] for r in rows], np.float64)
        out = {"eval-loss": float(np.dot(n, [r[1] for r in rows]) / n.sum())}
        if all(isinstance(r[2], float) for r in rows):
            out["eval-accuracy"] = float(np.dot(n, [r[2] for r in rows]) / n.sum())
        return MetricRecord(out)

    def summary(self) -> None:
        log.info("%s: N=%s, server_lr=%s, weighting=%s, max-update-norm=%g, max-norm-ratio=%g",
                 self.name, self.num_clients, self.server_lr, self.weighting, self.max_update_norm,
                 self.max_norm_ratio)

    # -------------------------------------------------------------------- checkpoints
    def get_state(self) -> Any:
        """The rule's state (``State``): copies of the attributes its fields name (hook)."""
        return rule_state.capture(self, self.State)

    def set_state(self, state: Any) -> None:
        """Take ``state`` (a ``State``) as the rule's state (hook)."""
        rule_state.restore(self, state)

    @classmethod
    def read_state(cls, saved: dict[str, Any]) -> Any:
        """The rule's ``State`` in a checkpoint (``state_dict()``, any format), for reports."""
        return rule_state.unpack(saved, cls.name, cls.State, cls.legacy_key)[2]

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, in the one layout of :mod:`strategies.state`."""
        return rule_state.pack(self.name, self.rng.bit_generator.state, self.identities.state_dict(),
                               self.get_state())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from ``saved`` (this or the previous checkpoint format); ValueError if it is
        not a checkpoint of this rule."""
        rng, identity, state = rule_state.unpack(saved, self.name, self.State, self.legacy_key)
        self.rng.bit_generator.state = rng
        self.identities.load_state_dict(identity)
        self.set_state(state)
