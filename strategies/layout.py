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
    A rule that keeps a reply's vector across rounds copies it (as the tables do)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.used = 0
        self.free: list[np.ndarray] = []  # rows handed back this round (:meth:`release`)
        self.stacks: dict[str, np.ndarray] = {}

    def new_round(self) -> None:
        """Last round's reports are gone: their rows are free."""
        self.used = 0
        self.free = []

    def row(self, size: int) -> np.ndarray:
        """A float32 vector of ``size`` not handed out since :meth:`new_round` (or handed back)."""
        if self.rows and self.rows[0].size != size:
            self.rows, self.free = [], []
        if self.free:
            return self.free.pop()
        if self.used == len(self.rows):
            self.rows.append(np.empty(size, np.float32))
        self.used += 1
        return self.rows[self.used - 1]

    def release(self, row: np.ndarray) -> None:
        """``row`` (from :meth:`row`) is no longer read: hand it out again this round (a streaming
        round holds as many rows as replies it has not yet folded in)."""
        if self.rows and row.size == self.rows[0].size:
            self.free.append(row)

    def stacked(self, name: str, vectors: list[np.ndarray]) -> np.ndarray:
        """``np.stack(vectors)`` (the same numbers) written into a matrix kept under ``name``."""
        dtype, shape = np.result_type(*vectors), (len(vectors), *np.shape(vectors[0]))
        buf = self.stacks.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[1:] != shape[1:] or len(buf) < shape[0]:
            buf = self.stacks[name] = np.empty(shape, dtype)
        return np.stack(vectors, out=buf[: shape[0]])
