"""Client state is committed only on acceptance (issue 39 item 5): a SCAFFOLD client keeps its new
c_i^+ pending until the server's next message says the reply was applied, so the server's c stays
the mean of the clients' c_i when replies are rejected, in process and under ``flwr run``.

The runs reject honest replies on purpose: ``max-norm-ratio=1.01`` rejects every reply above the
lower median of the recent norms (about half of them); the checkpoint of the last round holds
c and each client's last applied round, the state dir each client's c_i (and the pending one).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from conftest import extra_deploy

from experiments.inprocess import run_inprocess
from server_app.results import read_metrics
from strategies.rules.scaffold import Scaffold

ROUNDS, CLIENTS = 6, 6


def scaffold_run(tmp_path, state) -> dict:
    return {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": CLIENTS,
            "num-server-rounds": ROUNDS, "local-steps": "steps:n=2", "batch-size": 1, "lr": 0.1,
            "availability": "bernoulli:p=0.7", "progress": False, "checkpoint-every": ROUNDS,
            "results-dir": str(tmp_path), "run-name": "run", "strategy": "scaffold", "max-norm-ratio": 1.01,
            "state-dir": str(state)}


def applied_mean(run_dir, state) -> tuple[np.ndarray, np.ndarray]:
    """(the server's c, the mean of the clients' c_i as the server applied them)."""
    strategy = Scaffold.read_state(torch.load(run_dir / "checkpoints" / f"round-{ROUNDS:04d}.pt",
                                              weights_only=False)["strategy"])
    variates = []
    for client in range(CLIENTS):
        path = state / f"client-{client}" / f"scaffold-{strategy.run_key}.pt"
        if not path.exists():  # never trained: c_i = 0
            variates.append(np.zeros_like(strategy.c))
            continue
        saved = torch.load(path, weights_only=True)
        applied = saved["pending"] if saved["pending"] is not None and \
            strategy.accepted.get(client) == saved["pending_tau"] else saved["copy"]
        variates.append(np.concatenate([v.numpy().ravel() for k, v in sorted(applied.items()) if k.startswith("c.")]))
    return strategy.c, np.mean(variates, axis=0)


def check(run_dir, state) -> None:
    rows = read_metrics(run_dir)
    assert sum(r["num-rejected"] for r in rows) >= 2 and sum(r["num-participants"] for r in rows) >= 6
    c, mean = applied_mean(run_dir, state)
    assert np.abs(c).max() > 0
    np.testing.assert_allclose(c, mean, rtol=1e-5, atol=1e-6)


def test_rejected_replies_leave_c_the_mean_of_the_clients_c_i_in_process(tmp_path):
    state = tmp_path / "state"
    check(run_inprocess(scaffold_run(tmp_path, state)), state)


needs_flwr = pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH")


@pytest.mark.slow
@needs_flwr
@extra_deploy("the same check under flwr run (~65 s)", "the in-process case here (the same ServerApp and ClientApp)")
def test_rejected_replies_leave_c_the_mean_of_the_clients_c_i_under_flwr_run(tmp_path):
    import flower_link
    from conftest import ROOT
    from flower_link import local_superlink

    state, results = tmp_path / "state", tmp_path / "results"
    config = scaffold_run(results, state)
    text = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in config.items())
    with local_superlink(tmp_path / "flwr-home") as env:
        log, status = flower_link.flwr_run(ROOT, env, tmp_path, text, num_supernodes=CLIENTS)
    assert status == "finished:completed", log[-3000:]
    check(results / "run", state)
