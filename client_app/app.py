"""The ClientApp: local training on the client's partition, under an optional availability gate.

Client id = partition id (``node_config["partition-id"]``): stable across runs and restarts,
unlike Flower's node ids. Train replies carry the trained arrays and the metrics every rule may
need: ``client-id``, ``num-examples``, ``num-steps``, ``a-norm`` (FedNova's ‖a_i‖_1) and
``train-loss``. A node's ``node_config`` may also set ``data-dir`` (where its files live).

Importing this module does not import torch (the workload and the client rules load at the first
message that needs them): in a deployment with ``client-worker=true`` in the node config (see
``client_app.worker``), every message goes through the mod ``through_worker`` to the node's
long-lived worker, and the short-lived ``flwr-clientapp`` process stays thin.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from availability import Schedule, schedule_for
from runconfig import AvailabilityConfig, ConfigError, StragglerConfig, WorkloadConfig, from_run_config
from strategies.protocol import (
    A_NORM,
    CLIENT_ID,
    CLIENT_RULE,
    IGNORE_AVAILABILITY,
    LOCAL_STEPS,
    LR,
    MAX_LOCAL_STEPS,
    NUM_EXAMPLES,
    NUM_STEPS,
    PROBE_BATCHES,
    SERVER_ROUND,
    TRAIN_LOSS,
    TRAIN_TIME,
    UNAVAILABLE,
)

from . import timing
from .client_rule import ClientRule, correct_gradients
from .secure import secure_mod
from .worker import TRAIN_UNTIL, through_worker

if TYPE_CHECKING:
    from workloads.solvers import LocalResult
    from workloads.workload import Workload


app = ClientApp(mods=[secure_mod, through_worker])  # secure_mod: SecAgg+ messages (spec option secure=secagg+)


def identity(context: Context) -> tuple[int, int]:
    """(partition id, number of partitions) of this node; clear error if absent."""
    cfg = context.node_config
    if "partition-id" not in cfg or "num-partitions" not in cfg:
        raise ConfigError(
            "node config lacks 'partition-id' / 'num-partitions'; start the SuperNode with "
            "--node-config \"partition-id=I num-partitions=N\""
        )
    return int(cfg["partition-id"]), int(cfg["num-partitions"])


def workload_of(context: Context) -> tuple[Workload, int]:
    from workloads.workload import get_workload  # torch: only where the work is done

    pid, n = identity(context)
    run_config = dict(context.run_config)
    if "data-dir" in context.node_config:
        run_config["data-dir"] = str(context.node_config["data-dir"])
    cfg = from_run_config(WorkloadConfig, run_config)
    if n != cfg.num_clients:
        raise ConfigError(
            f"this node says num-partitions={n} but the run config has num-clients={cfg.num_clients}"
        )
    return get_workload(cfg), pid


@functools.lru_cache(maxsize=4)
def _schedule(run_config: tuple[tuple[str, object], ...], wl: Workload) -> Schedule:
    return schedule_for(dict(run_config), wl)


def declines(msg: Message, context: Context, wl: Workload, pid: int, rnd: int) -> bool:
    """The client-side gate: True when this client is offline in 0-based round ``rnd``."""
    acfg = from_run_config(AvailabilityConfig, context.run_config).validate()
    if acfg.availability_gate != "client" or msg.content["config"].get(IGNORE_AVAILABILITY, False):
        return False
    schedule = _schedule(tuple(sorted(context.run_config.items())), wl)
    return not schedule.is_available(pid, rnd)


def rule_of(config: Any) -> ClientRule:
    from .rules import client_rule  # torch: only where the work is done

    return client_rule(str(config.get(CLIENT_RULE, "plain")))


def server_round(msg: Message) -> int:
    return int(cast(int, msg.content.config_records["config"][SERVER_ROUND]))


@app.query("identity")  # the server's identity query (server_app.identity.identity_query)
@app.query()
def query(msg: Message, context: Context) -> Message:
    """Who am I: lets the server map node ids to client ids before any training."""
    pid, n = identity(context)
    return Message(RecordDict({"identity": MetricRecord({"client-id": pid, "num-partitions": n})}), reply_to=msg)


@dataclass
class TrainStart:
    """A train message after its *start*: decoded, gated, and the model the client starts from.

    The per-client handler (:func:`train`) and the cohort engine (``experiments.cohort_grid``) both
    build it with :func:`train_start` and answer it with :func:`train_reply`; only the local
    training between them differs.
    """

    msg: Message
    context: Context
    workload: Workload
    client: int
    rnd: int  # 0-based round
    config: Any
    rule: ClientRule
    start: dict[str, Any]  # the state dict local training starts from (the client rule's choice)
    received: float  # time.monotonic() when the message was taken up
    steps: int  # this round's local steps: the workload's, or fewer (config max-local-steps)
    stop: Callable[[int], bool] | None = None  # a deployed straggler's deadline (see stop_at_deadline)


def train_start(msg: Message, context: Context) -> TrainStart | Message:
    """Decode ``msg``, apply the client-side gate (an "unavailable" error reply when it declines),
    and let the client rule choose the start model (FedAWE: the client's own copy)."""
    received = time.monotonic()
    wl, pid = workload_of(context)
    rnd = server_round(msg) - 1
    if declines(msg, context, wl, pid, rnd):
        return Message(Error(code=UNAVAILABLE, reason=f"client {pid} unavailable in round {rnd}"), reply_to=msg)
    config = msg.content["config"]
    rule = rule_of(config)
    start = rule.start(msg.content.array_records["arrays"].to_torch_state_dict(), context, pid, rnd, config)
    return TrainStart(msg, context, wl, pid, rnd, config, rule, start, received,
                      job_steps(wl.steps_for(pid, rnd), config), stop_at_deadline(context))


def job_steps(steps: int, config: Any) -> int:
    """This job's local steps: the rule's own count (config ``local-steps``: FedCompass's Q_i) or
    else the workload's ``steps``, cut to config ``max-local-steps`` when fewer (the virtual
    clock's budget for a straggler under ``straggler-policy=partial``)."""
    for key in (LOCAL_STEPS, MAX_LOCAL_STEPS):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"train config {key} = {value!r}: expected an integer >= 1")
    own = config.get(LOCAL_STEPS)
    steps = steps if own is None else int(own)
    budget = config.get(MAX_LOCAL_STEPS)
    return steps if budget is None else min(steps, int(budget))


def stop_at_deadline(context: Context) -> Callable[[int], bool] | None:
    """A deployed straggler's stop (node config ``train-until``, epoch seconds, set per message by
    ``client_app.worker`` under ``straggler-policy=partial``): after k >= ``straggler-min-steps``
    steps, stop when one more step, at the mean step time so far, would end after ``train-until``."""
    until = context.node_config.get(TRAIN_UNTIL)
    stragglers = from_run_config(StragglerConfig, context.run_config).validate()
    if until is None or stragglers.straggler_policy != "partial":
        return None
    min_steps = stragglers.straggler_min_steps
    began = time.time()

    def stop(done: int) -> bool:
        now = time.time()
        return done >= min_steps and now + (now - began) / done > float(cast(float, until))

    return stop


def local_training(ts: TrainStart) -> tuple[dict[str, Any], LocalResult]:
    """The client's local steps from ``ts.start``: (trained state dict on the CPU, result), over
    the rounds the client rule runs (``rounds``: FedPBC's catch-up first) and with the gradient
    correction its ``start`` registered, if any (:func:`client_app.client_rule.correct_gradients`).

    On the CPU the trained tensors are the workload's scratch model's own (no copy): valid until
    the next message, and :func:`train_reply` turns them into the reply at once.
    """
    model = ts.workload.scratch_model(ts.start)
    correction = correct_gradients(model, ts.context)
    try:
        for rnd in ts.rule.rounds(ts.context, ts.client, ts.rnd, ts.config):
            own = rnd == ts.rnd  # a straggler's budget and stop hold this round's steps only
            result = ts.workload.train_client(model, ts.client, rnd, ts.steps if own else None,
                                              ts.stop if own else None)
    finally:
        if correction is not None:
            correction.detach()  # the scratch model serves the next message too
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}, result


def train_reply(ts: TrainStart, trained: dict[str, Any], result: LocalResult,
                times: tuple[float, float] | None = None) -> Message:
    """The reply: the client rule's arrays (FedAWE: the echo) and every metric a rule may need.
    ``times`` (wall and CPU seconds of local training) is reported where the node asks for timing."""
    wl, pid, rnd = ts.workload, ts.client, ts.rnd
    metrics = MetricRecord({
        CLIENT_ID: pid,
        NUM_EXAMPLES: wl.num_examples(pid),
        NUM_STEPS: result.num_steps,
        A_NORM: float(result.a_norm),
        TRAIN_LOSS: float(result.train_loss),
        LR: wl.lr_at(rnd),
    })
    arrays = ArrayRecord(ts.rule.reply(ts.start, trained, ts.context, pid, rnd, ts.config))
    if times is not None and timing.reports_timing(ts.context):  # edge emulation: see client_app/timing.py
        train_time, cpu_time = times
        metrics[TRAIN_TIME] = train_time
        timing.record(ts.context, pid, rnd + 1, {"train-time": train_time, "cpu-time": cpu_time,
                                                 "num-steps": result.num_steps, "peak-rss-mb": timing.peak_rss_mb(),
                                                 "receive-to-reply": time.monotonic() - ts.received,
                                                 "sent-at": ts.msg.metadata.created_at})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=ts.msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    ts = train_start(msg, context)
    if isinstance(ts, Message):
        return ts  # declined
    t0, cpu0 = time.monotonic(), time.process_time()
    trained, result = local_training(ts)
    return train_reply(ts, trained, result, (time.monotonic() - t0, time.process_time() - cpu0))


@app.train("adopt")
def adopt(msg: Message, context: Context) -> Message:
    """The round-end broadcast: keep the server's new model as this client's own (FedAWE)."""
    pid, _ = identity(context)
    config = msg.content["config"]
    rule = rule_of(config)
    rule.adopt(msg.content.array_records["arrays"].to_torch_state_dict(), context, pid, server_round(msg) - 1, config)
    return Message(RecordDict({"metrics": MetricRecord({CLIENT_ID: pid})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss and accuracy of the received model on this client's own data.

    With config ``probe-batches`` = k > 0, only on k seeded mini-batches (cpow-d's cheap probe).
    """
    wl, pid = workload_of(context)
    config = msg.content.config_records.get("config", ConfigRecord())
    model = wl.scratch_model(msg.content.array_records["arrays"].to_torch_state_dict())
    data = wl.client_data(pid)
    if (k := int(cast(int, config.get(PROBE_BATCHES, 0)))) > 0:
        data = wl.probe_data(pid, int(cast(int, config.get(SERVER_ROUND, 1))) - 1, k)
    scores = wl.evaluate(model, data)
    metrics: dict[str, int | float | list[int] | list[float]] = {CLIENT_ID: pid, NUM_EXAMPLES: wl.num_examples(pid),
               **{f"eval-{k}": float(v) for k, v in scores.items()}}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
