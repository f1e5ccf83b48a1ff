"""Client weights: equal (1/|A_t|) or by data size (p_i = n_i / Σ n_j); the one list of names.

``WEIGHTINGS`` is what a run config's ``weighting`` may say; ``"auto"`` resolves to the rule's
``paper_weighting`` (FedNova: num-examples, the others: equal).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import scipy.linalg.blas as blas

AUTO_WEIGHTING = "auto"  # the rule's paper_weighting
# a client back after more rounds than this, or new, has a participation estimate that rests on
# its absence (FedAU's default cutoff K): its weight is capped (:func:`cap_rare_weights`)
LONG_SILENT_ROUNDS = 50
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


def cap_rare_weights(weights: np.ndarray, rare: np.ndarray, seen: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, int]:
    """The weights of clients ``ids`` (``weights``: theirs, from the rule's participation estimate),
    those of the ``rare`` ones (new, or back after more than :data:`LONG_SILENT_ROUNDS` rounds)
    capped at the largest weight any OTHER client seen before would get now (``seen``: the
    weights every seen client would get, by client id, NaN for the unseen): a new or long-silent
    id gains no more weight than a returning client (FedAU's newcomer cap, Wang & Ji 2024, made
    one rule for the participation estimates; 1 when no other client was seen). Returns the
    weights and how many were capped."""
    out = np.asarray(weights, np.float64).copy()
    if not rare.any():
        return out, 0
    known = np.flatnonzero(~np.isnan(seen))
    order = known[np.argsort(seen[known])[::-1][:2]]  # the two largest: the largest other than oneself
    capped = 0
    for k in np.flatnonzero(rare):
        others = [j for j in order if j != ids[k]]
        cap = float(seen[others[0]]) if others else 1.0
        if out[k] > cap:
            out[k], capped = cap, capped + 1
    return out, capped


def matrix_runs(vectors: Sequence[np.ndarray]) -> list[tuple[np.ndarray, list[int]]]:
    """``vectors`` grouped into runs of equally spaced rows of one C-contiguous matrix (the reply
    :class:`Scratch`, a client table), in the matrix's row order: ``[(2-D view, positions in
    vectors)]``, one run per stretch (a vector that is no such row is a run of its own). A run is
    a strided view, no copy, so one matrix product (BLAS) reads its rows once."""
    keyed: list[tuple[int, int, int]] = []  # (matrix id, row, position)
    owners: dict[int, np.ndarray] = {}
    alone: list[int] = []
    for k, v in enumerate(vectors):
        base = v.base if isinstance(v, np.ndarray) else None
        if (isinstance(base, np.ndarray) and v.ndim == 1 and base.ndim == 2 and base.dtype == v.dtype
                and base.flags.c_contiguous and base.shape[1] == v.size and v.strides == (v.itemsize,)):
            row, rem = divmod(v.ctypes.data - base.ctypes.data, base.strides[0])
            if rem == 0 and 0 <= row < base.shape[0]:
                owners[id(base)] = base
                keyed.append((id(base), row, k))
                continue
        alone.append(k)
    keyed.sort()
    runs: list[tuple[np.ndarray, list[int]]] = []
    i = 0
    while i < len(keyed):
        owner, first, _ = keyed[i]
        j, step = i + 1, 0
        while j < len(keyed) and keyed[j][0] == owner:
            gap = keyed[j][1] - keyed[j - 1][1]
            if gap <= 0 or (step and gap != step):
                break
            step, j = gap, j + 1
        last = keyed[j - 1][1]
        runs.append((owners[owner][first : last + 1 : step or 1], [k for _, _, k in keyed[i:j]]))
        i = j
    runs += [(np.asarray(vectors[k])[None, :], [k]) for k in alone]
    return runs


@functools.cache
def _openblas() -> Any:
    from threadpoolctl import ThreadpoolController  # scikit-learn's: already installed

    return ThreadpoolController().select(internal_api="openblas")  # numpy's and scipy's, not torch's MKL


def one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """numpy's and scipy's OpenBLAS on one thread while the context lasts (the server's loops).

    The server's vector math (folds, norms, the bounds' references) is a few memory-bound passes
    over model-sized vectors. On a machine whose cores are busy training clients, OpenBLAS's worker
    threads spin waiting for a core: in Flower's Ray simulation the ServerApp process spent 0.17 CPU s
    a round of MNIST's MLP, 10 clients a round, on 2 cores, against 0.07 on one thread (issue 49,
    ``benchmarks/ray_path.py``). The results are the same bit for bit: every kernel used here
    computes each element, or each element's sum, on one thread whatever the thread count
    (tests/test_rule_numbers.py passes under ``OPENBLAS_NUM_THREADS=1``). torch's MKL and OpenMP are
    left as they are."""
    return _openblas().limit(limits=1)


def add_scaled(out: np.ndarray, w: float, v: np.ndarray) -> np.ndarray:
    """``out += w v`` in place, returned: one BLAS ``saxpy`` pass for contiguous float32 vectors,
    else the product rounded to ``out``'s dtype, then added."""
    if (out.dtype == v.dtype == np.float32 and out.ndim == v.ndim == 1 and out.flags.c_contiguous
            and v.flags.c_contiguous):
        return blas.saxpy(v, out, a=w)
    out += np.multiply(v, np.float32(w)).astype(out.dtype, copy=False)
    return out


def weighted_sum(weights: Iterable[Any], vectors: Iterable[np.ndarray]) -> np.ndarray | int:
    """Σ_i w_i v_i (0 when there is no term). Float32 vectors give a float32 sum, the weights taken
    in float32 (as ``float(w_i) * v_i`` does); vectors that are rows of one matrix (the reply
    rows of :class:`strategies.layout.Scratch`, sorted by client id) are summed by one
    matrix-vector product per run of rows (:func:`matrix_runs`: BLAS, each row
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
        if len(positions) > 1:
            part = w32[positions] @ rows
        elif out is not None:  # one vector alone: added in place, one pass
            out = add_scaled(out, w32[positions[0]], rows[0])
            continue
        else:
            part = w32[positions[0]] * rows[0]
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
