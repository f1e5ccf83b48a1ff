"""How far the cohort engine ends from the per-client engine, beside how far the per-client engine
ends from itself when its start moves by 1e-7 (prints; never asserts).

Both engines run the same local update (:func:`workloads.solvers.solver_step`) on the same
mini-batches; they differ only in float reassociation (a vmapped, batched forward and backward
pass). Where a config is chaotic, any such difference grows: a ReLU flips on one example, and a
large step with momentum amplifies it. The ``own`` column measures that sensitivity (the
per-client engine against itself from a start perturbed by ``--shake``, relative); ``engines``
is the cohort engine against the per-client engine. Calm configs show both near 1e-7; chaotic
ones show both large together. The defaults are issue 28's configs (Fashion-MNIST, 100 clients,
per-class Dirichlet 0.1: 4 to 3,833 examples a client).

    python -m benchmarks.engine_agreement                       # issue 28's three configs
    python -m benchmarks.engine_agreement --rounds 2 --configs momentum
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from experiments.inprocess import run_inprocess
from experiments.presets import DATA_DIR
from workloads.workload import Workload, get_workload

BASE: dict[str, object] = {"dataset": "fashion-mnist", "data-dir": DATA_DIR, "model": "mlp", "num-clients": 100,
        "partition": "dirichlet:alpha=0.1", "availability": "bernoulli:p=0.15", "checkpoint-every": 0,
        "eval-every": 0, "progress": False}
CONFIGS: dict[str, dict[str, object]] = {
    "steps200": {"local-steps": "steps:n=200"},
    "epochs1": {"local-steps": "epochs:min=1,max=1"},
    "momentum": {"local-steps": "epochs:min=1,max=2", "solver": "momentum", "momentum": 0.9},
}


def final(cfg: dict, engine: str, out: Path, shake: float = 0.0) -> dict:
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
    return torch.load(run_dir / "final_model.pt")


def relative(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item() for k in a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--rounds", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--shake", type=float, default=1e-7)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(f"{'config':10} {'rounds':>6} {'own':>9} {'engines':>9}   (relative, max over tensors of the final model)")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.configs:
            for rounds in a.rounds:
                cfg = {**BASE, **CONFIGS[name], "num-server-rounds": rounds}
                ref = final(cfg, "per-client", Path(tmp))
                own = relative(ref, final(cfg, "per-client", Path(tmp), a.shake))
                engines = relative(ref, final(cfg, "cohort", Path(tmp)))
                print(f"{name:10} {rounds:6d} {own:9.1e} {engines:9.1e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
