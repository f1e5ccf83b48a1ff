"""The Flower adapter every aggregation rule shares: messages in and out, done once.

A rule subclasses :class:`AvailabilityStrategy` and writes only :meth:`aggregate`, the math:
``(round t, global flat vector x, reports) -> (new flat vector, metrics)``, and declares what it
needs and its state (:class:`strategies.rule.Rule`). The base turns Flower messages into
:class:`ClientReport` objects and back, composing small parts:

- :mod:`strategies.replies`: one reply -> a report or a rejection with its reason;
- :mod:`strategies.identity`: which node may speak for which client id;
- :mod:`strategies.bounds`: the update-norm bounds;
- :mod:`strategies.layout` and :mod:`strategies.weighting`: flat float32 vectors and weights;
- :mod:`strategies.state`: the one checkpoint layout;
- :mod:`strategies.sampling` and :mod:`strategies.options`: Flower's ``FedAvg`` arguments;
  :mod:`strategies.metrics`: Flower's metric names; :mod:`strategies.scoring`: the evaluate round,
  the round-end broadcast and what ``evaluate_fn`` sees;
- :mod:`strategies.failures`: one log line per reason and round; no silent failure.

It takes Flower's ``FedAvg`` arguments with Flower's meaning and works under Flower's own
``Strategy.start``: a rule's round-end broadcast (FedAWE) is delivered in ``configure_evaluate``,
which ``start`` calls right after aggregation. The ``send_and_receive`` timeout is the round
deadline; error replies and missing replies both mean "unavailable". A rejected reply never
reaches the rule, its state or the model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from . import state as rule_state
from .bounds import NormBounds
from .failures import FailurePolicy, StrategyFailure, log_round
from .identity import Identities
from .layout import Layout, Scratch, aggregate_integers, named_arrays, safe_norm
from .metrics import carries_client_id
from .options import MetricsAggrFn, RecordKeys
from .protocol import CLIENT_RULE, NUM_EXAMPLES, PLAIN_RULE, SERVER_ROUND
from .replies import (
    SUPERLINK_NODE_ID,
    ClientReport,
    ReplyParser,
    ReplyRejected,
    RoundLog,
    destinations,
    source_node,
)
from .rule import Rule
from .sampling import Sampling, check_destinations
from .scoring import EvaluateRound
from .weighting import AUTO_WEIGHTING, WEIGHTINGS, cap_shares, client_weights, resolve_weighting

__all__ = ["SUPERLINK_NODE_ID", "WEIGHTINGS", "AvailabilityStrategy", "ClientReport", "Layout",
           "ReplyRejected", "RoundLog", "StrategyFailure", "named_arrays", "safe_norm"]

log = logging.getLogger("flwr")  # Flower's logger: these lines appear where Flower's own do


class AvailabilityStrategy(EvaluateRound, Rule, Strategy):
    """Base of every rule here: the Flower adapter around reply parsing, identities and bounds.

    Parameters
    ----------
    num_clients : N (rules that average over all clients need it; bounds a reply's ``client-id``).
    server_lr : η_g, the server step applied to the rule's update.
    weighting : "equal", "num-examples" (p_i = n_i / n), or "auto" (the default): the rule's
        ``paper_weighting`` (``self.weighting`` holds the resolved value).
    seed : seeds the strategy's own generators (node sampling, power-of-choice...).
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes,
        node_wait : Flower's ``FedAvg`` arguments, Flower's meaning (:class:`Sampling`), but the
        first round waits at most ``node_wait`` s for ``min_available_nodes``, and a rule that
        picks its own clients refuses ``fraction_train`` < 1 (``fixed_selection`` says why).
    weighted_by_key, arrayrecord_key, configrecord_key, train_metrics_aggr_fn,
        evaluate_metrics_aggr_fn : Flower's (:class:`RecordKeys`). The train function sees the
        accepted replies; its metrics are merged under the rule's own (which carry
        ``train-loss``). Evaluate: default every numeric metric's weighted mean (Flower's).
    max_failed_rounds : the run fails (:class:`StrategyFailure`) after this many rounds in a row
        in which replies arrived but none could be used (0: never; :mod:`strategies.failures`).
    integer_arrays : "mean" (of the accepted replies', rule's weights, rounded) or "keep" (x^t's):
        the model's integer arrays, which no rule averages (:mod:`strategies.layout`).
    max_num_examples, max_num_steps : replies claiming more are rejected as absurd.
    max_update_norm, max_norm_ratio : the update-norm bounds (:class:`NormBounds`, which says
        how the defaults 1e6 and 1e3 were measured); spec keys ``max-update-norm`` and
        ``max-norm-ratio``.
    max_weight_share : under ``num-examples`` weighting, no client's weight above this share of
        the round (:func:`cap_shares`), so that a client claiming a huge ``num-examples`` cannot
        take the round; 0 (the default) = no cap, the papers' p_i = n_i / n. Spec key
        ``max-weight-share`` (e.g. ``fednova:max-weight-share=0.2``).

    ``num_clients=None``: rules that need N (``needs_num_clients``, ``needs_client_ids``) take
    the number of nodes connected at the first round (waiting until it is steady); none connected
    within ``node_wait`` is a :class:`StrategyFailure` before any training.
    """

    def __init__(
        self,
        *,
        num_clients: int | None = None,
        server_lr: float = 1.0,
        weighting: str = AUTO_WEIGHTING,
        seed: int = 0,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = NUM_EXAMPLES,
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: MetricsAggrFn | None = None,
        evaluate_metrics_aggr_fn: MetricsAggrFn | None = None,
        node_wait: float = 60.0,
        max_failed_rounds: int = 3,
        integer_arrays: str = "mean",
        max_num_examples: int = 10**9,
        max_num_steps: int = 10**7,
        max_update_norm: float = 1e6,
        max_norm_ratio: float = 1e3,
        max_weight_share: float = 0.0,
    ) -> None:
        weighting = resolve_weighting(weighting, self.paper_weighting)
        self.bounds = NormBounds(float(max_update_norm), float(max_norm_ratio))
        self.sampling = Sampling(fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
                                 min_available_nodes, node_wait)
        self.failures = FailurePolicy(self.name, max_failed_rounds)
        self.keys = RecordKeys(weighted_by_key, arrayrecord_key, configrecord_key, train_metrics_aggr_fn,
                               evaluate_metrics_aggr_fn)
        if self.fixed_selection and fraction_train != 1.0:
            raise ValueError(f"strategy '{self.name}': fraction_train={fraction_train} cannot apply: "
                             f"{self.fixed_selection}")
        aggregate_integers(integer_arrays, {}, [], np.zeros(0))  # checks the policy's name
        if not (math.isfinite(max_weight_share) and 0 <= max_weight_share <= 1):
            raise ValueError(f"max_weight_share (spec key max-weight-share) must be in [0, 1] (0 = off), "
                             f"got {max_weight_share}")
        if not server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {server_lr}")
        if num_clients is not None and (isinstance(num_clients, bool) or not isinstance(num_clients, int)
                                        or num_clients < 1):
            raise ValueError(f"num_clients must be an integer >= 1 (None: the nodes connected at the "
                             f"first round), got {num_clients!r}")
        if self.equal_weights_only and weighting != "equal":
            raise ValueError(f"strategy '{self.name}' weights clients equally (1/N, as its paper); "
                             f"weighting={weighting!r} is not supported")
        self.num_clients = num_clients
        self.server_lr = float(server_lr)
        self.weighting = weighting
        self.max_num_examples = max_num_examples
        self.max_num_steps = max_num_steps
        self.integer_arrays = integer_arrays
        self.message_timeout = 3600.0  # broadcasts' deadline; start() sets its own timeout
        self.rng = np.random.default_rng(seed)  # also Flower's fractions (no draw at fraction 1)
        self.max_weight_share = float(max_weight_share)
        self.identities = Identities()
        self.connected: set[int] = set()  # node ids the grid listed at this round's configure_train
        self.layout: Layout | None = None
        self.current: np.ndarray | None = None  # x^t, flat (the floating arrays)
        self.current_integers: dict[str, np.ndarray] = {}  # x^t's other arrays
        self.round_log = RoundLog()
        self.problems: list[str] = []  # this round's reasons the rule could not run (each names a fix)
        self._sent: list[Message] = []
        self._accepted: list[RecordDict] = []  # this round's accepted reply contents
        self._rows: dict[int, int] = {}  # this round's rows for replies without a client id
        self._waited = False  # the first round's wait for nodes is done
        self._ids_reported = False  # some reply of this run named its client id
        self._scratch = Scratch()  # the replies' vectors, reused across rounds

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
        """The client id (row in [0, N)) of a reply that reports none (:meth:`Identities.row`)."""
        return self.identities.row(node, self.require_num_clients(), self._rows, self.name, self._ids_reported)

    @property
    def current_arrays(self) -> ArrayRecord | None:
        """x^t as an ArrayRecord (Flower's strategies' attribute; tests set it, as Flower's do)."""
        return None if self.layout is None else self.layout.unflatten(self.current, self.current_integers)

    @current_arrays.setter
    def current_arrays(self, arrays: ArrayRecord) -> None:
        self.set_global(arrays)

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

    def stacked(self, name: str, vectors: list[np.ndarray]) -> np.ndarray:
        """``np.stack(vectors)`` into a matrix reused across rounds (:class:`Scratch`)."""
        return self._scratch.stacked(name, vectors)

    # ------------------------------------------------------------------ shared helpers
    def weights(self, reports: list[ClientReport]) -> np.ndarray:
        """Per-report weights summing to 1 over the reports (equal or by num-examples)."""
        w = client_weights(self.weighting, [r.num_examples for r in reports])
        return cap_shares(w, self.max_weight_share) if self.weighting == "num-examples" else w

    def require_num_clients(self) -> int:
        if self.num_clients is None:
            raise ValueError(f"strategy '{self.name}' needs num_clients (N)")
        return self.num_clients

    def set_global(self, arrays: ArrayRecord) -> None:
        """Take ``arrays`` as x^t (what configure_train does; tests call it directly)."""
        self.layout = Layout.of(arrays)
        self.current = self.layout.flatten(arrays)
        self.current_integers = self.layout.integers(arrays)

    def arrays_of(self, vector: np.ndarray) -> ArrayRecord:
        """The ArrayRecord of flat vector ``vector`` with x^t's integer arrays."""
        return self.layout.unflatten(vector, self.current_integers)

    def connected_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes; before the first round, after the bounded wait for
        ``min_available_nodes`` (and N taken from them where the rule needs it and none was given)."""
        if self._waited:
            return sorted(grid.get_node_ids())
        self._waited = True
        infer = self.num_clients is None and (self.needs_num_clients or self.needs_client_ids)
        nodes = self.sampling.wait(grid, min(self.sampling.min_available_nodes, self.num_clients or 2**31),
                                   settle=0.5 if infer else 0.0)
        if infer:
            if not nodes:
                raise StrategyFailure(f"strategy '{self.name}' needs num_clients (N) and no node connected "
                                      f"within node_wait={self.sampling.node_wait:g} s: pass num_clients=N")
            self.num_clients = len(nodes)
            log.info("%s: num_clients not given: N = %d, the nodes connected at the first round",
                     self.name, self.num_clients)
        return nodes

    # ------------------------------------------------------------- Flower: train round
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.deliver_broadcast(server_round - 1, arrays, grid)  # a loop that skipped configure_evaluate
        self.set_global(arrays)
        connected = self.connected_nodes(grid)
        self.connected = set(connected)
        self.problems, self._rows = [], {}
        pool = self.sampling.sample(connected, True, self.rng)
        node_ids = check_destinations(self.select_nodes(server_round, arrays, pool, grid), connected, self.name)
        config[SERVER_ROUND] = server_round
        config[CLIENT_RULE] = PLAIN_RULE
        for key, value in self.train_config(server_round - 1, node_ids).items():
            config[key] = value
        content = self.keys.content(arrays, config)
        self._sent = [Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in node_ids]
        self.round_log = RoundLog(sent=node_ids)
        return self._sent

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current is None or self.layout is None:
            raise RuntimeError("aggregate_train before configure_train/set_global (or current_arrays)")
        replies = list(replies)
        reports = self.collect(replies)
        new, metrics = self.aggregate(server_round - 1, self.current, reports)
        step = safe_norm(np.subtract(new, self.current, dtype=np.float64))  # NaN/Inf in x^{t+1} -> not finite
        if not math.isfinite(step):
            log.error("round %d: %s produced a non-finite model; keeping x^t", server_round, self.name)
            new, step = self.current, 0.0
        if self.keys.train_metrics_aggr_fn is not None and self._accepted:
            metrics = {**dict(self.keys.train_metrics_aggr_fn(self._accepted, self.keys.weighted_by_key) or {}), **metrics}
        metrics = {
            "num-participants": len(reports),
            "num-unavailable": len(self.round_log.unavailable),
            "num-rejected": len(self.round_log.rejected),
            "update-norm": step,
            **metrics,
        }
        losses = [r.train_loss for r in reports if r.train_loss is not None]
        if losses:
            metrics["train-loss"] = float(np.mean(losses))
        log_round(self.name, server_round, self.round_log.rejected, self.round_log.unavailable)
        received = sum(1 for m in replies if not m.has_error())
        self.failures.end_round(server_round, received, len(reports), self.round_log.rejected, self.problems)
        integers = aggregate_integers(self.integer_arrays, self.current_integers, [r.integers for r in reports],
                                      self.weights(reports) if reports else np.zeros(0))
        return self.layout.unflatten(new, integers), MetricRecord(metrics)

    def collect(self, replies: Iterable[Message]) -> list[ClientReport]:
        """Validate replies; fill ``round_log``; return the valid reports, by client id.

        Order: each reply alone (:meth:`parse_reply`), then who may claim which client id
        (:meth:`check_identities`), then the update norms against the round (:meth:`check_norms`).
        A reply rejected at any step reaches neither the rule nor its state.
        """
        replies = list(replies)
        node_of_message = destinations(self._sent)
        sent = set(self.round_log.sent) if self._sent else None
        self._scratch.new_round()
        answered: set[int] = set()
        parsed: list[ClientReport] = []
        content_of: dict[int, RecordDict] = {}
        self._ids_reported |= any(not m.has_error() and carries_client_id(m.content) for m in replies)
        for i, msg in enumerate(replies):
            node = source_node(msg, node_of_message)
            if not isinstance(node, int):  # a mocked reply (Flower's create_mock_reply): no sender
                node = -(i + 1)
            answered.add(node)
            if msg.has_error():
                self.round_log.unavailable.append(node)
                continue
            content_of[node] = msg.content
            try:  # one reply, one verdict: whatever goes wrong with it rejects it, never the round
                if sent is not None and node not in sent:
                    raise ReplyRejected("reply from a node this round did not address")
                parsed.append(self.parse_reply(msg, node))
            except ReplyRejected as exc:
                self.reject(node, str(exc))
            except Exception as exc:  # noqa: BLE001
                self.reject(node, f"reply cannot be read: {type(exc).__name__}: {exc}")
                log.exception("round of %s: reading the reply of node %d raised (a bug, or a reply no check "
                              "foresaw)", self.name, node)
        reports = self.check_norms(self.check_identities(parsed))
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
        self.identities.bind(reports)
        self.bounds.commit(reports)

    def reject(self, node: int, reason: str) -> None:
        """Record a rejected reply (``round_log.rejected``; logged once per reason and round)."""
        self.round_log.rejected.append((node, reason))

    def check_identities(self, reports: list[ClientReport]) -> list[ClientReport]:
        """One report per client id, from the node allowed to claim it (:meth:`Identities.check`)."""
        return self.identities.check(reports, self.connected, self.reject)

    def check_norms(self, reports: list[ClientReport]) -> list[ClientReport]:
        """Reject reports whose :meth:`update_norm` is beyond the bounds (:meth:`NormBounds.check`)."""
        return self.bounds.check(reports, self.update_norm, lambda r: r.node_id, self.reject)

    def summary(self) -> None:
        log.info("%s: N=%s, server_lr=%s, weighting=%s, max-weight-share=%g, %s, %s, %s, max_failed_rounds=%d, "
                 "integer arrays: %s", self.name, self.num_clients, self.server_lr, self.weighting,
                 self.max_weight_share, self.bounds, self.sampling, self.keys, self.failures.max_failed_rounds,
                 self.integer_arrays)

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, in the one layout of :mod:`strategies.state`."""
        return rule_state.pack(self.name, self.rng.bit_generator.state, self.identities.state_dict(),
                               self.bounds.state_dict(), self.get_state())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from ``saved`` (this or the previous checkpoint format); ValueError if it is
        not a checkpoint of this rule."""
        rng, identity, bounds, state = rule_state.unpack(saved, self.name, self.State, self.legacy_key)
        self.set_state(state)
        self.rng.bit_generator.state = rng
        self.identities.load_state_dict(identity)
        self.bounds.load_state_dict(bounds)
