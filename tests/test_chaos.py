"""Chaos on real processes: one deployed run (4 SuperNodes, 5 rounds, everyone scheduled on) where

- round 2: node 2 replies NaN, node 3 replies a huge update (1e20): both rejected, named;
- round 3: node 0 is SIGKILLed and node 1 SIGTERMed as the round starts: the round closes when
  the SuperLink gives the killed node up (heartbeat expiry, ~1 min) or at round-timeout;
- after round 3 is recorded (and checkpointed), the SuperLink and its ServerApp are killed in
  round 4; the run is then resumed from its newest checkpoint on a fresh SuperLink and freshly
  started nodes, and completes.

Checked: no hang (bounded timeouts), every round in ``metrics.jsonl`` exactly once, the resumed
run starts at checkpoint + 1 from the checkpointed model (an in-process run that drops the same
replies reproduces the deployment's checkpoint and final model), the participation reports name
every injected fault, and no process or zombie is left. Faults come from the TEST-ONLY hook in
``tests/fault_hook`` (see its docstring). ~2-3 min on an idle 2-core box, most of it the
killed node's heartbeat expiry; round-timeout is 180 s so that a loaded box does not time out
honest rounds.
"""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest

from tests.test_deploy import fault_node

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

N, R = 4, 4  # the resumed part runs round 4 alone
NAN, HUGE = (2, 2), (2, 3)  # (round, client)
KILL, TERM = (3, 0), (3, 1)  # (round, client), taken down as the round starts
LINK_DOWN_AFTER = 3  # the SuperLink dies ~2 s after this round's line (in the next round)


def run_config(results) -> dict:
    return {
        "num-server-rounds": R, "strategy": "fedavg-all", "availability": "always",
        "dataset": "digits", "model": "logreg", "local-steps": "steps:n=2", "partition": "iid",
        "round-timeout": 180.0, "wait-for-nodes": 120.0, "checkpoint-every": 1, "device": "cpu",
        "results-dir": str(results), "progress": False,
    }


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    if shutil.which("flower-superlink") is None or shutil.which("flwr") is None:
        pytest.skip("flower-superlink / flwr not on PATH")
    from deploy.local import ProcessSite
    from deploy.run import run_deployment
    from deploy.submission import latest_checkpoint

    tmp = tmp_path_factory.mktemp("chaos")
    (nan_env, nan_cfg), (huge_env, huge_cfg) = fault_node("nan", NAN[0]), fault_node("huge", HUGE[0])
    lines: list[str] = []
    dep = ProcessSite(N, tmp / "work", node_env={NAN[1]: nan_env, HUGE[1]: huge_env},
                     node_config_extra={NAN[1]: nan_cfg, HUGE[1]: huge_cfg}, log=lines.append)
    cfg = run_config(tmp / "results")
    t0 = time.monotonic()
    try:
        with dep:
            def link_down(row: dict) -> None:
                if row["round"] == LINK_DOWN_AFTER:
                    time.sleep(2.0)  # round 4 is under way
                    dep.kill_superlink()

            first = run_deployment(dep, cfg, churn="rounds", on_row=link_down, timeout=600,
                                   crashes={KILL[0]: [(KILL[1], 0.0, "kill"), (TERM[1], 0.0, "term")]})
            ckpt = latest_checkpoint(first.run_dir)
            resumed = run_deployment(dep, cfg, churn="rounds", resume_from=ckpt, timeout=600)
    finally:
        dep.close()
    return {"first": first, "resumed": resumed, "ckpt": ckpt, "dep": dep, "log": lines, "tmp": tmp,
            "wall": time.monotonic() - t0}


def test_the_run_survives_and_resumes_from_its_last_checkpoint(chaos):
    from server_app.results import read_metrics

    first, resumed, ckpt = chaos["first"], chaos["resumed"], chaos["ckpt"]
    print(f"chaos run: {chaos['wall']:.0f} s wall (both parts)")
    assert first.status == "superlink-died", (first.status, chaos["log"])
    assert resumed.ok, (resumed.status, resumed.report and resumed.report.summary(), chaos["log"])
    assert resumed.run_dir == first.run_dir
    ckpt_round = int(ckpt.stem.split("-")[1])
    assert ckpt_round >= LINK_DOWN_AFTER
    assert resumed.rows[0]["round"] == ckpt_round + 1
    assert [r["round"] for r in read_metrics(first.run_dir)] == list(range(1, R + 1))
    assert (first.run_dir / "final_model.pt").is_file()


def test_the_participation_reports_name_every_injected_fault(chaos):
    first, resumed = chaos["first"], chaos["resumed"]
    assert first.report.failures == [] and resumed.report.failures == [], (
        first.report.summary(), resumed.report.summary())
    why = {(r.round, c): w for r in first.report.rounds for c, w in r.why.items()}
    assert why[NAN].startswith("reply rejected") and "NaN" in why[NAN], first.report.summary()
    assert why[HUGE].startswith("reply rejected") and "update norm" in why[HUGE], first.report.summary()
    assert "SIGKILL" in why[KILL] and "SIGTERM" in why[TERM], first.report.summary()
    row = first.rows[NAN[0] - 1]
    assert len(row["rejected"]) == 2 and sorted(row["participants"]) == [0, 1], row


def test_the_resumed_run_continues_exactly_from_the_checkpoint(chaos, tmp_path):
    """An in-process run of the same config that drops the replies the deployment did not use
    gives the deployment's checkpoint (the model the checkpoint holds is the run's model at that
    round) and its final model (the resumed rounds started from the checkpoint)."""
    import torch

    from experiments.inprocess import run_inprocess
    from server_app.results import read_metrics

    first, ckpt = chaos["first"], chaos["ckpt"]
    took_part = {(r["round"], c) for r in read_metrics(first.run_dir) for c in r["participants"]}
    cfg = {**first.run_config, "results-dir": str(tmp_path), "run-name": "ref", "round-start-delay": 0.0}
    ref = run_inprocess(cfg, down=lambda rnd, client: (rnd, client) not in took_part)
    ours = torch.load(ckpt, weights_only=False)["arrays"]
    theirs = torch.load(ref / "checkpoints" / ckpt.name, weights_only=False)["arrays"]
    for k in ours:
        np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-5, atol=1e-6, err_msg=k)
    a, b = torch.load(ref / "final_model.pt"), torch.load(first.run_dir / "final_model.pt")
    for k in a:
        np.testing.assert_allclose(a[k].numpy(), b[k].numpy(), rtol=1e-5, atol=1e-6, err_msg=k)


def test_nothing_is_left_behind(chaos):
    from deploy.procs import zombie_children

    dep = chaos["dep"]
    assert dep.leftovers() == []
    assert zombie_children() == []
    assert not any(n.running for n in dep.nodes.values()) and not dep.superlink.alive
