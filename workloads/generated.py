"""Generated datasets: no files, one seed, a given number of clients.

``groups`` = the client id of every example:

* ``synthetic``: Synthetic(alpha, beta) of Li et al. (FedProx, MLSys 2020, Sec. 5.1), following the
  authors' generator: u_k ~ N(0, alpha^2) (``alpha`` is used as the standard deviation, as in their
  code), W_k ~ N(u_k, 1), b_k ~ N(u_k, 1), B_k ~ N(0, beta^2), v_k ~ N(B_k, 1), x ~ N(v_k, Sigma)
  with Sigma_jj = j^-1.2, y = argmax(W x + b); n_k = int(lognormal(4, 2)) + 50 examples. The test set
  is a seeded ``test_fraction`` (default 0.2) of every client's examples, ``groups`` kept in both.
* ``quadratic``: client i holds one point e_i ~ N(0, spread^2 I_dim); ``x = e``, ``y = arange(N)``,
  ``groups = arange(N)``, test = train, ``num_classes = 0``. F_i(x) = 1/2 ||x - e_i||^2, x* = mean e_i.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .tensordata import DatasetError, TensorData


def synthetic(num_clients: int, seed: int, alpha: float = 1.0, beta: float = 1.0,
              iid: bool = False, dim: int = 60, classes: int = 10,
              test_fraction: float = 0.2) -> tuple[TensorData, TensorData]:
    if alpha < 0 or beta < 0 or dim < 1 or classes < 2 or not 0 <= test_fraction < 1:
        raise DatasetError(f"synthetic: bad parameters alpha={alpha}, beta={beta}, dim={dim}, "
                           f"classes={classes}, test_fraction={test_fraction}")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_clients).astype(int) + 50
    u = rng.normal(0, alpha, num_clients)
    big_b = rng.normal(0, beta, num_clients)
    sd = np.arange(1, dim + 1, dtype=np.float64) ** -0.6  # sqrt of Sigma_jj = j^-1.2
    w_glob, b_glob = rng.normal(0, 1, (dim, classes)), rng.normal(0, 1, classes)
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {"x": ([], []), "y": ([], []), "g": ([], [])}
    for k in range(num_clients):
        v = np.full(dim, big_b[k]) if iid else rng.normal(big_b[k], 1, dim)
        w, b = (w_glob, b_glob) if iid else (rng.normal(u[k], 1, (dim, classes)),
                                             rng.normal(u[k], 1, classes))
        x = v + rng.standard_normal((sizes[k], dim)) * sd
        y = np.argmax(x @ w + b, axis=1)
        n_test = int(round(test_fraction * sizes[k]))
        perm = rng.permutation(sizes[k])
        for j, idx in enumerate((perm[n_test:], perm[:n_test])):
            parts["x"][j].append(x[idx])
            parts["y"][j].append(y[idx])
            parts["g"][j].append(np.full(len(idx), k, np.int64))
    out = []
    for j in range(2):
        out.append(TensorData(
            torch.from_numpy(np.concatenate(parts["x"][j]).astype(np.float32)),
            torch.from_numpy(np.concatenate(parts["y"][j]).astype(np.int64)),
            classes, np.concatenate(parts["g"][j])))
    return out[0], out[1]


def quadratic(num_clients: int, seed: int, dim: int = 10,
              spread: float = 1.0) -> tuple[TensorData, TensorData]:
    if dim < 1 or spread < 0:
        raise DatasetError(f"quadratic: bad parameters dim={dim}, spread={spread}")
    e = np.random.default_rng(seed).normal(0.0, spread, (num_clients, dim)).astype(np.float32)
    data = TensorData(torch.from_numpy(e), torch.arange(num_clients, dtype=torch.int64), 0,
                      np.arange(num_clients))
    return data, data


#: name -> (generator, allowed parameters with defaults)
GENERATED: dict[str, tuple[Callable[..., tuple[TensorData, TensorData]], dict[str, Any]]] = {
    "synthetic": (synthetic, {"alpha": 1.0, "beta": 1.0, "iid": False, "dim": 60,
                               "classes": 10, "test_fraction": 0.2}),
    "quadratic": (quadratic, {"dim": 10, "spread": 1.0}),
}
