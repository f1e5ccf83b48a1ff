"""SecAgg+ under churn needs two minimums at once (issue 50): the legacy strategy's
``min_fit_clients`` and SecAgg+'s reconstruction threshold. The check against the schedule warns,
naming both and the schedule; a round the strategy could not sample records the real reason
(3 online < min_fit_clients = 4), not "fewer than 2 nodes to sample"."""

import json
import logging

import numpy as np
from flwr.app import RecordDict
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

from availability import build_schedule
from server_app.dropin import with_availability
from server_app.securecheck import check_secure, round_halts, secure_advice, secure_threshold
from tests.test_churn_workflows import SHAPE, inner_grid

N = 5


def test_a_round_completes_only_with_both_minimums_online_as_flowers_sampling_and_secagg_count_them():
    # Flower's legacy FedAvg samples max(int(online x fraction_fit), min_fit_clients), none with fewer online
    assert "3 online, fewer than the 4 the strategy samples" in round_halts(3, min_fit_clients=4)
    assert round_halts(4, min_fit_clients=4, reconstruction_threshold=4, num_shares=7) is None
    # a minimum below the threshold starts the round, which then halts at the key exchange
    assert "fewer than SecAgg+'s reconstruction threshold 4" in round_halts(3, min_fit_clients=2,
                                                                            reconstruction_threshold=4, num_shares=7)
    assert "SecAgg+ needs 2" in round_halts(1, min_fit_clients=0)
    # fractions, as SecAggPlusWorkflow.setup_stage computes them: shares = round(f x sampled), at least 3
    assert secure_threshold(10, 0.6, 1.0) == 6 and secure_threshold(2, 0.6, 1.0) == 2
    assert secure_threshold(5, 0.5, 0.5) == 2  # 3 shares (odd), threshold max(2, round(1.5))
    assert round_halts(2, min_fit_clients=2, reconstruction_threshold=2, num_shares=3) is None  # the example's


def test_the_check_warns_naming_both_numbers_and_the_schedule_when_they_exceed_what_it_gives(caplog):
    schedule = build_schedule("bernoulli:p=0.5", 10, 0)  # 5 online per round on average
    text = secure_advice(schedule, min_fit_clients=2, reconstruction_threshold=4, num_shares=7, num_rounds=50)
    assert text is not None  # the docs' old advice ("lower min_fit_clients to 2") under a threshold of 4
    assert "min_fit_clients = 2 and SecAgg+'s reconstruction threshold = 4" in text
    assert "'bernoulli:p=0.5', N=10" in text and "below the threshold 4 starts rounds that then halt" in text
    assert secure_advice(schedule, min_fit_clients=4, reconstruction_threshold=4, num_shares=7) is None  # fits
    high = secure_advice(schedule, min_fit_clients=8, reconstruction_threshold=4, num_shares=7, num_rounds=50)
    assert high is not None and "completes only with 8 or more clients online" in high
    halting = sum(round_halts(int(n), min_fit_clients=8) is not None for n in schedule.matrix(50).sum(axis=1))
    assert f"{halting} of the first 50 rounds will halt" in high and halting > 40
    never = secure_advice(schedule, min_fit_clients=11)
    assert never is not None and "no round can complete" in never
    # the one line for a ServerApp: Flower's objects as they are, a DP wrapper's inner strategy read
    inner = LegacyFedAvg(min_fit_clients=2, min_available_clients=0)
    wrapped = DifferentialPrivacyClientSideFixedClipping(inner, noise_multiplier=0.1, clipping_norm=1.0,
                                                         num_sampled_clients=5)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        said = check_secure(schedule, wrapped, SecAggPlusWorkflow(num_shares=7, reconstruction_threshold=4))
    assert said is not None and said in caplog.text and "min_fit_clients = 2" in said


class MinFit(LegacyFedAvg):
    def __init__(self, min_fit: int) -> None:
        super().__init__(fraction_fit=1.0, min_fit_clients=min_fit, min_available_clients=0, fraction_evaluate=0.0,
                         initial_parameters=ndarrays_to_parameters([np.zeros(SHAPE)]))


def test_a_round_the_strategy_could_not_sample_records_the_real_reason_and_the_check_warns_once(tmp_path, caplog):
    """bernoulli:p=0.6, seed 4: 3, then 4 clients online. min_fit_clients = 4 = the threshold: round 1
    is not started (Flower: 'Sampling failed'), its record says 3 online < 4 asked for; round 2
    completes with the 4 online. The schedule has 3 online on average: one warning, naming the numbers."""
    schedule = build_schedule("bernoulli:p=0.6", N, 4)
    assert schedule.matrix(2).sum(axis=1).tolist() == [3, 4]
    grid = with_availability(inner_grid(True), "bernoulli:p=0.6", num_clients=N, seed=4, results_dir=tmp_path)
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=2), strategy=MinFit(4))
    with caplog.at_level(logging.INFO, logger="flwr"):
        DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=5, reconstruction_threshold=4,
                                                        max_weight=float(N)))(grid, context)
    rows = {r["round"]: r for r in map(json.loads, (tmp_path / "rounds.jsonl").read_text().splitlines())}
    assert rows[1]["secure"]["status"] == "halted" and rows[1]["participants"] == []
    (reason,) = rows[1]["problems"]
    assert "3 online being fewer than the 4 it asks for" in reason and "fewer than 2" not in reason
    assert rows[2]["secure"]["status"] == "completed" and len(rows[2]["participants"]) == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "SecAgg+ under churn" in
                r.getMessage()]
    assert len(warnings) == 1 and "min_fit_clients = 4" in warnings[0] and "'bernoulli:p=0.6', N=5" in warnings[0]
