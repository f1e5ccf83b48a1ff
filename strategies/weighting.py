"""Client weights: equal (1/|A_t|) or by data size (p_i = n_i / Σ n_j); the one list of names.

``WEIGHTINGS`` is what a run config's ``weighting`` may say; ``"auto"`` resolves to the rule's
``paper_weighting`` (FedNova: num-examples, the others: equal).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
