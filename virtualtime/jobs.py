"""One job's fate on the virtual clock: :func:`job_fate`, the one place that decides it.

A job is one message's work for one client: dispatched at ``dispatch``, started when the device is
free (``free_at``: a device works one job at a time, as a SuperNode handles one message at a
time), then download, overhead, ``steps`` local steps and upload (:class:`~.clock.JobTime`). The
client must stay online (:meth:`~.clock.VirtualClock.online`: in its session and on in the
schedule, at every schedule slot's start) from the dispatch on:

- offline at the dispatch: ``off`` (the message is not delivered; its node would be stopped);
- offline before its local training ends: ``lost`` and not ``trained`` (it never trains);
- offline during its upload: ``lost`` and ``trained`` (its client-side state changed; the reply is lost);
- else its reply arrives at ``arrival`` = start + job seconds, when its device is free again.

Whether an arrival is on time or ``late`` is the policy's call (:meth:`JobFate.late`): the
synchronous barrier closes a round at its deadline or its ``min-replies``-th arrival
(``server_app.clockgrid``), the asynchronous buffer has no close (``server_app.asynchronous``).
A barrier with a deadline may cut a job to the steps that fit (``partial``): k =
floor((dispatch + deadline - start - download - overhead - upload) / step time)
(:meth:`~.clock.VirtualClock.steps_that_fit`), at least ``min_steps``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .clock import VirtualClock


@dataclass(frozen=True)
class JobFate:
    """What becomes of one job (the module docstring); times are virtual seconds."""

    client: int
    start: float  # when its device starts it: the dispatch, or later when still busy
    steps: int  # the local steps it runs
    cut: bool  # fewer steps than asked (partial): the message must carry the budget
    seconds: float  # its time from start to arrival (a cut job that fits: up to the deadline)
    off: bool  # offline at the dispatch: not delivered
    trained: bool  # it runs its local training (delivered, online until training ends)
    lost: bool  # it goes offline before its reply arrives (off jobs count as lost too)

    @property
    def arrival(self) -> float:
        """When the reply arrives and the device is free again (start + seconds)."""
        return self.start + self.seconds

    def late(self, close: float) -> bool:
        """Whether a reply that arrives comes after ``close`` (the barrier's)."""
        return not self.lost and self.arrival > close


def stays_online(clock: VirtualClock, client: int, since: float, until: float) -> bool:
    """Whether ``client``, online at ``since``, is online until ``until``: its session at ``since``
    lasts, and it is on at every schedule slot's start in between. A few checks per job."""
    if clock.session(client, since)[2] < until:
        return False
    slot = clock.slot_seconds
    if slot:
        k = math.floor(since / slot + 1e-9) + 1
        while k * slot < until - 1e-9:
            if not clock.online(client, k * slot):
                return False
            k += 1
    return True


def job_fate(clock: VirtualClock, client: int, dispatch: float, steps: int, *, free_at: float | None = None,
             deadline: float = math.inf, partial: bool = False, min_steps: int = 1) -> JobFate:
    """The fate of ``client``'s job of ``steps`` local steps dispatched at ``dispatch`` (the module
    docstring). ``free_at``: when its device finishes an earlier job (None: free). ``deadline``:
    seconds after ``dispatch`` the policy waits; with ``partial`` a job that would end later runs
    the steps that fit, at least ``min(min_steps, steps)``."""
    if not clock.online(client, dispatch):
        return JobFate(client, dispatch, steps, False, 0.0, True, False, True)
    start = dispatch if free_at is None else max(dispatch, free_at)
    cut = fits = False
    if partial and math.isfinite(deadline):
        fit = clock.steps_that_fit(client, deadline - (start - dispatch))
        if fit is not None and fit < steps:
            budget = max(fit, min(min_steps, steps))
            cut, fits, steps = True, fit >= budget, budget
    jt = clock.job_time(client, steps)
    seconds = min(jt.total, dispatch + deadline - start) if fits else jt.total  # k fits, whatever the float sums
    trained = stays_online(clock, client, dispatch, start + jt.trained)
    lost = not trained or not stays_online(clock, client, dispatch, start + seconds)
    return JobFate(client, start, steps, cut, seconds, False, trained, lost)


def back_online(clock: VirtualClock, client: int, dispatch: float) -> float:
    """When ``client``, whose job dispatched at ``dispatch`` is off or lost, is online again: the
    first time it is online after it goes offline (math.inf: never, within the clock's horizon).
    A barrier with no deadline and no arrival closes its round then."""
    return clock.next_online(client, clock.online_until(client, dispatch))
