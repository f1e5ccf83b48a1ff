"""A ClientApp that raises is not churn (issue 47 item 6): its error reply still counts as
unavailable (the rule's math is unchanged), but the round's record and the log name it with the
real exception (``Type: first line``, not Ray's or Flower's wrapper). Error replies that mean a
message or node was unavailable stay quiet, as churn does."""

from __future__ import annotations

import json
import logging

import numpy as np
from flwr.app import Error, Message, MessageType
from flwr.common.constant import ErrorCode
from replies import reply, start_round
from rich.console import Console
from test_no_work import QUADRATIC, RAY_REASON

from experiments.grid import InProcessGrid
from runconfig.defaults import default_run_config
from server_app.config import RunConfig
from server_app.experiment import run
from strategies import build_strategy


def failed(sent: Message, code: int, reason: str) -> Message:
    return Message(Error(code=code, reason=reason), reply_to=sent)


def test_a_raising_clientapp_is_recorded_and_warned_and_churn_is_not(caplog):
    strategy = build_strategy("fedavg-active", num_clients=4)
    x = np.zeros(3, np.float32)
    sent = start_round(strategy, 1, x, [101, 102, 103, 104])
    replies = [reply(sent[101], x + 1, **{"client-id": 1}),
               failed(sent[102], ErrorCode.CLIENT_APP_RAISED_EXCEPTION, RAY_REASON),  # simulation: Ray's chain
               failed(sent[103], ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "<class 'ValueError'>:<'bad shard\nmore'>"),
               failed(sent[104], ErrorCode.NODE_UNAVAILABLE, "node went offline")]  # churn
    with caplog.at_level(logging.WARNING, logger="flwr"):
        arrays, _ = strategy.aggregate_train(1, replies)
    log = strategy.round_log
    assert sorted(log.unavailable) == [102, 103, 104]  # the math is as before: all three are unavailable
    assert log.errors == [(102, "KeyError: 'config'"), (103, "ValueError: bad shard")]
    assert log.errors_record() == {"client-errors": [[102, "KeyError: 'config'"], [103, "ValueError: bad shard"]]}
    assert np.allclose(arrays["w"].numpy(), x + 1)  # the one good reply, alone
    assert "1 ClientApp failed (counted as unavailable): KeyError: 'config' (node 102)" in caplog.text
    assert "ValueError: bad shard (node 103)" in caplog.text and "offline" not in caplog.text


def test_a_round_of_only_churn_records_no_client_errors():
    strategy = build_strategy("fedavg-active", num_clients=2)
    sent = start_round(strategy, 1, np.zeros(3, np.float32), [101, 102])
    codes = (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)
    strategy.aggregate_train(1, [failed(sent[n], code, "gone") for n, code in zip((101, 102), codes, strict=True)])
    assert strategy.round_log.errors == [] and strategy.round_log.errors_record() == {}


class OneClientRaises(InProcessGrid):
    """Client 2's training raises in every round; Flower's runtime sends the error reply."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        app = self.app

        def guarded(msg, context):
            if msg.metadata.message_type == MessageType.TRAIN and context.node_config["partition-id"] == 2:
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                     reason="<class 'RuntimeError'>:<'no data on this device'>"), reply_to=msg)
            return app(msg, context)

        self.app = guarded


def test_the_projects_loop_records_the_failed_client_in_every_round(tmp_path):
    config = {**default_run_config(), **QUADRATIC, "availability": "always", "num-server-rounds": 3,
              "results-dir": str(tmp_path), "run-name": "errors"}
    grid = OneClientRaises(4, config)
    run_dir = run(grid, RunConfig.from_run_config(config), console=Console(quiet=True))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["participants"] for r in rows] == [[0, 1, 3]] * 3  # the run goes on with the others
    for r in rows:
        ((node, why),) = r["client-errors"]
        assert why == "RuntimeError: no data on this device" and r["unavailable-nodes"] == 1
