"""Sampling reaches real nodes for any uint64 node ids (Flower draws them at random in [1, 2^64)).

NumPy turns a list of ids on both sides of 2^63 into float64, whose values are other nodes; the
draw must pick indices, and a message to a node that is not connected must be an error, never an
unavailable client.
"""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp.strategy import Strategy
from flwr.supercore.corestate.utils import generate_rand_int_from_bytes
from test_dropin import FlowerGrid, Tiny, tiny_app

from strategies import build_strategy
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
