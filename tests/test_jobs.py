"""One job's fate (virtualtime/jobs.py): off, lost before training, lost on the way back, on time,
late, cut to the steps that fit, started late on a busy device, lost to a schedule slot; and that
the loops decide none of it themselves. Times are dyadic, so the sums are exact."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from virtualtime import JobTime, VirtualClock, parse_profiles
from virtualtime.barrier import barrier_close
from virtualtime.jobs import back_online, job_fate

ROOT = Path(__file__).resolve().parents[1]


def clock() -> VirtualClock:
    plan = parse_profiles({
        "a": {"clients": [0], "step_ms": 1000, "session_on_s": 10, "session_off_s": 10, "session_model": "periodic"},
        "b": {"clients": [1], "step_ms": 500, "rtt_ms": 250, "session_on_s": 10, "session_off_s": 10,
              "session_model": "periodic"},
        "c": {"clients": [2], "step_ms": 250, "overhead_ms": 500},
    }, 3)
    return VirtualClock(plan, model_bytes=0, seed=0)


def test_a_job_arrives_at_its_start_plus_its_time_and_is_late_only_after_the_close():
    fate = job_fate(clock(), 1, 0.0, 4)  # 0.25 down + 4 x 0.5 + 0.25 up
    assert (fate.off, fate.trained, fate.lost, fate.cut, fate.steps, fate.arrival) == (False, True, False, False, 4, 2.5)
    assert fate.late(2.0) and not fate.late(2.5)


def test_a_session_that_ends_before_training_or_during_the_upload_loses_the_job():
    c = clock()
    edge = job_fate(c, 0, 7.0, 3)  # ends exactly when the session does: it arrives
    assert not edge.lost and edge.arrival == 10.0
    never = job_fate(c, 0, 7.0, 4)  # training would end at 11, the session at 10
    assert (never.trained, never.lost) == (False, True)
    assert back_online(c, 0, 7.0) == 20.0
    upload = job_fate(c, 1, 7.75, 4)  # trained at 10.0, the reply would arrive at 10.25
    assert (upload.trained, upload.lost) == (True, True)
    assert not upload.late(math.inf)  # a lost reply is never late: it never comes
    off = job_fate(c, 0, 12.0, 1)
    assert (off.off, off.trained, off.lost) == (True, False, True)
    assert back_online(c, 0, 12.0) == 20.0


def test_a_busy_device_starts_the_job_when_its_earlier_job_ends():
    fate = job_fate(clock(), 2, 1.0, 2, free_at=3.0)  # 0.5 overhead + 2 x 0.25
    assert (fate.start, fate.arrival) == (3.0, 4.0)
    assert job_fate(clock(), 2, 1.0, 2, free_at=0.5).start == 1.0


def test_partial_cuts_a_job_to_the_steps_that_fit_at_least_min_steps():
    c = clock()
    full = job_fate(c, 2, 0.0, 8, deadline=1.5)  # drop: all 8 steps, arrives at 2.5
    assert (full.cut, full.steps, full.arrival) == (False, 8, 2.5)
    cut = job_fate(c, 2, 0.0, 8, deadline=1.5, partial=True)  # floor((1.5 - 0.5) / 0.25) = 4
    assert (cut.cut, cut.steps, cut.arrival, cut.late(1.5)) == (True, 4, 1.5, False)
    waited = job_fate(c, 2, 0.0, 8, free_at=0.75, deadline=1.5, partial=True, min_steps=2)  # 1 fits, 2 asked
    assert (waited.cut, waited.steps, waited.arrival, waited.late(1.5)) == (True, 2, 1.75, True)
    assert job_fate(c, 2, 0.0, 3, deadline=1.5, partial=True).cut is False  # 3 steps fit whole


class Slots:
    """Client 0 on in slots 0, 1, 3, ...; off in slot 2. Client 1 always on."""

    def available(self, t: int) -> np.ndarray:
        return np.array([t != 2, True])


def test_the_steps_only_clock_times_steps_and_loses_a_job_to_an_off_schedule_slot():
    c = VirtualClock.steps_only(2, Slots(), slot_seconds=2.0)
    assert c.job_time(0, 3) == JobTime(0.0, 3.0, 0.0)
    assert not job_fate(c, 0, 1.0, 3).lost  # arrives at 4.0, slot 2's start: not inside the job
    lost = job_fate(c, 0, 1.0, 4)  # slot 2 starts at 4.0 < 5.0
    assert lost.lost and back_online(c, 0, 1.0) == 6.0
    assert not job_fate(c, 1, 1.0, 4).lost
    assert c.next_online(0, 4.5) == 6.0 and c.next_online(1, 4.5) == 4.5


def test_no_loop_decides_a_jobs_fate_itself():
    """The synchronous grid and the asynchronous loop call job_fate; neither reads sessions or
    cuts steps on its own (the copies that were there went)."""
    for name in ("clockgrid.py", "asynchronous.py", "async_clock.py", "async_realtime.py", "experiment.py"):
        text = (ROOT / "server_app" / name).read_text()
        assert ".session(" not in text and "steps_that_fit(" not in text and "online_until(" not in text, name
    for name in ("clockgrid.py", "asynchronous.py"):
        assert "job_fate(" in (ROOT / "server_app" / name).read_text(), name


def test_the_barrier_closes_at_the_deadline_the_kth_arrival_or_the_last_one():
    arrivals = {0: 3.0, 1: 1.5, 2: 2.5}
    assert barrier_close(1.0, arrivals, deadline=1.5) == 2.5  # T + deadline; an arrival at it is on time
    assert barrier_close(1.0, arrivals, deadline=1.5, none_lost=False) == 2.5
    assert barrier_close(1.0, arrivals, deadline=4.0) == 3.0  # everyone still coming is in
    assert barrier_close(1.0, arrivals, deadline=4.0, none_lost=False) == 5.0  # a lost client holds it
    assert barrier_close(1.0, arrivals, deadline=4.0, min_replies=2) == 2.5
    assert barrier_close(1.0, arrivals, deadline=0.25, min_replies=2) == 1.25
    assert barrier_close(1.0, arrivals, none_lost=False) == 3.0  # no deadline: the last arrival
    assert barrier_close(1.0, {}, none_lost=False, back=[math.inf, 7.0, 4.0]) == 4.0  # the first back
    assert barrier_close(1.0, {}, back=[math.inf]) == 1.0
