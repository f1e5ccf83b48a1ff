"""The virtual clock's parts (virtualtime/): the devices file's simulation keys and their errors,
job times in closed form, sessions (deterministic, order-free), the event queue's order."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

import virtualtime
from virtualtime import EventQueue, ProfileError, VirtualClock, parse_profiles, read_profiles

EXAMPLE = Path(virtualtime.__file__).parent / "example-devices.toml"


def toy_plan(reference_step_ms=None):
    return parse_profiles({
        "slow": {"clients": [0], "step_ms": 10.0, "down_kbps": 8, "up_kbps": 4, "rtt_ms": 100},
        "fast": {"count": 1, "speed": 2.0, "rtt_ms": 0},
    }, 3, reference_step_ms=reference_step_ms)


def test_job_time_is_download_plus_steps_times_step_plus_upload_in_closed_form():
    clock = VirtualClock(toy_plan(reference_step_ms=4.0), model_bytes=1000, seed=0)
    jt = clock.job_time(0, 5)  # 1000 B = 8 kbit: 1 s at 8 kbit/s, 2 s at 4 kbit/s, + 0.1 s RTT each way
    assert (jt.download, jt.compute, jt.upload) == (pytest.approx(1.1), pytest.approx(0.05), pytest.approx(2.1))
    assert jt.total == pytest.approx(3.25)
    assert clock.job_time(1, 5) == virtualtime.JobTime(0.0, pytest.approx(5 * 0.002), 0.0)  # speed 2: 2 ms
    assert clock.job_time(2, 5).compute == pytest.approx(0.02)  # unconstrained: the reference, 4 ms
    assert list(clock.job_times([0, 1, 2], [5, 5, 5])) == pytest.approx([3.25, 0.01, 0.02])


def test_overhead_ms_is_a_fixed_cost_per_job_between_the_download_and_the_compute():
    plan = parse_profiles({"slow": {"clients": [0], "step_ms": 10.0, "down_kbps": 8, "rtt_ms": 100,
                                    "overhead_ms": 750}, "fast": {"count": 1, "step_ms": 1.0}}, 2)
    clock = VirtualClock(plan, model_bytes=1000, seed=0)
    jt = clock.job_time(0, 5)
    assert (jt.download, jt.overhead, jt.compute, jt.upload) == pytest.approx((1.1, 0.75, 0.05, 0.1))
    assert jt.trained == pytest.approx(1.9) and jt.total == pytest.approx(2.0)  # same for 0 or 500 steps
    assert clock.job_time(0, 500).total - clock.job_time(0, 5).total == pytest.approx(495 * 0.01)
    assert clock.job_time(1, 5).overhead == 0.0  # a class without the key pays none
    assert list(clock.job_times([0, 1], [5, 5])) == pytest.approx([2.0, 0.005])
    assert plan.record()["slow"]["overhead_ms"] == 750.0 and "overhead_ms=750" in plan.describe()
    with pytest.raises(ProfileError, match=r"overhead_ms = -1 must be >= 0"):
        parse_profiles({"slow": {"count": 1, "overhead_ms": -1}}, 1)


def test_a_speed_without_a_reference_step_time_is_an_error_naming_the_fix():
    with pytest.raises(ProfileError, match=r"\[fast\] has no step_ms.* reference-step-ms"):
        VirtualClock(toy_plan(), model_bytes=10, seed=0)


@pytest.mark.parametrize("table, match", [
    ({"count": 1, "step_sm": 1.0}, r"unknown key 'step_sm' \(did you mean 'step_ms'\?\)"),
    ({"count": 1, "step_ms": 0}, r"step_ms = 0 must be > 0"),
    ({"count": 1, "speed": -1}, r"speed = -1 must be > 0"),
    ({"count": 1, "step_ms": 1.0, "speed": 2.0}, r"one of step_ms .* and speed"),
    ({"count": 1, "session_on_s": 10}, r"both session_on_s and session_off_s"),
    ({"count": 1, "session_on_s": 10, "session_off_s": 5, "session_model": "weibull"}, r"session_model = 'weibull'"),
    ({"count": 1, "session_model": "periodic"}, r"session_model needs session_on_s"),
])
def test_bad_simulation_keys_are_refused_naming_class_and_key(table, match):
    with pytest.raises(ProfileError, match=match):
        parse_profiles({"slow": table}, 2)


def test_the_bundled_example_parses_for_the_deployment_and_the_simulation():
    from deploy.edge.devices import load_devices

    plan = read_profiles(EXAMPLE, 20, seed=0)
    assert [dc.name for dc in plan.classes] == ["slow", "mid", "fast"] and plan.profile_of(0).step_ms == 2.8
    assert load_devices(EXAMPLE, 20).of(0).limits["cpus"] == 0.2  # the deployment reads the same file
    assert "reference-step-ms" not in plan.record() and plan.record()["slow"]["clients"] == list(range(6))


def test_periodic_sessions_are_on_then_off_from_zero_and_compose_with_the_schedule():
    plan = parse_profiles({"p": {"count": 1, "step_ms": 1.0, "session_on_s": 10, "session_off_s": 5,
                                 "session_model": "periodic"}}, 1)
    clock = VirtualClock(plan, model_bytes=0, seed=0)
    assert [clock.online(0, t) for t in (0, 9.99, 10, 14.99, 15, 24.9)] == [True, True, False, False, True, True]
    assert clock.next_online(0, 12.0) == 15.0 and clock.online_until(0, 16.0) == 25.0

    class EveryOther:  # on in even slots only
        def available(self, t):
            return [t % 2 == 0]

    clock = VirtualClock(plan, model_bytes=0, seed=0, schedule=EveryOther(), slot_seconds=4.0)
    assert not clock.online(0, 5.0)  # slot 1 is off
    assert clock.next_online(0, 5.0) == 8.0 and clock.online_until(0, 8.0) == 10.0  # session ends at 10
    assert clock.next_online(0, 10.0) == 16.0  # session back at 15, but slot 3 (12-16) is off


def test_a_client_never_online_has_next_online_inf():
    class Never:
        def available(self, t):
            return [False]

    plan = parse_profiles({"a": {"count": 1, "step_ms": 1.0}}, 1)
    assert VirtualClock(plan, model_bytes=0, seed=0, schedule=Never(), slot_seconds=1e9).next_online(0, 0.0) == math.inf


@pytest.mark.parametrize("slot", [2.63, 0.1, 0.7, 1.1])
def test_next_online_steps_over_slot_starts_that_floating_point_rounds_down(slot):
    """k x slot is in slot k even where (k x slot) // slot = k - 1 (15 x 2.63 // 2.63 = 14): the
    clock found the slot after 39.449999999999996 to be itself, looped and said "never"."""
    class At:  # on in slot 25 only
        def available(self, t):
            return [t == 25]

    plan = parse_profiles({"a": {"count": 1, "step_ms": 1.0}}, 1)
    clock = VirtualClock(plan, model_bytes=0, seed=0, schedule=At(), slot_seconds=slot)
    assert clock.next_online(0, 0.0) == 25 * slot and clock.online(0, 25 * slot)
    assert not clock.online(0, 24 * slot) and clock.online_until(0, 25 * slot) == 26 * slot


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), on=st.floats(1, 100), off=st.floats(0.5, 100),
       times=st.lists(st.floats(0, 2000), min_size=1, max_size=20))
def test_exponential_sessions_answer_the_same_whatever_the_order_of_questions(seed, on, off, times):
    plan = parse_profiles({"a": {"count": 3, "step_ms": 1.0, "session_on_s": on, "session_off_s": off}}, 3)
    forward, shuffled = (VirtualClock(plan, model_bytes=0, seed=seed) for _ in range(2))
    want = {(c, t): forward.session(c, t) for t in sorted(times) for c in range(3)}
    for (c, t) in reversed(list(want)):
        assert shuffled.session(c, t) == want[c, t]
        on_, start, end = want[c, t]
        assert start <= t < end


def test_exponential_sessions_spend_the_stationary_share_online():
    plan = parse_profiles({"a": {"count": 200, "step_ms": 1.0, "session_on_s": 30, "session_off_s": 10}}, 200)
    clock = VirtualClock(plan, model_bytes=0, seed=7)
    share = sum(clock.online(c, t) for c in range(200) for t in range(0, 2000, 50)) / (200 * 40)
    assert share == pytest.approx(0.75, abs=0.03)
    other = VirtualClock(plan, model_bytes=0, seed=8)
    assert [clock.online(c, 100.0) for c in range(200)] != [other.online(c, 100.0) for c in range(200)]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.0, 1.0, 2.5, math.inf]), st.integers()), min_size=1, max_size=30))
def test_the_event_queue_pops_by_time_then_push_order(events):
    q = EventQueue()
    for i, (t, payload) in enumerate(events):
        q.push(t, f"k{i}", payload)
    out = [q.pop() for _ in range(len(q))]
    assert [(e.time, e.seq) for e in out] == sorted((t, i) for i, (t, _) in enumerate(events))
    assert len(q) == 0 and q.peek() is None
    with pytest.raises(IndexError):
        q.pop()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([0.0, 1.0, 2.5]), min_size=1, max_size=20), st.integers(0, 20),
       st.lists(st.sampled_from([0.0, 1.0, 2.5]), max_size=5))
def test_a_restored_event_queue_releases_events_as_the_original(times, popped, later):
    """A checkpoint's copy of a queue (events() and next_seq) releases the same events in the same
    order as the queue it copies, events pushed afterwards included (the asynchronous loop's resume)."""
    q = EventQueue()
    for i, t in enumerate(times):
        q.push(t, "k", i)
    for _ in range(min(popped, len(q))):
        q.pop()
    copy = EventQueue.restored(q.events(), q.next_seq)
    for queue in (q, copy):
        for t in later:
            queue.push(t, "later", t)
    assert [(e.time, e.seq, e.payload) for e in (q.pop() for _ in range(len(q)))] == \
        [(e.time, e.seq, e.payload) for e in (copy.pop() for _ in range(len(copy)))]
    with pytest.raises(ValueError, match="distinct sequence numbers"):
        EventQueue.restored([virtualtime.Event(0.0, 3, "k")], 3)
