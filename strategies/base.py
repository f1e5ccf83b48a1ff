"""The Flower plumbing every aggregation rule shares, done once.

A rule subclasses :class:`AvailabilityStrategy` and writes only :meth:`aggregate`, the math:
``(round t, global flat vector x, reports) -> (new flat vector, metrics)``. The base turns
Flower messages into :class:`ClientReport` objects and back:

- It addresses every connected node (never Flower's ``sample_nodes``, which waits forever
  for ``min_available_nodes``); the caller's ``send_and_receive`` timeout is the round deadline.
- Stable client ids: the ``client-id`` a reply reports (the partition id), falling back to the
  node id for ClientApps that do not report one. A client id is bound to the node that first
  claimed it (see :meth:`AvailabilityStrategy.check_identities`), so no node can write into
  another client's stored state.
- Error replies and missing replies both mean "unavailable". Errors relayed by the SuperLink
  (``src_node_id == 1``) are traced back to their node through ``reply_to_message_id``.
- Validation: a reply with missing records, wrong keys or shapes, NaN/Inf, absurd counts, a
  client id it may not claim, or an update norm beyond the bounds (:meth:`check_norms`) is
  rejected and logged with its reason; it never reaches the rule, its state or the model.
- Flat float32 vectors (:class:`Layout`), equal or data-size weights, a seeded generator, and
  ``state_dict`` / ``load_state_dict`` for checkpoints.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from .protocol import A_NORM, CLIENT_ID, NUM_EXAMPLES, NUM_STEPS, SERVER_ROUND, TRAIN_LOSS

log = logging.getLogger(__name__)

SUPERLINK_NODE_ID = 1  # src_node_id of errors the SuperLink writes on a node's behalf
WEIGHTINGS = ("equal", "num-examples")
AUTO_WEIGHTING = "auto"  # the rule's paper_weighting


@dataclass(frozen=True)
class Layout:
    """Names, shapes and dtypes of an ArrayRecord, to map it to one flat float32 vector."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, record: ArrayRecord) -> Layout:
        arrays = record.to_numpy_ndarrays()
        return cls(
            tuple(record.keys()),
            tuple(tuple(a.shape) for a in arrays),
            tuple(a.dtype.str for a in arrays),
        )

    @property
    def size(self) -> int:
        return int(sum(math.prod(s) for s in self.shapes))

    def flatten(self, record: ArrayRecord) -> np.ndarray:
        arrays = record.to_numpy_ndarrays()
        if not arrays:
            return np.zeros(0, np.float32)
        return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])

    def unflatten(self, vector: np.ndarray) -> ArrayRecord:
        out, start = {}, 0
        for key, shape, dtype in zip(self.keys, self.shapes, self.dtypes, strict=True):
            n = math.prod(shape)
            out[key] = np.asarray(vector[start : start + n], dtype=np.dtype(dtype)).reshape(shape)
            start += n
        return named_arrays(out)

    def mismatch(self, record: ArrayRecord) -> str | None:
        """Why ``record`` does not fit this layout, or None."""
        if tuple(record.keys()) != self.keys:
            return f"array keys {list(record.keys())[:5]}... differ from the model's"
        for key, shape, arr in zip(self.keys, self.shapes, record.values(), strict=True):
            if tuple(arr.shape) != shape:
                return f"array '{key}' has shape {tuple(arr.shape)}, expected {shape}"
        return None


def safe_norm(vector: np.ndarray) -> float:
    """‖v‖₂ that cannot overflow: a float32 dot product (fast, no copy), redone in float64 when
    it overflowed (float32 squares overflow for norms above ~1.8e19)."""
    v = np.asarray(vector)
    if v.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            square = float(np.dot(v, v))
        if math.isfinite(square):
            return math.sqrt(square)
    v = v.astype(np.float64)
    return math.sqrt(float(np.dot(v, v)))


def named_arrays(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord from name -> ndarray (Flower's constructor takes lists or Arrays)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


@dataclass
class ClientReport:
    """One valid training reply, as the rules see it."""

    client_id: int
    node_id: int
    delta: np.ndarray  # Δ_i = x_i^{t,end} − x^t, flat float32 (the server ADDS it)
    num_examples: int
    num_steps: int | None = None
    a_norm: float | None = None  # FedNova's ‖a_i‖_1
    train_loss: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundLog:
    """Who did what in one round, for the ServerApp's per-round record."""

    sent: list[int] = field(default_factory=list)  # node ids addressed
    participants: list[int] = field(default_factory=list)  # client ids of valid replies
    unavailable: list[int] = field(default_factory=list)  # node ids: error or no reply
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (node id, reason)


class ReplyRejected(ValueError):
    """A reply that must not reach the model; the message says why."""


class AvailabilityStrategy(Strategy):
    """Base of every rule here: Flower plumbing, reply validation, flat vectors, state.

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
    max_update_norm : a reply whose update norm (:meth:`update_norm`) exceeds this is rejected;
        0 = no absolute cap. Spec key ``max-update-norm``.
    max_norm_ratio : with at least 3 replies left under the cap, a reply whose update norm
        exceeds this multiple of the round's median update norm is rejected; 0 = off. Spec key
        ``max-norm-ratio`` (e.g. ``mifa:max-norm-ratio=50``).

    Default bounds (measured, see :meth:`check_norms`): honest update norms in 12–15-round
    in-process runs (digits and quadratic workloads; the fedawe-table2 CNN, fedexp-fedaware,
    fdms-clustered and fednova presets: FedAvg, MIFA, FedExP, Stale, FedNova with momentum 0.9
    and Dirichlet-0.1 data sizes) were at most 25 and at most 3.4 times the round's median.
    FedAWE's raw ‖x_i^† − x^t‖ (the client's stale copy plus the echo factor t − τ_i) reached 157
    and 68 times the median in 12 rounds, which is why FedAWE overrides :meth:`update_norm` (its
    client's own step ‖u_i‖ / (t − τ_i): at most 3.9 times the median in 15 digits rounds).
    ``max_update_norm = 1e6`` and ``max_norm_ratio = 1e3`` leave orders of magnitude of margin
    above all of these and still reject what breaks float32 rules (norms ≳ 1e19 overflow a
    float32 sum of squares or Gram matrix).
    """

    name: ClassVar[str] = ""
    required_metrics: ClassVar[tuple[str, ...]] = (NUM_EXAMPLES,)
    # rules that keep per-client state in rows 0..N-1 need the reported client id, not a node id
    needs_client_ids: ClassVar[bool] = False
    # rules whose paper weights every client 1/N refuse data-size weighting
    equal_weights_only: ClassVar[bool] = False
    # the weighting of the rule's paper, what weighting="auto" resolves to
    paper_weighting: ClassVar[str] = "equal"

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
        if weighting == AUTO_WEIGHTING:
            weighting = self.paper_weighting
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {(*WEIGHTINGS, AUTO_WEIGHTING)}, got {weighting!r}")
        if not (math.isfinite(max_update_norm) and max_update_norm >= 0):
            raise ValueError(f"max_update_norm (spec key max-update-norm) must be a finite number >= 0 "
                             f"(0 = no cap), got {max_update_norm}")
        if not (math.isfinite(max_norm_ratio) and (max_norm_ratio == 0 or max_norm_ratio > 1)):
            raise ValueError(f"max_norm_ratio (spec key max-norm-ratio) must be a finite number > 1 "
                             f"(0 = off), got {max_norm_ratio}")
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
        self.max_update_norm = float(max_update_norm)
        self.max_norm_ratio = float(max_norm_ratio)
        self.rng = np.random.default_rng(seed)
        self.client_of_node: dict[int, int] = {}  # node id -> client id of its last valid reply
        self.node_of_client: dict[int, int] = {}  # client id -> the node bound to it for the run
        self.connected: set[int] = set()  # node ids the grid listed at this round's configure_train
        self.layout: Layout | None = None
        self.current: np.ndarray | None = None  # x^t, flat
        self.round_log = RoundLog()
        self._sent: list[Message] = []

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

    # ------------------------------------------------------------------ shared helpers
    def weights(self, reports: list[ClientReport]) -> np.ndarray:
        """Per-report weights summing to 1 over the reports (equal or by num-examples)."""
        if self.weighting == "num-examples":
            w = np.array([r.num_examples for r in reports], np.float64)
        else:
            w = np.ones(len(reports))
        return w / w.sum()

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
        node_of_message = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent}
        sent = set(self.round_log.sent) if self._sent else None
        answered: set[int] = set()
        parsed: list[ClientReport] = []
        for msg in replies:
            node = msg.metadata.src_node_id
            if node == SUPERLINK_NODE_ID:
                node = node_of_message.get(msg.metadata.reply_to_message_id, node)
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
        for r in reports:  # only accepted replies bind: a rejected one leaves no trace in the state
            owner = self.node_of_client.get(r.client_id)
            if owner is not None and owner != r.node_id:
                log.info("client %d moves from node %d (gone) to node %d", r.client_id, owner, r.node_id)
                self.client_of_node.pop(owner, None)
            self.node_of_client[r.client_id] = r.node_id
            self.client_of_node[r.node_id] = r.client_id
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
        """One report per client id, from the node allowed to claim it; the others rejected.

        The first node whose reply for a client id is accepted is bound to that id for the run
        (``node_of_client``, part of the checkpoint; :meth:`collect` binds). Rejected: a node that
        claims another id than the one it is bound to; a claim of an id bound to another node that
        is still connected (listed by the grid at this round's configure_train). A node restarted
        without a registered key gets a new node id from Flower, so it takes its id back once its
        old node is gone from the grid's list; with SuperNode authentication the restarted node
        keeps its node id (the SuperLink maps the registered public key to the node id), so a
        binding to a node id is a binding to a key. Several claims of one free id in a round:
        the lowest node id wins.
        """
        bound_to = {node: client for client, node in self.node_of_client.items()}
        claims: dict[int, list[ClientReport]] = {}
        for r in sorted(reports, key=lambda r: r.node_id):  # stable: a node's first reply first
            own = bound_to.setdefault(r.node_id, r.client_id)  # a node's first claim this round
            if own != r.client_id:
                self.reject(r.node_id, f"node {r.node_id} is bound to client {own}; "
                                       f"it may not claim client {r.client_id}")
                continue
            claims.setdefault(r.client_id, []).append(r)
        kept = []
        for client, group in claims.items():
            owner = self.node_of_client.get(client)
            if owner is not None and owner not in {r.node_id for r in group} and owner in self.connected:
                for r in group:
                    self.reject(r.node_id, f"client {client} belongs to node {owner}, still connected")
                continue
            winner = next((r for r in group if r.node_id == owner), group[0])
            for r in group:
                if r is winner:
                    continue
                if r.node_id == winner.node_id:
                    why = f"node {r.node_id} replied before"
                elif winner.node_id == owner:
                    why = f"node {owner} is bound to it"
                else:
                    why = f"node {winner.node_id} claimed it too and the lower node id wins"
                self.reject(r.node_id, f"second reply for client {client} this round: {why}")
            kept.append(winner)
        return kept

    def check_norms(self, reports: list[ClientReport]) -> list[ClientReport]:
        """Reject reports whose :meth:`update_norm` is not finite or is beyond the bounds.

        First the absolute cap ``max_update_norm``; then, among the reports under it and only
        when at least 3 remain, ``max_norm_ratio`` × their median norm (a median of 1 or 2 norms
        says nothing about which one is wrong; a zero median gives no scale, so no ratio test).
        The round's own median needs no history, so the first round is checked like any other.
        """
        norms = [self.update_norm(r) for r in reports]
        under = []
        for r, norm in zip(reports, norms, strict=True):
            if self.max_update_norm and norm > self.max_update_norm:  # inf included
                self.reject(r.node_id, f"update norm {norm:.2g} > max-update-norm {self.max_update_norm:.2g}")
            elif not math.isfinite(norm):
                self.reject(r.node_id, f"update norm {norm} is not finite")
            else:
                under.append((r, norm))
        median = float(np.median([n for _, n in under])) if len(under) >= 3 else 0.0
        if not (self.max_norm_ratio and median > 0):
            return [r for r, _ in under]
        kept = []
        for r, norm in under:
            if norm > self.max_norm_ratio * median:
                self.reject(r.node_id, f"update norm {norm:.2g} > max-norm-ratio {self.max_norm_ratio:g} "
                                       f"x the round's median {median:.2g}")
            else:
                kept.append(r)
        return kept

    def parse_reply(self, msg: Message, node: int) -> ClientReport:
        """One reply -> ClientReport, or ReplyRejected naming the problem."""
        content = msg.content
        if len(content.array_records) != 1 or len(content.metric_records) != 1:
            raise ReplyRejected(
                f"expected one ArrayRecord and one MetricRecord, got "
                f"{list(content.array_records)} and {list(content.metric_records)}"
            )
        arrays = next(iter(content.array_records.values()))
        metrics = dict(next(iter(content.metric_records.values())))
        missing = [k for k in self.required_metrics if k not in metrics]
        if missing:
            raise ReplyRejected(f"metrics lack {missing} (strategy '{self.name}' needs them)")
        assert self.layout is not None and self.current is not None
        if (why := self.layout.mismatch(arrays)) is not None:
            raise ReplyRejected(why)
        model = self.layout.flatten(arrays)
        if not np.all(np.isfinite(model)):
            raise ReplyRejected("arrays contain NaN or Inf")
        if self.needs_client_ids and CLIENT_ID not in metrics:
            raise ReplyRejected(
                f"strategy '{self.name}' keeps per-client state: replies must carry metric "
                f"'{CLIENT_ID}' (the partition id, in [0, N))"
            )
        client_id = _count(metrics, CLIENT_ID, 0, (self.num_clients or 2**63) - 1, default=node)
        return ClientReport(
            client_id=client_id,
            node_id=node,
            delta=model - self.current,
            num_examples=_count(metrics, NUM_EXAMPLES, 1, self.max_num_examples),
            num_steps=_count(metrics, NUM_STEPS, 1, self.max_num_steps, default=None),
            a_norm=_positive(metrics, A_NORM),
            train_loss=_finite(metrics, TRAIN_LOSS),
            metrics=metrics,
        )

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
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly; subclasses extend with their own state."""
        return {"rng": self.rng.bit_generator.state, "client_of_node": dict(self.client_of_node),
                "node_of_client": dict(self.node_of_client)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.client_of_node = dict(state["client_of_node"])
        # checkpoints from before identity binding: bind as their last replies did
        self.node_of_client = dict(state.get("node_of_client")
                                   or {client: node for node, client in self.client_of_node.items()})


def _count(metrics: dict, key: str, low: int, high: int, default: Any = ReplyRejected) -> Any:
    if key not in metrics:
        if default is ReplyRejected:
            raise ReplyRejected(f"metric '{key}' missing")
        return default
    value = metrics[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ReplyRejected(f"metric '{key}'={value!r} is not an integer in [{low}, {high}]")
    return value


def _finite(metrics: dict, key: str) -> float | None:
    if key not in metrics:
        return None
    value = metrics[key]
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReplyRejected(f"metric '{key}'={value!r} is not a finite number")
    return float(value)


def _positive(metrics: dict, key: str) -> float | None:
    value = _finite(metrics, key)
    if value is not None and value <= 0:
        raise ReplyRejected(f"metric '{key}'={value!r} must be > 0")
    return value
