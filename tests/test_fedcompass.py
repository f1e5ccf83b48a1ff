"""FedCompass against a port of the official code (APPFL's ``CompassScheduler`` and
``FedCompassAggregator``, gradient-based, written here from that code with an explicit clock in
place of ``time.time()`` and of its ``threading.Timer``s), on the same clients' speeds: the same
step counts, the same aggregations at the same times, the same model. Then the rule in the
asynchronous loop on the virtual clock, and one claim of the paper."""

from __future__ import annotations

import heapq
import math
import os
import tomllib
import uuid

import numpy as np
import pytest
from replies import reply

from experiments.inprocess import run_inprocess
from server_app.results import read_metrics
from strategies import build_strategy, named_arrays
from virtualtime import parse_profiles


# ----------------------------------------------------------------------------- the port
class OfficialCompass:
    """APPFL's CompassScheduler + FedCompassAggregator (gradient_based, weights 1/num_clients,
    polynomial staleness (u + 1)^-a), with ``now`` passed in and timers returned to the caller."""

    def __init__(self, n, x0, *, q_min, q_max, momentum, factor, alpha, a):
        self.n, self.x = n, np.asarray(x0, np.float64).copy()
        self.q_min, self.q_max, self.momentum, self.factor, self.alpha, self.a = q_min, q_max, momentum, factor, alpha, a
        self.client_info, self.arrival_group, self.group_buffer = {}, {}, {}
        self.general_buffer = {"local_models": {}, "local_steps": {}, "timestamp": {}}
        self.global_timestamp, self.group_counter, self.late = 0, 0, 0
        self.timers = []  # (time, group) the caller fires with timer()
        self.futures = {}  # client -> (model, steps) once its group aggregated
        self.log = []  # (time, kind, sorted clients, staleness by client)

    def _aggregate(self, models, staleness):
        for cid, grad in models.items():
            self.x = self.x - grad * (self.alpha * (staleness[cid] + 1) ** (-self.a) * (1.0 / self.n))

    def schedule(self, cid, grad, now):
        """Returns (model, steps) at once, or None (the client waits for its group)."""
        self._record_info(cid, now)
        if "goa" not in self.client_info[cid]:
            return self._single_update(cid, grad, now, buffer=False)
        return self._group_update(cid, grad, self.client_info[cid]["goa"], now)

    def _record_info(self, cid, now):
        start = self.client_info[cid]["start_time"] if cid in self.client_info else 0
        steps = self.client_info[cid]["local_steps"] if cid in self.client_info else self.q_max
        speed = (now - start) / steps
        if cid not in self.client_info:
            self.client_info[cid] = {"timestamp": 0, "speed": speed, "local_steps": self.q_max}
        else:
            info = self.client_info[cid]
            info["speed"] = (1 - self.momentum) * info["speed"] + self.momentum * speed

    def _single_update(self, cid, grad, now, buffer):
        if not buffer:
            st = self.global_timestamp - self.client_info[cid]["timestamp"]
            self._aggregate({cid: grad}, {cid: st})
            self.log.append((now, "single", [cid], {cid: st}))
            self.global_timestamp += 1
        else:
            self.late += 1
            self.general_buffer["local_models"][cid] = grad
            self.general_buffer["timestamp"][cid] = self.client_info[cid]["timestamp"]
        self.client_info[cid]["timestamp"] = self.global_timestamp
        self._assign_group(cid, now)
        return self.x.copy(), self.client_info[cid]["local_steps"]

    def _group_update(self, cid, grad, g, now):
        if now > self.arrival_group[g]["latest_arrival_time"]:
            self.arrival_group[g]["clients"].remove(cid)
            if not self.arrival_group[g]["clients"]:
                del self.arrival_group[g]
            return self._single_update(cid, grad, now, buffer=True)
        self.arrival_group[g]["clients"].remove(cid)
        self.arrival_group[g]["arrived_clients"].append(cid)
        buf = self.group_buffer.setdefault(g, {"local_models": {}, "local_steps": {}, "timestamp": {}})
        buf["local_models"][cid] = grad
        buf["timestamp"][cid] = self.client_info[cid]["timestamp"]
        if not self.arrival_group[g]["clients"]:
            self._group_aggregation(g, now)
        return None

    def timer(self, g, now):
        self._group_aggregation(g, now)

    def _group_aggregation(self, g, now):
        if g not in self.arrival_group or g not in self.group_buffer:
            return
        models = {**self.general_buffer["local_models"], **self.group_buffer[g]["local_models"]}
        stamps = {**self.general_buffer["timestamp"], **self.group_buffer[g]["timestamp"]}
        staleness = {c: self.global_timestamp - stamps[c] for c in stamps}
        self.general_buffer = {"local_models": {}, "local_steps": {}, "timestamp": {}}
        self._aggregate(models, staleness)
        self.log.append((now, "group", sorted(models), staleness))
        self.global_timestamp += 1
        speeds = []
        for c in self.arrival_group[g]["arrived_clients"]:
            self.client_info[c]["timestamp"] = self.global_timestamp
            speeds.append((c, self.client_info[c]["speed"]))
        self.arrival_group[g]["expected_arrival_time"] = 0
        self.arrival_group[g]["latest_arrival_time"] = 0
        for c, _ in sorted(speeds, key=lambda x: x[1]):
            self._assign_group(c, now)
            self.futures[c] = (self.x.copy(), self.client_info[c]["local_steps"])
        if not self.arrival_group[g]["clients"]:
            del self.arrival_group[g]

    def _new_group(self, cid, now, steps):
        speed = self.client_info[cid]["speed"]
        self.arrival_group[self.group_counter] = {
            "clients": [cid], "arrived_clients": [],
            "expected_arrival_time": now + steps * speed,
            "latest_arrival_time": now + steps * speed * self.factor}
        self.timers.append((self.arrival_group[self.group_counter]["latest_arrival_time"], self.group_counter))
        self.client_info[cid].update(goa=self.group_counter, local_steps=steps, start_time=now)
        self.group_counter += 1

    def _assign_group(self, cid, now):
        if not self.arrival_group:
            self._new_group(cid, now, self.q_max)
        elif not self._join_group(cid, now):
            self._create_group(cid, now)

    def _join_group(self, cid, now):
        assigned, steps_at = -1, -1
        for g in self.arrival_group:
            steps = math.floor((self.arrival_group[g]["expected_arrival_time"] - now) / self.client_info[cid]["speed"])
            if steps < self.q_min or steps < steps_at or steps > self.q_max:
                continue
            assigned, steps_at = g, steps
        if assigned == -1:
            return False
        self.arrival_group[assigned]["clients"].append(cid)
        self.client_info[cid].update(goa=assigned, local_steps=steps_at, start_time=now)
        return True

    def _create_group(self, cid, now):
        steps_at = -1
        for g in self.arrival_group:
            if now < self.arrival_group[g]["latest_arrival_time"]:
                members = self.arrival_group[g]["clients"] + self.arrival_group[g]["arrived_clients"]
                fastest = min(self.client_info[c]["speed"] for c in members)
                est = self.arrival_group[g]["latest_arrival_time"] + fastest * self.q_max
                steps = math.floor((est - now) / self.client_info[cid]["speed"])
                if steps <= self.q_max:
                    steps_at = max(steps_at, steps)
        steps_at = self.q_min if 0 <= steps_at < self.q_min else steps_at
        steps_at = self.q_max if steps_at < 0 else steps_at
        self._new_group(cid, now, steps_at)


def grad_of(c, job, dim):
    """The client's change Δ of its job-th update (deterministic)."""
    return np.random.default_rng([c, job]).normal(size=dim)


def seconds(sec_per_step, jitter, c, job, steps):
    """A job's time: Q x the client's seconds per step, times a deterministic factor in
    [1 − jitter, 1 + 2 jitter] (a device that is sometimes slower than its estimate)."""
    return steps * sec_per_step[c] * (1 + jitter * np.random.default_rng([7, c, job]).uniform(-1, 2))


def run_official(sec_per_step, horizon, dim, x0, jitter=0.0, **kw):
    """Events on the port: a client's job of Q steps takes Q x its seconds per step (jittered)."""
    port = OfficialCompass(len(sec_per_step), x0, **kw)
    queue, seq, jobs, steps_log = [], 0, dict.fromkeys(range(len(sec_per_step)), 0), []
    running, handed = {}, {}  # client -> Q of its job running, of its update the port holds
    port.steps_applied = []  # per aggregation: the mean Q of the updates applied

    def start(c, now, steps):
        nonlocal seq
        jobs[c] += 1
        running[c] = steps
        steps_log.append((c, steps))
        heapq.heappush(queue, (now + seconds(sec_per_step, jitter, c, jobs[c], steps), seq, "arrival", c))
        seq += 1

    for c in range(len(sec_per_step)):
        start(c, 0.0, kw["q_max"])
    fired = 0
    while queue:
        while fired < len(port.timers):  # the timers the port created: events too
            t, g = port.timers[fired]
            heapq.heappush(queue, (t, seq, "timer", g))
            seq += 1
            fired += 1
        now, _, kind, who = heapq.heappop(queue)
        if now > horizon:
            break
        logged = len(port.log)
        if kind == "timer":
            port.timer(who, now)
        else:
            handed[who] = running[who]
            got = port.schedule(who, -grad_of(who, jobs[who], dim), now)  # the official client sends old − new
        port.steps_applied += [np.mean([handed[c] for c in entry[2]]) for entry in port.log[logged:]]
        if kind == "arrival" and got is not None:
            start(who, now, got[1])
        for c, (_, steps) in sorted(port.futures.items()):
            start(c, now, steps)
        port.futures = {}
    return port, steps_log


# ----------------------------------------------------------------------------- our rule, driven the same way
def run_ours(sec_per_step, horizon, dim, x0, spec, jitter=0.0):
    """The same events through the rule's hooks, as the asynchronous loop drives them."""
    n = len(sec_per_step)
    rule = build_strategy(spec, num_clients=n)
    rule.begin(named_arrays({"w": np.asarray(x0, np.float32)}))
    queue, seq, jobs, steps_log, log = [], 0, dict.fromkeys(range(n), 0), [], []
    idle = set(range(n))

    def dispatch(now):
        nonlocal seq
        for c in sorted(idle):
            if rule.holds(100 + c):
                continue
            idle.discard(c)
            jobs[c] += 1
            msg, version = rule.job(100 + c, jobs[c])
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            steps = rule.job_steps(100 + c, 100)
            assert msg.content["config"]["local-steps"] == steps  # the step count travels in the message
            steps_log.append((c, steps))
            heapq.heappush(queue, (now + seconds(sec_per_step, jitter, c, jobs[c], steps), seq, "arrival",
                                   (c, msg, version)))
            seq += 1

    def record(now):
        log.append((now, rule.aggregation_kind, sorted(a.report.client_id for a in rule.applied),
                    {a.report.client_id: a.staleness for a in rule.applied}))

    dispatch(0.0)
    queued = None
    while True:
        due = rule.deadline()
        if due is not None and due != queued:
            heapq.heappush(queue, (due, seq, "deadline", None))
            seq += 1
            queued = due
        if not queue:
            break
        now, _, kind, payload = heapq.heappop(queue)
        if now > horizon:
            break
        if kind == "deadline":
            if rule.at_deadline(now):
                record(now)
        else:
            c, msg, version = payload
            x_start = rule.snapshots.get(version, rule.current)
            out = rule.arrive(reply(msg, x_start + grad_of(c, jobs[c], dim).astype(np.float32), **{"client-id": c}),
                              msg, version, {100 + i for i in range(n)}, now)
            assert not out.reason, out.reason
            idle.add(c)
            if out.aggregated:
                record(now)
        dispatch(now)
    return rule, steps_log, log


OFFICIAL = {"q_min": 20, "q_max": 100, "momentum": 0.9, "factor": 1.5, "alpha": 0.9, "a": 0.5}
SPEC = "fedcompass:q-min=20,q-max=100,speed-momentum=0.9,latest-time-factor=1.5,alpha=0.9,staleness=poly,staleness-a=0.5,max-norm-ratio=0"  # the paper (no start-up hold)


@pytest.mark.parametrize(("speeds", "jitter"), [
    ([0.011, 0.023, 0.0317, 0.047, 0.052], 0.0),  # within Q_max / Q_min = 5 of each other
    ([0.01, 0.013, 0.031, 0.07, 0.19, 0.41, 0.0555, 0.0209], 0.0),  # 41x apart: several groups
    ([0.01, 0.013, 0.031, 0.07, 0.19, 0.41, 0.0555, 0.0209], 0.3),  # and late: deadlines, general buffer
])
def test_fedcompass_equals_the_official_code_on_the_same_clients(speeds, jitter):
    dim, x0 = 6, np.linspace(-1, 1, 6)
    port, port_steps = run_official(speeds, 60.0, dim, x0, jitter, **OFFICIAL)
    rule, our_steps, log = run_ours(speeds, 60.0, dim, x0, SPEC, jitter)
    assert our_steps == port_steps  # every job's Q_i, in order
    assert len(log) == len(port.log) > 10
    for (t1, k1, c1, s1), (t2, k2, c2, s2) in zip(log, port.log, strict=True):
        assert t1 == pytest.approx(t2, abs=1e-9) and c1 == c2 and s1 == s2
        assert (k1 == "first") == (k2 == "single")
    assert any(k == "deadline" for _, k, _, _ in log) == (jitter > 0)  # a group aggregated at its latest time
    assert (port.late > 0) == (jitter > 0)  # updates after their group's latest time: the general buffer
    np.testing.assert_allclose(rule.current, port.x, rtol=1e-5, atol=1e-5)


def test_the_rule_checks_its_parameters():
    with pytest.raises(ValueError, match="q-min=30 and q-max=20"):
        build_strategy("fedcompass:q-min=30,q-max=20", num_clients=2)
    with pytest.raises(ValueError, match="weighting='num-examples'"):
        build_strategy("fedcompass", num_clients=2, weighting="num-examples")
    with pytest.raises(ValueError, match="latest-time-factor"):
        build_strategy("fedcompass:latest-time-factor=0.5", num_clients=2)


def test_paper_claim_updates_arrive_as_one_group_within_the_step_range():
    """The paper's claim (abstract; Fig. 1: five clients, Q_min = 20, Q_max = 100): Compass gives
    each client local steps in proportion to its speed so that the updates arrive together as a
    group, keeping staleness low. Checked: five clients up to 4.7x apart in speed (within
    Q_max / Q_min = 5) form ONE group within the first 11 aggregations (the first updates arrive
    alone, as in the figure); from then on every aggregation applies all five updates at
    staleness 0, each client running Q_i = ⌊1.1 s / its seconds per step⌋ (100, 47, 34, 23, 21)."""
    speeds = [0.011, 0.023, 0.0317, 0.047, 0.052]
    _, steps, log = run_ours(speeds, 100.0, 4, np.zeros(4), SPEC)
    first = next(i for i, (_, _, c, _) in enumerate(log) if c == [0, 1, 2, 3, 4])
    assert first <= 10 and len(log) - first > 50
    assert all(c == [0, 1, 2, 3, 4] and set(s.values()) <= {0} for _, _, c, s in log[first + 1:])
    assert steps[-10:] == [(0, 100), (1, 47), (2, 34), (3, 23), (4, 21)] * 2


DEVICES = """
[c0]
clients = [0]
step_ms = 110
[c1]
clients = [1]
step_ms = 230
[c2]
clients = [2]
step_ms = 470
"""


def test_fedcompass_in_the_asynchronous_loop_on_the_virtual_clock(tmp_path):
    """The loop takes each job's time from the rule's Q_i (the client trains that many steps) and
    fires the groups' latest arrival times: its aggregations are the port's, at the port's times."""
    devices = tmp_path / "devices.toml"
    devices.write_text(DEVICES)
    parse_profiles(tomllib.loads(DEVICES), 3)
    cfg = {"num-clients": 3, "dataset": "digits", "model": "mlp", "eval-every": 0, "availability": "always",
           "local-steps": "steps:n=3", "checkpoint-every": 0, "progress": False, "num-server-rounds": 8,
           "strategy": "fedcompass:q-min=2,q-max=8,max-norm-ratio=0", "weighting": "equal",  # the paper: no hold
           "devices": str(devices), "results-dir": str(tmp_path), "run-name": "compass"}
    rows = read_metrics(run_inprocess(cfg))
    port, _ = run_official([0.11, 0.23, 0.47], rows[-1]["virtual-time"], 2, np.zeros(2),
                           **{**OFFICIAL, "q_min": 2, "q_max": 8})
    assert [(r["virtual-time"], r["participants"]) for r in rows] == \
        [(pytest.approx(t, abs=1e-6), c) for t, _, c, _ in port.log[:len(rows)]]
    # the clients trained the steps the rule sent (their replies' num-steps), not the workload's 3
    assert [r["local-steps"] for r in rows] == pytest.approx(port.steps_applied[:len(rows)])
    assert any(r["local-steps"] != 3 for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.environ.get("FLCHURN_EXTRA_DEPLOY_TESTS"), reason="a 2-3 minute deployment: opt-in with "
                    "FLCHURN_EXTRA_DEPLOY_TESTS=1 (CI's time budget; the asynchronous deployment path is tested "
                    "by tests/test_async.py's FedBuff deployment)")
def test_fedcompass_deployed_on_real_time(tmp_path):
    """Three SuperNodes (real processes), FedCompass on real time: the clients train the Q_i the
    rule sends (their replies' num-steps, in [Q_min, Q_max]), groups aggregate (measured once:
    three single first updates, then groups of all three at staleness 0, about 11 s apart), and
    no process is left."""
    import shutil

    if shutil.which("flower-superlink") is None:
        pytest.skip("flower-superlink not on PATH")
    from deploy.local import ProcessSite
    from deploy.procs import zombie_children
    from deploy.run import run_deployment

    cfg = {"num-server-rounds": 5, "strategy": "fedcompass:q-min=2,q-max=10", "availability": "always",
           "dataset": "digits", "model": "logreg", "local-steps": "steps:n=10", "partition": "iid",
           "round-timeout": 120.0, "checkpoint-every": 0, "device": "cpu", "weighting": "equal",
           "results-dir": str(tmp_path / "results"), "progress": False}
    with ProcessSite(3, tmp_path / "work") as dep:
        out = run_deployment(dep, cfg, timeout=500)
    assert out.completed, out.status
    rows = read_metrics(out.run_dir)
    assert [r["round"] for r in rows] == list(range(1, 6))
    assert all(2 <= r["local-steps"] <= 10 for r in rows)
    assert sum(len(r["arrivals"]) for r in rows) > len(rows)  # some aggregation applied a group
    assert dep.leftovers() == [] and zombie_children() == []


SESSION_DEVICES = """
[fast]
clients = [0, 1]
step_ms = 110
session_on_s = 0.8
session_off_s = 0.5
[slow]
clients = [2, 3]
step_ms = 370
"""


@pytest.mark.parametrize("at", [3])
def test_a_resumed_fedcompass_run_equals_the_uninterrupted_run(tmp_path, at):
    """The checkpoint holds the scheduler (groups, speeds, timers) and its buffers; the loop's
    queue holds the groups' latest-time events: a resumed run has the same rows and model. Sessions
    make jobs lost, so groups also close at their latest time."""
    import torch
    from test_async_resume import resume, rows_by_client

    (tmp_path / "devices.toml").write_text(SESSION_DEVICES)
    cfg = {"num-clients": 4, "dataset": "digits", "model": "mlp", "eval-every": 0, "progress": False,
           "batch-size": 128, "num-server-rounds": 8, "availability": "always", "local-steps": "steps:n=3",
           "strategy": "fedcompass:q-min=2,q-max=8", "weighting": "equal", "devices": str(tmp_path / "devices.toml"),
           "checkpoint-every": at, "results-dir": str(tmp_path)}
    full = run_inprocess({**cfg, "run-name": "full"})
    rows = read_metrics(full)
    assert len(rows) == 8 and any(r["lost-nodes"] for r in rows)
    resumed = resume(full, cfg, at)
    assert rows_by_client(resumed) == rows_by_client(full)
    a, b = torch.load(full / "final_model.pt"), torch.load(resumed / "final_model.pt")
    assert all(torch.equal(a[name], b[name]) for name in a)
