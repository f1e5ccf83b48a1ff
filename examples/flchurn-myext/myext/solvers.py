"""Recipe: a local solver. Adam (Kingma & Ba, ICLR 2015, Algorithm 1) as each client's local
optimiser, its moments started at zero every round, written once over a cohort's stacked tensors
(a leading client dimension) so that the per-client and the cohort engine both run it.

Reached as ``solver = "myext.solvers:Adam:beta2=0.99"``, or, installed, ``solver = "adam:beta2=0.99"``.
"""

from __future__ import annotations

import torch

from workloads.solvers import LocalSolver


class Adam(LocalSolver):
    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1 and eps > 0):
            raise ValueError(f"Adam needs 0 <= beta1, beta2 < 1 and eps > 0; got {beta1}, {beta2}, {eps}")
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def init(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        steps = torch.zeros(params[0].shape[0], dtype=torch.float64, device=params[0].device)  # t, per client
        return [steps, *(torch.zeros_like(p) for p in params), *(torch.zeros_like(p) for p in params)]

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: list[torch.Tensor],
             lr: float) -> None:
        t, first, second = state[0], state[1:1 + len(params)], state[1 + len(params):]
        t.add_(1)
        for p, g, m, v in zip(params, grads, first, second, strict=True):
            m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            rows = (-1,) + (1,) * (p.dim() - 1)  # one bias correction per client
            correct1 = (1 - self.beta1 ** t).to(p.dtype).view(rows)
            correct2 = (1 - self.beta2 ** t).sqrt().to(p.dtype).view(rows)
            p.sub_(lr * m / correct1 / (v.sqrt() / correct2 + self.eps))
