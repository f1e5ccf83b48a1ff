"""``python -m experiments.run --ray-address``: the refusals (no cluster needed), then a real Ray
cluster on this machine (a head and two workers, ``tests/ray_cluster.py``): the same numbers as a
single-node run, actors on several nodes, a lost worker named and never an offline client."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from deploy.procs import free_port
from deploy.waits import host_slowdown
from experiments.raycluster import (
    LOCAL,
    ClusterError,
    NodeAnswer,
    answers_differ,
    fitting,
    parse_address,
    paths_unseen,
    ray_address_env,
)
from experiments.run import main
from server_app.results import read_metrics
from server_app.versions import project_fingerprint

TIMES = {"round-time", "wall-time"}
LOST_KEY = "ray-workers-lost"


def refused(capsys, *argv: str) -> str:
    """Run the wrapper, which must exit 2 before submitting; its error."""
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_flowers_init_args_for_ray_resources_are_refused_on_a_cluster(capsys):
    for key in ("init-args-num-cpus", "init-args-num-gpus"):
        err = refused(capsys, "--ray-address", "127.0.0.1:1", "--federation-config", f"{key}=2")
        assert f"--federation-config {key}=2" in err and "joining an existing cluster" in err


def test_a_relative_data_dir_and_another_backend_are_refused_on_a_cluster(capsys):
    err = refused(capsys, "--ray-address", "127.0.0.1:1", "--run-config", "data-dir='data'")
    assert "'data-dir' = 'data' is relative" in err
    err = refused(capsys, "--ray-address", "127.0.0.1:1", "--federation-config", "backend='other'")
    assert "backend=other" in err


def test_federation_keys_are_flowers_and_ours_stay_with_our_flags(capsys):
    err = refused(capsys, "--federation-config", "init-args-num-cpu=2")
    assert "init-args-num-cpu" in err and "did you mean 'init-args-num-cpus'?" in err
    err = refused(capsys, "--federation-config", "client-resources-num-cpus=2")
    assert "set it with --num-cpus" in err


def test_an_address_that_is_not_host_port_or_does_not_answer_is_named(capsys):
    with pytest.raises(ClusterError, match="ray://"):
        parse_address("ray://head:10001")
    assert parse_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    port = free_port()  # nothing listens there
    err = refused(capsys, "--skip-checks", "--ray-address", f"127.0.0.1:{port}", "--run-config", "num-clients=2")
    assert f"--ray-address 127.0.0.1:{port}: the Ray cluster does not answer" in err


def test_without_the_flag_ray_starts_locally_even_where_ray_address_is_set():
    assert ray_address_env(None, {}) == (LOCAL, None)
    address, note = ray_address_env(None, {"RAY_ADDRESS": "10.0.0.5:6379"})
    assert address == LOCAL and note is not None and "--ray-address 10.0.0.5:6379" in note
    assert ray_address_env("10.0.0.5:6379", {"RAY_ADDRESS": "other:1"}) == ("10.0.0.5:6379", None)


def node(i: int, cpus: float = 1.0, gpus: float = 0.0, alive: bool = True) -> dict:
    return {"node-id": f"n{i}", "address": f"10.0.0.{i}", "cpus": cpus, "gpus": gpus, "alive": alive, "head": i == 0}


def test_one_actor_must_fit_a_live_node_and_every_node_must_run_this_clientapp():
    nodes = [node(0, 2), node(1, 8, alive=False), node(2, 4, gpus=1)]
    assert [n["node-id"] for n in fitting(nodes, 4, 0)] == ["n2"]
    assert fitting(nodes, 8, 0) == [] and fitting(nodes, 1, 0.5) == [node(2, 4, gpus=1)]
    here = {"flchurn": {"version": "0.1.0", "sources": "aa"}, "torch": "2.15.0"}
    answers = [NodeAnswer(node(0), here, "", {"/s/m": True}),
               NodeAnswer(node(1), {**here, "flchurn": {"version": "0.1.0", "sources": "bb"}}, "", {"/s/m": True}),
               NodeAnswer(node(2), {}, "ModuleNotFoundError: No module named 'client_app'", {"/s/m": False})]
    lines = answers_differ(here, answers)
    assert len(lines) == 2 and lines[0].startswith("node n1 (10.0.0.1): flchurn") and "'bb'" in lines[0]
    assert lines[1] == "node n2 (10.0.0.2): the ClientApp does not import: ModuleNotFoundError: No module named 'client_app'"
    assert paths_unseen({"state-dir": ("/s", "/s/m")}, answers) == [
        "run config 'state-dir' = '/s' is not there on node n2 (10.0.0.2)"]


def test_the_fingerprint_changes_with_any_source_file(tmp_path, monkeypatch):
    pkg = tmp_path / "fppkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    first = project_fingerprint(("fppkg",))
    assert project_fingerprint(("fppkg",)) == first
    (pkg / "sub" / "a.py").write_text("x = 2\n")
    assert project_fingerprint(("fppkg",))["sources"] != first["sources"]
    assert project_fingerprint(("fppkg", "no_such_package_here"))["sources"] != first["sources"]
    assert project_fingerprint()["version"] != ""


def test_a_node_dead_in_rays_table_is_reported_once_and_one_dead_before_the_run_never(monkeypatch):
    from server_app import raylost

    dead: dict[str, str] = {"old": "10.0.0.9"}
    monkeypatch.setattr(raylost, "dead_ray_nodes", lambda: dict(dead))
    lost = raylost.LostWorkers()
    lost.begin()
    assert lost.take() == {}  # dead before the run began: not this run's loss
    dead["w2"] = "10.0.0.2"
    assert lost.take() == {LOST_KEY: [{"ray-node": "w2", "address": "10.0.0.2", "actor": "", "error": raylost.NODE_DIED}]}
    assert lost.take() == {}  # reported once
    # a loss seen under a message names its node: the node table does not report it again
    monkeypatch.setattr(raylost, "ray_actor_node", lambda actor: {"ray-node": "w3", "address": "10.0.0.3"})
    lost.note("actor-1", RuntimeError("died"))
    dead["w3"] = "10.0.0.3"
    assert [e["ray-node"] for e in lost.take()[LOST_KEY]] == ["w3"]
    assert lost.take() == {}
    monkeypatch.setattr(raylost, "dead_ray_nodes", lambda: None)  # no Ray in this process
    assert lost.take() == {}


# --- a real cluster -------------------------------------------------------------------------------

# tiny, different rule / seeds / schedule; every round has someone online. stream=false: a streaming
# rule folds replies in the order they arrive, which differs between any two Ray runs (a 3-reply
# round's model moved by 1 ulp, 7e-9, between a single-node and a cluster run); a held round folds
# them in client order. 6 rounds of 1000-1200 local steps (1-2 s each; with 2 steps rounds 2-6 took
# 0.5 s in all, and with 400 steps 3 s, and the run ended before Ray knew of the loss): the worker
# killed after round 1 is dead in Ray's node table (health checks every 0.5 s, tests/ray_cluster.py)
# before the last round
CONFIGS = {
    "a": "num-clients=3 num-server-rounds=6 local-steps='steps:n=1000' checkpoint-every=0 model='logreg' "
         "strategy='fedavg-active:stream=false' availability='always' train-seed=1 data-seed=2",
    "b": "num-clients=3 num-server-rounds=6 local-steps='steps:n=1200' checkpoint-every=0 model='logreg' "
         "strategy='fedau:stream=false' availability='bernoulli:p=0.7' schedule-seed=3 train-seed=4",
}
FULL = bool(os.environ.get("FLCHURN_EXTRA_DEPLOY_TESTS"))


def wrapper(tmp_path: Path, name: str, config: str, *extra: str, env: dict | None = None) -> subprocess.Popen:
    out = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen([sys.executable, "-m", "experiments.run", "--flwr-home", str(tmp_path / f"home-{name}"),
                             "--run-config", f"{config} results-dir='{tmp_path / 'results'}' run-name='{name}'",
                             *extra], cwd=ROOT, env=env or os.environ.copy(), stdout=out, stderr=subprocess.STDOUT,
                            text=True)


def finish(tmp_path: Path, name: str, proc: subprocess.Popen) -> tuple[list[dict], dict, str]:
    proc.wait(timeout=900 * host_slowdown())
    log = (tmp_path / f"{name}.log").read_text()
    assert proc.returncode == 0, log[-4000:]
    run_dir = tmp_path / "results" / name
    return read_metrics(run_dir), json.loads((run_dir / "config.json").read_text()), log


def numbers(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMES and k != LOST_KEY} for r in rows]


@pytest.fixture(scope="module")
def cluster():
    """A head and two workers; as root the head on a bridge's address and worker w2 a host of its
    own (a network namespace with its own address, tests/multihost_hosts.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from multihost_hosts import NamespaceHosts, can_make_hosts
    from ray_cluster import RayCluster

    hosts = NamespaceHosts(1).create() if can_make_hosts() is None else None
    c = RayCluster(workers=2, hosts=hosts)
    try:
        yield c.start()
    finally:
        c.stop()
        assert c.leftovers() == []
        if hosts is not None:
            hosts.remove()
            assert hosts.leftovers() == []


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "b",  # CI: one config (cluster start ~45 s, then the two runs side by side, 2-4 minutes here)
    pytest.param("a", marks=pytest.mark.skipif(not FULL, reason="a second config: opt-in with "
                                                "FLCHURN_EXTRA_DEPLOY_TESTS=1 (CI's 30-minute budget)")),
])
def test_a_cluster_run_equals_the_single_node_run_places_actors_on_several_nodes_and_survives_a_lost_worker(
        tmp_path, cluster, name):
    # worker w2 is killed (every process of it: a lost machine) after round 1 of the cluster run; the
    # single-node run beside it has RAY_ADDRESS pointing at the cluster: it must not join it
    cluster.revive("w2")  # killed by an earlier case
    t0 = time.monotonic()
    ids = {n["id"] for n in cluster.nodes() if n["alive"]}
    victim = cluster.node_id("w2")
    local = wrapper(tmp_path, f"local-{name}", CONFIGS[name], env={**os.environ, "RAY_ADDRESS": cluster.address})
    proc = wrapper(tmp_path, f"cluster-{name}", CONFIGS[name], "--ray-address", cluster.address)
    metrics = tmp_path / "results" / f"cluster-{name}" / "metrics.jsonl"
    deadline = time.monotonic() + 600 * host_slowdown()
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "round 1 never recorded"
        time.sleep(0.2)
    assert cluster.kill("w2")  # at once: the later rounds take seconds
    rows, config, log = finish(tmp_path, f"cluster-{name}", proc)
    ref_rows, ref_config, ref_log = finish(tmp_path, f"local-{name}", local)
    wall = time.monotonic() - t0
    placed = {a["node"] for a in cluster.actors("ClientAppActor")}  # Ray's table keeps the dead actors' nodes

    assert f"pass --ray-address {cluster.address} to run on that cluster" in ref_log
    assert len(ref_config["ray"]["nodes"]) == 1 and ref_config["ray"]["nodes"][0]["node-id"] not in ids
    assert numbers(rows) == numbers(ref_rows)  # the same numbers, and the lost worker cost no client its round
    assert {n["node-id"] for n in config["ray"]["nodes"] if n["alive"]} == ids
    assert config["versions"]["flchurn"] == project_fingerprint() and config["versions"]["ray"]
    assert len(placed & ids) >= 2, placed
    if cluster.hosts is not None:  # w2 a host of its own: the run reached it at its own address
        assert {n["address"] for n in config["ray"]["nodes"]} == {cluster.node_ip("head"), cluster.node_ip("w2")}
        assert cluster.node_ip("w2") != cluster.node_ip("head")
    lost = [e for r in rows for e in r.get(LOST_KEY, [])]
    assert lost and {e["ray-node"] for e in lost} == {victim}, rows
    assert f"Ray worker lost: node {victim}" in log
    print(f"\ncluster start {cluster.started_s:.0f} s, single-node and cluster runs side by side {wall:.0f} s, "
          f"actors on {len(placed & ids)} nodes, lost: {lost}")
