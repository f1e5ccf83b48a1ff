"""The parameters every rule shares, as one frozen value (pfl-research's hyper-parameter habit).

:class:`StrategyParams` holds the base's arguments, Flower's ``FedAvg`` arguments among them with
Flower's names and meaning, checked once when the value is made. A rule's constructor takes its
own parameters (``FedAU(cutoff=50)``) and either a ``params=StrategyParams(...)`` or the same
fields as keyword arguments (``FedAU(num_clients=10, fraction_evaluate=0.5)``), which update
``params``. A run's values come from its run config (``server_app.experiment``); a strategy spec
sets only a rule's own parameters and :data:`SPEC_FIELDS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from .bounds import (
    MAX_EXAMPLES_RATIO,
    MAX_MODEL_RATIO,
    MAX_NORM_RATIO,
    MAX_REFERENCE_GROWTH,
    MAX_UPDATE_NORM,
    NormBounds,
)
from .failures import FailurePolicy
from .layout import aggregate_integers
from .options import MetricsAggrFn, RecordKeys
from .protocol import NUM_EXAMPLES
from .robust import Robust
from .sampling import Sampling
from .weighting import AUTO_WEIGHTING

# the fields a strategy spec may set for every rule (e.g. "mifa:max-norm-ratio=50")
SPEC_FIELDS = frozenset({"max_update_norm", "max_norm_ratio", "max_weight_share", "max_model_ratio",
                         "max_examples_ratio", "max_reference_growth", "stream", "robust"})


@dataclass(frozen=True)
class StrategyParams:
    """The shared parameters of a rule (:class:`strategies.base.AvailabilityStrategy`).

    Parameters
    ----------
    num_clients : N (rules that average over all clients need it; bounds a reply's ``client-id``).
        None: rules that need N (``needs_num_clients``, ``needs_client_ids``) take the number of
        nodes connected at the first round (waiting until it is steady); none connected within
        ``node_wait`` is a :class:`StrategyFailure` before any training.
    server_lr : η_g, the server step applied to the rule's update.
    weighting : "equal", "num-examples" (p_i = n_i / n), or "auto" (the default): the rule's
        ``paper_weighting`` (the strategy's ``weighting`` holds the resolved value).
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
    max_update_norm, max_norm_ratio, max_model_ratio : the update-norm bounds (:class:`NormBounds`,
        whose module says how the defaults were measured; ``max_norm_ratio=None``: the rule's
        ``default_norm_ratio``); spec keys ``max-update-norm``, ``max-norm-ratio``,
        ``max-model-ratio``.
    max_reference_growth : the norm references follow the nodes' latest norms up to this multiple
        of their first ones (0: uncapped; :class:`NormBounds`); spec key ``max-reference-growth``.
    max_examples_ratio : under ``num-examples`` weighting, a reply's num-examples is cut to this
        multiple of the lower median of recent ones (metric ``num-examples-clipped``); spec key
        ``max-examples-ratio``.
    max_weight_share : under ``num-examples`` weighting, no client's weight above this share of
        the round (:func:`strategies.weighting.cap_shares`), so that a client claiming a huge
        ``num-examples`` cannot take the round; 0 (the default) = no cap, the papers'
        p_i = n_i / n. Spec key ``max-weight-share`` (e.g. ``fednova:max-weight-share=0.2``).
    stream : a rule that declares ``streams`` folds replies in as they arrive (server memory
        O(model); :mod:`strategies.streaming`); False holds every reply of a round (the same
        numbers to float rounding). Spec key ``stream`` (e.g. ``fedavg-active:stream=false``).
    robust : "" (off, the default: the papers' means), ``median``, ``trimmed-mean[:beta=0.2]`` or
        ``clip`` (:mod:`strategies.robust`); spec key ``robust`` (e.g. ``fedavg-active:robust=median``).
    """

    num_clients: int | None = None
    server_lr: float = 1.0
    weighting: str = AUTO_WEIGHTING
    seed: int = 0
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_nodes: int = 2
    min_evaluate_nodes: int = 2
    min_available_nodes: int = 2
    weighted_by_key: str = NUM_EXAMPLES
    arrayrecord_key: str = "arrays"
    configrecord_key: str = "config"
    train_metrics_aggr_fn: MetricsAggrFn | None = None
    evaluate_metrics_aggr_fn: MetricsAggrFn | None = None
    node_wait: float = 60.0
    max_failed_rounds: int = 3
    integer_arrays: str = "mean"
    max_num_examples: int = 10**9
    max_num_steps: int = 10**7
    max_update_norm: float = MAX_UPDATE_NORM
    max_norm_ratio: float | None = None  # None: the rule's default_norm_ratio
    max_weight_share: float = 0.0
    max_model_ratio: float = MAX_MODEL_RATIO
    max_examples_ratio: float = MAX_EXAMPLES_RATIO
    max_reference_growth: float = MAX_REFERENCE_GROWTH
    stream: bool = True
    robust: str = ""

    def __post_init__(self) -> None:
        self.sampling(), self.record_keys(), self.bounds()  # each checks its own fields
        FailurePolicy("", self.max_failed_rounds)
        Robust.parse(self.robust)
        aggregate_integers(self.integer_arrays, {}, [], np.zeros(0))  # checks the policy's name
        if not (math.isfinite(self.max_weight_share) and 0 <= self.max_weight_share <= 1):
            raise ValueError(f"max_weight_share (spec key max-weight-share) must be in [0, 1] (0 = off), "
                             f"got {self.max_weight_share}")
        if not self.server_lr > 0:
            raise ValueError(f"server_lr must be > 0, got {self.server_lr}")
        n = self.num_clients
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"num_clients must be an integer >= 1 (None: the nodes connected at the "
                             f"first round), got {n!r}")

    @classmethod
    def names(cls) -> frozenset[str]:
        """The field names (what a rule's constructor accepts besides its own parameters)."""
        return frozenset(f.name for f in fields(cls))

    def updated(self, **changes: Any) -> StrategyParams:
        """A copy with ``changes``; an unknown name is a ValueError that lists the known ones."""
        unknown = sorted(set(changes) - self.names())
        if unknown:
            raise ValueError(f"unknown strategy argument(s) {unknown}; the shared ones are {sorted(self.names())} "
                             f"(a rule's own parameters are its constructor's keyword arguments)")
        return replace(self, **changes) if changes else self

    def sampling(self) -> Sampling:
        return Sampling(self.fraction_train, self.fraction_evaluate, self.min_train_nodes,
                        self.min_evaluate_nodes, self.min_available_nodes, self.node_wait)

    def record_keys(self) -> RecordKeys:
        return RecordKeys(self.weighted_by_key, self.arrayrecord_key, self.configrecord_key,
                          self.train_metrics_aggr_fn, self.evaluate_metrics_aggr_fn)

    def bounds(self, default_ratio: float = MAX_NORM_RATIO) -> NormBounds:
        """A fresh :class:`NormBounds` (it keeps a history: one per user); ``default_ratio`` when
        ``max_norm_ratio`` is None (a rule's ``default_norm_ratio``)."""
        ratio = default_ratio if self.max_norm_ratio is None else self.max_norm_ratio
        return NormBounds(float(self.max_update_norm), float(ratio), float(self.max_model_ratio),
                          float(self.max_examples_ratio), float(self.max_reference_growth))
