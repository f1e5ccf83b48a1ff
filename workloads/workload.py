"""A workload: dataset + partition + model + local training, rebuilt identically anywhere.

The server and every client build the same :class:`Workload` from the same
:class:`~runconfig.WorkloadConfig`; :func:`get_workload` caches it per process, so a
client's partition is built once per process, not once per round. All randomness is keyed by
the config's seeds and by (client, round), never by process state, so a client trained in a Ray
worker, a SuperNode or in-process gives the same update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import cast

import numpy as np
import torch
from torch import nn

from runconfig import ConfigError, WorkloadConfig, closest, config_key
from runconfig.extensions import ExtensionError, entry_points, resolve

from .data import DATASETS, TensorData, dataset_name, dataset_reference, load_dataset
from .extensions import user_evaluation
from .models import MODELS, build_model, model_params
from .partition import PARTITIONERS, cluster_of, label_distributions, partition, partitioner_reference
from .precision import exact_float32
from .solvers import (
    LOCAL_STEPS,
    LR_SCHEDULES,
    SOLVERS,
    LocalResult,
    SolverConfig,
    local_steps,
    local_train,
    lr_at,
)


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; anything else is taken as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"run config 'device' = {name!r}: {exc}") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"run config 'device' = {name!r} but CUDA is not available here")
    return device


def _seed_of(*keys: int) -> int:
    return int(np.random.default_rng(list(keys)).integers(2**62))


class Workload:
    def __init__(self, cfg: WorkloadConfig) -> None:
        cfg.validate()
        try:
            custom_data = dataset_reference(cfg.dataset) is not None
            self.dataset_name = dataset_name(cfg.dataset)
        except ValueError as exc:
            raise ConfigError(f"run config 'dataset' = {cfg.dataset!r}: {exc}") from exc
        if not custom_data and self.dataset_name not in DATASETS:
            near = closest(self.dataset_name, [*DATASETS, *entry_points("dataset")])
            raise ConfigError(f"run config 'dataset' = {cfg.dataset!r}; known: {list(DATASETS)}, "
                              "or the user's 'module:attr' (docs/extending.md)"
                              + (f" (did you mean '{near}'?)" if near else ""))
        with config_key("model", cfg.model, [*MODELS, *entry_points("model")]):
            model_params(cfg.model)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.train, self.test = load_dataset(
            cfg.dataset,
            cfg.data_dir or None,
            download=cfg.download,
            seed=cfg.data_seed,
            num_clients=cfg.num_clients,
        )
        labels = self.train.y.numpy()
        with config_key("partition", cfg.partition, [*PARTITIONERS, *entry_points("partitioner")]):
            features = self.train.x.numpy() if partitioner_reference(cfg.partition) is not None else None
            self.parts = partition(cfg.partition, labels, cfg.num_clients, cfg.data_seed, groups=self.train.groups,
                                   features=features)
        empty = [i for i, p in enumerate(self.parts) if len(p) == 0]
        if empty:
            raise ConfigError(
                f"partition {cfg.partition!r} left clients {empty[:10]} without data; "
                "use more data per client or a larger Dirichlet alpha / min_size"
            )
        self.num_classes = self.train.num_classes
        self.label_dists = (
            label_distributions(labels, self.parts, self.num_classes) if self.num_classes else None
        )
        self.clusters = cluster_of(cfg.partition, cfg.num_clients)
        with config_key("solver", cfg.solver, [*SOLVERS, *entry_points("solver")]):
            self.solver = SolverConfig(
                kind=cfg.solver, lr=cfg.lr, momentum=cfg.momentum, mu=cfg.prox_mu,
                weight_decay=cfg.weight_decay,
            )
        self._scratch: nn.Module | None = None
        # fail now, not in round 1: the model must take this input, the specs must parse
        self.new_model()
        with config_key("local-steps", cfg.local_steps, LOCAL_STEPS):
            self.steps_for(0, 0)
        with config_key("lr-schedule", cfg.lr_schedule, [*LR_SCHEDULES, *entry_points("lr-schedule")]):
            lr_at(cfg.lr_schedule, cfg.lr, 0)
        with config_key("evaluation", cfg.evaluation, entry_points("evaluation")):
            self.central = self._central_evaluation(cfg.evaluation)

    @staticmethod
    def _central_evaluation(spec: str) -> Callable[..., dict[str, float]] | None:
        """The run config's ``evaluation`` (the user's function; None when empty)."""
        if not spec:
            return None
        ref = resolve(spec, "evaluation")
        if ref is None:
            raise ExtensionError(f"no evaluation function {spec!r}: name one as 'module:function[:key=value,...]' "
                                 "or an installed flchurn.evaluations entry point (docs/extending.md)")
        return user_evaluation(ref)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.x.shape[1:])

    def new_model(self) -> nn.Module:
        """The initial global model: the same weights for the same train seed."""
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(self.cfg.train_seed)
            return build_model(self.cfg.model, self.input_shape, self.num_classes, dataset=self.dataset_name)

    def scratch_model(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """This process's one working model, loaded with ``state`` (every parameter and buffer):
        a message reuses it instead of building and initialising a new model."""
        if self._scratch is None:
            self._scratch = self.new_model()
        self._scratch.load_state_dict(state)
        return self._scratch

    def num_examples(self, client: int) -> int:
        return len(self.parts[client])

    def batch_size_of(self, client: int) -> int:
        """``client``'s mini-batch size: the run's, or all its examples when it has fewer."""
        return min(self.cfg.batch_size, self.num_examples(client))

    def batch_indices(self, client: int, rnd: int) -> Iterator[torch.Tensor]:
        """Endless shuffled mini-batches of ``client``'s data for round ``rnd`` (seeded), as row
        indices into ``self.train``: every engine draws exactly these."""
        idx = torch.as_tensor(self.parts[client])
        gen = torch.Generator().manual_seed(_seed_of(self.cfg.train_seed, client, rnd, 1))
        size = self.batch_size_of(client)
        while True:
            order = idx[torch.randperm(len(idx), generator=gen)]
            for start in range(0, len(order) - size + 1, size):
                yield order[start : start + size]

    def batches(self, client: int, rnd: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless shuffled mini-batches of ``client``'s data for round ``rnd`` (seeded)."""
        for take in self.batch_indices(client, rnd):
            yield self.train.x[take], self.train.y[take]

    def dropout_seed(self, client: int, rnd: int) -> int:
        """The seed of ``client``'s own randomness in training (dropout) in round ``rnd``."""
        return _seed_of(self.cfg.train_seed, client, rnd, 2)

    def lr_at(self, rnd: int) -> float:
        """The local learning rate of 0-based round ``rnd``."""
        return lr_at(self.cfg.lr_schedule, self.cfg.lr, rnd)

    def steps_for(self, client: int, rnd: int) -> int:
        return local_steps(
            self.cfg.local_steps, client=client, rnd=rnd, seed=self.cfg.train_seed,
            num_examples=self.num_examples(client), batch_size=self.cfg.batch_size,
        )

    def train_client(self, model: nn.Module, client: int, rnd: int, steps: int | None = None,
                     stop: Callable[[int], bool] | None = None) -> LocalResult:
        """Run ``client``'s local steps of round ``rnd`` (0-based) on ``model`` in place: ``steps``
        of them when given (a straggler's budget), else :meth:`steps_for`; ``stop``: see
        :func:`~workloads.solvers.local_train`."""
        solver = SolverConfig(**{**self.solver.__dict__, "lr": self.lr_at(rnd)})
        with torch.random.fork_rng(devices=[]), exact_float32(self.device):  # as the cohort engine
            torch.default_generator.manual_seed(self.dropout_seed(client, rnd))
            return local_train(
                model.to(self.device), self.batches(client, rnd),
                self.steps_for(client, rnd) if steps is None else steps, solver, device=self.device, stop=stop,
            )

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: TensorData | None = None, batch: int = 2048) -> dict[str, float]:
        """Mean loss and accuracy (classifiers) or distance to the optimum (quadratic); on the test
        set (``data`` None), also the run config's ``evaluation`` (its names replace these)."""
        scores = self._evaluate(model, self.test if data is None else data, batch)
        if data is None and self.central is not None:
            model.eval()
            scores.update(self.central(model, self.test, train=self.train, parts=self.parts,
                                       groups=self.train.groups, clusters=self.clusters,
                                       label_dists=self.label_dists, num_classes=self.num_classes,
                                       device=self.device))
        return scores

    def _evaluate(self, model: nn.Module, data: TensorData, batch: int) -> dict[str, float]:
        model = model.to(self.device).eval()
        if getattr(model, "is_regression", False):
            x = cast(torch.Tensor, model.x).detach().cpu()
            points = data.x
            loss = 0.5 * ((points - x) ** 2).sum(dim=1).mean().item()
            return {"loss": loss, "distance-to-optimum": (x - points.mean(0)).norm().item()}
        loss_sum, correct = 0.0, 0
        for start in range(0, len(data), batch):
            xb = data.x[start : start + batch].to(self.device)
            yb = data.y[start : start + batch].to(self.device)
            out = model(xb)
            loss_sum += nn.functional.cross_entropy(out, yb, reduction="sum").item()
            correct += (out.argmax(1) == yb).sum().item()
        n = max(len(data), 1)
        return {"loss": loss_sum / n, "accuracy": correct / n}

    def probe_data(self, client: int, rnd: int, num_batches: int) -> TensorData:
        """``num_batches`` of ``client``'s seeded mini-batches of round ``rnd``, as one set."""
        batches = self.batches(client, rnd)
        xs, ys = zip(*(next(batches) for _ in range(num_batches)), strict=True)
        return TensorData(torch.cat(xs), torch.cat(ys), self.num_classes)

    def client_data(self, client: int) -> TensorData:
        take = torch.as_tensor(self.parts[client])
        return TensorData(self.train.x[take], self.train.y[take], self.num_classes)


@functools.lru_cache(maxsize=2)
def get_workload(cfg: WorkloadConfig) -> Workload:
    """One Workload per config per process (the partition is built once)."""
    return Workload(cfg)
