"""pfl-research's CIFAR-10 setup in miniature learns at the defaults, and no honest update is
rejected (issue 49, item 6).

pfl's setup: its ``simple_cnn`` (``tests/pfl_models.py``, by ``module:attr``), many users of whom a
small share trains each round, 5 local steps of batch 10, lr 0.1, FedAvg. Here on digits (8x8, so
seconds) with 100 users and about 10 a round, 4 rounds, over three training seeds, at every default
bound (``max-norm-ratio``, ``max-update-norm``, ...): every reply of every round is accepted, and
the test loss falls below its first round's and below chance (ln 10).
"""

from __future__ import annotations

import json
import math

import pytest

from experiments.inprocess import run_inprocess

SETUP = {"dataset": "digits", "model": "pfl_models:simple_cnn", "num-clients": 100, "partition": "iid",
         "availability": "bernoulli:p=0.1", "local-steps": "steps:n=5", "batch-size": 10, "lr": 0.1,
         "strategy": "fedavg-active", "num-server-rounds": 4, "eval-every": 1, "checkpoint-every": 0,
         "progress": False}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pfls_setup_learns_and_rejects_no_honest_update(tmp_path, seed):
    run = run_inprocess({**SETUP, "train-seed": seed, "results-dir": str(tmp_path), "run-name": f"pfl-{seed}"})
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == SETUP["num-server-rounds"]
    for r in rows:
        assert r["num-rejected"] == 0, f"round {r['round']}: honest updates rejected: {r.get('rejected')}"
        assert len(r["participants"]) > 0
    losses = [r["test-loss"] for r in rows]
    assert losses[-1] < losses[0] and losses[-1] < math.log(10), losses
