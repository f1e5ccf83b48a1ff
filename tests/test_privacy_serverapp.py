"""Central DP in the project's own ServerApp (run config dp-*, privacy.rounds): a run under churn
records each round's (ε, δ) in metrics.jsonl, and a
setting whose accounting would not hold is refused before any folder exists."""

import numpy as np
import pytest

from experiments.inprocess import run_inprocess
from privacy import METHODS, ChurnAccountant
from runconfig import ConfigError
from server_app.config import ACCOUNTANTS
from server_app.results import read_matrix, read_metrics

SMALL = {"num-server-rounds": 4, "num-clients": 6, "model": "mlp", "local-steps": "steps:n=2",
         "availability": "bernoulli:p=0.5", "schedule-seed": 3, "checkpoint-every": 0, "eval-every": 0,
         "progress": False, "strategy": "fedavg-active", "weighting": "equal", "dp-noise-multiplier": 1.5,
         "dp-clipping-norm": 0.5, "dp-delta": 1e-4}


def test_a_run_under_churn_records_epsilon_per_round(tmp_path):
    """Every row has the round's figures, the participants those of participation.csv, and ε
    the accountant's on that realised schedule (the model's noise is the loop's own)."""
    run = run_inprocess({**SMALL, "results-dir": str(tmp_path)})
    rows = read_metrics(run)
    participation = read_matrix(run / "participation.csv")
    assert 0 < participation.sum() < participation.size
    expected = ChurnAccountant(6, 1e-4)
    for r, row in enumerate(participation, start=1):
        expected.compose(r, np.flatnonzero(row).tolist(), 1.5)
    assert [row["dp-participants"] for row in rows] == participation.sum(axis=1).tolist()
    assert [row["dp-epsilon"] for row in rows] == pytest.approx([s.epsilon for s in expected.history], rel=1e-9)
    assert [row["dp-epsilon-worst-client"] for row in rows] == pytest.approx(
        [s.epsilon_worst_client for s in expected.history], rel=1e-9)
    assert all(row["dp-noise-multiplier"] == (1.5 if row["participants"] else 0.0) for row in rows)


def test_noise_changes_the_model_and_clipping_bounds_the_step(tmp_path):
    """Same run, seeds and schedule without DP: the model differs once noise is added."""
    with_dp = read_metrics(run_inprocess({**SMALL, "results-dir": str(tmp_path / "a"), "eval-every": 1}))
    without = read_metrics(run_inprocess({**SMALL, "results-dir": str(tmp_path / "b"), "eval-every": 1,
                                          "dp-noise-multiplier": 0.0}))
    assert [r["participants"] for r in with_dp] == [r["participants"] for r in without]
    assert "dp-epsilon" not in without[-1]
    assert with_dp[-1]["test-loss"] != without[-1]["test-loss"]


@pytest.mark.parametrize("over, match", [
    ({"strategy": "fedau"}, "'strategy' = 'fedau'.*fedavg-active"),
    ({"weighting": "auto"}, "'weighting' = 'auto'.*'equal'"),
    ({"dp-clipping-norm": 0.0}, "'dp-clipping-norm' = 0.0"),
    ({"dp-delta": 1.0}, "'dp-delta' = 1.0"),
    ({"dp-accountant": "rpd"}, "'dp-accountant' = 'rpd'"),
])
def test_settings_the_accountant_cannot_stand_behind_are_refused(over, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        run_inprocess({**SMALL, "results-dir": str(tmp_path), **over})
    assert not any(tmp_path.iterdir())  # refused before the results folder


def test_the_run_configs_accountants_are_the_accountants():
    assert ACCOUNTANTS == METHODS


def test_the_report_states_the_epsilon_each_cell_ended_with(tmp_path):
    """Two cells of one study, with and without churn: the report's privacy table has each cell's
    last-round ε, worst-client ε and δ, as their metrics.jsonl have them."""
    from experiments.report import write_report
    from experiments.study import Sweep

    sweep = Sweep(name="dp", base=SMALL, axes={"dynamics": {"always": {"availability": "always"},
                                                             "churn": {"availability": "bernoulli:p=0.5"}},
                                               "rule": {"fedavg-active": {}}}, seeds=(0,), notes="DP under churn.")
    results = tmp_path / "results"
    for dynamics, over in sweep.axes["dynamics"].items():
        run_inprocess({**SMALL, **over, "eval-every": 1, "results-dir": str(results),
                       "run-name": f"{dynamics}__fedavg-active__s0"})
    md = write_report(sweep, results, tmp_path / "report").read_text()
    for dynamics in ("always", "churn"):
        last = read_metrics(results / f"{dynamics}__fedavg-active__s0")[-1]
        row = next(line for line in md.splitlines() if line.startswith(f"| {dynamics} / fedavg-active | "))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[2:6] == ["1.5", f"{last['dp-epsilon']:.2f}", f"{last['dp-epsilon-worst-client']:.2f}", "0.0001"]
    always = read_metrics(results / "always__fedavg-active__s0")[-1]
    churn = read_metrics(results / "churn__fedavg-active__s0")[-1]
    assert churn["dp-epsilon"] < always["dp-epsilon"]  # fewer clients a round: amplified, and fewer rounds each


def test_a_dp_run_resumed_from_a_checkpoint_ends_as_the_uninterrupted_run(tmp_path):
    """The checkpoint holds the accountant's rounds: the resumed run's ε goes on from them (not
    from 0), and its noise (the loop's seeded generator, restored) gives the same model, bit for bit."""
    import shutil

    import torch

    cfg = {**SMALL, "results-dir": str(tmp_path), "checkpoint-every": 1}
    full = run_inprocess({**cfg, "run-name": "full"})
    copy = tmp_path / "resumed"
    shutil.copytree(full, copy)
    (copy / "final_model.pt").unlink()
    resumed = run_inprocess({**cfg, "resume-from": str(copy / "checkpoints" / "round-0002.pt")})
    def timeless(run):
        return [{k: v for k, v in r.items() if "time" not in k} for r in read_metrics(run)]

    assert timeless(resumed) == timeless(full) and len(timeless(full)) == 4
    assert read_metrics(resumed)[-1]["dp-epsilon"] > read_metrics(resumed)[1]["dp-epsilon"] > 0
    a, b = torch.load(full / "final_model.pt"), torch.load(resumed / "final_model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    without = run_inprocess({**cfg, "run-name": "plain", "dp-noise-multiplier": 0.0})
    with pytest.raises(ConfigError, match=r"other settings for \['dp-noise-multiplier'\]"):
        run_inprocess({**cfg, "run-name": "again", "resume-from": str(without / "checkpoints" / "round-0002.pt")})
