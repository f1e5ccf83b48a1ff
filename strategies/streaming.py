"""Streaming aggregation: a rule's update folded in reply by reply, in O(model) server memory.

A rule whose update is a sum over the round's replies with per-reply weights known on arrival
(up to one normalisation at the end) declares ``streams = True`` and returns a :class:`Fold` from
:meth:`strategies.rule.Rule.start_fold`. The base then consumes the replies as they arrive
(:meth:`strategies.intake.ReplyIntake.stream`): each accepted reply is folded in and let
go, so the server holds the running sums and the replies not yet read, never the whole round:
one reply at a time once the bounds' references are settled (from the second round on), the
first round's reference window (:data:`strategies.bounds.REFERENCE_WINDOW` replies) before. The result equals the rule's :meth:`~strategies.rule.Rule.aggregate` on every reply
held (to float rounding: float32 partial sums of 16 replies in arrival order, added in float64;
``tests/test_streaming.py``). A rule that must see every reply at once (a Gram matrix, pairwise
similarities, per-client tables of updates) keeps ``streams = False`` and says why in
``holds_replies``; the base logs it once.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .replies import ClientReport
from .weighting import add_scaled, weighted_sum


class Fold:
    """One round's running aggregate: :meth:`add` each accepted report as it arrives (its vectors
    are not kept), then :meth:`finish` gives x^{t+1} and the rule's metrics, as ``aggregate``.

    ``held_weights``: set by :meth:`strategies.rule.Rule.aggregate` when a round is held (every
    reply known: e.g. ``max-weight-share`` caps each weight against the round's), the rule's
    weights of the round by client id; a fold that weights its reports takes them from there."""

    held_weights: dict[int, float] | None = None

    def report_weight(self, report: ClientReport, weight_of: Callable[[ClientReport], float]) -> float:
        """``report``'s weight in a fold weighted by the run's ``weighting``: its weight of the
        round when the base holds the round (``held_weights``: ``max-weight-share``'s caps, which
        need every reply), else ``weight_of(report)`` (n_i or 1; the fold normalises at the end)."""
        if self.held_weights is not None:
            return self.held_weights[report.client_id]
        return float(weight_of(report))

    def add(self, report: ClientReport) -> None:
        raise NotImplementedError

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        raise NotImplementedError


_HELD = contextvars.ContextVar("held_round", default=False)


@contextlib.contextmanager
def held_round() -> Iterator[None]:
    """A held round is folded (:meth:`strategies.rule.Rule.aggregate`): every reply's vectors
    stay until the round's end, so :class:`RunningSum` adds them :data:`BLOCK` at a time, one
    matrix-vector product over consecutive reply rows (:func:`strategies.weighting.weighted_sum`),
    not a pass per reply (a streaming round hands a reply's rows on once it is folded in)."""
    token = _HELD.set(True)
    try:
        yield
    finally:
        _HELD.reset(token)


class RunningSum:
    """Σ_i w_i v_i (v_i float32 vectors), with Σ_i w_i and the number of terms: float32 partial
    sums of :data:`BLOCK` terms (one BLAS ``saxpy`` per reply; in a :func:`held_round`, one BLAS
    matrix-vector product per block of reply rows) added into a float64 total (``total``)."""

    def __init__(self, size: int) -> None:
        self._total = np.zeros(size, np.float64)
        self._partial = np.zeros(size, np.float32)
        self._in_partial = 0
        self._held: list[tuple[float, np.ndarray]] = []  # a held round's terms not yet added
        self.weight = 0.0
        self.count = 0

    def add(self, w: float, v: np.ndarray) -> None:
        self.weight += w
        self.count += 1
        if _HELD.get():
            self._held.append((w, v))
            if len(self._held) == BLOCK:
                self._flush()
            return
        if self._in_partial == 0:  # a block's first term is written, not added to zeros (the same numbers)
            if w == 1.0:
                np.copyto(self._partial, v)
            else:
                np.multiply(v, np.float32(w), out=self._partial)
        elif w == 1.0:
            self._partial += v
        else:
            self._partial = add_scaled(self._partial, w, v)
        self._in_partial += 1
        if self._in_partial == BLOCK:
            self._flush()

    def add_sum(self, total: np.ndarray) -> None:
        """Add Σ_j w_j v_j computed elsewhere (SecAgg+'s unmasked sum: :mod:`strategies.secure`),
        its weights and terms already counted by :meth:`add` of zero vectors."""
        self._flush()
        self._total += total

    def _flush(self) -> None:
        if self._held:
            weights, vectors = zip(*self._held, strict=True)
            self._held = []
            self._total += weighted_sum(weights, vectors)  # float32, one product per run of rows
        if self._in_partial:
            self._total += self._partial
            self._in_partial = 0

    @property
    def total(self) -> np.ndarray:
        """Σ_i w_i v_i so far (float64)."""
        self._flush()
        return self._total


BLOCK = 16  # replies per float32 partial sum of RunningSum (then added into the float64 total)


def step(x: np.ndarray, server_lr: float, u: np.ndarray) -> np.ndarray:
    """x + η_g u as float32 (x's dtype)."""
    return (x + server_lr * u).astype(x.dtype, copy=False)


def example_weight(weighting: str) -> Any:
    """A report's unnormalised weight: its num-examples, or 1 (equal weights)."""
    if weighting == "num-examples":
        return lambda r: float(r.num_examples)
    return lambda r: 1.0
