"""Local solvers, FedNova's ‖a_i‖_1, learning-rate schedules and local-step counts.

- Solvers (``SolverConfig.kind``): ``sgd`` (plain SGD), ``momentum`` (heavy ball, buffer
  v <- rho v + g, x <- x - lr v; torch SGD with dampening 0, no Nesterov) and ``prox`` (FedProx,
  Li et al., MLSys 2020: the gradient of loss + (mu/2)||x - x0||^2, x0 the round's start weights).
- ``a_norm``: ‖a_i‖_1 of FedNova (Wang et al., NeurIPS 2020, Sec. 4 and App.), the sum of the
  coefficients with which the local gradients enter x0 - x_tau = lr * sum_k a_k g_k.
- A user's solver (``module:attr`` or entry point ``flchurn.solvers``): a :class:`LocalSolver`, the
  update written over a cohort's stacked tensors, so that both engines run it (docs/extending.md).
- ``lr_at``: ``constant``; ``inv-sqrt:every=10`` (eta0 / sqrt(t/every + 1), FedAWE: Xiang et al.,
  NeurIPS 2024); ``step:gamma=0.1,every=100``; ``exp:gamma=0.998`` (eta0 * gamma^t, FedExP code);
  ``cosine:rounds=T,floor=0`` (SGDR without restarts: Loshchilov & Hutter, ICLR 2017, Eq. 5); a
  user's ``schedule(t, base_lr, **params) -> float`` (``module:attr`` or entry point
  ``flchurn.lr_schedules``).
- ``local_steps``: ``steps:n=10`` or ``epochs:min=2,max=5`` (E ~ U{min..max} inclusive per
  (client, round), steps = E * ceil(n_examples / batch)); ``epochs:min=3`` means max = min.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from availability.spec import SpecError, parse_spec
from runconfig.extensions import entry_points

from .usersolvers import LocalSolver, user_schedule, user_solver

SOLVERS: tuple[str, ...] = ("sgd", "momentum", "prox")
LR_SCHEDULES: tuple[str, ...] = ("constant", "inv-sqrt", "step", "exp", "cosine")
LOCAL_STEPS: tuple[str, ...] = ("steps", "epochs")


def _check(kind: str, lr: float, momentum: float, mu: float) -> None:
    if kind not in SOLVERS and user_solver(kind, SOLVERS) is None:
        names = [*SOLVERS, *entry_points("solver")]
        raise ValueError(
            f"unknown solver kind {kind!r}; choose one of {', '.join(names)}, or your own as "
            "'module:Class[:key=value,...]' (a workloads.solvers.LocalSolver, docs/extending.md)"
        )
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0; got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1); got {momentum}")
    if not (math.isfinite(mu) and mu >= 0):
        raise ValueError(f"mu must be a finite number >= 0; got {mu}")


@dataclass(frozen=True)
class SolverConfig:
    """Local solver. ``momentum`` is read only by kind ``momentum``, ``mu`` only by ``prox``.

    ``weight_decay`` is torch's (adds wd*x to every gradient) and, as in the FedNova code, is
    not counted in ``a_norm``. ``max_grad_norm`` clips the loss gradient (before the prox term).
    """

    kind: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    mu: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        _check(self.kind, self.lr, self.momentum, self.mu)
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(
                f"weight_decay must be a finite number >= 0; got {self.weight_decay}"
            )
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(
                f"max_grad_norm must be None or > 0; got {self.max_grad_norm}"
            )


@dataclass(frozen=True)
class LocalResult:
    num_steps: int
    a_norm: float
    train_loss: float  # mean of the per-step mini-batch losses (without the prox term)


def a_norm(
    kind: str, steps: int, lr: float, momentum: float = 0.0, mu: float = 0.0
) -> float:
    """FedNova's ‖a_i‖_1 (Wang et al., NeurIPS 2020) for ``steps`` = tau local steps.

    sgd: tau; momentum rho: [tau - rho(1 - rho^tau)/(1 - rho)] / (1 - rho);
    prox mu: [1 - (1 - lr mu)^tau] / (lr mu) (tau when lr mu = 0).
    """
    _check(kind, lr, momentum, mu)
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1; got {steps}")
    tau = int(steps)
    if (user := user_solver(kind, SOLVERS) if kind not in SOLVERS else None) is not None:
        norm = getattr(user, "a_norm", None)  # a duck-typed solver may leave it out: plain SGD's tau
        return float(norm(tau, lr)) if norm is not None else float(tau)
    if kind == "momentum" and momentum > 0:
        rho = momentum
        return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)
    if kind == "prox" and lr * mu > 0:
        q = lr * mu  # expm1/log1p keep tiny q accurate (-> tau as q -> 0)
        return (-math.expm1(tau * math.log1p(-q)) if q < 1 else 1 - (1 - q) ** tau) / q
    return float(tau)


def batch_loss(out: torch.Tensor, y: torch.Tensor, regression: bool) -> torch.Tensor:
    """The training loss of one mini-batch: cross-entropy on logits, or the mean model output
    (``model.is_regression``). Both engines call this."""
    return out.mean() if regression else F.cross_entropy(out, y)


def solver_step(params: list[torch.Tensor], grads: list[torch.Tensor], solver: SolverConfig,
                bufs: list[torch.Tensor], x0: list[torch.Tensor]) -> None:
    """One local step of ``solver``, in place, on tensors whose first dimension indexes clients: a
    cohort's stacked parameters, or one client's as views with a leading 1. The one
    implementation of the local update, for both engines.

    Per client, in ``torch.optim.SGD``'s order: the loss gradient clipped by its global norm
    (``torch.nn.utils.clip_grad_norm_``: coefficient min(1, max / (norm + 1e-6))), plus FedProx's
    mu (x - x0), plus weight decay wd x, through heavy-ball momentum (v <- rho v + g, dampening 0;
    ``bufs`` start at zero), then x <- x - lr v. ``bufs`` is empty without momentum, ``x0`` (the
    round's start) empty without a prox term; ``grads`` are overwritten. A user's solver
    (:class:`LocalSolver`) gets the clipped gradient plus weight decay, and ``bufs`` is its state.
    """
    with torch.no_grad():
        if solver.max_grad_norm is not None:
            norms = torch.stack([torch.linalg.vector_norm(g.flatten(1), dim=1) for g in grads], dim=1)
            coef = torch.clamp(solver.max_grad_norm / (torch.linalg.vector_norm(norms, dim=1) + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
        if solver.kind not in SOLVERS:
            _user_step(user_solver(solver.kind, SOLVERS), params, grads, solver, bufs)
            return
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            if x0:
                g.add_(p - x0[i], alpha=solver.mu)
            if solver.weight_decay:
                g.add_(p, alpha=solver.weight_decay)
            if bufs:
                g = bufs[i].mul_(solver.momentum).add_(g)
            p.add_(g, alpha=-solver.lr)


def _user_step(user: LocalSolver | None, params: list[torch.Tensor], grads: list[torch.Tensor],
               solver: SolverConfig, state: list[torch.Tensor]) -> None:
    assert user is not None  # SolverConfig checked the kind
    if solver.weight_decay:
        for p, g in zip(params, grads, strict=True):
            g.add_(p, alpha=solver.weight_decay)
    if getattr(user, "batched", True) or params[0].shape[0] == 1:
        user.step(params, grads, state, solver.lr)
        return
    for c in range(params[0].shape[0]):  # one client at a time, on views of the stacks
        user.step([p[c:c + 1] for p in params], [g[c:c + 1] for g in grads], [s[c:c + 1] for s in state],
                  solver.lr)


def solver_memory(params: list[torch.Tensor], solver: SolverConfig) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(bufs, x0)`` for :func:`solver_step` at the start of local training: zero momentum
    buffers (momentum only) and a copy of the start (prox only); a user's solver: its
    :meth:`LocalSolver.init` state as ``bufs``."""
    if solver.kind not in SOLVERS:
        user = user_solver(solver.kind, SOLVERS)
        assert user is not None
        with torch.no_grad():
            state = list(user.init([p.detach() for p in params])) if hasattr(user, "init") else []
        bad = [i for i, t in enumerate(state) if not isinstance(t, torch.Tensor) or t.dim() < 1
               or t.shape[0] != params[0].shape[0]]
        if bad:
            raise ValueError(f"solver {solver.kind!r}: init() returned state {bad} without the leading client "
                             f"dimension ({params[0].shape[0]}): every state tensor has one row per client")
        return state, []
    momentum = solver.kind == "momentum" and solver.momentum > 0
    prox = solver.kind == "prox" and solver.mu > 0
    return ([torch.zeros_like(p) for p in params] if momentum else [],
            [p.detach().clone() for p in params] if prox else [])


def local_train(
    model: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    solver: SolverConfig,
    device: torch.device | str = "cpu",
    stop: Callable[[int], bool] | None = None,
) -> LocalResult:
    """Run ``steps`` optimizer steps (:func:`solver_step`) on batches pulled from ``batches``;
    fewer when ``stop(k)``, asked before step k + 1 for k >= 1, says True (a deployed straggler's
    deadline): the result's ``num_steps`` and ``a_norm`` are those of the steps done.

    Loss: :func:`batch_loss`. The model is put in train mode and moved to ``device``; it is
    updated in place.
    """
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [p.detach().unsqueeze(0) for p in params]  # views: the update writes the parameters
    bufs, x0 = solver_memory(rows, solver)
    regression = bool(getattr(model, "is_regression", False))
    total = torch.zeros((), device=device)
    done = 0
    for k in range(steps):
        if k and stop is not None and stop(k):
            break
        try:
            x, y = next(batches)
        except StopIteration:
            raise ValueError(
                f"batch iterator ran out after {k} of {steps} steps"
            ) from None
        loss = batch_loss(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True), regression)
        grads = torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)
        solver_step(rows, [g.unsqueeze(0) for g in grads], solver, bufs, x0)
        total += loss.detach()
        done = k + 1
    norm = a_norm(solver.kind, done, solver.lr, solver.momentum, solver.mu)
    return LocalResult(num_steps=done, a_norm=norm, train_loss=float(total) / max(done, 1))


def lr_at(spec: str, base_lr: float, t: int) -> float:
    """Local learning rate in round ``t`` (0-based) under schedule ``spec``, from ``base_lr``."""
    if t < 0:
        raise ValueError(f"round t must be >= 0; got {t}")
    if not base_lr > 0:
        raise ValueError(f"base_lr must be > 0; got {base_lr}")
    if (user := user_schedule(spec, LR_SCHEDULES)) is not None:
        lr = user(t, base_lr)
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr schedule {spec!r} gave {lr!r} in round {t + 1}; a learning rate is a finite "
                             "number > 0")
        return float(lr)
    s = parse_spec(spec)
    if s.name == "constant":
        s.take({}, what="lr schedule")
        return float(base_lr)
    if s.name == "inv-sqrt":
        every = s.take({"every": 10.0}, what="lr schedule")["every"]
        if not every > 0:
            raise SpecError(f"lr schedule 'inv-sqrt': every must be > 0; got {every}")
        return base_lr / math.sqrt(t / every + 1)
    if s.name == "step":
        p = s.take({"gamma": 0.1, "every": 100}, what="lr schedule")
        if not 0 < p["gamma"] <= 1:
            raise SpecError(
                f"lr schedule 'step': gamma must be in (0, 1]; got {p['gamma']}"
            )
        if p["every"] < 1:
            raise SpecError(
                f"lr schedule 'step': every must be an integer >= 1; got {p['every']}"
            )
        return base_lr * p["gamma"] ** (t // p["every"])
    if s.name == "exp":
        gamma = s.take({"gamma": 0.998}, what="lr schedule")["gamma"]
        if not 0 < gamma <= 1:
            raise SpecError(f"lr schedule 'exp': gamma must be in (0, 1]; got {gamma}")
        return base_lr * gamma**t
    if s.name == "cosine":
        return _cosine(s.take({"rounds": 0, "floor": 0.0}, what="lr schedule"), base_lr, t)
    raise SpecError(
        f"unknown lr schedule {s.name!r}; choose one of {', '.join([*LR_SCHEDULES, *entry_points('lr-schedule')])}, "
        "or your own as 'module:function[:key=value,...]' (docs/extending.md)"
    )


def _cosine(p: dict[str, Any], base_lr: float, t: int) -> float:
    """eta_min + (eta0 - eta_min)(1 + cos(pi t / T)) / 2, eta_min = floor * eta0 (SGDR, Eq. 5)."""
    rounds, floor = p["rounds"], p["floor"]
    if rounds < 1:
        raise SpecError("lr schedule 'cosine' needs rounds=T >= 1, the rounds it decays over (usually "
                        f"num-server-rounds); got {rounds}")
    if not 0 <= floor < 1:
        raise SpecError(f"lr schedule 'cosine': floor (the final fraction of lr) must be in [0, 1); got {floor}")
    if t >= rounds and floor == 0:
        raise SpecError(f"lr schedule 'cosine:rounds={rounds}' reaches lr 0 at round {rounds + 1}, which this "
                        f"run reaches: set rounds >= num-server-rounds, or floor > 0")
    low = floor * base_lr
    return low + (base_lr - low) * (1 + math.cos(math.pi * min(t, rounds) / rounds)) / 2


def local_steps(
    spec: str, *, client: int, rnd: int, seed: int, num_examples: int, batch_size: int
) -> int:
    """Number of local steps of ``client`` in round ``rnd``; a pure function of its arguments.

    ``epochs`` draws E ~ U{min..max} (inclusive, unlike ``randint(2, localE)`` in the FedNova
    code) from ``np.random.default_rng([seed, client, rnd])``.
    """
    s = parse_spec(spec)
    if s.name == "steps":
        n = s.take({"n": 10}, what="local steps")["n"]
        if n < 1:
            raise SpecError(f"local steps 'steps': n must be an integer >= 1; got {n}")
        return n
    if s.name != "epochs":
        raise SpecError(
            f"unknown local steps {s.name!r}; choose one of {', '.join(LOCAL_STEPS)}"
        )
    p = s.take({"min": 1, "max": 1}, what="local steps")
    lo, hi = p["min"], p["max"] if "max" in s.params else p["min"]
    if lo < 1 or hi < lo:
        raise SpecError(
            f"local steps 'epochs': need 1 <= min <= max; got min={lo}, max={hi}"
        )
    for what, v in (("client", client), ("rnd", rnd), ("seed", seed)):
        if v < 0:
            raise ValueError(f"{what} must be >= 0; got {v}")
    if num_examples < 1 or batch_size < 1:
        raise ValueError(
            f"num_examples and batch_size must be >= 1; got {num_examples}, {batch_size}"
        )
    epochs = (
        lo
        if lo == hi
        else int(np.random.default_rng([seed, client, rnd]).integers(lo, hi + 1))
    )
    return epochs * math.ceil(num_examples / batch_size)
