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
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runconfig import ConfigError
from strategies import StrategyFailure
from strategies.protocol import IGNORE_AVAILABILITY, NUM_STEPS, TRAIN_TIME
from strategies.registry import is_asynchronous
from strategies.replies import brief, finite
from strategies.weighting import one_blas_thread

from . import checkpoint
from .asynchronous import run_async
from .clockgrid import VirtualClockGrid, busy_after, last_virtual_time
from .config import RunConfig, ServerConfig
from .identity import discover_clients
from .network import AvailabilityGrid, fast_pull, reply_seconds, wait_for_nodes
from .raylost import LOST
from .results import METRICS, RunRecorder
from .setup import Setup, config_record, evaluate_models, prepare, save_checkpoint

log = logging.getLogger(__name__)


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


def wait_round_start(s: ServerConfig, rnd: int) -> None:
    """``round-start-delay`` seconds before round ``rnd``; with ``round-start-signal``, only until
    the churn driver has written ``<signal folder>/round-<rnd>`` (its nodes are registered)."""
    if not s.round_start_signal:
        time.sleep(s.round_start_delay)
        return
    flag, deadline = Path(s.round_start_signal) / f"round-{rnd}", time.monotonic() + s.round_start_delay
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


def train_timeout(s: ServerConfig, rnd: int, start_round: int, straggler_policy: str = "drop") -> float:
    """How long round ``rnd`` waits for training replies: ``round-deadline`` when set, except in the run's
    first round (every client also starts its worker) and under ``straggler-policy=wait``: ``round-timeout``."""
    return s.round_deadline if s.round_deadline and rnd > start_round and straggler_policy != "wait" else s.round_timeout


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
        self.sent, self.answers = sent, dict[str, int]()
        self.seconds: dict[int, float | None] = {}  # node -> its first answer's train-time
        self.steps: dict[int, int] = {}  # node -> its first answer's num-steps (an integer >= 0)

    def watch(self, replies: Iterable[Message]) -> Iterator[Message]:
        for msg in replies:
            self.note(msg)
            yield msg

    def note(self, msg: Message) -> None:
        try:  # message id -> node, read at the first reply (an in-process grid gives the ids as it delivers)
            self.answers = self.answers or {m.metadata.message_id: m.metadata.dst_node_id for m in self.sent}
            node = self.answers.get(msg.metadata.reply_to_message_id)
            if node is None or node != msg.metadata.src_node_id or msg.has_error() or node in self.seconds:
                return
        except Exception:  # noqa: BLE001 (a reply that cannot even say what it answers is not timed)
            return
        try:
            records = list(msg.content.metric_records.values())
            seconds = finite(records[0], TRAIN_TIME) if len(records) == 1 else None
            steps = finite(records[0], NUM_STEPS) if len(records) == 1 else None
        except Exception:  # noqa: BLE001 (ReplyRejected, or a record no reader foresaw)
            seconds = steps = None
        self.seconds[node] = seconds if seconds is not None and 0 <= seconds <= MAX_TRAIN_TIME else None
        if steps is not None and steps >= 0 and steps == int(steps):
            self.steps[node] = int(steps)

    def record(self, participants: list[int], node_of_client: Mapping[int, int]) -> dict[str, dict[str, float]]:
        """``client-train-time``: participant -> seconds ({} when no participant's reply had one)."""
        times = {}
        for client in participants:
            seconds = self.seconds.get(node_of_client.get(client, -1))
            if seconds is not None:
                times[str(client)] = round(seconds, 4)
        return {"client-train-time": dict(sorted(times.items(), key=lambda kv: int(kv[0])))} if times else {}

    def steps_record(self, participants: list[int], node_of_client: Mapping[int, int]) -> dict[str, dict[str, int]]:
        """``client-steps``: participant -> its reply's ``num-steps`` (a partial straggler's are fewer)."""
        steps = {str(c): self.steps[n] for c in sorted(participants) if (n := node_of_client.get(c, -1)) in self.steps}
        return {"client-steps": steps} if steps else {}


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


def run(grid: Grid, cfg: RunConfig, console: Console | None = None) -> Path:
    """Run all rounds on ``grid``; return the results folder."""
    grid = fast_pull(grid)  # a deployment: look for replies every 0.1 s, not Flower's 3 s
    setup = prepare(cfg)
    client_of_node = connect(grid, cfg)  # every check is done before the results folder exists
    new_folder = not setup.run_dir.exists()
    try:
        with one_blas_thread():  # the server's vector math: busy cores make BLAS threads spin (strategies.weighting)
            if is_asynchronous(setup.strategy):
                if (policy := cfg.stragglers.straggler_policy) != "drop":  # FedBuff, FedAsync: no round, no deadline
                    raise ConfigError(f"run config 'straggler-policy' = {policy!r}: '{cfg.server.strategy}' is asynchronous")
                return run_async(grid, setup, client_of_node, console or Console())
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
    LOST.begin()  # Ray nodes dead before this run are not its lost workers
    if setup.start_round > 1:
        saved = checkpoint.load(s.resume_from)
        checkpoint.restore_rng(saved)
        if setup.privacy is not None:  # the accountant goes on from the rounds it composed
            if "privacy" not in saved:
                raise ConfigError(f"resume-from {s.resume_from!r}: the checkpoint was written without central DP "
                                  f"(dp-noise-multiplier = 0): its rounds' privacy was not accounted")
            setup.privacy.load_state_dict(saved["privacy"])
    else:
        random.seed(cfg.workload.train_seed)

    net: Grid = grid
    gate = None
    if cfg.availability.availability_gate == "server":
        net = gate = AvailabilityGrid(grid, setup.schedule, client_of_node, s.round_timeout)
    if setup.clock is not None:  # outside the gate: it times what the strategy sends
        net = VirtualClockGrid(net, setup.clock, client_of_node, setup.workload.steps_for, deadline=s.virtual_deadline,
                               min_replies=s.min_replies, start=last_virtual_time(recorder.rows),
                               busy=busy_after(recorder.rows), scheduled=setup.schedule.available,
                               straggler_policy=cfg.stragglers.straggler_policy, min_steps=cfg.stragglers.straggler_min_steps)

    arrays, strategy, t_run = setup.arrays, setup.strategy, time.monotonic()
    strategy.evaluation.scored = True  # evaluate_models shows the rule's scored models
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not (s.progress and console.is_terminal)) as bar:
        task = bar.add_task(s.strategy, total=s.num_server_rounds, completed=setup.start_round - 1, status="")
        for rnd in range(setup.start_round, s.num_server_rounds + 1):
            wait_round_start(s, rnd)  # lets a churn driver bring the round's nodes up
            t0 = time.monotonic()
            if gate is not None:  # offline nodes are not listed, as in a deployment (issue 35)
                gate.begin_round(rnd, every_node=bool(strategy.train_config(rnd - 1, []).get(IGNORE_AVAILABILITY)))
            sent = list(strategy.configure_train(rnd, arrays, ConfigRecord(), net))
            times = TrainTimes(sent)  # the replies pass through once: a streaming rule holds none
            wait = train_timeout(s, rnd, setup.start_round, cfg.stragglers.straggler_policy)
            pulled = net.send_and_receive(sent, timeout=wait)
            arrived = reply_seconds(net)  # a deployment (its grid pulls eagerly): when each reply came
            replies = times.watch(pulled)
            if setup.privacy is not None:  # central DP: each update clipped before the rule (privacy.rounds)
                replies = setup.privacy.clip(replies, arrays)
            new_arrays, metrics = strategy.aggregate_train(rnd, replies)
            dp: dict[str, float] = {}
            if setup.privacy is not None:  # ... and the rule's model noised, the round accounted
                new_arrays, dp = setup.privacy.release(rnd, new_arrays, strategy.round_log.participants)
            arrays = new_arrays if new_arrays is not None else arrays
            if broadcast := strategy.configure_broadcast(rnd, arrays, net):
                list(net.send_and_receive(broadcast, timeout=s.round_timeout))
            rlog = strategy.round_log
            row: dict[str, Any] = {
                "round": rnd,
                "participants": rlog.participants,
                "unavailable-nodes": len(rlog.unavailable),
                "rejected": [[node, brief(why)] for node, why in rlog.rejected],
                **rlog.errors_record(),
                **rlog.cut_record(),
                **(dict(metrics) if metrics else {}),
                **dp,
                **times.record(rlog.participants, strategy.node_of_client),
                **times.steps_record(rlog.participants, strategy.node_of_client),
                **client_reply_times(arrived, sent, rlog.participants, strategy.node_of_client),
                **LOST.take(),  # Ray workers lost in this round (their messages ran again: server_app.raylost)
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
