"""Flower's fixed-clipping DP wrappers, with the noise of each round calibrated to the clients that
really took part and the round's (ε, δ) accounted and recorded.

Flower's ``DifferentialPrivacy{Server,Client}SideFixedClipping`` (Message API,
``flwr.serverapp.strategy``; and the legacy ``flwr.server.strategy`` ones, which Flower's
``fl-dp-sa`` example runs under SecAgg+) add noise of standard deviation z·C/n to the aggregate,
n = ``num_sampled_clients`` fixed at construction. Under churn m_t ≠ n clients reply, so the
round's real noise multiplier is z·m_t/n (fewer clients: less privacy than configured); Flower
only warns. The classes here take the same arguments plus the population and δ:

- ``calibration="realised"`` (default): σ_t = z·Δ_t with Δ_t = C·max_i w_i/Σ_i w_i over the
  round's replies (C/m_t under equal weights): every round has multiplier z, whatever m_t.
- ``calibration="target"``: Flower's σ = z·C/n, kept; the round's effective multiplier σ/Δ_t is
  what is accounted (and stated).

The round's aggregation step is this module's (Flower's wrappers' own ``aggregate_train`` /
``aggregate_fit`` are replaced, not called): Flower's clipping function on each reply (server side),
the inner strategy's aggregate, Flower's Gaussian at the planned σ. Flower's ``configure_*``,
evaluation and ``summary`` are kept; Flower's ``accountant=`` argument is not taken (it refuses
churn: docs/privacy.md).

Every round is composed by :class:`privacy.accountant.ChurnAccountant` at q_t = m_t/N; its
figures join the round's metrics (``dp-epsilon``, ``dp-epsilon-worst-client``, ...), Flower's
log, and, with ``results_dir``, one line of ``privacy.jsonl``. A reply that carries an error, and
under SecAgg+ a client that dropped out (Flower's ``failures``), is a client that did not take
part: it is left out and logged, where Flower's wrappers would skip the round's aggregation. The
weights w_i are the replies' ``weighted_by_key`` metric (``num-examples``; legacy: ``FitRes
.num_examples``), the weights Flower's FedAvg and SecAgg+ aggregate with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.common import FitRes, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.logger import FLOWER_LOGGER
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import (
    DifferentialPrivacyClientSideFixedClipping as LegacyClientSide,
    DifferentialPrivacyServerSideFixedClipping as LegacyServerSide,
)
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping as FlowerClientSide,
    DifferentialPrivacyServerSideFixedClipping as FlowerServerSide,
    Strategy,
)
from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_clip_model_update

from .accountant import ChurnAccountant, PrivacyConfigError, Spent

CALIBRATIONS = ("realised", "target")
RECORD = "privacy.jsonl"


class ChurnNoise:
    """The part every wrapper holds: the calibration, the accountant and the record.

    Args:
        num_clients: N, the population the accountant's q_t = m_t / N is over.
        delta: δ of the reported ε.
        calibration: ``"realised"`` or ``"target"`` (module docstring).
        accountant: ``"rdp"`` or ``"pld"`` (:class:`~privacy.accountant.ChurnAccountant`).
        results_dir: where ``privacy.jsonl`` goes (None: metrics and log only).
    """

    def __init__(self, num_clients: int, delta: float, *, calibration: str = "realised",
                 accountant: str = "rdp", results_dir: str | Path | None = None) -> None:
        if calibration not in CALIBRATIONS:
            raise PrivacyConfigError(f"calibration {calibration!r}: known are {', '.join(CALIBRATIONS)} "
                                     "(realised: noise for the clients that replied; target: Flower's, for "
                                     "num_sampled_clients)")
        self.calibration = calibration
        self.accountant = ChurnAccountant(num_clients, delta, method=accountant)
        self.path = Path(results_dir) / RECORD if results_dir is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
        self.std: float | None = None  # the round's σ, between `plan` and the noise

    def plan(self, noise_multiplier: float, clipping_norm: float, target: int, weights: Sequence[float]) -> float:
        """Set the round's σ from its replies' weights; returns its effective multiplier σ / Δ_t."""
        if not weights:
            self.std = None
            return 0.0
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise PrivacyConfigError(f"aggregation weights {list(weights)}: each must be positive and finite "
                                     "(the round's sensitivity C·max w / Σ w needs them)")
        sensitivity = clipping_norm * max(weights) / sum(weights)
        if self.calibration == "realised":
            self.std = noise_multiplier * sensitivity
        else:
            self.std = noise_multiplier * clipping_norm / target
        return self.std / sensitivity

    def noised(self, arrays: list[Any]) -> list[Any]:
        """The aggregate with the planned noise (Flower's own Gaussian, in place)."""
        if self.std is None:
            raise RuntimeError("privacy: noise asked for before the round's replies were seen (plan)")
        add_gaussian_noise_inplace(arrays, self.std)
        FLOWER_LOGGER.info("aggregate_fit: central DP noise with %.4f stdev added (%s calibration)",
                           self.std, self.calibration)
        return arrays

    def release(self, rnd: int, clients: Iterable[Any], noise_multiplier: float) -> Spent:
        """Account the round (no clients: nothing released), log and record it. Rounds since the
        last one recorded that released nothing (a halted SecAgg+ round: no aggregate) get their
        line first."""
        last = self.accountant.history[-1].round if self.accountant.history else 0
        for skipped in range(last + 1, rnd):
            self._record(self.accountant.compose(skipped, [], 0.0))
        spent = self.accountant.compose(rnd, list(clients), noise_multiplier)
        self.std = None
        FLOWER_LOGGER.info("privacy, round %d: %d of %d clients, z = %.4g, epsilon = %.4g (Poisson at q = %.3g; "
                           "worst client without amplification: %.4g) at delta = %g", rnd, spent.participants,
                           spent.population, spent.noise_multiplier, spent.epsilon, spent.sampling_rate,
                           spent.epsilon_worst_client, spent.delta)
        self._record(spent)
        return spent

    def _record(self, spent: Spent) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({**spent.record(), "calibration": self.calibration}) + "\n")


def _weight(metrics: MetricRecord | None, key: str, node: int) -> float:
    value = metrics.get(key) if metrics is not None else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PrivacyConfigError(f"privacy: the reply of node {node} has no numeric {key!r} metric: the round's "
                                 f"sensitivity needs each client's aggregation weight")
    return float(value)


def clip_update(update: list[Any], reference: list[Any], clipping_norm: float) -> None:
    """Flower's fixed clipping of ``update - reference`` in place (a zero update is within any norm:
    Flower's own step divides by its norm)."""
    if any(np.any(u != r) for u, r in zip(update, reference, strict=True)):
        compute_clip_model_update(update, reference, clipping_norm)


def _warn_target(wrapper: Any, rnd: int, took_part: int, z: float) -> None:
    if wrapper.churn.calibration == "target" and took_part and took_part != wrapper.num_sampled_clients:
        FLOWER_LOGGER.warning("privacy, round %d: %d clients took part, the noise is for %d (calibration "
                              "'target'): the round's noise multiplier is %.4g (accounted)", rnd, took_part,
                              wrapper.num_sampled_clients, z)


def _message_round(wrapper: Any, rnd: int, replies: Iterable[Message], clip: bool
                   ) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Message API, Flower's wrapper's round with the planned σ: error replies left out, the
    updates clipped (server side), the inner strategy's aggregate, the noise, the account."""
    replies = list(replies)
    took_part = [r for r in replies if not r.has_error()]
    if len(took_part) < len(replies):
        FLOWER_LOGGER.info("privacy, round %d: %d error replies left out (clients that did not take part)",
                           rnd, len(replies) - len(took_part))
    key = getattr(wrapper.strategy, "weighted_by_key", "num-examples")
    weights = [_weight(next(iter(r.content.metric_records.values()), None), key, r.metadata.src_node_id)
               for r in took_part]
    z = wrapper.churn.plan(wrapper.noise_multiplier, wrapper.clipping_norm, wrapper.num_sampled_clients, weights)
    _warn_target(wrapper, rnd, len(took_part), z)
    if clip and took_part:
        reference = wrapper.current_arrays.to_numpy_ndarrays()
        for reply in took_part:
            for name, record in reply.content.array_records.items():
                update = record.to_numpy_ndarrays()
                clip_update(update, reference, wrapper.clipping_norm)
                reply.content[name] = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(record.keys(), update,
                                                                                           strict=True)})
    arrays, metrics = wrapper.strategy.aggregate_train(rnd, took_part) if took_part else (None, None)
    if arrays is not None:
        noised = wrapper.churn.noised(arrays.to_numpy_ndarrays())
        arrays = ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(arrays.keys(), noised, strict=True)})
    spent = wrapper.churn.release(rnd, [r.metadata.src_node_id for r in took_part] if arrays is not None else [], z)
    metrics = MetricRecord({**(dict(metrics) if metrics is not None else {}), **spent.metrics()})
    return arrays, metrics


class DifferentialPrivacyServerSideFixedClipping(FlowerServerSide):
    """Flower's server-side fixed clipping (Message API) under churn; see the module docstring.

    Example::

        strategy = DifferentialPrivacyServerSideFixedClipping(
            FedAvg(), noise_multiplier=1.0, clipping_norm=0.5, num_sampled_clients=10,
            num_clients=20, delta=1e-5, results_dir="out")
    """

    def __init__(self, strategy: Strategy, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int,
                 *, num_clients: int, delta: float, calibration: str = "realised", accountant: str = "rdp",
                 results_dir: str | Path | None = None) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients)
        self.churn = ChurnNoise(num_clients, delta, calibration=calibration, accountant=accountant,
                                results_dir=results_dir)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return _message_round(self, server_round, replies, clip=True)


class DifferentialPrivacyClientSideFixedClipping(FlowerClientSide):
    """Flower's client-side fixed clipping (Message API: clients add ``fixedclipping_mod``) under
    churn; the arguments of :class:`DifferentialPrivacyServerSideFixedClipping`."""

    def __init__(self, strategy: Strategy, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int,
                 *, num_clients: int, delta: float, calibration: str = "realised", accountant: str = "rdp",
                 results_dir: str | Path | None = None) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients)
        self.churn = ChurnNoise(num_clients, delta, calibration=calibration, accountant=accountant,
                                results_dir=results_dir)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return _message_round(self, server_round, replies, clip=False)


def _legacy_round(wrapper: Any, rnd: int, results: list[tuple[ClientProxy, FitRes]],
                  failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
    """Legacy API (Flower's workflows, SecAgg+): aggregate the clients that took part, noise, account."""
    if failures:
        FLOWER_LOGGER.info("privacy, round %d: %d failures left out (clients that did not take part)",
                           rnd, len(failures))
    z = wrapper.churn.plan(wrapper.noise_multiplier, wrapper.clipping_norm, wrapper.num_sampled_clients,
                           [float(res.num_examples) for _, res in results])
    _warn_target(wrapper, rnd, len(results), z)
    params, metrics = wrapper.strategy.aggregate_fit(rnd, results, []) if results else (None, {})
    if params is not None:
        params = ndarrays_to_parameters(wrapper.churn.noised(parameters_to_ndarrays(params)))
    spent = wrapper.churn.release(rnd, [proxy.node_id for proxy, _ in results] if params is not None else [], z)
    return params, {**metrics, **spent.metrics()}


class LegacyDifferentialPrivacyClientSideFixedClipping(LegacyClientSide):
    """Flower's legacy client-side fixed clipping (``flwr.server.strategy``; clients add
    ``fixedclipping_mod``), as Flower's ``fl-dp-sa`` runs it under SecAgg+, under churn."""

    def __init__(self, strategy: Any, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int,
                 *, num_clients: int, delta: float, calibration: str = "realised", accountant: str = "rdp",
                 results_dir: str | Path | None = None) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients)
        self.churn = ChurnNoise(num_clients, delta, calibration=calibration, accountant=accountant,
                                results_dir=results_dir)

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
        return _legacy_round(self, server_round, results, failures)


class LegacyDifferentialPrivacyServerSideFixedClipping(LegacyServerSide):
    """Flower's legacy server-side fixed clipping (``flwr.server.strategy``) under churn: the
    replies are clipped by Flower's own step, the noise and accounting are this module's."""

    def __init__(self, strategy: Any, noise_multiplier: float, clipping_norm: float, num_sampled_clients: int,
                 *, num_clients: int, delta: float, calibration: str = "realised", accountant: str = "rdp",
                 results_dir: str | Path | None = None) -> None:
        super().__init__(strategy, noise_multiplier, clipping_norm, num_sampled_clients)
        self.churn = ChurnNoise(num_clients, delta, calibration=calibration, accountant=accountant,
                                results_dir=results_dir)

    def aggregate_fit(self, server_round: int, results: list[tuple[ClientProxy, FitRes]],
                      failures: list[Any]) -> tuple[Parameters | None, dict[str, Scalar]]:
        for _, res in results:  # Flower's server-side clipping step, on the clients that took part
            update = parameters_to_ndarrays(res.parameters)
            clip_update(update, self.current_round_params, self.clipping_norm)
            res.parameters = ndarrays_to_parameters(update)
        return _legacy_round(self, server_round, results, failures)
