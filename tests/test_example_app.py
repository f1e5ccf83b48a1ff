"""Flower's quickstart template with the project's strategies (examples/quickstart-flchurn), run
with the real `flwr run` on a local SuperLink of its own, 2 rounds per rule."""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH")]
EXAMPLE = ROOT / "examples" / "quickstart-flchurn"
RULES = ["fedavg-active", "fedau", "fednova", "fedawe", "pow-d:d=4,m=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory):
    """One local SuperLink for every rule (started by the first `flwr run`), on ports of its own
    so that it never meets another local SuperLink on Flower's fixed default ports."""
    home = tmp_path_factory.mktemp("flwr-home")
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           "OMP_NUM_THREADS": "1", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    yield env
    out = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True).stdout
    for pid in map(int, out.split()):
        os.kill(pid, signal.SIGTERM)


def records(log: str, marker: str) -> list[dict]:
    """The dicts Flower's ``start`` logs after ``marker`` (one per round)."""
    return [ast.literal_eval(m) for m in re.findall(re.escape(marker) + r" (\{.*\})", log)]


@pytest.mark.parametrize("spec", RULES)
def test_flowers_template_runs_the_rule_with_flwr_run(spec, flwr_env, tmp_path):
    proc = subprocess.run(
        ["flwr", "run", str(EXAMPLE), "--stream", "--run-config", f"num-server-rounds=2 strategy='{spec}'",
         "--federation-config", "num-supernodes=4 client-resources-num-cpus=1"],
        env=flwr_env, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    run_id = re.search(r"Successfully started run (\d+)", log).group(1)
    ls = subprocess.run(["flwr", "ls", "--format", "json"], env=flwr_env, capture_output=True, text=True,
                        timeout=60, cwd=tmp_path)
    status = {str(r["run-id"]): r["status"] for r in json.loads(ls.stdout)["runs"]}
    assert status[run_id] == "finished:completed", log[-3000:]  # `flwr run` exits 0 even when it failed

    train = records(log, "Aggregated MetricRecord:")[::2]  # train, then evaluate, each round
    assert [r["num-participants"] for r in train] == [2, 2] if spec.startswith("pow-d") else [4, 4]
    assert all(r["num-rejected"] == 0 and r["update-norm"] > 0 for r in train), train
    initial = ast.literal_eval(re.search(r"Initial global evaluation results: (\{.*\})", log).group(1))
    final = records(log, "└──> MetricRecord:")[-1]
    assert final["loss"] != initial["loss"]  # the model changed
