"""The asynchronous loop in a deployment: real time, Flower's Grid push and pull, no round barrier.

Every connected node without a job gets one (``push_messages``: the model of the current version);
replies are pulled every ``FLCHURN_PULL_INTERVAL`` seconds (0.1 s) and each goes to the rule as it
arrives (:meth:`strategies.asynchronous.AsyncRule.arrive`). A node that disappears (churn:
:mod:`deploy.async_churn` follows the rows) just stops replying: its job in flight comes back as an
error reply (SIGTERM) or gets none; a job without a reply after ``round-timeout`` seconds
(``round-deadline`` after a node's first job, which also starts its worker) is lost. Either way it is
recorded as unavailable (the row's ``lost-nodes``), and the node gets a new job as soon as it is
connected and idle. Times in the rows are real seconds since the start. Schedule round t here is
the churn driver's: slot(r), the r-th schedule round with anyone on, while aggregation r is made
(:mod:`deploy.async_churn`); it agrees with the virtual loop's (the slot of a job's dispatch) when
every aggregation takes one slot (docs/virtual-time.md, "Round t").
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from strategies.asynchronous import ArrivalOutcome, AsyncRule

from .network import PULL_INTERVAL, PULL_INTERVAL_VAR
from .setup import Setup

log = logging.getLogger(__name__)


@dataclass
class LiveJob:
    node: int
    message: Message
    version: int
    deadline: float  # monotonic seconds


def _reply_to(msg: Message) -> str | None:
    try:
        return str(msg.metadata.reply_to_message_id)
    except Exception:  # noqa: BLE001 (a reply that cannot say what it answers answers no job)
        return None


def run_realtime(grid: Grid, setup: Setup, strategy: AsyncRule, rec: Any) -> float:
    """Run to ``num-server-rounds`` aggregations on real time; returns the seconds it took."""
    s = setup.cfg.server
    interval = float(os.environ.get(PULL_INTERVAL_VAR, PULL_INTERVAL))
    t0 = time.monotonic()
    jobs: dict[str, LiveJob] = {}
    busy: set[int] = set()
    started: set[int] = set()  # nodes that had a job (their worker is up)
    count: dict[int, int] = {}  # jobs per client (node when its client is not known yet)
    last_seen = t0
    while strategy.version < s.num_server_rounds:
        now = time.monotonic()
        connected = set(grid.get_node_ids())
        if connected or jobs:
            last_seen = now
        elif now - last_seen > s.wait_for_nodes:
            raise RuntimeError(f"{strategy.name}: no node connected for {s.wait_for_nodes:g} s (wait-for-nodes) "
                               f"after {strategy.version} aggregations")
        idle = sorted(n for n in connected - busy if not strategy.holds(n))  # FedCompass: an update waiting for its group
        cap = strategy.concurrency - len(jobs) if strategy.concurrency else len(idle)
        if cap < len(idle):
            idle = sorted(int(n) for n in strategy.rng.choice(idle, max(cap, 0), replace=False))
        if idle:
            _dispatch(grid, strategy, idle, jobs, busy, started, count, s, now)
        replies = list(grid.pull_messages(list(jobs))) if jobs else []
        t = time.monotonic()
        for reply in replies:
            job = jobs.pop(_reply_to(reply) or "", None)
            if job is None:
                continue
            busy.discard(job.node)
            x_old = strategy.current
            outcome = strategy.arrive(reply, job.message, job.version, connected, t - t0)
            rec.note(strategy, strategy.client_of_node.get(job.node, -1), outcome, t - t0)
            if outcome.aggregated and x_old is not None:
                rec.row(strategy, t - t0, x_old)
            if strategy.version >= s.num_server_rounds:
                break
        x_old = strategy.current
        if strategy.version < s.num_server_rounds and strategy.at_deadline(t - t0):  # a rule's own times (FedCompass)
            rec.row(strategy, t - t0, x_old)
        for mid, job in list(jobs.items()):
            if t >= job.deadline:
                del jobs[mid]
                busy.discard(job.node)
                strategy.release(job.version)
                strategy.round_log.unavailable.append(job.node)
                rec.note(strategy, strategy.client_of_node.get(job.node, -1),
                         ArrivalOutcome(job.node, reason="unavailable: no reply within the timeout", unavailable=True), t - t0)
        time.sleep(interval)
    for job in jobs.values():  # jobs still out when the run ends: their replies are not waited for
        strategy.release(job.version)
    return time.monotonic() - t0


def _dispatch(grid: Grid, strategy: AsyncRule, nodes: list[int], jobs: dict[str, LiveJob], busy: set[int],
              started: set[int], count: dict[int, int], s: Any, now: float) -> None:
    out = []
    for node in nodes:
        key = strategy.client_of_node.get(node, -node)
        count[key] = count.get(key, 0) + 1
        msg, version = strategy.job(node, count[key])
        out.append((node, msg, version))
    try:
        ids: list[str | None] = list(grid.push_messages([m for _, m, _ in out]))
    except Exception as exc:  # noqa: BLE001 (a node that left between listing and pushing)
        log.warning("%s: pushing %d job(s) failed (%s); retrying next poll", strategy.name, len(out), exc)
        for _, _, version in out:
            strategy.release(version)
        return
    ids += [None] * (len(out) - len(ids))
    for (node, msg, version), mid in zip(out, ids, strict=False):
        if not mid:
            strategy.release(version)
            continue
        timeout = s.round_deadline if s.round_deadline and node in started else s.round_timeout
        jobs[str(mid)] = LiveJob(node, msg, version, now + timeout)
        busy.add(node)
        started.add(node)
