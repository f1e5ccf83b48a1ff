"""What "schedule round t" means in an asynchronous run, simulated and deployed (docs/virtual-time.md,
"Round t"): on the virtual clock, the slot [t x slot_seconds, (t + 1) x slot_seconds) in which a
job is dispatched; in a deployment (deploy/async_churn.py), the schedule round slot(r) whose nodes
are up while aggregation r is made, empty rounds passed over. Where they can agree (every job one
slot long, FedBuff's K = the clients on in each non-empty round) they do: aggregation r of the
simulation applies exactly the jobs dispatched in schedule round slot(r), at the end of that slot."""

from __future__ import annotations

import json

from availability import build_schedule
from deploy.async_churn import AggregationChurn
from experiments.inprocess import run_inprocess

# 6 clients, two on in each schedule round but round 2 (empty); the file wraps after round 5
MATRIX = """1,1,0,0,0,0
0,0,1,1,0,0
0,0,0,0,0,0
0,0,0,0,1,1
1,0,1,0,0,0
0,1,0,1,0,0
"""
STEPS = 3  # every job 3 local steps: 3 virtual seconds, one slot (the longest round-0 job)


class NoNodes:
    num_nodes = 6

    def log(self, _line: str) -> None:
        pass


def test_async_simulated_and_deployed_agree_on_what_schedule_round_t_is(tmp_path, monkeypatch):
    monkeypatch.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)
    trace = tmp_path / "trace.csv"
    trace.write_text(MATRIX)
    spec = f"trace-matrix:path={trace}"
    aggregations = 7
    run_dir = run_inprocess({
        "dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": 6,
        "local-steps": f"steps:n={STEPS}", "batch-size": 1, "lr": 0.1, "availability": spec,
        "strategy": "fedbuff:k=2,max-norm-ratio=0", "num-server-rounds": aggregations, "eval-every": 0, "checkpoint-every": 0,  # no start-up hold
        "progress": False, "device": "cpu", "results-dir": str(tmp_path), "run-name": "sim"})
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    driver = AggregationChurn(NoNodes(), build_schedule(spec, 6, 0), aggregations)  # type: ignore[arg-type]
    assert driver.skipped == [2]
    assert [row["round"] for row in rows] == list(range(1, aggregations + 1))
    for row in rows:
        r = row["round"]
        assert row["participants"] == sorted(driver.on(r)), r
        assert row["virtual-time"] == (driver.slot(r) + 1) * STEPS, r  # dispatched at the slot's start
        assert all(staleness == 0 for _, staleness in row["arrivals"]), r
