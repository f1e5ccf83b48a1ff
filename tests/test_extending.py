"""The recipes of docs/extending.md, run from outside the project's packages: the example package
examples/flchurn-myext, reached by ``module:attr`` specs and by its entry points."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from extension_fixtures import MYEXT, use_myext
from torch import nn

from availability import ScheduleError, SpecError, build_schedule, schedule_for
from experiments.inprocess import run_inprocess
from runconfig.extensions import ExtensionError, split_reference
from server_app.results import read_metrics
from workloads.data import load_dataset
from workloads.models import build_model
from workloads.partition import partition

SMALL = {"num-clients": 4, "num-server-rounds": 2, "local-steps": "steps:n=2", "batch-size": 8,
         "checkpoint-every": 0, "progress": False, "device": "cpu", "engine": "per-client", "lr": 0.1}
MODULE_SPECS = {"dataset": "myext.data:blobs:n=200", "model": "myext.nets:tiny_mlp:width=16",
                "partition": "myext.splits:FeatureSkew", "availability": "myext.schedules:Diurnal:period=4"}
ENTRY_SPECS = {"dataset": "blobs:n=200", "model": "tiny-mlp:width=16", "partition": "feature-skew",
               "availability": "diurnal:period=4"}


@pytest.fixture
def myext(monkeypatch, tmp_path):
    use_myext(monkeypatch, tmp_path)


def test_a_module_attr_spec_is_told_from_a_builtin_spec():
    assert split_reference("mynets:resnet8:width=32") == ("mynets:resnet8", "width=32")
    assert split_reference("my.nets:Zoo.resnet8") == ("my.nets:Zoo.resnet8", "")
    assert split_reference("dirichlet:alpha=0.3") is None and split_reference("mlp") is None
    with pytest.raises(ExtensionError, match="module path"):
        split_reference("my-nets:resnet8")


def test_model_recipe_by_module_and_by_entry_point(myext):
    model = build_model("myext.nets:tiny_mlp:width=16,depth=2", (8,), 3)
    assert [m.out_features for m in model.modules() if isinstance(m, nn.Linear)] == [16, 16, 3]
    torch.manual_seed(0)
    a = build_model("tiny-mlp:width=16", (8,), 3)
    torch.manual_seed(0)
    b = build_model("myext.nets:tiny_mlp:width=16", (8,), 3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    with pytest.raises(SpecError, match="expected an integer"):
        build_model("myext.nets:tiny_mlp:width=1.5", (8,), 3)
    with pytest.raises(SpecError, match=r"unknown parameter.*allowed: \['depth', 'width'\]"):
        build_model("tiny-mlp:height=3", (8,), 3)
    with pytest.raises(ExtensionError, match="no attribute 'nope'"):
        build_model("myext.nets:nope", (8,), 3)
    assert build_model("mlp", (8,), 3).__class__.__name__ == "Classifier"  # built-ins win


def test_dataset_recipe_in_every_accepted_form(myext, tmp_path):
    train, test = load_dataset("myext.data:blobs:n=200,classes=4", seed=3)
    assert (len(train), len(test), train.num_classes, tuple(train.x.shape[1:])) == (160, 40, 4, (8,))
    same, _ = load_dataset("blobs:n=200,classes=4", seed=3)  # the entry point
    assert torch.equal(same.x, train.x) and torch.equal(same.y, train.y)
    arrays, _ = load_dataset("myext.data:blobs:n=300", seed=1)
    hf, hf_test = load_dataset("myext.data:blobs_hf", seed=1)  # a datasets.DatasetDict
    assert torch.allclose(hf.x, arrays.x) and torch.equal(hf.y, arrays.y) and len(hf_test) == 60
    fds, _ = load_dataset("myext.data:blobs_federated", tmp_path, seed=1)  # a FederatedDataset
    assert torch.allclose(fds.x, arrays.x) and torch.equal(fds.y, arrays.y)
    with pytest.raises(SpecError, match="unknown parameter"):
        load_dataset("blobs:size=3")


def test_builtin_datasets_take_parameters_from_their_spec():
    a, _ = load_dataset("synthetic:alpha=0.5,beta=0.5,test-fraction=0.5", num_clients=5, seed=0)
    b, _ = load_dataset("synthetic", num_clients=5, seed=0, alpha=0.5, beta=0.5, test_fraction=0.5)
    c, _ = load_dataset("synthetic", num_clients=5, seed=0)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert len(a) < len(c)  # half held out for testing, not a fifth


def test_partition_recipe_sees_features(myext):
    train, _ = load_dataset("myext.data:blobs:n=400", seed=0)
    x, y = train.x.numpy(), train.y.numpy()
    parts = partition("myext.splits:FeatureSkew:seed=5", y, 4, 0, features=x)
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(y)))  # disjoint and covering
    score = x.astype(np.float64) @ np.random.default_rng(5).normal(size=x.shape[1])
    for a, b in zip(parts, parts[1:], strict=False):  # contiguous blocks of feature space
        assert score[a].max() <= score[b].min()
    by_ep = partition("feature-skew:seed=5", y, 4, 0, features=x)
    assert all(np.array_equal(p, q) for p, q in zip(parts, by_ep, strict=True))


def test_any_flwr_datasets_partitioner_and_a_plain_function_are_partitioners(tmp_path, monkeypatch):
    labels = np.repeat(np.arange(4), 25)
    parts = partition("flwr_datasets.partitioner:DirichletPartitioner:partition-by=label,alpha=0.5,"
                      "min-partition-size=0", labels, 5, 1)
    assert len(parts) == 5 and sorted(np.concatenate(parts).tolist()) == list(range(100))
    again = partition("flwr_datasets.partitioner:DirichletPartitioner:partition_by=label,alpha=0.5,"
                      "min_partition_size=0", labels, 5, 1)  # snake_case keys name the same parameters
    assert all(np.array_equal(p, q) for p, q in zip(parts, again, strict=True))
    (tmp_path / "mysplit.py").write_text(
        "import numpy as np\n"
        "def by_label(labels, num_partitions, every=1):\n"
        "    return [np.flatnonzero(labels % num_partitions == i)[::every] for i in range(num_partitions)]\n"
        "def halves(labels):\n"
        "    return np.array_split(np.arange(len(labels)), 2)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parts = partition("mysplit:by_label:every=2", labels, 4, 0)
    assert [set(labels[p]) for p in parts] == [{0}, {1}, {2}, {3}] and [len(p) for p in parts] == [13] * 4
    with pytest.raises(ExtensionError, match="returned 2 partitions for 4 clients"):
        partition("mysplit:halves", labels, 4, 0)


def test_availability_recipe_by_module_entry_point_and_run_config(myext):
    s = build_schedule("myext.schedules:Diurnal:period=4,depth=0.5", 6, 0)
    assert s.spec == "myext.schedules:Diurnal:period=4,depth=0.5" and s.params["period"] == 4
    t = build_schedule("diurnal:period=4,depth=0.5", 6, 0)
    assert np.array_equal(s.matrix(20), t.matrix(20)) and np.allclose(s.prob(3), t.prob(3))
    assert 0.8 * 0.5 <= s.prob(0).max() <= 0.8 and s.prob(0).min() >= 0.8 * 0.5 - 1e-12
    run_config = {"num-clients": 6, "availability": "diurnal:period=4", "schedule-seed": 2}
    assert schedule_for(run_config).matrix(5).shape == (5, 6)
    with pytest.raises(ScheduleError, match="unknown parameter"):
        build_schedule("diurnal:phase=1", 6, 0)


def test_a_schedule_factory_is_an_availability_model(tmp_path, monkeypatch):
    (tmp_path / "myfactory.py").write_text(
        "from availability import build_schedule\n"
        "def half(num_clients, seed, p=0.5):\n"
        "    return build_schedule(f'bernoulli:p={p}', num_clients, seed)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    s = build_schedule("myfactory:half:p=0.25", 8, 1)
    assert np.array_equal(s.matrix(10), build_schedule("bernoulli:p=0.25", 8, 1).matrix(10))


@pytest.mark.parametrize("names", [MODULE_SPECS, ENTRY_SPECS], ids=["module-attr", "entry-point"])
def test_all_four_recipes_in_one_in_process_run(myext, tmp_path, names):
    run = run_inprocess({**SMALL, **names, "results-dir": str(tmp_path), "run-name": "mine"})
    rows = read_metrics(run)
    assert [r["round"] for r in rows] == [1, 2] and "test-accuracy" in rows[-1]
    config = json.loads((run / "config.json").read_text())
    assert config["model"] == names["model"] and config["partition"] == names["partition"]


def test_module_and_entry_point_runs_give_the_same_numbers(myext, tmp_path):
    runs = [run_inprocess({**SMALL, **names, "results-dir": str(tmp_path), "run-name": tag})
            for tag, names in (("module", MODULE_SPECS), ("entry", ENTRY_SPECS))]
    a, b = ([{k: v for k, v in r.items() if k not in ("round-time", "wall-time")} for r in read_metrics(p)]
            for p in runs)
    assert a == b


def test_a_user_module_that_is_missing_fails_before_training_naming_it(tmp_path):
    from runconfig import ConfigError

    with pytest.raises((ConfigError, ExtensionError), match="cannot import module 'nowhere'"):
        run_inprocess({**SMALL, "model": "nowhere:net", "results-dir": str(tmp_path)})
    assert not any(tmp_path.iterdir())


def test_the_example_package_lives_outside_the_project_packages():
    import tomllib

    from conftest import ROOT

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert not any(str(MYEXT.relative_to(ROOT)).startswith(p) for p in packages["packages"])


@pytest.mark.slow
def test_the_recipes_under_flwr_run_on_the_ray_simulation(myext, tmp_path):
    """`flwr run .` (Flower's Ray simulation on a fresh local SuperLink) with the user's model,
    dataset, partitioner and availability model, reached through the exported PYTHONPATH; two
    rounds, the same participants and numbers as the in-process run."""
    import shutil

    from test_engines import flwr_run

    if shutil.which("flwr") is None:
        pytest.skip("the flwr CLI is not on PATH")
    specs = " ".join(f"{k}='{v}'" for k, v in MODULE_SPECS.items())
    results = tmp_path / "results"
    log, status = flwr_run(tmp_path, f"num-clients=4 num-server-rounds=2 local-steps='steps:n=2' batch-size=8 "
                                     f"lr=0.1 checkpoint-every=0 round-timeout=600.0 device='cpu' {specs} "
                                     f"results-dir='{results}' run-name='flwr'")
    assert status == "finished:completed", log[-3000:]
    reference = run_inprocess({**SMALL, **MODULE_SPECS, "results-dir": str(tmp_path), "run-name": "inprocess"})
    got, want = read_metrics(results / "flwr"), read_metrics(reference)
    assert [r["participants"] for r in got] == [r["participants"] for r in want]
    assert got[-1]["test-loss"] == pytest.approx(want[-1]["test-loss"], rel=1e-5)


def test_the_projects_partitioners_are_flwr_datasets_partitioners():
    import datasets
    from flwr_datasets.partitioner import Partitioner

    from workloads.partition import flwr_partitioner

    labels = np.random.default_rng(0).integers(0, 5, 200)
    part = flwr_partitioner("client-dirichlet:alpha=0.3,min-size=2", 8, seed=4)
    assert isinstance(part, Partitioner) and part.num_partitions == 8
    part.dataset = datasets.Dataset.from_dict({"label": labels, "row": np.arange(200)})
    ours = partition("client-dirichlet:alpha=0.3,min_size=2", labels, 8, 4)
    for i in range(8):
        assert sorted(part.load_partition(i)["row"]) == sorted(ours[i].tolist())
    with pytest.raises(SpecError, match="unknown partitioner"):
        flwr_partitioner("dirichlett", 8)


def test_rule_recipe_by_module_and_by_entry_point(myext, tmp_path):
    """A rule of the user's own (myext.rules.ParticipationScaled, a FedAvgActive subclass) from both
    routes: its own parameter checked, the same numbers either way; with every client online its
    step scale is 1, so it equals fedavg-active bit for bit, and under churn it does not. Its own
    aggregate runs: it holds the round, where fedavg-active itself streams."""
    from strategies import build_strategy

    rule = build_strategy("myext.rules:ParticipationScaled:floor=0.2", num_clients=4)
    assert type(rule).__name__ == "ParticipationScaled" and rule.floor == 0.2
    with pytest.raises(SpecError, match="expected a number|expected a float"):
        build_strategy("participation-scaled:floor=high", num_clients=4)
    with pytest.raises(ExtensionError, match="not a rule class"):
        build_strategy("myext.nets:tiny_mlp", num_clients=4)

    def final(strategy, availability, tag):
        run = run_inprocess({**SMALL, "strategy": strategy, "availability": availability,
                             "results-dir": str(tmp_path), "run-name": tag})
        return [{k: v for k, v in r.items() if k not in ("round-time", "wall-time", "step-scale")}
                for r in read_metrics(run)]

    churn = "bernoulli:p=0.5"
    module = final("myext.rules:ParticipationScaled:floor=0.2", churn, "module")
    assert module == final("participation-scaled:floor=0.2", churn, "entry")
    assert module != final("fedavg-active", churn, "fedavg-churn")
    # a rule that overrides aggregate holds the round (its override must apply), so it equals
    # fedavg-active on the same path bit for bit (streamed fedavg-active: within float rounding)
    assert final("participation-scaled", "always", "mine-always") == final("fedavg-active:stream=false", "always",
                                                                           "fedavg-always")


def test_a_rule_value_recipe_is_fedavgm(myext, tmp_path):
    """docs/extending.md's rule as a value (myext.momentum:ServerMomentum, FedAvgM in its own
    package, no class of the adapter named): its spec key is its Params field, checked; β = 0 is
    fedavg-active, and β = 0.9 is the built-in fedavgm (Flower's FedAvgM) with that momentum, to float
    rounding (float64 sums here, float32 partial sums there); its state resumes through the checkpoint."""
    from strategies import build_strategy
    from strategies.rule_strategy import RuleStrategy

    rule = build_strategy("myext.momentum:ServerMomentum:beta=0.5", num_clients=4)
    assert isinstance(rule, RuleStrategy) and rule.name == "server-momentum" and rule.rule.params.beta == 0.5
    with pytest.raises(SpecError, match="expected a number|expected a float"):
        build_strategy("myext.momentum:ServerMomentum:beta=high", num_clients=4)
    with pytest.raises(SpecError, match="unknown"):
        build_strategy("myext.momentum:ServerMomentum:betta=0.5", num_clients=4)

    def final(strategy, tag):
        run = run_inprocess({**SMALL, "num-server-rounds": 3, "strategy": strategy, "availability": "bernoulli:p=0.6",
                             "results-dir": str(tmp_path), "run-name": tag})
        return torch.load(run / "final_model.pt")

    def close(a, b):
        return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)

    plain, avg = final("myext.momentum:ServerMomentum:beta=0", "m0"), final("fedavg-active", "avg")
    assert close(plain, avg)
    momentum = final("myext.momentum:ServerMomentum:beta=0.9", "m9")
    assert close(momentum, final("fedavgm:server-momentum=0.9", "flower")) and not close(momentum, avg)
    a = build_strategy("myext.momentum:ServerMomentum:beta=0.9", num_clients=4)
    a.rule_state = a.rule.State(np.arange(3.0))
    b = build_strategy("myext.momentum:ServerMomentum:beta=0.9", num_clients=4)
    b.load_state_dict(a.state_dict())
    assert np.array_equal(b.rule_state.velocity, np.arange(3.0))


# ------------------------------------------------------------------ solver, lr schedule, evaluation

def test_solver_recipe_is_adam_for_one_client(myext):
    """myext.solvers:Adam through the per-client engine's local_train equals torch.optim.Adam on the
    same batches; by entry point it is the same object."""
    from workloads.solvers import SolverConfig, local_train, user_solver

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    reference = copy.deepcopy(model)
    data = [(torch.randn(8, 5), torch.randint(0, 3, (8,))) for _ in range(6)]
    result = local_train(model, iter(data), 6, SolverConfig(kind="myext.solvers:Adam:beta2=0.99", lr=0.01))
    opt = torch.optim.Adam(reference.parameters(), lr=0.01, betas=(0.9, 0.99), foreach=False)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert result.num_steps == 6 and result.a_norm == 6.0  # LocalSolver's default: plain SGD's tau
    assert type(user_solver("adam:beta2=0.99", ("sgd",))).__name__ == "Adam"
    with pytest.raises(SpecError, match="unknown parameter"):
        SolverConfig(kind="myext.solvers:Adam:beta3=0.5")


USER_SGD = '''
from workloads.solvers import LocalSolver


class PlainSGD(LocalSolver):
    batched = False  # one client at a time: the cohort engine calls it per client

    def step(self, params, grads, state, lr):
        assert params[0].shape[0] == 1
        for p, g in zip(params, grads):
            p.add_(g, alpha=-lr)
'''


def rows_of(run):
    return [{k: v for k, v in r.items() if k not in ("round-time", "wall-time")} for r in read_metrics(run)]


def test_a_user_solver_runs_in_both_engines(myext, tmp_path, monkeypatch):
    """A one-client-at-a-time SGD of the user's equals solver=sgd bit for bit in the cohort engine;
    Adam by module:attr and by entry point gives the same numbers, and the per-client and cohort
    engines agree on it to float rounding, with unequal local steps (the cohort engine ran it:
    config.json)."""
    (tmp_path / "usersgd.py").write_text(USER_SGD)
    monkeypatch.syspath_prepend(str(tmp_path))
    base = {**SMALL, **MODULE_SPECS, "availability": "bernoulli:p=0.7", "results-dir": str(tmp_path),
            "engine": "cohort", "num-server-rounds": 2}

    def run(tag, **over):
        return run_inprocess({**base, "run-name": tag, **over})

    assert rows_of(run("sgd", solver="sgd")) == rows_of(run("user-sgd", solver="usersgd:PlainSGD"))
    adam = {"solver": "myext.solvers:Adam", "lr": 0.01, "local-steps": "epochs:min=1,max=2"}  # unequal steps
    cohort = run("adam-cohort", **adam)
    assert json.loads((cohort / "config.json").read_text())["engine-used"] == "cohort"
    entry = run("adam-entry", **{**adam, "solver": "adam"})
    per_client = run("adam-pc", **adam, engine="per-client")
    assert rows_of(cohort) == rows_of(entry)
    for a, b in zip(rows_of(cohort), rows_of(per_client), strict=True):
        assert a["participants"] == b["participants"]
        assert a["train-loss"] == pytest.approx(b["train-loss"], rel=1e-4)
    assert rows_of(cohort)[-1]["test-loss"] == pytest.approx(rows_of(per_client)[-1]["test-loss"], rel=1e-4)
    assert rows_of(cohort) != rows_of(run("sgd-lr", **{**adam, "solver": "sgd"}))  # Adam is not SGD


def test_lr_schedule_recipe_and_cosine(myext, tmp_path):
    """The schedule is a function of the round: by module:attr, by entry point and in a run (the lr
    the clients train with); the built-in cosine by its formula; a module that does not import says so."""
    from workloads.solvers import lr_at

    spec = "myext.lr:warmup_cosine:warmup=2,rounds=6,floor=0.1"
    decay = [(1 + math.cos(math.pi * k / 4)) / 2 for k in range(5)]  # (t - warmup) / (rounds - warmup)
    want = [0.05, 0.1, *(0.1 * (0.1 + 0.9 * d) for d in decay), 0.01]  # warm-up (t 0-1), decay (t 2-6), floor
    assert [lr_at(spec, 0.1, t) for t in range(8)] == pytest.approx(want)
    assert [lr_at("warmup-cosine:warmup=2,rounds=6,floor=0.1", 0.1, t) for t in range(8)] == pytest.approx(want)
    assert [lr_at("cosine:rounds=4", 0.2, t) for t in range(4)] == pytest.approx(
        [0.2, 0.1 * (1 + math.cos(math.pi / 4)), 0.1, 0.1 * (1 + math.cos(3 * math.pi / 4))])
    assert lr_at("cosine:rounds=4,floor=0.5", 0.2, 9) == pytest.approx(0.1)
    with pytest.raises(SpecError, match="unknown parameter"):
        lr_at("myext.lr:warmup_cosine:warm=2", 0.1, 0)
    with pytest.raises(ExtensionError, match="cannot import module 'tzfl.local'"):
        lr_at("tzfl.local:cosine", 0.1, 0)

    def first_round(tag, **over):  # round 1 trains with the schedule's lr 0.05 (half of lr = 0.1)
        return rows_of(run_inprocess({**SMALL, **MODULE_SPECS, "availability": "always", "num-server-rounds": 1,
                                      "results-dir": str(tmp_path), "run-name": tag, **over}))

    scheduled = first_round("scheduled", **{"lr-schedule": spec})
    assert scheduled == first_round("half", lr=0.05) != first_round("full")


def test_evaluation_recipe_is_recorded_per_round_and_drawn(myext, tmp_path):
    """myext.evaluation:per_group runs on the server's global model every evaluated round: its
    metrics land in metrics.jsonl as test-<name> (recomputed here from the final model), in
    evaluation.png, and by entry point give the same numbers."""
    from myext.evaluation import per_group

    from runconfig import WorkloadConfig, from_run_config
    from workloads.tensordata import TensorData
    from workloads.workload import Workload, get_workload

    over = {**SMALL, **MODULE_SPECS, "num-server-rounds": 3, "eval-every": 1, "results-dir": str(tmp_path)}
    run = run_inprocess({**over, "evaluation": "myext.evaluation:per_group:worst=0.5", "run-name": "eval"})
    rows = read_metrics(run)
    names = {"test-client-accuracy-mean", "test-client-accuracy-worst", "test-client-accuracy-std",
             *(f"test-class-accuracy-{c}" for c in range(3))}
    assert all(names <= set(r) for r in rows) and "test-accuracy" in rows[-1]
    assert (run / "evaluation.png").is_file()
    config = json.loads((run / "config.json").read_text())
    wl: Workload = get_workload(from_run_config(WorkloadConfig, config))
    model = wl.new_model()
    model.load_state_dict(torch.load(run / "final_model.pt"))
    model.eval()
    again = per_group(model, wl.test, wl.train, wl.parts, "cpu", worst=0.5)
    assert {f"test-{k}": v for k, v in again.items()} == pytest.approx({k: rows[-1][k] for k in names})
    assert isinstance(wl.test, TensorData) and again["client-accuracy-worst"] <= again["client-accuracy-mean"]
    entry = run_inprocess({**over, "evaluation": "per-group:worst=0.5", "run-name": "eval-entry"})
    assert rows_of(entry) == rows_of(run)
