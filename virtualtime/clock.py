"""The virtual clock: how long a client's job takes on its device, and when it is online.

A job (one round's work for one client) is, in virtual seconds, in this order::

    download = rtt_ms / 1000 + model_bytes * 8 / (down_kbps * 1000)
    overhead = overhead_ms / 1000                  (the fixed cost of a job on this device)
    compute  = num_steps * step_ms / 1000          (step_ms = reference_step_ms / speed without one)
    upload   = rtt_ms / 1000 + upload_bytes * 8 / (up_kbps * 1000)

A missing bandwidth is unlimited (0 s) and a missing ``rtt_ms`` or ``overhead_ms`` is 0.
``overhead_ms`` is what a device pays per job whatever the model's size and the steps: in a
Flower deployment, the ``flwr-clientapp`` process started for every message, (de)serialisation
and the polls; ``benchmarks/clock_vs_emulation.py`` measures it per device class. ``loss``, ``cpus`` and
``mem_mb`` do not enter the time (a deployment's caps; ``speed`` / ``step_ms`` stand for the
CPU). A client is online at time t when it is in an online session (:mod:`.sessions`) and, with
an availability ``schedule`` and ``slot_seconds``, the schedule has it on in slot
``floor(t / slot_seconds)``.

One clock type serves every run: synchronous rounds with ``devices`` (profiles and sessions, no
schedule: the availability gate applies it per Flower round), the asynchronous loop with
``devices`` (profiles, sessions and the schedule in slots) and the asynchronous loop without
(:meth:`VirtualClock.steps_only`: one device class whose job is ``steps x step seconds``, no
transfers, no sessions, the schedule in slots). What a job's times mean for the job (on time,
late, lost, cut to the steps that fit) is :func:`virtualtime.jobs.job_fate`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .errors import ProfileError
from .profiles import DeviceProfile, ProfilePlan
from .sessions import Sessions

MAX_SLOTS = 100_000  # next_online looks this many schedule slots ahead before it says "never"
CACHED_SLOTS = 512  # schedule slots whose availability the clock keeps (then it starts afresh)
STEP_SECONDS = 1.0  # virtual seconds per local step of a clock without device profiles (steps_only)


class RoundSchedule(Protocol):
    """What the clock needs of an availability schedule (``availability.Schedule``)."""

    def available(self, t: int) -> Any: ...


@dataclass(frozen=True)
class JobTime:
    """One job's virtual seconds: download, compute, upload, and the fixed overhead (after the
    download, before the compute)."""

    download: float
    compute: float
    upload: float
    overhead: float = 0.0

    @property
    def trained(self) -> float:
        """Seconds from the job's start to the end of its local training."""
        return self.download + self.overhead + self.compute

    @property
    def total(self) -> float:
        return self.trained + self.upload


def _transfer(nbytes: int, kbps: int | None) -> float:
    return 0.0 if kbps is None else nbytes * 8 / (kbps * 1000.0)


class VirtualClock:
    """Job times and online periods for the clients of ``plan``, with ``seed`` for the sessions."""

    def __init__(self, plan: ProfilePlan, *, model_bytes: int, seed: int, schedule: RoundSchedule | None = None,
                 slot_seconds: float | None = None, upload_bytes: int | None = None) -> None:
        if model_bytes < 0:
            raise ProfileError(f"model_bytes = {model_bytes} must be >= 0")
        if (schedule is None) != (slot_seconds is None):
            raise ProfileError("an availability schedule needs slot_seconds (the virtual length of one of its "
                               "rounds), and slot_seconds a schedule")
        if slot_seconds is not None and not (math.isfinite(slot_seconds) and slot_seconds > 0):
            raise ProfileError(f"slot_seconds = {slot_seconds!r} must be a number > 0")
        self.plan, self.seed = plan, int(seed)
        self.model_bytes = int(model_bytes)
        self.upload_bytes = self.model_bytes if upload_bytes is None else int(upload_bytes)
        self.schedule, self.slot_seconds = schedule, slot_seconds
        self._slots: dict[int, np.ndarray] = {}  # schedule slot -> who is on (at most CACHED_SLOTS)
        n = plan.num_clients
        # per class, computed once: (download s, upload s, step s, overhead s); per client: its class index
        self._class_index = np.zeros(n, dtype=np.int32)
        self._net: list[tuple[float, float, float, float]] = []
        on = np.full(n, np.inf)
        off = np.zeros(n)
        periodic = np.zeros(n, dtype=bool)
        for i, dc in enumerate(plan.classes):
            rtt = (dc.rtt_ms or 0.0) / 1000.0
            step = dc.step_seconds(plan.reference_step_ms)
            self._net.append((rtt + _transfer(self.model_bytes, dc.down_kbps),
                              rtt + _transfer(self.upload_bytes, dc.up_kbps), step, (dc.overhead_ms or 0.0) / 1000.0))
            ids = np.asarray(dc.clients, dtype=np.int64)
            self._class_index[ids] = i
            if dc.has_sessions:
                on[ids], off[ids] = dc.session_on_s, dc.session_off_s
                periodic[ids] = dc.session_model == "periodic"
        self.sessions = Sessions(on, off, periodic, self.seed)
        self._always_on = not bool(np.any(np.isfinite(on) & (off != 0)))  # no client ever leaves a session

    @classmethod
    def steps_only(cls, num_clients: int, schedule: RoundSchedule, slot_seconds: float,
                   step_seconds: float = STEP_SECONDS) -> VirtualClock:
        """The clock of a run without device profiles: one class for every client whose job takes
        ``num_steps x step_seconds`` (no download, overhead or upload, no sessions), online when
        ``schedule`` has it on in slot ``floor(t / slot_seconds)``."""
        if not (math.isfinite(step_seconds) and step_seconds > 0):
            raise ProfileError(f"step_seconds = {step_seconds!r} must be a number > 0")
        one = DeviceProfile("steps", tuple(range(num_clients)), step_ms=step_seconds * 1000.0)
        return cls(ProfilePlan(num_clients, (one,)), model_bytes=0, seed=0, schedule=schedule,
                   slot_seconds=slot_seconds)

    @property
    def num_clients(self) -> int:
        return self.plan.num_clients

    def job_time(self, client: int, num_steps: int) -> JobTime:
        """Download, ``num_steps`` local steps and upload of ``client``, in virtual seconds."""
        down, up, step, overhead = self._net[self._class_index[client]]
        return JobTime(down, num_steps * step, up, overhead)

    def steps_that_fit(self, client: int, seconds: float) -> int | None:
        """The local steps of ``client`` whose job (download, overhead, the steps, upload) takes at
        most ``seconds``: floor((seconds - download - overhead - upload) / step time), 0 when not
        even the transfers fit; None when a step takes no time (every step fits). A quotient within
        1e-9 of an integer counts as that integer (0.1 s steps in 1.5 s: 15, not 14.999...)."""
        down, up, step, overhead = self._net[self._class_index[client]]
        if step <= 0:
            return None
        return max(0, math.floor((seconds - down - overhead - up) / step + 1e-9))

    def job_times(self, clients: np.ndarray, num_steps: np.ndarray) -> np.ndarray:
        """Total job seconds of many clients at once (vectorised :meth:`job_time`)."""
        table = np.asarray(self._net, dtype=np.float64)
        rows = table[self._class_index[np.asarray(clients, dtype=np.int64)]]
        return rows[:, 0] + rows[:, 3] + np.asarray(num_steps, dtype=np.float64) * rows[:, 2] + rows[:, 1]

    def _slot_of(self, t: float) -> int:
        """The schedule slot that holds ``t``; a time computed as k x ``slot_seconds`` is in slot k
        whatever its rounding (15 x 2.63 = 39.449999999999996, and 39.449999999999996 // 2.63 = 14:
        ``next_online`` stepped to that same time again, 100,000 times, then said "never")."""
        assert self.slot_seconds is not None
        return int(math.floor(t / self.slot_seconds + 1e-9))

    def _scheduled(self, client: int, t: float) -> bool:
        if self.schedule is None or self.slot_seconds is None:
            return True
        return bool(self._on_in(self._slot_of(t))[client])

    def _on_in(self, slot: int) -> np.ndarray:
        """Who the schedule has on in ``slot`` (cached: CACHED_SLOTS slots, then afresh)."""
        assert self.schedule is not None
        on = self._slots.get(slot)
        if on is None:
            if len(self._slots) >= CACHED_SLOTS:
                self._slots.clear()
            on = self._slots[slot] = np.asarray(self.schedule.available(slot), dtype=bool)
        return on

    def online(self, client: int, t: float) -> bool:
        """Whether ``client`` is online at virtual time ``t``: in a session and on in the schedule."""
        return self.session(client, t)[0] and self._scheduled(client, t)

    def session(self, client: int, t: float) -> tuple[bool, float, float]:
        """(online?, start, end) of the session interval of ``client`` that holds ``t`` (no schedule)."""
        return (True, 0.0, math.inf) if self._always_on else self.sessions.interval(client, t)

    def online_until(self, client: int, t: float) -> float:
        """When ``client``, online at ``t``, goes offline (its session ends, or a schedule slot in
        which it is off begins); ``t`` when it is offline at ``t``."""
        on, _, end = self.session(client, t)
        if not on or not self._scheduled(client, t):
            return t
        if self.slot_seconds is None:
            return end
        slot = self._slot_of(t) + 1
        for _ in range(MAX_SLOTS):
            start = slot * self.slot_seconds
            if start >= end:
                return end
            if not self._scheduled(client, start):
                return start
            slot += 1
        return end

    def next_online(self, client: int, t: float) -> float:
        """The first time >= ``t`` at which ``client`` is online; ``math.inf`` if never (within
        ``MAX_SLOTS`` schedule slots, or a session that never comes)."""
        if self._always_on and self.slot_seconds is not None:  # the schedule alone: the next slot it has on
            if self._scheduled(client, t):
                return t
            first = self._slot_of(t) + 1
            for slot in range(first, first + MAX_SLOTS):
                if self._on_in(slot)[client]:
                    return slot * self.slot_seconds
            return math.inf
        for _ in range(MAX_SLOTS):
            on, _, end = self.session(client, t)
            if not on:
                if not math.isfinite(end):
                    return math.inf
                t = end
                continue
            if self._scheduled(client, t):
                return t
            assert self.slot_seconds is not None
            t = (self._slot_of(t) + 1) * self.slot_seconds
        return math.inf
