"""The real engines: Flower's Ray simulation, and `flwr run .` against a local SuperLink."""

import shutil

import flower_link
import pytest
from conftest import ROOT, extra_deploy
from flower_link import DEFAULT_CONTROL_PORT, DEFAULT_HTTP_PORT, local_superlink
from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from client_app.app import app as client_app
from deploy.procs import port_open
from experiments.inprocess import default_run_config, run_inprocess
from server_app.config import RunConfig
from server_app.experiment import run
from server_app.results import read_matrix, read_metrics

pytestmark = pytest.mark.slow
# round-timeout: a Ray worker starting cold on a loaded 2-core machine took over 120 s to send the
# first reply; these tests check numbers, not latency, so a slow reply must still count
SMALL = {"num-clients": 4, "num-server-rounds": 3, "local-steps": "steps:n=3", "progress": False,
         "availability": "staircase:period=2,low=0.5", "checkpoint-every": 0, "round-timeout": 600.0}
TIMES = {"round-time", "wall-time"}


def rows(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMES} for r in read_metrics(run_dir)]


def apps_with_config(run_config):
    """run_simulation passes an empty run config; these apps carry ours."""
    server = ServerApp()

    @server.main()
    def main(grid, context):
        run(grid, RunConfig.from_run_config(run_config))

    client = ClientApp()

    def with_config(msg, context):
        ctx = Context(run_id=context.run_id, node_id=context.node_id, node_config=context.node_config,
                      state=context.state, run_config=run_config)
        return client_app(msg, ctx)

    for register in (client.train, client.query, client.evaluate):
        register()(with_config)
    client.query("identity")(with_config)  # the server's identity query
    return server, client


def test_ray_simulation_gives_the_inprocess_numbers(tmp_path):
    from flwr.simulation import run_simulation

    run_config = {**default_run_config(), **SMALL, "results-dir": str(tmp_path), "run-name": "ray"}
    server, client = apps_with_config(run_config)
    run_simulation(server, client, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})
    reference = run_inprocess({**SMALL, "results-dir": str(tmp_path), "run-name": "inprocess"})
    ray_rows, ref_rows = rows(tmp_path / "ray"), rows(reference)
    assert len(ray_rows) == 3
    # same clients, same numbers up to float reduction order (Ray workers run torch on 1 thread)
    assert [r["participants"] for r in ray_rows] == [r["participants"] for r in ref_rows]
    for got, want in zip(ray_rows, ref_rows, strict=True):
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == (pytest.approx(value, rel=1e-5) if isinstance(value, float) else value), key
    assert (read_matrix(tmp_path / "ray" / "participation.csv")
            == read_matrix(tmp_path / "ray" / "availability.csv")).all()


@pytest.fixture(scope="module")
def beside_another_flower(tmp_path_factory):
    """Another Flower app's local SuperLink on Flower's default ports (39091, 39093), as when a
    user runs their own app on this machine: the tests here must neither submit to it nor stop
    it. Yields the environment that lists its runs (None where the ports are taken already: then
    someone's SuperLink is there, which is the situation itself)."""
    if port_open(DEFAULT_HTTP_PORT):
        yield None
        return
    with local_superlink(tmp_path_factory.mktemp("other-flwr-home"), DEFAULT_HTTP_PORT,
                         DEFAULT_CONTROL_PORT) as env:
        yield env


def flwr_run(tmp_path, run_config: str) -> tuple[str, str]:
    """`flwr run .` on a SuperLink of its own; returns (output, the run's final status)."""
    with local_superlink(tmp_path / "flwr-home") as env:
        return flower_link.flwr_run(ROOT, env, tmp_path, run_config)


FLWR_SMALL = "num-clients=4 num-server-rounds=3 local-steps='steps:n=3' checkpoint-every=0 round-timeout=600.0"
needs_flwr = pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH")


@needs_flwr
def test_flwr_run_completes_and_writes_its_results(tmp_path, beside_another_flower):
    results = tmp_path / "results"
    log, status = flwr_run(tmp_path, f"{FLWR_SMALL} results-dir='{results}' run-name='flwr'")
    assert status == "finished:completed", log[-3000:]
    if beside_another_flower is not None:  # the other app's SuperLink got no run and still serves
        assert flower_link.runs(beside_another_flower, tmp_path) == {}
    run_dir = results / "flwr"
    assert f"results: {run_dir}" in log
    assert [r["round"] for r in read_metrics(run_dir)] == [1, 2, 3]
    for name in ("config.json", "participation.csv", "final_model.pt", "accuracy.png", "participation.png"):
        assert (run_dir / name).is_file(), name


@needs_flwr
@extra_deploy("plain flwr run of a bad config (~90 s)",
              "tests/test_runner.py's failed run (the wrapper prints the ServerApp's reason) and the config checks")
def test_flwr_run_with_a_bad_config_ends_failed_with_the_reason(tmp_path):
    log, status = flwr_run(tmp_path, f"{FLWR_SMALL} strategy='fedsgd' results-dir='{tmp_path}'")
    assert status == "finished:failed"
    assert "unknown strategy 'fedsgd'" in log
