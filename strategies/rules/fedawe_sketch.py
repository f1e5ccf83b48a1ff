"""FedAWE's consistency check, its one model-sized part: a secret projection P and P (Δ_i − η_g u_i).

The check (:meth:`strategies.rules.fedawe.FedAWE._check_start`) compares P x_i^{t,0}, where
x_i^{t,0} = x_i^† − η_g u_i, with P x^s of the models client i can hold. P has :data:`SKETCH`
rows; each is a *block-scaled* Gaussian: view the first K ⌊d/K⌋ coordinates of a flat model x as
a K × n matrix X (row k holds coordinates k n .. k n + n − 1, n = ⌊d/K⌋, K = :data:`SPAN`) and
the last d − K n coordinates as x_tail; then

    P_r x = c_r^T X a_r + t_r · x_tail,     c_r ∈ R^K, a_r ∈ R^n, t_r ∈ R^{d − K n} standard normal,

i.e. P_r's entry at (k, b) is c_rk a_rb. Why this shape: P is (K + n + K) numbers a row, not d,
so checking one reply reads Δ_i and u_i once and nothing model-sized besides (a dense P, 2 × d
float64, was read again for every reply: 16 MB at d = 10⁶), and c_r^T X is a float32 BLAS product
whose sums have depth K, so its rounding has a bound (below). An error e in a start is caught as
with a dense Gaussian P: P_r e = Σ_b a_rb (c_r · e_b) (e_b: column b of e's matrix) is, for the
secret c_r and a_r, a Gaussian mixture that vanishes only for e = 0; an error in one coordinate
gives c_rk a_rb e_j, a product of two Gaussians, a little more often near 0 than one Gaussian.

P (Δ − η u) in float32 (:meth:`Projection.of_start`), per block of :data:`BLOCK` coordinates (in
cache): w = fl(Δ − fl(η u)) (per coordinate off by at most 2⁻²⁴ (|Δ_j| + 3.01 |η u_j|)), then
c_r^T W (float32 BLAS, K products a sum: off by at most γ_K Σ_k |c_rk w_kb|, γ_K ≤ (K + 0.01) 2⁻²⁴,
whatever the order of the sum), then · a_r in float64 (n terms, γ_n of float64). With
Cauchy-Schwarz the whole is off by at most

    ‖P_r‖ ((K + 3) 2⁻²⁴ + (n + K + 4) 2⁻⁵²) (‖Δ‖ + 3.01 |η| ‖u‖)        (:meth:`Projection.float32_slack`),

which the check adds to the float32 rounding of the reply itself; the known sketches P x^s are
float64 (:meth:`Projection.of_model`).
"""

from __future__ import annotations

import math

import numpy as np

SKETCH = 2  # rows of P
SPAN = 32  # K: the depth of P's float32 sums (the slack grows with it: (K + 3) 2^-24)
BLOCK = 1 << 16  # coordinates per float32 block of P (Δ − η u): 256 KiB, in cache
FORM = 2  # P's construction from the seed (1: the dense Gaussian P before; checkpoints say which)


class Projection:
    """P over flat models of ``size`` coordinates, drawn from the secret ``seed`` (module docstring)."""

    def __init__(self, seed: int, size: int) -> None:
        rng = np.random.default_rng(seed)
        self.size, self.cols = size, size // SPAN
        self.c = rng.standard_normal((SKETCH, SPAN)).astype(np.float32)  # c_r (float32: the BLAS operand)
        self.a = rng.standard_normal((SKETCH, self.cols))  # a_r
        self.t = rng.standard_normal((SKETCH, size - SPAN * self.cols))  # t_r, the tail's
        c64 = self.c.astype(np.float64)
        norms = np.sqrt(np.sum(c64**2, axis=1) * np.sum(self.a**2, axis=1) + np.sum(self.t**2, axis=1))
        self.row_norm = float(norms.max())  # max_r ‖P_r‖₂
        width = max(1, min(self.cols, BLOCK // SPAN))  # columns per block
        self._w = np.empty(SPAN * width, np.float32)  # a block of fl(Δ − η u), reused

    def _split(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(X, x_tail): the K × n view of x's first K n coordinates, and the rest."""
        main = SPAN * self.cols
        return x[:main].reshape(SPAN, self.cols), x[main:]

    def of_model(self, x: np.ndarray) -> np.ndarray:
        """P x in float64 (a model's sketch; once a round)."""
        x64 = np.asarray(x, np.float64)
        matrix, tail = self._split(x64)
        return np.einsum("rb,rb->r", self.c.astype(np.float64) @ matrix, self.a) + self.t @ tail

    def of_start(self, delta: np.ndarray, update: np.ndarray, lr: float) -> np.ndarray:
        """P (Δ − η u) for flat float32 Δ and u: float32 blocks of at most :data:`BLOCK`
        coordinates (one read of Δ and u, no model-sized temporary), summed in float64."""
        (dm, dt), (um, ut) = self._split(delta), self._split(update)
        out = self.t @ (dt.astype(np.float64) - lr * ut.astype(np.float64))
        step, scale = max(1, len(self._w) // SPAN), np.float32(lr)
        for start in range(0, self.cols, step):
            stop = min(start + step, self.cols)
            w = self._w[: SPAN * (stop - start)].reshape(SPAN, stop - start)
            if scale == 1:
                np.subtract(dm[:, start:stop], um[:, start:stop], out=w)
            else:
                np.multiply(um[:, start:stop], scale, out=w)
                np.subtract(dm[:, start:stop], w, out=w)
            out += np.einsum("rb,rb->r", self.c @ w, self.a[:, start:stop])
        return out

    def float32_slack(self, delta_norm: float, update_norm: float, lr: float) -> float:
        """The most :meth:`of_start` can be off from the exact P_r (Δ − η u), any row (module docstring)."""
        factor = math.ldexp(SPAN + 3, -24) + math.ldexp(self.cols + SPAN + 4, -52)
        return self.row_norm * factor * (delta_norm + 3.01 * abs(lr) * update_norm)
