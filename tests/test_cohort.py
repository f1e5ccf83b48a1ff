"""The cohort engine trains a round's clients at once and ends where the per-client engine ends.

Equality is within 1e-4 relative per tensor of the final model (float reassociation only), over
rules, solvers, step options, a client smaller than the batch and a model with dropout; a model
it cannot batch falls back to per client, logs why once and still gives the same model.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from experiments.inprocess import run_inprocess
from strategies import STRATEGIES
from strategies.protocol import CORRECTED_RULES
from workloads import workload as workload_module
from workloads.models import Classifier
from workloads.solvers import SolverConfig
from workloads.vmapped import CohortTrainer
from workloads.workload import Workload, get_workload

SMALL = {"num-server-rounds": 3, "num-clients": 6, "model": "mlp", "availability": "bernoulli:p=0.7",
         "checkpoint-every": 0, "eval-every": 0, "progress": False}
TOL = 1e-4


def final_and_config(tmp_path, engine: str, **over):
    run_dir = run_inprocess({**SMALL, **over, "engine": engine, "results-dir": str(tmp_path),
                             "run-name": engine})
    return (torch.load(run_dir / "final_model.pt"), json.loads((run_dir / "config.json").read_text()),
            [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        rel = ((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item()
        assert rel <= TOL, f"{k}: relative difference {rel:.2e}"


def same_run(tmp_path, **over):
    ref, ref_cfg, ref_rows = final_and_config(tmp_path / "per-client", "per-client", **over)
    got, cfg, rows = final_and_config(tmp_path / "cohort", "cohort", **over)
    assert_close(ref, got)
    assert ref_cfg["engine-used"] == "per-client" and cfg["engine"] == "cohort"
    assert [r["participants"] for r in rows] == [r["participants"] for r in ref_rows]
    return cfg, rows, ref_rows


RULES = sorted(set(STRATEGIES) - set(CORRECTED_RULES))  # SCAFFOLD's rules train per client (below)


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_ends_where_the_per_client_engine_ends(tmp_path, rule):
    cfg, rows, ref_rows = same_run(tmp_path, strategy=rule)
    assert cfg["engine-used"] == "cohort"
    for a, b in zip(rows, ref_rows, strict=True):  # the metrics the replies carry agree too
        for key in ("train-loss", "mean-train-loss"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-4)


@pytest.mark.parametrize("options", [
    {"solver": "momentum", "momentum": 0.9, "local-steps": "epochs:min=1,max=3"},  # heterogeneous steps
    {"solver": "prox", "prox-mu": 0.5, "weight-decay": 1e-3, "lr-schedule": "inv-sqrt"},
    {"solver": "sgd", "local-steps": "steps:n=4", "lr-schedule": "step:gamma=0.5,every=1"},
    # clients smaller than the batch; lr 0.01: at 0.05 this CNN's loss reaches 6 and three rounds of
    # chaotic training amplify float reassociation (4e-7 after one round, see below) past 1e-4
    {"model": "cnn", "local-steps": "epochs:min=1,max=2", "batch-size": 64, "lr": 0.01},
    {"model": "logreg", "strategy": "fednova", "solver": "momentum", "momentum": 0.5},
])
def test_solvers_and_step_options_match(tmp_path, options):
    cfg, _, _ = same_run(tmp_path, **options)
    assert cfg["engine-used"] == "cohort"


def test_a_client_smaller_than_the_batch_trains_on_all_its_examples(tmp_path):
    wl = get_workload(_cfg(**{"batch-size": 10_000}))
    assert all(wl.batch_size_of(c) == wl.num_examples(c) for c in range(wl.cfg.num_clients))
    same_run(tmp_path, **{"batch-size": 10_000})


def _cfg(**over):
    from experiments.inprocess import default_run_config
    from runconfig import WorkloadConfig, from_run_config

    return from_run_config(WorkloadConfig, {**default_run_config(), **SMALL, **over})


@pytest.fixture
def model_with(monkeypatch):
    """Replace the mlp by a model with extra layers, for this test's workloads only."""
    def use(*middle: nn.Module):
        def build(spec, shape, num_classes, dataset=None):
            flat = int(torch.tensor(shape).prod())
            return Classifier(nn.Flatten(), nn.Linear(flat, 32), *middle, nn.ReLU(), nn.Dropout(0.2),
                              nn.Linear(32, num_classes))
        monkeypatch.setattr(workload_module, "build_model", build)
        get_workload.cache_clear()
    yield use
    get_workload.cache_clear()


def test_dropout_masks_are_each_clients_own(tmp_path, model_with):
    model_with(nn.Dropout(0.5))
    cfg, _, _ = same_run(tmp_path)
    assert cfg["engine-used"] == "cohort"


def test_a_model_it_cannot_batch_falls_back_says_why_once_and_is_equal(tmp_path, model_with, caplog):
    model_with(nn.AlphaDropout(0.3))
    with caplog.at_level(logging.WARNING, logger="experiments.cohort_grid"):
        cfg, _, _ = same_run(tmp_path)
    assert cfg["engine-used"] == "per-client"
    assert "AlphaDropout" in cfg["engine-reason"]
    warnings = [r for r in caplog.records if r.name == "experiments.cohort_grid"]
    assert len(warnings) == 1 and "AlphaDropout" in warnings[0].getMessage()


def test_a_custom_client_app_is_never_bypassed(tmp_path):
    from flwr.clientapp import ClientApp

    from client_app.app import app as client_app
    from experiments.cohort_grid import CohortGrid

    custom = ClientApp()

    @custom.train()
    def train(msg, context):  # e.g. a test's ClientApp that poisons replies
        return client_app(msg, context)

    grid = CohortGrid(3, {**SMALL, "num-clients": 3}, engine="cohort", client_app=custom)
    assert grid.engine_record["engine-used"] == "per-client"
    assert "its own train handler" in grid.engine_record["engine-reason"]


def test_auto_says_what_it_picked(tmp_path):
    for model in ("mlp", "cnn"):  # a convolution too: the cohort on a CPU as on a GPU
        _, cfg, _ = final_and_config(tmp_path / model, "auto", model=model)
        assert cfg["engine-used"] == "cohort" and cfg["engine-reason"].startswith("auto:")
        assert "every machine" in cfg["engine-reason"]
        assert cfg["engine-kernels"].startswith("per-client (cpu)")  # how the cohort computed, here


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_auto_chooses_the_same_engine_on_a_cpu_and_a_gpu(model):
    from experiments.cohort_grid import auto_engine

    wl = Workload(_cfg(model=model))  # a workload of its own: its device is changed below
    on_cpu = auto_engine(wl)
    wl.device = torch.device("cuda")  # what auto sees on a GPU machine (nothing is put there)
    assert auto_engine(wl) == on_cpu


def test_a_model_may_declare_its_engine(tmp_path, monkeypatch):
    def build(spec, shape, num_classes, dataset=None):
        model = Classifier(nn.Flatten(), nn.Linear(int(torch.tensor(shape).prod()), num_classes))
        model.prefers_cohort = False
        return model
    monkeypatch.setattr(workload_module, "build_model", build)
    get_workload.cache_clear()
    try:
        _, cfg, _ = final_and_config(tmp_path / "declared", "auto")
    finally:
        get_workload.cache_clear()
    assert cfg["engine-used"] == "per-client"
    assert cfg["engine-reason"] == "auto: the model declares prefers_cohort=False"


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_one_round_equals_each_clients_own_training_with_clipping(model):
    wl = Workload(_cfg(model=model, **{"local-steps": "epochs:min=1,max=3", "batch-size": 64}))
    wl.solver = SolverConfig(kind="momentum", lr=0.5, momentum=0.9, max_grad_norm=0.05)
    start = wl.new_model().state_dict()
    clients = list(range(wl.cfg.num_clients))
    ours = CohortTrainer(wl).train(clients, [start] * len(clients), rnd=2)
    for c, (trained, result) in zip(clients, ours, strict=True):
        model = wl.scratch_model(start)
        ref = wl.train_client(model, c, 2)
        for k, v in model.state_dict().items():
            assert ((trained[k] - v).norm() / v.norm()).item() <= 1e-5, k
        assert (result.num_steps, result.a_norm) == (ref.num_steps, ref.a_norm)
        assert result.train_loss == pytest.approx(ref.train_loss, rel=1e-5)


@pytest.mark.parametrize("rule", CORRECTED_RULES)
def test_a_rule_that_corrects_every_local_step_trains_per_client_and_says_why(tmp_path, rule):
    cfg, _, _ = same_run(tmp_path, strategy=rule, **{"num-server-rounds": 2})
    assert cfg["engine-used"] == "per-client" and "control variate" in cfg["engine-reason"]


def test_fedpbc_catch_up_trains_the_missed_rounds_per_client_and_ends_where_per_client_ends(tmp_path):
    cfg, rows, _ = same_run(tmp_path, strategy="fedpbc:catch-up=true")
    assert cfg["engine-used"] == "cohort"  # the returning clients' several rounds run per client


def test_training_on_a_gpu_is_exact_float32_and_deterministic_then_restores_the_callers_settings():
    """Both engines train inside exact_float32 (issue 37: TF32 convolutions put the engines 4.7e-2
    apart on an H200 where the config's own sensitivity is 4e-6). The flags are set on any build."""
    from workloads.precision import exact_float32

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    saved = (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark)
    try:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark = True, True, False, True
        with exact_float32(torch.device("cpu")):  # the CPU: nothing to change
            assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (True, True, False, True)
        with pytest.raises(RuntimeError, match="in training"), exact_float32(torch.device("cuda")):
            assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (False, False, True, False)
            raise RuntimeError("in training")
        assert (cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark) == (True, True, False, True)
    finally:
        cudnn.allow_tf32, matmul.allow_tf32, cudnn.deterministic, cudnn.benchmark = saved


def test_both_engines_train_inside_exact_float32(monkeypatch):
    """The per-client engine (Workload.train_client) and the cohort engine (CohortTrainer.train)
    each enter exact_float32 on the workload's device while they train."""
    import contextlib

    from workloads import vmapped

    entered: list[str] = []

    @contextlib.contextmanager
    def spy(device):
        entered.append(device.type)
        yield

    monkeypatch.setattr(workload_module, "exact_float32", spy)
    monkeypatch.setattr(vmapped, "exact_float32", spy)
    wl = Workload(_cfg(**{"local-steps": "steps:n=2"}))
    start = wl.new_model().state_dict()
    wl.train_client(wl.scratch_model(start), 0, 0)
    assert entered == ["cpu"]
    CohortTrainer(wl).train([0, 1], [start, start], 0)
    assert entered[1:] and set(entered) == {"cpu"}
