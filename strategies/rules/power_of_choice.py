"""Power-of-choice client selection: train the clients whose loss is largest.

Cho, Wang and Joshi, "Towards Understanding Biased Client Selection in Federated Learning",
AISTATS 2022, Alg. 1 (pow-d) and Sec. 5 (cpow-d, rpow-d). Each round:

1. draw d candidates without replacement, with probability ∝ data size n_i (uniform while no
   size is known; a node whose size is not known yet gets the mean known size);
2. send them the current global model in an EVALUATE probe and read their local loss
   (``pow-d``: on all local data; ``cpow-d``: on one seeded mini-batch, config
   ``probe-batches`` = 1); ``rpow-d`` sends no probe and uses the train loss each client reported
   the last time it trained (never-seen clients first);
3. send training to the m candidates with the largest loss; aggregate as FedAvg over the clients
   that replied (equal or data-size weights, as the base's ``weighting``).

d = m is plain random selection.

Hostile losses (a deviation from the paper, only beyond the honest spread): a loss above
``max_loss_ratio`` (spec key ``max-loss-ratio``, default 100; 0 = off, the paper's ranking) times
the lower median of the round's finite losses (at least 3 of them) is not credible: that
candidate ranks after every credible one (metrics ``losses-out-of-range`` and ``loss-ratio-max``,
the largest loss over that median), so a client reporting 1e308 is not picked while m credible
candidates answered. A client reporting the top loss within the bound is still picked whenever
it is a candidate (docs/threat-model.md). The generator is the strategy's seeded ``self.rng``, drawn
afresh every round (the official code re-seeded it on every call, so its candidates repeated).

Unavailability: candidates are drawn among the CONNECTED nodes; one that is offline in this round
never answers the probe (the availability layer drops it) and is not chosen, so fewer than m may
train. Under rpow-d an offline candidate is chosen blindly and simply does not reply.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from ..base import AvailabilityStrategy, ClientReport
from ..bounds import MIN_POOL, lower_median
from ..intake import Probe
from ..metrics import names
from ..protocol import CLIENT_ID, EVAL_LOSS, NUM_EXAMPLES, PROBE_BATCHES, TRAIN_LOSS
from ..replies import ReplyRejected, count, finite
from ..sampling import draw
from ..weighting import weighted_sum

VARIANTS = ("pow-d", "cpow-d", "rpow-d")
MAX_LOSS_RATIO = 100.0  # x the lower median of the round's probe losses (module docstring)
flwr_log = logging.getLogger("flwr")


@dataclass
class PowerOfChoiceState:
    """Client id -> its data size (from any reply) and -> its train loss when it last trained."""

    size_of: dict[int, int]
    last_loss: dict[int, float]


class PowerOfChoice(AvailabilityStrategy):
    """Loss-biased client selection (Cho et al., AISTATS 2022, Alg. 1)."""

    name = "pow-d"
    mean_of_updates = True
    State = PowerOfChoiceState
    fixed_selection = ("power-of-choice chooses its own clients each round (d candidates probed, the m "
                       "with the largest loss trained): set d and m instead")

    def __init__(self, *, d: int = 10, m: int = 5, variant: str = "pow-d", probe_timeout: float = 60.0,
                 max_loss_ratio: float = MAX_LOSS_RATIO, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (math.isfinite(max_loss_ratio) and (max_loss_ratio == 0 or max_loss_ratio > 1)):
            raise ValueError(f"pow-d: max_loss_ratio (spec key max-loss-ratio) must be a finite number > 1 "
                             f"(0 = off), got {max_loss_ratio}")
        self.max_loss_ratio = float(max_loss_ratio)
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if not (isinstance(d, int) and isinstance(m, int) and d >= 1 and m >= 1):
            raise ValueError(f"pow-d needs integers d >= 1 and m >= 1, got d={d!r}, m={m!r}")
        if m > d:
            flwr_log.warning("pow-d: m=%d > d=%d: m capped to d=%d (every candidate trains)", m, d, d)
            m = d
        if not probe_timeout > 0:
            raise ValueError(f"probe_timeout must be > 0, got {probe_timeout}")
        self.d, self.m, self.variant, self.probe_timeout = int(d), int(m), variant, float(probe_timeout)
        self.size_of: dict[int, int] = {}  # client id -> num-examples, from any reply
        self.last_loss: dict[int, float] = {}  # client id -> train loss when it last trained (rpow-d)
        self.selection: dict[str, Any] = {}  # this round's selection metrics
        self.loss_check: dict[str, float] = {}  # this round's loss bound metrics
        self._capped_at: int | None = None  # the connected count of the last "capped" note

    # ------------------------------------------------------------------ selection
    def caps(self, connected: int) -> tuple[int, int]:
        """(d, m) for a round with ``connected`` nodes: d and m capped by them, with a logged note
        each time the number of connected nodes below d changes (the defaults d=10, m=5 then fit a
        small federation)."""
        d, m = min(self.d, connected), min(self.m, connected)
        if self.d > connected and connected != self._capped_at:
            flwr_log.info("pow-d: %d node(s) connected: d=%d capped to %d, m=%d to %d", connected, self.d, d,
                          self.m, m)
        self._capped_at = connected if self.d > connected else None
        return d, m

    def draw_candidates(self, nodes: list[int]) -> list[int]:
        """d nodes without replacement, ∝ known data size (uniform while none is known)."""
        k = self.caps(len(nodes))[0]
        sizes = np.array([self.size_of.get(self.client_of_node.get(n, -1), np.nan) for n in nodes], np.float64)
        p = None
        if k < len(nodes) and not np.all(np.isnan(sizes)):
            sizes[np.isnan(sizes)] = np.nanmean(sizes)
            p = sizes / sizes.sum()
        return draw(nodes, k, self.rng, p)

    def probe_request(self, server_round: int, connected: list[int]) -> Probe:
        """d candidates drawn among the connected nodes; pow-d and cpow-d probe them (the base
        sends the probe: ``probe-batches`` 1 for cpow-d, 0 = all local data), rpow-d does not."""
        return Probe(self.draw_candidates(connected), {PROBE_BATCHES: 1 if self.variant == "cpow-d" else 0},
                     self.probe_timeout, send=self.variant != "rpow-d")

    def read_probe(self, server_round: int, candidates: list[int], answers: dict[int, dict[str, Any]]) -> dict[int, float]:
        """Node -> local loss of the current model, for the candidates that answered the probe
        in time (``answers``: node -> its reply's metrics); a bad value is ignored, not trusted."""
        losses: dict[int, float] = {}
        for node, metrics in answers.items():
            try:  # the same readers as training replies
                loss = finite(metrics, EVAL_LOSS)
            except ReplyRejected:
                continue
            if loss is None:
                continue
            losses[node] = loss
            for read in (self._probe_client, self._probe_size):
                try:
                    read(node, metrics)
                except ReplyRejected:
                    pass
        if candidates and not answers:  # unavailability, or a probe_timeout too short for cold clients
            flwr_log.warning("pow-d, round %d: none of %d candidates answered the probe within "
                             "probe-timeout=%gs; nobody trains this round", server_round, len(candidates),
                             self.probe_timeout)
        if answers and not losses:  # the rule cannot choose: fail the run rather than train nobody
            self.problems.append(f"power-of-choice's probe got {len(answers)} evaluate replies, none with a "
                                 f"loss {names(EVAL_LOSS)}: add it to the ClientApp's evaluate reply")
        return losses

    def _probe_client(self, node: int, metrics: dict[str, Any]) -> None:
        client = count(metrics, CLIENT_ID, 0, (self.num_clients or 2**63) - 1, default=None)
        if client is not None and self.binding.may_claim(node, client):  # never another node's client
            self.client_of_node[node] = client

    def _probe_size(self, node: int, metrics: dict[str, Any]) -> None:
        size = count(metrics, NUM_EXAMPLES, 1, self.max_num_examples, default=None)
        if size is not None:  # a claim: at most the data-size bound, as a training reply's
            limit = self.bounds.examples.limit([float(v) for v in self.size_of.values()])
            self.size_of[self.binding.client(node, node)] = int(min(size, limit))

    def choose(self, candidates: list[int], losses: dict[int, float]) -> list[int]:
        """The m candidates with the largest credible loss (ties keep the random draw order);
        a loss beyond ``max_loss_ratio`` × the lower median of the finite ones ranks last."""
        finite = [v for v in losses.values() if math.isfinite(v)]
        reference = lower_median(finite) if len(finite) >= MIN_POOL else 0.0
        limit = self.max_loss_ratio * reference if self.max_loss_ratio and reference > 0 else math.inf
        out = [n for n in candidates if n in losses and math.isfinite(losses[n]) and losses[n] > limit]
        self.loss_check = {"losses-out-of-range": len(out),
                           **({"loss-ratio-max": max(finite) / reference} if reference > 0 else {})}
        ranked = sorted((n for n in candidates if n in losses), key=lambda n: (n in out, -losses[n]))
        return ranked[: self.m]

    def select_nodes(self, server_round: int, arrays: ArrayRecord, connected: list[int], grid: Grid) -> list[int]:
        """Train the m candidates (:meth:`probe_request`) with the largest loss: the probe's
        (pow-d, cpow-d) or the last train loss (rpow-d)."""
        probe = self.round.probe
        candidates = probe.nodes if probe is not None else []
        if self.variant == "rpow-d":
            losses = {n: self.last_loss.get(self.client_of_node.get(n, n), math.inf) for n in candidates}
        else:
            losses = self.read_probe(server_round, candidates, self.round.probe_answers)
        chosen = self.choose(candidates, losses)
        self.selection = {
            **self.loss_check,
            "candidates": len(candidates),
            "probe-replies": len(losses) if self.variant != "rpow-d" else 0,
            "chosen-clients": [int(self.client_of_node.get(n, n)) for n in chosen],
            # rpow-d: a never-seen client's loss is unknown, written -1
            "chosen-losses": [losses[n] if math.isfinite(losses[n]) else -1.0 for n in chosen],
        }
        return chosen

    # ------------------------------------------------------------------ aggregation
    def aggregate(self, t: int, x: np.ndarray, reports: list[ClientReport]):
        for r in reports:
            self.size_of[r.client_id] = r.num_examples
            if r.train_loss is not None:
                self.last_loss[r.client_id] = r.train_loss
        if self.variant == "rpow-d" and reports and all(r.train_loss is None for r in reports):
            self.problems.append(f"rpow-d ranks clients by their last train loss, and no reply carries "
                                 f"{names(TRAIN_LOSS)}: add it to the ClientApp's train reply")
        metrics = dict(self.selection)
        if not reports:
            return x, metrics
        u: np.ndarray | int | None = self.robust_mean(reports)
        if u is None:
            u = weighted_sum(self.weights(reports), (r.delta for r in reports))
        assert u is not None
        return x + self.server_lr * u, metrics
