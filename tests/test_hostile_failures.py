"""No minority can end a run (issue 27, item 6); the federation producing nothing still fails.

:class:`FailurePolicy` counts distinct nodes: after ``max_failed_rounds`` rounds in a row with no
usable reply, the run fails only when the nodes rejected in them are more than half of the
run's nodes (or the rule reported a problem); a junk-only minority is quarantined.
"""

import logging

import numpy as np
import pytest
from replies import build_rule, rule_reply, start_round

from strategies import STRATEGIES
from strategies.failures import FailurePolicy, StrategyFailure

JUNK = "array 'w' cannot be decoded"


def play(policy, rounds, nodes=range(20), rejected_nodes=(0,), problems=()):
    for rnd in rounds:
        policy.end_round(rnd, received=len(rejected_nodes), accepted=0,
                         rejected=[(n, JUNK) for n in rejected_nodes], problems=list(problems), nodes=nodes)


def test_one_junk_node_while_everyone_else_is_offline_is_quarantined_not_fatal(caplog):
    policy = FailurePolicy("fedavg-active", 3)
    policy.end_round(1, received=19, accepted=19, rejected=[], problems=[], nodes=range(20))  # everyone, once
    with caplog.at_level(logging.WARNING, logger="flwr"):
        play(policy, range(2, 12))  # node 0 alone, junk, for 10 rounds
    assert policy.quarantined == {0}
    assert caplog.text.count("quarantined") == 1  # logged once


def test_a_junk_minority_of_several_nodes_is_quarantined_too():
    policy = FailurePolicy("mifa", 3)
    play(policy, range(1, 7), rejected_nodes=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9))  # 10 of 20: not a majority
    assert policy.quarantined == set(range(10))


def test_a_junk_majority_ends_the_run_with_the_reasons():
    policy = FailurePolicy("mifa", 3)
    with pytest.raises(StrategyFailure, match=r"could use no reply in 3 rounds in a row \(rounds 1-3.*cannot be decoded \(11 replies\)"):
        play(policy, range(1, 4), rejected_nodes=range(11))


def test_a_misconfigured_federation_fails_even_when_its_nodes_come_one_at_a_time():
    """Every node sends junk, a few per round (churn): the rejected nodes add up to a majority."""
    policy = FailurePolicy("fedavg-active", 3)
    with pytest.raises(StrategyFailure) as err:
        for rnd in range(1, 40):
            play(policy, [rnd], rejected_nodes=[(2 * rnd) % 20, (2 * rnd + 1) % 20])
    assert "rounds 1-" in str(err.value)
    assert 5 <= len(policy.failed_rounds) <= 11  # fails once 11 of 20 nodes have shown junk


def test_a_single_node_federation_that_sends_junk_fails():
    policy = FailurePolicy("fedavg-active", 3)
    with pytest.raises(StrategyFailure):
        play(policy, range(1, 4), nodes=[0])


def test_a_problem_of_the_rule_still_fails_and_a_usable_round_resets():
    policy = FailurePolicy("pow-d", 2)
    play(policy, [1], problems=["no reply carries a train loss"])
    policy.end_round(2, received=3, accepted=1, rejected=[], problems=[], nodes=range(20))
    play(policy, [3], problems=["no reply carries a train loss"])
    with pytest.raises(StrategyFailure, match="train loss"):
        play(policy, [4], problems=["no reply carries a train loss"])


def test_silent_rounds_are_not_failures_and_zero_never_fails():
    policy = FailurePolicy("fedavg-active", 3)
    for rnd in range(1, 10):
        policy.end_round(rnd, received=0, accepted=0, rejected=[], problems=[], nodes=range(20))
    assert policy.failed_rounds == []
    play(FailurePolicy("fedavg-active", 0), range(1, 10), nodes=[0])  # 0: never stops


# ------------------------------------------------------------- through every rule's aggregate_train
RULES = sorted(STRATEGIES)


def junk(name, sent, x, client):
    return rule_reply(name, sent, x, client, arrays={"w": np.array(["junk"] * 3)})


@pytest.mark.parametrize("name", RULES)
def test_one_node_sending_junk_while_the_others_are_offline_does_not_end_the_run(name):
    s = build_rule(name, n=4)  # max_failed_rounds = 3, the default
    x = np.array([1.0, -1.0, 2.0], np.float32)
    sent = start_round(s, 1, x, [100, 101, 102, 103])
    s.aggregate_train(1, [rule_reply(name, sent[100 + c], x + 0.1, c) for c in range(4) if 100 + c in sent])
    for rnd in range(2, 8):  # only node 103 replies, with junk, for 6 rounds
        sent = start_round(s, rnd, x, [100, 101, 102, 103])
        s.aggregate_train(rnd, [junk(name, sent[103], x, 3)] if 103 in sent else [])
    assert s.failures.quarantined <= {103}


@pytest.mark.parametrize("name", ["fedavg-active", "mifa", "fednova", "fedawe"])
def test_every_node_sending_junk_still_ends_the_run(name):
    s = build_rule(name, n=4)
    x = np.array([1.0, -1.0, 2.0], np.float32)
    with pytest.raises(StrategyFailure, match="could use no reply in 3 rounds"):
        for rnd in range(1, 5):
            sent = start_round(s, rnd, x, [100, 101, 102, 103])
            s.aggregate_train(rnd, [junk(name, sent[100 + c], x, c) for c in range(4)])


@pytest.mark.parametrize("name", ["fedavg-active", "mifa", "fedau", "stale", "fedawe", "fednova"])
def test_sybils_that_take_every_id_in_round_one_then_go_silent_do_not_end_the_run(name):
    """Issue 27: nodes 50-53 claim clients 0-3 first (the lower node id wins), then stay connected
    and silent; the real nodes 100-103 are rejected (the log says who holds their ids) but the
    sybils are no majority of the run's nodes, so the run goes on."""
    s = build_rule(name, n=4)
    x = np.array([1.0, -1.0, 2.0], np.float32)
    nodes = [50, 51, 52, 53, 100, 101, 102, 103]
    sent = start_round(s, 1, x, nodes)
    s.aggregate_train(1, [rule_reply(name, sent[n], x + 0.1, n % 50 if n < 100 else n - 100) for n in nodes])
    assert sorted(s.node_of_client.values()) == [50, 51, 52, 53]
    for rnd in range(2, 7):
        sent = start_round(s, rnd, x, nodes)
        s.aggregate_train(rnd, [rule_reply(name, sent[100 + c], x + 0.1, c) for c in range(4)])
        assert all("belongs to node 5" in why for _, why in s.round_log.rejected)
    assert s.failures.quarantined == {100, 101, 102, 103}


@pytest.mark.parametrize("name", ["fedavg-active", "mifa"])
def test_one_junk_node_alone_connected_while_the_others_are_offline_does_not_end_the_run(name):
    """Issue 39: in a deployment, offline nodes are not listed (cyclic or group availability): for
    5 rounds node 103 is the only node connected and sends junk. The federation is N = 4 clients,
    not the one node heard from: it is quarantined and the run waits for the others."""
    s = build_rule(name, n=4, min_available_nodes=1)  # max_failed_rounds = 3, the default
    x = np.array([1.0, -1.0, 2.0], np.float32)
    for rnd in range(1, 6):
        sent = start_round(s, rnd, x, [103])
        s.aggregate_train(rnd, [junk(name, sent[103], x, 3)])
    assert s.failures.quarantined == {103}
    sent = start_round(s, 6, x, [100, 101, 102, 103])  # the others are back: their replies are used
    out, _ = s.aggregate_train(6, [rule_reply(name, sent[100 + c], x + 0.1, c) for c in range(3)])
    assert s.round_log.participants == [0, 1, 2]


def test_a_junk_node_alone_ends_a_run_without_a_known_n_as_before():
    """Without N, the one node heard from is the whole federation: its junk ends the run."""
    s = build_rule("fedavg-active", n=4, min_available_nodes=1)
    s.num_clients = None
    x = np.array([1.0, -1.0, 2.0], np.float32)
    with pytest.raises(StrategyFailure):
        for rnd in range(1, 5):
            sent = start_round(s, rnd, x, [103])
            s.aggregate_train(rnd, [junk("fedavg-active", sent[103], x, 3)])
