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
import time
import urllib.request

import pytest
from conftest import ROOT

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH")]
EXAMPLE = ROOT / "examples" / "quickstart-flchurn"
# pow-d's probe waits probe-timeout for the losses: a cold Ray worker on a loaded machine took more
# than the default 60 s to answer its first message
RULES = ["fedavg-active", "fedau", "fednova", "fedawe", "pow-d:d=4,m=2,probe-timeout=600"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def flwr_env(tmp_path_factory):
    """One local SuperLink for every rule, on ports of its own (Flower's fixed defaults would meet
    another local SuperLink), started here with Flower's own command line because `flwr run`
    gives it only 15 s to come up, too little on a loaded machine; `flwr run` then uses it."""
    home = tmp_path_factory.mktemp("flwr-home")
    http, control = free_port(), free_port()
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
           "OMP_NUM_THREADS": "1", "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    (home / "local-superlink").mkdir()
    superlink = subprocess.Popen(  # as flwr.cli.local_superlink starts it
        ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
         "--control-api-address", f"127.0.0.1:{control}", "--host", "127.0.0.1", "--port", str(http),
         "--database", str(home / "local-superlink" / "state.db")],
        env=env, cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the template saves
    # final_model.pt in the ServerApp's working directory: the SuperLink's
    try:
        deadline = time.monotonic() + 180
        while not healthy(http):
            assert superlink.poll() is None and time.monotonic() < deadline, "the local SuperLink did not start"
            time.sleep(0.5)
        yield env
    finally:
        superlink.send_signal(signal.SIGTERM)
        try:
            superlink.wait(timeout=30)
        except subprocess.TimeoutExpired:
            superlink.kill()


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


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

    train = [r for r in records(log, "Aggregated MetricRecord:") if "num-participants" in r]
    trained = 2 if spec.startswith("pow-d") else 4  # pow-d trains its m = 2 of d = 4
    assert [r["num-participants"] for r in train] == [trained, trained], train
    assert all(r["num-rejected"] == 0 and r["update-norm"] > 0 for r in train), train
    initial = ast.literal_eval(re.search(r"Initial global evaluation results: (\{.*\})", log).group(1))
    final = records(log, "└──> MetricRecord:")[-1]
    assert final["loss"] != initial["loss"]  # the model changed
