"""FL-FDMS's per-round aggregation cost, with and without complexity reduction, next to FedAvg.

Synthetic clustered updates (Wang & Xu's setting, scaled up): N clients in equal clusters,
Δ_i = s_i (c_{cluster(i)} + σ ξ_i) with unit centres c, ‖ξ_i‖ ≈ 1 and a random scale s_i, so that
cos(Δ_i, Δ_j) ≈ 1/(1 + σ²) inside a cluster and ≈ 0 across, whatever d is. Each round a
fraction α of the clients drops (at least one per cluster kept), leaving ``--active`` clients.

The races need rounds before they eliminate (Θ_t falls like 1/√t), so the similarity state
(R, N_ij, candidate sets) is first WARMED UP on the same kind of updates at a small dimension
(the state does not depend on d), then ``--rounds`` rounds are timed at the full dimension.
Θ_t is the authors' code's (theta-scale=0.5, beta=1.0, theta-offset=0.01; see strategies/fdms.py).
Timings are wall-clock seconds of ``aggregate`` (building the synthetic updates excluded), BLAS
single-threaded by default (``--threads``);
medians over the timed rounds. A measurement, not a test::

    python benchmarks/fdms_cost.py                       # N=200, 100 active, d=1M
    python benchmarks/fdms_cost.py --dim 100000 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from strategies.base import ClientReport
from strategies.rules.fdms import FLFDMS
from strategies.rules.fedavg import FedAvgActive

CODE_THETA = {"theta_scale": 0.5, "beta": 1.0, "theta_offset": 0.01}


class Updates:
    """Clustered synthetic updates of dimension ``dim``; ``pool`` noise rows drawn once, reused."""

    def __init__(self, n: int, clusters: int, dim: int, active: int, sigma: float, seed: int,
                 pool: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n, self.active, self.sigma = n, active, np.float32(sigma)
        self.cluster = np.arange(n) // (n // clusters)
        self.centres = self.rng.standard_normal((clusters, dim), dtype=np.float32)
        self.centres /= np.linalg.norm(self.centres, axis=1, keepdims=True)
        self.noise = self.rng.standard_normal((pool, dim), dtype=np.float32) / np.float32(np.sqrt(dim))

    def schedule(self, t: int) -> np.ndarray:
        """Round 0: everyone; then ``active`` clients, at least one of every cluster."""
        if t == 0:
            return np.arange(self.n)
        keep = [self.rng.choice(np.flatnonzero(self.cluster == c)) for c in np.unique(self.cluster)]
        rest = self.rng.permutation(np.setdiff1d(np.arange(self.n), keep))
        return np.sort(np.r_[keep, rest[: self.active - len(keep)]])

    def reports(self, ids: np.ndarray) -> list[ClientReport]:
        if len(ids) > len(self.noise):
            raise ValueError(f"{len(ids)} clients but a noise pool of {len(self.noise)}")
        slots = self.rng.permutation(len(self.noise))
        scales = self.rng.uniform(0.5, 2.0, len(ids)).astype(np.float32)
        return [ClientReport(int(c), int(c), scales[i] * (self.centres[self.cluster[c]]
                                                          + self.sigma * self.noise[slots[i]]), 1)
                for i, c in enumerate(ids)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--active", type=int, default=100)
    ap.add_argument("--clusters", type=int, default=10)
    ap.add_argument("--dim", type=int, default=1_000_000)
    ap.add_argument("--sigma", type=float, default=0.5, help="noise norm relative to the centre")
    ap.add_argument("--warmup", type=int, default=150, help="rounds at --warmup-dim before timing")
    ap.add_argument("--warmup-dim", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds at --dim")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="BLAS threads (1: stable numbers on a shared machine, where a busy core "
                         "makes multi-threaded BLAS spin and slow down many times over)")
    a = ap.parse_args()
    with threadpool_limits(limits=a.threads):
        run(a)


def run(a: argparse.Namespace) -> None:

    rules = {"fl-fdms": FLFDMS(num_clients=a.clients, **CODE_THETA),
             "fl-fdms reduction": FLFDMS(num_clients=a.clients, reduction=True, **CODE_THETA),
             "fedavg-active": FedAvgActive(num_clients=a.clients)}
    fdms = [k for k in rules if k.startswith("fl-fdms")]

    tic = time.perf_counter()
    small = Updates(a.clients, a.clusters, a.warmup_dim, a.active, a.sigma, a.seed, pool=a.clients)
    x = np.zeros(a.warmup_dim, np.float32)
    for t in range(a.warmup):
        reps = small.reports(small.schedule(t))
        for k in fdms:
            rules[k].aggregate(t, x, reps)
    fast = rules["fl-fdms reduction"]
    print(f"warm-up: {a.warmup} rounds at d={a.warmup_dim} in {time.perf_counter() - tic:.1f} s; "
          f"Θ_t={fast.theta(a.warmup - 1):.3f}, mean |C_k|={fast.candidates.sum(1).mean():.1f} "
          f"(cluster size {a.clients // a.clusters})")

    big = Updates(a.clients, a.clusters, a.dim, a.active, a.sigma, a.seed + 1, pool=a.active)
    x = np.zeros(a.dim, np.float32)
    seconds: dict[str, list[float]] = {k: [] for k in rules}
    phases: dict[str, dict[str, list[float]]] = {k: {} for k in fdms}
    counts: dict[str, list[tuple[int, int]]] = {k: [] for k in fdms}
    friends_agree = True
    for t in range(a.warmup, a.warmup + a.rounds):
        reps = big.reports(big.schedule(t))
        chosen = []
        for k, rule in rules.items():
            tic = time.perf_counter()
            _, metrics = rule.aggregate(t, x, reps)
            seconds[k].append(time.perf_counter() - tic)
            if k in fdms:
                counts[k].append((metrics["similarity-pairs"], metrics["similarity-dots"]))
                for phase, s in rule.timings.items():
                    phases[k].setdefault(phase, []).append(s)
                chosen.append(rule.friends)
        friends_agree &= chosen[0] == chosen[1]
        del reps

    med = {k: statistics.median(v) for k, v in seconds.items()}
    print(f"\nN={a.clients}, {a.active} active clients/round, {a.clusters} clusters, d={a.dim:,}, "
          f"{a.threads} BLAS thread(s), "
          f"median of {a.rounds} rounds after {a.warmup} warm-up rounds; same friends: {friends_agree}\n")
    head = "| rule | aggregate s | stack s | friends s | weighted sum s | similarity s | pairs | dots |"
    print(head)
    print("|" + "---|" * 8)
    for k in rules:
        if k in fdms:
            p = {ph: statistics.median(v) for ph, v in phases[k].items()}
            pairs, dots = (int(statistics.median(c)) for c in zip(*counts[k], strict=True))
            print(f"| {k} | {med[k]:.3f} | {p['stack']:.3f} | {p['friends']:.4f} | {p['aggregate']:.3f} | "
                  f"{p['similarity']:.3f} | {pairs} | {dots} |")
        else:
            print(f"| {k} | {med[k]:.3f} | | | | | | |")
    print(f"\nreduction: {med['fl-fdms'] / med['fl-fdms reduction']:.2f}x less aggregation time; "
          f"FL-FDMS costs {med['fl-fdms'] / med['fedavg-active']:.1f}x FedAvg without, "
          f"{med['fl-fdms reduction'] / med['fedavg-active']:.1f}x with the reduction")


if __name__ == "__main__":
    main()
