"""A newcomer's reading time per flow of docs/architecture.md, estimated (prints; never asserts).

For each flow, the lines of every function or class on its stops (read once), at 40 lines a minute,
plus half a minute per change of file. It counts what must be read, not what must be understood.

    python benchmarks/flow_reading.py            # this checkout
    python benchmarks/flow_reading.py OTHER_TREE # another checkout (stops that do not exist are listed)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent
FLOWS = {
 "simulated synchronous round": [
  ("server_app/app.py", "main"), ("server_app/experiment.py", "run"), ("server_app/setup.py", "prepare"),
  ("server_app/experiment.py", "connect"), ("server_app/experiment.py", "_run_rounds"),
  ("strategies/base.py", "AvailabilityStrategy.configure_train"), ("server_app/network.py", "AvailabilityGrid.send_and_receive"),
  ("experiments/grid.py", "InProcessGrid.send_and_receive"), ("client_app/app.py", "train"),
  ("client_app/app.py", "train_start"), ("client_app/app.py", "local_training"), ("client_app/app.py", "train_reply"),
  ("strategies/base.py", "AvailabilityStrategy.aggregate_train"), ("strategies/intake.py", "ReplyIntake.collect"),
  ("strategies/intake.py", "ReplyIntake.stream"), ("strategies/intake.py", "ReplyIntake._read"),
  ("strategies/intake.py", "ReplyIntake.judge"), ("strategies/intake.py", "ReplyIntake.finish"),
  ("strategies/rule_strategy.py", "RuleStrategy.start_fold"), ("strategies/rules/fedavg.py", "FedAvgActiveRule"),
  ("strategies/rules/fedavg.py", "MeanFold"), ("server_app/setup.py", "evaluate_models"),
 ],
 "deployed round with churn": [
  ("deploy/cli.py", "main"), ("deploy/launch.py", "launch_main"), ("deploy/record.py", "run_recorded"),
  ("deploy/run.py", "run_deployment"), ("deploy/run.py", "run_with"),
  ("deploy/run.py", "start_nodes"), ("deploy/run.py", "follow_run"), ("deploy/run.py", "compare_participation"),
  ("deploy/local.py", "ProcessSite.start_superlink"), ("deploy/local.py", "ProcessSite.start_node"),
  ("deploy/local.py", "ProcessSite.registered_id"), ("deploy/local.py", "ProcessSite.signal_node"),
  ("deploy/local.py", "ProcessSite.stop_node"),
  ("deploy/follow.py", "RunFollower.poll"), ("deploy/follow.py", "RunFollower.events"),
  ("deploy/churn.py", "RoundChurn.on"), ("deploy/churn.py", "RoundChurn.prepare"),
  ("deploy/churn.py", "RoundChurn.on_event"), ("deploy/churn.py", "RoundChurn._begin"),
  ("deploy/churn.py", "RoundChurn._fire"), ("deploy/churn.py", "RoundChurn.explained"),
  ("server_app/network.py", "fast_pull"), ("server_app/network.py", "PollingGrid.send_and_receive"),
  ("client_app/worker.py", "NodeWorker.call"), ("client_app/worker_process.py", "handle"),
  ("client_app/app.py", "train"), ("strategies/base.py", "AvailabilityStrategy.aggregate_train"),
  ("deploy/participation.py", "participation_report"),
 ],
 "asynchronous FedBuff aggregation": [
  ("server_app/experiment.py", "run"), ("server_app/asynchronous.py", "run_async"),
  ("server_app/asynchronous.py", "VirtualLoop"), ("strategies/asynchronous.py", "AsyncRule.job"),
  ("strategies/asynchronous.py", "AsyncRule.arrive"), ("strategies/asynchronous.py", "AsyncRule._check_one"),
  ("strategies/intake.py", "ReplyIntake.collect"), ("strategies/rules/fedbuff.py", "FedBuff"),
  ("server_app/asynchronous.py", "AsyncRecorder.row"),
 ],
}
def span(path: str, name: str | None) -> int | None:
    src = (ROOT / path).read_text()
    if name is None:
        return len(src.splitlines())
    tree = ast.parse(src)
    parts = name.split(".")
    nodes = tree.body
    node = None
    for p in parts:
        node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and n.name == p), None)
        if node is None:
            return None
        nodes = node.body
    return node.end_lineno - node.lineno + 1
for flow, hops in FLOWS.items():
    total, files, missing = 0, [], []
    for path, name in hops:
        n = span(path, name)
        if n is None:
            missing.append(f"{path}:{name}")
            continue
        total += n
        if not files or files[-1] != path:
            files.append(path)
    minutes = total / 40 + 0.5 * len(files)
    print(f"{flow}: {len(hops)} stops, {len(files)} file hops, {total} lines -> {minutes:.0f} min"
          + (f" (not found: {missing})" if missing else ""))
