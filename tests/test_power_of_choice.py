"""Power-of-choice selection on a fake grid that answers probes with chosen losses."""

import uuid

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from experiments.inprocess import run_inprocess
from server_app.results import read_matrix, read_metrics
from strategies import build_strategy, named_arrays
from strategies.intake import Probe
from strategies.protocol import CLIENT_RULE, PROBE_BATCHES, SERVER_ROUND
from strategies.rules.power_of_choice import PowerOfChoice


class FakeGrid:
    """Node 100 + c hosts client c. EVALUATE probes are answered with ``losses[c]``; TRAIN
    messages are recorded and answered with the model + ``updates[c]`` (default 0) and
    ``train-loss`` = ``train_losses[c]``. Clients in ``offline`` never reply."""

    def __init__(self, losses, sizes=None, offline=(), train_losses=None):
        self.losses = dict(enumerate(losses))
        self.sizes = sizes or {c: 10 for c in self.losses}
        self.offline = set(offline)
        self.train_losses = train_losses or {}
        self.probes: list[list[int]] = []  # client ids probed, per call
        self.probe_configs: list[dict] = []
        self.timeouts: list[float | None] = []

    def get_node_ids(self):
        return [100 + c for c in self.losses]

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.timeouts.append(timeout)
        out = []
        if messages and messages[0].metadata.message_type == MessageType.EVALUATE:
            self.probes.append(sorted(m.metadata.dst_node_id - 100 for m in messages))
            self.probe_configs.append(dict(messages[0].content["config"]))
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            c = msg.metadata.dst_node_id - 100
            if c in self.offline:
                continue
            if msg.metadata.message_type == MessageType.EVALUATE:
                metrics = {"eval-loss": float(self.losses[c]), "client-id": c, "num-examples": self.sizes[c]}
                out.append(Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg))
            else:
                model = msg.content["arrays"]["w"].numpy()
                metrics = {"client-id": c, "num-examples": self.sizes[c],
                           "train-loss": float(self.train_losses.get(c, 1.0))}
                out.append(Message(RecordDict({"arrays": named_arrays({"w": model + c}),
                                               "metrics": MetricRecord(metrics)}), reply_to=msg))
        return out


def play(strategy, grid, rnd, x=(0.0, 0.0)):
    """One round: selection (with its probe), training on the fake grid, aggregation."""
    train = list(strategy.configure_train(rnd, named_arrays({"w": np.asarray(x, np.float32)}), ConfigRecord(), grid))
    chosen = sorted(m.metadata.dst_node_id - 100 for m in train)
    arrays, metrics = strategy.aggregate_train(rnd, grid.send_and_receive(train, timeout=5.0))
    return chosen, arrays["w"].numpy(), metrics


def test_picks_the_largest_losses_and_aggregates_them_as_fedavg():
    losses = [0.1, 5.0, 0.3, 4.0, 0.2, 3.0, 0.9, 0.4]
    s = PowerOfChoice(num_clients=8, d=8, m=3, probe_timeout=7.5)
    grid = FakeGrid(losses)
    chosen, new, metrics = play(s, grid, 1)
    assert chosen == [1, 3, 5]
    np.testing.assert_allclose(new, np.mean([1, 3, 5]) * np.ones(2))  # model + c, equal weights
    assert metrics["chosen-clients"] == [1, 3, 5] and metrics["chosen-losses"] == [5.0, 4.0, 3.0]
    assert metrics["candidates"] == 8 and metrics["probe-replies"] == 8
    assert grid.timeouts[0] == 7.5  # the probe waits probe_timeout
    assert grid.probe_configs[0] == {SERVER_ROUND: 1, CLIENT_RULE: "plain", PROBE_BATCHES: 0}
    assert s.round_log.participants == [1, 3, 5]


def test_chosen_are_the_top_m_among_the_drawn_candidates():
    rng = np.random.default_rng(1)
    losses = rng.random(30)
    s = PowerOfChoice(num_clients=30, d=6, m=2, seed=3)
    grid = FakeGrid(losses)
    for rnd in range(1, 21):
        chosen, _, _ = play(s, grid, rnd)
        cands = grid.probes[-1]
        assert len(cands) == 6
        assert chosen == sorted(sorted(cands, key=lambda c: -losses[c])[:2])


def test_offline_candidates_are_never_chosen():
    losses = [9.0, 8.0, 1.0, 2.0, 3.0]
    s = PowerOfChoice(num_clients=5, d=5, m=2)
    grid = FakeGrid(losses, offline={0, 1})
    chosen, _, metrics = play(s, grid, 1)
    assert chosen == [3, 4] and metrics["probe-replies"] == 3
    s2 = PowerOfChoice(num_clients=5, d=5, m=4)
    chosen, _, _ = play(s2, grid, 1)
    assert chosen == [2, 3, 4]  # fewer than m replied: only they train


def test_d_equal_m_is_uniform_random_selection():
    n, m, rounds = 10, 3, 1500
    s = PowerOfChoice(num_clients=n, d=m, m=m, seed=11)
    grid = FakeGrid(np.arange(n, dtype=float))  # losses would favour high ids if they mattered
    counts = np.zeros(n)
    arrays = named_arrays({"w": np.zeros(1, np.float32)})
    for rnd in range(1, rounds + 1):
        train = s.configure_train(rnd, arrays, ConfigRecord(), grid)
        for msg in train:
            counts[msg.metadata.dst_node_id - 100] += 1
    freq = counts / rounds
    np.testing.assert_allclose(freq, m / n, atol=0.05)  # binomial sd ≈ 0.012


def test_candidates_change_every_round_and_follow_the_seed():
    def probes(seed):
        s = PowerOfChoice(num_clients=20, d=5, m=2, seed=seed)
        grid = FakeGrid(np.ones(20))
        for rnd in range(1, 21):
            play(s, grid, rnd)
        return [tuple(p) for p in grid.probes]

    a = probes(0)
    assert len(set(a)) >= 15  # the official code's re-seeding repeated the same set every round
    assert a == probes(0) and a != probes(1)


def test_candidates_are_drawn_by_data_size_once_sizes_are_known():
    sizes = {0: 1000, 1: 10, 2: 10, 3: 10, 4: 10}
    s = PowerOfChoice(num_clients=5, d=1, m=1, seed=0)
    grid = FakeGrid(np.ones(5), sizes=sizes)
    chosen = [play(s, grid, rnd)[0][0] for rnd in range(1, 201)]
    # round 1 is uniform (no sizes yet); afterwards client 0 is drawn with p ≈ 1000/1040
    assert np.mean(np.array(chosen[50:]) == 0) > 0.9


def test_cpow_d_probes_one_batch_and_rpow_d_probes_nobody():
    s = build_strategy("pow-d:d=4,m=2,variant=cpow-d,probe-timeout=3.0", num_clients=4)
    grid = FakeGrid([1.0, 2.0, 3.0, 4.0])
    play(s, grid, 5)
    assert grid.probe_configs[0] == {SERVER_ROUND: 5, CLIENT_RULE: "plain", PROBE_BATCHES: 1}
    assert grid.timeouts[0] == 3.0

    r = PowerOfChoice(num_clients=4, d=4, m=2, variant="rpow-d", seed=0)
    grid = FakeGrid([9.0, 9.0, 9.0, 9.0], train_losses={0: 0.5, 1: 7.0, 2: 3.0, 3: 0.1})
    first, _, metrics = play(r, grid, 1)
    assert grid.probes == [] and metrics["chosen-losses"] == [-1.0, -1.0]  # never seen: unknown loss
    second, _, _ = play(r, grid, 2)
    assert not set(first) & set(second)  # never-seen clients go first
    third, _, metrics = play(r, grid, 3)
    assert third == [1, 2] and metrics["chosen-losses"] == [7.0, 3.0]  # largest last train loss
    with pytest.raises(ValueError, match="variant"):
        PowerOfChoice(variant="pow")
    with pytest.raises(ValueError, match="d >= 1"):
        PowerOfChoice(d=0, m=3)


def test_d_and_m_are_capped_by_the_federation_with_a_note(caplog):
    """pow-d's defaults (d=10, m=5) on 4 nodes: d and m capped by the connected nodes, said once;
    m > d given: m capped to d, said."""
    with caplog.at_level("INFO", logger="flwr"):
        capped = PowerOfChoice(num_clients=4, d=3, m=5)
    assert (capped.rule.params.d, capped.rule.params.m) == (3, 3) and "m=5 > d=3: m capped" in caplog.text
    s = PowerOfChoice(num_clients=4, seed=1)
    grid = FakeGrid([4.0, 1.0, 3.0, 2.0])
    caplog.clear()
    with caplog.at_level("INFO", logger="flwr"):
        chosen, _, metrics = play(s, grid, 1)
        play(s, grid, 2)
    assert grid.probes[0] == [0, 1, 2, 3] and metrics["candidates"] == 4
    assert chosen == [0, 1, 2, 3]  # m=5 capped to the 4 connected nodes
    assert caplog.text.count("4 node(s) connected: d=10 capped to 4, m=5 to 4") == 1  # once, not per round


def test_state_dict_resumes_the_same_selection():
    a = PowerOfChoice(num_clients=12, d=4, m=2, seed=5)
    grid = FakeGrid(np.linspace(0, 1, 12))
    play(a, grid, 1)
    b = PowerOfChoice(num_clients=12, d=4, m=2, seed=99)
    b.load_state_dict(a.state_dict())
    ga, gb = FakeGrid(np.linspace(0, 1, 12)), FakeGrid(np.linspace(0, 1, 12))
    assert [play(a, ga, r)[0] for r in (2, 3)] == [play(b, gb, r)[0] for r in (2, 3)]
    assert ga.probes == gb.probes


def test_end_to_end_probes_go_through_the_availability_layer(tmp_path):
    cfg = {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": 10,
           "num-server-rounds": 8, "availability": "bernoulli:p=0.5", "local-steps": "steps:n=2",
           "batch-size": 1, "progress": False, "checkpoint-every": 0, "results-dir": str(tmp_path),
           "strategy": "pow-d:d=6,m=2"}
    run_dir = run_inprocess(cfg)
    rows = read_metrics(run_dir)
    realised = read_matrix(run_dir / "participation.csv")
    scheduled = read_matrix(run_dir / "availability.csv")
    assert np.all(realised <= scheduled)  # only clients online in that round trained
    assert all(r["num-participants"] == min(2, r["probe-replies"]) for r in rows)
    assert all(r["probe-replies"] <= 6 and sorted(r["chosen-clients"]) == r["participants"] for r in rows)
    assert realised.sum() > 0


def test_a_probe_reply_cannot_take_a_client_id_bound_to_another_node():
    s = build_strategy("pow-d:d=2,m=2", num_clients=3)
    s.node_of_client[1] = 999  # client 1 belongs to node 999; node 101 claims it in its probe reply
    answers = s.evaluation.probe(1, named_arrays({"w": np.zeros(2, np.float32)}), Probe([100, 101]), FakeGrid([1.0, 2.0]))
    losses = s.rule.read_probe(1, s.kept_state(), [100, 101], s.probe_answers(answers), [])
    assert losses == {100: 1.0, 101: 2.0} and s.client_of_node == {100: 0}


def test_a_probe_loss_beyond_the_honest_spread_is_not_picked():
    """A client reporting 1e308 (issue 27) ranks last: not picked while m credible candidates
    answer; its loss is counted out of range. max-loss-ratio=0 is the paper's ranking."""
    losses = [0.5, 0.9, 1.3, 0.7, 1.1, 0.6, 0.8, 1e308]
    picked = {}
    for spec in ("pow-d:d=8,m=3", "pow-d:d=8,m=3,max-loss-ratio=0"):
        s = build_strategy(spec, num_clients=8)
        grid = FakeGrid(losses)
        chosen = [play(s, grid, rnd)[0] for rnd in range(1, 4)]
        picked[spec] = sum(7 in c for c in chosen)
        if "ratio" not in spec:
            assert s.selection.metrics["losses-out-of-range"] == 1 and chosen[0] == [1, 2, 4]
    assert picked == {"pow-d:d=8,m=3": 0, "pow-d:d=8,m=3,max-loss-ratio=0": 3}
