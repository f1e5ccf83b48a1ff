"""The clock of an asynchronous run in simulation: job times and who is online, in virtual seconds.

:func:`clock_for` returns the run's clock. Without device profiles it is :class:`StepClock`: a
job of ``s`` local steps takes ``s`` x ``STEP_SECONDS`` virtual seconds (nothing for download and
upload), and client i is online at time t when the schedule makes it available in slot
``floor(t / slot)``, one slot being the longest client's job at round 0 (one synchronous round
with every client in parallel). So with full availability and equal local steps, every client
finishes at the same instants and FedBuff with K = N aggregates exactly the synchronous rounds.

The clock interface (``online``, ``next_online``, ``job_time``) is the one of the virtual clock
with device profiles (package ``virtualtime``, run config ``devices``), which takes its place
when profiles are given.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from availability import Schedule
from virtualtime import JobTime

STEP_SECONDS = 1.0  # virtual seconds per local step without device profiles
HORIZON_SLOTS = 100_000  # next_online looks this many slots ahead, then gives up (as virtualtime.clock)
CACHED_SLOTS = 512


class Clock(Protocol):
    @property
    def slot_seconds(self) -> float | None: ...  # the virtual length of one schedule round, on every clock

    def online(self, client: int, t: float) -> bool: ...

    def next_online(self, client: int, t: float) -> float: ...

    def job_time(self, client: int, num_steps: int) -> JobTime: ...


class StepClock:
    """Job time = local steps x ``step_seconds``; online = the schedule in slots of ``slot_seconds``."""

    def __init__(self, schedule: Schedule, slot_seconds: float, step_seconds: float = STEP_SECONDS) -> None:
        if not (math.isfinite(slot_seconds) and slot_seconds > 0):
            raise ValueError(f"slot_seconds must be > 0, got {slot_seconds}")
        self.schedule, self.slot_seconds, self.step = schedule, float(slot_seconds), float(step_seconds)
        self._slots: dict[int, np.ndarray] = {}

    def slot_of(self, t: float) -> int:
        return int(math.floor(t / self.slot_seconds + 1e-9))

    def available(self, slot: int) -> np.ndarray:
        if slot not in self._slots:
            if len(self._slots) >= CACHED_SLOTS:
                self._slots.clear()
            self._slots[slot] = self.schedule.available(slot)
        return self._slots[slot]

    def online(self, client: int, t: float) -> bool:
        return bool(self.available(self.slot_of(t))[client])

    def next_online(self, client: int, t: float) -> float:
        """The first time >= t at which ``client`` is online (inf: not within the horizon)."""
        if self.online(client, t):
            return t
        first = self.slot_of(t) + 1
        for slot in range(first, first + HORIZON_SLOTS):
            if self.available(slot)[client]:
                return slot * self.slot_seconds
        return math.inf

    def job_time(self, client: int, num_steps: int) -> JobTime:
        return JobTime(0.0, num_steps * self.step, 0.0)


def completes(clock: Clock, client: int, start: float, end: float) -> bool:
    """Whether ``client``, online at ``start``, stays online until ``end`` (its job's arrival): its
    session (a clock with sessions) lasts, and it is online at every schedule slot's start in
    between. A few checks per job, whatever the horizon."""
    if not clock.online(client, start):
        return False
    session = getattr(clock, "session", None)
    if session is not None and session(client, start)[2] < end:
        return False
    slot = getattr(clock, "slot", None) or getattr(clock, "slot_seconds", None)
    if slot:
        k = math.floor(start / slot + 1e-9) + 1
        while k * slot < end - 1e-9:
            if not clock.online(client, k * slot):
                return False
            k += 1
    return True
