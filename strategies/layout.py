"""Flat vectors: an ArrayRecord <-> one float32 vector, and a norm that cannot overflow.

Every rule computes on flat float32 vectors (x^t, Δ_i); :class:`Layout` remembers the names,
shapes and dtypes of the model's arrays to map an ArrayRecord to such a vector and back. Every
shape survives the round trip, 0-d arrays included (BatchNorm's ``num_batches_tracked``).

Only floating arrays enter the vector. Integer and boolean arrays (counters such as
``num_batches_tracked``, index tables) are no parameters a rule may average, and float32 would
round integers above 2^24: they travel beside the vector, exactly, as name -> array
(:meth:`Layout.integers`), and the base aggregates them by its ``integer_arrays`` policy.
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
        """The other arrays of ``record``, in the layout's dtypes; ValueError for values that are
        not finite (a reply may send an integer buffer as floats: rounded to the nearest)."""
        out = {}
        for key, dtype, floating, arr in zip(self.keys, self.dtypes, self.floating, record.values(),
                                             strict=True):
            if floating:
                continue
            a = arr.numpy()
            if a.dtype.kind == "f":
                if not np.all(np.isfinite(a)):
                    raise ValueError(f"array '{key}' ({np.dtype(dtype).name} in the model) holds NaN or Inf")
                a = np.rint(a)
            out[key] = a.astype(np.dtype(dtype))
        return out

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
    v = v.astype(np.float64)
    return math.sqrt(float(np.dot(v, v)))


def named_arrays(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord from name -> ndarray (Flower's constructor takes lists or Arrays). Shapes are
    kept as they are: ``np.ascontiguousarray`` would turn a 0-d array into shape (1,)."""
    return ArrayRecord({k: Array(np.asarray(v, order="C")) for k, v in arrays.items()})


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
