"""FedAWARE: gradient diversity maximisation with per-client server momenta.

Zeng, Xu, Pan, Wang and Tang, "Tackling Hybrid Heterogeneity on Federated Optimization via
Gradient Diversity Maximization" (arXiv:2310.02702), Alg. 1. The server keeps one momentum per
client, updated only when the client's update arrives (g_i = −Δ_i, the pseudo-gradient):

    m_i ← α m_i + (1 − α) g_i                                   (i ∈ A_t)
    m̂_i = m_i / ‖m_i‖                                          (clients seen at least once)
    λ = argmin_{λ ∈ simplex} ‖Σ_i λ_i m̂_i‖²                    (min-norm point of the hull)
    x^{t+1} = x^t − η_g Σ_i λ_i m̂_i

λ is found by Frank–Wolfe on the Gram matrix M = m̂ m̂ᵀ (:func:`min_norm_weights`), as in the
multiple-gradient-descent solver of Sener & Koltun (NeurIPS 2018) that the official code uses.
Clients never seen (m_i = 0) or with m_i = 0 are left out: a zero vector would make the minimum
norm 0. Until ``min_seen`` clients (0 = all N) have been seen, the round is FedAvg over the
active clients (the official code's exploration phase).

Memory: the momenta are one float32 N × d matrix (the paper's O(N d) server state).

Numerical safety (any finite input): the Gram matrix falls back from one float32 product to a
blockwise product of the rows divided by their largest entry, scaled back in float64, when the
float32 one overflows or underflows (:func:`gram`); d = Σ (λ_i / ‖m_i‖) m_i has
‖d‖ ≤ 1, and momenta with a norm below ~1e-38 (float32's smallest normal) count as zero. A
momentum update stays within float32's range (|α m − (1 − α) Δ| ≤ max(|m|, |Δ|):
:func:`update_momenta`). If the solver fails (an exception, or λ not finite or off the
simplex) the round falls back to equal weights λ_i = 1/|S| on the normalised momenta, the FedAvg
of the unit momenta (logged; metric ``solver-fallback`` = 1).

The solver adds an exact finish to Frank–Wolfe (``polish``, see :func:`min_norm_solve`).
Official code (github.com/dunzeng/FedAWARE, utils.py / min_norm_solvers.py) differences:
it writes m ← (1 − α) m + α g (identical at its α = 0.5); its solver stops after 250 iterations,
clamps two-vector weights to [0.001, 0.999] and returns the iterate before the last step; it
divides zero-norm momenta by 1 instead of dropping them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from ..contract import Finished, Needs, RoundContext, Rule
from ..replies import ClientReport
from ..rule import Rule as HookRule
from ..rule_strategy import RuleStrategy
from ..weighting import weighted_sum

log = logging.getLogger(__name__)
BLOCK = 1 << 22  # elements of one block of columns (16 MiB float32) in the scaled Gram product
MOMENTUM_BLOCK = 1 << 17  # columns per block of the momentum update
TINY = float(np.finfo(np.float32).tiny)  # ~1.2e-38: momenta with a smaller norm count as zero


def _two_point(aa, ab, bb):
    """γ minimising ‖γ a + (1 − γ) b‖² over [0, 1], and that minimum (elementwise).

    aa = a·a, ab = a·b, bb = b·b (arrays or scalars).
    """
    aa, ab, bb = np.broadcast_arrays(*(np.asarray(v, np.float64) for v in (aa, ab, bb)))
    denom = aa + bb - 2 * ab
    with np.errstate(divide="ignore", invalid="ignore"):
        gamma = np.where(denom > 0, (bb - ab) / denom, 0.0)
    gamma = np.where(ab >= aa, 1.0, np.where(ab >= bb, 0.0, gamma))
    gamma = np.clip(gamma, 0.0, 1.0)
    cost = gamma**2 * aa + 2 * gamma * (1 - gamma) * ab + (1 - gamma) ** 2 * bb
    return gamma, cost


def min_norm_solve(gram: np.ndarray, *, tol: float = 1e-5, max_iter: int = 1000,
                   polish: bool = True) -> tuple[np.ndarray, int]:
    """λ = argmin_{λ ∈ simplex} λᵀ M λ by Frank–Wolfe, and the number of FW iterations.

    Start from the best pair (i, j) (closed-form two-vector minimum norm over all pairs), then
    repeat: j* = argmin_j (Mλ)_j, exact line search on the segment [λ, e_{j*}], until the step
    changes λ by less than ``tol`` in ℓ1 or ``max_iter`` iterations.

    Plain Frank–Wolfe zig-zags when the minimum lies on a face of the simplex: after 1000
    iterations its objective can still be ~1e-3 above the minimum (measured on random
    instances with 3–12 vectors). With ``polish`` (default) Wolfe's min-norm-point active-set
    steps (Wolfe, Math. Programming 1976), started from FW's support, then make the answer exact;
    the polished λ is kept only if it is feasible and not worse.
    """
    m = np.asarray(gram, np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.shape[0] == 0:
        raise ValueError(f"gram must be a non-empty square matrix, got shape {m.shape}")
    n = m.shape[0]
    lam = np.zeros(n)
    if n == 1:
        lam[0] = 1.0
        return lam, 0
    diag = np.diag(m)
    gamma, cost = _two_point(diag[:, None], m, diag[None, :])
    cost = np.where(np.triu(np.ones((n, n), bool), k=1), cost, np.inf)
    i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
    lam[i], lam[j] = gamma[i, j], 1.0 - gamma[i, j]
    mlam = m @ lam
    it = 0
    while it < max_iter:
        it += 1
        k = int(np.argmin(mlam))
        g, _ = _two_point(lam @ mlam, mlam[k], m[k, k])
        g = float(g)
        new = g * lam
        new[k] += 1.0 - g
        change = float(np.abs(new - lam).sum())
        lam = new
        mlam = g * mlam + (1.0 - g) * m[:, k]
        if change < tol:
            break
    if polish:
        try:
            better = _wolfe_polish(m, lam)
        except np.linalg.LinAlgError:  # lstsq's SVD did not converge: keep Frank–Wolfe's answer
            better = lam
        if better.min() >= 0 and abs(better.sum() - 1) < 1e-9 and better @ m @ better <= lam @ m @ lam:
            lam = better
    return lam, it


def _wolfe_polish(m: np.ndarray, lam: np.ndarray, rel_tol: float = 1e-12) -> np.ndarray:
    """Wolfe's min-norm-point iterations on Gram matrix ``m``, from the feasible ``lam``.

    The corral S is λ's support. Minor cycle: the affine minimiser α of λ_Sᵀ M_SS λ_S with
    Σ α = 1 (KKT system, least squares); if α > 0 it becomes λ, else move from λ towards α
    until a weight hits 0 and drop it. Major cycle: add j = argmin (Mλ)_j while
    (Mλ)_j < λᵀMλ (the simplex optimality condition fails).
    """
    n = len(lam)
    lam = np.where(lam > 1e-15, lam, 0.0)
    lam /= lam.sum()
    corral = [int(i) for i in np.flatnonzero(lam)]
    for _ in range(10 * n + 50):
        k = len(corral)
        kkt = np.zeros((k + 1, k + 1))
        kkt[:k, :k] = m[np.ix_(corral, corral)]
        kkt[:k, k] = kkt[k, :k] = 1.0
        rhs = np.zeros(k + 1)
        rhs[k] = 1.0
        alpha = _solve(kkt, rhs)[:k]
        if not np.all(np.isfinite(alpha)) or abs(alpha.sum()) < 1e-12:
            break
        alpha /= alpha.sum()
        current = lam[corral]
        if np.all(alpha > 0):
            lam = np.zeros(n)
            lam[corral] = alpha
            mlam = m @ lam
            f = float(lam @ mlam)
            j = int(np.argmin(mlam))
            if mlam[j] >= f - rel_tol * max(1.0, abs(f)) or j in corral:
                break
            corral.append(j)
            continue
        neg = alpha <= 0
        theta = float(np.min(current[neg] / (current[neg] - alpha[neg])))
        moved = current + theta * (alpha - current)
        keep = moved > 1e-15
        lam = np.zeros(n)
        lam[np.asarray(corral)[keep]] = moved[keep]
        corral = [c for c, kp in zip(corral, keep, strict=True) if kp]
    return lam


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a⁻¹b by LU; least squares when ``a`` is singular or the LU answer is inaccurate."""
    try:
        x = np.linalg.solve(a, b)
        if np.all(np.isfinite(x)) and np.linalg.norm(a @ x - b) <= 1e-9 * (1 + np.linalg.norm(b)):
            return x
    except np.linalg.LinAlgError:
        pass
    return np.linalg.lstsq(a, b, rcond=None)[0]


def min_norm_weights(gram: np.ndarray, *, tol: float = 1e-5, max_iter: int = 1000,
                     polish: bool = True) -> np.ndarray:
    """λ on the simplex minimising ‖Σ λ_i v_i‖² given the Gram matrix M_ij = v_i·v_j."""
    return min_norm_solve(gram, tol=tol, max_iter=max_iter, polish=polish)[0]


@dataclass(frozen=True)
class FedAWAREParams:
    """alpha : α, the momentum's weight of the past (in [0, 1)).
    min_seen : clients to see before the min-norm direction is used (0: all N).
    polish : the exact finish of Frank–Wolfe (False: plain Frank–Wolfe, as the official code)."""

    alpha: float = 0.5
    min_seen: int = 0
    polish: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"alpha must be in [0, 1), got {self.alpha}")


@dataclass
class FedAWAREState:
    """The per-client momenta m_i (N × d float32, None before the first round) and who was seen."""

    momenta: np.ndarray | None = None
    seen: np.ndarray | None = None


class FedAWARERule(Rule):
    """Min-norm direction of normalised per-client momenta (Zeng et al., arXiv:2310.02702, Alg. 1).

    The momenta are the state's N × d matrix, changed in place by each round (a copy per round
    would cost O(N d)); a checkpoint copies it."""

    name = "fedaware"
    Params, State = FedAWAREParams, FedAWAREState
    needs = Needs(client_ids=True, holds=HookRule.holds_replies)  # momenta are rows 0..N-1 of a matrix

    def validate(self, num_clients: int | None) -> None:
        n = num_clients  # None: the nodes connected at the first round (the adapter counts them)
        if not 0 <= self.params.min_seen <= (n if n is not None else self.params.min_seen):
            raise ValueError(f"min_seen must be in [0, N={n}] (0 = all clients), got {self.params.min_seen}")

    def fold(self, state: FedAWAREState, ctx: RoundContext) -> FedAWAREFold:
        return FedAWAREFold(self, state, ctx)


class FedAWAREFold:
    """A FedAWARE round: the reports held, the momenta updated and the direction taken at the end."""

    def __init__(self, rule: FedAWARERule, state: FedAWAREState, ctx: RoundContext) -> None:
        self.rule, self.state, self.ctx = rule, state, ctx
        self.reports: list[ClientReport] = []

    def add(self, report: ClientReport) -> None:
        self.reports.append(report)

    def finish(self) -> Finished:
        p, ctx, reports = self.rule.params, self.ctx, self.reports
        x, n = ctx.x, ctx.require_num_clients()
        self.rule.validate(n)
        state = self.state
        if state.seen is None or state.seen.size != n:
            state = replace(state, seen=np.zeros(n, bool))
        if state.momenta is None or state.momenta.shape[1] != x.size:
            state = replace(state, momenta=np.zeros((n, x.size), np.float32), seen=np.zeros(n, bool))
        assert state.momenta is not None and state.seen is not None
        update_momenta(state.momenta, state.seen, reports, p.alpha)
        metrics: dict[str, float] = {"num-seen": int(state.seen.sum())}
        if not reports:
            return Finished(x, state, metrics)
        if state.seen.sum() < (p.min_seen or n):
            w = [ctx.weight(r) for r in reports]
            return Finished(x + ctx.server_lr * weighted_sum(w, (r.delta for r in reports)), state, metrics)
        d, info = direction(state.momenta, state.seen, p.polish)
        return Finished(x - ctx.server_lr * d, state, {**metrics, **info})


def update_momenta(momenta: np.ndarray, seen: np.ndarray, reports: list[ClientReport], alpha: float) -> None:
    """m_i ← α m_i + (1 − α) g_i with g_i = −Δ_i, in place, in float32 (each product is within
    float32's range; three roundings instead of one: within 1.5 ulp), in one pass over blocks
    of columns, every participant's block while the scratch blocks stay in cache. Where the
    float32 difference overflows (entries near float32's largest, possible only with the
    norm bounds off), that block is computed in float64: |α m − (1 − α) Δ| <= max(|m|, |Δ|)."""
    dim = momenta.shape[1]
    a32, b32 = np.float32(alpha), np.float32(1.0 - alpha)
    scaled, term = np.empty(min(dim, MOMENTUM_BLOCK), np.float32), np.empty(min(dim, MOMENTUM_BLOCK), np.float32)
    with np.errstate(over="raise", under="ignore", invalid="raise"):
        for lo in range(0, dim, MOMENTUM_BLOCK):
            cols = slice(lo, min(lo + MOMENTUM_BLOCK, dim))
            a, b = scaled[: cols.stop - lo], term[: cols.stop - lo]
            for r in reports:
                row = momenta[r.client_id, cols]
                try:
                    np.subtract(np.multiply(row, a32, out=a), np.multiply(r.delta[cols], b32, out=b), out=a)
                except FloatingPointError:
                    a[...] = alpha * row.astype(np.float64) - (1.0 - alpha) * r.delta[cols].astype(np.float64)
                row[...] = a
    for r in reports:
        seen[r.client_id] = True


def direction(momenta: np.ndarray, seen: np.ndarray, polish: bool = True) -> tuple[np.ndarray, dict[str, float]]:
    """d = Σ λ_i m̂_i over the seen, non-zero momenta, and solver metrics."""
    g = gram(momenta)
    norms = np.sqrt(np.maximum(np.diag(g), 0.0))
    keep = np.flatnonzero(seen & (norms >= TINY))  # below: zero (1/‖m_i‖ is not a float32)
    if keep.size == 0:
        return np.zeros(momenta.shape[1], np.float32), {"min-norm": 0.0}
    nk = norms[keep]
    unit = g[np.ix_(keep, keep)] / np.outer(nk, nk)  # Gram of the normalised momenta
    lam, iters, fallback = solve(unit, polish)
    coef = np.zeros(len(norms), np.float32)
    coef[keep] = lam / nk  # <= 1 / TINY, a float32; each λ_i m_ij / ‖m_i‖ is <= λ_i
    d = coef @ momenta  # ‖d‖ <= 1
    return d, {
        "min-norm": float(np.sqrt(max(lam @ unit @ lam, 0.0))),
        "fw-iterations": iters,
        "lambda-support": int((lam > 1e-8).sum()),
        "lambda-max": float(lam.max()),
        "solver-fallback": float(fallback),
    }


def gram(m: np.ndarray) -> np.ndarray:
    """M Mᵀ of the momenta in float64 (N × N).

    One float32 product, unless it overflowed (norms ≳ 1e19) or a non-zero row's squared norm
    fell below 1e-30 (precision lost to underflow); then blockwise over columns on the rows
    divided by their largest entry (entries in [-1, 1]: no overflow), scaled back in float64.
    """
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        g = (m @ m.T).astype(np.float64)
    small = np.flatnonzero(np.diag(g) < 1e-30)
    if np.all(np.isfinite(g)) and not m[small].any():
        return g
    n, dim = m.shape
    step = max(1, BLOCK // n)
    scale = np.zeros(n, np.float32)  # largest |entry| of each row
    for lo in range(0, dim, step):
        scale = np.maximum(scale, np.abs(m[:, lo:lo + step]).max(axis=1, initial=0.0))
    divisor = np.where(scale > 0, scale, 1.0).astype(np.float32)[:, None]
    g = np.zeros((n, n))
    for lo in range(0, dim, step):
        block = m[:, lo:lo + step] / divisor
        g += block @ block.T
    scale64 = scale.astype(np.float64)
    return g * np.outer(scale64, scale64)


def solve(unit: np.ndarray, polish: bool = True) -> tuple[np.ndarray, int, bool]:
    """λ from :func:`min_norm_solve`, or equal weights (logged) when the solver fails."""
    try:
        lam, iters = min_norm_solve(unit, polish=polish)
        if np.all(np.isfinite(lam)) and lam.min() >= 0 and abs(lam.sum() - 1) < 1e-6:
            return lam, iters, False
        why = f"λ off the simplex (sum {lam.sum():.3g}, min {lam.min():.3g})"
    except (ArithmeticError, ValueError, np.linalg.LinAlgError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    log.error("fedaware: min-norm solver failed (%s); using equal weights on the unit momenta", why)
    return np.full(len(unit), 1.0 / len(unit)), 0, True


class FedAWARE(RuleStrategy):
    """:class:`FedAWARERule` as a Flower Strategy (Zeng et al., arXiv:2310.02702, Alg. 1)."""

    rule = FedAWARERule()
