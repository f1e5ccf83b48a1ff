"""Local training of a whole cohort at once: the clients' parameters stacked, one batched step.

:class:`CohortTrainer` runs, for every client of a round, exactly the local steps of
:meth:`~workloads.workload.Workload.train_client` (the same mini-batches, learning rate, solver
and dropout masks) on the clients' stacked parameters, in chunks that fit a memory budget: on a
GPU as ``torch.func.vmap(functional_call)`` with autograd through it, on a CPU each client's own
forward and backward pass on its rows. Clients are grouped by mini-batch size (a
client with fewer examples than the batch uses all of them, as per client); clients with fewer
local steps than others stop updating (the update is applied to the rows of the clients
with steps left). The update is :func:`workloads.solvers.solver_step`, the function the
per-client engine calls, on the stacked tensors; the loss is :func:`~workloads.solvers.batch_loss`.
On a GPU, results equal the per-client ones up to float reassociation in the vmapped forward and
backward pass (batched matrix products, grouped convolutions): where training is chaotic (a ReLU
that flips on one example, then momentum and a large step amplifying it) that is as large as a
1e-7 perturbation of the start gives the per-client engine itself; see
``benchmarks/engine_agreement.py``. On a CPU they are equal bit for bit.

:func:`cohort_unsupported` says why a workload cannot be batched (then the engine trains it per
client and says so); a dry vmapped step catches what it does not know. :func:`prefers_cohort`
is ``engine = auto``'s choice, from what the model is (or declares), never from its name;
:func:`batched_kernels` says which pass a device runs. Both engines train in exact float32 on a
GPU (:func:`workloads.precision.exact_float32`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from torch.func import functional_call, vmap

from .precision import exact_float32
from .solvers import LocalResult, SolverConfig, a_norm, batch_loss, solver_memory, solver_step

if TYPE_CHECKING:
    from .workload import Workload

StateDict = dict[str, torch.Tensor]
CPU_BUDGET = 1 << 30  # bytes a chunk of clients may take on the CPU
CPU_MAX_CHUNK = 32  # ... and at most this many clients: smaller working sets stay in cache (measured, noisy)
GPU_FRACTION = 0.5  # ... and this fraction of the free GPU memory


class MaskedDropout(nn.Module):
    """Dropout whose keep-mask is given (a buffer set per call): the cohort's copy of ``nn.Dropout``.

    The masks are drawn per client from the client's own seeded generator, in the order the
    per-client path draws them (every dropout layer of a forward pass, step after step); on the CPU
    ``torch.empty(shape).bernoulli_(1 - p, generator)`` is exactly what ``nn.Dropout`` draws.
    """

    mask: torch.Tensor  # the buffer registered below

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.register_buffer("mask", torch.ones(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask * (1.0 / (1.0 - self.p))


def cohort_unsupported(model: nn.Module) -> str | None:
    """Why this model cannot be trained as a cohort, or None."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            return f"layer '{name}' ({type(m).__name__}) updates running statistics in training"
        if isinstance(m, nn.modules.dropout._DropoutNd) and type(m) is not nn.Dropout:
            return f"layer '{name}' ({type(m).__name__}) draws masks the cohort engine does not reproduce"
    return None


def prefers_cohort(model: nn.Module) -> tuple[bool, str]:
    """Whether ``engine = auto`` should train ``model`` as a cohort, and why: by what the model is
    (or declares), never by its name.

    A model may declare it (attribute ``prefers_cohort = True/False``); otherwise the cohort, the
    faster engine on every machine (``benchmarks/engine_speed.py``): on a GPU batching the clients
    is the lever; on a CPU the cohort runs each client's pass with the per-client kernels
    (:func:`batched_kernels`: the per-client engine's numbers bit for bit) and saves the
    ClientApp's per-message training path. Whether the cohort engine *can* train it is decided
    afterwards by :class:`CohortTrainer`'s dry vmapped step.
    """
    declared = getattr(model, "prefers_cohort", None)
    if declared is not None:
        return bool(declared), f"the model declares prefers_cohort={bool(declared)}"
    return True, ("the cohort wherever it can train the run, the faster engine on every machine: on a GPU "
                  "one vmapped pass, on a CPU each client's pass with the per-client kernels (the same numbers "
                  "bit for bit)")


def batched_kernels(device: torch.device) -> bool:
    """Whether the cohort engine runs one vmapped forward and backward pass per chunk on
    ``device`` (a GPU), or each client's own pass with the per-client engine's kernels (a CPU).

    On a CPU the vmapped pass sums in another order than the per-client one: a vmapped
    convolution is one grouped convolution (its weight gradient, a sum over batch x height x
    width, ~1e-6 relative apart per step on CIFAR-10's first layer) and a vmapped linear layer a
    batched product (~1e-6 apart forward). That is ten times the 1e-7 start move that measures a
    config's own sensitivity, so where a ReLU or a max-pool is within rounding of flipping the
    engines take different sides (issue 49: the CIFAR-10 ``cnn`` at lr 0.05, one client of ten
    1.8e-3 apart after a flip at step 18, the round's model 2.9e-4 against its own 7.3e-7). With
    the per-client kernels the engines are bit-identical on a CPU, and no slower there (one
    client's pass already keeps a core busy; ``benchmarks/engine_speed.py``). On a GPU batching is
    the lever, and the vmapped pass agrees within the config's own sensitivity in exact float32.
    """
    return device.type != "cpu"


class CohortTrainer:
    """The vmapped local training of one workload (build once, call per round)."""

    def __init__(self, wl: Workload) -> None:
        self.wl = wl
        base = wl.new_model()
        if (why := cohort_unsupported(base)) is not None:
            raise ValueError(why)
        self.model = copy.deepcopy(base)
        self.dropouts: list[str] = []
        for name, m in list(self.model.named_modules()):
            if isinstance(m, nn.Dropout) and m.p > 0:
                parent, _, leaf = name.rpartition(".")
                self.model.get_submodule(parent).register_module(leaf, MaskedDropout(m.p))
                self.dropouts.append(f"{name}.mask")
        self.model.to(wl.device).train()
        self.param_names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        self.regression = bool(getattr(base, "is_regression", False))
        self.x = wl.train.x.to(wl.device)  # the data, resident on the device once
        self.y = wl.train.y.to(wl.device)
        self._mask_shapes: dict[int, list[tuple[int, ...]]] = {}
        self._chunks: dict[tuple[int, bool, bool], int] = {}
        self._losses = vmap(self._loss, in_dims=(0, 0, 0, 0), randomness="error")
        #: One vmapped pass for the whole chunk (a GPU), or each client's own forward and backward
        #: pass, the per-client engine's kernels, on its rows of the stacks (a CPU: see
        #: :func:`batched_kernels`); the solver step is batched either way.
        self.batched = batched_kernels(wl.device)
        self._dry_run()

    def _dry_run(self) -> None:
        """One vmapped step on two copies of the initial model: raises what vmap cannot batch."""
        state = {k: v.detach() for k, v in self.model.state_dict().items() if k not in self.dropouts}
        params = {k: torch.stack([state[k]] * 2) for k in self.param_names}
        others = {k: torch.stack([v] * 2) for k, v in state.items() if k not in params}
        batch = min(2, len(self.x))
        for name, shape in zip(self.dropouts, self.mask_shapes(batch), strict=True):
            others[name] = torch.ones((2, *shape), device=self.x.device)
        idx = torch.zeros((2, batch), dtype=torch.long, device=self.x.device)
        self._vmapped_step(params, others, self.x[idx], self.y[idx])  # on every device: one verdict

    def _step(self, params: StateDict, others: StateDict, x: torch.Tensor,
              y: torch.Tensor) -> tuple[StateDict, torch.Tensor]:
        """Every client's loss gradient and loss, stacked (see :attr:`batched`)."""
        if self.batched:
            return self._vmapped_step(params, others, x, y)
        return self._each_step(params, others, x, y)

    def _each_step(self, params: StateDict, others: StateDict, x: torch.Tensor,
                   y: torch.Tensor) -> tuple[StateDict, torch.Tensor]:
        """Client after client, the per-client engine's forward and backward pass (the same
        operations on the same tensors: bit for bit its gradients and losses), on views of the
        client's rows; the gradients stacked for the batched solver step."""
        names, per_client, losses = list(params), [], []
        for c in range(x.shape[0]):
            leaves = [params[k][c].detach().requires_grad_() for k in names]
            state = {**dict(zip(names, leaves, strict=True)), **{k: v[c] for k, v in others.items()}}
            loss = self._loss(state, {}, x[c], y[c])
            per_client.append(torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True))
            losses.append(loss.detach())
        grads = {k: torch.stack(gs) for k, gs in zip(names, zip(*per_client, strict=True), strict=True)}
        return grads, torch.stack(losses)

    def _vmapped_step(self, params: StateDict, others: StateDict, x: torch.Tensor,
                      y: torch.Tensor) -> tuple[StateDict, torch.Tensor]:
        """Every client's loss gradient and loss: the vmapped forward pass (batched matmuls and
        convolutions), then autograd through it; the sum's gradient with respect to client c's
        parameters is client c's own (the clients share nothing). On a CPU this is about twice as
        fast as ``vmap(grad(...))``."""
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        losses = self._losses(leaves, others, x, y)
        grads = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True, materialize_grads=True)
        return dict(zip(leaves, grads, strict=True)), losses.detach()

    # -- the per-client loss, vmapped over clients --------------------------------------------
    def _loss(self, params: StateDict, others: StateDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.model, {**params, **others}, (x,))
        return batch_loss(out, y, self.regression)

    def mask_shapes(self, batch: int) -> list[tuple[int, ...]]:
        """The input shape of every dropout layer for a mini-batch of ``batch`` (forward order)."""
        if batch not in self._mask_shapes:
            shapes: list[tuple[int, ...]] = []
            hooks = [self.model.get_submodule(n.rsplit(".", 1)[0]).register_forward_pre_hook(
                lambda _m, args: shapes.append(tuple(args[0].shape))) for n in self.dropouts]
            try:
                with torch.no_grad():
                    self.model(self.x[:batch])
            finally:
                for h in hooks:
                    h.remove()
            self._mask_shapes[batch] = shapes
        return self._mask_shapes[batch]

    def chunk_size(self, batch: int, momentum: bool, prox: bool) -> int:
        """How many clients one vmapped step takes within the memory budget."""
        key = (batch, momentum, prox)
        if key not in self._chunks:
            self._chunks[key] = self._chunk_size(batch, momentum, prox)
        return self._chunks[key]

    def _chunk_size(self, batch: int, momentum: bool, prox: bool) -> int:
        n_params = sum(p.numel() for p in self.model.parameters())
        sizes: list[int] = []
        leaves = [m for m in self.model.modules() if not list(m.children())]
        hooks = [m.register_forward_hook(lambda _m, _i, o: sizes.append(o.numel())) for m in leaves]
        try:
            with torch.no_grad():
                self.model(self.x[:1])
        finally:
            for h in hooks:
                h.remove()
        acts = sum(sizes) or self.x[0].numel() * 8
        per_client = 4 * (n_params * (4 + momentum + prox) + 3 * batch * (acts + self.x[0].numel()))
        dev = self.wl.device
        if dev.type == "cuda":
            return max(1, int(GPU_FRACTION * torch.cuda.mem_get_info(dev)[0] // per_client))
        return max(1, min(CPU_MAX_CHUNK, int(CPU_BUDGET // per_client)))

    # -- one round ----------------------------------------------------------------------------
    def train(self, clients: list[int], starts: list[StateDict], rnd: int,
              steps: list[int] | None = None) -> list[tuple[StateDict, LocalResult]]:
        """Every client's local steps of 0-based round ``rnd`` from its start state dict (``steps``:
        each client's step count, a straggler's budget; default the workload's ``steps_for``)."""
        steps = list(steps) if steps is not None else [self.wl.steps_for(c, rnd) for c in clients]
        wl = self.wl
        solver = SolverConfig(**{**wl.solver.__dict__, "lr": wl.lr_at(rnd)})
        out: dict[int, tuple[StateDict, LocalResult]] = {}
        by_batch: dict[int, list[int]] = {}
        for i, c in enumerate(clients):
            by_batch.setdefault(wl.batch_size_of(c), []).append(i)
        momentum = solver.kind == "momentum" and solver.momentum > 0
        prox = solver.kind == "prox" and solver.mu > 0
        for batch, members in by_batch.items():
            size = self.chunk_size(batch, momentum, prox)
            for lo in range(0, len(members), size):
                chunk = members[lo:lo + size]
                with exact_float32(wl.device):  # the per-client engine's arithmetic (no TF32 on a GPU)
                    results = self._train_chunk([clients[i] for i in chunk], [starts[i] for i in chunk],
                                                rnd, batch, solver, [steps[i] for i in chunk])
                out.update(zip(chunk, results, strict=True))
        return [out[i] for i in range(len(clients))]

    def _train_chunk(self, clients: list[int], starts: list[StateDict], rnd: int, batch: int,
                     solver: SolverConfig, steps: list[int]) -> list[tuple[StateDict, LocalResult]]:
        wl, dev, n = self.wl, self.wl.device, len(clients)
        params = {k: torch.stack([s[k] for s in starts]).to(dev, torch.float32) for k in self.param_names}
        others = {k: torch.stack([s[k] for s in starts]).to(dev) for k in starts[0] if k not in params}
        longest, shortest = max(steps), min(steps)
        active_at = torch.tensor([[k < s for s in steps] for k in range(longest)], device=dev)
        batches = [wl.batch_indices(c, rnd) for c in clients]
        gens = [torch.Generator().manual_seed(wl.dropout_seed(c, rnd)) for c in clients] if self.dropouts else []
        shapes = self.mask_shapes(batch) if self.dropouts else []
        names = list(params)
        rows = list(params.values())
        bufs, x0 = solver_memory(rows, solver)
        loss_sum = torch.zeros(n, device=dev)
        idle = torch.zeros(batch, dtype=torch.long)
        every_idx = torch.stack([torch.stack([next(b) if k < s else idle for b, s in zip(batches, steps, strict=True)])
                                 for k in range(longest)]).to(dev)  # (steps, clients, batch): one copy
        for k in range(longest):
            idx = every_idx[k]
            for name, shape in zip(self.dropouts, shapes, strict=True):
                others[name] = torch.stack([
                    torch.empty(shape).bernoulli_(1 - self._p(name), generator=g) if k < s else torch.ones(shape)
                    for g, s in zip(gens, steps, strict=True)]).to(dev)
            grads, loss = self._step(params, others, self.x[idx], self.y[idx])
            g_rows = [grads[key] for key in names]
            if k < shortest:  # every client steps: in place on the stacks
                solver_step(rows, g_rows, solver, bufs, x0)
                loss_sum += loss
                continue
            live = active_at[k].nonzero().squeeze(1)  # the clients with steps left: their rows only
            sub = [[t[live] for t in ts] for ts in (rows, g_rows, bufs, x0)]
            solver_step(sub[0], sub[1], solver, sub[2], sub[3])
            with torch.no_grad():
                for ts, new in ((rows, sub[0]), (bufs, sub[2])):
                    for t, v in zip(ts, new, strict=True):
                        t[live] = v
                loss_sum[live] += loss[live]
        losses = loss_sum.cpu().tolist()
        out = []
        for i, s in enumerate(steps):
            trained = {k: (params[k][i] if k in params else starts[i][k]).detach().to("cpu", copy=True)
                       for k in starts[i]}
            result = LocalResult(num_steps=s, a_norm=a_norm(solver.kind, s, solver.lr, solver.momentum, solver.mu),
                                 train_loss=losses[i] / s)
            out.append((trained, result))
        return out

    def _p(self, mask_name: str) -> float:
        return cast(float, self.model.get_submodule(mask_name.rsplit(".", 1)[0]).p)

