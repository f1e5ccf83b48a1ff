"""Small independent numpy implementations of the new rules' papers, for the differential tests.

Each simulates the whole algorithm on quadratic clients F_i(x) = ½ Σ_j h_ij (x_j − e_ij)² with
exact gradients h_i ⊙ (x − e_i), plain local SGD of K steps at lr η, and a given participation
matrix P (rounds × clients, 0/1), in float64. Written from the papers' pseudo-code (and, for
Amplified SCAFFOLD, as a port of its official ``synthetic/train.py`` loop), without any of the
project's code.
"""

from __future__ import annotations

import numpy as np


def quadratic_clients(n: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(h, e): curvatures in [0.5, 3] and optima in [-2, 2], one row per client."""
    rng = np.random.default_rng(seed)
    return rng.uniform(0.5, 3.0, (n, d)), rng.uniform(-2.0, 2.0, (n, d))


def grad(h: np.ndarray, e: np.ndarray, i: int, x: np.ndarray) -> np.ndarray:
    return h[i] * (x - e[i])


def local_sgd(h, e, i, x, steps, lr, shift=None, scale=1.0):
    """K steps y ← y − lr·scale·(g(y) + shift); returns (y, the raw gradients' sum)."""
    y = np.array(x, np.float64)
    total = np.zeros_like(y)
    for _ in range(steps):
        g = grad(h, e, i, y)
        total += g
        y = y - lr * scale * (g + (0.0 if shift is None else shift))
    return y, total


def scaffold(h, e, P, x0, steps, lr, server_lr=1.0):
    """Karimireddy et al., ICML 2020, Alg. 1 with option II: c_i^+ = c_i − c + (x − y_i)/(K η_l)."""
    n = h.shape[0]
    x, c, ci = np.array(x0, np.float64), np.zeros_like(x0, dtype=np.float64), np.zeros((n, len(x0)))
    for t in range(P.shape[0]):
        active = np.flatnonzero(P[t])
        if not len(active):
            continue
        dys, dcs = [], []
        for i in active:
            y, _ = local_sgd(h, e, i, x, steps, lr, shift=c - ci[i])
            new_ci = ci[i] - c + (x - y) / (steps * lr)
            dys.append(y - x)
            dcs.append(new_ci - ci[i])
            ci[i] = new_ci
        x = x + server_lr * np.mean(dys, axis=0)
        c = c + np.sum(dcs, axis=0) / n
    return x


def amplified_scaffold(h, e, P, x0, steps, lr, period, gamma):
    """Port of the official code's loop (``synthetic/train.py``, amplify=True, correction="period"),
    exact gradients, participation from P (an empty round keeps x)."""
    n = h.shape[0]
    eta = lr / gamma
    global_x = np.array(x0, np.float64)
    amplify_x = global_x.copy()
    local_corrections = [np.zeros_like(global_x) for _ in range(n)]
    global_correction = np.zeros_like(global_x)
    avg_local_grads = [np.zeros_like(global_x) for _ in range(n)]
    local_sample_sizes = [0] * n
    for r in range(P.shape[0]):
        trained = []
        for client in np.flatnonzero(P[r]):
            local_x = global_x.copy()
            for _ in range(steps):
                g = grad(h, e, client, local_x)
                avg_local_grads[client] = avg_local_grads[client] + g
                local_sample_sizes[client] += 1
                g = g - local_corrections[client] + global_correction
                local_x = local_x - eta * g
            trained.append(local_x)
        if trained:
            global_x = np.mean(trained, axis=0)
        if (r + 1) % period == 0:
            global_x = amplify_x + gamma * (global_x - amplify_x)
            amplify_x = global_x.copy()
            for client in range(n):
                if local_sample_sizes[client] > 0:
                    global_correction -= local_corrections[client] / n
                    local_corrections[client] = avg_local_grads[client] / local_sample_sizes[client]
                    global_correction += local_corrections[client] / n
                    avg_local_grads[client] = np.zeros_like(global_x)
                    local_sample_sizes[client] = 0
    return global_x


def fedpbc(h, e, P, x0, steps, lr, server_lr=1.0):
    """Xiang et al., arXiv 2306.00280, Alg. 1 (the available clients train their own copies;
    the mean reaches only them, after the round)."""
    n = h.shape[0]
    x = np.array(x0, np.float64)
    copies = np.tile(x, (n, 1))
    for t in range(P.shape[0]):
        active = np.flatnonzero(P[t])
        if not len(active):
            continue
        echoed = []
        for i in active:
            y, _ = local_sgd(h, e, i, copies[i], steps, lr)
            echoed.append(copies[i] + server_lr * (y - copies[i]))
        x = np.mean(echoed, axis=0)
        copies[active] = x
    return x


def fedstale(h, e, P, x0, steps, lr, beta, server_lr=1.0):
    """Rodio & Neglia, arXiv 2405.04171, Alg. 1: v = mean_A(Δ_i − β y_i) + β mean_all(y)."""
    n = h.shape[0]
    x = np.array(x0, np.float64)
    y = np.zeros((n, len(x)))
    for t in range(P.shape[0]):
        active = np.flatnonzero(P[t])
        if not len(active):
            continue
        deltas = {i: local_sgd(h, e, i, x, steps, lr)[0] - x for i in active}
        v = np.mean([deltas[i] - beta * y[i] for i in active], axis=0) + beta * y.mean(axis=0)
        x = x + server_lr * v
        for i in active:
            y[i] = deltas[i]
    return x


def debiased_fedavg(h, e, P, x0, steps, lr, estimate="share", server_lr=1.0):
    """Sun et al., ICLR 2025, Sec. 5: Δ_i / (N π̂_i), π̂ from the participation counts so far."""
    n = h.shape[0]
    x = np.array(x0, np.float64)
    seen = np.zeros(n)
    for t in range(P.shape[0]):
        active = np.flatnonzero(P[t])
        seen += P[t]
        if not len(active):
            continue
        u = np.zeros_like(x)
        for i in active:
            delta = local_sgd(h, e, i, x, steps, lr)[0] - x
            if estimate == "share":
                u += delta / (n * seen[i] / seen.sum()) / len(active)
            else:
                u += delta / (n * seen[i] / (t + 1))
        x = x + server_lr * u
    return x


def fedpbc_code(h, e, P, x0, steps, lr):
    """Port of the official FedPBC loop (``varying_pbc.py``, lr_global = 1): EVERY client trains its
    own copy every round, linked or not; the linked clients' copies are averaged and the mean
    replaces their copies; an empty round keeps the global model."""
    n = h.shape[0]
    w_global = np.array(x0, np.float64)
    w_local = np.tile(w_global, (n, 1))
    for t in range(P.shape[0]):
        for i in range(n):
            w_local[i] = local_sgd(h, e, i, w_local[i], steps, lr)[0]
        linked = np.flatnonzero(P[t])
        if len(linked):
            w_global = w_local[linked].mean(axis=0)
            w_local[linked] = w_global
    return w_global
