"""The one local update both engines run (``workloads.solvers.solver_step``).

It is torch's own SGD (momentum, dampening 0, weight decay) after ``clip_grad_norm_`` and
FedProx's gradient term, and stacking clients changes nothing: a cohort's rows step exactly as
each client alone.
"""

from __future__ import annotations

import pytest
import torch

from workloads.solvers import SolverConfig, solver_memory, solver_step

SHAPES = [(5, 3), (3,), (2, 2, 2)]
SOLVERS = [
    SolverConfig(kind="sgd", lr=0.1),
    SolverConfig(kind="momentum", lr=0.05, momentum=0.9, weight_decay=1e-2),
    SolverConfig(kind="prox", lr=0.1, mu=0.5, max_grad_norm=0.3),
    SolverConfig(kind="momentum", lr=0.2, momentum=0.5, max_grad_norm=0.05, weight_decay=1e-3),
]


def grads_for(step: int, client: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * client + step)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def start(client: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(client)
    return [torch.randn(s, generator=gen) for s in SHAPES]


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.kind)
def test_it_is_torch_sgd_after_clipping_and_the_prox_term(solver):
    ours = [p.unsqueeze(0).clone() for p in start(0)]
    bufs, x0 = solver_memory(ours, solver)
    theirs = [torch.nn.Parameter(p.clone()) for p in start(0)]
    first = [p.detach().clone() for p in theirs]
    opt = torch.optim.SGD(theirs, lr=solver.lr, weight_decay=solver.weight_decay,
                          momentum=solver.momentum if solver.kind == "momentum" else 0.0)
    for k in range(6):
        grads = grads_for(k, 0)
        solver_step(ours, [g.unsqueeze(0).clone() for g in grads], solver, bufs, x0)
        for p, g in zip(theirs, grads, strict=True):
            p.grad = g.clone()
        if solver.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(theirs, solver.max_grad_norm)
        if solver.kind == "prox":
            for p, p0 in zip(theirs, first, strict=True):
                p.grad.add_(p.detach() - p0, alpha=solver.mu)
        opt.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a[0], b.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("solver", SOLVERS, ids=lambda s: s.kind)
def test_a_stack_of_clients_steps_as_each_client_alone(solver):
    clients = range(3)
    stacked = [torch.stack(ps) for ps in zip(*(start(c) for c in clients), strict=True)]
    bufs, x0 = solver_memory(stacked, solver)
    alone = {c: [p.unsqueeze(0) for p in start(c)] for c in clients}
    memory = {c: solver_memory(alone[c], solver) for c in clients}
    for k in range(5):
        per_client = [grads_for(k, c) for c in clients]
        solver_step(stacked, [torch.stack(gs) for gs in zip(*per_client, strict=True)], solver, bufs, x0)
        for c in clients:
            solver_step(alone[c], [g.unsqueeze(0) for g in per_client[c]], solver, *memory[c])
    for c in clients:
        for rows, own in zip(stacked, alone[c], strict=True):
            torch.testing.assert_close(rows[c], own[0], rtol=1e-6, atol=1e-7)
