"""Flower's quickstart template with the project's strategies (examples/quickstart-flchurn), run
with the real `flwr run` on a local SuperLink of its own, 2 rounds per rule."""

import ast
import re
import shutil

import pytest
from conftest import ROOT, extra_deploy
from flower_link import flwr_run, local_superlink

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH")]
EXAMPLE = ROOT / "examples" / "quickstart-flchurn"
# pow-d's probe waits probe-timeout for the losses: a cold Ray worker on a loaded machine took more
# than the default 60 s to answer its first message
# in CI the two rules with a stage of their own in Flower's template: FedAWE (its client half keeps
# a copy) and power-of-choice (its probe round); the others are opt-in (each 50-85 s here), and every
# rule runs as a drop-in in process in tests/test_dropin.py
OPT_IN = extra_deploy("another rule in Flower's template under flwr run", "the fedawe case here")
POW_D_OPT_IN = extra_deploy("power-of-choice in Flower's template under flwr run (~35-50 s)",
                            "the fedawe case here, and pow-d's probes in tests/test_power_of_choice.py (in process) "
                            "and under Flower's own Strategy.start in tests/test_sampling.py")
RULES = [pytest.param("fedavg-active", marks=OPT_IN), pytest.param("fedau", marks=OPT_IN),
         pytest.param("fednova", marks=OPT_IN), "fedawe", pytest.param("pow-d:d=4,m=2,probe-timeout=600", marks=POW_D_OPT_IN)]


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory):
    """One local SuperLink of its own for every rule (:mod:`flower_link`)."""
    with local_superlink(tmp_path_factory.mktemp("flwr-home")) as env:
        yield env


def records(log: str, marker: str) -> list[dict]:
    """The dicts Flower's ``start`` logs after ``marker`` (one per round)."""
    return [ast.literal_eval(m) for m in re.findall(re.escape(marker) + r" (\{.*\})", log)]


@pytest.mark.parametrize("spec", RULES)
def test_flowers_template_runs_the_rule_with_flwr_run(spec, flwr_env, tmp_path):
    log, status = flwr_run(EXAMPLE, flwr_env, tmp_path, f"num-server-rounds=2 strategy='{spec}'")
    assert status == "finished:completed", log[-3000:]  # `flwr run` exits 0 even when it failed

    train = [r for r in records(log, "Aggregated MetricRecord:") if "num-participants" in r]
    trained = 2 if spec.startswith("pow-d") else 4  # pow-d trains its m = 2 of d = 4
    assert [r["num-participants"] for r in train] == [trained, trained], train
    assert all(r["num-rejected"] == 0 and r["update-norm"] > 0 for r in train), train
    initial = ast.literal_eval(re.search(r"Initial global evaluation results: (\{.*\})", log).group(1))
    final = records(log, "└──> MetricRecord:")[-1]
    assert final["loss"] != initial["loss"]  # the model changed
