"""The churn driver: stop and start SuperNode processes so that the connected nodes follow the
availability schedule, in rounds (any spec) or in wall-clock seconds (``trace-intervals``).

Round mode (:class:`RoundChurn`)
--------------------------------
It follows the server through ``<run dir>/metrics.jsonl``: when round t's line appears, the
server is about to start round t + 1. In Flower round r (1-based; schedule round r - 1) the
connected nodes should be exactly {i : A(i, r - 1) = 1}, built from the same spec,
``schedule-seed`` and label distributions as the simulation (:func:`availability.schedule_for`).

Timing semantics. Write L_t for the moment line t is written (L_0: ``config.json`` appears,
just before the server waits for ``min-nodes``) and D for the ServerApp's ``round-start-delay``
(0 until the server has that key). Round r's TRAIN messages go to the nodes connected at
S_r = L_{r-1} + D; a node that registers later is not addressed in round r, a node that
leaves after S_r still gets a message (its reply is an error or never comes).

- Stops happen at L_{r-1} for the nodes off in r. ``term`` (SIGTERM, ``docker stop``): the node
  deactivates at once and the SuperLink answers its pending messages with NODE_UNAVAILABLE, so
  even with D = 0 it only costs an error reply (a ClientApp needs seconds to start, so it cannot
  reply in between). ``kill`` (SIGKILL of the node's whole tree, a crash): the SuperLink still
  lists the node until its heartbeat expires (30 s x 2), every round in between waits its full
  ``round-timeout`` for that node, then gets NODE_UNAVAILABLE; the run still ends.
- Starts are the slow part: a SuperNode needs ~2 s (idle machine) to ~6 s (loaded 2-core box) to
  register. ``lookahead`` (default): the nodes that come on in round r are started during round
  r - 1, at S_{r-1} + ``margin``, i.e. after round r - 1's messages went out, so they are
  connected but unaddressed until S_r. They are in time when round r - 1 lasts longer than a
  node start (a round lasts at least one ClientApp start, several seconds; an empty round
  lasts ~0 s, so nodes after an empty round come late unless D covers a start). Caveat: a
  look-ahead node is connected during the end of round r - 1, so round r - 1's federated
  evaluation / round-end broadcast (messages addressed to *all connected* nodes after training)
  reach it; use ``lookahead=False`` with D >= a node's start time to be exact there.
  Without lookahead, nodes are started at L_{r-1} and the driver waits up to D for them.
  Nodes that can (``deploy.nodes.BootsAhead``: processes) are *booted* at S_r when they come on in
  r + 1 or r + 2 (:mod:`deploy.boot`: imports done, not connected), so a start is a registration.
- Round-start signal (``signal_dir``; the launcher's default): instead of a fixed D, the
  server waits before round r until the driver has written ``<signal_dir>/round-<r>``, at most
  D (``round-start-signal`` / ``round-start-delay`` in the run config). The driver writes it as
  soon as every node on in round r is registered (and the nodes off in r have left), so a round
  waits exactly for its devices; a node still not registered at the bound is late. S_r is then
  the signal's time, and the look-ahead starts count from it, so they stay out of round r - 1.
- A node that is not registered at S_r is reported "late" (``self.late``); its reply for round r
  is missing. :attr:`missed` lists every (round, client) that the schedule has on but that the
  deployment could not serve (late, crashed), so a reference simulation can drop exactly those.
- Crashes on purpose: ``crashes={r: [(client, seconds_after_S_r[, "kill"|"term"]), ...]}``
  SIGKILLs (default; a power cut) or SIGTERMs a node in the middle of round r; the schedule
  decides when it comes back.

After the run (:func:`deploy.participation.participation_report`): every recorded round's participants are compared
with the schedule. A difference is within the timing slack when it has a reason: the node was
late or taken down on purpose (:meth:`RoundChurn.explained`), or its reply was rejected (the
round's ``rejected`` list). Anything else (a client on in the schedule with no reply and no
reason, a client that took part while off) fails the run, naming rounds and clients.

A restarted SuperNode gets a new Flower node id (ephemeral identity); strategies key their
state by the ``client-id`` the ClientApp reports (its ``partition-id``), so nothing else is
needed (``tests/test_deploy.py`` checks that).

Wall-clock mode (:class:`WallClockChurn`)
-----------------------------------------
For ``trace-intervals`` specs: client i is connected while the elapsed time (x ``speedup``) mod
the trace's period lies in one of its on-intervals, independent of rounds; the server just
trains whoever is connected when a round starts.

Asynchronous rules (FedBuff, FedAsync) have no rounds: :class:`deploy.async_churn.AggregationChurn`
follows their aggregations the same way (no look-ahead, no signal, empty rounds passed over).

One interface (:class:`ChurnDriver`): the run loop hands every driver the same typed events
(:mod:`deploy.follow`: ``Submitted``, ``RunStarted``, ``RoundFinished``, ``Tick``, ``RunDone``)
through ``on_event``, from its own loop: single-threaded on purpose. Round mode acts on the
start and the round lines, wall-clock mode on the submission and the ticks.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from availability import Schedule, read_trace_intervals
from availability.traces import TraceIntervals

from .errors import DeployError
from .follow import Event, RoundFinished, RunDone, RunStarted, Submitted, Tick
from .nodes import MODES, BootsAhead, Nodes

#: a crash on purpose: (client, seconds after the round's start[, "kill" (default) | "term"])
Crash = tuple[int, float] | tuple[int, float, str]


class ChurnDriver(Protocol):
    """What the run loop needs of a churn driver (:class:`RoundChurn`, :class:`WallClockChurn`)."""

    events: list[dict[str, Any]]  # what it did: {"t", "action", "client", ...}

    @property
    def min_nodes(self) -> int:
        """The nodes up when the run starts (the run config's ``min-nodes``)."""
        ...

    def prepare(self, timeout: float | None = None) -> None:
        """Put the first round's nodes in place, registered, before ``flwr run``."""

    def on_event(self, event: Event) -> None:
        """Act on one event of the run (see :mod:`deploy.follow`)."""


class RoundChurn:
    """Round-following churn driver (see the module docstring for the timing semantics)."""

    def __init__(
        self,
        nodes: Nodes,
        schedule: Schedule,
        num_rounds: int,
        *,
        mode: str = "term",
        grace: float = 0.0,
        lookahead: bool = True,
        margin: float = 1.0,
        signal_dir: str | Path | None = None,
        crashes: Mapping[int, list[Crash]] | None = None,
        log: Callable[[str], None] | None = None,
        start_round: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"churn mode must be one of {MODES}, not {mode!r}")
        if schedule.num_clients != nodes.num_nodes:
            raise DeployError(f"schedule has {schedule.num_clients} clients, deployment {nodes.num_nodes} nodes")
        self.nodes = nodes
        self.schedule = schedule
        self.num_rounds = num_rounds
        self.start_round = int(start_round)  # a resumed run starts at its checkpoint's round + 1
        self.mode = mode
        self.grace = float(grace)
        self.lookahead = lookahead
        self.margin = float(margin)
        # round-start signal: the server starts round r when <signal_dir>/round-<r> exists (or after
        # its round-start-delay, the bound): the driver writes it once r's nodes are registered
        self.signal_dir = Path(signal_dir) if signal_dir is not None else None
        if self.signal_dir is not None:
            self.signal_dir.mkdir(parents=True, exist_ok=True)
        self.crashes = {int(r): list(v) for r, v in (crashes or {}).items()}
        self.log = log or nodes.log
        self.matrix = schedule.matrix(num_rounds).astype(bool)  # (R, N), row t = schedule round t
        self.timers: list[tuple[float, str, int, int]] = []  # (when, action, round, client)
        self.round = 0  # the server round in progress (0: not started)
        self.late: dict[int, list[int]] = {}
        # round -> {client: incarnation} up at the round's start / still up when it ended
        self.up_at_start: dict[int, dict[int, int]] = {}
        self.up_at_end: dict[int, dict[int, int]] = {}
        self.crashed: dict[int, list[int]] = {}
        self.cut_off: dict[int, dict[int, str]] = {}  # round -> client the schedule has on -> its host's outage
        self.events: list[dict[str, Any]] = []
        self.started_at: float | None = None  # the server's start (RunStarted)
        self.done = False
        if not self.on(self.start_round):
            raise DeployError(f"the schedule has nobody online in round {self.start_round}; min-nodes cannot "
                              "express that (0 means num-clients): choose another schedule-seed or trace")

    def on(self, r: int) -> set[int]:
        """Clients online in Flower round r (1-based)."""
        if not 1 <= r <= self.num_rounds:
            return set()
        return {int(i) for i in np.flatnonzero(self.matrix[r - 1])}

    @property
    def min_nodes(self) -> int:
        return len(self.on(self.start_round))

    @property
    def missed(self) -> set[tuple[int, int]]:
        """(round, client) pairs the schedule has on but the deployment did not serve."""
        out = {(r, c) for r, cs in self.late.items() for c in cs}
        return out | {(r, c) for r, cs in self.crashed.items() for c in cs}

    def _event(self, action: str, r: int, client: int, **extra: Any) -> None:
        self.events.append({"t": time.monotonic(), "action": action, "round": r, "client": client, **extra})

    def _up(self) -> dict[int, int]:
        return {i: self.nodes.incarnation(i) for i in self.nodes.running_nodes()}

    def diagnose(self, r: int, client: int) -> str | None:
        """What the driver saw of a miss it cannot explain: the node stayed up through round r
        (a slow client: no reply within round-timeout) or went down without being told to."""
        start, end = self.up_at_start.get(r), self.up_at_end.get(r)
        if start is None or end is None or client not in start:
            return None
        if end.get(client) == start[client]:
            return "its node stayed up through the round but gave no valid reply within round-timeout"
        return "its node went down during the round although the driver did not stop it"

    def explained(self) -> dict[tuple[int, int], str]:
        """(round, client) -> why a client the schedule has on could not take part, for the
        misses the timing semantics allow: late nodes and nodes taken down on purpose."""
        out = {(r, c): "late: not registered when the round started" for r, cs in self.late.items() for c in cs}
        for e in self.events:
            if e["action"] in ("crash", "term"):
                how = "SIGKILL" if e["action"] == "crash" else "SIGTERM"
                out[e["round"], e["client"]] = f"taken down mid-round ({how}, asked for)"
        out.update({(r, c): why for r, cs in self.cut_off.items() for c, why in cs.items()})
        return out

    def _note_cut_off(self, r: int) -> None:
        """Round r's clients whose host did not answer now or since the last look (a named cause)."""
        if not 1 <= r <= self.num_rounds:
            return
        want = self.on(r)
        for c, why in self.nodes.unreachable().items():
            if c in want and c not in self.cut_off.setdefault(r, {}):
                self.cut_off[r][c] = why  # a cause for its miss, if it misses
                self.log(f"round {r}: client {c}'s reply may be lost: {why}")

    def prepare(self, timeout: float | None = None) -> None:
        """Stop the nodes that are off in the first round, start its nodes and wait until they are
        registered (before ``flwr run``)."""
        first = self.on(self.start_round)
        for i in sorted(self.nodes.running_nodes() - first):
            self.nodes.stop_node(i, "term")
        for i in sorted(first):
            self.nodes.start_node(i)
            self._event("start", self.start_round, i)
        for i in sorted(first):
            self.nodes.wait_registered(i, timeout)

    def on_event(self, event: Event) -> None:
        """The server's start begins round ``start_round``; round t's line begins round t + 1 (the
        last ends the driving); a tick fires the due timers (look-ahead starts, crashes)."""
        if self.done:
            return
        if isinstance(event, RunStarted):
            self.started_at = event.t
            self._begin(self.start_round, event.t)
        elif isinstance(event, RoundFinished):
            self._note_cut_off(event.round)
            self.up_at_end[event.round] = self._up()
            if event.round >= self.num_rounds:
                self.done = True
                self.timers.clear()
                return
            self._begin(event.round + 1, event.t)
        elif isinstance(event, Tick):
            self._note_cut_off(self.round)
            self._fire(event.t)
        elif isinstance(event, RunDone):
            self.done = True

    def _fire(self, now: float) -> None:
        due = [t for t in self.timers if t[0] <= now]
        self.timers = [t for t in self.timers if t[0] > now]
        for _, action, r, client in sorted(due):
            if action == "lookahead" and r == self.round + 1 and client not in self.nodes.running_nodes():
                self.nodes.start_node(client)
                self._event("start", r, client, lookahead=True)
            elif action in ("crash", "term") and r == self.round and client in self.nodes.running_nodes():
                self._crash(r, client, action)

    def _crash(self, r: int, client: int, action: str) -> None:
        """A crash on purpose (``crash``: SIGKILL, ``term``: SIGTERM) of ``client`` in round r."""
        mode = "kill" if action == "crash" else "term"
        self.log(f"round {r}: taking node {client} down mid-round ({mode})")
        self.nodes.stop_node(client, mode)
        self.crashed.setdefault(r, []).append(client)
        self._event(action, r, client)

    def _begin(self, r: int, at: float) -> None:
        """The server finished round r - 1 at ``at`` and starts round r at ``at`` + grace, or, with
        a ``signal_dir``, as soon as round r's nodes are registered (at most ``at`` + grace)."""
        self.round = r
        want = self.on(r)
        up = self.nodes.running_nodes()
        leaving = sorted(up - want)
        if self.mode == "term":  # all leave at once; waiting for each exit comes after the check below
            for i in leaving:
                self.nodes.signal_node(i, signal.SIGTERM)
        missing = sorted(want - up)
        for i in missing:  # not started ahead (no lookahead, a crash, or a node that died)
            self.nodes.start_node(i)
            self._event("start", r, i, lookahead=False)
        # the server starts the round at + grace, or (signal_dir) on our signal, at most then: signal once all are in
        deadline = at + max(0.0, self.grace - (0.3 if self.signal_dir is None else 0.5))
        while time.monotonic() < deadline and any(self.nodes.registered_id(i) is None for i in want):
            time.sleep(0.05)
        late = sorted(i for i in want if self.nodes.registered_id(i) is None)
        self._note_cut_off(r)
        self.up_at_start[r] = {i: n for i, n in self._up().items() if i in want and i not in late}
        if late:
            self.late[r] = late
            self.log(f"round {r}: node(s) {late} not registered when the round started: they miss it")
        for i in leaving:  # (SIGTERMed above: gone from the SuperLink's node list by now)
            self.nodes.stop_node(i, self.mode)
            self._event("stop", r, i, mode=self.mode)
        if self.signal_dir is not None:
            (self.signal_dir / f"round-{r}").touch()
            at = time.monotonic() - self.grace  # the round starts now: timers below count from here
        self._arm_crashes(r, want, at + self.grace)
        if self.lookahead and r < self.num_rounds:  # round r + 1's returning nodes, once r's messages went out
            when = at + self.grace + self.margin
            for i in sorted(self.on(r + 1) - want):
                self.timers.append((when, "lookahead", r + 1, i))
            if isinstance(self.nodes, BootsAhead):  # rounds r + 1's and r + 2's, booted now (deploy.boot)
                ahead = self.on(r + 1) | (self.on(r + 2) if r + 2 <= self.num_rounds else set())
                for i in sorted(ahead - want):
                    self.nodes.boot_node(i)

    def _arm_crashes(self, r: int, want: set[int], start: float) -> None:
        """The crashes on purpose of round r (``crashes``), timed from its start."""
        for crash in self.crashes.get(r, []):
            client, after = crash[0], crash[1]
            how = crash[2] if len(crash) > 2 else "kill"
            if client in want:
                self.timers.append((start + after, "crash" if how == "kill" else "term", r, client))

    def expected(self) -> np.ndarray:
        """The participation the deployment should realise: the schedule minus :attr:`missed`."""
        m = self.matrix.copy()
        for r, c in self.missed:
            m[r - 1, c] = False
        return m


class WallClockChurn:
    """Wall-clock churn for ``trace-intervals`` schedules: node i is up while
    (elapsed x speedup) mod period is inside one of its intervals."""

    def __init__(self, nodes: Nodes, schedule: Schedule, *, mode: str = "term",
                 speedup: float = 1.0, log: Callable[[str], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"churn mode must be one of {MODES}, not {mode!r}")
        if not isinstance(schedule, TraceIntervals):
            raise DeployError(f"wall-clock churn needs a trace-intervals schedule, not {schedule.name!r}")
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.nodes = nodes
        self.mode = mode
        self.speedup = float(speedup)
        self.log = log or nodes.log
        self.period, self.intervals = read_trace_intervals(schedule.path, schedule.num_clients)
        self.t0: float | None = None
        self.events: list[dict[str, Any]] = []
        self.done = False

    def on_at(self, seconds: float) -> set[int]:
        tau = seconds % self.period
        return {i for i, iv in enumerate(self.intervals)
                if np.any((tau - iv[:, 0]) % self.period < iv[:, 1] - iv[:, 0])}

    @property
    def min_nodes(self) -> int:
        n = len(self.on_at(0.0))
        if n == 0:
            raise DeployError("the trace has nobody online at time 0; min-nodes cannot express that")
        return n

    def prepare(self, timeout: float | None = None) -> None:
        for i in sorted(self.on_at(0.0)):
            self.nodes.start_node(i)
        for i in sorted(self.on_at(0.0)):
            self.nodes.wait_registered(i, timeout)

    def on_event(self, event: Event) -> None:
        """The clock starts at the submission; every tick puts the nodes where the trace has
        them; the run's end stops the driving."""
        if isinstance(event, Submitted):
            self.t0 = event.t
        elif isinstance(event, RunDone):
            self.done = True
        elif isinstance(event, Tick) and self.t0 is not None and not self.done:
            self._follow_trace((event.t - self.t0) * self.speedup)

    def _follow_trace(self, elapsed: float) -> None:
        want = self.on_at(elapsed)
        running = self.nodes.running_nodes()
        for i in sorted(running - want):
            self.nodes.stop_node(i, self.mode)
            self.events.append({"t": elapsed, "action": "stop", "client": i})
        for i in sorted(want - running):
            self.nodes.start_node(i)
            self.events.append({"t": elapsed, "action": "start", "client": i})
