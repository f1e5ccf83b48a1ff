"""The shared parameters as one frozen value; the rules in strategies/rules/, exported by name;
rule state saved through its declared fields."""

import dataclasses
from collections import deque

import numpy as np
import pytest

import strategies
from strategies import STRATEGIES, FedAU, StrategyParams, build_strategy
from strategies.params import SPEC_FIELDS
from strategies.registry import SHARED, strategy_params
from strategies.replies import ClientReport
from strategies.rules.fedawe import EchoReport


def test_params_and_keyword_arguments_build_the_same_strategy():
    by_keywords = FedAU(num_clients=5, fraction_evaluate=0.5, min_evaluate_nodes=1, seed=3, cutoff=7)
    by_params = FedAU(params=StrategyParams(num_clients=5, fraction_evaluate=0.5, min_evaluate_nodes=1, seed=3),
                      cutoff=7)
    assert by_keywords.params == by_params.params
    assert by_keywords.sampling == by_params.sampling and by_keywords.rule.params.cutoff == by_params.rule.params.cutoff == 7
    assert by_keywords.rng.random() == by_params.rng.random()
    # keywords update a given value; the value itself never changes (frozen)
    base = StrategyParams(num_clients=5)
    assert FedAU(params=base, server_lr=0.5).params == dataclasses.replace(base, server_lr=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.server_lr = 2.0  # type: ignore[misc]


def test_bad_shared_parameters_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"unknown strategy argument\(s\) \['fraction_fit'\]"):
        FedAU(num_clients=5, fraction_fit=0.5)
    with pytest.raises(ValueError, match="fraction_evaluate must be a number in"):
        StrategyParams(fraction_evaluate=2.0)
    with pytest.raises(ValueError, match="num_clients must be an integer >= 1"):
        build_strategy("fedavg-active", num_clients=0)


def test_a_spec_sets_the_rules_own_parameters_and_the_spec_fields_only():
    assert SHARED | SPEC_FIELDS == StrategyParams.names() and not SHARED & SPEC_FIELDS
    assert list(strategy_params(STRATEGIES["fedau"])) == ["max-update-norm", "max-norm-ratio", "max-weight-share",
                                                          "max-model-ratio", "max-examples-ratio", "max-reference-growth", "stream",
                                                          "robust", "cutoff"]
    s = build_strategy("fedau:cutoff=3,max-norm-ratio=50", num_clients=4)
    assert (s.rule.params.cutoff, s.params.max_norm_ratio, s.bounds.max_norm_ratio) == (3, 50.0, 50.0)


def test_every_rule_lives_in_strategies_rules_and_is_exported_by_name():
    for cls in STRATEGIES.values():
        assert cls.__module__.startswith("strategies.rules."), cls
        assert getattr(strategies, cls.__name__) is cls


def test_state_fields_with_their_own_saving_round_trip():
    mifa = build_strategy("mifa:gradient-units=true", num_clients=3)
    mifa.rule_state = mifa.kept_state()
    mifa.rule_state.lr_history.extend([0.1, 0.2])
    saved = mifa.state_dict()
    assert saved["state"]["lr_history"] == [0.1, 0.2] and saved["state"]["table"] is None
    again = build_strategy("mifa:gradient-units=true", num_clients=3)
    again.load_state_dict(saved)
    assert isinstance(again.rule_state.lr_history, deque) and list(again.rule_state.lr_history) == [0.1, 0.2]
    assert again.rule_state.lr_history.maxlen == mifa.rule_state.lr_history.maxlen


def test_a_plain_report_reads_as_an_echo_of_factor_one():
    plain = ClientReport(client_id=1, node_id=101, delta=np.array([3.0, 4.0], np.float32), num_examples=2)
    echo = EchoReport.of(plain)
    assert (echo.echo_factor, echo.echo_norm, echo.client_id) == (1, 5.0, 1)
    assert echo.echo_update is plain.delta and EchoReport.of(echo) is echo
