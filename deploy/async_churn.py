"""The churn driver of an asynchronous run (FedBuff, FedAsync deployed: ``server_app/async_realtime.py``):
:class:`AggregationChurn`.

An asynchronous run has no rounds: the server aggregates whenever its rule says (FedAsync every
arrival, FedBuff every K) and writes one ``metrics.jsonl`` row per aggregation. The driver counts
aggregations as the round driver counts rounds: while the server makes aggregation r (after row
r - 1, until row r), the nodes up are those of schedule round ``slot(r)``, the r-th schedule round
with anyone on. What differs from :class:`deploy.churn.RoundChurn`, and why:

- **Empty schedule rounds are passed over.** No node, no arrival, no row: a driver that stopped
  every node for aggregation r would wait for row r forever (the server gives up after
  ``wait-for-nodes`` with nobody connected). As in the virtual-time loop, where an empty slot passes
  without an aggregation, such a round is skipped (``skipped``; :meth:`slot` maps aggregations to
  schedule rounds).
- **No look-ahead, no waiting, no round-start signal.** The server never waits at a barrier, and
  every connected idle node gets a job at once: a node started early would train while the
  schedule has it off, and a driver that waited for registrations would fall behind the rows. A node
  that comes on for aggregation r is started when row r - 1 appears and takes part once it has
  registered (2-6 s; its first job also starts its worker); meanwhile the others go on.
- **Rows that come together act once.** The driver acts on the tick after the rows of one poll,
  for the newest of them: a node is not started and stopped again within one poll.
- A node that goes off is SIGTERMed (``mode="term"``; SIGKILL with ``"kill"``): its job in flight
  comes back as an error reply or expires after ``round-deadline``, and the server records it as
  lost (the row's ``unavailable-nodes`` and ``lost-nodes``).

``up_during[r]``: the clients whose node ran at some moment while aggregation r was being made (as
the follower saw the rows), the ones whose arrivals row r may hold.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from availability import Schedule

from .errors import DeployError
from .follow import Event, RoundFinished, RunDone, RunStarted, Tick
from .nodes import MODES, Nodes

# how many schedule rounds the driver reads to find one with someone on per aggregation, at most
SEARCH_FACTOR = 16


class AggregationChurn:
    """Aggregation-following churn driver for asynchronous rules (the module docstring)."""

    def __init__(self, nodes: Nodes, schedule: Schedule, num_aggregations: int, *, mode: str = "term",
                 log: Callable[[str], None] | None = None, start_aggregation: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"churn mode must be one of {MODES}, not {mode!r}")
        if schedule.num_clients != nodes.num_nodes:
            raise DeployError(f"schedule has {schedule.num_clients} clients, deployment {nodes.num_nodes} nodes")
        self.nodes, self.mode, self.log = nodes, mode, log or nodes.log
        self.num_aggregations = int(num_aggregations)
        self.start = int(start_aggregation)
        horizon = SEARCH_FACTOR * max(self.num_aggregations, 1)
        matrix = schedule.matrix(horizon).astype(bool)
        slots = [int(t) for t in np.flatnonzero(matrix.any(axis=1))][: self.num_aggregations]
        if len(slots) < self.num_aggregations:
            raise DeployError(
                f"the schedule has someone online in only {len(slots)} of its first {horizon} rounds; an "
                f"asynchronous run of {self.num_aggregations} aggregations needs one such round per aggregation "
                "(each empty round is passed over): choose another schedule or schedule-seed")
        self.slots = slots  # aggregation r (1-based) -> schedule round (0-based)
        self.skipped = sorted(set(range(slots[-1] + 1)) - set(slots))  # empty schedule rounds passed over
        self.matrix = matrix[: slots[-1] + 1]
        self.events: list[dict[str, Any]] = []
        self.up_during: dict[int, set[int]] = {}
        self.aggregation = 0  # the aggregation being made (0: the server has not started)
        self._target = 0  # the aggregation whose nodes the next tick puts in place
        self._seen: set[int] = set()  # nodes up at some moment since the last row
        self.done = False

    def slot(self, r: int) -> int:
        """The schedule round (0-based) whose nodes are up while aggregation r (1-based) is made."""
        return self.slots[r - 1]

    def on(self, r: int) -> set[int]:
        """Clients up while aggregation r (1-based) is made."""
        if not 1 <= r <= self.num_aggregations:
            return set()
        return {int(i) for i in np.flatnonzero(self.matrix[self.slot(r)])}

    @property
    def min_nodes(self) -> int:
        return len(self.on(self.start))

    def prepare(self, timeout: float | None = None) -> None:
        """The first aggregation's nodes up and registered, the others down (before ``flwr run``)."""
        first = self.on(self.start)
        for i in sorted(self.nodes.running_nodes() - first):
            self.nodes.stop_node(i, "term")
        for i in sorted(first - self.nodes.running_nodes()):
            self.nodes.start_node(i)
            self._event("start", self.start, i)
        for i in sorted(first):
            self.nodes.wait_registered(i, timeout)

    def on_event(self, event: Event) -> None:
        """The server's start begins aggregation ``start``; row r begins r + 1 (the last ends the
        driving); the tick after them puts the newest aggregation's nodes in place."""
        if self.done:
            return
        if isinstance(event, RunStarted):
            self.aggregation = self._target = self.start
            self._seen = self.nodes.running_nodes()
        elif isinstance(event, RoundFinished):
            self.up_during[event.round] = self._seen | self.nodes.running_nodes()
            self._seen = self.nodes.running_nodes()
            if event.round >= self.num_aggregations:
                self.done = True
                return
            self._target = event.round + 1
        elif isinstance(event, Tick):
            if self._target > self.aggregation:
                self._put(self._target)
            self._seen |= self.nodes.running_nodes()
        elif isinstance(event, RunDone):
            self.done = True

    def _put(self, r: int) -> None:
        """Nodes off for aggregation r go (all signalled at once), the ones on are started."""
        self.aggregation = r
        want, up = self.on(r), self.nodes.running_nodes()
        leaving = sorted(up - want)
        if self.mode == "term":
            for i in leaving:
                self.nodes.signal_node(i, signal.SIGTERM)
        for i in leaving:
            self.nodes.stop_node(i, self.mode)
            self._event("stop", r, i, mode=self.mode)
        for i in sorted(want - self.nodes.running_nodes()):
            self.nodes.start_node(i)
            self._event("start", r, i)
        if leaving or want - up:
            self.log(f"aggregation {r} (schedule round {self.slot(r) + 1}): nodes up {sorted(want)}")

    def _event(self, action: str, r: int, client: int, **extra: Any) -> None:
        self.events.append({"t": time.monotonic(), "action": action, "round": r, "slot": self.slot(r),
                            "client": client, **extra})

    def took_part_while_off(self, rows: list[dict[str, Any]]) -> dict[int, list[int]]:
        """Row r -> the participants whose node ran neither while aggregation r nor r - 1 was made
        (one aggregation of slack: a reply the server pulled just after the row it came before)."""
        out = {}
        for row in rows:
            r = int(row["round"])
            if r not in self.up_during:
                continue
            allowed = self.up_during[r] | self.up_during.get(r - 1, set())
            extra = sorted(int(c) for c in row["participants"] if int(c) not in allowed)
            if extra:
                out[r] = extra
        return out
