"""Property test (hypothesis): the cohort engine ends where the per-client engine ends, on random configs.

Drawn: the dataset (digits; the larger generated ``synthetic``, whose clients hold 40 to 2,600
examples, split by client: a quantity-skewed partition; ``quadratic``), the partition (iid,
Dirichlet, shards, natural), the model, local steps (``steps:n`` beyond one pass over a small
client's data, or ``epochs`` with per-client counts), batches larger than a client, the solver
(sgd, momentum, prox, weight decay), the lr schedule, the availability and any registered rule
the cohort engine trains (all but SCAFFOLD's, which train per client under either engine).

Each draw runs three times in process: per client, per client from a start perturbed by 1e-7
(relative), and as a cohort. The perturbed run measures the config's own sensitivity to float
rounding: where it stays below ``CALM`` the training is not chaotic and the engines must agree
within ``TOL`` (relative, per tensor of the final model); where it is larger (a ReLU flipping on
one example, amplified by momentum and a large step), the engines may differ by as much as the
per-client engine differs from itself, no more. Derandomized: CI sees the same draws every time.

``test_round_one_agrees_within_ten_times_the_configs_own_sensitivity`` (issue 37) goes where
training is chaotic on purpose: label-skewed partitions (Dirichlet 0.1, one or two label shards a
client), convolutions (the ``cnn``, and a small conv net with GroupNorm), learning rates up to 0.3,
up to 40 steps or three epochs, momentum and prox. It trains round 1 directly (the engines' own
training, no Flower: ``Workload.train_client`` against ``CohortTrainer``) and compares the round's
FedAvg model; the config's own sensitivity is the per-client engine's change under a 1e-7 move of
its start, the larger of two directions (one direction can miss a ReLU that flips, and the engines
then seem to differ by what the per-client engine itself does in the other direction).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings, strategies as st
from torch import nn

from experiments.inprocess import default_run_config, run_inprocess
from runconfig import WorkloadConfig, from_run_config
from strategies import STRATEGIES
from strategies.protocol import CORRECTED_RULES
from workloads import workload as workload_module
from workloads.models import Classifier
from workloads.vmapped import CohortTrainer
from workloads.workload import Workload, get_workload

TOL = 1e-4  # the engines on a config that is not chaotic
CALM = 1e-5  # the per-client engine's own change under a 1e-7 perturbation of its start
MAX_STEPS = 400  # local steps a round, summed over clients: keeps a draw CI-cheap
RULES = sorted(set(STRATEGIES) - set(CORRECTED_RULES))  # SCAFFOLD's rules train per client in both

DATA = {  # dataset -> (models, partitions)
    "digits": (["mlp", "logreg"], ["iid", "dirichlet:alpha=0.3,min_size=5", "shards:per_client=2"]),
    "synthetic": (["mlp", "logreg"], ["natural"]),
    "quadratic": (["quadratic"], ["natural"]),
}


@st.composite
def configs(draw):
    dataset = draw(st.sampled_from(sorted(DATA)))
    models, partitions = DATA[dataset]
    solver = draw(st.sampled_from(["sgd", "momentum", "prox"]))
    steps = draw(st.one_of(
        st.integers(1, 30).map(lambda n: f"steps:n={n}"),
        st.tuples(st.integers(1, 2), st.integers(0, 1)).map(lambda t: f"epochs:min={t[0]},max={t[0] + t[1]}")))
    return {
        "dataset": dataset, "model": draw(st.sampled_from(models)), "partition": draw(st.sampled_from(partitions)),
        "num-clients": draw(st.integers(3, 6)), "data-seed": draw(st.integers(0, 5)),
        "num-server-rounds": draw(st.integers(2, 3)), "strategy": draw(st.sampled_from(RULES)),
        "availability": draw(st.sampled_from(["always", "bernoulli:p=0.6"] + (  # sine: from the label mix
            ["sine:gamma=0.5,period=2"] if dataset != "quadratic" else []))),
        "local-steps": steps, "batch-size": draw(st.sampled_from([8, 32, 1000])),  # 1000: above every client
        "lr": draw(st.sampled_from([0.01, 0.05])), "solver": solver,
        "lr-schedule": draw(st.sampled_from(["constant", "inv-sqrt:every=1"])),
        "momentum": draw(st.sampled_from([0.5, 0.9])) if solver == "momentum" else 0.0,
        "prox-mu": draw(st.sampled_from([0.1, 1.0])) if solver == "prox" else 0.0,
        "weight-decay": draw(st.sampled_from([0.0, 1e-3])),
    }


def final_model(cfg: dict, engine: str, out: Path) -> tuple[dict, dict]:
    run_dir = run_inprocess({**cfg, "engine": engine, "results-dir": str(out), "run-name": engine,
                             "checkpoint-every": 0, "eval-every": 0, "progress": False})
    return torch.load(run_dir / "final_model.pt"), json.loads((run_dir / "config.json").read_text())


def relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item() for k in a)


def perturbed_start(monkeypatch, size: float) -> None:
    """The server's initial model (``Workload.new_model``) perturbed by ``size`` (relative, seeded)."""
    new_model = Workload.new_model

    def perturbed(self):
        model = new_model(self)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():  # scaled by the tensor's mean size (a zero start moves too)
                p.add_(torch.randn(p.shape, generator=gen), alpha=size * max(p.abs().mean().item(), 1e-3))
        return model

    monkeypatch.setattr(Workload, "new_model", perturbed)


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(over=configs())
def test_the_engines_agree_on_random_configs(over):
    cfg = {**default_run_config(), **over}
    wl = get_workload(from_run_config(WorkloadConfig, cfg))
    assume(sum(wl.steps_for(c, 0) for c in range(wl.cfg.num_clients)) <= MAX_STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        ref, ref_cfg = final_model(over, "per-client", Path(tmp) / "ref")
        got, got_cfg = final_model(over, "cohort", Path(tmp) / "cohort")
        with pytest.MonkeyPatch.context() as mp:
            perturbed_start(mp, 1e-7)
            shaken, _ = final_model(over, "per-client", Path(tmp) / "shaken")
    assert ref_cfg["engine-used"] == "per-client" and got_cfg["engine-used"] == "cohort"
    own, between = relative(ref, shaken), relative(ref, got)
    if own <= CALM:
        assert between <= TOL, f"engines differ by {between:.2e} on a calm config (own {own:.2e}): {over}"
    else:  # chaotic: the engines may differ as the per-client engine differs from itself
        assert between <= max(TOL, 10 * own), f"engines differ by {between:.2e}, own {own:.2e}: {over}"


# -- issue 37: round 1 within 10x the config's own sensitivity, where training is chaotic ------------
SHAKE = 1e-7  # the move of the start that defines a config's own sensitivity (relative)
SHAKE_SEEDS = (1, 2)  # its directions: the sensitivity is the larger change
FLOAT_FLOOR = 1e-6  # float32 rounding of a round's update: below it nothing is told apart
ROUND_ONE_STEPS = 300  # local steps of round 1, summed over clients: keeps a draw CI-cheap


def groupnorm_cnn(input_shape, num_classes):
    """A small conv net with GroupNorm (no running statistics: the cohort engine batches it)."""
    c, h, w = input_shape
    return Classifier(nn.Conv2d(c, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Flatten(), nn.Linear(8 * (h // 2) * (w // 2), num_classes))


@st.composite
def chaotic_configs(draw):
    solver = draw(st.sampled_from(["sgd", "momentum", "prox"]))
    return {
        "dataset": "digits", "availability": "always", "num-server-rounds": 1,
        "model": draw(st.sampled_from(["cnn", "groupnorm-cnn", "mlp"])),
        "partition": draw(st.sampled_from(["dirichlet:alpha=0.1,min_size=10", "shards:per_client=1",
                                           "shards:per_client=2"])),
        "num-clients": draw(st.integers(3, 5)), "data-seed": draw(st.integers(0, 3)),
        "local-steps": draw(st.one_of(
            st.integers(5, 40).map(lambda n: f"steps:n={n}"),
            st.tuples(st.integers(1, 2), st.integers(0, 1)).map(lambda t: f"epochs:min={t[0]},max={t[0] + t[1]}"))),
        "batch-size": draw(st.sampled_from([8, 16, 32])), "lr": draw(st.sampled_from([0.05, 0.1, 0.3])),
        "solver": solver, "momentum": draw(st.sampled_from([0.5, 0.9])) if solver == "momentum" else 0.0,
        "prox-mu": draw(st.sampled_from([0.1, 1.0])) if solver == "prox" else 0.0,
    }


def round_one(wl: Workload, start: dict, engine: str) -> dict:
    """Round 1's FedAvg model (weights by examples, every client), each client trained by ``engine``."""
    clients = list(range(wl.cfg.num_clients))
    if engine == "cohort":
        trained = [state for state, _ in CohortTrainer(wl).train(clients, [start] * len(clients), 0)]
    else:
        trained = []
        for c in clients:
            model = wl.scratch_model(start)
            wl.train_client(model, c, 0)
            trained.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    weights = [wl.num_examples(c) for c in clients]
    return {k: sum(w * t[k].double() for w, t in zip(weights, trained, strict=True)) / sum(weights) for k in start}


def shaken(start: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=gen) * SHAKE * max(v.abs().mean().item(), 1e-3)
            for k, v in start.items()}


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(over=chaotic_configs())
# issue 37's fresh cases on this data: lr 0.05 for 20 steps of 32, prox 0.1 for 1-2 epochs of 16, momentum 0.9
@example(over={"dataset": "digits", "availability": "always", "num-server-rounds": 1, "model": "cnn",
               "partition": "dirichlet:alpha=0.1,min_size=10", "num-clients": 4, "data-seed": 0,
               "local-steps": "steps:n=20", "batch-size": 32, "lr": 0.05, "solver": "sgd"})
@example(over={"dataset": "digits", "availability": "always", "num-server-rounds": 1, "model": "cnn",
               "partition": "dirichlet:alpha=0.1,min_size=10", "num-clients": 4, "data-seed": 1,
               "local-steps": "epochs:min=1,max=2", "batch-size": 16, "lr": 0.05, "solver": "prox", "prox-mu": 0.1})
@example(over={"dataset": "digits", "availability": "always", "num-server-rounds": 1, "model": "cnn",
               "partition": "shards:per_client=2", "num-clients": 4, "data-seed": 2,
               "local-steps": "steps:n=20", "batch-size": 32, "lr": 0.05, "solver": "momentum", "momentum": 0.9})
@example(over={"dataset": "digits", "availability": "always", "num-server-rounds": 1, "model": "groupnorm-cnn",
               "partition": "shards:per_client=1", "num-clients": 3, "data-seed": 0,
               "local-steps": "steps:n=30", "batch-size": 16, "lr": 0.3, "solver": "sgd"})
def test_round_one_agrees_within_ten_times_the_configs_own_sensitivity(over):
    with pytest.MonkeyPatch.context() as mp:
        if over["model"] == "groupnorm-cnn":
            mp.setattr(workload_module, "build_model", lambda spec, shape, classes, dataset=None:
                       groupnorm_cnn(shape, classes))
            over = {**over, "model": "mlp"}  # a known name, for the config's checks; the patched builder ignores it
        wl = Workload(from_run_config(WorkloadConfig, {**default_run_config(), **over}))
        assume(sum(wl.steps_for(c, 0) for c in range(wl.cfg.num_clients)) <= ROUND_ONE_STEPS)
        start = {k: v.detach().clone() for k, v in wl.new_model().state_dict().items()}
        ref = round_one(wl, start, "per-client")
        between = relative(ref, round_one(wl, start, "cohort"))
        own = max(relative(ref, round_one(wl, shaken(start, seed), "per-client")) for seed in SHAKE_SEEDS)
    assert between <= max(10 * own, FLOAT_FLOOR), f"engines differ by {between:.2e}, own {own:.2e}: {over}"
