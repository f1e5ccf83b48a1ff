"""Synchronous rounds on the virtual clock (run config ``devices``): :class:`VirtualClockGrid`.

It wraps the grid the round loop talks to (outside :class:`~server_app.network.AvailabilityGrid`),
so it works for every engine: in process (per client, cohort) and on Flower's Ray simulation.
Round r (the Flower round; schedule round r - 1) starts at virtual time T (the previous round's
close; 0 first). For each TRAIN message of the round to client c, the job's fate is
:func:`virtualtime.jobs.job_fate`'s (the asynchronous loop calls the same function); this grid
acts on it and closes the round (the barrier):

- c is offline in its session at T: the message is not delivered (its node is gone, as the
  deployment's churn driver stops it): status ``off``;
- c's session ends before download + compute are over: not delivered, it never trains
  (``lost``: no reply ever comes);
- c's session ends during its upload: delivered, it trains (its client-side state, e.g.
  FedAWE's kept copy, changes), the reply is lost (``lost``);
- else its reply arrives at S + download + overhead + compute + upload, where S is when its job
  starts: T, or later when the device is still busy with a job of an earlier round whose reply
  came too late (a device works one job at a time, as a SuperNode handles one message at a
  time: the deployment's message waits for it). ``client-virtual-time`` is the reply's time
  from T, the deployment's ``client-reply-time``.

The round closes at ``close = min(T + virtual-deadline, the min-replies-th arrival)``; with no
lost client and every reply in before that, at the last arrival; with no deadline and no
arrival at all, when the first of its addressed clients is back online (T if none ever is).
Replies that arrive after the close are dropped: status ``late``. A late client trained, as in a
deployment, where the server drops a reply that comes after the round closed.

Stragglers (run config ``straggler-policy``, :mod:`runconfig.stragglers`): ``drop`` is the above;
``wait`` lifts the deadline (the round waits for every reply that comes); ``partial`` gives a
client whose job would end after ``T + virtual-deadline`` the steps that fit,
``k = floor((T + virtual-deadline - S - download - overhead - upload) / step time)``
(:meth:`~virtualtime.VirtualClock.steps_that_fit`), at least ``straggler-min-steps``: its train
message carries ``max-local-steps = k`` (a copy of the message's content: the strategy sends one
content to every node), the client trains k steps and replies with ``num-steps = k``, on time
when k fits. Sessions then judge the shorter job. The replies the
strategy sees keep the inner grid's order (only filtered), so with no deadline and no session a
run equals the run without ``devices`` bit for bit. Other messages (evaluate, queries, an oracle
round's) pass unchanged and take no virtual time. Clients the schedule has off in round r are not
addressed at all (the availability grid lists only the online, as a deployment): a round with
nobody online sends no training and takes no virtual time (before, it waited ``virtual-deadline``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from runconfig import STRAGGLER_POLICIES, ConfigError
from strategies.grid import DelegatingGrid
from strategies.protocol import IGNORE_AVAILABILITY, MAX_LOCAL_STEPS, SERVER_ROUND, server_round_of
from virtualtime import ProfileError, VirtualClock, read_profiles
from virtualtime.barrier import barrier_close
from virtualtime.jobs import back_online, job_fate

#: the statuses of deploy.realised (the deployment's record), for the same record here
ON_TIME, LATE, LOST, OFF = "on time", "late", "lost", "off"


class VirtualClockGrid(DelegatingGrid):
    """Times each round's TRAIN messages on ``clock``; see the module docstring."""

    def __init__(self, grid: Grid, clock: VirtualClock, client_of_node: dict[int, int],
                 steps_for: Callable[[int, int], int], *, deadline: float = 0.0, min_replies: int = 0,
                 start: float = 0.0, busy: Mapping[int, float] | None = None,
                 scheduled: Callable[[int], Any] | None = None, straggler_policy: str = "drop",
                 min_steps: int = 1) -> None:
        super().__init__(grid)
        if straggler_policy not in STRAGGLER_POLICIES or min_steps < 1:
            raise ValueError(f"straggler policy {straggler_policy!r} (one of {STRAGGLER_POLICIES}), "
                             f"min steps {min_steps} (>= 1)")
        self.scheduled = scheduled  # 0-based round -> A(., t), or None: every client scheduled on
        self.clock, self.client_of_node, self.steps_for = clock, client_of_node, steps_for
        self.policy, self.min_steps = straggler_policy, min_steps
        self.deadline = deadline if deadline > 0 and straggler_policy != "wait" else math.inf
        self.min_replies = min_replies
        self.now = float(start)
        self.busy_until: dict[int, float] = dict(busy or {})  # client -> when its last late job ends
        self.records: dict[int, dict[str, Any]] = {}  # round -> what the round's row keeps

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        raise NotImplementedError("VirtualClockGrid times rounds through send_and_receive only")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        timed = [m for m in messages if self._timed(m)]
        if not timed:
            return self.grid.send_and_receive(messages, timeout=timeout)
        rnd = server_round_of(timed[0].content)
        assert rnd is not None
        t0 = self.now
        plan = self._plan(timed, rnd, t0)
        keep = [m for m in messages if id(m) not in plan["undelivered"]]
        replies = list(self.grid.send_and_receive(keep, timeout=timeout)) if keep else []
        return self._close(rnd, t0, plan, timed, replies)

    def _timed(self, m: Message) -> bool:
        if m.metadata.message_type != MessageType.TRAIN or server_round_of(m.content) is None:
            return False
        if any(r.get(IGNORE_AVAILABILITY, False) for r in m.content.config_records.values()):
            return False
        return m.metadata.dst_node_id in self.client_of_node

    def _plan(self, timed: list[Message], rnd: int, t0: float) -> dict[str, Any]:
        """Who is off, who is lost before training, each delivered client's job time and arrival:
        each job's fate is :func:`virtualtime.jobs.job_fate`'s, this grid only acts on it."""
        undelivered: set[int] = set()  # id() of the messages not delivered
        on_now = self.scheduled(rnd - 1) if self.scheduled is not None else None
        off: list[int] = []
        lost: list[int] = []
        job: dict[int, float] = {}
        arrival: dict[int, float] = {}
        back: list[float] = []  # when an absent client is online again
        partial = self.policy == "partial"
        for m in timed:
            c = self.client_of_node[m.metadata.dst_node_id]
            if on_now is not None and not (0 <= c < len(on_now) and on_now[c]):
                continue  # off in the schedule: the availability gate decides what it gets
            fate = job_fate(self.clock, c, t0, self.steps_for(c, rnd - 1), free_at=self.busy_until.get(c),
                            deadline=self.deadline, partial=partial, min_steps=self.min_steps)
            if fate.cut:
                self._budget(m, fate.steps)
            if fate.off or not fate.trained:
                (off if fate.off else lost).append(c)
                undelivered.add(id(m))
                back.append(back_online(self.clock, c, t0))
                continue
            job[c] = fate.start - t0 + fate.seconds
            if fate.lost:
                lost.append(c)  # trained; the reply is lost on the way
                back.append(back_online(self.clock, c, t0))
            else:
                arrival[c] = fate.arrival
        return {"undelivered": undelivered, "off": off, "lost": lost, "job": job, "arrival": arrival,
                "back": back}

    @staticmethod
    def _budget(m: Message, steps: int) -> None:
        """A cut job's message carries its budget (``max-local-steps``), in a copy of its content
        (the strategy sends one content to every node)."""
        content = RecordDict(dict(m.content.items()))
        for name, record in m.content.config_records.items():
            if SERVER_ROUND in record:
                content[name] = ConfigRecord({**dict(record.items()), MAX_LOCAL_STEPS: steps})
        m.content = content

    def _close(self, rnd: int, t0: float, plan: Mapping[str, Any], timed: list[Message],
               replies: list[Message]) -> list[Message]:
        node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in timed if m.metadata.message_id}
        sent_nodes = {m.metadata.dst_node_id for m in timed}
        arrival: dict[int, float] = plan["arrival"]
        came: dict[int, float] = {}  # client -> arrival, for the replies that did come (not errors)
        client_of_reply: list[int | None] = []
        for reply in replies:
            node = node_of.get(reply.metadata.reply_to_message_id)
            if node is None and reply.metadata.src_node_id in sent_nodes:
                node = reply.metadata.src_node_id
            c = self.client_of_node.get(node) if node is not None else None
            if c is not None and c in arrival and not reply.has_error():
                came[c] = arrival[c]
                client_of_reply.append(c)
            else:
                client_of_reply.append(None if c is None or c not in plan["job"] else c)
        close = barrier_close(t0, came, deadline=self.deadline, min_replies=self.min_replies,
                              none_lost=not plan["lost"], back=plan["back"])
        late = sorted(c for c, t in came.items() if t > close)
        self.busy_until.update({c: came[c] for c in late})
        kept = [r for r, c in zip(replies, client_of_reply, strict=True)
                if c is None or (c in came and came[c] <= close)]
        self.now = max(close, t0)
        self.records[rnd] = {
            "virtual-time": round(self.now, 6),
            "virtual-round-time": round(self.now - t0, 6),
            "late": late,
            "lost": sorted(plan["lost"]),
            "session-off": sorted(plan["off"]),
            "client-virtual-time": {str(c): round(t, 6) for c, t in sorted(plan["job"].items())},
        }
        return kept

    def round_record(self, rnd: int) -> dict[str, Any]:
        """What round ``rnd``'s metrics row keeps (``virtual-time`` ...). A round without timed
        messages (nobody online, so nobody addressed, as in a deployment; an oracle round) takes
        no virtual time and has nobody late, lost or off."""
        return self.records.pop(rnd, None) or {"virtual-time": round(self.now, 6), "virtual-round-time": 0.0,
                                               "late": [], "lost": [], "session-off": [], "client-virtual-time": {}}


def build_clock(devices: str, num_clients: int, *, seed: int, reference_step_ms: float,
                model_bytes: int) -> VirtualClock:
    """The run's clock from run config ``devices`` (a path; relative to the ServerApp's working
    folder), ConfigError naming the key for any problem with the file."""
    try:
        plan = read_profiles(devices, num_clients, seed=seed, reference_step_ms=reference_step_ms or None)
        return VirtualClock(plan, model_bytes=model_bytes, seed=seed)
    except ProfileError as err:
        raise ConfigError(f"run config 'devices' = {devices!r}: {err}") from err


def last_virtual_time(rows: Iterable[Mapping[str, Any]]) -> float:
    """Where a resumed run's clock starts: the last recorded ``virtual-time`` (0 without one)."""
    times = [float(r["virtual-time"]) for r in rows if "virtual-time" in r]
    return times[-1] if times else 0.0


def busy_after(rows: Iterable[Mapping[str, Any]]) -> dict[int, float]:
    """Where a resumed run's devices stand: client -> when its last late job ends (the round's
    start T = virtual-time - virtual-round-time, plus its client-virtual-time), as the grid of the
    uninterrupted run holds it in ``busy_until``."""
    busy: dict[int, float] = {}
    for row in rows:
        if "late" not in row or "virtual-round-time" not in row:
            continue
        t0 = float(row["virtual-time"]) - float(row["virtual-round-time"])
        times = row.get("client-virtual-time", {})
        busy.update({int(c): t0 + float(times[str(c)]) for c in row["late"] if str(c) in times})
    return busy
