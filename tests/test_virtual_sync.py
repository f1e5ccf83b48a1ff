"""Synchronous rounds on the virtual clock (run config ``devices``), through the real round loop
and the real ClientApp in process: the closed-form toy, no deadline equals no clock bit for bit,
the same seed gives the same events."""

from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from experiments.inprocess import run_inprocess
from runconfig import ConfigError
from server_app.results import accuracy_figure, clock_statuses, participation_figure, read_metrics

matplotlib.use("Agg")
N = 4
BASE = {
    "dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": N,
    "local-steps": "steps:n=1", "batch-size": 1, "lr": 0.5, "availability": "always", "data-seed": 0,
    "train-seed": 0, "progress": False, "eval-every": 1, "checkpoint-every": 0, "device": "cpu",
}
# the quadratic model is x in R^10, float32: 40 bytes each way = 0.32 kbit
TOY = """
[a]
clients = [0]
step_ms = 1000
session_on_s = 10
session_off_s = 10
session_model = "periodic"
[b]
clients = [1]
step_ms = 2000
down_kbps = 1
[c]
clients = [2]
step_ms = 3000
rtt_ms = 500
[d]
clients = [3]
step_ms = 500
session_on_s = 4
session_off_s = 100
session_model = "periodic"
"""
VIRTUAL = ("virtual-time", "virtual-round-time", "late", "lost", "session-off", "client-virtual-time")
TIMING = ("round-time", "wall-time")


@pytest.fixture(autouse=True, scope="module")
def no_plots():
    with pytest.MonkeyPatch.context() as mp:  # the pictures are test_plots.py's; here they cost 1-3 s a run
        mp.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)
        yield


def run(tmp_path, name, **over):
    run_dir = run_inprocess({**BASE, **over, "results-dir": str(tmp_path), "run-name": name})
    return read_metrics(run_dir), torch.load(run_dir / "final_model.pt", weights_only=True), run_dir


def devices(tmp_path, text=TOY):
    path = tmp_path / "devices.toml"
    path.write_text(text)
    return str(path)


def test_the_closed_form_toy_closes_rounds_at_the_deadline_and_records_late_and_lost(tmp_path):
    # jobs: client 0 = 1 s; 1 = 0.32 s download + 2 s; 2 = 0.5 + 3 + 0.5 s; 3 = 0.5 s.
    # Deadline 3.5 s: rounds start at 0, 3.5, 7, 10.5, 14, client 2 is always late (4.0 > 3.5).
    # Client 0 is on in [0, 10) and [20, 30): off from round 4. Client 3 is on in [0, 4): in round
    # 2 its reply lands at 3.5 + 0.5 = 4.0, the end of its session (in time); from round 3 it is off.
    rows, final, run_dir = run(tmp_path, "toy", strategy="fedavg-active", **{
        "num-server-rounds": 5, "devices": devices(tmp_path), "virtual-deadline": 3.5})
    assert [r["virtual-time"] for r in rows] == pytest.approx([3.5, 7.0, 10.5, 14.0, 17.5])
    assert [r["participants"] for r in rows] == [[0, 1, 3], [0, 1, 3], [0, 1], [1], [1]]
    assert [r["late"] for r in rows] == [[2]] * 5  # 4.0 s > 3.5: trained, dropped
    assert [r["session-off"] for r in rows] == [[], [], [3], [0, 3], [0, 3]]
    assert [r["lost"] for r in rows] == [[]] * 5
    assert rows[0]["client-virtual-time"] == pytest.approx({"0": 1.0, "1": 2.32, "2": 4.0, "3": 0.5})
    assert clock_statuses(rows, N).tolist() == [[1, 1, 2, 1]] * 2 + [[1, 1, 2, 4]] + [[4, 1, 2, 4]] * 2
    assert len(accuracy_figure(rows, N).axes) == 4  # against rounds, and beside it against virtual time
    assert len(participation_figure(np.zeros((5, N)), None, clock_statuses(rows, N)).axes) == 1
    # the strategy saw exactly these replies: the same run with the others dropped at delivery
    config = json.loads((run_dir / "config.json").read_text())
    assert config["devices-used"]["c"] == {"clients": [2], "step_ms": 3000.0, "rtt_ms": 500.0}
    took_part = {(r["round"], c) for r in rows for c in r["participants"]}
    down_dir = run_inprocess({**BASE, "strategy": "fedavg-active", "num-server-rounds": 5,
                              "results-dir": str(tmp_path), "run-name": "down"},
                             down=lambda rnd, c: (rnd, c) not in took_part)
    down_final = torch.load(down_dir / "final_model.pt", weights_only=True)
    assert all(torch.equal(final[k], down_final[k]) for k in final)


def test_min_replies_closes_at_the_kth_arrival_and_a_session_ending_mid_job_loses_the_client(tmp_path):
    text = TOY.replace("session_on_s = 4\n", "session_on_s = 1.2\n")  # client 3: on in [0, 1.2)
    rows, _, _ = run(tmp_path, "k", strategy="fedavg-active", **{
        "num-server-rounds": 3, "devices": devices(tmp_path, text), "min-replies": 2})
    # round 1: arrivals 0.5 (3), 1.0 (0), 2.32 (1), 4.0 (2): closes at 1.0
    assert rows[0]["virtual-time"] == pytest.approx(1.0) and rows[0]["participants"] == [0, 3]
    assert rows[0]["late"] == [1, 2]
    # round 2 starts at 1.0: client 3's job would end at 1.5 > 1.2: lost before training. Clients
    # 1 and 2 are still busy with their late jobs (a device works one job at a time): 1 starts at
    # 2.32 and replies at 4.64, 2 starts at 4.0 and replies at 8.0 (late again)
    assert rows[1]["lost"] == [3] and rows[1]["participants"] == [0, 1]
    assert rows[1]["virtual-time"] == pytest.approx(2.32 + 2.32) and rows[1]["late"] == [2]
    assert rows[1]["client-virtual-time"] == pytest.approx({"0": 1.0, "1": 3.64, "2": 7.0})
    # round 3 starts at 4.64: 0 and 1 are free (5.64, 6.96); 2 is busy until 8.0 and replies at 12.0
    assert rows[2]["session-off"] == [3] and rows[2]["virtual-time"] == pytest.approx(4.64 + 2.32)
    assert rows[2]["client-virtual-time"] == pytest.approx({"0": 1.0, "1": 2.32, "2": 7.36})


BUSY = """
[slow]
count = {k}
step_ms = {ms}
overhead_ms = {overhead}
session_on_s = {on}
session_off_s = {off}
[fast]
count = {rest}
step_ms = 400
"""


@settings(max_examples=4, deadline=None, derandomize=True)
@given(k=st.integers(1, N - 1), ms=st.integers(500, 4000), overhead=st.integers(0, 1500), on=st.integers(2, 30),
       off=st.integers(1, 10), close=st.sampled_from([("virtual-deadline", 1.5), ("virtual-deadline", 3.0),
                                                     ("min-replies", 1), ("min-replies", 2)]),
       at=st.integers(1, 4), seed=st.integers(0, 3))
@example(k=1, ms=2000, overhead=0, on=1000, off=1, close=("min-replies", 2), at=2, seed=0)
def test_a_resumed_clock_run_keeps_the_devices_still_busy_with_late_jobs(tmp_path_factory, k, ms, overhead, on, off,
                                                                        close, at, seed):
    import shutil

    tmp = tmp_path_factory.mktemp("busy")
    text = BUSY.format(k=k, ms=ms, overhead=overhead, on=on, off=off, rest=N - k)
    over = {"strategy": "fedavg-active", "num-server-rounds": 5, "devices": devices(tmp, text), close[0]: close[1],
            "checkpoint-every": 1, "schedule-seed": seed}
    rows, final, full = run(tmp, "full", **over)
    copy = tmp / "resumed"
    shutil.copytree(full, copy)
    (copy / "final_model.pt").unlink()
    resumed, resumed_final, _ = run(tmp, "resumed", **over,
                                    **{"resume-from": str(copy / "checkpoints" / f"round-{at:04d}.pt")})
    strip = ("round-time", "wall-time")
    assert [{k: v for k, v in r.items() if k not in strip} for r in resumed] == [
        {k: v for k, v in r.items() if k not in strip} for r in rows]
    assert all(torch.equal(final[k], resumed_final[k]) for k in final)


def test_a_late_device_starts_its_next_job_when_the_late_one_ends(tmp_path):
    # slow: 2 s jobs, min-replies 2 closes every round at the fast clients' 0.4 s: the slow device's
    # jobs run back to back, so its reply comes 2, 3.6, 5.2 ... s after its round starts
    text = BUSY.format(k=1, ms=2000, overhead=0, on=1000, off=1, rest=N - 1)
    rows, _, _ = run(tmp_path, "busy", strategy="fedavg-active", **{
        "num-server-rounds": 4, "devices": devices(tmp_path, text), "min-replies": 2})
    assert [r["late"] for r in rows] == [[0]] * 4
    assert [r["client-virtual-time"]["0"] for r in rows] == pytest.approx([2.0, 3.6, 5.2, 6.8])


def test_overhead_ms_delays_every_job_and_a_session_ending_in_it_loses_the_client_untrained(tmp_path):
    text = """
[a]
clients = [0]
step_ms = 1000
[b]
clients = [1]
step_ms = 100
overhead_ms = 1500
session_on_s = 1.2
session_off_s = 100
session_model = "periodic"
[c]
clients = [2, 3]
step_ms = 500
overhead_ms = 250
"""
    rows, _, _ = run(tmp_path, "overhead", strategy="fedavg-active", **{
        "num-server-rounds": 2, "devices": devices(tmp_path, text)})
    # client 1 would train by 0.1 s without its overhead; with it, by 1.6 s > 1.2: lost, untrained
    assert rows[0]["lost"] == [1] and rows[0]["participants"] == [0, 2, 3]
    assert rows[0]["client-virtual-time"] == pytest.approx({"0": 1.0, "2": 0.75, "3": 0.75})
    assert rows[0]["virtual-time"] == pytest.approx(1.0) and rows[1]["lost"] == [1]  # still on at 1.0 < 1.2


@pytest.mark.parametrize("strategy, availability", [("fedavg-active", "bernoulli:p=0.6"),
                                                    ("fedawe", "bernoulli:p=0.5")])
def test_no_deadline_and_no_sessions_equals_the_run_without_devices_bit_for_bit(tmp_path, strategy, availability):
    text = "[slow]\ncount = 2\nstep_ms = 9\nup_kbps = 3\nrtt_ms = 40\n[fast]\ncount = 2\nspeed = 3.0\n"
    over = {"strategy": strategy, "availability": availability, "num-server-rounds": 4}
    plain_rows, plain, _ = run(tmp_path, "plain", **over)
    clock_rows, clocked, _ = run(tmp_path, "clock", **over, devices=devices(tmp_path, text),
                                 **{"reference-step-ms": 2.0})
    assert all(torch.equal(plain[k], clocked[k]) for k in plain) and plain.keys() == clocked.keys()
    assert not any(k in row for row in plain_rows for k in VIRTUAL)
    strip = [{k: v for k, v in r.items() if k not in VIRTUAL + TIMING} for r in clock_rows]
    assert strip == [{k: v for k, v in r.items() if k not in TIMING} for r in plain_rows]
    assert all(r["late"] == [] and (r["virtual-round-time"] > 0) == bool(r["participants"]) for r in clock_rows)


SESSIONS = "[a]\ncount = {k}\nstep_ms = {ms}\ndown_kbps = 2\nsession_on_s = {on}\nsession_off_s = {off}\n"


@settings(max_examples=3, deadline=None, derandomize=True)
@given(k=st.integers(1, N), ms=st.integers(100, 3000), on=st.integers(1, 20), off=st.integers(1, 20),
       deadline=st.sampled_from([0.0, 1.0, 3.0]), seed=st.integers(0, 3))
def test_the_same_seed_gives_the_same_events(tmp_path_factory, k, ms, on, off, deadline, seed):
    tmp = tmp_path_factory.mktemp("seed")
    path = devices(tmp, SESSIONS.format(k=k, ms=ms, on=on, off=off))
    over = {"strategy": "fedavg-active", "num-server-rounds": 4, "devices": path, "virtual-deadline": deadline,
            "schedule-seed": seed, "reference-step-ms": 700.0}
    first, second = (run(tmp, f"r{i}", **over)[0] for i in range(2))
    assert [{k: r[k] for k in (*VIRTUAL, "participants")} for r in first] == \
        [{k: r[k] for k in (*VIRTUAL, "participants")} for r in second]


@pytest.mark.parametrize("over, match", [
    ({"virtual-deadline": 3.0}, r"'virtual-deadline' = 3.0 .* without devices"),
    ({"min-replies": 2}, r"'min-replies' = 2 .* without devices"),
    ({"devices": "nowhere.toml"}, r"run config 'devices' = 'nowhere.toml': devices file nowhere.toml"),
    ({"devices": "DEV", "availability-gate": "none"}, r"availability-gate 'none'"),
    ({"devices": "DEV", "min-replies": -1}, r"'min-replies' = -1"),
])
def test_bad_clock_keys_are_refused_naming_the_key(tmp_path, over, match):
    if over.get("devices") == "DEV":
        over = {**over, "devices": devices(tmp_path)}
    with pytest.raises(ConfigError, match=match):
        run_inprocess({**BASE, **over, "results-dir": str(tmp_path)})
