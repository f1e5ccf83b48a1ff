"""Sessions that end mid-round, for the drop-in's grid: when a node leaves its round, by stage.

:class:`SessionStages` times the rounds of a Flower app on the virtual clock (device profiles with
``session_on_s`` / ``session_off_s``, :class:`virtualtime.VirtualClock`) and says, per (round,
client), the first SecAgg+ stage the client's node is gone by, as ``with_availability``'s
``departures`` does by hand. Round r (1-based; schedule round r - 1) starts at virtual time T_r
(T_1 = 0). For a client the schedule has online in round r, with ``job`` its job time for
``local_steps`` steps (:meth:`~virtualtime.VirtualClock.job_time`: download, overhead, compute,
upload) and E the end of its session at T_r (:meth:`~virtualtime.VirtualClock.online_until`):

- offline at T_r (between sessions): gone by ``setup``: not listed, as a node that is not
  connected (status ``off`` of :mod:`server_app.clockgrid`);
- E < T_r + job total: gone by ``collect_masked_vectors``, the stage that trains: its masked
  vector (or plain training reply) never comes; SecAgg+ recovers its masks from the shares;
- E < end of the round: gone by ``unmask``: its vector counts, it sends no shares;
- else: it stays.

The key exchange (``setup``, ``share_keys``) takes no virtual time (a few small messages, next to
a model's download and training), so no session ends between it and the training. The round ends
when its slowest online client's job is in (a barrier without deadline, as
:mod:`server_app.clockgrid` with no ``virtual-deadline``); a round with nobody online ends when
the first scheduled client is online again (:func:`virtualtime.jobs.back_online`'s rule). A
client whose session ends during its upload is counted gone before the training stage (its reply
never comes), where the project's own loop lets it train and loses the reply: the drop-in cannot
make a foreign ClientApp train without replying.
"""

from __future__ import annotations

import math

import numpy as np
from flwr.common.secure_aggregation.secaggplus_constants import Stage

from availability import Schedule
from virtualtime import VirtualClock

GONE_BY_START, GONE_BY_TRAINING, GONE_BY_UNMASK = Stage.SETUP, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK


class SessionStages:
    """``departures`` from the clock's sessions (see the module): :meth:`get` ``(round, client)``
    -> the stage the client is gone by, or None."""

    def __init__(self, clock: VirtualClock, schedule: Schedule, local_steps: int = 1) -> None:
        if clock.num_clients != schedule.num_clients:
            raise ValueError(f"the clock has {clock.num_clients} clients and the schedule {schedule.num_clients}: "
                             f"build both for the same N")
        if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 0:
            raise ValueError(f"local_steps must be an integer >= 0 (the steps one job runs), got {local_steps!r}")
        self.clock, self.schedule, self.local_steps = clock, schedule, local_steps
        self.starts: list[float] = [0.0]  # starts[r - 1] = T_r
        self.rounds: dict[int, dict[int, str | None]] = {}  # round -> client -> gone-by stage
        self.closes: dict[int, float] = {}  # round -> when its last staying client's job is in

    def start(self, rnd: int) -> float:
        """T_rnd, the virtual time round ``rnd`` (1-based) starts."""
        while len(self.starts) < rnd:
            self.starts.append(self._end(len(self.starts)))
        return self.starts[rnd - 1]

    def get(self, key: tuple[int, int], default: str | None = None) -> str | None:
        """The stage client ``key[1]`` is gone by in round ``key[0]`` (``default``: it stays)."""
        rnd, client = key
        stage = self._round(rnd).get(client) if rnd >= 1 else None
        return default if stage is None else stage

    def _round(self, rnd: int) -> dict[int, str | None]:
        if rnd not in self.rounds:
            t0 = self.start(rnd)
            on = np.flatnonzero(self.schedule.available(rnd - 1))
            jobs = {int(c): self.clock.job_time(int(c), self.local_steps).total for c in on}
            until = {c: self.clock.online_until(c, t0) for c in jobs}
            staying = [jobs[c] for c in jobs if until[c] > t0 and until[c] >= t0 + jobs[c]]
            close = self.closes[rnd] = t0 + max(staying, default=0.0)
            self.rounds[rnd] = {c: (GONE_BY_START if until[c] <= t0 else GONE_BY_TRAINING if until[c] < t0 + jobs[c]
                                    else GONE_BY_UNMASK if until[c] < close else None) for c in jobs}
        return self.rounds[rnd]

    def _end(self, rnd: int) -> float:
        """When round ``rnd`` ends: its slowest staying client's job is in; with none, when the first
        of its scheduled clients is online again (T_rnd when none ever is)."""
        row = self._round(rnd)
        t0 = self.starts[rnd - 1]
        if any(stage in (None, GONE_BY_UNMASK) for stage in row.values()):
            return self.closes[rnd]
        on = np.flatnonzero(self.schedule.available(rnd - 1))
        back = [self.clock.next_online(int(c), self.clock.online_until(int(c), t0)) for c in on]
        first = min(back, default=math.inf)
        return first if math.isfinite(first) and first > t0 else t0
