"""FedAWE (Xiang et al., NeurIPS 2024): server rule on mocked replies, the client rule and its
state store, in-process runs, and the paper's two-client counterexample against interval
reweighting without the postponed broadcast."""

import io

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from replies import Grid1, error, reply, start_round
from rich.console import Console

from client_app.app import app as client_app
from client_app.fedawe import FedAWERule, FedAWEStateError, StateStore
from client_app.rules import client_rule
from experiments.inprocess import NODE_ID_BASE, InProcessGrid, default_run_config, run_inprocess
from server_app.config import RunConfig
from server_app.experiment import run
from server_app.results import read_matrix, read_metrics
from strategies import STRATEGIES, AvailabilityStrategy, build_strategy, named_arrays
from strategies.failures import StrategyFailure
from strategies.protocol import ACCEPTED_ROUND, ADOPT, CLIENT_RULE, SERVER_ROUND
from strategies.rules.fedawe import (
    BLOCK,
    ECHO_FACTOR,
    RUN_KEY,
    SEND_UPDATE,
    SERVER_LR,
    SKETCH,
    UPDATE_PREFIX,
    FedAWE,
)
from strategies.rules.fedawe_sketch import SPAN, Projection
from workloads.data import load_dataset

TIMES = {"round-time", "wall-time"}


# ------------------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    """In-process runs here check numbers; the end-of-run plots only cost time."""
    monkeypatch.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)


def awe_reply(sent, model, factor, update="x0", **metrics):
    """A FedAWE client's reply: x_i^† in 'w', the echo factor and u_i (a scalar: filled; None: left
    out; "x0", the default: consistent with a client whose copy is x^0, the sent model, as the
    server checks) as extra keys."""
    arrays = {"w": np.asarray(model, np.float32), ECHO_FACTOR: np.array([factor], np.float64)}
    if isinstance(update, str):
        eta = float(sent.content["config"][SERVER_LR])
        update = (np.asarray(model, np.float64) - sent_model(sent)) / eta
    if update is not None:
        u = np.asarray(update, np.float32)
        arrays[UPDATE_PREFIX + "w"] = np.full(np.shape(model), u, np.float32) if u.ndim == 0 else u
    content = RecordDict({"arrays": named_arrays(arrays),
                          "metrics": MetricRecord({"num-examples": 10, **metrics})})
    return Message(content, reply_to=sent)


def sent_model(msg):
    return msg.content["arrays"]["w"].numpy()


def ctx(pid=0, run_id=1, **node):
    return Context(run_id=run_id, node_id=NODE_ID_BASE + pid, state=RecordDict(), run_config={},
                   node_config={"partition-id": pid, "num-partitions": 4, **node})


def cfg(key="k1", lr=1.0, send_update=False):
    return ConfigRecord({CLIENT_RULE: "fedawe", SERVER_LR: lr, SEND_UPDATE: send_update, RUN_KEY: key})


def sd(values, count=3):
    """A state dict with a float parameter and an integer buffer (like BatchNorm's counter)."""
    return {"w": torch.tensor(values, dtype=torch.float32), "n": torch.tensor(count)}


def rows_without_times(run_dir):
    return [{k: v for k, v in r.items() if k not in TIMES} for r in read_metrics(run_dir)]


def quadratic(tmp_path, **over):
    return {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": 6,
            "num-server-rounds": 8, "local-steps": "steps:n=1", "batch-size": 1, "lr": 0.1,
            "availability": "bernoulli:p=0.5", "progress": False, "checkpoint-every": 0,
            "results-dir": str(tmp_path), "strategy": "fedawe", **over}


def run_grid(overrides, client_app=client_app):
    """What run_inprocess does, keeping the grid (it records every delivered message)."""
    run_config = {**default_run_config(), **overrides}
    config = RunConfig.from_run_config(run_config)
    grid = InProcessGrid(config.workload.num_clients, run_config, client_app=client_app)
    return run(grid, config, console=Console(quiet=True)), grid


def arrays_in(obj):
    """Every ndarray reachable through dicts, lists and tuples."""
    if isinstance(obj, np.ndarray):
        return [obj]
    if isinstance(obj, dict):
        return [a for v in obj.values() for a in arrays_in(v)]
    if isinstance(obj, (list, tuple)):
        return [a for v in obj for a in arrays_in(v)]
    return []


# ------------------------------------------------------------------------- server rule
def test_mean_of_echoed_models_and_mean_echo_factor():
    s = FedAWE(num_clients=4)
    sent = start_round(s, 3, np.array([1.0, -1.0]), [100, 101, 102])  # t = 2: factors up to 3
    arrays, metrics = s.aggregate_train(3, [awe_reply(sent[100], [2.0, 0.0], 1, **{"client-id": 0}),
                                            awe_reply(sent[102], [4.0, -6.0], 3, **{"client-id": 2})])
    np.testing.assert_allclose(arrays["w"].numpy(), [3.0, -3.0])  # (x_0^† + x_2^†) / 2
    assert metrics["mean-echo-factor"] == 2.0 and metrics["num-participants"] == 2
    assert s.round_log.participants == [0, 2]


def test_train_messages_carry_the_initial_model_and_the_client_config():
    s = FedAWE(num_clients=4, server_lr=0.5)
    x0 = np.array([1.0, -1.0])
    first = start_round(s, 1, x0, [100, 101])
    s.aggregate_train(1, [awe_reply(first[100], [2.0, 2.0], 1, **{"client-id": 0})])
    later = start_round(s, 2, np.array([2.0, 2.0]), [100, 101])
    for msg in later.values():
        np.testing.assert_array_equal(sent_model(msg), x0)  # x^0: the copy of a client without one
        config = msg.content["config"]
        assert config[CLIENT_RULE] == "fedawe" and config[SERVER_LR] == 0.5
        assert config[SEND_UPDATE] is True and config[RUN_KEY] == s.run_key and config[SERVER_ROUND] == 2
    np.testing.assert_array_equal(s.current, [2.0, 2.0])  # the rule itself works on x^t


@pytest.mark.parametrize(("clip", "expected", "clipped"), [(0.5, [5.6, 5.8], 1.0), (5.0, [6.2, 6.6], 0.0)])
def test_server_clip_of_the_averaged_echoed_update(clip, expected, clipped):
    """x^{t+1} = mean x_i^{t,0} + η_g clip(mean u_i) (official code), η_g = 2.

    Both starts x^0 = (5, 5) (the copies the server accepts), u = (0.3, 0.4) and (0.9, 1.2):
    ū = (0.6, 0.8), ‖ū‖ = 1. Clipped to 0.5: (5, 5) + 2 (0.3, 0.4) = (5.6, 5.8); not clipped:
    mean x_i^† = (6.2, 6.6).
    """
    s = FedAWE(num_clients=4, server_lr=2.0, clip=clip)
    sent = start_round(s, 2, np.array([5.0, 5.0]), [100, 102])
    assert sent[100].content["config"][SEND_UPDATE] is True
    starts, updates = np.array([[5.0, 5.0], [5.0, 5.0]]), np.array([[0.3, 0.4], [0.9, 1.2]])
    echoed = starts + 2.0 * updates  # what the clients send as their model
    replies = [awe_reply(sent[100 + 2 * k], echoed[k], 2, updates[k], **{"client-id": 2 * k}) for k in range(2)]
    arrays, metrics = s.aggregate_train(2, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), expected, rtol=1e-6)
    assert metrics["echo-update-norm"] == pytest.approx(1.0) and metrics["echo-clipped"] == clipped
    # x̄ (from x^0 = (5, 5)) moves by (|A_t|/N) η_g clip(ū) = (2/4) · 2 · clip(ū)
    np.testing.assert_allclose(s.xbar, 5.0 + (2 / 4) * 2.0 * np.array([0.6, 0.8]) * min(1.0, clip), rtol=1e-6)


def test_spec_builds_the_clip_and_rejects_a_bad_one():
    assert build_strategy("fedawe:clip=0.5", num_clients=3).clip == 0.5
    assert build_strategy("fedawe", num_clients=3).clip == 0.0
    with pytest.raises(ValueError, match="clip"):
        FedAWE(clip=-1.0)


def test_broadcast_goes_only_to_the_nodes_of_valid_replies():
    s = FedAWE(num_clients=5)
    sent = start_round(s, 2, np.zeros(1), [100, 101, 102, 103, 104])
    replies = [awe_reply(sent[100], [1.0], 1, **{"client-id": 0}),
               error(sent[101]),  # unavailable
               reply(sent[102], [9.0], **{"client-id": 2}),  # a plain client: rejected
               awe_reply(sent[104], [3.0], 2, **{"client-id": 4})]  # 103 never answers
    arrays, _ = s.aggregate_train(2, replies)
    assert arrays["w"].numpy().tolist() == [2.0]
    out = s.configure_broadcast(2, arrays, Grid1(sent))
    assert [m.metadata.dst_node_id for m in out] == [100, 104]
    for m in out:
        assert m.metadata.message_type == ADOPT == "train.adopt"
        assert m.content["arrays"]["w"].numpy().tolist() == [2.0]
        config = m.content["config"]
        assert config[SERVER_ROUND] == 2 and config[CLIENT_RULE] == "fedawe" and config[RUN_KEY] == s.run_key
    assert s.configure_broadcast(3, arrays, Grid1(sent)) == []  # not this round's participants
    sent = start_round(s, 3, np.zeros(1), [100, 101])
    arrays, _ = s.aggregate_train(3, [error(sent[100])])
    assert s.configure_broadcast(3, arrays, Grid1(sent)) == []  # nobody to tell


@pytest.mark.parametrize(
    ("factor", "update", "extra", "why"),
    [
        (None, None, {}, "does not run FedAWE's client rule"),
        (0, [0.5], {}, "outside [1, 2]"),
        (3, [0.5], {}, "outside [1, 2]"),
        (1.5, [0.5], {}, "one integer"),
        (1, [0.5], {"fedawe.bogus": np.ones(1, np.float32)}, "unknown FedAWE reply keys"),
        (1, None, {}, "lacks 'fedawe.update.w'"),
    ],
)
def test_bad_fedawe_replies_are_rejected_with_reason(factor, update, extra, why):
    s = FedAWE(num_clients=3)
    sent = start_round(s, 2, np.zeros(1), [100, 101])
    arrays = {"w": np.ones(1, np.float32), **extra}
    if factor is not None:
        arrays[ECHO_FACTOR] = np.array([factor], np.float64)
    if update is not None:
        arrays[UPDATE_PREFIX + "w"] = np.asarray(update, np.float32)
    bad = Message(RecordDict({"arrays": named_arrays(arrays),
                              "metrics": MetricRecord({"num-examples": 3, "client-id": 1})}), reply_to=sent[101])
    out, metrics = s.aggregate_train(2, [awe_reply(sent[100], [4.0], 1, **{"client-id": 0}), bad])
    assert out["w"].numpy().tolist() == [4.0] and metrics["num-rejected"] == 1
    (node, reason), = s.round_log.rejected
    assert node == 101 and why in reason


def test_clip_needs_the_echoed_update_of_every_reply():
    s = FedAWE(num_clients=3, clip=0.5)
    sent = start_round(s, 1, np.zeros(2), [100, 101])
    out, _ = s.aggregate_train(1, [awe_reply(sent[100], [1.0, 1.0], 1, [1.0, 1.0], **{"client-id": 0}),
                                   awe_reply(sent[101], [9.0, 9.0], 1, None, **{"client-id": 1}),
                                   ])
    assert "fedawe.update.w" in s.round_log.rejected[0][1]
    sent = start_round(s, 2, out["w"].numpy(), [100])
    s.aggregate_train(2, [awe_reply(sent[100], [1.0, 1.0], 1, [1.0, 1.0, 1.0], **{"client-id": 0})])
    assert "shape" in s.round_log.rejected[0][1]


def test_server_memory_is_constant_per_client():
    """O(1) per client: after many rounds of 60 clients the state holds x^0 and x̄, nothing per client."""
    n, d = 60, 40
    s = FedAWE(num_clients=n, clip=0.5)
    rng = np.random.default_rng(0)
    x = np.zeros(d)
    for rnd in range(1, 9):
        nodes = [100 + c for c in range(n)]
        sent = start_round(s, rnd, x, nodes)
        replies = [awe_reply(sent[100 + c], rng.normal(size=d), 1, **{"client-id": c})  # copy x^0
                   for c in range(n) if rng.random() < 0.7]
        out, _ = s.aggregate_train(rnd, replies)
        x = out["w"].numpy()
    in_state = arrays_in(s.state_dict())
    # x^0 and x̄, and the consistency check's SKETCH numbers per round: nothing per client
    assert sum(a.size for a in in_state) == 2 * d + SKETCH * len(s.sketches)
    # _sent: this round's messages; _scratch: the base's reusable rows for one round's replies
    # (Δ_i and u_i), O(replies per round), the memory the replies take while aggregated
    held = arrays_in({k: v for k, v in vars(s).items() if k not in ("_sent", "_scratch")})
    # x^t, x^0, x̄, the layout's bookkeeping, the check's projection P (SKETCH x (d / SPAN + SPAN)
    # numbers) and its reused float32 block of Δ_i − η_g u_i, sketches
    assert sum(a.size for a in held) <= (7 + SKETCH) * d + SKETCH * (len(s.sketches) + 1)
    assert len(s.client_of_node) == n  # the base's node -> client id map: one int each


def test_checkpoint_round_trip_continues_identically():
    a = FedAWE(num_clients=3, clip=0.5, seed=4)
    x = np.array([0.5, -0.5])
    sent = start_round(a, 1, x, [100, 101])
    out, _ = a.aggregate_train(1, [awe_reply(sent[100], [1.0, 1.0], 1, [0.2, 0.1], **{"client-id": 0})])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = FedAWE(num_clients=3, clip=0.5, seed=99)
    b.load_state_dict(torch.load(buf, weights_only=False))
    assert b.run_key == a.run_key and b.run_key != FedAWE().run_key
    results = []
    for s in (a, b):
        sent = start_round(s, 2, out["w"].numpy(), [100, 101])
        np.testing.assert_array_equal(sent_model(sent[101]), x)  # x^0 survives the checkpoint
        assert sent[101].content["config"][RUN_KEY] == a.run_key
        new, _ = s.aggregate_train(2, [awe_reply(sent[101], [3.0, 0.0], 2, [2.0, 2.0], **{"client-id": 1})])
        results.append((new["w"].numpy(), s.rng.random(3)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    fresh = FedAWE(num_clients=3)
    fresh.load_state_dict(FedAWE(num_clients=3).state_dict())  # before any round: no x^0 yet
    assert fresh.initial is None
    with pytest.raises(ValueError, match="run key"):
        saved = a.state_dict()
        fresh.load_state_dict({**saved, "state": {**saved["state"], "run_key": "../../etc"}})


# --------------------------------------------------------------------------- client rule
def test_client_rule_is_registered_and_echoes_from_its_own_copy():
    rule = client_rule("fedawe")
    assert isinstance(rule, FedAWERule)
    c = ctx()
    # first appearance in round t = 2: the copy is the message's model, τ = −1, factor t + 1 = 3
    start = rule.start(sd([0.0, 0.0]), c, 0, 2, cfg(lr=0.5))
    assert start["w"].tolist() == [0.0, 0.0]
    trained = sd([1.0, 2.0], count=7)
    out = rule.reply(start, trained, c, 0, 2, cfg(lr=0.5, send_update=True))
    assert out["w"].tolist() == [1.5, 3.0]  # x^{t,0} + η_g (t − τ) Δ = 0.5 · 3 · (1, 2)
    assert out["n"].item() == 7  # integer buffers: as trained
    assert out[ECHO_FACTOR].tolist() == [3.0]
    assert out[UPDATE_PREFIX + "w"].tolist() == [3.0, 6.0] and out[UPDATE_PREFIX + "n"].tolist() == 0
    assert out["w"].dtype == torch.float32
    # the round-end broadcast: the copy becomes x^{t+1}
    rule.adopt(sd([7.0, 7.0]), c, 0, 2, cfg())
    start = rule.start(sd([9.0, 9.0]), c, 0, 5, cfg())  # the message's model is ignored now
    assert start["w"].tolist() == [7.0, 7.0]
    out = rule.reply(start, sd([8.0, 7.0]), c, 0, 5, cfg())
    assert out[ECHO_FACTOR].tolist() == [3.0] and out["w"].tolist() == [10.0, 7.0]  # 7 + 3 · 1
    assert set(out) == {"w", "n", ECHO_FACTOR}  # no update unless asked
    # no broadcast after round 5 reached it: round 6 starts from the same copy
    assert rule.start(sd([0.0, 0.0]), c, 0, 6, cfg())["w"].tolist() == [7.0, 7.0]


def test_replays_are_refused_and_stale_broadcasts_ignored():
    rule, c = FedAWERule(), ctx()
    start = rule.start(sd([0.0, 0.0]), c, 0, 4, cfg())
    rule.reply(start, sd([1.0, 1.0]), c, 0, 4, cfg())
    with pytest.raises(FedAWEStateError, match="replay"):
        rule.start(sd([0.0, 0.0]), c, 0, 4, cfg())
    rule.adopt(sd([5.0, 5.0]), c, 0, 3, cfg())  # an older round's broadcast: ignored
    assert rule.start(sd([0.0, 0.0]), c, 0, 6, cfg())["w"].tolist() == [0.0, 0.0]
    other = ctx(1)
    rule.start(sd([0.0, 0.0]), other, 1, 0, cfg())
    with pytest.raises(FedAWEStateError, match="does not fit"):
        rule.start({"w": torch.zeros(3), "n": torch.tensor(1)}, other, 1, 1, cfg())


def test_tau_moves_only_to_a_round_the_server_applied():
    """τ_i waits for the broadcast (the server applied the reply): a rejected reply's round is
    dropped, so the next echo factor counts it; an applied reply whose broadcast was lost moves
    τ_i when the next message's accepted-round names it (the copy stays)."""
    rule, c = FedAWERule(), ctx()

    def factor(t, accepted=-1):
        config = cfg()
        config[ACCEPTED_ROUND] = accepted
        start = rule.start(sd([0.0, 0.0]), c, 0, t, config)
        return int(rule.reply(start, sd([1.0, 0.0]), c, 0, t, config)[ECHO_FACTOR].item())

    assert factor(0) == 1
    rule.adopt(sd([2.0, 0.0]), c, 0, 0, cfg())  # applied: τ_i = 0, x_i = the broadcast
    assert factor(2, accepted=0) == 2  # rejected: no broadcast
    assert factor(3, accepted=0) == 3  # round 2 dropped: 3 − 0
    assert factor(5, accepted=3) == 2  # round 3 applied, its broadcast lost: τ_i = 3
    assert rule.start(sd([0.0, 0.0]), c, 0, 6, cfg())["w"].tolist() == [2.0, 0.0]  # the copy of round 0's broadcast


@pytest.mark.parametrize("p", [1.0, 0.5, 0.15])
def test_echo_factors_count_every_round_exactly_once(p):
    """Prop. 1 (exactly): the factors of a client's available rounds up to round r, plus the
    rounds since its last availability, equal r + 1; so they sum to R over R rounds when it is
    available in the last round, to (last available round + 1) ≤ R in general. Hence for
    Bernoulli(p) the mean factor over its participations is about 1/p (echoing is unbiased)."""
    rule, c = FedAWERule(), ctx()
    rng = np.random.default_rng(int(p * 100))
    rounds, factors, last = 600, {}, -1
    for t in range(rounds):
        if rng.random() < p:
            start = rule.start(sd([0.0, 0.0]), c, 0, t, cfg())
            factors[t] = int(rule.reply(start, sd([1.0, 0.0]), c, 0, t, cfg())[ECHO_FACTOR].item())
            rule.adopt(sd([float(t), 0.0]), c, 0, t, cfg())
            last = t
        assert sum(factors.values()) + (t - last) == t + 1
    assert sum(factors.values()) == last + 1 <= rounds
    assert np.mean(list(factors.values())) == pytest.approx(1 / p, rel=0.3)


def test_state_dir_survives_a_client_restart_and_node_config_wins(tmp_path):
    node_dir, run_dir = tmp_path / "node", tmp_path / "run"
    rule = FedAWERule()
    c = ctx(2, **{"state-dir": str(node_dir)})
    c.run_config["state-dir"] = str(run_dir)
    start = rule.start(sd([0.0, 0.0]), c, 2, 0, cfg())
    rule.reply(start, sd([1.0, 1.0]), c, 2, 0, cfg())
    rule.adopt(sd([4.0, 2.0]), c, 2, 0, cfg())
    path = node_dir / "client-2" / "fedawe-k1.pt"
    assert path.is_file() and not run_dir.exists()
    assert [p.name for p in path.parent.iterdir()] == ["fedawe-k1.pt"]  # no temp files left
    # the process restarts: a new rule and a new Context with an empty state
    again = FedAWERule()
    c2 = ctx(2, **{"state-dir": str(node_dir)})
    start = again.start(sd([0.0, 0.0]), c2, 2, 3, cfg())
    assert start["w"].tolist() == [4.0, 2.0]
    assert again.reply(start, sd([5.0, 2.0]), c2, 2, 3, cfg())[ECHO_FACTOR].item() == 3  # 3 − τ = 3 − 0
    # without a state dir a restart loses the copy: the client starts over from the message
    assert again.start(sd([0.0, 0.0]), ctx(2), 2, 3, cfg())["w"].tolist() == [0.0, 0.0]
    # the run config's state dir is used when the node config has none
    c4 = ctx(1)
    c4.run_config["state-dir"] = str(run_dir)
    rule.start(sd([1.0, 1.0]), c4, 1, 0, cfg())
    assert (run_dir / "client-1" / "fedawe-k1.pt").is_file()


def test_runs_are_isolated(tmp_path):
    rule = FedAWERule()
    c = ctx(0, **{"state-dir": str(tmp_path)})
    rule.start(sd([1.0, 1.0]), c, 0, 0, cfg("runA"))
    rule.adopt(sd([6.0, 6.0]), c, 0, 0, cfg("runA"))
    # another run (another key) on the same node and state dir starts from its own x^0
    assert rule.start(sd([2.0, 2.0]), c, 0, 0, cfg("runB"))["w"].tolist() == [2.0, 2.0]
    assert rule.start(sd([2.0, 2.0]), ctx(0, **{"state-dir": str(tmp_path)}), 0, 1, cfg("runA"))["w"].tolist() == [6.0, 6.0]
    # without a server key the run id names the state
    no_key = ConfigRecord({CLIENT_RULE: "fedawe"})
    rule.start(sd([3.0, 3.0]), ctx(0, run_id=7, **{"state-dir": str(tmp_path)}), 0, 0, no_key)
    assert rule.start(sd([4.0, 4.0]), ctx(0, run_id=8, **{"state-dir": str(tmp_path)}), 0, 0, no_key)["w"].tolist() == [4.0, 4.0]
    assert sorted(p.name for p in (tmp_path / "client-0").iterdir()) == [
        "fedawe-run7.pt", "fedawe-run8.pt", "fedawe-runA.pt", "fedawe-runB.pt"]
    with pytest.raises(FedAWEStateError, match="run key"):
        StateStore(c, 0, ConfigRecord({RUN_KEY: "../x"}))


# ----------------------------------------------------------------------------- in process
def test_inprocess_broadcast_reaches_only_participants_and_runs_are_deterministic(tmp_path):
    a, grid = run_grid(quadratic(tmp_path, **{"run-name": "a"}))
    b = run_inprocess(quadratic(tmp_path, **{"run-name": "b"}))
    rows = rows_without_times(a)
    assert rows == rows_without_times(b)
    np.testing.assert_array_equal(read_matrix(a / "participation.csv"), read_matrix(a / "availability.csv"))
    adopted = {}
    for m in grid.delivered:  # also the QUERY messages of client discovery
        if m.metadata.message_type == ADOPT:
            adopted.setdefault(int(m.content["config"][SERVER_ROUND]), []).append(m.metadata.dst_node_id)
        elif m.metadata.message_type == "train":
            assert not m.content["arrays"]["x"].numpy().any()  # x^0 = 0, every round
    partial = 0
    for row in rows:
        expected = [NODE_ID_BASE + c for c in row["participants"]]
        assert sorted(adopted.get(row["round"], [])) == expected
        partial += 0 < len(expected) < 6
    assert partial >= 3  # the schedule really left clients out
    final = torch.load(a / "final_model.pt", weights_only=True)["x"]
    last = [m for m in grid.delivered if m.metadata.message_type == ADOPT][-1]
    if rows[-1]["participants"]:
        np.testing.assert_array_equal(last.content["arrays"]["x"].numpy(), final.numpy())


def test_inprocess_restarting_clients_keep_their_copies_in_the_state_dir(tmp_path):
    """Every message reaches a freshly started client process (a new, empty Context): with a
    state dir the run equals the uninterrupted one; without, every reply is a first appearance."""

    def restarting(msg, context):
        fresh = Context(run_id=context.run_id, node_id=context.node_id, state=RecordDict(),
                        run_config=context.run_config, node_config=context.node_config)
        return client_app(msg, fresh)

    base, _ = run_grid(quadratic(tmp_path, **{"run-name": "base"}))
    kept, _ = run_grid(quadratic(tmp_path, **{"run-name": "kept", "state-dir": str(tmp_path / "state")}),
                       client_app=restarting)
    assert rows_without_times(kept) == rows_without_times(base)
    files = sorted(p.relative_to(tmp_path / "state").parts[0] for p in (tmp_path / "state").rglob("*.pt"))
    assert files == [f"client-{c}" for c in range(6)]
    # without it, every reply claims factor t + 1: accepted at a client's first appearance, then
    # beyond the echo cap (issue 20), and once no reply is usable for max_failed_rounds rounds the
    # run fails naming the reason (issue 17)
    with pytest.raises(StrategyFailure, match="echo-factor"):
        run_grid(quadratic(tmp_path, **{"run-name": "lost"}), client_app=restarting)
    lost = tmp_path / "lost"
    rows = [row for row in read_metrics(lost) if row["participants"]]
    assert rows
    for row in rows:
        assert row["mean-echo-factor"] == row["round"]  # τ forgotten: factor t + 1 every time


# ------------------------------------------------------------------ the counterexample
# Two clients, F_i(x) = ½‖x − e_i‖², client 0 always available, client 1 only in odd rounds,
# one exact gradient step with lr η: Δ_i = η (e_i − x_i^{t,0}); x* = (e_0 + e_1)/2.
#
# Interval reweighting WITHOUT the postponed broadcast (everyone starts from x^t, the server adds
# mean_{A_t} (t − τ_i) Δ_i; client 1's factor is 2): over a cycle, with y = x^{2k},
#   y' = (1 − 3η/2)[(1 − η) y + η e_0] + (η/2) e_0 + η e_1
#   => y* = [3(1 − η) e_0 + 2 e_1] / (5 − 3η),  y* − x* = (1 − 3η) / (2(5 − 3η)) (e_0 − e_1),
# biased towards the always-available client, (3 e_0 + 2 e_1)/5 as η → 0 (distance ‖e_0 − e_1‖/10):
# the mean over A_t gives client 0 weight 1 + 1/2 per cycle and client 1 only 2 · 1/2.
#
# FedAWE (client 1 starts from its copy x^{2k}, adopted after its last round):
#   y' = ½[(1 − η) z + η e_0] + ½[(1 − 2η) y + 2η e_1],  z = (1 − η) y + η e_0
#   => y* = [(2 − η) e_0 + 2 e_1] / (4 − η),  y* − x* = −η / (2(4 − η)) (e_0 − e_1) → 0 as η → 0.
def fixed_points(e, eta):
    biased = (3 * (1 - eta) * e[0] + 2 * e[1]) / (5 - 3 * eta)
    fedawe = ((2 - eta) * e[0] + 2 * e[1]) / (4 - eta)
    return biased, fedawe


def simulate(rule, e, rounds, lr, available=lambda t, i: i == 0 or t % 2 == 1):
    """Plain numpy: 'fedawe' (own copies + postponed broadcast) or 'interval' (no broadcast)."""
    n, d = e.shape
    x, copies, tau = np.zeros(d), np.zeros((n, d)), np.full(n, -1)
    for t in range(rounds):
        active = [i for i in range(n) if available(t, i)]
        if not active:
            continue
        echoed = []
        for i in active:
            start = copies[i] if rule == "fedawe" else x
            echoed.append(start + (t - tau[i]) * lr(t) * (e[i] - start))
            tau[i] = t
        x = np.mean(echoed, axis=0)
        if rule == "fedawe":
            copies[active] = x
    return x


def test_counterexample_closed_form():
    e = np.eye(2)
    star = e.mean(0)
    gap = np.linalg.norm(e[0] - e[1])
    for eta in (0.05, 0.1, 0.2):
        biased, fedawe = fixed_points(e, eta)
        np.testing.assert_allclose(simulate("interval", e, 400, lambda t, eta=eta: eta), biased, atol=1e-9)
        np.testing.assert_allclose(simulate("fedawe", e, 400, lambda t, eta=eta: eta), fedawe, atol=1e-9)
        assert np.linalg.norm(biased - star) == pytest.approx((1 - 3 * eta) / (2 * (5 - 3 * eta)) * gap)
        assert np.linalg.norm(fedawe - star) == pytest.approx(eta / (2 * (4 - eta)) * gap)
    # decaying lr (the paper's η_0 / √(t/10 + 1)): FedAWE reaches x*, the biased rule stays ~ gap/10 away
    lr = lambda t: 0.1 / np.sqrt(t / 10 + 1)  # noqa: E731
    rounds = 4000
    assert np.linalg.norm(simulate("fedawe", e, rounds, lr) - star) < 0.0015 * gap
    assert np.linalg.norm(simulate("interval", e, rounds, lr) - star) > 0.097 * gap


class IntervalReweighting(AvailabilityStrategy):
    """The counterexample's foil: x^{t+1} = x^t + mean_{A_t} (t − τ_i) Δ_i, every client starting
    from x^t (plain client rule, no postponed broadcast); τ_i kept by the server."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tau = {}

    def aggregate(self, t, x, reports):
        if not reports:
            return x, {}
        u = np.mean([(t - self.tau.get(r.client_id, -1)) * r.delta for r in reports], axis=0)
        self.tau.update({r.client_id: t for r in reports})
        return x + self.server_lr * u, {}


def test_counterexample_through_the_real_strategy_and_client_rule(tmp_path, monkeypatch):
    monkeypatch.setitem(STRATEGIES, "interval-reweighting", IntervalReweighting)
    (tmp_path / "trace.csv").write_text("# client 0 always, client 1 in odd rounds\n1,0\n1,1\n")
    rounds, eta = 80, 0.1  # contraction per two rounds: 0.805 (FedAWE), 0.765
    over = {"num-clients": 2, "num-server-rounds": rounds, "lr": eta, "eval-every": 0,
            "availability": f"trace-matrix:path={tmp_path / 'trace.csv'}"}
    e, _ = load_dataset("quadratic", num_clients=2, seed=0)
    e = e.x.numpy().astype(np.float64)
    star = e.mean(0)
    biased, fedawe = fixed_points(e, eta)
    finals = {}
    for rule in ("fedawe", "interval-reweighting"):
        run_dir, _ = run_grid(quadratic(tmp_path, **over, strategy=rule, **{"run-name": rule}))
        finals[rule] = torch.load(run_dir / "final_model.pt", weights_only=True)["x"].numpy()
        participants = [r["participants"] for r in read_metrics(run_dir)]
        assert participants[:4] == [[0], [0, 1], [0], [0, 1]]
    # the real code follows the plain simulation step by step...
    np.testing.assert_allclose(finals["fedawe"], simulate("fedawe", e, rounds, lambda t: eta), atol=1e-4)
    np.testing.assert_allclose(finals["interval-reweighting"], simulate("interval", e, rounds, lambda t: eta),
                               atol=1e-4)
    # ...and lands on the fixed points: FedAWE near x*, interval reweighting biased by the derived margin
    np.testing.assert_allclose(finals["fedawe"], fedawe, atol=1e-3)
    np.testing.assert_allclose(finals["interval-reweighting"], biased, atol=1e-3)
    gap = np.linalg.norm(e[0] - e[1])
    assert np.linalg.norm(finals["fedawe"] - star) < 0.014 * gap
    assert np.linalg.norm(finals["interval-reweighting"] - star) > 0.07 * gap


# ------------------------------------------------------------------ x̄, the official score
def drive(s, n, rounds, available, train, d=3):
    """Rounds of ``s`` against n real client rules (one context each); returns (x^t, copies)."""
    from flwr.app import ArrayRecord

    rule, contexts = FedAWERule(), [ctx(pid=c) for c in range(n)]
    x = np.linspace(-1.0, 1.0, d)
    for rnd in range(1, rounds + 1):
        t = rnd - 1
        sent = start_round(s, rnd, x, [NODE_ID_BASE + c for c in range(n)])
        replies = []
        for c in available(t):
            msg = sent[NODE_ID_BASE + c]
            start = rule.start(msg.content["arrays"].to_torch_state_dict(), contexts[c], c, t, msg.content["config"])
            trained = {"w": start["w"] + torch.as_tensor(train(t, c, start["w"].numpy()), dtype=torch.float32)}
            out = rule.reply(start, trained, contexts[c], c, t, msg.content["config"])
            replies.append(Message(RecordDict({"arrays": ArrayRecord(out),
                                               "metrics": MetricRecord({"num-examples": 5 + c, "client-id": c})}),
                                   reply_to=msg))
        arrays, _ = s.aggregate_train(rnd, replies)
        for m in s.configure_broadcast(rnd, arrays, Grid1(sent)):
            c = m.metadata.dst_node_id - NODE_ID_BASE
            rule.adopt(m.content["arrays"].to_torch_state_dict(), contexts[c], c, t, m.content["config"])
        x = arrays["w"].numpy()
    copies = []
    for c in range(n):
        state = StateStore(contexts[c], c, {RUN_KEY: s.run_key}).load()
        copies.append(np.linspace(-1.0, 1.0, d) if state is None else state.copy["w"].numpy())
    return x, np.array(copies)


@pytest.mark.parametrize(("clip", "server_lr", "weighting"),
                         [(0.0, 1.0, "equal"), (0.5, 1.0, "equal"), (0.0, 1.7, "equal"), (0.3, 0.6, "equal"),
                          (0.3, 1.5, "num-examples")])
def test_tracked_xbar_is_the_mean_of_every_clients_copy(clip, server_lr, weighting):
    """x̄ ← x̄ + (1/N) Σ_{A_t} (x^{t+1} − x_i^{t,0}) equals the mean of the copies the client rules
    hold, with and without the clip, η_g ≠ 1, empty rounds (t = 2, 5) and a client never seen (5)."""
    n = 6
    rng = np.random.default_rng(1)
    picks = {t: sorted(rng.choice(5, size=rng.integers(1, 5), replace=False).tolist()) for t in range(12)}
    picks[2] = picks[5] = []

    def train(t, c, w):
        return -0.3 * (w - (c - 2.0))  # a step toward e_c = c − 2: copies differ, updates large

    s = FedAWE(num_clients=n, clip=clip, server_lr=server_lr, weighting=weighting)
    x, copies = drive(s, n, 12, picks.__getitem__, train)
    assert not np.allclose(x, copies.mean(axis=0), atol=1e-2)  # x^t and x̄ differ: not a vacuous check
    np.testing.assert_allclose(s.xbar, copies.mean(axis=0), atol=1e-5)
    (xbar,) = s.extra_evaluation_arrays(named_arrays({"w": x})).values()
    np.testing.assert_allclose(xbar["w"].numpy(), copies.mean(axis=0), atol=1e-5)


def test_xbar_survives_a_checkpoint_and_needs_num_clients():
    a = FedAWE(num_clients=3, clip=0.5)
    drive(a, 3, 3, lambda t: [t % 3], lambda t, c, w: np.full_like(w, 0.4))
    b = FedAWE(num_clients=3)
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(b.xbar, a.xbar)
    assert FedAWE().extra_evaluation_arrays(named_arrays({"w": np.zeros(1, np.float32)})) == {}
    s = FedAWE()  # N not given (someone else's app): the nodes connected at the first round
    start_round(s, 1, np.zeros(2), [100, 101])
    assert s.num_clients == 2 and s.xbar.tolist() == [0.0, 0.0]


def test_update_norm_is_the_clients_own_local_change():
    """‖u_i‖ / (t − τ_i) = ‖Δ_i‖, whatever the copy's staleness (x_i^† − x^t) or the echo factor."""
    s = FedAWE(num_clients=3, min_available_nodes=1)
    sent = start_round(s, 5, np.zeros(2), [100])
    report = s.parse_reply(awe_reply(sent[100], [6.0, 8.0], 4, [6.0, 8.0], **{"client-id": 0}), 100, s.round)
    assert s.update_norm(report) == pytest.approx(2.5)


def test_inprocess_run_records_the_xbar_score_and_tracks_the_copies_in_the_state_dir(tmp_path):
    """A real run (ServerApp loop + ClientApp, η_g ≠ 1, clip on): the checkpointed x̄ equals the mean
    of the copies the clients wrote to the state dir, and every evaluated round records both scores."""
    state = tmp_path / "state"
    run_dir = run_inprocess(quadratic(tmp_path, **{"strategy": "fedawe:clip=0.5", "server-lr": 1.5,
                                                  "availability": "bernoulli:p=0.3", "checkpoint-every": 8,
                                                  "state-dir": str(state)}))
    rows = read_metrics(run_dir)
    assert all("test-distance-to-optimum" in r and "test-distance-to-optimum-xbar" in r for r in rows)
    assert any(r["test-distance-to-optimum"] != r["test-distance-to-optimum-xbar"] for r in rows)
    strategy = FedAWE.read_state(torch.load(run_dir / "checkpoints" / "round-0008.pt", weights_only=False)["strategy"])
    copies = []
    for c in range(6):  # a client never available has no file: its copy is still x^0 = 0
        path = state / f"client-{c}" / f"fedawe-{strategy.run_key}.pt"
        copies.append(torch.load(path, weights_only=True)["copy"]["x"].numpy() if path.exists() else np.zeros(10))
    assert len(list(state.glob("client-*/fedawe-*.pt"))) >= 3
    np.testing.assert_allclose(strategy.xbar, np.mean(copies, axis=0), atol=1e-5)


def test_norm_bound_judges_the_local_change_not_the_echo_or_the_stale_copy():
    """max-norm-ratio 1000 (the default): a rare client (echo factor 50, copy 900 away from x^t)
    with an ordinary local change passes; a client whose own change is 2000x the others' is
    rejected; so is a returned model 1e5 away from x^t with an ordinary echoed update."""
    s = FedAWE(num_clients=6, check_start=False)  # copies far from any model the server sent
    sent = start_round(s, 60, np.zeros(2), [100 + c for c in range(6)])
    ordinary = [awe_reply(sent[100 + c], [1.0, 0.0], 1, [1.0, 0.0], **{"client-id": c}) for c in range(3)]
    rare = awe_reply(sent[103], [900.0, 50.0], 50, [0.0, 50.0], **{"client-id": 3})  # ‖Δ‖ = 50 / 50 = 1
    wild = awe_reply(sent[104], [2000.0, 0.0], 1, [2000.0, 0.0], **{"client-id": 4})  # ‖Δ‖ = 2000
    far = awe_reply(sent[105], [1e5, 1e5], 1, [1.0, 0.0], **{"client-id": 5})  # x^† − x^t = 1.4e5
    s.aggregate_train(60, [*ordinary, rare, wild, far])
    assert s.round_log.participants == [0, 1, 2, 3]
    assert [node for node, _ in s.round_log.rejected] == [104, 105]


def test_the_consistency_check_spans_blocks_and_catches_a_start_off_by_a_little():
    """check-start over several blocks (d > 2 BLOCK): a start x_i^† − η_g u_i
    that is x^0 passes at float32 rounding (u_i computed in float32); one off x^0 by 0.1 in one
    coordinate of the last block (5e-4 of ‖x^0‖) is rejected."""
    d = 2 * BLOCK + 7232
    rng = np.random.default_rng(1)
    x0 = rng.normal(size=d).astype(np.float32)
    s = FedAWE(num_clients=4, server_lr=0.7)
    s.sketch_seed = 12345  # P is secret and random per run; fixed here so the test is deterministic
    sent = start_round(s, 1, x0, [100, 101])
    model = (x0 + rng.normal(scale=0.01, size=d)).astype(np.float32)
    honest = ((model.astype(np.float64) - x0) / 0.7).astype(np.float32)
    off = honest.copy()
    off[-5] -= np.float32(0.1 / 0.7)  # x_i^† − η_g u_i moves by 0.1 in one coordinate
    s.aggregate_train(1, [awe_reply(sent[100], model, 1, honest, **{"client-id": 0}),
                          awe_reply(sent[101], model, 1, off, **{"client-id": 1})])
    assert [n for n, _ in s.round_log.rejected] == [101] and "disagree" in s.round_log.rejected[0][1]
    assert s.round_log.participants == [0]


@pytest.mark.parametrize("lr", [1.0, 0.7])
def test_the_check_s_projection_is_its_definition_and_its_float32_sketch_stays_within_its_slack(lr):
    """P built entry by entry from its definition (strategies.rules.fedawe_sketch: block q, row k,
    column b -> c_rk a_r,qb; the tail t_r), over 2 full blocks, a shorter one and a tail: the
    float64 sketch of a model is P x, and the float32 P (Δ − η u) is off from the exact one by
    less than the slack the check adds for it, which grows with ‖Δ − η u‖ (0 there: a start at x^t)."""
    d = 2 * BLOCK + 5 * SPAN + 7
    p = Projection(12345, d)
    dense = np.zeros((SKETCH, d))
    for start in range(0, SPAN * p.cols, BLOCK):
        cols = min(BLOCK, SPAN * p.cols - start) // SPAN
        for r in range(SKETCH):
            block = np.outer(p.c[r].astype(np.float64), p.a[r, start // SPAN:start // SPAN + cols])
            dense[r, start:start + SPAN * cols] = block.ravel()
    dense[:, SPAN * p.cols:] = p.t
    assert p.row_norm == pytest.approx(np.linalg.norm(dense, axis=1).max(), rel=1e-12)
    rng = np.random.default_rng(0)
    x = rng.normal(size=d).astype(np.float32)
    np.testing.assert_allclose(p.of_model(x), dense @ x.astype(np.float64), rtol=1e-12)
    delta = rng.normal(scale=10, size=d).astype(np.float32)
    for update in (rng.normal(scale=10, size=d).astype(np.float32), (delta / np.float32(lr)).astype(np.float32)):
        sketch, start_norm = p.of_start(delta, update, lr)
        w = delta.astype(np.float64) - lr * update.astype(np.float64)
        exact = dense @ w
        assert start_norm >= np.linalg.norm(w) * (1 - 1e-6) or np.linalg.norm(w) < 1e-5 * np.linalg.norm(delta)
        slack = p.float32_slack(float(np.linalg.norm(delta)), float(np.linalg.norm(update)), lr, start_norm)
        assert np.all(np.abs(sketch - exact) <= slack), (np.abs(sketch - exact), slack)
    assert start_norm < 1e-3 * np.linalg.norm(delta)  # Δ − η u ≈ 0: the slack's second term vanishes


def test_a_checkpoint_of_the_dense_projection_is_refused_while_the_check_is_on(caplog):
    """A checkpoint from before the block-scaled P (no ``sketch_form``) holds sketches of another
    P: refused with the fix while check-start is on (never a silent check-off); with
    check-start=false it resumes without them, and says so. A current checkpoint keeps its
    sketches and its check, with the checkpoint's P."""
    a = FedAWE(num_clients=3)
    sent = start_round(a, 1, np.array([0.5, -0.5]), [100, 101])
    a.aggregate_train(1, [awe_reply(sent[100], [1.0, 1.0], 1, **{"client-id": 0})])
    saved = a.state_dict()
    b = FedAWE(num_clients=3)
    start_round(b, 1, np.array([0.5, -0.5]), [100, 101])  # b's own P, from its own seed, built
    b.load_state_dict(saved)
    assert b.sketches.keys() == a.sketches.keys() and -1 in b.sketches
    sent = start_round(b, 2, np.array([0.75, 0.25]), [100, 101])  # a's P now: a start at x^0 passes
    b.aggregate_train(2, [awe_reply(sent[101], [0.25, -0.25], 1, **{"client-id": 1})])
    assert b.round_log.participants == [1], b.round_log.rejected
    b.load_state_dict(saved)
    old = {**saved, "state": {k: v for k, v in saved["state"].items() if k != "sketch_form"}}
    with pytest.raises(ValueError, match="older projection.*resume with check-start=false"):
        b.load_state_dict(old)
    b = FedAWE(num_clients=3, check_start=False)
    with caplog.at_level("WARNING"):
        b.load_state_dict(old)
    assert b.sketches == {} and "dropped: check-start=false" in caplog.text
    sent = start_round(b, 2, np.array([0.75, 0.25]), [100, 101])  # a start no model the client can hold
    b.aggregate_train(2, [awe_reply(sent[101], [9.0, 9.0], 1, [1.0, 1.0], **{"client-id": 1})])
    assert b.round_log.participants == [1]
