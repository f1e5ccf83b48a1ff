"""A newcomer's reading time per flow of docs/architecture.md, estimated (prints; never asserts).

Each flow is its stops, in the order the code runs (the rows of docs/architecture.md's tables);
each stop lists every function or class a reader must read to know what happens there: the stop's
own function and every callee that decides the outcome (the fold that does the math, the intake's
checks and bounds, the start-up hold, the share window and the trigger that decide when an
asynchronous rule's ``apply`` runs). A callee whose outcome is a no-op on the flow's path (a rule
hook whose default returns its input) is still listed: a reader must open it to know that.
Not listed: Flower's own code, logging, the progress bar, the results writer, checkpoints.

The lines of every listed name (its decorators, signature, docstring and body; a name read once
per flow, a method inside a listed class not again) and the changes of file as the list is read
in order give two figures:

- the script's own: 40 lines a minute + 0.5 min a file change (the figure this page used before);
- a human's: 25 lines a minute of these 52-60-character lines + 0.75 min a file change (issue 48).

It counts what must be read, not what must be understood. The deployed flow assumes flow 1 read:
its ServerApp runs flow 1's steps 2-14, listed there, so it lists only the hand-overs to them.

Below the flows: the lines a new rule needs, on the FedAvgM example of docs/extending.md
(``examples/flchurn-myext/myext/momentum.py``: code lines, docstrings, comments and blank lines
left out), and whether it needs the adapter (imports of the project beyond
``strategies.contract`` and the adapter-free helpers).

    python benchmarks/flow_reading.py            # this checkout
    python benchmarks/flow_reading.py OTHER_TREE # another checkout (names that do not exist are listed)
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

OWN = (40.0, 0.5)  # lines a minute, minutes a file change: the script's own figure
HUMAN = (25.0, 0.75)  # issue 48 item 7: a human reading these lines

Stop = tuple[str, list[tuple[str, str]]]  # (what happens, [(file, qualified name), ...])

SIMULATED: list[Stop] = [
    ("1 run_inprocess", [("experiments/inprocess.py", "run_inprocess")]),
    ("2 run", [("server_app/experiment.py", "run")]),
    ("3 prepare", [("server_app/setup.py", "prepare"), ("strategies/registry.py", "build_strategy"),
                   ("strategies/registry.py", "_rule_and_params"), ("strategies/registry.py", "_rule_class")]),
    ("4 connect", [("server_app/experiment.py", "connect"), ("server_app/identity.py", "discover_clients"),
                   ("client_app/app.py", "query")]),
    ("5 _run_rounds", [("server_app/experiment.py", "_run_rounds"), ("server_app/experiment.py", "wait_round_start"),
                       ("server_app/experiment.py", "train_timeout"),
                       ("server_app/network.py", "AvailabilityGrid.begin_round")]),
    ("6 configure_train", [
        ("strategies/base.py", "AvailabilityStrategy.configure_train"),
        ("strategies/evaluate_round.py", "Evaluation.deliver_broadcast"),
        ("strategies/base.py", "AvailabilityStrategy.connected_nodes"),
        ("strategies/sampling.py", "Sampling.sample"), ("strategies/sampling.py", "Sampling.size"),
        ("strategies/sampling.py", "draw"), ("strategies/sampling.py", "check_destinations"),
        ("strategies/rule_strategy.py", "RuleStrategy.probe_request"),
        ("strategies/rule_strategy.py", "RuleStrategy.select_nodes"),
        ("strategies/rule_strategy.py", "RuleStrategy.train_config"),
        ("strategies/rule_strategy.py", "RuleStrategy.context"),
        ("strategies/rule_strategy.py", "RuleStrategy._state"),
        ("strategies/rule_strategy.py", "RuleStrategy.kept_state"),
        ("strategies/contract.py", "Rule.init"), ("strategies/contract.py", "Rule.probe"),
        ("strategies/contract.py", "Rule.select"), ("strategies/contract.py", "Rule.train_config"),
        ("strategies/base.py", "AvailabilityStrategy.train_record"),
        ("strategies/rule.py", "Rule.train_arrays"), ("strategies/rule.py", "Rule.node_config"),
        ("strategies/intake.py", "ReplyIntake.new_round"),
    ]),
    ("7 AvailabilityGrid", [("server_app/network.py", "AvailabilityGrid.get_node_ids"),
                            ("server_app/network.py", "AvailabilityGrid.online_nodes"),
                            ("server_app/network.py", "AvailabilityGrid.send_and_receive"),
                            ("server_app/network.py", "AvailabilityGrid.reachable")]),
    ("8 InProcessGrid", [("experiments/grid.py", "InProcessGrid.send_and_receive"),
                         ("experiments/grid.py", "InProcessGrid._pulled"), ("experiments/grid.py", "InProcessGrid.deliver")]),
    ("9 client train", [
        ("client_app/app.py", "train"), ("client_app/app.py", "train_start"), ("client_app/app.py", "declines"),
        ("client_app/app.py", "rule_of"), ("client_app/client_rule.py", "PlainRule"),
        ("client_app/app.py", "local_training"), ("workloads/workload.py", "Workload.train_client"),
        ("workloads/solvers.py", "local_train"), ("client_app/app.py", "train_reply"),
    ]),
    ("10 aggregate_train", [
        ("strategies/base.py", "AvailabilityStrategy.aggregate_train"),
        ("strategies/base.py", "AvailabilityStrategy.reason_held"),
        ("strategies/base.py", "AvailabilityStrategy.reason_whole_round"),
        ("strategies/rule_strategy.py", "RuleStrategy.start_fold"), ("strategies/rule_strategy.py", "_Taken"),
        ("strategies/intake.py", "ReplyIntake.release"),
        ("strategies/rule_strategy.py", "RuleStrategy._finish"),
        ("strategies/base.py", "AvailabilityStrategy.weights"), ("strategies/layout.py", "aggregate_integers"),
    ]),
    ("11 intake", [
        ("strategies/intake.py", "ReplyIntake.stream"), ("strategies/intake.py", "ReplyIntake.round_bounds"),
        ("strategies/rule_strategy.py", "RuleStrategy.state_references"), ("strategies/contract.py", "Rule.references"),
        ("strategies/bounds.py", "NormBounds.settled_for"), ("strategies/bounds.py", "NormBounds.new_round"),
        ("strategies/intake.py", "ReplyIntake._read"),
        ("strategies/intake.py", "ReplyIntake.parse"), ("strategies/intake.py", "ReplyIntake.parser"),
        ("strategies/replies.py", "ReplyParser.parse"),
        ("strategies/replies.py", "ReplyParser.report"), ("strategies/replies.py", "model_delta"),
        ("strategies/rule_strategy.py", "RuleStrategy.check_report"), ("strategies/contract.py", "Rule.check"),
        ("strategies/client_binding.py", "RoundClaims.take"), ("strategies/intake.py", "settled"),
        ("strategies/intake.py", "ReplyIntake.judge"), ("strategies/rule_strategy.py", "RuleStrategy.check_counts"),
        ("strategies/contract.py", "Rule.check_round"), ("strategies/intake.py", "ReplyIntake.check_norms"),
        ("strategies/base.py", "AvailabilityStrategy.norm_checks"), ("strategies/rule.py", "Rule.update_norm"),
        ("strategies/bounds.py", "NormBounds.check"),
        ("strategies/bounds.py", "NormBounds.reference"), ("strategies/bounds.py", "NormBounds.work_factor"),
        ("strategies/bounds.py", "NormBounds.widening"), ("strategies/bounds.py", "NormBounds.gap_factor"),
        ("strategies/bounds.py", "NormBounds.growth"), ("strategies/bounds.py", "RatioBound.settled"),
        ("strategies/bounds.py", "RatioBound.reference"), ("strategies/bounds.py", "RatioBound.limit"),
        ("strategies/bounds.py", "lower_median"),
        ("strategies/bounds.py", "NormBounds.clip_examples"),
        ("strategies/intake.py", "ReplyIntake.finish"), ("strategies/client_binding.py", "ClientBinding.bind"),
        ("strategies/bounds.py", "NormBounds.commit"), ("strategies/bounds.py", "RatioBound.commit"),
        ("strategies/rule_strategy.py", "RuleStrategy.commit_counts"),
        ("strategies/contract.py", "Rule.accepted"),
    ]),
    ("12 the fold", [
        ("strategies/rules/fedavg.py", "FedAvgActiveRule"), ("strategies/rules/fedavg.py", "MeanFold"),
        ("strategies/contract.py", "RoundContext"), ("strategies/contract.py", "Finished"),
        ("strategies/streaming.py", "RunningSum"), ("strategies/streaming.py", "step"),
    ]),
    ("13 failures", [("strategies/failures.py", "log_round"), ("strategies/failures.py", "FailurePolicy.end_round")]),
    ("14 broadcast, evaluate_models", [("strategies/base.py", "AvailabilityStrategy.configure_broadcast"),
                            ("strategies/evaluate_round.py", "Evaluation.broadcast"),
                            ("server_app/setup.py", "evaluate_models"),
                            ("strategies/rule_strategy.py", "RuleStrategy.evaluation_arrays"),
                            ("strategies/contract.py", "Rule.evaluated")]),
]

DEPLOYED: list[Stop] = [
    ("1 cli", [("deploy/cli.py", "main")]),
    ("2 launch_main", [("deploy/launch.py", "launch_main")]),
    ("3 run_recorded", [("deploy/record.py", "run_recorded")]),
    ("4 run_deployment", [
        ("deploy/run.py", "run_deployment"), ("deploy/run.py", "decide_timing"), ("deploy/run.py", "churn_grace"),
        ("deploy/submission.py", "build_run_config"), ("deploy/submission.py", "check_run_config"),
        ("deploy/submission.py", "build_run_schedule"),
        ("deploy/run.py", "signal_folder"), ("deploy/run.py", "first_round"), ("deploy/run.py", "churn_driver"),
        ("deploy/run.py", "run_with"), ("deploy/run.py", "start_nodes"), ("deploy/flwr_cli.py", "FlwrCli.submit"),
        ("deploy/run.py", "follow_run"), ("deploy/flwr_cli.py", "FlwrCli.poll_status"),
        ("deploy/run.py", "compare_participation"),
    ]),
    ("5 ProcessSite", [
        ("deploy/local.py", "ProcessSite.start_superlink"), ("deploy/local.py", "ProcessSite.start_node"),
        ("deploy/local.py", "ProcessSite.registered_id"), ("deploy/local.py", "ProcessSite.wait_registered"),
        ("deploy/local.py", "ProcessSite.signal_node"), ("deploy/local.py", "ProcessSite.stop_node"),
    ]),
    ("6 RunFollower", [("deploy/follow.py", "RunFollower.poll"), ("deploy/follow.py", "RunFollower.events")]),
    ("7 RoundChurn", [
        ("deploy/churn.py", "RoundChurn.__init__"), ("deploy/churn.py", "RoundChurn.on"),
        ("deploy/churn.py", "RoundChurn.prepare"),
        ("deploy/churn.py", "RoundChurn.on_event"), ("deploy/churn.py", "RoundChurn._begin"),
        ("deploy/churn.py", "RoundChurn._note_cut_off"), ("deploy/churn.py", "RoundChurn._fire"),
        ("deploy/churn.py", "RoundChurn.explained"),
    ]),
    ("8 the ServerApp's wait and grid", [
        ("server_app/app.py", "main"), ("server_app/experiment.py", "wait_round_start"), ("server_app/experiment.py", "train_timeout"),
        ("server_app/network.py", "fast_pull"), ("server_app/network.py", "PollingGrid.send_and_receive"),
    ]),
    ("9 worker", [("client_app/worker.py", "through_worker"), ("client_app/worker.py", "uses_worker"),
                  ("client_app/worker.py", "NodeWorker.call"), ("client_app/worker_process.py", "handle"),
                  ("client_app/app.py", "train")]),
    ("10 aggregate_train", [("strategies/base.py", "AvailabilityStrategy.aggregate_train")]),
    ("11 participation_report", [("deploy/participation.py", "participation_report")]),
]

FEDBUFF: list[Stop] = [
    ("1 run", [("server_app/experiment.py", "run"), ("strategies/registry.py", "is_asynchronous")]),
    ("2 run_async, VirtualLoop", [
        ("server_app/asynchronous.py", "run_async"), ("server_app/async_clock.py", "clock_for"),
        ("server_app/asynchronous.py", "VirtualLoop.__init__"), ("server_app/asynchronous.py", "VirtualLoop.run"),
        ("virtualtime/events.py", "run_events"), ("server_app/asynchronous.py", "VirtualLoop.handle"),
        ("server_app/asynchronous.py", "VirtualLoop.after_event"), ("strategies/asynchronous.py", "AsyncRule.deadline"),
        ("strategies/asynchronous.py", "AsyncRule.at_deadline"), ("server_app/asynchronous.py", "VirtualLoop.dispatch"),
        ("virtualtime/clock.py", "VirtualClock.steps_only"), ("virtualtime/clock.py", "VirtualClock.online"),
        ("virtualtime/clock.py", "VirtualClock.session"), ("virtualtime/clock.py", "VirtualClock._scheduled"),
        ("virtualtime/clock.py", "VirtualClock._slot_of"), ("virtualtime/clock.py", "VirtualClock._on_in"),
        ("virtualtime/clock.py", "VirtualClock.next_online"), ("virtualtime/jobs.py", "job_fate"),
        ("virtualtime/clock.py", "VirtualClock.job_time"), ("virtualtime/clock.py", "JobTime"),
        ("virtualtime/jobs.py", "stays_online"), ("virtualtime/jobs.py", "JobFate"),
        ("virtualtime/events.py", "EventQueue.push"), ("virtualtime/events.py", "EventQueue.pop"),
        ("server_app/asynchronous.py", "VirtualLoop.arrive"),
    ]),
    ("3 job", [("strategies/asynchronous.py", "AsyncRule.__init__"), ("strategies/asynchronous.py", "AsyncRule.begin"), ("strategies/asynchronous.py", "AsyncRule.job"),
               ("strategies/asynchronous.py", "AsyncRule._train_message"),
               ("strategies/asynchronous.py", "AsyncRule.holds"), ("strategies/asynchronous.py", "AsyncRule.job_steps")]),
    ("4 arrive, intake, hold, share window", [
        ("strategies/asynchronous.py", "AsyncRule.arrive"), ("strategies/asynchronous.py", "AsyncRule.release"),
        ("strategies/asynchronous.py", "AsyncRule._check_one"), ("strategies/intake.py", "ReplyIntake.new_round"),
        ("strategies/intake.py", "ReplyIntake.collect"), ("strategies/intake.py", "ReplyIntake.stream"),
        ("strategies/intake.py", "ReplyIntake.round_bounds"), ("strategies/rule.py", "Rule.state_references"),
        ("strategies/bounds.py", "NormBounds.settled_for"), ("strategies/bounds.py", "NormBounds.new_round"),
        ("strategies/intake.py", "ReplyIntake._read"), ("strategies/base.py", "AvailabilityStrategy.parse_reply"),
        ("strategies/intake.py", "ReplyIntake.parse"), ("strategies/intake.py", "ReplyIntake.parser"),
        ("strategies/replies.py", "ReplyParser.parse"),
        ("strategies/replies.py", "ReplyParser.report"), ("strategies/replies.py", "model_delta"),
        ("strategies/rule.py", "Rule.check_report"), ("strategies/client_binding.py", "RoundClaims.take"),
        ("strategies/intake.py", "settled"), ("strategies/intake.py", "ReplyIntake.judge"),
        ("strategies/rule.py", "Rule.check_counts"), ("strategies/intake.py", "ReplyIntake.check_norms"),
        ("strategies/base.py", "AvailabilityStrategy.norm_checks"), ("strategies/rule.py", "Rule.update_norm"),
        ("strategies/bounds.py", "NormBounds.check"),
        ("strategies/bounds.py", "NormBounds.reference"), ("strategies/bounds.py", "NormBounds.work_factor"),
        ("strategies/bounds.py", "NormBounds.widening"), ("strategies/bounds.py", "NormBounds.gap_factor"),
        ("strategies/bounds.py", "NormBounds.growth"), ("strategies/bounds.py", "RatioBound.settled"),
        ("strategies/bounds.py", "RatioBound.reference"), ("strategies/bounds.py", "RatioBound.limit"),
        ("strategies/bounds.py", "lower_median"),
        ("strategies/intake.py", "ReplyIntake.finish"),
        ("strategies/client_binding.py", "ClientBinding.bind"), ("strategies/bounds.py", "NormBounds.commit"),
        ("strategies/bounds.py", "RatioBound.commit"),
        ("strategies/rule.py", "Rule.commit_counts"), ("strategies/intake.py", "RoundIntake.absorb"),
        ("strategies/asynchronous.py", "AsyncRule._holding"), ("strategies/asynchronous.py", "AsyncRule._share"),
        ("strategies/asynchronous.py", "AsyncRule.arrival_limit"), ("strategies/asynchronous.py", "AsyncRule.share_window"),
        ("strategies/asynchronous.py", "Arrival"), ("strategies/asynchronous.py", "ArrivalOutcome"),
    ]),
    ("5 FedBuff add, _aggregate_now, apply", [
        ("strategies/rules/fedbuff.py", "FedBuff"), ("strategies/asynchronous.py", "AsyncRule._aggregate_now"),
        ("strategies/staleness.py", "staleness_weight"), ("strategies/base.py", "AvailabilityStrategy.weights"),
        ("strategies/weighting.py", "client_weights"), ("strategies/weighting.py", "weighted_sum"),
    ]),
    ("6 AsyncRecorder", [("server_app/asynchronous.py", "AsyncRecorder.note"),
                         ("strategies/asynchronous.py", "AsyncRule.buffer_size"),
                         ("server_app/asynchronous.py", "AsyncRecorder.row"),
                         ("strategies/asynchronous.py", "AsyncRule.new_window"),
                         ("server_app/setup.py", "evaluate_models")]),
]

FLOWS: dict[str, list[Stop]] = {
    "simulated synchronous round": SIMULATED,
    "deployed round with churn": DEPLOYED,
    "asynchronous FedBuff aggregation": FEDBUFF,
}

NEW_RULE = "examples/flchurn-myext/myext/momentum.py"  # docs/extending.md's FedAvgM
# what a rule may import and still know nothing of the adapter (strategies.rule_strategy, base, intake, ...)
ADAPTER_FREE = ("strategies.contract", "strategies.streaming", "strategies.replies", "strategies.staleness",
                "strategies.weighting", "strategies.state", "strategies.payloads")
PROJECT = ("strategies", "server_app", "client_app", "deploy", "experiments", "workloads", "availability",
           "virtualtime", "runconfig", "flowerlink")


def find(root: Path, path: str, name: str, cache: dict[str, ast.Module] | None = None) -> ast.AST | None:
    """The class or function ``name`` (dotted: ``Class.method``) of ``path`` under ``root``, or None."""
    cache = {} if cache is None else cache
    file = root / path
    if path not in cache:
        if not file.is_file():
            return None
        cache[path] = ast.parse(file.read_text())
    nodes: list[ast.stmt] = cache[path].body
    node: ast.AST | None = None
    for part in name.split("."):
        node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                     and n.name == part), None)
        if node is None:
            return None
        nodes = node.body
    return node


def lines_of(node: ast.AST) -> tuple[int, int]:
    """(first, last) line of a definition, its decorators included."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])  # type: ignore[attr-defined]
    return first, node.end_lineno  # type: ignore[attr-defined]


def measure(root: Path, names: list[tuple[str, str]]) -> dict[str, object]:
    """Lines (each read once; a name inside another listed one not again), file changes in reading
    order, the names not found, and both figures."""
    cache: dict[str, ast.Module] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    missing, files, last = [], 0, None
    for path, name in names:
        node = find(root, path, name, cache)
        if node is None:
            missing.append(f"{path}:{name}")
            continue
        spans.setdefault(path, []).append(lines_of(node))
        if path != last:
            files += 1
            last = path
    total = 0
    for ranges in spans.values():
        read: set[int] = set()
        for a, b in ranges:
            read.update(range(a, b + 1))
        total += len(read)
    own = total / OWN[0] + OWN[1] * files
    human = total / HUMAN[0] + HUMAN[1] * files
    return {"names": len(names), "lines": total, "files": files, "own": own, "human": human, "missing": missing}


def code_lines(source: str, only_definitions: bool = False) -> int:
    """Lines holding code: blank lines, comments and docstrings (module, class, function) left out;
    ``only_definitions``: those of the module's top-level classes and functions (no imports)."""
    tree = ast.parse(source)
    keep: set[int] | None = None
    if only_definitions:
        keep = set()
        for top in tree.body:
            if isinstance(top, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                a, b = lines_of(top)
                keep.update(range(a, b + 1))
    doc: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))  # type: ignore[operator]
    code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in doc and (keep is None or n in keep))
    return len(code)


def project_imports(source: str) -> list[str]:
    """The project modules ``source`` imports (absolute names)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        out += [m for m in mods if m.split(".")[0] in PROJECT]
    return sorted(set(out))


def new_rule(root: Path) -> dict[str, object] | None:
    file = root / NEW_RULE
    if not file.is_file():
        return None
    source = file.read_text()
    imports = project_imports(source)
    return {"code": code_lines(source), "own": code_lines(source, only_definitions=True), "lines": len(source.splitlines()), "imports": imports,
            "adapter_free": all(m in ADAPTER_FREE for m in imports)}


def flat(stops: list[Stop]) -> list[tuple[str, str]]:
    return [entry for _, entries in stops for entry in entries]


def report(root: Path) -> str:
    out = [f"{'flow':34} {'stops':>5} {'names':>5} {'lines':>5} {'files':>5} {'own':>6} {'human':>6}"
           "   (own: 40 lines/min + 0.5 min/file change; human: 25 lines/min + 0.75 min/file change)"]
    totals = [0.0, 0.0]
    for flow, stops in FLOWS.items():
        m = measure(root, flat(stops))
        totals = [totals[0] + m["own"], totals[1] + m["human"]]  # type: ignore[operator]
        out.append(f"{flow:34} {len(stops):>5} {m['names']:>5} {m['lines']:>5} {m['files']:>5} "
                   f"{m['own']:>5.1f}m {m['human']:>5.1f}m" + (f"  not found: {m['missing']}" if m["missing"] else ""))
    out.append(f"{'total':34} {'':>5} {'':>5} {'':>5} {'':>5} {totals[0]:>5.1f}m {totals[1]:>5.1f}m")
    rule = new_rule(root)
    if rule is None:
        out.append(f"new rule: {NEW_RULE} not found")
    else:
        out.append(f"new rule (FedAvgM, {NEW_RULE}): {rule['code']} code lines, "
                   f"{rule['own']} of them the rule's classes ({rule['lines']} lines in the file with docstrings, "
                   f"comments and blank lines); imports {rule['imports']}: "
                   + ("no knowledge of the adapter" if rule["adapter_free"] else "needs the adapter"))
    return "\n".join(out)


def per_stop(root: Path) -> str:
    """Each stop's names and lines (``--stops``)."""
    out = []
    for flow, stops in FLOWS.items():
        out.append(flow)
        for label, names in stops:
            m = measure(root, names)
            out.append(f"  {label:40} {m['lines']:>4} lines  " + ", ".join(n for _, n in names))
    return "\n".join(out)


def main(argv: list[str]) -> None:
    args = [a for a in argv if not a.startswith("--")]
    root = Path(args[0]) if args else HERE
    print(report(root))
    if "--stops" in argv:
        print(per_stop(root))


if __name__ == "__main__":
    main(sys.argv[1:])
