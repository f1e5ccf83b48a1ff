"""Churn in anyone's Flower app: ``server_app.dropin.with_availability`` on the server,
``client_app.dropin.availability_mod`` on the client (in process, Flower's own ``start``)."""

import logging

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg, Strategy
from rich.console import Console
from test_dropin import Tiny, tiny_app
from test_sampling import Deployed

from availability import build_schedule
from client_app.dropin import availability_mod, identity
from experiments.inprocess import InProcessGrid, run_inprocess
from server_app.dropin import with_availability
from server_app.results import read_matrix, read_metrics
from strategies import ORACLES, STRATEGIES, build_strategy

N, ROUNDS, SPEC, SEED = 6, 5, "bernoulli:p=0.5", 3


def foreign_app(extra_mods: tuple = (), **kwargs) -> ClientApp:
    """Flower's template ClientApp (tests.test_dropin) with the two churn lines added (after the
    user's own ``extra_mods``)."""
    app = tiny_app(mods=(*extra_mods, availability_mod), **kwargs)
    app.query("identity")(identity)
    return app


def flower_fedavg() -> FedAvg:
    """Flower's FedAvg taking whoever is online: its defaults (2 nodes) wait for ever when fewer are
    connected, under churn as in a deployment."""
    return FedAvg(min_available_nodes=0, min_train_nodes=0, min_evaluate_nodes=0)


def start(strategy, grid, rounds=ROUNDS):
    torch.manual_seed(0)
    return Strategy.start(strategy, grid=grid, initial_arrays=ArrayRecord(Tiny().state_dict()), num_rounds=rounds,
                          timeout=60, train_config=ConfigRecord({"lr": 0.5}))


class Recording(InProcessGrid):
    """Notes (round, client) of every TRAIN message when it is delivered (Flower's FedAvg reuses
    one ConfigRecord across rounds, so a delivered message's config shows the latest round)."""

    def deliver(self, msg):
        if msg.metadata.message_type == MessageType.TRAIN:
            self.trained.append((int(msg.content["config"]["server-round"]), self.partition_of[msg.metadata.dst_node_id]))
        return super().deliver(msg)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[tuple[int, int]] = []


def trained(grid: Recording) -> list[list[int]]:
    """Per round, the clients a TRAIN message was delivered to."""
    return [sorted(c for r, c in grid.trained if r == rnd) for rnd in range(1, ROUNDS + 1)]


@pytest.mark.parametrize("strategy", ["flower-fedavg", "fedau", "fedawe"])
def test_churn_in_a_foreign_app_equals_churn_in_the_projects_app(strategy, tmp_path, monkeypatch):
    """Same schedule, same N, same seed: the project's ServerApp (in process) and a foreign app
    under Flower's start (Flower's FedAvg or a rule) realise the same participation, = the schedule."""
    monkeypatch.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)
    ours = run_inprocess({"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": N,
                          "num-server-rounds": ROUNDS, "local-steps": "steps:n=1", "batch-size": 1,
                          "availability": SPEC, "schedule-seed": SEED, "progress": False, "checkpoint-every": 0,
                          "results-dir": str(tmp_path), "run-name": "ours", "strategy": "fedavg-active"},
                         console=Console(quiet=True))
    rule = flower_fedavg() if strategy == "flower-fedavg" else build_strategy(strategy, num_clients=N)
    inner = Recording(N, {}, client_app=foreign_app())
    grid = with_availability(inner, SPEC, num_clients=N, seed=SEED, results_dir=tmp_path / "foreign")
    start(rule, grid)

    schedule = build_schedule(SPEC, N, SEED).matrix(ROUNDS)
    assert 0 < schedule.sum() < schedule.size  # the schedule has churn to show
    assert (read_matrix(ours / "participation.csv") == schedule).all()
    assert (read_matrix(tmp_path / "foreign" / "participation.csv") == schedule).all()
    assert (read_matrix(tmp_path / "foreign" / "availability.csv") == schedule).all()
    assert trained(inner) == [np.flatnonzero(row).tolist() for row in schedule]  # offline: never delivered
    assert [r["participants"] for r in read_metrics(ours)] == [np.flatnonzero(row).tolist() for row in schedule]


class Silent(InProcessGrid):
    """An in-process grid whose node ``mute`` never answers a QUERY (a cold or broken worker)."""

    def __init__(self, *args, mute: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.mute = mute

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(
            [m for m in messages if not (m.metadata.message_type.startswith(MessageType.QUERY)
                                         and self.partition_of[m.metadata.dst_node_id] == self.mute)],
            timeout=timeout)
        return replies


@pytest.mark.parametrize("strategy", ["flower-fedavg", "fedau"])
def test_a_node_that_never_says_who_it_is_receives_nothing_and_the_log_says_so(strategy, caplog):
    """Fail closed: client 2's node never answers the identity query; the schedule says it is
    always online, yet it gets no round message, and Flower's logger says why, every round."""
    inner = Silent(4, {}, client_app=foreign_app(), mute=2)
    grid = with_availability(inner, "always", num_clients=4, identity_timeout=0.5)
    rule = flower_fedavg() if strategy == "flower-fedavg" else build_strategy(strategy, num_clients=4)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        start(rule, grid, rounds=2)
    round_messages = [m for m in inner.delivered if not m.metadata.message_type.startswith(MessageType.QUERY)]
    assert round_messages and all(inner.partition_of[m.metadata.dst_node_id] != 2 for m in round_messages)
    mute_node = next(n for n, c in inner.partition_of.items() if c == 2)
    for rnd in (1, 2):
        assert f"availability, round {rnd}: 1 node(s) have not said which client they are ({mute_node})" in caplog.text
    assert grid.rounds[1]["reached"] == [0, 1, 3] and grid.rounds[2]["replied"] == [0, 1, 3]


def test_a_node_without_a_partition_id_answers_with_the_fix_and_receives_nothing(caplog):
    inner = InProcessGrid(3, {}, client_app=foreign_app())
    node = next(iter(inner.contexts))
    inner.contexts[node].node_config.pop("partition-id")
    grid = with_availability(inner, "always", num_clients=3, identity_timeout=0.5)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        start(flower_fedavg(), grid, rounds=1)
    assert "has no 'partition-id' in its node config" in caplog.text
    assert all(m.metadata.dst_node_id != node for m in inner.delivered
               if m.metadata.message_type == MessageType.TRAIN)


def test_the_client_gate_declines_offline_rounds_itself(tmp_path):
    """gate="client": every train message is delivered; the offline clients decline (error
    replies), so the realised participation is the schedule all the same."""
    run_config = {"availability": SPEC, "schedule-seed": SEED, "availability-gate": "client", "lr": 0.5}
    inner = Recording(N, run_config, client_app=foreign_app())
    grid = with_availability(inner, SPEC, num_clients=N, seed=SEED, gate="client", results_dir=tmp_path)
    start(FedAvg(min_available_nodes=N), grid)
    schedule = build_schedule(SPEC, N, SEED).matrix(ROUNDS)
    assert trained(inner) == [list(range(N))] * ROUNDS  # every message delivered
    assert (read_matrix(tmp_path / "participation.csv") == schedule).all()


def test_bad_arguments_are_named():
    grid = InProcessGrid(2, {})
    with pytest.raises(ValueError, match="needs num_clients"):
        with_availability(grid, SPEC)
    with pytest.raises(ValueError, match="gate must be"):
        with_availability(grid, SPEC, num_clients=2, gate="none")
    with pytest.raises(ValueError, match="unknown availability model"):
        with_availability(grid, "sometimes", num_clients=2)
    with pytest.raises(ValueError, match="num_clients=3 but the schedule has 2"):
        with_availability(grid, build_schedule(SPEC, 2, 0), num_clients=3)


def test_deployed_the_wrapper_filters_nothing_and_writes_what_the_launcher_follows(tmp_path, monkeypatch):
    """Under ``python -m deploy launch --app`` (its environment variables): every message goes out
    (the launcher stops the offline nodes), config.json and one metrics.jsonl line per round are
    written for its follower and report, and round r's nodes are listed only after its signal (or
    the bound)."""
    from server_app.dropin import Deployed

    signals = tmp_path / "signals"
    signals.mkdir()
    for r in (1, 2):
        (signals / f"round-{r}").touch()
    deployed = Deployed(tmp_path / "run", signals, 0.3, {"spec": SPEC, "seed": SEED, "num_clients": N})
    for key, value in deployed.env().items():
        monkeypatch.setenv(key, value)
    inner = Recording(N, {}, client_app=foreign_app())
    grid = with_availability(inner, SPEC, num_clients=N, seed=SEED)
    assert grid.gate == "none"
    start(FedAvg(min_available_nodes=N), grid, rounds=3)
    assert trained(inner)[:3] == [list(range(N))] * 3  # nothing filtered
    assert (tmp_path / "run" / "config.json").is_file()
    rows = read_metrics(tmp_path / "run")
    assert [r["round"] for r in rows] == [1, 2, 3] and all(r["participants"] == list(range(N)) for r in rows)
    assert grid.signalled == 4  # waited for rounds 1..3 (3 and 4 up to the bound: no file)

    monkeypatch.setenv("FLCHURN_APP_SCHEDULE", '{"spec": "always", "seed": 0, "num_clients": 6}')
    with pytest.raises(ValueError, match="not the launcher's"):
        with_availability(inner, SPEC, num_clients=N, seed=SEED)


EVERY_RULE = sorted(set(STRATEGIES) - ORACLES - {"cluster-fedvarp", "pow-d"}) + ["cluster-fedvarp:clusters=2",
                                                                                  "pow-d:d=6,m=6"]


@pytest.mark.parametrize("spec", EVERY_RULE)
def test_every_rule_trains_only_the_online_clients_through_the_wrapper(spec):
    """Under Flower's start and the wrapper, no rule reaches an offline client, except in the
    oracle rounds the rule marks (FL-FDMS's round 0, the Full baseline: ignore-availability)."""
    inner = Recording(N, {}, client_app=foreign_app())
    grid = with_availability(inner, SPEC, num_clients=N, seed=SEED)
    start(build_strategy(spec, num_clients=N), grid, rounds=3)
    schedule = build_schedule(SPEC, N, SEED).matrix(3)
    delivered = trained(inner)[:3]
    online = [np.flatnonzero(row).tolist() for row in schedule]
    if spec in ("full", "fl-fdms"):  # oracle rounds reach everyone; the others only the online
        assert all(set(on) <= set(got) for on, got in zip(online, delivered, strict=True))
    else:
        assert delivered == online
        assert [grid.rounds[r]["replied"] for r in (1, 2, 3)] == online


def test_a_rule_not_told_n_takes_the_schedules_not_the_online_count():
    """Only the online nodes are listed, so a rule without num_clients must not take N from its
    first listing (3 of 6 here): it takes the grid's N, and no later client's reply is rejected."""
    inner = Recording(N, {}, client_app=foreign_app())
    grid = with_availability(inner, SPEC, num_clients=N, seed=SEED)
    strategy = build_strategy("fedau")
    result = start(strategy, grid, rounds=4)
    assert len(grid.online_nodes(inner.get_node_ids(), 1)) < N and strategy.num_clients == N
    assert all(m["num-rejected"] == 0 for m in result.train_metrics_clientapp.values())
    assert [grid.rounds[r]["participants"] for r in (1, 2, 3, 4)] == [
        np.flatnonzero(row).tolist() for row in build_schedule(SPEC, N, SEED).matrix(4)]


class Deployment(Deployed, Recording):
    """What ``deploy launch --app`` leaves running (``test_sampling.Deployed``: only the nodes of the
    clients online in round r), recording each TRAIN message as it is delivered."""


@pytest.mark.parametrize("strategy", ["flower-fedavg", "fedau"])
def test_fraction_train_samples_among_the_online_as_in_a_deployment(strategy, tmp_path, monkeypatch):
    """fraction_train=0.5: in simulation the grid lists only the online, so the strategy draws among
    them, and the addressed sets equal those of a deployment (offline nodes really gone) for the
    same schedule and seed, round by round, evaluation included."""
    import random

    from server_app.dropin import Deployed

    def rule():
        random.seed(0)  # Flower's FedAvg samples with random.sample; the rules with their own seeded generator
        if strategy == "flower-fedavg":
            return FedAvg(fraction_train=0.5, fraction_evaluate=0.5, min_available_nodes=0, min_train_nodes=1,
                          min_evaluate_nodes=1)
        return build_strategy("fedau", num_clients=N, fraction_train=0.5, min_train_nodes=1)

    schedule = build_schedule(SPEC, N, SEED)
    sim = Recording(N, {}, client_app=foreign_app())
    start(rule(), with_availability(sim, SPEC, num_clients=N, seed=SEED))

    deployed = Deployed(tmp_path / "run", None, 0.0, {"spec": SPEC, "seed": SEED, "num_clients": N})
    for key, value in deployed.env().items():
        monkeypatch.setenv(key, value)
    real = Deployment(N, {}, client_app=foreign_app(), run_dir=tmp_path / "run", schedule=schedule)
    start(rule(), with_availability(real, SPEC, num_clients=N, seed=SEED))

    online = [np.flatnonzero(row).tolist() for row in schedule.matrix(ROUNDS)]
    addressed = trained(sim)
    assert addressed == trained(real)
    assert all(set(a) <= set(o) and len(a) == max(len(o) // 2, min(1, len(o))) for a, o in zip(addressed, online,
                                                                                               strict=True))
    assert any(len(a) < len(o) for a, o in zip(addressed, online, strict=True))  # a real draw among the online
    evaluated = [sorted(sim.partition_of[m.metadata.dst_node_id] for m in grid.delivered
                        if m.metadata.message_type == MessageType.EVALUATE) for grid in (sim, real)]
    assert evaluated[0] == evaluated[1]


def test_cyclic_in_a_foreign_app_takes_label_distributions_or_says_how(tmp_path):
    """cyclic needs the clients' label distributions: without them the error says how to give
    them; an array, a .npy file and a function of N give the same schedule."""
    from availability.base import ScheduleError

    spec = "cyclic"
    with pytest.raises(ScheduleError, match=r"label_dists=D.*\.npy or \.csv file.*function of N"):
        with_availability(InProcessGrid(N, {}), spec, num_clients=N)
    dists = np.random.default_rng(0).dirichlet(np.ones(10), size=N)
    np.save(tmp_path / "dists.npy", dists)
    grids = [with_availability(InProcessGrid(N, {}, client_app=foreign_app()), spec, num_clients=N, seed=1,
                               label_dists=given) for given in (dists, tmp_path / "dists.npy", lambda n: dists[:n])]
    matrices = [g.schedule.matrix(6) for g in grids]
    assert all((m == matrices[0]).all() for m in matrices) and 0 < matrices[0].sum() < matrices[0].size
    start(flower_fedavg(), grids[0], rounds=3)
    assert [grids[0].rounds[r]["participants"] for r in (1, 2, 3)] == [np.flatnonzero(row).tolist()
                                                                        for row in matrices[0][:3]]
