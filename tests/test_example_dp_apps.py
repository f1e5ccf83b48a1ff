"""Flower's fl-dp-sa (DP with client-side fixed clipping + SecAgg+, a client_fn NumPyClient app on
the legacy DefaultWorkflow) and the `flwr new` template (quickstart-pytorch, Message API, Flower's
FedAvg.start) with churn (examples/*-flchurn), in simulation: the example's own ServerApp main and
ClientApp on an in-process grid (Flower's messages without Ray), offline data, 6 clients."""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import DATA_DIR, ROOT, extra_deploy
from flwr.app import Context, RecordDict
from flwr.supercore.run import Run
from test_churn_workflows import SerialisingGrid
from test_example_churn_apps import example, rows

from availability import build_schedule
from privacy import ChurnAccountant
from server_app.results import read_matrix

N, SPEC, SEED, ROUNDS = 6, "bernoulli:p=0.6", 3, 3  # seed 3: 5, 3 and 5 of 6 clients online


def run_main(server, client, run_config, num_clients=N):
    grid = SerialisingGrid(num_clients, run_config, client_app=client.app)
    grid.set_run(Run.create_empty(1))
    torch.manual_seed(0)
    server.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    return grid


@pytest.mark.skipif(not (DATA_DIR / "mnist").is_dir(), reason="no offline MNIST")
def test_fl_dp_sa_adds_noise_for_who_took_part_and_records_epsilon_per_round(tmp_path, monkeypatch, caplog):
    """Flower's DP + SecAgg+ example with the documented lines: the rounds with at least SecAgg+'s
    threshold (4, = min_fit_clients) online complete with 4 sampled online clients, the round with 3
    online halts; privacy.jsonl has one line per round, each released round at the configured
    multiplier with q = 4/6, and its ε is the accountant's on that schedule (nothing released in the
    halted round)."""
    monkeypatch.chdir(tmp_path)
    server, client = example(monkeypatch, "fl-dp-sa-flchurn", "fl_dp_sa")
    config = {"noise-multiplier": 0.2, "clipping-norm": 10.0, "num-sampled-clients": 20, "num-shares": 7,
              "reconstruction-threshold": 4, "data-dir": str(DATA_DIR), "max-examples": 300, "num-clients": N,
              "availability": SPEC, "schedule-seed": SEED, "results-dir": str(tmp_path / "out"), "dp-delta": 1e-4}
    with caplog.at_level("INFO", logger="flwr"):
        run_main(server, client, config)
    schedule = build_schedule(SPEC, N, SEED).matrix(ROUNDS)
    assert schedule.sum(axis=1).tolist() == [5, 3, 5]
    got = rows(tmp_path / "out")
    assert [got[r]["secure"]["status"] for r in (1, 2, 3)] == ["completed", "halted", "completed"]
    participation = read_matrix(tmp_path / "out" / "participation.csv")
    assert participation.sum(axis=1).tolist() == [4, 0, 4]
    assert not (participation & ~schedule).any()  # only online clients took part
    lines = [json.loads(x) for x in (tmp_path / "out" / "privacy.jsonl").read_text().splitlines()]
    assert [x["participants"] for x in lines] == [4, 0, 4]
    assert [x["noise_multiplier"] for x in lines] == [0.2, 0.0, 0.2]
    expected = ChurnAccountant(N, 1e-4)
    for r, row in enumerate(participation, start=1):
        expected.compose(r, np.flatnonzero(row).tolist(), 0.2)
    assert [x["epsilon"] for x in lines] == pytest.approx([s.epsilon for s in expected.history], rel=1e-9)
    # Flower's wrapper would add z·C/20 = 0.1; the noise is for the 4 that took part: z·C·max w/Σw ≈ 0.5
    stds = [float(s) for s in re.findall(r"central DP noise with ([0-9.]+) stdev added \(realised", caplog.text)]
    assert len(stds) == 2 and all(0.45 < s < 0.55 for s in stds), stds


@pytest.mark.skipif(not (DATA_DIR / "cifar10").is_dir(), reason="no offline CIFAR-10")
@pytest.mark.parametrize("strategy", ["flower-fedavg", "fedau"])
def test_the_flwr_new_template_realises_the_schedule(strategy, tmp_path, monkeypatch):
    """Flower's template with the documented lines, under Flower's FedAvg or a project rule: offline
    clients never train, participation.csv = the schedule, and the saved model is not the initial one."""
    monkeypatch.chdir(tmp_path)
    server, client = example(monkeypatch, "quickstart-pytorch-flchurn", "pytorchexample")
    config = {"num-server-rounds": ROUNDS, "fraction-evaluate": 0.0, "local-epochs": 1, "learning-rate": 0.1,
              "batch-size": 32, "data-dir": str(DATA_DIR), "max-examples": 600, "strategy": strategy,
              "num-clients": N, "availability": SPEC, "schedule-seed": SEED, "results-dir": str(tmp_path / "out")}
    run_main(server, client, config)
    schedule = build_schedule(SPEC, N, SEED).matrix(ROUNDS)
    assert (read_matrix(tmp_path / "out" / "participation.csv") == schedule).all()
    torch.manual_seed(0)  # run_main's seed: the ServerApp's first Net() is the initial model
    initial = server.Net().state_dict()
    final = torch.load(tmp_path / "final_model.pt")
    assert any(not torch.equal(initial[k], final[k]) for k in initial)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH")
@pytest.mark.skipif(not (DATA_DIR / "mnist").is_dir(), reason="no offline MNIST")
@extra_deploy("fl-dp-sa again under flwr run and Ray (minutes)", "test_fl_dp_sa_adds_noise_for_who_took_part_"
              "and_records_epsilon_per_round, in process")
def test_fl_dp_sa_under_flwr_run(tmp_path_factory, tmp_path):
    """The same example with the real `flwr run` (Ray simulation, a SuperLink of its own): the
    same rounds complete and halt, and privacy.jsonl records the three rounds."""
    from flower_link import flwr_run, local_superlink

    config = (f"data-dir='{DATA_DIR}' max-examples=300 num-clients={N} availability='{SPEC}' "
              f"schedule-seed={SEED} results-dir='{tmp_path / 'out'}'")
    with local_superlink(tmp_path_factory.mktemp("flwr-home")) as env:
        log, status = flwr_run(ROOT / "examples" / "fl-dp-sa-flchurn", env, tmp_path, config, num_supernodes=N,
                               timeout=900)
    assert status == "finished:completed", log[-3000:]
    got = rows(tmp_path / "out")
    assert [got[r]["secure"]["status"] for r in (1, 2, 3)] == ["completed", "halted", "completed"], log[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "out" / "privacy.jsonl").read_text().splitlines()]
    assert [x["participants"] for x in lines] == [4, 0, 4]
