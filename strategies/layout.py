"""Flat vectors: an ArrayRecord <-> one float32 vector, and a norm that cannot overflow.

Every rule computes on flat float32 vectors (x^t, Δ_i); :class:`Layout` remembers the names,
shapes and dtypes of the model's arrays to map an ArrayRecord to such a vector and back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord


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
    def size(self) -> int:
        return int(sum(math.prod(s) for s in self.shapes))

    def flatten(self, record: ArrayRecord) -> np.ndarray:
        arrays = record.to_numpy_ndarrays()
        if not arrays:
            return np.zeros(0, np.float32)
        return np.concatenate([np.asarray(a, np.float32).ravel() for a in arrays])

    def unflatten(self, vector: np.ndarray) -> ArrayRecord:
        out, start = {}, 0
        for key, shape, dtype in zip(self.keys, self.shapes, self.dtypes, strict=True):
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


def named_arrays(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord from name -> ndarray (Flower's constructor takes lists or Arrays)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})
