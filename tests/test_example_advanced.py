"""Flower's advanced-pytorch example (examples/advanced-pytorch-flchurn: its own FedAvg subclass
with its own configure_train and start loop) with churn injected by server_app.dropin /
client_app.dropin and a rule swapped in under the same subclass, run with the real `flwr run` on a
SuperLink of its own: realised participation = the schedule, under two rules."""

import ast
import re
import shutil

import numpy as np
import pytest
from conftest import DATA_DIR, ROOT, extra_deploy
from flower_link import flwr_run, local_superlink

from availability import build_schedule
from server_app.results import read_matrix

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH"),
              pytest.mark.skipif(not (DATA_DIR / "fashion-mnist").is_dir(), reason="no offline Fashion-MNIST")]
EXAMPLE = ROOT / "examples" / "advanced-pytorch-flchurn"
ROUNDS, SPEC, SEED = 3, "bernoulli:p=0.5", 4  # seed 4: 3, 3 and 2 of 4 clients online


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory):
    with local_superlink(tmp_path_factory.mktemp("flwr-home")) as env:
        yield env


@pytest.mark.parametrize("rule", ["fedau", pytest.param("fedexp", marks=extra_deploy(
    "a second rule in Flower's advanced-pytorch example", "the fedau case"))])
def test_the_advanced_example_realises_the_schedule_under_a_rule(rule, flwr_env, tmp_path):
    config = (f"num-server-rounds={ROUNDS} strategy='{rule}' availability='{SPEC}' schedule-seed={SEED} "
              f"data-dir='{DATA_DIR}' results-dir='{tmp_path}' max-examples=2000")
    log, status = flwr_run(EXAMPLE, flwr_env, tmp_path, config)
    assert status == "finished:completed", log[-3000:]
    out = next(tmp_path.glob("*/*/participation.csv")).parent
    schedule = build_schedule(SPEC, 4, SEED).matrix(ROUNDS)
    assert 0 < schedule.sum() < schedule.size
    assert (read_matrix(out / "availability.csv") == schedule).all()
    assert (read_matrix(out / "participation.csv") == schedule).all(), (out / "participation.csv").read_text()
    train = [ast.literal_eval(m) for m in re.findall(r"Aggregated MetricRecord: (\{.*\})", log)]
    train = [r for r in train if "num-participants" in r]
    assert [r["num-participants"] for r in train] == schedule.sum(axis=1).tolist()  # the rule saw who was online
    assert all(r["num-rejected"] == 0 for r in train)
    assert (out / "final_model.pt").is_file() and (out / "results.json").is_file()  # the example's own loop ran
    assert np.isfinite([r["update-norm"] for r in train]).all()
