"""The asynchronous loop: FedBuff and FedAsync without a round barrier (chosen by the rule).

A rule with ``asynchronous = True`` (:class:`strategies.asynchronous.AsyncRule`) runs here instead
of the round loop of :mod:`server_app.experiment`. Every idle client that is online gets a job (a
train message with the model of the current version); when its reply arrives the rule takes it
(FedAsync aggregates on every arrival, FedBuff every K), and the client starts its next job if it is
online. ``num-server-rounds`` counts aggregations; ``metrics.jsonl`` has one row per aggregation.

- Simulation (in process and under Flower's Ray simulation: availability gate ``server`` or
  ``client``): discrete events on a VIRTUAL clock (:mod:`server_app.async_clock`), no real
  waiting. Each job's fate (its arrival, or lost when its client goes offline before it) is
  :func:`virtualtime.jobs.job_fate`'s, as for the synchronous rounds. Schedule round t is the
  virtual slot [t x slot_seconds, (t + 1) x slot_seconds): a job belongs to the slot of its
  dispatch; a train message's ``server-round`` is its client's job count (data order, lr), not
  a schedule round, and the client-side gate ignores it (the clock decides). The jobs
  dispatched at one virtual instant go out together through the grid's ``send_and_receive``
  (the cohort engine trains them at once); each reply is held until its
  virtual arrival time, dispatch + the client's job time. Events are ordered by (time, sequence
  number): the same seed gives the same arrivals in the same order.
- A deployment (gate ``none``): real time, :mod:`server_app.async_realtime`.

Rows: ``round`` (the version after the aggregation), ``participants`` (the client ids applied),
``arrivals`` ([client, staleness] of each applied update, in arrival order), ``virtual-time`` (or
real seconds in a deployment), ``rejected`` (stale arrivals among them, with their reasons),
``unavailable-nodes`` (jobs lost since the last row), the rule's metrics, evaluation, and
``round-time`` / ``wall-time`` in wall seconds.

Checkpoints (``checkpoint-every`` aggregations) hold the model, the rule's state and the RNG
states; on the virtual clock also the loop's own (:mod:`server_app.async_resume`: the event queue
with the jobs in flight and their replies, the virtual time, each client's job count), so that
``resume-from`` continues the run exactly as if it had not stopped. A deployment does not resume
(its jobs in flight run on real nodes): ``resume-from`` is refused there.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.serverapp import Grid
from rich.console import Console

from flowerlink import set_message_id
from runconfig import ConfigError
from strategies.asynchronous import ArrivalOutcome, AsyncRule
from strategies.replies import brief
from virtualtime import Event, EventQueue, VirtualClock
from virtualtime.events import run_events
from virtualtime.jobs import job_fate

from . import checkpoint
from .async_clock import clock_for
from .async_resume import LoopState, SavedJob, restored_reply, saved_reply
from .results import RunRecorder
from .setup import Setup, check_resume, config_record, evaluate_models, save_checkpoint

log = logging.getLogger(__name__)

ARRIVAL, WAKE, DEADLINE = "arrival", "wake", "deadline"  # DEADLINE: a rule's own time (FedCompass's groups)


@dataclass
class Job:
    client: int
    message: Message
    version: int
    job_round: int  # the message's server-round (the client's job count)
    reply: Message | None = None
    lost: bool = False  # the client goes offline before the job ends




class AsyncRecorder:
    """The rows of an asynchronous run: what arrived since the last aggregation, then one row per aggregation."""

    def __init__(self, setup: Setup, recorder: RunRecorder, console: Console) -> None:
        self.setup, self.recorder, self.console = setup, recorder, console
        self.t_run = self.t_last = time.monotonic()
        self.arrivals: list[dict[str, Any]] = []  # every arrival, for tests and the event-order record
        self.failed_in_a_row = 0
        # the loop's state for a checkpoint: the virtual loop installs its own; real time has none to resume
        self.loop_state: Callable[[], Mapping[str, Any]] = lambda: {"kind": checkpoint.REALTIME}

    def row(self, strategy: AsyncRule, now: float, x_old: np.ndarray) -> None:
        s = self.setup.cfg.server
        rlog, applied = strategy.round_log, strategy.applied
        assert strategy.current is not None
        reports = [a.report for a in applied]
        losses = [r.train_loss for r in reports if r.train_loss is not None]
        row: dict[str, Any] = {
            "round": strategy.version,
            "participants": sorted({r.client_id for r in reports}),
            "arrivals": [[a.report.client_id, a.staleness] for a in applied],
            "virtual-time": round(now, 6),
            "unavailable-nodes": len(rlog.unavailable),
            "lost-nodes": [int(node) for node in rlog.unavailable],  # whose jobs were lost, in order
            "rejected": [[node, brief(why)] for node, why in rlog.rejected],
            **rlog.errors_record(),
            **rlog.cut_record(),
            "num-participants": len(reports),
            "num-rejected": len(rlog.rejected),
            "num-stale": sum(1 for _, why in rlog.rejected if why.startswith("stale")),
            "update-norm": float(np.linalg.norm(np.subtract(strategy.current, x_old, dtype=np.float64))),
            "buffered": len(strategy.pending),
            **strategy.last_metrics,
        }
        if losses:
            row["train-loss"] = float(np.mean(losses))
        arrays = strategy.arrays_of(strategy.current)
        if (s.eval_every and strategy.version % s.eval_every == 0) or strategy.version == s.num_server_rounds:
            row.update(evaluate_models(self.setup.workload, strategy, arrays))
        t = time.monotonic()
        row["round-time"], row["wall-time"] = t - self.t_last, t - self.t_run
        self.t_last = t
        self.recorder.record(row)
        if s.checkpoint_every and strategy.version % s.checkpoint_every == 0:
            save_checkpoint(self.setup, strategy.version, arrays, self.loop_state())
        strategy.new_window()
        acc = f", acc {row['test-accuracy']:.3f}" if "test-accuracy" in row else ""
        self.console.print(f"aggregation {strategy.version}/{s.num_server_rounds} at t={now:.1f}: "
                           f"{len(reports)} updates{acc}", soft_wrap=True)

    def note(self, strategy: AsyncRule, client: int, outcome: Any, now: float) -> None:
        """One arrival's record; a StrategyFailure after too many failures in a row (every client
        failing max-failed-rounds times: nothing will ever be aggregated)."""
        self.arrivals.append({"time": now, "client": client, "staleness": outcome.staleness,
                              "accepted": not outcome.reason, "aggregated": outcome.aggregated})
        self.failed_in_a_row = 0 if not outcome.reason else self.failed_in_a_row + 1
        n = self.setup.cfg.workload.num_clients
        limit = max(1, strategy.failures.max_failed_rounds) * max(n, 1) * strategy.buffer_size
        if self.failed_in_a_row > limit:
            from strategies.failures import StrategyFailure

            raise StrategyFailure(f"{strategy.name}: {self.failed_in_a_row} arrivals in a row were lost or "
                                  f"rejected (last: {outcome.reason}); nothing can be aggregated")


def run_async(grid: Grid, setup: Setup, client_of_node: dict[int, int], console: Console) -> Path:
    """Run an asynchronous rule to ``num-server-rounds`` aggregations; return the results folder."""
    cfg, strategy = setup.cfg, setup.strategy
    assert isinstance(strategy, AsyncRule)
    s = cfg.server
    if s.resume_from:
        check_resume(cfg, s.resume_from)  # prepare() did too, before any folder was touched
    if s.federated_evaluation:
        raise ConfigError(f"run config 'federated-evaluation' = true: strategy '{strategy.name}' is asynchronous "
                          "(no rounds whose clients could evaluate); use central evaluation (eval-every)")
    recorder = RunRecorder(setup.run_dir, cfg.workload.num_clients)
    recorder.write_config({**config_record(grid, setup), "loop": "asynchronous"})
    recorder.resume_at(setup.start_round - 1)
    strategy.begin(setup.arrays)  # a resumed run: the checkpoint's model, and prepare() loaded the rule's state
    rec = AsyncRecorder(setup, recorder, console)
    if cfg.availability.availability_gate == "none":
        from .async_realtime import run_realtime

        end = run_realtime(grid, setup, strategy, rec)
        slots = max(len(recorder.rows), 1)
    else:
        clock = clock_for(setup)
        loop = VirtualLoop(grid, setup, strategy, clock, client_of_node, rec)
        resume = None
        if s.resume_from:  # prepare() checked it: this loop's, the same settings, versions left to run
            ckpt = checkpoint.load(s.resume_from)
            resume = LoopState.from_saved(ckpt["loop"], s.resume_from)
            checkpoint.restore_rng(ckpt)
        end = loop.run(resume)
        slot = clock.slot_seconds or 1.0
        slots = int(min(max(1, math.ceil(end / slot) + 1), 10 * s.num_server_rounds + 1))
    if not recorder.rows:
        raise RuntimeError(f"{strategy.name}: no aggregation happened (no client was ever online, or every "
                           "job was lost); see the log")
    assert strategy.current is not None
    recorder.finish(strategy.arrays_of(strategy.current).to_torch_state_dict(), setup.schedule.matrix(slots))
    kind = "real" if cfg.availability.availability_gate == "none" else "virtual"
    console.print(f"[bold green]done[/]: {strategy.version} aggregations, {kind} time {end:.1f} s", soft_wrap=True)
    console.print(f"results: {setup.run_dir}", soft_wrap=True)
    return setup.run_dir


class VirtualLoop:
    """Discrete events on a virtual clock (the module docstring)."""

    def __init__(self, grid: Grid, setup: Setup, strategy: AsyncRule, clock: VirtualClock,
                 client_of_node: dict[int, int], rec: AsyncRecorder) -> None:
        self.grid, self.setup, self.strategy, self.clock, self.rec = grid, setup, strategy, clock, rec
        self.node_of = {c: node for node, c in client_of_node.items()}
        n = setup.cfg.workload.num_clients
        missing = [c for c in range(n) if c not in self.node_of]
        if missing:
            raise ConfigError(f"asynchronous run: no node hosts client(s) {missing[:5]}: pass num-supernodes={n}")
        self.connected = set(self.node_of.values())
        self.idle = set(range(n))  # clients without a job that are (or may be) online
        self.jobs_of = dict.fromkeys(range(n), 0)
        self.queue = EventQueue()
        self.in_flight = 0
        self.now = 0.0
        self.deadline_queued: float | None = None
        rec.loop_state = self.state

    def run(self, resume: LoopState | None = None) -> float:
        """Events until ``num-server-rounds`` aggregations (or none is left); the last event's time.
        ``resume``: go on from a checkpoint's state (written right after an event was handled)."""
        target = self.setup.cfg.server.num_server_rounds
        if resume is None:
            self.dispatch(self.now)
        else:
            self.restore(resume)
            self.after_event(target)
        if self.strategy.version < target:
            run_events(self.queue, lambda event: self.handle(event, target))  # the buffer: the policy
        if self.strategy.version < target:
            log.warning("%s: stopped after %d of %d aggregations at virtual time %.1f: no client will be online "
                        "again within the clock's horizon", self.strategy.name, self.strategy.version, target,
                        self.now)
        return self.now

    def handle(self, event: Event, target: int) -> bool:
        """One event of the buffer's policy (an arrival, a client back online, a rule's own
        deadline), then the instant's dispatch; True when ``target`` aggregations are made."""
        self.now = event.time
        if event.kind == ARRIVAL:
            self.arrive(event.payload, self.now)
        elif event.kind == DEADLINE:
            x_old = self.strategy.current
            if self.strategy.at_deadline(self.now):
                assert x_old is not None  # a deadline comes after the loop's begin
                self.rec.row(self.strategy, self.now, x_old)
        else:
            self.idle.add(event.payload)
        self.after_event(target)
        return self.strategy.version >= target

    def after_event(self, target: int) -> None:
        nxt = self.queue.peek()
        if self.strategy.version < target and (nxt is None or nxt.time != self.now):
            self.dispatch(self.now)  # after every event of this instant
        due = self.strategy.deadline()  # a rule with times of its own: FedCompass
        if due is not None and due != self.deadline_queued:
            self.queue.push(max(due, self.now), DEADLINE, -1)
            self.deadline_queued = due

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """The loop's checkpoint entry (:class:`LoopState`), taken while an event is handled."""
        events = []
        for e in self.queue.events():
            item: dict[str, Any] = {"time": e.time, "seq": e.seq, "kind": e.kind}
            if e.kind == ARRIVAL:
                job: Job = e.payload
                item["client"] = job.client
                item["job"] = asdict(SavedJob(job.client, job.version, job.job_round, job.lost, saved_reply(job.reply)))
            else:
                item["client"] = int(e.payload)
            events.append(item)
        n = self.setup.cfg.workload.num_clients
        return LoopState(self.now, self.queue.next_seq, events, sorted(self.idle), [self.jobs_of[c] for c in range(n)],
                         self.in_flight, self.rec.failed_in_a_row, dict(self.node_of)).saved()

    def restore(self, state: LoopState) -> None:
        """Take a checkpoint's loop state: each job in flight gets its message again (to the node
        that hosts its client now) and the reply it had."""
        n = self.setup.cfg.workload.num_clients
        if len(state.jobs_of) != n:
            raise ConfigError(f"the checkpoint's loop holds {len(state.jobs_of)} clients, the run has num-clients={n}")
        self.rebind({int(c): int(node) for c, node in state.node_of.items()})
        events = []
        for item in state.events:
            payload: Any = int(item["client"])
            if item["kind"] == ARRIVAL:
                saved = SavedJob(**item["job"])
                msg = self.strategy.resume_job(self.node_of[saved.client], saved.job_round, saved.version)
                set_message_id(msg, uuid.uuid4().hex)  # as a grid gives it one
                payload = Job(saved.client, msg, saved.version, saved.job_round, restored_reply(saved.reply, msg),
                              saved.lost)
            events.append(Event(float(item["time"]), int(item["seq"]), str(item["kind"]), payload))
        self.queue = EventQueue.restored(events, int(state.next_seq))
        self.now = float(state.now)
        self.idle = {int(c) for c in state.idle}
        self.jobs_of = {c: int(k) for c, k in enumerate(state.jobs_of)}
        self.in_flight = int(state.in_flight)
        self.rec.failed_in_a_row = int(state.failed_in_a_row)

    def rebind(self, saved_node_of: Mapping[int, int]) -> None:
        """A run resumed on nodes with other ids (a new Flower simulation draws new ones): the
        rule's client binding follows each client to its node now (in simulation a node's
        client id is its partition, :func:`server_app.experiment.connect`)."""
        moved = {saved_node_of[c]: node for c, node in self.node_of.items()
                 if c in saved_node_of and saved_node_of[c] != node}
        if not moved:
            return
        binding = self.strategy.binding
        binding.load_state_dict({
            "client_of_node": {moved.get(node, node): c for node, c in binding.client_of_node.items()},
            "node_of_client": {c: moved.get(node, node) for c, node in binding.node_of_client.items()},
        })

    def dispatch(self, now: float) -> None:
        free = []
        for c in sorted(self.idle):
            if self.strategy.holds(self.node_of[c]):  # FedCompass: an update waiting for its group
                continue
            if self.clock.online(c, now):
                free.append(c)
                continue
            self.idle.discard(c)  # back at its wake event: an offline client costs nothing until then
            t = self.clock.next_online(c, now)
            if math.isfinite(t):
                self.queue.push(t, WAKE, c)
        cap = self.strategy.concurrency - self.in_flight if self.strategy.concurrency else len(free)
        if cap <= 0 or not free:
            return
        if cap < len(free):
            free = sorted(int(c) for c in self.strategy.rng.choice(free, cap, replace=False))
        jobs = []
        for c in free:
            self.jobs_of[c] += 1
            msg, version = self.strategy.job(self.node_of[c], self.jobs_of[c])
            jobs.append(Job(c, msg, version, self.jobs_of[c]))
        replies = self.grid.send_and_receive([j.message for j in jobs], timeout=self.setup.cfg.server.round_timeout)
        by_id: dict[str, Message] = {}
        for r in replies:
            try:
                by_id.setdefault(str(r.metadata.reply_to_message_id), r)
            except Exception:  # noqa: BLE001 (a reply that cannot say what it answers answers no job)
                continue
        wl = self.setup.workload
        for job in jobs:
            job.reply = by_id.get(str(job.message.metadata.message_id))
            steps = wl.steps_for(job.client, self.jobs_of[job.client] - 1)
            own = self.strategy.job_steps(job.message.metadata.dst_node_id, steps)  # the rule's own count (FedCompass)
            fate = job_fate(self.clock, job.client, now, own)
            job.lost = fate.lost
            self.queue.push(fate.arrival, ARRIVAL, job)
            self.idle.discard(job.client)
            self.in_flight += 1

    def arrive(self, job: Job, now: float) -> None:
        s, x_old = self.strategy, self.strategy.current
        self.in_flight -= 1
        self.idle.add(job.client)
        if job.reply is None or job.lost:  # no reply, or offline before the job ended
            s.release(job.version)
            s.round_log.unavailable.append(job.message.metadata.dst_node_id)
            outcome = ArrivalOutcome(job.message.metadata.dst_node_id, job.client, reason="unavailable", unavailable=True)
        else:
            outcome = s.arrive(job.reply, job.message, job.version, self.connected, now)
        self.rec.note(s, job.client, outcome, now)
        if outcome.aggregated:
            assert x_old is not None
            self.rec.row(s, now, x_old)

