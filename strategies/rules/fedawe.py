"""FedAWE: adaptive weight echoing and implicit gossiping, server side.

Xiang et al., "Efficient Federated Learning against Heterogeneous and Non-stationary Client
Unavailability", NeurIPS 2024, Alg. 1; the server clip follows the official code
(mingxiang12/FedAWE, ``util.accumulation``).

Client i keeps its own copy x_i and τ_i, the last round it was available (−1 at first). In round t
an available client starts from ITS OWN copy, runs its local steps (Δ_i = x_i^{t,end} − x_i^{t,0}),
echoes x_i^† = x_i^{t,0} + η_g (t − τ_i) Δ_i, sets τ_i ← t and replies x_i^†. The server averages,
x^{t+1} = mean_{A_t} x_i^†, and sends x^{t+1} to the clients of A_t ONLY (the postponed broadcast:
they set x_i ← x^{t+1}; every other client keeps its older copy). The client side is
``client_app.fedawe`` (client rule ``fedawe``).

Protocol (this module owns the names; the client imports them):

- train and adopt config: ``client-rule = "fedawe"``, ``fedawe-server-lr`` (η_g, applied by the
  client in its echo), ``fedawe-send-update`` (always True: the server needs u_i, see below),
  ``fedawe-run-key`` (names the clients' state for this run; restored with a checkpoint).
- train messages carry the INITIAL model x^0, not x^t: a client that has no copy yet takes the
  model of its first message as its copy, and in the paper every copy starts at x^0 (a client
  first available in round t starts from x^0 with echo factor t + 1). Clients with a copy ignore
  the message's model. The server keeps x^0 (one model, not per client).
- reply: ONE ArrayRecord. Its model keys hold x_i^†, so averaging replies is all the paper's rule
  needs; metadata rides in extra keys with the prefix ``fedawe.``:

  * ``fedawe.echo-factor``: t − τ_i, shape (1,) (validated, reported as ``mean-echo-factor``);
  * ``fedawe.update.<key>``: u_i = (t − τ_i) Δ_i for each model array.

  Why u_i: one model-size vector cannot carry both x_i^{t,0} and u_i, and the server keeps no
  per-client model. With u_i the server (a) applies the official code's clip of the averaged
  echoed update, x^{t+1} = mean x_i^{t,0} + η_g clip(ū) = mean x_i^† + η_g (clip(ū) − ū), a
  nonlinear function of ū = mean u_i; (b) tracks x̄, the mean of ALL N clients' copies, which the
  official code scores (below). It doubles the reply's size. Keeping everything in the one
  ArrayRecord leaves the ClientApp's reply shape (one ArrayRecord + one MetricRecord) unchanged.

What is scored. The official code (mingxiang12/FedAWE, ``varying_awe.py`` with
``util.evaluate(w_global, device, w_local)``, called from ``statistic/collect_stat.py``) scores
FedAWE on x̄ = (1/N) Σ_{i=1}^{N} x_i, the mean of every client's copy, and the baselines on the
server model. Both are recorded here: ``test-accuracy`` on x^t as for every rule, and the x̄ score
(``extra_evaluation_arrays`` -> ``{"xbar": x̄}``, recorded as ``test-accuracy-xbar``). The server
tracks x̄ exactly without per-client state: after round t the clients of A_t hold x^{t+1} and the
others keep their copies, so

    x̄^{t+1} = x̄^t + (1/N) Σ_{i∈A_t} (x^{t+1} − x_i^{t,0}),   x_i^{t,0} = x_i^† − η_g u_i,

from x̄^0 = x^0. With equal weights, x^{t+1} = mean_{A_t} x_i^{t,0} + η_g clip(ū) gives
x̄^{t+1} = x̄^t + (|A_t|/N) η_g clip(ū) (clip = identity when off); the general form above also
holds for data-size weights. An empty round changes neither. (A client that ignores a stale
broadcast, ``client_app.fedawe``, would break the identity; it cannot happen in a run that
delivers round t's broadcast before round t + 1.)

A ClientApp that does not run the ``fedawe`` rule replies without ``fedawe.echo-factor``: its
reply is rejected with that reason (it would otherwise be plain FedAvg from x^0).

Server memory: x^t, x^0 and x̄ (three models), the round's running sums (:class:`EchoFold`: the
rule streams, each reply folded in and let go, so a round holds one reply, not the round's; two
sums, four with num-examples weights) and a few scalars; nothing per client beyond the node ->
client id map of the base and the last accepted round.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import scipy.linalg.blas as blas
from flwr.app import ArrayRecord

from ..base import AvailabilityStrategy, ClientReport, Layout, ReplyRejected, named_arrays, safe_norm
from ..bounds import NormBounds
from ..protocol import (  # noqa: F401  (re-exported: FedAWE's wire format)
    ACCEPTED_ROUND,
    ADOPT,
    CLIENT_RULE,
    FEDAWE_ECHO_FACTOR as ECHO_FACTOR,
    FEDAWE_META_PREFIX as META_PREFIX,
    FEDAWE_RULE as RULE,
    FEDAWE_RUN_KEY as RUN_KEY,
    FEDAWE_RUN_KEY_PATTERN as RUN_KEY_PATTERN,
    FEDAWE_SEND_UPDATE as SEND_UPDATE,
    FEDAWE_SERVER_LR as SERVER_LR,
    FEDAWE_UPDATE_PREFIX as UPDATE_PREFIX,
    SERVER_ROUND,
)
from ..rule import Payload
from ..streaming import Fold, RunningSum, example_weight
from .fedawe_sketch import BLOCK, FORM, SKETCH, Projection, restored_sketches  # noqa: F401  (BLOCK, SKETCH: sizes)

DISTANCE_RATIO = 1e3  # x the median of recent ‖x_i^† − x^t‖ (bounds.py: honest up to 157)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EchoReport(ClientReport):
    """A FedAWE reply's view (:meth:`of`): ``delta`` = x_i^† − x^t, the echo factor t − τ_i,
    u_i = (t − τ_i) Δ_i (flat float32) and ‖u_i‖, from the report's declared payloads."""

    echo_factor: int
    echo_update: np.ndarray
    echo_norm: float

    @classmethod
    def of(cls, report: ClientReport) -> EchoReport:
        """``report`` itself, its payloads (``echo-factor``, ``update``) as fields, or a plain
        report as a client that started from x^t with echo factor 1 (u_i = Δ_i)."""
        if isinstance(report, EchoReport):
            return report
        values = {f.name: getattr(report, f.name) for f in fields(ClientReport)}
        if FACTOR in report.payloads:
            return cls(**values, echo_factor=int(report.payloads[FACTOR][0]), echo_update=report.payloads[UPDATE],
                       echo_norm=report.payload_norms[UPDATE])
        norm = report.norm if report.norm is not None else safe_norm(report.delta)
        return cls(**values, echo_factor=1, echo_update=report.delta, echo_norm=norm)


FACTOR, UPDATE = "echo-factor", "update"  # FedAWE's declared payloads' names (report.payloads)


@dataclass
class FedAWEState:
    """The run key naming the clients' state, x^0 (name -> array), x̄ (flat float64) and, per
    client id, the last round its reply was accepted (caps the echo factor)."""

    run_key: str
    initial: dict[str, np.ndarray] | None
    xbar: np.ndarray | None = None
    last_accepted: dict[int, int] = field(default_factory=dict)
    sketch_seed: int = 0  # the secret projection of the consistency check (0: none yet)
    sketches: dict[int, np.ndarray] = field(default_factory=dict)  # round t -> P x^t
    sketch_form: int = 1  # how P is drawn from the seed (fedawe_sketch.FORM; 1: a checkpoint of the dense P)

    def __post_init__(self) -> None:
        if not RUN_KEY_PATTERN.fullmatch(str(self.run_key)):
            raise ValueError(f"fedawe: bad run key in the checkpoint: {self.run_key!r}")


class FedAWE(AvailabilityStrategy):
    """FedAWE (Xiang et al., NeurIPS 2024, Alg. 1): x^{t+1} = mean_{A_t} x_i^†, postponed broadcast.

    Parameters
    ----------
    clip : the official code's clip of the averaged echoed update mean_{A_t} (t − τ_i) Δ_i to
        this norm before η_g (0.5 there; the published numbers used it). 0 = off (the paper).
    check_start : reject a reply whose x_i^† − η_g u_i is no model the client can hold
        (:meth:`_check_start`: x^0, a broadcast since, or x^t); spec key ``check-start``,
        true by default (the paper's server trusts u_i: ``check-start=false``).

    The client applies η_g (``server_lr``) in its echo; the weights are equal over A_t
    (``weighting="num-examples"`` weights the mean by data size instead). The official code
    scores FedAWE on x̄, the mean of all N clients' copies: the server tracks x̄ (module
    docstring; needs ``num_clients``) and offers it for evaluation as ``"xbar"``. Metrics:
    ``mean-echo-factor`` (mean t − τ_i over A_t), ``echo-update-norm`` (‖mean u_i‖ before any
    clip), ``echo-clipped`` (with the clip: 1 when it clipped) and ``xbar-gap`` (‖x̄ − x^{t+1}‖).
    """

    name = "fedawe"
    State = FedAWEState
    client_rule = RULE  # its client half: client_app.fedawe.FedAWERule
    namespace = META_PREFIX
    reads = (Payload(FACTOR, ECHO_FACTOR, "echo factor t − τ_i", scalar=True, bounded=False,
                     missing=f"this node does not run FedAWE's client rule ('{RULE}'). A ClientApp takes part "
                             "with client_app.dropin: ClientApp(mods=[client_rule_mod]) and "
                             "app.train(\"adopt\")(adopt)"),
             # bounded as the rule's update_norm: ‖u_i‖ / (t − τ_i), the client's own step
             Payload(UPDATE, UPDATE_PREFIX, "echoed update", bounded=False,
                     missing="the server needs the client's echoed update u_i (config fedawe-send-update) "
                             "for its clip and x̄"))
    robust_clip = False  # its first norm is ‖u_i‖/(t − τ_i), not ‖Δ_i‖ = ‖x_i^† − x^t‖
    streams = True  # ū, Σ w_i Δ_i and x̄'s terms are sums; the clip acts on ū once (EchoFold)
    needs_num_clients = True  # x̄ is the mean over all N clients' copies
    # ‖u_i‖/(t − τ_i) of a client back from a stale copy: honest up to 12.3 x the reference
    # (benchmarks/honest_variation.py, digits Dirichlet 0.2, 1-5 local epochs), where every other
    # rule's honest ‖Δ_i‖ stayed within 2.4
    default_norm_ratio = 30.0

    def __init__(self, *, clip: float = 0.0, check_start: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.check_start = bool(check_start)  # FedAWE._check_start; false: trust u_i (the paper's server)
        if not (math.isfinite(clip) and clip >= 0):
            raise ValueError(f"fedawe: clip must be a finite number >= 0 (0 = off), got {clip}")
        self.clip = float(clip)
        self.run_key = secrets.token_hex(8)  # new run, new client state; kept by checkpoints
        self.initial: dict[str, np.ndarray] | None = None  # x^0, the copy every client starts with
        self.xbar: np.ndarray | None = None  # x̄, the mean of all N clients' copies, flat float64
        self._t = 0  # 0-based round being collected (bounds the echo factor)
        self._adopters: tuple[int, list[int]] = (0, [])  # (server round, node ids of A_t)
        self.last_accepted: dict[int, int] = {}  # client id -> last round its reply was accepted
        # ‖x_i^† − x^t‖: how stale a client's copy is, legitimately up to 157 x the median (bounds.py)
        self.distance_bounds = NormBounds(float(self.params.max_update_norm), DISTANCE_RATIO, 0.0, 0.0)
        self.sketch_seed = secrets.randbits(63) or 1  # secret: the clients do not know P
        self.sketches: dict[int, np.ndarray] = {}  # round t -> P x^t (SKETCH numbers per round)
        self.sketch_form = FORM
        self._projection: Projection | None = None  # P, from sketch_seed (fedawe_sketch)
        self._current_norm: float | None = None  # ‖x^t‖₂, this round's (reset by configure_train)

    # ------------------------------------------------------------------ messages out
    def client_config(self) -> dict[str, Any]:
        """What the client rule needs, in train and adopt messages alike."""
        return {CLIENT_RULE: self.client_rule, SERVER_LR: self.server_lr, SEND_UPDATE: True, RUN_KEY: self.run_key}

    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        return self.client_config()

    def node_config(self, t: int, node: int) -> dict[str, Any]:
        """The round of this node's client's last applied reply (−1: none): its client moves
        τ_i only to a round the server applied (client_app.fedawe)."""
        return {ACCEPTED_ROUND: self.last_accepted.get(self.client_of_node.get(node, -1), -1)}

    def train_arrays(self, t: int, arrays: ArrayRecord) -> ArrayRecord:
        """x^0 (the clients train from their own copies, which start there); keeps the sketches
        P x^0 and P x^t that check the echoed starts (:meth:`_check_start`)."""
        first = self.initial is None
        if first:  # the first model this strategy sees is x^0
            self.initial = dict(zip(arrays.keys(), (np.array(a) for a in arrays.to_numpy_ndarrays()),
                                    strict=True))
        self._t = t
        assert self.initial is not None and self.layout is not None
        initial = named_arrays(self.initial)
        if Layout.of(initial) != self.layout:
            raise ValueError("fedawe: the stored initial model does not match the global model's layout")
        if first and self.num_clients is not None:  # every copy starts at x^0
            self.xbar = self.layout.flatten(initial).astype(np.float64)
        if first:
            self.sketches[-1] = self.projection().of_model(self.layout.flatten(initial))  # x^0
        assert self.current is not None
        self.sketches[self._t] = self.projection().of_model(self.current)  # x^t
        self._current_norm = None
        return initial

    def broadcast_nodes(self, server_round: int) -> list[int]:
        """x^{t+1} goes to the round's participants only (the nodes of its valid replies), once:
        the project's ServerApp sends it itself, Flower's ``start`` through ``configure_evaluate``."""
        rnd, nodes = self._adopters
        if rnd != server_round or not nodes:
            return []
        self._adopters = (0, [])
        return nodes

    # -------------------------------------------------------------------- replies in
    def check_report(self, report: ClientReport) -> None:
        """The echo factor (an integer, capped by the client's history) and the echoed start
        (:meth:`_check_start`) of a reply whose payloads the base decoded (``reads``)."""
        self._echo_factor(report)
        self._check_start(report, report.payloads[UPDATE])

    def _echo_factor(self, report: ClientReport) -> int:
        """t − τ_i, at most t − (the last round whose reply from this client was accepted)."""
        value = float(report.payloads[FACTOR][0])
        if value != int(value):
            raise ReplyRejected(f"'{ECHO_FACTOR}' must be one integer, got {value}")
        factor = int(value)
        cap = self._t - self.last_accepted.get(report.client_id, -1)
        if not 1 <= factor <= cap:
            raise ReplyRejected(f"'{ECHO_FACTOR}'={factor} is outside [1, {cap}]: t − the round of client "
                                f"{report.client_id}'s last accepted reply (t + 1 when none)")
        return factor

    def projection(self) -> Projection:
        """P (:mod:`strategies.rules.fedawe_sketch`), from the secret ``sketch_seed``."""
        assert self.current is not None
        if self._projection is None or self._projection.size != self.current.size:
            self._projection = Projection(self.sketch_seed, self.current.size)
        return self._projection

    def set_state(self, state: Any) -> None:
        """The base's restore, then P anew from the restored seed; sketches of another P are
        refused while the check is on, else dropped (:func:`restored_sketches`)."""
        super().set_state(state)
        self._projection, self._current_norm = None, None
        self.sketches, self.sketch_form = restored_sketches(self.name, self.sketches, self.sketch_form, self.check_start)

    def _check_start(self, report: ClientReport, update: np.ndarray) -> None:
        """x_i^{t,0} = x_i^† − η_g u_i must be a model the client can hold: x^0, or a broadcast
        x^{s+1} of a round s ≤ its last accepted one, or x^t (a plain reply, as
        :meth:`EchoReport.of` reads one: it then moves x̄ by at most ‖x^t − its copy‖ / N).
        Checked on P x (P secret, Gaussian, a few rows): a start off every such model by e gives
        P e ~ N(0, ‖e‖²) per row, far beyond the float32 rounding of an honest reply
        (:meth:`Projection.tolerance`). The one model-sized work is P (Δ_i − η_g u_i)
        (:meth:`Projection.of_start`). Without the sketches (a checkpoint from before them): no check."""
        assert self.current is not None
        if not self.check_start:
            return
        rounds = [-1, self._t, *range(self.last_accepted.get(report.client_id, -2) + 2)]  # x^0, x^t, x^{s+1}
        known = [self.sketches[s] for s in rounds if s in self.sketches]
        if -1 not in self.sketches:
            return
        p = self.projection()
        if self._current_norm is None:  # once a round
            self._current_norm = safe_norm(self.current)
        delta_norm = report.norm if report.norm is not None else safe_norm(report.delta)
        update_norm = report.payload_norms[UPDATE] if UPDATE in report.payload_norms else safe_norm(update)
        # P x_i^{t,0} = P x^t + P (Δ_i − η_g u_i) (P x^t: this round's sketch)
        sketch, start_norm = p.of_start(report.delta, update, self.server_lr)
        got = self.sketches[self._t] + sketch
        tol = p.tolerance(self._current_norm, delta_norm, update_norm, self.server_lr, start_norm)
        if not (np.all(np.isfinite(got)) and math.isfinite(tol)) or not any(np.all(np.abs(got - s) <= tol)
                                                                            for s in known):
            raise ReplyRejected("the returned model and the echoed update u_i disagree: x_i^† − η_g u_i is not x^0 "
                                "nor a model broadcast to this client since (FedAWE's consistency check)")

    # ------------------------------------------------------------------------ the rule
    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        """Round t as running sums (:class:`EchoFold`); the base's ``aggregate`` folds a held round."""
        return EchoFold(self, t, x)

    def extra_evaluation_arrays(self, arrays: ArrayRecord) -> dict[str, ArrayRecord]:
        """{"xbar": x̄}: the model the official code scores FedAWE on (empty before round 1)."""
        if self.xbar is None or self.layout is None:
            return {}
        return {"xbar": self.arrays_of(self.xbar)}

    def update_norm(self, report: ClientReport) -> float:
        """‖Δ_i‖ = ‖u_i‖ / (t − τ_i), the client's own local change (for the base's sanity bound).

        Not ‖x_i^† − x^t‖, which measures how stale the client's copy is, and not ‖u_i‖, which the
        echo factor (up to t + 1, legitimately above 100 for rare clients) inflates.
        """
        echo = EchoReport.of(report)
        return echo.echo_norm / echo.echo_factor

    def norm_checks(self) -> list[tuple[NormBounds, Callable[[ClientReport], float]]]:
        """The client's own step (:meth:`update_norm`) through the bounds, then the returned model's
        distance ‖x_i^† − x^t‖ through the same bounds, with its own running median."""
        def distance(r: ClientReport) -> float:
            return r.norm if r.norm is not None else safe_norm(r.delta)

        return [*super().norm_checks(), (self.distance_bounds, distance)]

    def summary(self) -> None:
        log.info("fedawe: N=%s, server_lr=%s (applied by the clients), clip=%s, run key %s",
                 self.num_clients, self.server_lr, self.clip or "off", self.run_key)


class EchoFold(Fold):
    """FedAWE's round as running sums, O(d) memory: Σ w_i u_i (ū: its norm and clip once, at
    :meth:`finish`), Σ w_i Δ_i, and for x̄ with num-examples weights Σ Δ_i and Σ u_i; w_i = 1 or n_i
    (``held_weights`` in a held round), normalised at the end. The participants (the broadcast,
    ``last_accepted``) are recorded at :meth:`finish`: later replies are capped as in a held round."""

    def __init__(self, rule: FedAWE, t: int, x: np.ndarray) -> None:
        self.rule, self.t, self.x = rule, t, x
        self.weight_of = example_weight(rule.weighting)
        self.updates, self.deltas = RunningSum(x.size), RunningSum(x.size)
        self.plain = None if rule.weighting == "equal" or rule.xbar is None else (RunningSum(x.size), RunningSum(x.size))
        self.factors = 0
        self.clients: list[tuple[int, int]] = []  # (client id, node id)

    def add(self, report: ClientReport) -> None:
        echo = EchoReport.of(report)
        weight = self.report_weight(echo, self.weight_of)
        self.updates.add(weight, echo.echo_update)
        self.deltas.add(weight, echo.delta)
        if self.plain is not None:
            self.plain[0].add(1.0, echo.delta)
            self.plain[1].add(1.0, echo.echo_update)
        self.factors += echo.echo_factor
        self.clients.append((echo.client_id, echo.node_id))

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        """x^{t+1} = x^t + Σ w_i Δ_i = Σ w_i x_i^† (clipped: mean x_i^{t,0} + η_g clip(ū)), then x̄'s step."""
        rule, x, m = self.rule, self.x, len(self.clients)
        self.clients.sort()
        rule._adopters = (self.t + 1, [node for _, node in self.clients])
        for client, _ in self.clients:  # caps the echo factor of this client's next reply
            rule.last_accepted[client] = self.t
        if not m:
            return x, {} if rule.xbar is None else {"xbar-gap": float(np.linalg.norm(rule.xbar - x))}
        u, new = self.updates.total, self.deltas.total  # spent here: ū and x^{t+1} in place, float64
        if self.deltas.weight != 1.0:  # normalised
            u, new = np.divide(u, self.deltas.weight, out=u), np.divide(new, self.deltas.weight, out=new)
        norm, k = float(np.linalg.norm(u)), 1.0  # ‖ū‖; k ū = clip(ū)
        metrics = {"mean-echo-factor": self.factors / m, "echo-update-norm": norm}
        if rule.clip > 0:  # mean x_i^† = mean x_i^{t,0} + η_g ū -> mean x_i^{t,0} + η_g clip(ū) (official code)
            k = rule.clip / norm if norm > rule.clip else 1.0
            metrics["echo-clipped"] = float(norm > rule.clip)
        new += x  # x^t + Σ w_i Δ_i
        if k != 1.0:
            new = blas.daxpy(u, new, a=rule.server_lr * (k - 1.0))
        out = new.astype(np.float32)
        if rule.xbar is not None:
            # A_t's clients move from x_i^{t,0} = x_i^† − η_g u_i to x^{t+1}, the others stay (module docstring):
            # Σ (x^{t+1} − x_i^{t,0}) = m (x^{t+1} − x^t) − Σ Δ_i + η_g Σ u_i, in float64, in ``new``; with equal
            if self.plain is None:  # weights m (x^{t+1} − new + η_g k ū), new = x^t + Σ w_i Δ_i + η_g (k − 1) ū
                np.subtract(out, new, out=new)
                new, scale = blas.daxpy(u, new, a=rule.server_lr * k), m / rule.require_num_clients()
            else:
                np.subtract(out, x, out=new, dtype=np.float64)
                new *= m
                new -= self.plain[0].total
                new, scale = blas.daxpy(self.plain[1].total, new, a=rule.server_lr), 1.0 / rule.require_num_clients()
            new *= scale
            rule.xbar = np.add(new, rule.xbar, out=new)  # a new array (the old one may be someone's)
            metrics["xbar-gap"] = float(np.linalg.norm(np.subtract(new, out, out=u)))
        return out, metrics
