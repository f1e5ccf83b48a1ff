"""Sampling reaches real nodes for any uint64 node ids (Flower draws them at random in [1, 2^64)).

NumPy turns a list of ids on both sides of 2^63 into float64, whose values are other nodes; the
draw must pick indices, and a message to a node that is not connected must be an error, never an
unavailable client.
"""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, MessageType
from flwr.serverapp.strategy import Strategy
from flwr.supercore.corestate.utils import generate_rand_int_from_bytes
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from rich.console import Console
from test_dropin import FlowerGrid, Tiny, tiny_app

from availability import build_schedule
from experiments.inprocess import InProcessGrid, default_run_config
from server_app.config import RunConfig
from strategies import STRATEGIES, build_strategy
from strategies.protocol import PROBE_BATCHES
from strategies.sampling import Sampling, check_destinations, draw

# ids on both sides of 2^63 (the pair the issue found as float64), and Flower's edges
STRADDLING = [1517244241696706561, 13946623257709623111, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 1, 1, 7]


def flower_ids(n: int) -> list[int]:
    """``n`` node ids drawn by Flower's own function (8 bytes of os.urandom, unsigned): a new
    federation each run, as a SuperLink's."""
    ids: set[int] = set()
    while len(ids) < n:
        ids.add(generate_rand_int_from_bytes(8, exclude=ids))
    return sorted(ids)


def test_numpy_would_round_these_ids():
    """The failure this guards against is real: the ids become floats that name other nodes."""
    rounded = np.array(STRADDLING[:2])
    assert rounded.dtype == np.float64 and int(rounded[1]) != STRADDLING[1]


@pytest.mark.parametrize("ids", [STRADDLING, flower_ids(50), flower_ids(9)], ids=["straddling", "flower-50",
                                                                                         "flower-9"])
def test_a_draw_returns_exactly_the_given_ids(ids):
    sampling = Sampling(fraction_train=0.5, fraction_evaluate=0.3, min_train_nodes=1, min_evaluate_nodes=1)
    rng = np.random.default_rng(0)
    seen: set[int] = set()
    for _ in range(40):
        for train in (True, False):
            picked = sampling.sample(ids, train, rng)
            assert len(picked) == sampling.size(len(ids), train) and len(set(picked)) == len(picked)
            assert set(picked) <= set(ids)
            assert all(type(n) is int for n in picked)
            seen |= set(picked)
    assert seen == set(ids)  # every node is reachable by the draw
    weighted = draw(ids, 3, rng, p=np.full(len(ids), 1 / len(ids)))
    assert set(weighted) <= set(ids)


def test_a_message_to_a_node_that_is_not_connected_is_an_error():
    wrong = int(np.array(STRADDLING[:2])[1])  # the float-rounded id: no such node
    with pytest.raises(ValueError, match=r"not connected \(\[" + str(wrong)):
        check_destinations([STRADDLING[0], wrong], STRADDLING, "fedau")
    assert check_destinations([STRADDLING[1], STRADDLING[0]], STRADDLING, "fedau") == sorted(STRADDLING[:2])

    class RoundsIds(type(build_strategy("fedavg-active"))):
        name = ""  # not registered

        def select_nodes(self, server_round, arrays, nodes, grid):
            return [int(n) for n in np.array(nodes, dtype=np.float64)]  # the old bug, in a subclass

    grid = FlowerGrid(len(STRADDLING), {}, client_app=tiny_app(), node_ids=STRADDLING)
    with pytest.raises(ValueError, match="not connected"):
        RoundsIds().configure_train(1, ArrayRecord(Tiny().state_dict()), ConfigRecord(), grid)


@pytest.mark.parametrize("spec", ["fedavg-active", "fedau", "pow-d:d=4,m=2"])
@pytest.mark.parametrize("ids", [STRADDLING, flower_ids(8)], ids=["straddling", "flower"])
def test_fractions_train_and_evaluate_real_nodes_under_flowers_start(spec, ids):
    """Flower's own start loop, fraction 0.5 (pow-d: its own selection), every round: the sampled
    nodes all reply, so none is counted unavailable and the model moves."""
    kwargs = {} if spec.startswith("pow-d") else {"fraction_train": 0.5}
    strategy = build_strategy(spec, num_clients=len(ids), fraction_evaluate=0.5, min_evaluate_nodes=1, **kwargs)
    torch.manual_seed(0)
    initial = ArrayRecord(Tiny().state_dict())
    grid = FlowerGrid(len(ids), {}, client_app=tiny_app(), node_ids=ids)
    result = Strategy.start(strategy, grid=grid, initial_arrays=initial, num_rounds=3, timeout=60,
                            train_config=ConfigRecord({"lr": 0.5}))
    for rnd, metrics in result.train_metrics_clientapp.items():
        assert metrics["num-participants"] == (2 if spec.startswith("pow-d") else len(ids) // 2), rnd
        assert metrics["num-unavailable"] == 0, rnd
    assert set(m.metadata.dst_node_id for m in grid.delivered) <= set(ids)
    assert len(result.evaluate_metrics_clientapp) == 3
    assert not torch.equal(result.arrays.to_torch_state_dict()["fc.weight"], initial.to_torch_state_dict()["fc.weight"])


# ------------------------------------------- the project's ServerApp: offline is not connected
def fraction_of_the_online(rule: str) -> type:
    """A user's rule: the built-in ``rule`` over ``fraction`` (a spec parameter) of the connected
    nodes, at least one (``strategy = "test_sampling:FractionFedau:fraction=0.3"``)."""
    base = STRATEGIES[rule]

    def __init__(self, *, fraction: float = 0.5, **kwargs):
        base.__init__(self, **{"fraction_train": fraction, "min_train_nodes": 1, **kwargs})

    name = "Fraction" + rule.title().replace("-", "")
    return type(name, (base,), {"name": f"fraction-{rule}", "__init__": __init__, "__module__": __name__})


FractionFedavgActive = fraction_of_the_online("fedavg-active")
FractionFedavgAll = fraction_of_the_online("fedavg-all")
FractionFedau = fraction_of_the_online("fedau")
FractionDebiasedFedavg = fraction_of_the_online("debiased-fedavg")
FractionMifa = fraction_of_the_online("mifa")
FRACTION_RULES = [FractionFedavgActive, FractionFedavgAll, FractionFedau, FractionDebiasedFedavg, FractionMifa]


class Deployed(InProcessGrid):
    """What a deployment's SuperLink lists: only the SuperNodes the churn driver left running, those
    of the clients online in round r, where r - 1 rounds are in the run's metrics.jsonl (the driver
    starts round r's nodes once round r - 1's line is written)."""

    def __init__(self, *args, run_dir, schedule, **kwargs):
        super().__init__(*args, **kwargs)
        self.run_dir, self.schedule = run_dir, schedule

    def get_node_ids(self):
        metrics = self.run_dir / "metrics.jsonl"
        done = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
        online = self.schedule.available(done)
        return [n for n, c in self.partition_of.items() if online[c]]


QUADRATIC = {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": 8,
             "num-server-rounds": 5, "availability": "bernoulli:p=0.5", "local-steps": "steps:n=1", "batch-size": 1,
             "progress": False, "checkpoint-every": 0}


def addressed_sets(over: dict, tmp_path) -> tuple[dict, dict, object, RunConfig]:
    """The project's ServerApp run in simulation (gate ``server``) and as deployed (gate ``none``,
    :class:`Deployed`: offline nodes never listed): the clients each gate addressed, by (round, kind),
    kind TRAIN, EVALUATE (federated evaluation) or PROBE (power-of-choice's EVALUATE probe)."""
    from server_app.experiment import run

    addressed, n = {}, int(over["num-clients"])
    for gate in ("server", "none"):
        run_config = {**default_run_config(), **QUADRATIC, **over, "availability-gate": gate,
                      "results-dir": str(tmp_path / gate), "run-name": "run"}
        cfg = RunConfig.from_run_config(run_config)
        schedule = build_schedule(cfg.availability.availability, n, cfg.availability.schedule_seed)
        if gate == "none":  # the launcher's min-nodes: the nodes up when the run starts
            cfg = RunConfig.from_run_config({**run_config, "min-nodes": int(schedule.available(0).sum())})
        grid = (InProcessGrid(n, run_config) if gate == "server" else
                Deployed(n, run_config, run_dir=tmp_path / gate / "run", schedule=schedule))
        run(grid, cfg, console=Console(quiet=True))
        rounds: dict[tuple[int, str], list[int]] = {}
        for m in grid.delivered:
            config = m.content.config_records.get("config", {})
            if "server-round" in config and m.metadata.message_type in (MessageType.TRAIN, MessageType.EVALUATE):
                kind = PROBE if PROBE_BATCHES in config else m.metadata.message_type
                rounds.setdefault((int(config["server-round"]), kind), []).append(grid.partition_of[m.metadata.dst_node_id])
        addressed[gate] = {k: sorted(v) for k, v in rounds.items()}
    return addressed["server"], addressed["none"], schedule, cfg


PROBE = "probe"
UNIT = st.sampled_from([0.3, 0.5, 0.7, 0.9])
SCHEDULES = st.one_of(  # the models that need no label distributions (the quadratic workload has none)
    st.just("always"), UNIT.map(lambda p: f"bernoulli:p={p}"),
    st.tuples(UNIT, UNIT).map(lambda pq: f"on-off:p={pq[0]},q={pq[1]},spread=0.1"),
    st.tuples(st.integers(1, 3), UNIT).map(lambda g: f"group-dropout:groups={g[0]},fail=0.3,recover=0.6,p={g[1]}"),
    st.tuples(st.integers(1, 3), UNIT).map(lambda g: f"group-cyclic:groups={g[0]},window=1,sample={g[1]}"),
    st.sampled_from([0.2, 0.4]).map(lambda a: f"dropout:alpha={a}"),
    st.sampled_from([0.3, 1.0]).map(lambda s: f"ln:sigma={s}"))


@st.composite
def sampled_runs(draw):
    """A rule that samples among the connected (a fraction of them, or power-of-choice's d
    candidates and m of them), a schedule and its parameters, N, rounds, seeds, federated evaluation."""
    if draw(st.booleans()):
        d = draw(st.integers(1, 5))
        variant = draw(st.sampled_from(["pow-d", "cpow-d", "rpow-d"]))
        spec = f"pow-d:d={d},m={draw(st.integers(1, d))},variant={variant}"
    else:
        rule = draw(st.sampled_from(FRACTION_RULES)).__name__
        spec = f"test_sampling:{rule}:fraction={draw(st.sampled_from([0.2, 0.5, 0.7, 1.0]))}"
    return {"strategy": spec, "availability": draw(SCHEDULES), "num-clients": draw(st.integers(3, 8)),
            "num-server-rounds": draw(st.integers(2, 4)), "schedule-seed": draw(st.integers(0, 2**16)),
            "train-seed": draw(st.integers(0, 3)), "federated-evaluation": draw(st.booleans())}


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(over=sampled_runs())
def test_the_serverapp_samples_among_the_online_as_a_deployment_does(over, tmp_path_factory):
    """The project's ServerApp in simulation (gate ``server``) and in a deployment (gate ``none``, the
    offline SuperNodes stopped: never listed) address the same clients, round by round, for the same
    schedule, seeds and rule, on random configs: the sampler applied to the online set (a user's rule
    with fraction_train < 1; power-of-choice's probed candidates and trained clients)."""
    over = {**QUADRATIC, **over}
    # a deployment cannot start with nobody online (deploy.churn refuses: min-nodes 0 means N)
    assume(build_schedule(over["availability"], over["num-clients"], over["schedule-seed"]).available(0).any())
    server, deployed, schedule, cfg = addressed_sets(over, tmp_path_factory.mktemp("run"))
    assert server == deployed, over

    rounds = int(over["num-server-rounds"])
    online = [np.flatnonzero(row).tolist() for row in schedule.matrix(rounds)]
    assert all(set(clients) <= set(online[rnd - 1]) for (rnd, _), clients in server.items())
    trained = [server.get((r, MessageType.TRAIN), []) for r in range(1, rounds + 1)]
    if over["strategy"].startswith("pow-d"):  # d candidates probed among the online, m of them trained
        strategy = build_strategy(over["strategy"], num_clients=int(over["num-clients"]))
        candidates = [server.get((r, PROBE), []) for r in range(1, rounds + 1)]
        if strategy.rule.params.variant == "rpow-d":  # no probe: it chooses by the train losses reported
            assert candidates == [[]] * rounds
        else:
            assert [len(c) for c in candidates] == [min(strategy.rule.params.d, len(o)) for o in online]
            assert all(set(t) <= set(c) and len(t) == min(strategy.rule.params.m, len(c))
                       for t, c in zip(trained, candidates, strict=True))
    else:  # Flower's size, max(int(fraction x online), 1), drawn by the rule's seeded generator from the online
        strategy = build_strategy(over["strategy"], num_clients=int(over["num-clients"]))
        rng = np.random.default_rng(cfg.workload.train_seed)
        assert trained == [sorted(strategy.sampling.sample(o, True, rng)) for o in online]
    evaluated = [server.get((r, MessageType.EVALUATE), []) for r in range(1, rounds + 1)]
    assert evaluated == (online if over["federated-evaluation"] else [[]] * rounds)
