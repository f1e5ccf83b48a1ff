"""How far the cohort engine ends from the per-client engine, beside how far the per-client engine
ends from itself when its start moves by 1e-7 (prints a table; never asserts).

Both engines run the same local update (:func:`workloads.solvers.solver_step`) on the same
mini-batches; where a config is chaotic, any float difference grows (a ReLU flips on one example,
a large step with momentum amplifies it). ``own`` measures that sensitivity: the per-client engine
against itself from a start perturbed by ``--shake`` (relative, seeded). ``engines`` is the cohort
engine against the per-client engine; ``ratio`` = engines / own (issue 37 asks for <= 10).
Difference = relative L2 norm of the difference of the final (aggregated) model, max over tensors.

Suites:

- ``issue37`` (default): issue 37's table, CIFAR-10 (the shared JPEG-q75 copy), the ``cnn`` model,
  per-class Dirichlet 0.1 over ``--clients`` clients, every client available, round 1.
- ``issue28``: issue 28's configs (Fashion-MNIST, MLP, 100 clients, Dirichlet 0.1, ``bernoulli:p=0.15``).

    python -m benchmarks.engine_agreement                         # issue 37's four rows, round 1
    python -m benchmarks.engine_agreement --suite issue28 --rounds 1 4
    python -m benchmarks.engine_agreement --configs sgd-0.05 --device cuda
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from experiments.inprocess import run_inprocess
from experiments.presets import DATA_DIR
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
}


def final(cfg: dict, engine: str, out: Path, shake: float = 0.0) -> dict:
    """The final model of one in-process run (its start moved by ``shake``, relative, seeded)."""
    new_model = Workload.new_model

    def shaken(self):
        model = new_model(self)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen), alpha=shake * max(p.abs().mean().item(), 1e-3))
        return model

    if shake:
        Workload.new_model = shaken  # type: ignore[method-assign]
    try:
        run_dir = run_inprocess({**cfg, "engine": engine, "results-dir": str(out), "run-name": f"{engine}-{shake}"})
    finally:
        Workload.new_model = new_model  # type: ignore[method-assign]
        get_workload.cache_clear()
    return {k: v.double() for k, v in torch.load(run_dir / "final_model.pt").items()}


def relative(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item() for k in a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="issue37", choices=list(SUITES))
    ap.add_argument("--configs", nargs="*", help="names within the suite (default: all)")
    ap.add_argument("--rounds", type=int, nargs="*", default=[1])
    ap.add_argument("--clients", type=int, default=20, help="num-clients (issue37 suite)")
    ap.add_argument("--shake", type=float, default=1e-7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="the run config's device (cpu, cuda, auto)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base, configs = SUITES[a.suite]
    names = a.configs or list(configs)
    unknown = sorted(set(names) - set(configs))
    if unknown:
        ap.error(f"unknown config(s) {unknown} in suite {a.suite}; known: {list(configs)}")
    base = {**COMMON, "num-clients": a.clients, **base, "device": a.device}
    print(f"suite {a.suite}, device {a.device}; relative L2 difference of the final model, max over tensors")
    print("| config | rounds | cohort vs per-client | own sensitivity | ratio | seconds |")
    print("|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            for rounds in a.rounds:
                t0 = time.perf_counter()
                cfg = {**base, **configs[name], "num-server-rounds": rounds}
                ref = final(cfg, "per-client", Path(tmp))
                own = relative(ref, final(cfg, "per-client", Path(tmp), a.shake))
                engines = relative(ref, final(cfg, "cohort", Path(tmp)))
                print(f"| {name} | {rounds} | {engines:.1e} | {own:.1e} | {engines / max(own, 1e-30):.1f}x "
                      f"| {time.perf_counter() - t0:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
