"""Flower's server optimizers (FedAdam, FedYogi, FedAdagrad, FedAvgM) as rules: their step is
Flower's, applied to the FedAvg average of the accepted replies, checked against hand-computed
Adam/Yogi/Adagrad/momentum updates (Reddi et al., ICLR 2021, Alg. 2; Hsu et al. 2019)."""

from __future__ import annotations

import numpy as np
import pytest
from replies import run_round

from strategies import build_strategy

UPDATES = [{0: np.array([0.2, -0.4, 0.1]), 1: np.array([0.0, -0.2, 0.3])},
           {0: np.array([-0.1, 0.1, 0.0]), 2: np.array([0.3, 0.1, 0.2])},
           {1: np.array([0.05, 0.0, -0.3])}]


def by_hand(kind: str, eta: float, b1: float = 0.9, b2: float = 0.99, tau: float = 1e-3, momentum: float = 0.0):
    """x over three rounds of equally weighted FedAvg averages fed to the optimizer."""
    x, m, v, buf = np.zeros(3), np.zeros(3), np.zeros(3), None
    out = []
    for t, ups in enumerate(UPDATES, start=1):
        d = np.mean(list(ups.values()), axis=0)
        if kind == "fedavgm":
            buf = d if buf is None or momentum == 0 else momentum * buf + d
            x = x + eta * buf
        else:
            m = b1 * m + (1 - b1) * d
            if kind == "fedadam":
                v = b2 * v + (1 - b2) * d**2
                x = x + eta * np.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1)) * m / (np.sqrt(v) + tau)
            elif kind == "fedyogi":
                v = v - (1 - b2) * d**2 * np.sign(v - d**2)
                x = x + eta * m / (np.sqrt(v) + tau)
            else:  # fedadagrad
                v = v + d**2
                x = x + eta * m / (np.sqrt(v) + tau)
        out.append(x.copy())
    return out


@pytest.mark.parametrize("spec, kind, kw", [
    ("fedadam:eta=0.05", "fedadam", {"eta": 0.05}),
    ("fedyogi:eta=0.02,beta-1=0.8", "fedyogi", {"eta": 0.02, "b1": 0.8}),
    ("fedadagrad:eta=0.1,tau=0.01", "fedadagrad", {"eta": 0.1, "tau": 0.01, "b1": 0.0}),  # Flower: no momentum
    ("fedavgm:server-momentum=0.9,server-learning-rate=0.5", "fedavgm", {"eta": 0.5, "momentum": 0.9}),
])
def test_the_server_step_is_flowers_optimizer_on_the_fedavg_average(spec, kind, kw):
    rule = build_strategy(spec, num_clients=3, weighting="equal")
    x = np.zeros(3, np.float32)
    for rnd, (ups, want) in enumerate(zip(UPDATES, by_hand(kind, **kw), strict=True), start=1):
        x = run_round(rule, rnd, x, ups)
        assert np.allclose(x, want, rtol=1e-4, atol=1e-6), (rnd, x, want)


def test_server_lr_is_refused_where_the_optimizer_has_its_own_step():
    with pytest.raises(ValueError, match="set 'fedadam:eta=...'"):
        build_strategy("fedadam", num_clients=3, server_lr=0.5)
    with pytest.raises(ValueError, match="server-learning-rate"):
        build_strategy("fedavgm", num_clients=3, server_lr=2.0)


def test_the_moments_are_the_rules_state_and_resume_bit_identically():
    a = build_strategy("fedadam:eta=0.05", num_clients=3, weighting="equal")
    x = run_round(a, 1, np.zeros(3, np.float32), UPDATES[0])
    saved = a.state_dict()
    b = build_strategy("fedadam:eta=0.05", num_clients=3, weighting="equal")
    b.load_state_dict(saved)
    assert np.array_equal(run_round(a, 2, x, UPDATES[1]), run_round(b, 2, x, UPDATES[1]))
    fresh = build_strategy("fedadam:eta=0.05", num_clients=3, weighting="equal")
    assert not np.array_equal(run_round(fresh, 2, x, UPDATES[1]), run_round(a, 3, x, UPDATES[1]))
