"""The Flower adapter every aggregation rule shares: messages in and out, done once.

A rule (one module in :mod:`strategies.rules`) subclasses :class:`AvailabilityStrategy` and
writes only :meth:`aggregate` (or its streaming fold), the math: ``(round t, global flat vector x,
reports) -> (new flat vector, metrics)``, and declares what it needs, its state and its extra
payloads (:class:`strategies.rule.Rule`): this module packs what the rule sends, the intake parses
and bounds what it reads back, and no rule builds or reads a message. The class is
:class:`strategies.rule.Rule` (a rule's declarations and hooks, the one class it extends) and
Flower's ``Strategy``; the jobs are parts it holds, each built here and testable alone:
:class:`strategies.intake.ReplyIntake` (which replies of a round reach the rule, ``self.intake``,
with one value per round, ``self.round``), :class:`strategies.evaluate_round.Evaluation`
(Flower's evaluate round, the round-end broadcast, what ``evaluate_fn`` sees:
``self.evaluation``), and this module (the shared parameters turned into parts, Flower's train
round, checkpoints). It composes small parts:

- :mod:`strategies.params`: the shared parameters, one frozen value (Flower's ``FedAvg``
  arguments among them: :mod:`strategies.sampling`, :mod:`strategies.options`);
- :mod:`strategies.replies`: one reply -> a report or a rejection with its reason;
- :mod:`strategies.client_binding`: which node may speak for which client id;
- :mod:`strategies.bounds`: the update-norm bounds;
- :mod:`strategies.layout` and :mod:`strategies.weighting`: flat float32 vectors and weights;
- :mod:`strategies.state`: rule state through its declared fields, the one checkpoint layout;
- :mod:`strategies.metrics`: Flower's metric names;
- :mod:`strategies.failures`: one log line per reason and round; no silent failure.

It takes Flower's ``FedAvg`` arguments with Flower's meaning and works under Flower's own
``Strategy.start``: a rule's round-end broadcast (FedAWE) is delivered in ``configure_evaluate``,
which ``start`` calls right after aggregation. The ``send_and_receive`` timeout is the round
deadline; error replies and missing replies both mean "unavailable". A rejected reply never
reaches the rule, its state or the model.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from . import state as rule_state
from .bounds import NormBounds
from .client_binding import ClientBinding
from .evaluate_round import EvaluateFn, Evaluation, scored_evaluate_fn
from .failures import FailurePolicy, StrategyFailure, log_round
from .intake import ReplyIntake, RoundIntake
from .layout import Layout, aggregate_integers, distance, named_arrays, safe_norm
from .params import StrategyParams
from .payloads import pack_payloads
from .protocol import CLIENT_RULE, SERVER_ROUND
from .replies import (
    SUPERLINK_NODE_ID,
    ClientReport,
    ReplyRejected,
    RoundLog,
)
from .robust import Robust
from .rule import Rule
from .sampling import check_destinations
from .weighting import WEIGHTINGS, cap_shares, client_weights, resolve_weighting

__all__ = ["SUPERLINK_NODE_ID", "WEIGHTINGS", "AvailabilityStrategy", "ClientReport", "Layout",
           "ReplyRejected", "RoundLog", "StrategyFailure", "StrategyParams", "named_arrays", "safe_norm"]

log = logging.getLogger("flwr")  # Flower's logger: these lines appear where Flower's own do


class AvailabilityStrategy(Rule, Strategy):
    """Base of every rule here: the Flower adapter around reply parsing, client binding and bounds.

    ``params``: the shared parameters (:class:`StrategyParams`, which documents each); keyword
    arguments of the same names (Flower's ``FedAvg`` arguments among them) update it, so
    ``FedAU(num_clients=10, fraction_evaluate=0.5)`` and
    ``FedAU(params=StrategyParams(num_clients=10, fraction_evaluate=0.5))`` are one strategy.
    ``self.params`` keeps them; the parts built from them are ``sampling``, ``keys``, ``bounds``
    and ``failures``.
    """

    def __init__(self, params: StrategyParams | None = None, **kwargs: Any) -> None:
        params = (params or StrategyParams()).updated(**kwargs)
        self.params = params
        weighting = resolve_weighting(params.weighting, self.paper_weighting)
        self.bounds = params.bounds(self.default_norm_ratio)
        self.sampling = params.sampling()
        self.failures = FailurePolicy(self.name, params.max_failed_rounds)
        self.keys = params.record_keys()
        if self.fixed_selection and params.fraction_train != 1.0:
            raise ValueError(f"strategy '{self.name}': fraction_train={params.fraction_train} cannot apply: "
                             f"{self.fixed_selection}")
        if self.equal_weights_only and weighting != "equal":
            raise ValueError(f"strategy '{self.name}' weights clients equally (1/N, as its paper); "
                             f"weighting={weighting!r} is not supported")
        self.num_clients = params.num_clients  # N; the nodes connected at the first round when None
        self.server_lr = float(params.server_lr)
        self.weighting = weighting  # resolved: never "auto"
        self.robust = Robust.parse(params.robust)
        if self.robust.combines and not self.mean_of_updates:
            raise ValueError(f"strategy '{self.name}': robust={self.robust} replaces a mean of the round's updates, "
                             f"and this rule's update is not one (stored rows, per-client weights or momenta, "
                             f"echoes): use robust=clip, or a rule that averages the round's updates "
                             f"(docs/strategies.md, 'Robust aggregation')")
        if self.robust.clips and not self.robust_clip:
            raise ValueError(f"strategy '{self.name}': robust=clip scales Δ_i to the norm bound, and this rule's "
                             f"checked norm is not ‖Δ_i‖ (its replies are echoed models)")
        self.max_num_examples = params.max_num_examples
        self.max_num_steps = params.max_num_steps
        self.integer_arrays = params.integer_arrays
        self.max_weight_share = float(params.max_weight_share)
        self.rng = np.random.default_rng(params.seed)  # also Flower's fractions (no draw at fraction 1)
        # one bound per declared payload read back (Payload.bounded): the run's bounds, its own reference
        self.payload_bounds = {p.name: self.params.bounds() for p in self.reads if p.bounded}
        self.intake = ReplyIntake(self)  # which replies reach the rule (strategies.intake)
        self.round = RoundIntake()  # this round's intake: sent, received, accepted, rejected, problems
        self.evaluation = Evaluation(self)  # Flower's evaluate round and the round-end broadcast
        Evaluation.adopt_loop(self, AvailabilityStrategy.start)  # a user's own start loop
        self.layout: Layout | None = None
        self.current: np.ndarray | None = None  # x^t, flat (the floating arrays)
        self.current_integers: dict[str, np.ndarray] = {}  # x^t's other arrays
        self._waited = False  # the first round's wait for nodes is done
        self._holds_logged = False

    @property
    def current_arrays(self) -> ArrayRecord | None:
        """x^t as an ArrayRecord (Flower's strategies' attribute; tests set it, as Flower's do)."""
        if self.layout is None or self.current is None:
            return None
        return self.layout.unflatten(self.current, self.current_integers)

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
    def binding(self) -> ClientBinding:
        return self.intake.binding

    @property
    def round_log(self) -> RoundLog:
        """This round's record (``self.round.log``): sent, participants, unavailable, rejected."""
        return self.round.log

    @property
    def problems(self) -> list[str]:
        """This round's reasons the rule could not run (each names a fix)."""
        return self.round.problems

    @property
    def connected(self) -> set[int]:
        """Node ids the grid listed at this round's configure_train."""
        return self.round.connected

    @property
    def client_of_node(self) -> dict[int, int]:
        return self.binding.client_of_node

    @property
    def node_of_client(self) -> dict[int, int]:
        return self.binding.node_of_client

    def stacked(self, name: str, vectors: list[np.ndarray]) -> np.ndarray:
        """``np.stack(vectors)`` into a matrix reused across rounds (:class:`Scratch`)."""
        return self.intake.scratch.stacked(name, vectors)

    # ------------------------------------------------------------------ shared helpers
    def weights(self, reports: list[ClientReport]) -> np.ndarray:
        """Per-report weights summing to 1 over the reports (equal or by num-examples)."""
        w = client_weights(self.weighting, [r.num_examples for r in reports])
        return cap_shares(w, self.max_weight_share) if self.weighting == "num-examples" else w

    def robust_mean(self, reports: list[ClientReport]) -> np.ndarray | None:
        """The coordinate-wise median or trimmed mean of the reports' Δ_i (``robust``), float32;
        None when ``robust`` does not replace the mean (the rule then runs its own)."""
        if not self.robust.combines or not reports:
            return None
        return self.robust.combine(self.stacked("robust", [r.delta for r in reports]))

    def set_global(self, arrays: ArrayRecord) -> None:
        """Take ``arrays`` as x^t (what configure_train does; tests call it directly)."""
        self.layout = Layout.of(arrays)
        self.current = self.layout.flatten(arrays)
        self.current_integers = self.layout.integers(arrays)

    def arrays_of(self, vector: np.ndarray) -> ArrayRecord:
        """The ArrayRecord of flat vector ``vector`` with x^t's integer arrays."""
        assert self.layout is not None
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
            told = getattr(grid, "num_clients", None)  # a churn grid lists only the online clients: it knows N
            told = told if isinstance(told, int) and not isinstance(told, bool) and told > 0 else None
            if not nodes and told is None:
                raise StrategyFailure(f"strategy '{self.name}' needs num_clients (N) and no node connected "
                                      f"within node_wait={self.sampling.node_wait:g} s: pass num_clients=N")
            self.num_clients = told or len(nodes)
            log.info("%s: num_clients not given: N = %d, %s", self.name, self.num_clients,
                     "the grid's clients" if told else "the nodes connected at the first round")
        return nodes

    # ------------------------------------------------------------- Flower: train round
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.evaluation.deliver_broadcast(server_round - 1, arrays, grid)  # a loop that skipped configure_evaluate
        self.set_global(arrays)
        connected = self.connected_nodes(grid)
        self.round = RoundIntake(connected=set(connected))
        pool = self.sampling.sample(connected, True, self.rng)
        if (probe := self.probe_request(server_round, pool)) is not None:  # power-of-choice's probe stage
            self.round.probe = probe
            self.round.probe_answers = self.evaluation.probe(server_round, arrays, probe, grid)
        node_ids = check_destinations(self.select_nodes(server_round, arrays, pool, grid), connected, self.name)
        config[SERVER_ROUND] = server_round
        config[CLIENT_RULE] = self.client_rule
        for key, value in self.train_config(server_round - 1, node_ids).items():
            config[key] = value
        record = self.train_record(server_round - 1, arrays)
        content = self.keys.content(record, config)
        own = {n: extra for n in node_ids if (extra := self.node_config(server_round - 1, n))}
        sent = [Message(self.keys.content(record, ConfigRecord({**config, **own[n]})) if n in own else content,
                        dst_node_id=n, message_type=MessageType.TRAIN) for n in node_ids]
        problems = self.round.problems
        self.round = self.intake.new_round(sent, set(connected), self.current, self.layout)
        self.round.problems += problems
        return sent

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current is None or self.layout is None:
            raise RuntimeError("aggregate_train before configure_train/set_global (or current_arrays)")
        rnd, holds = self.round, self.reason_held()
        if rnd.current is not self.current:  # replies without configure_train (a test, Flower's mocks)
            problems, rnd = rnd.problems, self.intake.new_round(rnd.sent, rnd.connected, self.current, self.layout)
            self.round, rnd.problems = rnd, problems
        if holds:
            reports = self.intake.collect(rnd, replies)
            new, metrics = self.aggregate(server_round - 1, self.current, reports)
        else:  # streaming: each accepted reply folded in and let go (strategies.streaming)
            fold = self.start_fold(server_round - 1, self.current)
            reports = []
            for report in self.intake.stream(rnd, replies):
                fold.add(report)
                self.intake.release(report)
                reports.append(report)
            reports = self.intake.finish(rnd, reports)
            new, metrics = fold.finish()
        step = distance(new, self.current)  # NaN/Inf in x^{t+1} -> not finite
        if not math.isfinite(step):
            log.error("round %d: %s produced a non-finite model; keeping x^t", server_round, self.name)
            new, step = self.current, 0.0
        if self.keys.train_metrics_aggr_fn is not None and rnd.accepted_metrics:
            extra: Mapping[str, Any] = self.keys.train_metrics_aggr_fn(rnd.accepted_metrics, self.keys.weighted_by_key) or {}
            metrics = {**dict(extra), **metrics}
        record: dict[str, Any] = {
            "num-participants": len(reports),
            "num-unavailable": len(rnd.log.unavailable),
            "num-rejected": len(rnd.log.rejected),
            **({"num-examples-clipped": rnd.examples_clipped} if rnd.examples_clipped else {}),
            **({"num-clipped": rnd.norms_clipped} if rnd.norms_clipped else {}),
            "update-norm": step,
            **metrics,
        }
        losses = [r.train_loss for r in reports if r.train_loss is not None]
        if losses:
            record["train-loss"] = float(np.mean(losses))
        log_round(self.name, server_round, rnd.log)
        self.failures.end_round(server_round, rnd.received, len(reports), rnd.log.rejected, rnd.problems,
                                nodes=[*rnd.log.sent, *rnd.log.unavailable])
        integers = aggregate_integers(self.integer_arrays, self.current_integers, [r.integers for r in reports],
                                      self.weights(reports) if reports else np.zeros(0))
        return self.layout.unflatten(new, integers), MetricRecord(record)

    def train_record(self, t: int, arrays: ArrayRecord) -> ArrayRecord:
        """What round t's train messages carry: the rule's ``train_arrays`` (x^t; FedAWE's x^0)
        and its declared ``sends`` beside them (SCAFFOLD's c), packed here."""
        record = self.train_arrays(t, arrays)
        if not self.sends:
            return record
        assert self.layout is not None
        return pack_payloads(record, self.layout, self.sends, self.send_payloads(t))

    # ---------------------------------------------------------------- the intake's entry
    def parse_reply(self, msg: Message, node: int, rnd: RoundIntake) -> ClientReport:
        """One reply -> ClientReport with the rule's declared payloads, or ReplyRejected naming
        the problem (:meth:`ReplyIntake.parse`); Δ_i is taken against ``rnd.current``. Not a hook:
        a rule declares ``reads`` and checks the parsed report in ``check_report``."""
        return self.intake.parse(msg, node, rnd)

    def norm_checks(self) -> list[tuple[NormBounds, Callable[[ClientReport], float]]]:
        """The bounds a round's reports go through, in order, each with the norm it compares
        (hook): ``self.bounds`` on :meth:`update_norm`, then one per declared payload read back
        (``payload_bounds``, on :meth:`payload_norm`); FedAWE adds the returned model's distance.
        Each keeps its own reference, committed for the accepted reports and checkpointed."""
        return [(self.bounds, self.update_norm),
                *[(bounds, functools.partial(self.payload_norm, name)) for name, bounds in self.payload_bounds.items()]]

    def summary(self) -> None:
        log.info("%s: N=%s, server_lr=%s, weighting=%s, max-weight-share=%g, robust=%s, %s, %s, %s, "
                 "max_failed_rounds=%d, integer arrays: %s", self.name, self.num_clients, self.server_lr,
                 self.weighting, self.max_weight_share, self.robust, self.bounds, self.sampling, self.keys, self.failures.max_failed_rounds,
                 self.integer_arrays)

    def reason_held(self) -> str:
        """Why this strategy holds every reply of a round ("" when it streams: the rule declares
        ``streams`` and ``stream`` is on); logged the first time."""
        if not self.params.stream:
            why = "stream=false"
        elif self.robust.combines:
            why = f"robust={self.robust} takes the coordinate-wise statistic of every reply's update"
        elif not self.streams:
            why = self.holds_replies
        elif (override := self.reason_whole_round()):
            why = override
        elif self.weighting == "num-examples" and self.max_weight_share:
            why = "max-weight-share caps each weight against the whole round's (water-filling)"
        else:
            why = ""
        if not self._holds_logged:
            self._holds_logged = True
            log.info("%s: %s", self.name, f"holds every reply of a round: {why}" if why else
                     "aggregates replies as they arrive (streaming)")
        return why

    def reason_whole_round(self) -> str:
        """Why this rule's ``aggregate`` runs on the whole round ("" when its fold stands for it):
        declared, not inferred. A rule of ``strategies`` that declares ``streams`` folds what its
        ``aggregate`` computes (tests/test_streaming.py checks each); an ``aggregate`` written elsewhere
        (a user's rule on FedAvgActive) runs, unless its own class declares ``streams = True``."""
        cls = type(self)
        if cls.aggregate.__module__.split(".")[0] == __name__.split(".")[0] or "streams" in vars(cls):
            return ""
        return (f"{cls.__name__} writes its own aggregate ({cls.aggregate.__module__}), which runs on the whole "
                "round (a class whose start_fold computes the same declares streams = True)")

    # ---------------------------------------------------------- Flower: evaluate round
    def configure_broadcast(self, server_round: int, arrays: ArrayRecord, grid: Grid) -> list[Message]:
        """The round-end broadcast of ``server_round`` (``self.evaluation.broadcast``; FedAWE's)."""
        return self.evaluation.broadcast(server_round, arrays)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The round-end broadcast, then the scored model to a ``fraction_evaluate`` sample
        (``self.evaluation.configure``)."""
        return self.evaluation.configure(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """The clients' evaluate metrics (``self.evaluation.aggregate``)."""
        return self.evaluation.aggregate(replies)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: EvaluateFn | None = None) -> Any:
        """Flower's ``Strategy.start``, with ``timeout`` also the broadcasts' deadline and
        ``evaluate_fn`` shown the model the rule is scored on (:func:`scored_evaluate_fn`)."""
        self.evaluation.timeout = float(timeout)
        return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                             scored_evaluate_fn(self, evaluate_fn))

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, in the one layout of :mod:`strategies.state`."""
        return rule_state.pack(self.name, dict(self.rng.bit_generator.state), self.binding.state_dict(),
                               [bounds.state_dict() for bounds, _ in self.norm_checks()], self.get_state())

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from ``saved`` (a :meth:`state_dict`); ValueError if it is not a checkpoint of
        this rule."""
        rng, binding, bounds, state = rule_state.unpack(saved, self.name, self.State)
        checks = self.norm_checks()
        if len(bounds) != len(checks):
            raise ValueError(f"the checkpoint holds {len(bounds)} norm bounds' histories, strategy "
                             f"{self.name!r} keeps {len(checks)}")
        self.set_state(state)
        self.rng.bit_generator.state = rng
        self.binding.load_state_dict(binding)
        for (own, _), saved_bounds in zip(checks, bounds, strict=True):
            own.load_state_dict(saved_bounds)
