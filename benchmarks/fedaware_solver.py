"""FedAWARE's server cost per round (Gram matrix + min-norm solver) next to FedAvg's aggregation.

For N seen clients and a model of d parameters, FedAWARE keeps an N × d float32 momentum matrix
and each round computes its Gram matrix (one N × N product), solves the min-norm problem on it
(Frank–Wolfe, then the exact active-set finish) and forms d = Σ λ_i m̂_i (one N-vector × matrix
product). FedAvg over N active clients sums N flat updates. Both are timed through the real
strategy classes' ``aggregate`` (FedAvg on N reports of size d; FedAWARE after every client has
been seen once, on the same momenta) and, for FedAWARE, split into its parts.

Run:  python benchmarks/fedaware_solver.py [--sizes 100x100000,1000x100000,100x1000000,1000x1000000]
A size needs about 3 × N × d × 4 bytes of memory (momenta, updates, Gram work); sizes that would
not fit in the available memory are skipped and said so. Timings are wall-clock, best of --repeat.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from strategies.base import ClientReport
from strategies.rules.fedavg import FedAvgActive
from strategies.rules.fedaware import FedAWARE, min_norm_solve


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def best_of(repeat: int, fn):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def bench(n: int, d: int, repeat: int, seed: int = 0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    # client updates: a shared direction plus client-specific noise (a realistic min-norm problem)
    common = rng.standard_normal(d, dtype=np.float32)
    deltas = np.empty((n, d), np.float32)
    for i in range(n):
        deltas[i] = 0.3 * common + rng.standard_normal(d, dtype=np.float32)
    reports = [ClientReport(client_id=i, node_id=i, delta=deltas[i], num_examples=1) for i in range(n)]
    x = np.zeros(d, np.float32)

    fedavg = FedAvgActive(num_clients=n)
    t_avg, _ = best_of(repeat, lambda: fedavg.aggregate(0, x, reports))

    aware = FedAWARE(num_clients=n, alpha=0.5)
    aware.aggregate(0, x, reports)  # fills the momenta and marks everyone seen (one full round)
    t_aware, _ = best_of(repeat, lambda: aware.aggregate(1, x, reports))

    mom = aware.rule_state.momenta
    t_gram, gram = best_of(repeat, lambda: (mom @ mom.T).astype(np.float64))
    norms = np.sqrt(np.diag(gram))
    unit = gram / np.outer(norms, norms)
    t_fw, (lam, iters) = best_of(repeat, lambda: min_norm_solve(unit, polish=False))
    t_solve, (lam2, _) = best_of(repeat, lambda: min_norm_solve(unit))
    coef = (lam2 / norms).astype(np.float32)
    t_comb, _ = best_of(repeat, lambda: coef @ mom)
    return {
        "fedavg": t_avg, "fedaware": t_aware, "gram": t_gram, "fw": t_fw, "fw_iters": iters,
        "solve": t_solve, "combine": t_comb, "support": int((lam2 > 1e-8).sum()),
        "fw_gap": float(lam @ unit @ lam - lam2 @ unit @ lam2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100x100000,1000x100000,100x1000000,1000x1000000",
                    help="comma-separated NxD")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"numpy {np.__version__}, {os.cpu_count()} CPU(s) visible, "
          f"{available_bytes() / 2**30:.1f} GiB available; best of {args.repeat}")
    header = (f"{'N':>6} {'d':>9} | {'FedAvg agg':>10} | {'FedAWARE agg':>12} = {'Gram':>8} + "
              f"{'FW+exact':>8} + {'Σλm̂':>7} | {'FW only':>8} {'FW it':>6} {'support':>7} "
              f"{'FW excess obj':>13}")
    print(header)
    print("-" * len(header))
    for size in args.sizes.split(","):
        n, d = (int(v) for v in size.lower().split("x"))
        need = 3 * n * d * 4
        if need > 0.8 * available_bytes():
            print(f"{n:>6} {d:>9} | skipped: needs ~{need / 2**30:.1f} GiB, "
                  f"{available_bytes() / 2**30:.1f} GiB available")
            continue
        r = bench(n, d, args.repeat)
        print(f"{n:>6} {d:>9} | {r['fedavg']:>9.3f}s | {r['fedaware']:>11.3f}s = {r['gram']:>7.3f}s + "
              f"{r['solve']:>7.3f}s + {r['combine']:>6.3f}s | {r['fw']:>7.3f}s {r['fw_iters']:>6} "
              f"{r['support']:>7} {r['fw_gap']:>13.2e}", flush=True)


if __name__ == "__main__":
    main()
