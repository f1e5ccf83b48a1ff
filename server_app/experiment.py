"""One run, from a checked config to a results folder: the round loop of the ServerApp.

Flower's ``Strategy.start`` has no hooks for checkpoints or per-round records, so the loop is
here; it calls the strategy exactly as ``start`` does (configure_train -> send_and_receive ->
aggregate_train, then the evaluate pair), with the round timeout as every round's deadline.
"""

from __future__ import annotations

import logging
import random
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from availability import Schedule, parse_spec, schedule_for
from runconfig import ConfigError
from runconfig.extensions import split_reference
from strategies import AvailabilityStrategy, StrategyFailure, build_strategy, named_arrays
from strategies.protocol import TRAIN_TIME
from strategies.replies import brief, finite
from workloads.workload import Workload, get_workload

from . import checkpoint
from .asynchronous import Hooks, check_resume, is_asynchronous, is_asynchronous_spec, run_async
from .clockgrid import VirtualClock, VirtualClockGrid, build_clock, busy_after, last_virtual_time
from .config import RunConfig, ServerConfig
from .network import AvailabilityGrid, discover_clients, fast_pull, reply_seconds, wait_for_nodes
from .results import METRICS, RunRecorder, default_run_name

log = logging.getLogger(__name__)


@dataclass
class Setup:
    """Everything a run needs, built and checked before round 1."""

    cfg: RunConfig
    workload: Workload
    schedule: Schedule
    strategy: AvailabilityStrategy
    run_dir: Path
    start_round: int
    arrays: ArrayRecord
    clock: VirtualClock | None = None  # run config devices: rounds on the virtual clock


def prepare(cfg: RunConfig) -> Setup:
    """Build workload, schedule and strategy; load a checkpoint. Raises before any training."""
    n = cfg.workload.num_clients
    workload = get_workload(cfg.workload)
    schedule = schedule_for(cfg.to_dict(), workload)
    s = cfg.server
    strategy = build_strategy(
        strategy_spec(s), num_clients=n, server_lr=s.server_lr, weighting=s.weighting,
        seed=cfg.workload.train_seed, fraction_evaluate=float(s.federated_evaluation), probabilities=schedule.prob,
        min_available_nodes=0,  # run() waits for min-nodes itself (wait-for-nodes); churn leaves rounds short
    )
    arrays = ArrayRecord(workload.new_model().state_dict())
    start_round = 1
    if s.resume_from:
        ckpt = load_checkpoint(s.resume_from, cfg, asynchronous=is_asynchronous(strategy))
        arrays = named_arrays(ckpt["arrays"])
        strategy.load_state_dict(ckpt["strategy"])
        start_round = ckpt["round"] + 1
    return Setup(cfg, workload, schedule, strategy, run_folder(cfg), start_round, arrays, virtual_clock(cfg, arrays))


def virtual_clock(cfg: RunConfig, arrays: ArrayRecord) -> VirtualClock | None:
    """The run's virtual clock (run config ``devices``; None without), its sessions seeded by
    ``schedule-seed``, its transfers the model's size each way."""
    s = cfg.server
    if not s.devices:
        return None
    if cfg.availability.availability_gate == "none":
        raise ConfigError(f"run config 'devices' = {s.devices!r} times a simulation; with availability-gate "
                          "'none' (a deployment) time is real: leave devices empty")
    return build_clock(s.devices, cfg.workload.num_clients, seed=cfg.availability.schedule_seed,
                       reference_step_ms=s.reference_step_ms,
                       model_bytes=sum(int(a.nbytes) for a in arrays.to_numpy_ndarrays()))


def strategy_spec(s: ServerConfig) -> str:
    """The ``strategy`` spec with the run config's ``max-update-norm`` / ``max-norm-ratio`` added as
    the rule's spec keys; 0 (the default) leaves the rule's own default, and a spec that sets the
    same key to another value is a ConfigError. A rule of the user's own (``module:Class:k=v``)
    keeps its ``module:Class`` in front of the parameters."""
    reference = split_reference(s.strategy)
    spec = parse_spec(s.strategy if reference is None else f"rule:{reference[1]}" if reference[1] else "rule")
    for key, value in (("max-update-norm", s.max_update_norm), ("max-norm-ratio", s.max_norm_ratio)):
        if not value:
            continue
        if key in spec.params and spec.params[key] != value:
            raise ConfigError(f"run config '{key}' = {value} but strategy {s.strategy!r} sets {key}="
                              f"{spec.params[key]}: set it in one place")
        spec.params[key] = value
    return str(spec) if reference is None else reference[0] + str(spec).removeprefix("rule")


def run_folder(cfg: RunConfig) -> Path:
    """The run's results folder: ``<results-dir>/<run-name>``, or a resumed checkpoint's own."""
    s = cfg.server
    if s.resume_from:
        return Path(s.resume_from).expanduser().resolve().parent.parent
    name = s.run_name or default_run_name(s.strategy, cfg.workload.dataset, cfg.workload.train_seed)
    return (Path(s.results_dir).expanduser() / name).resolve()


def connect(grid: Grid, cfg: RunConfig) -> dict[int, int]:
    """Wait for the nodes, then learn who they are (node id -> client id) and check it fits.

    In simulation and in process (gates ``server`` and ``client``) every node must host a client
    id in [0, num-clients): more SuperNodes than ``num-clients`` is a ConfigError naming the fix
    here, before any folder exists, instead of a ScheduleError in round 1. With the ``none`` gate
    (a deployment, where the launcher sets num-clients) the strategy learns ids from replies.
    """
    s, n = cfg.server, cfg.workload.num_clients
    wait_for_nodes(grid, s.min_nodes or n, s.wait_for_nodes)  # NodesMissing names the fix
    if cfg.availability.availability_gate == "none":
        return {}
    client_of_node = discover_clients(grid, {}, s.round_timeout)
    out_of_range = sorted({c for c in client_of_node.values() if not 0 <= c < n})
    if out_of_range:
        raise ConfigError(
            f"{len(client_of_node)} nodes are connected but the run config has num-clients={n}: nodes "
            f"report client ids {out_of_range[:5]}{'...' if len(out_of_range) > 5 else ''} outside "
            f"[0, {n}). The number of SuperNodes must equal num-clients: pass num-supernodes={n} "
            f"(flwr run --federation-config \"num-supernodes={n}\", or python -m experiments.run "
            f"--num-supernodes {n}), or set num-clients={max(out_of_range) + 1} in the run config"
        )
    return client_of_node


def load_checkpoint(path: str, cfg: RunConfig, asynchronous: bool = False) -> dict[str, Any]:
    """The checkpoint at ``path`` if this run may continue it (ConfigError naming why not): written
    by the loop this run runs (``asynchronous``: the strategy's), with the same settings."""
    if not Path(path).is_file():
        raise ConfigError(f"run config 'resume-from' = {path!r}: no such checkpoint file")
    s = cfg.server
    if asynchronous:
        check_resume(cfg, path)  # not a deployment
    ckpt = checkpoint.load(path)
    wanted = checkpoint.VIRTUAL if asynchronous else checkpoint.ROUNDS
    checkpoint.check_loop(ckpt, path, wanted, s.strategy, is_asynchronous_spec)
    checkpoint.check_resumable(ckpt, path, cfg.to_dict(), s.num_server_rounds)
    return ckpt


def save_checkpoint(setup: Setup, rnd: int, arrays: ArrayRecord, loop: Mapping[str, Any] | None = None) -> Path:
    """Round (or version) ``rnd``'s checkpoint; ``loop``: an asynchronous loop's state (None: the round loop)."""
    return checkpoint.save(setup.run_dir, rnd, dict(zip(arrays.keys(), arrays.to_numpy_ndarrays(), strict=True)),
                           setup.strategy.state_dict(), setup.cfg.to_dict(), loop)


def wait_round_start(s: ServerConfig, rnd: int) -> None:
    """``round-start-delay`` seconds before round ``rnd``; with ``round-start-signal``, only until
    the churn driver has written ``<signal folder>/round-<rnd>`` (its nodes are registered)."""
    if not s.round_start_signal:
        time.sleep(s.round_start_delay)
        return
    flag, deadline = Path(s.round_start_signal) / f"round-{rnd}", time.monotonic() + s.round_start_delay
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def train_timeout(s: ServerConfig, rnd: int, start_round: int) -> float:
    """How long round ``rnd`` waits for training replies: ``round-deadline`` when set, except in
    the run's first round, where every client also starts its worker (imports, workload): that
    round gets ``round-timeout``."""
    return s.round_deadline if s.round_deadline and rnd > start_round else s.round_timeout


MAX_TRAIN_TIME = 1e7  # seconds (116 days): a longer ``train-time`` is not a measurement


def client_train_times(replies: Iterable[Message], sent: list[Message], participants: list[int],
                       node_of_client: Mapping[int, int]) -> dict[str, dict[str, float]]:
    """``client-train-time``: participant -> seconds of local training, from replies that carry
    ``train-time`` (clients with node config ``report-timing=true``; {} otherwise); see :class:`TrainTimes`."""
    times = TrainTimes(sent)
    for msg in replies:
        times.note(msg)
    return times.record(participants, node_of_client)


class TrainTimes:
    """The ``train-time`` of each training reply, noted as the replies pass (:meth:`watch`), so
    that the round keeps a number per node, never the replies (a streaming strategy lets each go).

    Only a reply that answers one of this round's messages (``sent``), from the node the strategy
    accepted for that client id (``node_of_client``), counts (its first such reply); a
    ``train-time`` that is not a number in [0, MAX_TRAIN_TIME] is left out (the strategy judged
    the reply; the time is only a record). Never raises on what a reply holds.
    """

    def __init__(self, sent: list[Message]) -> None:
        self.answers = {m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id}
        self.seconds: dict[int, float | None] = {}  # node -> its first answer's train-time

    def watch(self, replies: Iterable[Message]) -> Iterator[Message]:
        for msg in replies:
            self.note(msg)
            yield msg

    def note(self, msg: Message) -> None:
        try:
            node = self.answers.get(msg.metadata.reply_to_message_id)
            if node is None or node != msg.metadata.src_node_id or msg.has_error() or node in self.seconds:
                return
        except Exception:  # noqa: BLE001 (a reply that cannot even say what it answers is not timed)
            return
        try:
            records = list(msg.content.metric_records.values())
            seconds = finite(records[0], TRAIN_TIME) if len(records) == 1 else None
        except Exception:  # noqa: BLE001 (ReplyRejected, or a record no reader foresaw)
            seconds = None
        self.seconds[node] = seconds if seconds is not None and 0 <= seconds <= MAX_TRAIN_TIME else None

    def record(self, participants: list[int], node_of_client: Mapping[int, int]) -> dict[str, dict[str, float]]:
        """``client-train-time``: participant -> seconds ({} when no participant's reply had one)."""
        times = {}
        for client in participants:
            seconds = self.seconds.get(node_of_client.get(client, -1))
            if seconds is not None:
                times[str(client)] = round(seconds, 4)
        return {"client-train-time": dict(sorted(times.items(), key=lambda kv: int(kv[0])))} if times else {}


def client_reply_times(arrived: Mapping[str, float], sent: list[Message], participants: list[int],
                       node_of_client: Mapping[int, int]) -> dict[str, dict[str, float]]:
    """``client-reply-time``: participant -> seconds from the push of the round's training messages
    to the server's look that found its reply (a deployment's :class:`PollingGrid`, resolution its
    pull interval; ``arrived``: message id -> seconds, from :func:`reply_seconds`). {} elsewhere."""
    to_node = {m.metadata.message_id: m.metadata.dst_node_id for m in sent if m.metadata.message_id}
    by_node = {to_node[mid]: s for mid, s in arrived.items() if mid in to_node}
    times = {str(c): round(by_node[node_of_client[c]], 3) for c in participants
             if node_of_client.get(c) in by_node}
    return {"client-reply-time": dict(sorted(times.items(), key=lambda kv: int(kv[0])))} if times else {}


def evaluate(workload: Workload, arrays: ArrayRecord) -> dict[str, float]:
    model = workload.scratch_model(arrays.to_torch_state_dict())
    return {f"test-{k}": v for k, v in workload.evaluate(model).items()}


def evaluate_models(workload: Workload, strategy: AvailabilityStrategy, arrays: ArrayRecord) -> dict[str, float]:
    """The strategy's evaluation model as ``test-<metric>``, its extra models as ``test-<metric>-<name>``
    (e.g. FedAWE's ``test-accuracy-xbar``)."""
    out = evaluate(workload, strategy.evaluation_arrays(arrays))
    for name, extra in strategy.extra_evaluation_arrays(arrays).items():
        out.update({f"{k}-{name}": v for k, v in evaluate(workload, extra).items()})
    return out


def run(grid: Grid, cfg: RunConfig, console: Console | None = None) -> Path:
    """Run all rounds on ``grid``; return the results folder."""
    grid = fast_pull(grid)  # a deployment: look for replies every 0.1 s, not Flower's 3 s
    setup = prepare(cfg)
    client_of_node = connect(grid, cfg)  # every check is done before the results folder exists
    new_folder = not setup.run_dir.exists()
    try:
        if is_asynchronous(setup.strategy):
            hooks = Hooks(evaluate_models, save_checkpoint, config_record(grid, setup))
            return run_async(grid, setup, client_of_node, console or Console(), hooks)
        return _run_rounds(grid, setup, client_of_node, console or Console())
    except BaseException:
        metrics = setup.run_dir / METRICS
        if new_folder and not (metrics.is_file() and metrics.stat().st_size):
            shutil.rmtree(setup.run_dir, ignore_errors=True)  # failed in round 1: no half-made folder
        raise


def _run_rounds(grid: Grid, setup: Setup, client_of_node: dict[int, int], console: Console) -> Path:
    cfg = setup.cfg
    s, n = cfg.server, cfg.workload.num_clients
    recorder = RunRecorder(setup.run_dir, n)
    recorder.write_config(config_record(grid, setup))
    recorder.resume_at(setup.start_round - 1)
    if setup.start_round > 1:
        checkpoint.restore_rng(checkpoint.load(s.resume_from))
    else:
        random.seed(cfg.workload.train_seed)

    net: Grid = grid
    if cfg.availability.availability_gate == "server":
        net = AvailabilityGrid(grid, setup.schedule, client_of_node, s.round_timeout)
    if setup.clock is not None:  # outside the gate: it times what the strategy sends
        net = VirtualClockGrid(net, setup.clock, client_of_node, setup.workload.steps_for, deadline=s.virtual_deadline,
                               min_replies=s.min_replies, start=last_virtual_time(recorder.rows),
                               busy=busy_after(recorder.rows), scheduled=setup.schedule.available)

    arrays, strategy, t_run = setup.arrays, setup.strategy, time.monotonic()
    strategy.scored_evaluation = True  # evaluate_models shows the rule's scored models
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not (s.progress and console.is_terminal)) as bar:
        task = bar.add_task(s.strategy, total=s.num_server_rounds, completed=setup.start_round - 1, status="")
        for rnd in range(setup.start_round, s.num_server_rounds + 1):
            wait_round_start(s, rnd)  # lets a churn driver bring the round's nodes up
            t0 = time.monotonic()
            sent = list(strategy.configure_train(rnd, arrays, ConfigRecord(), net))
            times = TrainTimes(sent)  # the replies pass through once: a streaming rule holds none
            pulled = net.send_and_receive(sent, timeout=train_timeout(s, rnd, setup.start_round))
            arrived = reply_seconds(net)  # a deployment (its grid pulls eagerly): when each reply came
            replies = times.watch(pulled)
            new_arrays, metrics = strategy.aggregate_train(rnd, replies)
            arrays = new_arrays if new_arrays is not None else arrays
            if broadcast := strategy.configure_broadcast(rnd, arrays, net):
                list(net.send_and_receive(broadcast, timeout=s.round_timeout))
            rlog = strategy.round_log
            row: dict[str, Any] = {
                "round": rnd,
                "participants": rlog.participants,
                "unavailable-nodes": len(rlog.unavailable),
                "rejected": [[node, brief(why)] for node, why in rlog.rejected],
                **(dict(metrics) if metrics else {}),
                **times.record(rlog.participants, strategy.node_of_client),
                **client_reply_times(arrived, sent, rlog.participants, strategy.node_of_client),
                **(net.round_record(rnd) if isinstance(net, VirtualClockGrid) else {}),
            }
            if s.federated_evaluation:
                fed = strategy.aggregate_evaluate(rnd, net.send_and_receive(
                    strategy.configure_evaluate(rnd, arrays, ConfigRecord(), net), timeout=s.round_timeout))
                row.update({f"federated-{k}": v for k, v in (fed or {}).items()})
            if (s.eval_every and rnd % s.eval_every == 0) or rnd == s.num_server_rounds:
                row.update(evaluate_models(setup.workload, strategy, arrays))
            row["round-time"] = time.monotonic() - t0
            row["wall-time"] = time.monotonic() - t_run
            recorder.record(row)
            if s.checkpoint_every and rnd % s.checkpoint_every == 0:
                save_checkpoint(setup, rnd, arrays)
            status = f"{len(rlog.participants)}/{n} replied" + (
                f", acc {row['test-accuracy']:.3f}" if "test-accuracy" in row else "")
            bar.update(task, advance=1, status=status)
            if not bar.live.is_started:
                console.print(f"round {rnd}/{s.num_server_rounds}: {status} ({row['round-time']:.1f} s)",
                              soft_wrap=True)

    final = arrays.to_torch_state_dict()
    recorder.finish(final, setup.schedule.matrix(s.num_server_rounds))
    last = recorder.rows[-1]
    if not any(r["participants"] for r in recorder.rows):  # no success without work (issue 35)
        raise StrategyFailure(f"no client's update was applied in any of the {len(recorder.rows)} rounds (0 "
                              f"participants in each; last round: {last['unavailable-nodes']} node(s) unavailable, "
                              f"rejected {last['rejected'][:3]}): the record is in {setup.run_dir}")
    summary = ", ".join(f"{k} {last[k]:.4f}" for k in ("test-accuracy", "test-loss") if k in last)
    console.print(f"[bold green]done[/]: {s.num_server_rounds} rounds in "
                  f"{time.monotonic() - t_run:.1f} s; {summary}", soft_wrap=True)
    console.print(f"results: {setup.run_dir}", soft_wrap=True)
    return setup.run_dir


def config_record(grid: Grid, setup: Setup) -> dict[str, Any]:
    """``config.json``: the resolved run config, seeds, schedule, engine, versions."""
    cfg = setup.cfg
    why = setup.strategy.holds_every_reply()
    return {**cfg.to_dict(), "weighting-used": setup.strategy.weighting,
            "aggregation": f"holds every reply: {why}" if why else "streaming", "seeds": cfg.seeds,
            "schedule": setup.schedule.describe(), **engine_record(grid, cfg), "versions": _versions(),
            **({"devices-used": setup.clock.plan.record()} if setup.clock else {})}


def engine_record(grid: Grid, cfg: RunConfig) -> dict[str, str]:
    """The engine that trains the clients, for ``config.json``: the grid's own record (the cohort
    engine's), else per client, with the reason when another engine was asked for."""
    if (record := getattr(grid, "engine_record", None)) is not None:
        return dict(record)
    if cfg.server.engine == "per-client":
        return {"engine-used": "per-client"}
    why = (f"engine={cfg.server.engine} applies to in-process runs (experiments.inprocess, experiments.sweep); "
           "here every client trains in its own ClientApp")
    log.warning("training per client: %s", why)
    return {"engine-used": "per-client", "engine-reason": why}


def _versions() -> dict[str, str]:
    import flwr

    return {"flwr": flwr.__version__, "torch": torch.__version__, "numpy": np.__version__}
