"""Secure rounds that fail closed (issue 47, items 4 and 7): one hostile client of 5 edits its SecAgg+
replies as a client can (it knows its own unmasked integers, so an edit of its masked vector edits
the sum); each attack makes that round a failed secure round (no update applied, the reason in the
round's problems, ``secure-attack`` = 1, never an exception out of ``configure_train``), the next
honest round completes, and a run whose secure rounds all fail ends failed with the reason."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from flwr.common import bytes_to_ndarray, ndarray_to_bytes
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from experiments.inprocess import InProcessGrid
from runconfig import WorkloadConfig, from_run_config
from runconfig.defaults import default_run_config
from strategies import build_strategy
from strategies.failures import StrategyFailure
from strategies.grid import DelegatingGrid
from strategies.layout import Layout
from workloads.workload import get_workload

N = 5
TINY = {"num-clients": N, "dataset": "digits", "model": "mlp", "eval-every": 0, "local-steps": "steps:n=2",
        "checkpoint-every": 0, "progress": False}
MOD, Q = 2**32, 2**22  # Flower's modulus and quantisation range


def _masked(record, edit):
    arrays = [bytes_to_ndarray(b) for b in record[Key.MASKED_PARAMETERS]]
    record[Key.MASKED_PARAMETERS] = [ndarray_to_bytes(a) for a in edit(arrays)]


def _add(index, k):
    def edit(arrays):
        a = arrays[index]
        arrays[index] = ((a.astype(np.int64) + k) % MOD).astype(a.dtype)
        return arrays
    return edit


ATTACKS = {  # name -> (stage, edit of the reply's SecAgg+ record, what the round's problem says)
    # the sum's weight element (Flower divides by it) set to 0 or 1: the attacker, which knows the round's
    # N honest elements of 2^22, shifts its own by -N 2^22 (or 1 - N 2^22)
    "weight element 0": (Stage.COLLECT_MASKED_VECTORS, lambda r: _masked(r, _add(0, -N * Q)), "weight element"),
    "weight element 1": (Stage.COLLECT_MASKED_VECTORS, lambda r: _masked(r, _add(0, 1 - N * Q)), "weight element"),
    "weight element of its own 0": (Stage.COLLECT_MASKED_VECTORS, lambda r: _masked(r, _add(0, -Q)), "weight element"),
    "+2^31-1 quanta on every entry": (Stage.COLLECT_MASKED_VECTORS, lambda r: _masked(r, _add(1, 2**31 - 1)),
                                      "a vector was shifted"),
    "masked vector one entry short": (Stage.COLLECT_MASKED_VECTORS,
                                      lambda r: _masked(r, lambda a: [a[0], a[1][:-1]]), "masked vector has arrays"),
    "stage-2 reply without masked_params": (Stage.COLLECT_MASKED_VECTORS,
                                            lambda r: r.pop(Key.MASKED_PARAMETERS), "no 'masked_params'"),
    "stage-3 reply one share short": (Stage.UNMASK, lambda r: r.__setitem__(Key.SHARE_LIST, r[Key.SHARE_LIST][:-1]),
                                      "5 nids but 4 shares"),
    "stage-3 reply with garbage shares": (Stage.UNMASK,  # well-formed, so Flower's own code meets it
                                          lambda r: r.__setitem__(Key.SHARE_LIST, [b"x" * 3 for _ in r[Key.SHARE_LIST]]),
                                          "SecAgg+ attack at stage unmask"),
    "setup reply without its public keys": (Stage.SETUP, lambda r: r.pop(Key.PUBLIC_KEY_1), "no bytes field"),
    "share-keys reply one ciphertext short": (Stage.SHARE_KEYS,
                                              lambda r: r.__setitem__(Key.CIPHERTEXT_LIST, r[Key.CIPHERTEXT_LIST][:-1]),
                                              "4 dsts but 3 ctxts"),
}


class HostileGrid(DelegatingGrid):
    """The in-process grid, one node of which edits its reply to one SecAgg+ stage while ``on``."""

    def __init__(self, grid, node, stage, edit):
        super().__init__(grid)
        self.node, self.stage, self.edit, self.on = node, stage, edit, True

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        stage = next((m.content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE) for m in messages
                      if RECORD_KEY_CONFIGS in m.content.config_records), None)  # one stage per call
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            if self.on and stage == self.stage and r.metadata.src_node_id == self.node and not r.has_error():
                self.edit(r.content.config_records[RECORD_KEY_CONFIGS])
        return replies


def hostile_run(spec, stage, edit):
    run_config = {**default_run_config(), **TINY}
    inner = InProcessGrid(N, run_config)
    grid = HostileGrid(inner, sorted(inner.get_node_ids())[-1], stage, edit)
    strategy = build_strategy(spec, num_clients=N, min_available_nodes=0)
    x = ArrayRecord(get_workload(from_run_config(WorkloadConfig, run_config)).new_model().state_dict())
    return grid, strategy, x, Layout.of(x)


def one_round(strategy, rnd, x, grid):
    assert list(strategy.configure_train(rnd, x, ConfigRecord(), grid)) == []  # never raises: the round ran
    return strategy.aggregate_train(rnd, [])


BEFORE_TRAINING = (Stage.SETUP, Stage.SHARE_KEYS)  # a named node's malformed reply there: dropped, not a veto


@pytest.mark.parametrize("attack", [a for a in ATTACKS if ATTACKS[a][0] not in BEFORE_TRAINING])
def test_each_attack_fails_its_round_closed_and_the_run_goes_on(attack):
    stage, edit, says = ATTACKS[attack]
    grid, strategy, x, layout = hostile_run("fedavg-active:secure=secagg+", stage, edit)
    new, metrics = one_round(strategy, 1, x, grid)
    assert np.array_equal(layout.flatten(new), layout.flatten(x))  # no update applied
    assert metrics["secure-attack"] == 1 and metrics["secure-completed"] == 0
    assert any("SecAgg+ attack" in p and says in p and "fails closed" in p for p in strategy.problems), strategy.problems
    if "weight" not in attack and "shifted" not in says and "garbage" not in attack:
        assert any(f"node {grid.node}" in p for p in strategy.problems)  # a malformed reply names its node
    grid.on = False  # the next round, honest: completes and trains
    new2, metrics2 = one_round(strategy, 2, new, grid)
    assert metrics2["secure-completed"] == 1 and "secure-attack" not in metrics2 and metrics2["secure-survivors"] == N
    assert not np.array_equal(layout.flatten(new2), layout.flatten(new))


@pytest.mark.parametrize("attack", [a for a in ATTACKS if ATTACKS[a][0] in BEFORE_TRAINING])
def test_a_malformed_reply_before_training_drops_its_node_and_the_round_completes_without_it(attack, caplog):
    """Before the stage that trains, a malformed reply names its node: the round runs again without
    it and completes with the others (before: failed closed, so one client could fail every secure
    round it was in, and three in a row ended the run). The attack is logged with its node."""
    stage, edit, says = ATTACKS[attack]
    grid, strategy, x, layout = hostile_run("fedavg-active:secure=secagg+", stage, edit)
    with caplog.at_level("WARNING", logger="flwr"):
        new, metrics = one_round(strategy, 1, x, grid)
    assert metrics["secure-completed"] == 1 and metrics["secure-dropped"] == 1 and "secure-attack" not in metrics
    assert metrics["secure-survivors"] == N - 1 and len(strategy.round_log.participants) == N - 1
    assert not np.array_equal(layout.flatten(new), layout.flatten(x))  # the honest clients trained
    assert any(says in r.getMessage() and f"node {grid.node}" in r.getMessage() and "dropped" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    for rnd in (2, 3, 4):  # every round it is in: no veto, the run goes on
        new, metrics = one_round(strategy, rnd, new, grid)
        assert metrics["secure-completed"] == 1, metrics


@pytest.mark.parametrize("attack", ["weight element 0", "weight element 1"])
def test_fedau_fails_the_weight_attacks_closed(attack):
    stage, edit, says = ATTACKS[attack]
    grid, strategy, x, layout = hostile_run("fedau:secure=secagg+", stage, edit)
    new, metrics = one_round(strategy, 1, x, grid)
    assert np.array_equal(layout.flatten(new), layout.flatten(x)) and metrics["secure-attack"] == 1
    assert any(says in p for p in strategy.problems)


def test_a_sum_beyond_the_survivors_clip_fails_closed():
    """Inside SecAgg+'s range but beyond n × the client-side clip (max-update-norm): 2^16 quanta
    (0.25) on every entry; honest clients clip to 0.01."""
    stage, _, _ = ATTACKS["weight element 0"]
    grid, strategy, x, layout = hostile_run("fedavg-active:secure=secagg+,max-update-norm=0.01", stage,
                                            lambda r: _masked(r, _add(1, 2**16)))
    new, metrics = one_round(strategy, 1, x, grid)
    assert np.array_equal(layout.flatten(new), layout.flatten(x)) and metrics["secure-attack"] == 1
    assert any("norm" in p and "max-update-norm=0.01" in p for p in strategy.problems), strategy.problems
    grid.on = False
    new2, metrics2 = one_round(strategy, 2, new, grid)
    assert "secure-attack" not in metrics2 and metrics2["secure-completed"] == 1
    assert 0 < np.linalg.norm(layout.flatten(new2) - layout.flatten(new)) <= 0.01 + 1e-4


def test_a_run_whose_secure_rounds_all_fail_ends_failed_with_the_reason():
    stage, edit, _ = ATTACKS["weight element 1"]
    grid, strategy, x, _ = hostile_run("fedavg-active:secure=secagg+", stage, edit)
    one_round(strategy, 1, x, grid)
    one_round(strategy, 2, x, grid)
    with pytest.raises(StrategyFailure, match="SecAgg\\+ attack.*weight element"):
        one_round(strategy, 3, x, grid)  # max_failed_rounds = 3 in a row


@pytest.mark.parametrize("attack, status", [("weight element 1", "failed-closed"),
                                            ("setup reply without its public keys", "completed")])
def test_the_churn_grid_records_an_attack_as_an_attack_not_churn(tmp_path, attack, status):
    """The ServerApp's availability grid (the drop-in's ChurnGrid) says why in ``rounds.jsonl``:
    status ``failed-closed`` and the attack's reason, not "halted (fewer than its threshold)"; a
    node dropped before training, in the problems of the round that completed without it."""
    import json
    import logging

    from server_app.dropin import with_availability

    stage, edit, says = ATTACKS[attack]
    run_config = {**default_run_config(), **TINY}
    hostile = HostileGrid(InProcessGrid(N, run_config), 0, stage, edit)
    hostile.node = sorted(hostile.get_node_ids())[-1]
    grid = with_availability(hostile, "always", num_clients=N, seed=0, results_dir=tmp_path, max_idle_rounds=0)
    strategy = build_strategy("fedavg-active:secure=secagg+", num_clients=N, min_available_nodes=0)
    x = ArrayRecord(get_workload(from_run_config(WorkloadConfig, run_config)).new_model().state_dict())
    for rnd in (1, 2):
        logging.getLogger("flwr").info("[ROUND %s/%s]", rnd, 2)
        x, _ = one_round(strategy, rnd, x, grid)
        hostile.on = False
    lines = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [line["secure"]["status"] for line in lines[:2]] == [status, "completed"]
    then = "fails closed" if status == "failed-closed" else f"node {hostile.node}: {says}"
    assert any(says in p and then in p for p in lines[0]["problems"]), lines[0]["problems"]
    assert lines[1]["problems"] == []


def _as_flower_runs(app):
    """``app`` called as Flower's runtime calls a ClientApp: an exception becomes an error reply
    with Flower's reason (``<class 'T'>:<'message'>``, code CLIENT_APP_RAISED_EXCEPTION)."""
    from flwr.app import Error, Message
    from flwr.common.constant import ErrorCode

    def run(msg, context):
        try:
            return app(msg, context)
        except Exception as ex:  # noqa: BLE001  # what flwr's runtime does (vce_api, run_clientapp)
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=msg)
    return run


def test_a_foreign_clientapp_without_the_secure_half_gets_a_failed_round_naming_secure_mod():
    """A Flower user's ClientApp (a train handler that reads ``arrays``, as Flower's templates do)
    without ``secure_mod`` under ``secure=secagg+``: SecAgg+'s setup message reaches its train
    handler, which raises. The round is a failed one naming the missing mod and the exception
    (type and first line), not "an empty round (churn)", and three such rounds end the run."""
    from flwr.clientapp import ClientApp

    foreign = ClientApp()

    @foreign.train()
    def train(msg, context):
        return msg.reply_to if msg.content["arrays"] is None else None  # KeyError at SecAgg+'s setup

    run_config = {**default_run_config(), **TINY}
    grid = InProcessGrid(N, run_config, client_app=_as_flower_runs(foreign))
    strategy = build_strategy("fedavg-active:secure=secagg+", num_clients=N, min_available_nodes=0)
    x = ArrayRecord(get_workload(from_run_config(WorkloadConfig, run_config)).new_model().state_dict())
    new, metrics = one_round(strategy, 1, x, grid)
    assert metrics["secure-completed"] == 0 and "secure-attack" not in metrics
    (problem,) = strategy.problems
    assert "client_app.secure.secure_mod" in problem and "KeyError: 'arrays'" in problem, problem
    one_round(strategy, 2, x, grid)
    with pytest.raises(StrategyFailure, match="secure_mod"):
        one_round(strategy, 3, x, grid)


class PlainSetupGrid(HostileGrid):
    """One node answers SecAgg+'s setup with a reply that has no SecAgg+ record."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self.grid.send_and_receive(list(messages), timeout=timeout))
        for r in replies:
            record = r.content.config_records.get(RECORD_KEY_CONFIGS) if not r.has_error() else None
            if r.metadata.src_node_id == self.node and record is not None and Key.PUBLIC_KEY_1 in record:
                del r.content.config_records[RECORD_KEY_CONFIGS]
        return replies


def test_a_plain_reply_to_the_setup_drops_its_node_naming_secure_mod(caplog):
    """A ClientApp without ``secure_mod`` whose train handler answers anything gives a setup reply
    without SecAgg+'s record: its node is dropped (the node and the missing mod named), the round
    completes with the others."""
    grid, strategy, x, layout = hostile_run("fedavg-active:secure=secagg+", Stage.SETUP, None)
    grid = PlainSetupGrid(grid.grid, grid.node, Stage.SETUP, None)
    with caplog.at_level("WARNING", logger="flwr"):
        new, metrics = one_round(strategy, 1, x, grid)
    assert metrics["secure-completed"] == 1 and metrics["secure-dropped"] == 1
    assert any("secure_mod" in r.getMessage() and f"node {grid.node}" in r.getMessage() for r in caplog.records)
