"""What a rule declares and overrides: the interface between the math and the Flower adapter.

:class:`Rule` holds a rule's class attributes (its name, the metrics it needs, whether it keeps
per-client rows, its paper's weighting, its declared ``State``, its client half and its extra
payloads) and the hooks the adapter (:class:`strategies.base.AvailabilityStrategy`) calls, with
their defaults. A rule module subclasses ``AvailabilityStrategy`` and overrides
:meth:`Rule.aggregate` (or, for a rule that streams, :meth:`Rule.start_fold`), and the hooks it
needs. A rule never builds or reads a message: what it sends beside the model and reads back
(SCAFFOLD's c and Δc_i, FedAWE's u_i and echo factor) it declares as named payloads
(:class:`Payload`: ``sends``, ``reads``), which the base packs, parses, bounds and hands over as
``report.payloads``; its client half is named by ``client_rule`` (``client_app.rules``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from . import state as rule_state
from .bounds import MAX_NORM_RATIO
from .intake import Probe
from .layout import safe_norm
from .payloads import Payload
from .protocol import NUM_EXAMPLES, PLAIN_RULE
from .replies import ClientReport
from .streaming import Fold, held_round


class Rule:
    """A rule's declarations and hooks (defaults: FedAvg's needs, no extra messages)."""

    name: ClassVar[str] = ""
    required_metrics: tuple[str, ...] = (NUM_EXAMPLES,)  # a rule may narrow it per instance (MIFA)
    # a missing metric's own reason (FedNova: what a-norm is)
    metric_hints: ClassVar[dict[str, str]] = {}
    # rules that keep per-client state in rows 0..N-1 need a client id in [0, N): the reported one,
    # else a row bound to the node for the run (logged once: a restarted node is a new client)
    needs_client_ids: ClassVar[bool] = False
    # rules whose math needs N
    needs_num_clients: ClassVar[bool] = False
    # why this rule cannot address a sampled fraction of the nodes ("" = it can)
    fixed_selection: ClassVar[str] = ""
    # rules whose paper weights every client 1/N refuse data-size weighting
    equal_weights_only: ClassVar[bool] = False
    # the weighting of the rule's paper, what weighting="auto" resolves to
    paper_weighting: ClassVar[str] = "equal"
    # the default of max_norm_ratio (strategies.bounds): the rule's checked norm's honest spread
    default_norm_ratio: ClassVar[float] = MAX_NORM_RATIO
    # whether the rule's update is a (weighted) mean of the round's Δ_i, which robust=median or
    # robust=trimmed-mean may replace (:meth:`AvailabilityStrategy.robust_mean`)
    mean_of_updates: ClassVar[bool] = False
    # whether the first norm check is ‖Δ_i‖, so robust=clip may scale Δ_i to the bound
    robust_clip: ClassVar[bool] = True
    # the rule's state (a dataclass whose fields name the attributes a resumed run needs)
    State: ClassVar[type] = rule_state.NoState
    # the rule sees one arrival at a time (strategies.asynchronous.AsyncRule: add, apply and the loop's members)
    asynchronous: ClassVar[bool] = False
    # the rule folds replies in as they arrive (start_fold): server memory O(model), not O(replies)
    streams: ClassVar[bool] = False
    # why a rule that does not stream must hold every reply of a round (logged once)
    holds_replies: ClassVar[str] = "its update reads every reply of the round at once"
    # the rule's client half (config ``client-rule``; client_app.rules.CLIENT_RULES): ``plain``
    # trains from the received model; SCAFFOLD's is client_app.scaffold, FedAWE's client_app.fedawe
    client_rule: ClassVar[str] = PLAIN_RULE
    # wire keys with this prefix are the rule's payloads, never the model ("scaffold.")
    namespace: ClassVar[str] = ""
    # payloads train messages carry beside the model (values: :meth:`send_payloads`)
    sends: ClassVar[tuple[Payload, ...]] = ()
    # payloads every reply must carry back (``report.payloads[name]``, bounded per ``Payload.bounded``)
    reads: ClassVar[tuple[Payload, ...]] = ()

    num_clients: int | None  # N (set by the base; the nodes connected at the first round when None)

    def require_num_clients(self) -> int:
        """N, or ValueError when the rule runs without it."""
        if self.num_clients is None:
            raise ValueError(f"strategy '{self.name}' needs num_clients (N)")
        return self.num_clients

    # ----------------------------------------------------------------- the rule (override)
    def aggregate(
        self, t: int, x: np.ndarray, reports: list[ClientReport]
    ) -> tuple[np.ndarray, dict[str, float]]:
        """Return x^{t+1} and the rule's metrics; t is 0-based (Flower round − 1). A rule writes
        this or :meth:`start_fold`, not both: by default every report is folded in, in client order."""
        fold = self.start_fold(t, x)
        if reports:
            fold.held_weights = dict(zip((r.client_id for r in reports), map(float, self.weights(reports)), strict=True))
        with held_round():  # every report's rows are held: added a block at a time
            for report in reports:
                fold.add(report)
        return fold.finish()

    def weights(self, reports: list[ClientReport]) -> np.ndarray:
        """Per-report weights summing to 1 over the reports (the base's)."""
        raise NotImplementedError

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        """Round t's running aggregate (rules with ``streams = True``): folding every accepted
        report in, in any order, gives what :meth:`aggregate` gives on them (to float rounding)."""
        raise NotImplementedError(f"strategy '{self.name}' does not stream ({self.holds_replies})")

    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        """Extra config entries sent with round t's train messages (hook)."""
        return {}

    def node_config(self, t: int, node: int) -> dict[str, Any]:
        """Extra config entries for node ``node``'s train message of round t alone (hook;
        SCAFFOLD: the round of its client's last applied reply, so the client commits only
        what the server applied). Nodes with entries get a message content of their own."""
        return {}

    def train_arrays(self, t: int, arrays: ArrayRecord) -> ArrayRecord:
        """The arrays round t's train messages carry (hook): x^t; SCAFFOLD adds c, FedAWE sends
        x^0 (its clients train from their own copies)."""
        return arrays

    def send_payloads(self, t: int) -> dict[str, np.ndarray]:
        """The flat values of the declared ``sends`` for round t's train messages (hook: SCAFFOLD's c)."""
        return {}

    def payload_norm(self, name: str, report: ClientReport) -> float:
        """The norm of payload ``name`` its bound compares (hook): its ‖·‖₂ by default."""
        return report.payload_norms[name]

    def broadcast_nodes(self, server_round: int) -> list[int]:
        """The nodes that get round ``server_round``'s new model right after aggregation, with
        the config of :meth:`train_config` (hook; FedAWE's postponed broadcast: the round's
        participants). Asked once per round; the base builds and sends the messages."""
        return []

    def evaluation_arrays(self, arrays: ArrayRecord) -> ArrayRecord:
        """The model to evaluate after a round (hook; FedExP evaluates an average)."""
        return arrays

    def extra_evaluation_arrays(self, arrays: ArrayRecord) -> dict[str, ArrayRecord]:
        """Other models this rule's paper scores, name -> arrays (hook; FedAWE: the mean of the
        clients' copies). The ServerApp evaluates each and records test-<metric>-<name>."""
        return {}

    def probe_request(self, server_round: int, connected: list[int]) -> Probe | None:
        """The round's probe stage, if any (hook; power-of-choice's candidates): the base sends
        it before :meth:`select_nodes` and leaves the answers in ``self.round.probe_answers``."""
        return None

    def select_nodes(self, server_round: int, arrays: ArrayRecord, connected: list[int],
                     grid: Grid) -> list[int]:
        """The connected nodes to train this round (hook; power-of-choice picks among the
        candidates it probed, ``self.round.probe`` and ``self.round.probe_answers``)."""
        return connected

    def update_norm(self, report: ClientReport) -> float:
        """The norm the sanity bounds compare (hook): ‖Δ_i‖₂ (:func:`safe_norm`: it cannot
        overflow). A rule whose replies are not updates of x^t (FedAWE's echoed models) may
        return a norm that means "how big is this client's own step"."""
        return report.norm if report.norm is not None else safe_norm(report.delta)

    def check_report(self, report: ClientReport) -> None:
        """Rule-specific checks of one parsed reply, its payloads decoded (hook): raise
        ReplyRejected to reject it (FedAWE: the echo factor's cap, the echoed start)."""

    def check_counts(self, rnd: Any, reports: list[ClientReport]) -> list[ClientReport]:
        """The reports whose counts pass the rule's own bounds (hook, before the norm bounds:
        FedNova's steps); the others go to ``rnd.reject(node, reason)``."""
        return reports

    def commit_counts(self, accepted: list[ClientReport]) -> None:
        """The round's accepted reports (hook: a rule's own count bounds remember them)."""

    def state_references(self) -> list[Any]:
        """Reference bounds kept outside the rule's attributes (a rule value's state's), for the intake."""
        return []

    # -------------------------------------------------------------------- state
    def get_state(self) -> Any:
        """The rule's state (``State``): copies of the attributes its fields name (hook)."""
        return rule_state.capture(self, self.State)

    def set_state(self, state: Any) -> None:
        """Take ``state`` (a ``State``) as the rule's state (hook)."""
        rule_state.restore(self, state)

    @classmethod
    def read_state(cls, saved: dict[str, Any]) -> Any:
        """The rule's ``State`` in a checkpoint (``state_dict()``), for reports."""
        return rule_state.unpack(saved, cls.name, cls.State)[3]
