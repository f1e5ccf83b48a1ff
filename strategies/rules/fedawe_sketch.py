"""FedAWE's consistency check, its one model-sized part: a secret projection P and P (Δ_i − η_g u_i).

The check (:meth:`strategies.rules.fedawe.FedAWE._check_start`) compares P x_i^{t,0}, where
x_i^{t,0} = x_i^† − η_g u_i, with P x^s of the models client i can hold. P has :data:`SKETCH`
rows; each is a *block-scaled* Gaussian. Cut the first K n coordinates of a flat model x (K =
:data:`SPAN`, n = ⌊d/K⌋) into blocks of :data:`BLOCK` (a multiple of K; the last block
shorter), view block q as a K-row matrix X_q (row-major: row k is the k-th run of its length / K
coordinates), and the last d − K n coordinates as x_tail; then

    P_r x = Σ_q c_r^T X_q a_r,q + t_r · x_tail,    c_r ∈ R^K, a_r = (a_r,1, a_r,2, ...) ∈ R^n,
                                                   t_r ∈ R^{d − K n}, all standard normal,

i.e. P_r's entry at (k, b) of block q is c_rk a_r,qb. Why this shape: P is (K + n + K) numbers
a row, not d, so checking one reply reads Δ_i and u_i once, in order, and nothing model-sized
besides (a dense P, 2 × d float64, was read again for every reply: 16 MB at d = 10⁶), and
c_r^T X_q is a float32 BLAS product whose sums have depth K, so its rounding has a bound (below).
An error e in a start is caught as with a dense Gaussian P: P_r e = Σ_q c_r^T E_q a_r,q is, for
the secret c_r and a_r, a Gaussian mixture that vanishes only for e = 0; an error in one
coordinate gives c_rk a_r,qb e_j, a product of two Gaussians, more often near 0 than one
Gaussian: hence 4 rows where the dense P had 2 (d = 40,000, ‖x^0‖ = 199, 300 secret seeds: an
error of 0.01 in one coordinate caught 247 times, the dense 2 rows 246; 0.003: 62 and 45; 2
block-scaled rows caught 0.01 only 65 of 100 times, the dense 84). The rows cost no extra read.
BLOCK and K are part of P's definition (changing them changes :data:`FORM`).

P (Δ − η u) in float32 (:meth:`Projection.of_start`), per block of :data:`BLOCK` coordinates (in
cache): w = fl(Δ − fl(η u)) (per coordinate off by at most 2⁻²⁴ (|Δ_j| + 3.01 |η u_j|)), then
c_r^T W (float32 BLAS, K products a sum: off by at most γ_K Σ_k |c_rk ŵ_kb|, γ_K ≤ (K + 0.01)
2⁻²⁴, whatever the order of the sum), then · a_r,q in float64 (n terms in all, γ_n of float64). With
Cauchy-Schwarz the whole is off by at most

    ‖P_r‖ (2⁻²⁴ (‖Δ‖ + 3.01 |η| ‖u‖) + ((K + 1) 2⁻²⁴ + (n + K + 4) 2⁻⁵²) ‖ŵ‖)   (:meth:`Projection.float32_slack`),

‖ŵ‖ from the blocks' float32 sums of squares (each at least (1 − γ_B) of the exact one, B =
:data:`BLOCK`). For an honest reply ŵ ≈ x^s − x^t, the distance of its start from x^t (0 for a
start at x^t), so the second term is small beside the first, and the first is at most 1.4 x the
float32 rounding of the reply itself that the check allows already; the check adds both to it.
The known sketches P x^s are float64 (:meth:`Projection.of_model`).
"""

from __future__ import annotations

import logging
import math

import numpy as np

SKETCH = 4  # rows of P (module docstring: as often caught as with 2 dense rows)
SPAN = 32  # K: the depth of P's float32 sums (the slack grows with it: (K + 1) 2^-24 ‖ŵ‖)
BLOCK = 1 << 17  # coordinates per block of P (a multiple of SPAN): 512 KiB of float32, in cache
FORM = 2  # P's construction from the seed (1: the dense Gaussian P before; checkpoints say which)

log = logging.getLogger(__name__)


class Projection:
    """P over flat models of ``size`` coordinates, drawn from the secret ``seed`` (module docstring)."""

    def __init__(self, seed: int, size: int) -> None:
        rng = np.random.default_rng(seed)
        self.size, self.cols = size, size // SPAN
        self.c = rng.standard_normal((SKETCH, SPAN)).astype(np.float32)  # c_r (float32: the BLAS operand)
        self.a = rng.standard_normal((SKETCH, self.cols))  # a_r, (a_r,1, a_r,2, ...) block by block
        self.t = rng.standard_normal((SKETCH, size - SPAN * self.cols))  # t_r, the tail's
        c64 = self.c.astype(np.float64)
        norms = np.sqrt(np.sum(c64**2, axis=1) * np.sum(self.a**2, axis=1) + np.sum(self.t**2, axis=1))
        self.row_norm = float(norms.max())  # max_r ‖P_r‖₂
        self._w = np.empty(min(BLOCK, SPAN * self.cols), np.float32)  # a block of fl(Δ − η u), reused
        self._r = np.empty((SKETCH, self.cols), np.float32)  # c_r^T X_q, block by block

    def _blocks(self) -> range:
        return range(0, SPAN * self.cols, BLOCK)

    def of_model(self, x: np.ndarray) -> np.ndarray:
        """P x in float64 (a model's sketch; once a round)."""
        c64, main = self.c.astype(np.float64), SPAN * self.cols
        out = self.t @ np.asarray(x[main:], np.float64)
        for start in self._blocks():
            block = np.asarray(x[start:min(start + BLOCK, main)], np.float64).reshape(SPAN, -1)
            cols = slice(start // SPAN, start // SPAN + block.shape[1])
            out += np.einsum("rb,rb->r", c64 @ block, self.a[:, cols])
        return out

    def of_start(self, delta: np.ndarray, update: np.ndarray, lr: float) -> tuple[np.ndarray, float]:
        """(P (Δ − η u), a bound on ‖ŵ‖ (ŵ: Δ − η u as computed)) for flat float32 Δ and u:
        float32 blocks of :data:`BLOCK` coordinates (one read of Δ and u, no model-sized
        temporary), summed in float64."""
        main, scale = SPAN * self.cols, np.float32(lr)
        tail = delta[main:].astype(np.float64) - lr * update[main:].astype(np.float64)
        out, squares = self.t @ tail, float(tail @ tail)
        for start in self._blocks():
            stop = min(start + BLOCK, main)
            w = self._w[: stop - start]
            if scale == 1:
                np.subtract(delta[start:stop], update[start:stop], out=w)
            else:
                np.multiply(update[start:stop], scale, out=w)
                np.subtract(delta[start:stop], w, out=w)
            squares += float(np.dot(w, w))  # float32, ≥ (1 − γ_BLOCK) Σ w_j²
            np.matmul(self.c, w.reshape(SPAN, -1), out=self._r[:, start // SPAN:stop // SPAN])
        return out + np.einsum("rb,rb->r", self._r, self.a), math.sqrt(squares / (1 - math.ldexp(BLOCK + 1, -24)))

    def float32_slack(self, delta_norm: float, update_norm: float, lr: float, start_norm: float) -> float:
        """The most :meth:`of_start` can be off from the exact P_r (Δ − η u), any row, given the
        bound ``start_norm`` on ‖ŵ‖ it returned (module docstring)."""
        factor = math.ldexp(SPAN + 1, -24) + math.ldexp(self.cols + SPAN + 4, -52)
        return self.row_norm * (math.ldexp(delta_norm + 3.01 * abs(lr) * update_norm, -24) + factor * start_norm)

    def tolerance(self, current_norm: float, delta_norm: float, update_norm: float, lr: float,
                  start_norm: float) -> float:
        """How far P x^t + :meth:`of_start` of an honest reply may lie from the sketch of its true
        start, any row: the reply's own float32 rounding, per coordinate at most b_j = 2⁻²³ (|x^t_j| +
        |Δ_j| + |η| |u_j|), so |P_r b| ≤ ‖P_r‖₂ 2⁻²³ (‖x^t‖ + ‖Δ‖ + |η| ‖u‖) (Cauchy-Schwarz, then the
        triangle inequality; 1.1 x that), plus :meth:`float32_slack` (of_start's own rounding)."""
        slack = 1.1 * self.row_norm * (current_norm + delta_norm + abs(lr) * update_norm)
        return math.ldexp(slack, -23) + self.float32_slack(delta_norm, update_norm, lr, start_norm) + 1e-12


def restored_sketches(rule: str, sketches: dict[int, np.ndarray], form: int,
                      check_start: bool) -> tuple[dict[int, np.ndarray], int]:
    """A checkpoint's (sketches, form) as this version uses them. Sketches of another P (form 1:
    a checkpoint of the dense P) cannot judge a start: refused while the check is on (it does not
    fail open), dropped (logged) with ``check-start=false``."""
    if form == FORM:
        return sketches, form
    if sketches and check_start:
        raise ValueError(f"{rule}: the checkpoint's consistency sketches are of an older projection "
                         f"(form {form}, this version draws form {FORM}), so check-start cannot "
                         "judge its replies: resume with check-start=false (the check off for this run) "
                         "or start the run again")
    if sketches:
        log.warning("%s: the checkpoint's consistency sketches (form %s) are dropped: check-start=false", rule, form)
    return {}, FORM
