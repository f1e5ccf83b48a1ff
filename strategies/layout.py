"""Flat vectors: an ArrayRecord <-> one float32 vector, a norm that cannot overflow, and the
reusable scratch memory the replies' vectors are written into.

Every rule computes on flat float32 vectors (x^t, Δ_i); :class:`Layout` remembers the names,
shapes and dtypes of the model's arrays to map an ArrayRecord to such a vector and back;
:class:`Scratch` keeps one round's reply vectors for the next rounds.
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
    v = np.asarray(v, np.float64)
    return math.sqrt(float(np.dot(v, v)))


def named_arrays(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord from name -> ndarray (Flower's constructor takes lists or Arrays)."""
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


class Scratch:
    """Flat float32 rows for one round's replies (Δ_i, u_i) and matrices of stacked replies, kept
    and reused in the next rounds: writing into fresh memory (page faults, zeroing) costs several
    times the arithmetic, and a round's replies must all be held while the rule aggregates them.
    A rule that keeps a reply's vector across rounds copies it (as the tables do)."""

    def __init__(self) -> None:
        self.rows: list[np.ndarray] = []
        self.used = 0
        self.stacks: dict[str, np.ndarray] = {}

    def new_round(self) -> None:
        """Last round's reports are gone: their rows are free."""
        self.used = 0

    def row(self, size: int) -> np.ndarray:
        """A float32 vector of ``size`` not handed out since :meth:`new_round`."""
        if self.rows and self.rows[0].size != size:
            self.rows = []
        if self.used == len(self.rows):
            self.rows.append(np.empty(size, np.float32))
        self.used += 1
        return self.rows[self.used - 1]

    def stacked(self, name: str, vectors: list[np.ndarray]) -> np.ndarray:
        """``np.stack(vectors)`` (the same numbers) written into a matrix kept under ``name``."""
        dtype, shape = np.result_type(*vectors), (len(vectors), *np.shape(vectors[0]))
        buf = self.stacks.get(name)
        if buf is None or buf.dtype != dtype or buf.shape[1:] != shape[1:] or len(buf) < shape[0]:
            buf = self.stacks[name] = np.empty(shape, dtype)
        return np.stack(vectors, out=buf[: shape[0]])
