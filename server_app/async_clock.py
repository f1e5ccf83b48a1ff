"""The clock of an asynchronous run in simulation: :func:`clock_for`.

With a devices file (run config ``devices``) it is the run's :class:`virtualtime.VirtualClock`
(profiles, sessions) with the availability schedule in slots of the slowest client's round-1 job.
Without, it is :meth:`virtualtime.VirtualClock.steps_only`: a job of ``s`` local steps takes
``s x STEP_SECONDS`` virtual seconds (no download or upload), and client i is online at time t
when the schedule makes it available in slot ``floor(t / slot_seconds)``, one slot being the
longest client's job at round 0 (one synchronous round with every client in parallel). So with
full availability and equal local steps every client finishes at the same instants, and FedBuff
with K = N aggregates exactly the synchronous rounds. Either way one slot is one schedule round:
a job dispatched at virtual time t is dispatched in schedule round ``floor(t / slot_seconds)``.
"""

from __future__ import annotations

from virtualtime import STEP_SECONDS, VirtualClock

from .setup import Setup


def clock_for(setup: Setup) -> VirtualClock:
    """The run's clock (the module docstring)."""
    wl, n = setup.workload, setup.cfg.workload.num_clients
    steps = [wl.steps_for(c, 0) for c in range(n)]
    base = setup.clock
    if base is None:
        return VirtualClock.steps_only(n, setup.schedule, max(steps) * STEP_SECONDS)
    slot = max(base.job_time(c, s).total for c, s in enumerate(steps)) or 1.0
    return VirtualClock(base.plan, model_bytes=base.model_bytes, seed=base.seed, schedule=setup.schedule,
                        slot_seconds=slot, upload_bytes=base.upload_bytes)

