"""Client weights: equal (1/|A_t|) or by data size (p_i = n_i / Σ n_j); the one list of names.

``WEIGHTINGS`` is what a run config's ``weighting`` may say; ``"auto"`` resolves to the rule's
``paper_weighting`` (FedNova: num-examples, the others: equal).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .layout import matrix_runs

AUTO_WEIGHTING = "auto"  # the rule's paper_weighting
RESOLVED_WEIGHTINGS = ("equal", "num-examples")
WEIGHTINGS = (AUTO_WEIGHTING, *RESOLVED_WEIGHTINGS)


def resolve_weighting(weighting: str, paper_weighting: str) -> str:
    """``weighting`` with "auto" replaced by the rule's ``paper_weighting``; ValueError if unknown."""
    if weighting == AUTO_WEIGHTING:
        weighting = paper_weighting
    if weighting not in RESOLVED_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return weighting


def client_weights(weighting: str, num_examples: Sequence[int]) -> np.ndarray:
    """Per-report weights summing to 1 (equal or by num-examples)."""
    if weighting == "num-examples":
        w = np.array(num_examples, np.float64)
    else:
        w = np.ones(len(num_examples))
    return w / w.sum()


def cap_shares(weights: np.ndarray, max_share: float) -> np.ndarray:
    """``weights`` (summing to 1) with no entry above ``max_share``: the capped entries are fixed
    at the cap and the rest is shared in proportion to the others' weights, repeated until none
    exceeds it (water-filling); equal weights when even those exceed it (m · max_share <= 1).
    ``max_share = 0`` returns ``weights`` unchanged."""
    m = len(weights)
    if not max_share or m == 0 or weights.max() <= max_share:
        return weights
    if m * max_share <= 1:
        return np.full(m, 1.0 / m)
    capped = np.zeros(m, bool)
    out = weights.copy()
    while True:
        over = ~capped & (out > max_share)
        if not over.any():
            return out
        capped |= over
        free = ~capped
        rest = 1.0 - max_share * capped.sum()
        out = np.where(capped, max_share, weights * rest / weights[free].sum())


def weighted_sum(weights: Iterable[Any], vectors: Iterable[np.ndarray]) -> np.ndarray | int:
    """Σ_i w_i v_i (0 when there is no term). Float32 vectors give a float32 sum, the weights taken
    in float32 (as ``float(w_i) * v_i`` does); vectors that are rows of one matrix (the reply
    rows of :class:`strategies.layout.Scratch`, sorted by client id) are summed by one
    matrix-vector product per run of rows (:func:`strategies.layout.matrix_runs`: BLAS, each row
    read once), in the rows' order, whatever the order given; others (float64 vectors) in place,
    in the order given, with numpy's type rules."""
    w, vs = list(weights), list(vectors)
    if not vs:
        return 0
    if len(w) != len(vs):
        raise ValueError(f"weighted_sum: {len(w)} weights for {len(vs)} vectors")
    if any(np.asarray(v).dtype != np.float32 for v in vs):
        return _weighted_sum_in_order(w, vs)
    w32 = np.array([float(x) for x in w], np.float32)
    out: np.ndarray | None = None
    for rows, positions in matrix_runs(vs):
        part = w32[positions] @ rows if len(positions) > 1 else w32[positions[0]] * rows[0]
        if out is None:
            out = part  # a new array
        else:
            out += part
    assert out is not None
    return out


def _weighted_sum_in_order(weights: list[Any], vectors: list[np.ndarray]) -> np.ndarray:
    """Σ_i w_i v_i accumulated in place, in the order given (numpy's type rules)."""
    out: np.ndarray | None = None
    term: np.ndarray | None = None
    for w, v in zip(weights, vectors, strict=True):
        if out is None:
            out = w * v
            term = np.empty_like(out)
        else:
            np.multiply(v, w, out=term)
            out += term
    assert out is not None
    return out
