"""Local solvers against FedNova's ‖a‖_1 and hand-rolled recurrences; schedules; step counts."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from availability.spec import SpecError
from workloads.models import build_model
from workloads.solvers import (
    LocalResult,
    SolverConfig,
    a_norm,
    local_steps,
    local_train,
    lr_at,
)

DIM = 5


def quad_setup(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(DIM, generator=g, dtype=torch.float64)
    e = torch.randn(DIM, generator=g, dtype=torch.float64)
    model = build_model("quadratic", (DIM,), 1).double()
    with torch.no_grad():
        model.x.copy_(x0)
    counter = itertools.count()

    def batches():
        for _ in counter:
            yield e[None], torch.zeros(1)

    return model, x0, e, batches(), counter


# ---------------------------------------------------------------- a_norm closed forms
@pytest.mark.parametrize("tau", [1, 2, 7, 40])
def test_a_norm_closed_forms(tau):
    assert a_norm("sgd", tau, 0.1) == tau
    rho, lr, mu = 0.9, 0.05, 0.3
    assert a_norm("momentum", tau, lr, momentum=rho) == pytest.approx(
        (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)
    )
    # brute force: coefficient of g_j is sum_{k=j..tau} rho^{k-j}
    assert a_norm("momentum", tau, lr, momentum=rho) == pytest.approx(
        sum(sum(rho ** (k - j) for k in range(j, tau + 1)) for j in range(1, tau + 1))
    )
    assert a_norm("prox", tau, lr, mu=mu) == pytest.approx(
        (1 - (1 - lr * mu) ** tau) / (lr * mu)
    )
    # limits: rho = 0 and mu = 0 reduce to plain SGD's tau
    assert a_norm("momentum", tau, lr, momentum=0.0) == tau
    assert a_norm("prox", tau, lr, mu=0.0) == tau
    assert a_norm("prox", tau, lr, mu=1e-12) == pytest.approx(tau, rel=1e-9)
    assert (
        a_norm("prox", tau, 1.0, mu=1.0) == 1.0
    )  # (1 − ημ) = 0: only the last gradient counts
    assert a_norm("momentum", 1, lr, momentum=rho) == pytest.approx(1.0)


def test_a_norm_validation():
    with pytest.raises(ValueError, match="steps"):
        a_norm("sgd", 0, 0.1)
    with pytest.raises(ValueError, match="momentum must be in \\[0, 1\\)"):
        a_norm("momentum", 3, 0.1, momentum=1.0)
    with pytest.raises(ValueError, match="mu must be"):
        a_norm("prox", 3, 0.1, mu=-1.0)
    with pytest.raises(ValueError, match="lr must be"):
        a_norm("sgd", 3, 0.0)
    with pytest.raises(ValueError, match="unknown solver kind 'adam'"):
        a_norm("adam", 3, 0.1)


# ---------------------------------------------------------------- empirical checks on F = ½‖x − e‖²
@pytest.mark.parametrize("tau", [1, 5, 13])
def test_sgd_quadratic_closed_form(tau):
    lr = 0.1
    model, x0, e, batches, counter = quad_setup()
    res = local_train(model, batches, tau, SolverConfig(kind="sgd", lr=lr))
    assert isinstance(res, LocalResult) and res.num_steps == tau and res.a_norm == tau
    assert next(counter) == tau  # exactly tau batches pulled
    assert torch.allclose(model.x.detach() - e, (1 - lr) ** tau * (x0 - e), atol=1e-12)
    # mean of the per-step losses ½(1−η)^{2k}‖x0 − e‖², k = 0..tau−1
    d2 = float((x0 - e).pow(2).sum())
    expected = sum(0.5 * (1 - lr) ** (2 * k) * d2 for k in range(tau)) / tau
    assert res.train_loss == pytest.approx(expected)


def hand_rolled(kind, x0, e, tau, lr, rho=0.0, mu=0.0):
    """Heavy-ball / FedProx recurrences with exact gradients; returns x_tau and the g_k used."""
    x, v, grads = x0.clone(), torch.zeros_like(x0), []
    for _ in range(tau):
        g = x - e
        grads.append(g)
        if kind == "momentum":
            v = rho * v + g
            x = x - lr * v
        else:
            x = x - lr * (g + mu * (x - x0))
    return x, grads


@pytest.mark.parametrize("tau", [1, 4, 11])
def test_momentum_matches_recurrence_and_fednova_coefficients(tau):
    lr, rho = 0.1, 0.8
    model, x0, e, batches, _ = quad_setup(1)
    res = local_train(
        model, batches, tau, SolverConfig(kind="momentum", lr=lr, momentum=rho)
    )
    x_ref, grads = hand_rolled("momentum", x0, e, tau, lr, rho=rho)
    assert torch.allclose(model.x.detach(), x_ref, atol=1e-12)
    # FedNova: x0 − x_tau = lr Σ_k a_k g_k, a_k = (1 − rho^{tau−k+1})/(1 − rho), ‖a‖_1 = a_norm
    a = [(1 - rho ** (tau - k + 1)) / (1 - rho) for k in range(1, tau + 1)]
    assert torch.allclose(
        x0 - x_ref, lr * sum(ak * g for ak, g in zip(a, grads, strict=False)), atol=1e-12
    )
    assert res.a_norm == pytest.approx(sum(a))
    assert res.num_steps == tau


@pytest.mark.parametrize("tau", [1, 4, 11])
def test_prox_matches_recurrence_and_fednova_coefficients(tau):
    lr, mu = 0.1, 0.5
    model, x0, e, batches, _ = quad_setup(2)
    res = local_train(model, batches, tau, SolverConfig(kind="prox", lr=lr, mu=mu))
    x_ref, grads = hand_rolled("prox", x0, e, tau, lr, mu=mu)
    assert torch.allclose(model.x.detach(), x_ref, atol=1e-12)
    # FedNova: a_k = (1 − lr mu)^{tau−k}; closed form here: x_tau − e = (1−η−ημ)^τ(x0−e) + ...
    a = [(1 - lr * mu) ** (tau - k) for k in range(1, tau + 1)]
    assert torch.allclose(
        x0 - x_ref, lr * sum(ak * g for ak, g in zip(a, grads, strict=False)), atol=1e-12
    )
    assert res.a_norm == pytest.approx(sum(a))
    # fixed point of the prox recurrence is (e + mu x0)/(1 + mu): check it is approached
    model2, x0, e, batches, _ = quad_setup(2)
    local_train(model2, batches, 400, SolverConfig(kind="prox", lr=lr, mu=mu))
    assert torch.allclose(model2.x.detach(), (e + mu * x0) / (1 + mu), atol=1e-9)


def test_momentum_and_mu_ignored_by_sgd():
    model, x0, e, batches, _ = quad_setup(3)
    res = local_train(
        model, batches, 3, SolverConfig(kind="sgd", lr=0.2, momentum=0.9, mu=1.0)
    )
    assert torch.allclose(model.x.detach() - e, 0.8**3 * (x0 - e), atol=1e-12)
    assert res.a_norm == 3


def test_gradient_clipping():
    model, x0, e, batches, _ = quad_setup(4)
    local_train(model, batches, 1, SolverConfig(lr=0.1, max_grad_norm=1e-3))
    step = model.x.detach() - x0
    assert float(step.norm()) == pytest.approx(0.1 * 1e-3, rel=1e-5)
    assert torch.allclose(step / step.norm(), -(x0 - e) / (x0 - e).norm(), atol=1e-9)


def test_classifier_training_decreases_loss_and_counts_steps():
    torch.manual_seed(0)
    model = build_model("logreg", (1, 8, 8), 3)
    x = torch.randn(32, 1, 8, 8)
    y = torch.randint(0, 3, (32,))
    pulls = itertools.count()

    def batches():
        for _ in pulls:
            yield x, y

    first = local_train(model, batches(), 1, SolverConfig(lr=0.5))
    later = local_train(
        model, batches(), 30, SolverConfig(kind="momentum", lr=0.5, momentum=0.5)
    )
    assert next(pulls) == 31
    assert later.num_steps == 30 and later.train_loss < first.train_loss


def test_local_train_errors():
    model, _, _, _, _ = quad_setup()
    with pytest.raises(ValueError, match="ran out after 2 of 5"):
        local_train(
            model, iter([(torch.zeros(1, DIM), torch.zeros(1))] * 2), 5, SolverConfig()
        )
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        local_train(model, iter([]), 0, SolverConfig())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0.0}, "lr must be"),
        ({"lr": -1.0}, "lr must be"),
        ({"kind": "momentum", "momentum": 1.0}, r"momentum must be in \[0, 1\)"),
        ({"momentum": -0.1}, r"momentum must be in \[0, 1\)"),
        ({"mu": -0.5}, "mu must be"),
        ({"kind": "adam"}, "unknown solver kind"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ],
)
def test_solver_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SolverConfig(**kwargs)


# ---------------------------------------------------------------- learning-rate schedules
def test_lr_schedules():
    assert lr_at("constant", 0.05, 1234) == 0.05
    assert lr_at("inv-sqrt:every=10", 0.1, 0) == pytest.approx(0.1)
    assert lr_at("inv-sqrt:every=10", 0.1, 30) == pytest.approx(0.1 / 2)
    assert lr_at("inv-sqrt:every=10", 0.1, 5) == pytest.approx(0.1 / math.sqrt(1.5))
    assert lr_at("inv-sqrt", 0.1, 1990) == pytest.approx(0.1 / math.sqrt(200))
    assert lr_at("step:gamma=0.1,every=100", 1.0, 99) == pytest.approx(1.0)
    assert lr_at("step:gamma=0.1,every=100", 1.0, 100) == pytest.approx(0.1)
    assert lr_at("step:gamma=0.5,every=3", 1.0, 7) == pytest.approx(0.25)
    assert lr_at("exp:gamma=0.998", 0.1, 0) == pytest.approx(0.1)
    assert lr_at("exp:gamma=0.998", 0.1, 500) == pytest.approx(0.1 * 0.998**500)
    assert lr_at("exp", 0.1, 2) == pytest.approx(0.1 * 0.998**2)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("linear", "unknown lr schedule"),
        ("cosine", "needs rounds=T"),
        ("cosine:rounds=3", "reaches lr 0 at round 4"),
        ("cosine:rounds=5,floor=1.0", r"floor .* must be in \[0, 1\)"),
        ("constant:gamma=0.5", "unknown parameter"),
        ("exp:gamma=1.5", "gamma must be in"),
        ("step:every=0", "every must be"),
        ("step:every=2.5", "integer"),
        ("inv-sqrt:every=0", "every must be"),
    ],
)
def test_lr_schedule_errors(spec, match):
    with pytest.raises(SpecError, match=match):
        lr_at(spec, 0.1, 3)


# ---------------------------------------------------------------- local step counts
def test_local_steps_fixed():
    kw = {"client": 3, "rnd": 7, "seed": 0, "num_examples": 100, "batch_size": 32}
    assert local_steps("steps:n=10", **kw) == 10
    assert local_steps("steps:n=1", **kw) == 1
    assert local_steps("epochs:min=2,max=2", **kw) == 2 * 4
    assert local_steps("epochs:min=3", **kw) == 3 * 4
    assert local_steps("epochs:min=1,max=1", **{**kw, "num_examples": 64}) == 2


def test_local_steps_uniform_inclusive_and_deterministic():
    kw = {
        "seed": 5,
        "num_examples": 10,
        "batch_size": 4,
    }  # ceil(10/4) = 3 steps per epoch
    draws = [
        local_steps("epochs:min=2,max=5", client=c, rnd=r, **kw)
        for c in range(40)
        for r in range(10)
    ]
    epochs = {d // 3 for d in draws}
    assert all(d % 3 == 0 for d in draws)
    assert epochs == {2, 3, 4, 5}
    again = [
        local_steps("epochs:min=2,max=5", client=c, rnd=r, **kw)
        for c in range(40)
        for r in range(10)
    ]
    assert draws == again
    other_seed = [
        local_steps(
            "epochs:min=2,max=5", client=c, rnd=r, seed=6, num_examples=10, batch_size=4
        )
        for c in range(40)
        for r in range(10)
    ]
    assert draws != other_seed
    # varies over rounds for one client and over clients in one round
    assert (
        len(
            {
                local_steps("epochs:min=2,max=5", client=0, rnd=r, **kw)
                for r in range(30)
            }
        )
        > 1
    )
    assert (
        len(
            {
                local_steps("epochs:min=2,max=5", client=c, rnd=0, **kw)
                for c in range(30)
            }
        )
        > 1
    )


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("epochs:min=5,max=2", "min <= max"),
        ("epochs:min=0,max=2", "min <= max"),
        ("steps:n=0", "n must be"),
        ("steps:n=2.5", "integer"),
        ("rounds:n=3", "unknown local steps"),
        ("steps:m=3", "unknown parameter"),
    ],
)
def test_local_steps_errors(spec, match):
    with pytest.raises(SpecError, match=match):
        local_steps(spec, client=0, rnd=0, seed=0, num_examples=10, batch_size=2)
    with pytest.raises(ValueError, match="num_examples"):
        local_steps(
            "epochs:min=1", client=0, rnd=0, seed=0, num_examples=0, batch_size=2
        )
