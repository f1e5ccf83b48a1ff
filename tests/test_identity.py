"""Client ids are bound to the node that first claimed them: no node can write another's state."""

import numpy as np
import pytest
from replies import reply, start_round

from strategies import FedAvgActive
from strategies.rules.fedau import FedAU
from strategies.rules.mifa import MIFA


def play(strategy, rnd, connected, claims):
    """Round ``rnd`` with ``connected`` nodes; ``claims`` = [(node, client id, update)], in reply order."""
    x = np.zeros(2)
    sent = start_round(strategy, rnd, x, connected)
    replies = [reply(sent[node], x + np.asarray(u), **{"client-id": c}) for node, c, u in claims]
    arrays, _ = strategy.aggregate_train(rnd, replies)
    return arrays["w"].numpy()


def rejected(strategy):
    return dict(strategy.round_log.rejected)


def bound_mifa():
    """MIFA with N = 4 after one round: node 100 is client 0, node 101 is client 1."""
    s = MIFA(num_clients=4)
    play(s, 1, [100, 101], [(100, 0, [1.0, 0.0]), (101, 1, [0.0, 1.0])])
    assert s.node_of_client == {0: 100, 1: 101}
    return s


def test_an_impostor_of_a_connected_client_is_rejected_and_its_row_kept():
    s = bound_mifa()
    play(s, 2, [100, 101, 200], [(101, 1, [0.0, 2.0]), (200, 0, [9.0, 9.0])])  # 100 connected, silent
    assert rejected(s) == {200: "client 0 belongs to node 100, still connected (if node 200 is client 0's own, node 100 squats its id: without SuperNode authentication a node id proves nothing)"}
    np.testing.assert_array_equal(s.rule_state.table.row(0), [1.0, 0.0])
    assert s.round_log.participants == [1] and s.node_of_client[0] == 100


def test_a_node_switching_its_claim_is_rejected():
    s = bound_mifa()
    play(s, 2, [100, 101], [(100, 0, [1.0, 1.0]), (101, 2, [5.0, 5.0])])  # client 2 is free
    assert "node 101 is bound to client 1; it may not claim client 2" == rejected(s)[101]
    assert not s.rule_state.table.seen[2] and s.node_of_client == {0: 100, 1: 101}


def test_a_restarted_node_takes_its_id_back_once_the_old_node_is_gone():
    s = FedAU(num_clients=3, cutoff=0)
    play(s, 1, [100, 101], [(100, 0, [1.0, 0.0]), (101, 1, [0.0, 1.0])])
    # round 2: node 100 restarted as 300, but the old id is still listed (heartbeat not expired)
    play(s, 2, [100, 101, 300], [(300, 0, [1.0, 0.0]), (101, 1, [0.0, 1.0])])
    assert rejected(s) == {300: "client 0 belongs to node 100, still connected (if node 300 is client 0's own, node 100 squats its id: without SuperNode authentication a node id proves nothing)"}
    # round 3: node 100 is gone; 300 takes client 0 back and keeps its FedAU history
    play(s, 3, [101, 300], [(300, 0, [1.0, 0.0]), (101, 1, [0.0, 1.0])])
    assert rejected(s) == {} and s.node_of_client[0] == 300 and s.round_log.participants == [0, 1]
    assert s.rule_state.interval_num[0] == 2 and s.rule_state.interval_sum[0] == 1 + 2  # intervals 1 and 2, one history
    assert 100 not in s.client_of_node and s.client_of_node[300] == 0


@pytest.mark.parametrize("order", [(104, 105), (105, 104)])
def test_two_nodes_claiming_one_free_id_the_first_to_arrive_wins(order):
    """A claim's verdict is final when it arrives (a streaming rule folds the reply in at once)."""
    s = FedAvgActive(num_clients=4)
    updates = {104: [2.0, 0.0], 105: [0.0, 7.0]}
    new = play(s, 1, [104, 105], [(n, 2, updates[n]) for n in order])
    first, second = order
    np.testing.assert_array_equal(new, updates[first])
    assert f"node {first} claimed it first" in rejected(s)[second] and s.node_of_client == {2: first}


def test_the_bound_owner_wins_over_a_lower_node_id_and_a_node_replies_once():
    s = bound_mifa()
    new = play(s, 2, [50, 100, 101], [(50, 1, [9.0, 9.0]), (101, 1, [0.0, 3.0]), (101, 1, [0.0, 4.0])])
    np.testing.assert_array_equal(s.rule_state.table.row(1), [0.0, 3.0])
    assert rejected(s)[50].startswith("client 1 belongs to node 101, still connected")
    assert rejected(s)[101] == "second reply for client 1 this round: node 101 replied before"
    np.testing.assert_array_equal(new, (np.array([1.0, 0.0]) + np.array([0.0, 3.0])) / 4)  # MIFA: mean of rows


def test_a_rejected_reply_binds_nothing():
    s = FedAvgActive(num_clients=4, max_update_norm=10)
    play(s, 1, [100, 101], [(100, 0, [1e3, 0.0]), (101, 1, [1.0, 0.0])])
    assert s.node_of_client == {1: 101}
    play(s, 2, [100, 102], [(102, 0, [1.0, 0.0])])  # 100 still connected, but never bound
    assert rejected(s) == {} and s.node_of_client[0] == 102


def test_the_binding_survives_a_checkpoint():
    s = bound_mifa()
    state = s.state_dict()
    again = MIFA(num_clients=4)
    again.load_state_dict(state)
    play(again, 2, [100, 101, 200], [(200, 0, [9.0, 9.0])])
    assert rejected(again) == {200: "client 0 belongs to node 100, still connected (if node 200 is client 0's own, node 100 squats its id: without SuperNode authentication a node id proves nothing)"}

