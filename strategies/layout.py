"""Flat vectors: an ArrayRecord <-> one float32 vector, a norm that cannot overflow, and the
reusable scratch memory the replies' vectors are written into.

Every rule computes on flat float32 vectors (x^t, Δ_i); :class:`Layout` remembers the names,
shapes and dtypes of the model's arrays to map an ArrayRecord to such a vector and back. Every
shape survives the round trip, 0-d arrays included (BatchNorm's ``num_batches_tracked``).

Only floating arrays enter the vector. Integer and boolean arrays (counters such as
``num_batches_tracked``, index tables) are no parameters a rule may average, and float32 would
round integers above 2^24: they travel beside the vector, exactly, as name -> array
(:meth:`Layout.integers`), and the base aggregates them by its ``integer_arrays`` policy.

:class:`Scratch` keeps one round's reply vectors for the next rounds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from .weighting import matrix_runs

INTEGER_POLICIES = ("mean", "keep")


@dataclass(frozen=True)
class Layout:
    """Names, shapes and dtypes of an ArrayRecord, to map it to one flat float32 vector."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of(cls, record: ArrayRecord) -> Layout:
        arrays = record.to_numpy_ndarrays()
        return cls(
            tuple(record.keys()),
            tuple(tuple(a.shape) for a in arrays),
            tuple(a.dtype.str for a in arrays),
        )

    @property
    def floating(self) -> tuple[bool, ...]:
        """Per array: does it enter the flat vector (a floating dtype)?"""
        return tuple(np.dtype(d).kind == "f" for d in self.dtypes)

    @property
    def size(self) -> int:
        """Length of the flat vector (the floating arrays' elements)."""
        return int(sum(math.prod(s) for s, f in zip(self.shapes, self.floating, strict=True) if f))

    def flatten(self, record: ArrayRecord) -> np.ndarray:
        """The floating arrays of ``record``, as one float32 vector."""
        arrays = [a for a, f in zip(record.to_numpy_ndarrays(), self.floating, strict=True) if f]
        if not arrays:
            return np.zeros(0, np.float32)
        return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])

    def integers(self, record: ArrayRecord) -> dict[str, np.ndarray]:
        """The other arrays of ``record``, in the layout's dtypes (:func:`as_model_integers`)."""
        return {key: as_model_integers(key, arr.numpy(), dtype)
                for key, dtype, floating, arr in zip(self.keys, self.dtypes, self.floating, record.values(),
                                                     strict=True) if not floating}

    def unflatten(self, vector: np.ndarray, integers: Mapping[str, np.ndarray] | None = None) -> ArrayRecord:
        """The ArrayRecord of flat vector ``vector`` and the non-floating arrays ``integers``."""
        out, start = {}, 0
        for key, shape, dtype, floating in zip(self.keys, self.shapes, self.dtypes, self.floating, strict=True):
            if not floating:
                if integers is None or key not in integers:
                    raise ValueError(f"unflatten: the model's non-floating array '{key}' was not given")
                out[key] = np.asarray(integers[key], dtype=np.dtype(dtype)).reshape(shape)
                continue
            n = math.prod(shape)
            out[key] = np.asarray(vector[start : start + n], dtype=np.dtype(dtype)).reshape(shape)
            start += n
        return named_arrays(out)

    def mismatch(self, record: ArrayRecord) -> str | None:
        """Why ``record`` does not fit this layout, or None."""
        if tuple(record.keys()) != self.keys:
            return f"array keys {list(record.keys())[:5]}... differ from the model's"
        for key, shape, arr in zip(self.keys, self.shapes, record.values(), strict=True):
            if tuple(arr.shape) != shape:
                return f"array '{key}' has shape {tuple(arr.shape)}, expected {shape}"
        return None


def safe_norm(vector: np.ndarray) -> float:
    """‖v‖₂ that cannot overflow: a float32 dot product (fast, no copy), redone in float64 when
    it overflowed (float32 squares overflow for norms above ~1.8e19)."""
    v = np.asarray(vector)
    if v.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            square = float(np.dot(v, v))
        if math.isfinite(square):
            return math.sqrt(square)
    v = np.asarray(v, np.float64)
    return math.sqrt(float(np.dot(v, v)))


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖₂: the difference in float32 when both are float32 (one pass, no float64 copy), in
    float64 when that is not finite (a float32 difference can overflow where float64's does not);
    NaN or Inf in ``a`` or ``b`` gives a value that is not finite."""
    if a.dtype == np.float32 and b.dtype == np.float32:
        with np.errstate(over="ignore", invalid="ignore"):
            norm = safe_norm(np.subtract(a, b))
        if math.isfinite(norm):
            return norm
    return safe_norm(np.subtract(a, b, dtype=np.float64))


def named_arrays(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord from name -> ndarray (Flower's constructor takes lists or Arrays). Shapes are
    kept as they are: ``np.ascontiguousarray`` would turn a 0-d array into shape (1,)."""
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in arrays.items()})


def as_model_integers(key: str, values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` of the model's non-floating array ``key`` in its ``dtype``; ValueError for values
    that are not finite or do not fit the dtype (a reply may send an integer buffer as floats:
    rounded to the nearest)."""
    target = np.dtype(dtype)
    if values.dtype.kind == "f":
        if not np.all(np.isfinite(values)):
            raise ValueError(f"array '{key}' ({target.name} in the model) holds NaN or Inf")
        values = np.rint(values)
    if target.kind in "iu" and values.size:
        info = np.iinfo(target)
        if values.min() < info.min or values.max() > info.max:
            raise ValueError(f"array '{key}' holds values outside {target.name}'s range "
                             f"[{info.min}, {info.max}]")
    return values.astype(target)


def aggregate_integers(policy: str, current: Mapping[str, np.ndarray], replied: list[Mapping[str, np.ndarray]],
                       weights: np.ndarray) -> dict[str, np.ndarray]:
    """The next model's integer arrays: ``"mean"``, the ``weights``-mean of the ``replied`` ones,
    rounded to the nearest (booleans: the weighted majority), or ``"keep"``, the ``current`` ones.
    A round without replies keeps them, as does an array some reply lacks."""
    if policy not in INTEGER_POLICIES:
        raise ValueError(f"integer_arrays must be one of {INTEGER_POLICIES}, got {policy!r}")
    if policy == "keep" or not replied:
        return dict(current)
    out = {}
    for key, value in current.items():
        if any(key not in r for r in replied):
            out[key] = value
            continue
        mean = np.tensordot(np.asarray(weights, np.float64), np.stack([r[key].astype(np.float64) for r in replied]), axes=1)
        out[key] = mean >= 0.5 if value.dtype.kind == "b" else np.rint(mean).astype(value.dtype)
    return out


class Scratch:
    """Flat float32 rows for one round's replies (Δ_i, u_i) and matrices of stacked replies, kept
    and reused in the next rounds: writing into fresh memory (page faults, zeroing) costs several
    times the arithmetic, and a round's replies must all be held while the rule aggregates them.
    A rule that keeps a reply's vector across rounds copies it (as the tables do).

    The rows are rows of matrices, one per vector a reply fills (pool 0: Δ_i; pool 1: FedAWE's
    u_i, SCAFFOLD's Δc_i), each with a row per reply of the round (:meth:`new_round`). The reply
    of rank ``k`` (:meth:`begin`: the rank of its client id) fills row k, so the accepted
    replies' vectors, sorted by client id, are the rows of one matrix in order: a weighted sum of
    them is one matrix-vector product, in an order that does not depend on the replies' arrival
    (:func:`strategies.weighting.weighted_sum`), and :meth:`stacked` returns the rows without a
    copy. Without :meth:`begin` (a streaming round, :mod:`strategies.streaming`) rows are handed
    out in arrival order and reused once handed back (:meth:`release`), so a round holds only the
    replies not yet folded in."""

    def __init__(self) -> None:
        self.pools: list[np.ndarray] = []  # pool j: the j-th vector of every reply, a row each
        self.size: int | None = None  # the rows' length
        self.extra: list[np.ndarray] = []  # rows beyond the pools' (more replies than announced)
        self.slot = 0  # the row of the reply being read
        self.call = 0  # the vectors it took so far: its next pool
        self.begun = False  # begin() gives the slots; without it, each row() is the next reply's
        self.used = 0  # slots handed out this round (without begin()) or the largest slot + 1
        self.wanted = 0  # the slots this round wants: the replies announced, or as many as last round used
        self.free: list[np.ndarray] = []  # rows handed back this round without begin() (:meth:`release`)
        self.stacks: dict[str, np.ndarray] = {}

    def new_round(self, replies: int = 0, size: int | None = None) -> None:
        """Last round's reports are gone: their rows are free. ``replies`` slots of ``size``
        this round, or as many as last round used (pools are made anew here when too small, or
        more than twice too large: a first streaming round holds its reference window's rows, the
        next ones a reply's; the memory is touched only where written)."""
        self.wanted = max(self.used, replies, 1)
        if size is not None and size != self.size:
            self.pools, self.size = [], size
        self.pools = [p if self.wanted <= len(p) <= 2 * self.wanted else np.empty((self.wanted, p.shape[1]), np.float32)
                      for p in self.pools]
        self.extra, self.slot, self.call, self.begun, self.used, self.free = [], 0, 0, False, 0, []

    def begin(self, slot: int) -> None:
        """The next rows handed out (:meth:`row`) are the reply of rank ``slot``'s: row ``slot``
        of pool 0, then of pool 1, ..."""
        self.slot, self.call, self.begun = slot, 0, True
        self.used = max(self.used, slot + 1)

    def row(self, size: int) -> np.ndarray:
        """A float32 vector of ``size`` not handed out since :meth:`new_round`: row ``slot`` of
        the next pool of the reply begun (:meth:`begin`), or without it a row handed back
        (:meth:`release`) or the next slot of pool 0."""
        if size != self.size:
            self.pools, self.size, self.free = [], size, []
        if self.begun:
            pool, self.call = self.call, self.call + 1
        elif self.free:
            return self.free.pop()
        else:
            pool, self.slot, self.used = 0, self.used, self.used + 1
        while len(self.pools) <= pool:
            self.pools.append(np.empty((max(self.wanted, self.used, 1), size), np.float32))
        if self.slot < len(self.pools[pool]):
            return self.pools[pool][self.slot]
        self.extra.append(np.empty(size, np.float32))  # the pools grow at the next round
        return self.extra[-1]

    def release(self, row: np.ndarray) -> None:
        """``row`` (from :meth:`row`) is no longer read: hand it out again this round (a streaming
        round holds as many rows as replies it has not yet folded in). Rows of replies begun
        (:meth:`begin`: slotted by client id) are each reply's own: nothing to hand back."""
        if not self.begun and row.size == self.size:
            self.free.append(row)

    def stacked(self, name: str, vectors: list[np.ndarray]) -> np.ndarray:
        """``np.stack(vectors)`` (the same numbers): the rows themselves when they are already
        consecutive rows of one matrix in this order (the reply rows: no copy; read only), else
        written into a matrix kept under ``name``."""
        runs = matrix_runs(vectors)
        if len(runs) == 1 and runs[0][1] == list(range(len(vectors))) and runs[0][0].flags.c_contiguous:
            return runs[0][0]
        dtype, shape = np.result_type(*vectors), (len(vectors), *np.shape(vectors[0]))
        buf = self.stacks.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[1:] != shape[1:] or len(buf) < shape[0]:
            buf = self.stacks[name] = np.empty(shape, dtype)
        return np.stack(vectors, out=buf[: shape[0]])
