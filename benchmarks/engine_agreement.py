"""How far the cohort engine ends from the per-client engine, beside how far the per-client engine
ends from itself when its start moves by 1e-7 (prints a table; never asserts).

Both engines run the same local update (:func:`workloads.solvers.solver_step`) on the same
mini-batches; where a config is chaotic, any float difference grows (a ReLU flips on one example,
a large step with momentum amplifies it). ``own`` measures that sensitivity: the per-client engine
against itself from a start perturbed by ``--shake`` (relative, seeded). ``engines`` is the cohort
engine against the per-client engine; ``ratio`` = engines / own (issue 37 asks for <= 10).
Difference = relative L2 norm of the difference of the final (aggregated) model, max over tensors.

Two ways to run the engines:

- ``--via runs`` (default): whole in-process runs (``run_inprocess``, the ServerApp loop, the
  ClientApp; ``fedavg-active``); any number of rounds.
- ``--via trainers``: round 1 only, the engines' own training without Flower
  (``Workload.train_client`` per client against ``CohortTrainer``), the round's model the FedAvg
  average by examples over every client (what ``fedavg-active`` makes of round 1 when every client
  is available). Also counts the clients past 10x their own sensitivity and whether the
  per-client engine rerun on one start is bit-identical. Needs no Flower (a GPU machine without it).

``--pytorch-defaults`` trains with PyTorch's default arithmetic on a GPU (TF32 convolutions, any
cuDNN algorithm: the code before issue 37) instead of :func:`workloads.precision.exact_float32`.
``--vmapped-cpu`` runs the cohort engine's vmapped pass on a CPU too (the code before issue 49;
since then a CPU runs each client's pass with the per-client kernels, bit-identical).

Suites:

- ``issue37`` (default): issue 37's table, CIFAR-10 (the shared JPEG-q75 copy), the ``cnn`` model,
  per-class Dirichlet 0.1 over ``--clients`` clients, every client available, round 1.
- ``issue28``: issue 28's configs (Fashion-MNIST, MLP, 100 clients, Dirichlet 0.1, ``bernoulli:p=0.15``).
- ``issue49``: issue 49's case (CIFAR-10 ``cnn``, 200 clients, per-class Dirichlet 0.1,
  ``bernoulli:p=0.04``, ``fedavg-active``, lr 0.05, 20 steps of 32); ``--clients`` does not apply.

    python -m benchmarks.engine_agreement                         # issue 37's four rows, round 1
    python -m benchmarks.engine_agreement --suite issue28 --rounds 1 4
    python -m benchmarks.engine_agreement --via trainers --device cuda [--pytorch-defaults]
    python -m benchmarks.engine_agreement --suite issue49 [--vmapped-cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from experiments.presets import DATA_DIR
from runconfig import WorkloadConfig, from_run_config
from runconfig.defaults import default_run_config
from workloads import vmapped, workload
from workloads.vmapped import CohortTrainer
from workloads.workload import Workload, get_workload

COMMON: dict[str, object] = {"checkpoint-every": 0, "eval-every": 0, "progress": False, "data-dir": DATA_DIR}
SUITES: dict[str, tuple[dict[str, object], dict[str, dict[str, object]]]] = {
    "issue37": ({"dataset": "cifar10", "model": "cnn", "partition": "dirichlet:alpha=0.1", "availability": "always"}, {
        "sgd-0.01": {"solver": "sgd", "lr": 0.01, "local-steps": "steps:n=5", "batch-size": 64},
        "sgd-0.05": {"solver": "sgd", "lr": 0.05, "local-steps": "steps:n=20", "batch-size": 32},
        "prox-0.1": {"solver": "prox", "prox-mu": 0.1, "local-steps": "epochs:min=1,max=2", "batch-size": 16},
        "momentum-0.9": {"solver": "momentum", "momentum": 0.9, "local-steps": "steps:n=20", "batch-size": 32},
    }),
    "issue28": ({"dataset": "fashion-mnist", "model": "mlp", "num-clients": 100, "partition": "dirichlet:alpha=0.1",
                 "availability": "bernoulli:p=0.15"}, {
        "steps200": {"local-steps": "steps:n=200"},
        "epochs1": {"local-steps": "epochs:min=1,max=1"},
        "momentum": {"local-steps": "epochs:min=1,max=2", "solver": "momentum", "momentum": 0.9},
    }),
    "issue49": ({"dataset": "cifar10", "model": "cnn", "num-clients": 200, "partition": "dirichlet:alpha=0.1",
                 "availability": "bernoulli:p=0.04", "strategy": "fedavg-active"}, {
        "sgd-0.05": {"lr": 0.05, "local-steps": "steps:n=20", "batch-size": 32},
    }),
}


def shaken(state: dict, shake: float) -> dict:
    """``state`` moved by ``shake`` (relative to each tensor's mean size, seeded)."""
    gen = torch.Generator().manual_seed(1)
    return {k: v + torch.randn(v.shape, generator=gen) * shake * max(v.abs().mean().item(), 1e-3)
            for k, v in state.items()}


@contextlib.contextmanager
def pytorch_defaults(device: torch.device) -> Iterator[None]:
    """In place of :func:`workloads.precision.exact_float32`: whatever PyTorch's settings are."""
    yield


def final(cfg: dict, engine: str, out: Path, shake: float = 0.0) -> dict:
    """The final model of one in-process run (its start moved by ``shake``, relative, seeded)."""
    from experiments.inprocess import run_inprocess  # Flower: only for whole runs

    new_model = Workload.new_model

    def shaken_model(self):
        model = new_model(self)
        model.load_state_dict(shaken(model.state_dict(), shake))
        return model

    if shake:
        Workload.new_model = shaken_model  # type: ignore[method-assign]
    try:
        run_dir = run_inprocess({**cfg, "engine": engine, "results-dir": str(out), "run-name": f"{engine}-{shake}"})
    finally:
        Workload.new_model = new_model  # type: ignore[method-assign]
        get_workload.cache_clear()
    return {k: v.double() for k, v in torch.load(run_dir / "final_model.pt").items()}


def relative(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item() for k in a)


def round_one(cfg: dict, shake: float) -> tuple[float, float, int, int, int]:
    """(engines, own, clients past 10x own, clients whose rerun differs, clients) of round 1 by the trainers."""
    wl = Workload(from_run_config(WorkloadConfig, {**default_run_config(), **cfg}))
    clients = list(range(wl.cfg.num_clients))
    start = {k: v.detach().clone() for k, v in wl.new_model().state_dict().items()}

    def per_client(state: dict) -> list[dict]:
        out = []
        for c in clients:
            model = wl.scratch_model(state)
            wl.train_client(model, c, 0)
            out.append({k: v.detach().cpu().double() for k, v in model.state_dict().items()})
        return out

    ref, again, moved = per_client(start), per_client(start), per_client(shaken(start, shake))
    cohort = [{k: v.double() for k, v in s.items()} for s, _ in CohortTrainer(wl).train(clients, [start] * len(clients), 0)]
    weights = [wl.num_examples(c) for c in clients]

    def fedavg(models: list[dict]) -> dict:
        return {k: sum(w * m[k] for w, m in zip(weights, models, strict=True)) / sum(weights) for k in start}

    past = sum(relative(r, c) > 10 * relative(r, m) for r, c, m in zip(ref, cohort, moved, strict=True))
    reruns = sum(relative(r, a) > 0 for r, a in zip(ref, again, strict=True))
    return relative(fedavg(ref), fedavg(cohort)), relative(fedavg(ref), fedavg(moved)), past, reruns, len(clients)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="issue37", choices=list(SUITES))
    ap.add_argument("--configs", nargs="*", help="names within the suite (default: all)")
    ap.add_argument("--rounds", type=int, nargs="*", default=[1])
    ap.add_argument("--clients", type=int, default=20, help="num-clients (issue37 suite)")
    ap.add_argument("--shake", type=float, default=1e-7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="the run config's device (cpu, cuda, auto)")
    ap.add_argument("--via", default="runs", choices=["runs", "trainers"])
    ap.add_argument("--vmapped-cpu", action="store_true",
                    help="the cohort engine's vmapped pass on a CPU too (before issue 49)")
    ap.add_argument("--pytorch-defaults", action="store_true",
                    help="train with PyTorch's default GPU arithmetic (TF32, any cuDNN algorithm): before issue 37")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base, configs = SUITES[a.suite]
    names = a.configs or list(configs)
    unknown = sorted(set(names) - set(configs))
    if unknown:
        ap.error(f"unknown config(s) {unknown} in suite {a.suite}; known: {list(configs)}")
    if a.via == "trainers" and a.rounds != [1]:
        ap.error("--via trainers measures round 1 only")
    if a.pytorch_defaults:
        workload.exact_float32 = vmapped.exact_float32 = pytorch_defaults
    if a.vmapped_cpu:
        vmapped.batched_kernels = lambda device: True
    base = {**COMMON, "num-clients": a.clients, **base, "device": a.device}
    print(f"suite {a.suite}, device {a.device}, via {a.via}{', PyTorch defaults' if a.pytorch_defaults else ''}"
          f"{', vmapped on a CPU' if a.vmapped_cpu else ''}; "
          "relative L2 difference of the final model, max over tensors")
    extra = " clients past 10x | reruns not identical |" if a.via == "trainers" else ""
    print(f"| config | rounds | cohort vs per-client | own sensitivity | ratio |{extra} seconds |")
    print("|---|---|---|---|---|" + "---|" * (3 if extra else 1), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for rounds in a.rounds:
                t0 = time.perf_counter()
                cfg = {**base, **configs[name], "num-server-rounds": rounds}
                if a.via == "trainers":
                    engines, own, past, reruns, n = round_one(cfg, a.shake)
                    more = f" {past} of {n} | {reruns} of {n} |"
                else:
                    ref = final(cfg, "per-client", Path(tmp))
                    own = relative(ref, final(cfg, "per-client", Path(tmp), a.shake))
                    engines = relative(ref, final(cfg, "cohort", Path(tmp)))
                    more = ""
                print(f"| {name} | {rounds} | {engines:.1e} | {own:.1e} | {engines / max(own, 1e-30):.1f}x |{more} "
                      f"{time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
