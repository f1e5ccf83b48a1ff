"""FedBuff and FedAsync (issue 29, item 3): the rules' math, the staleness bound, and the
asynchronous loop on the virtual clock (in process).

- FedBuff with K = the cohort and no staleness is FedAvg on the same arrivals (random configs
  through the rule's interface; and a whole in-process run against fedavg-active);
- FedAsync's mixing against a hand computation, staleness functions by hand;
- an arrival staler than ``max-staleness`` is rejected, recorded, and leaves no trace;
- the same seed gives the same events (arrival times, clients, staleness) in the same order;
- hostile replies from one client cannot end an asynchronous run or reach the model.
"""

from __future__ import annotations

import itertools
import json
import math
import uuid

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from hypothesis import given, settings, strategies as st
from replies import reply, run_round, start_round

from client_app.app import app as client_app
from experiments.inprocess import run_inprocess
from server_app.results import read_metrics
from strategies import build_strategy, named_arrays
from strategies.staleness import staleness_weight

TINY = {"num-clients": 4, "dataset": "digits", "model": "mlp", "eval-every": 0, "availability": "always",
        "local-steps": "steps:n=3", "checkpoint-every": 0, "progress": False}


def rows_of(path):
    return [{k: v for k, v in r.items() if k not in ("round-time", "wall-time")} for r in read_metrics(path)]


# ------------------------------------------------------------------ FedBuff = FedAvg
@settings(max_examples=25, deadline=None, derandomize=True)
@given(n=st.integers(1, 6), dim=st.integers(1, 8), rounds=st.integers(1, 3), lr=st.sampled_from([1.0, 0.5, 2.0]),
       weighting=st.sampled_from(["equal", "num-examples"]), seed=st.integers(0, 10**6))
def test_fedbuff_with_k_the_cohort_and_no_staleness_is_fedavg(n, dim, rounds, lr, weighting, seed):
    rng = np.random.default_rng(seed)
    kw = {"num_clients": n, "server_lr": lr, "weighting": weighting}
    buff, avg = build_strategy(f"fedbuff:k={n}", **kw), build_strategy("fedavg-active", **kw)
    xb = xa = rng.normal(0, 1, dim).astype(np.float32)
    sizes = {c: int(rng.integers(5, 50)) for c in range(n)}
    for t in range(1, rounds + 1):
        ups = {c: rng.normal(0, 0.1, dim).astype(np.float32) for c in range(n)}
        xb = _round_sizes(buff, t, xb, ups, sizes)
        xa = _round_sizes(avg, t, xa, ups, sizes)
        np.testing.assert_allclose(xb, xa, rtol=1e-6, atol=1e-6)
    assert buff.version == rounds and not buff.pending


def _round_sizes(strategy, t, x, ups, sizes):
    sent = start_round(strategy, t, x, [100 + c for c in ups])
    replies = [reply(sent[100 + c], x + d, **{"client-id": c, "num-examples": sizes[c]}) for c, d in ups.items()]
    arrays, _ = strategy.aggregate_train(t, replies)
    return arrays["w"].numpy()


def test_fedbuff_run_with_k_the_cohort_is_the_fedavg_run(tmp_path):
    """The asynchronous loop on the default clock (equal local steps: every client arrives at the
    same instants) with K = N ends where the synchronous FedAvg run ends."""
    base = {**TINY, "num-server-rounds": 2, "weighting": "equal", "results-dir": str(tmp_path)}
    a = run_inprocess({**base, "strategy": "fedbuff:k=4", "run-name": "buff"})
    b = run_inprocess({**base, "strategy": "fedavg-active", "run-name": "avg"})
    ma, mb = torch.load(a / "final_model.pt"), torch.load(b / "final_model.pt")
    assert max(float((ma[k] - mb[k]).abs().max()) for k in ma) <= 1e-6
    rows = read_metrics(a)
    assert [r["participants"] for r in rows] == [[0, 1, 2, 3]] * 2
    assert [r["arrivals"] for r in rows] == [[[c, 0] for c in range(4)]] * 2
    assert [r["virtual-time"] for r in rows] == [3.0, 6.0]  # 3 local steps x 1 s
    assert json.loads((a / "config.json").read_text())["loop"] == "asynchronous"


# ------------------------------------------------------------------ FedAsync by hand
def async_jobs(strategy, x, nodes):
    strategy.begin(named_arrays({"w": np.asarray(x, np.float32)}))
    jobs = {}
    for node in nodes:
        msg, version = strategy.job(node, 1)
        msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        jobs[node] = (msg, version)
    return jobs


def test_fedasync_mixes_each_arrival_by_hand():
    """The paper's rule (bounds off, so no start-up hold)."""
    s = build_strategy("fedasync:alpha=0.5,staleness=poly,staleness-a=1,max-norm-ratio=0", num_clients=3)
    x0 = np.array([1.0, -2.0, 0.5], np.float32)
    d = {100: np.array([0.2, 0.1, -0.3], np.float32), 101: np.array([-0.1, 0.4, 0.2], np.float32),
         102: np.array([0.3, -0.2, 0.1], np.float32)}
    jobs = async_jobs(s, x0, [100, 101, 102])
    out = [s.arrive(reply(jobs[n][0], x0 + d[n], **{"client-id": n - 100}), *jobs[n], {100, 101, 102}) for n in d]
    assert [o.staleness for o in out] == [0, 1, 2] and all(o.aggregated for o in out)
    x1 = 0.5 * x0 + 0.5 * (x0 + d[100])  # α s(0) = 0.5
    x2 = (1 - 0.25) * x1 + 0.25 * (x0 + d[101])  # α (1 + 1)^-1 = 0.25
    x3 = (1 - 0.5 / 3) * x2 + 0.5 / 3 * (x0 + d[102])  # α (1 + 2)^-1
    np.testing.assert_allclose(s.current, x3, rtol=1e-6)
    assert s.version == 3 and s.snapshots.keys() <= {3}  # versions no job needs are dropped


def test_the_start_up_hold_applies_the_first_arrivals_once_a_majority_of_nodes_replied():
    """With the bounds on, the arrivals before a majority of the nodes (at least 3) have an entry
    are held, then applied in one aggregation, in the order they arrived (staleness 0: no version
    passed); a huge first arrival is judged against that majority's reference and, as it came
    before the server could judge it, cut to that bound (not rejected) and reported."""
    d = {100: np.array([0.2, 0.1, -0.3], np.float32), 101: np.array([-0.1, 0.4, 0.2], np.float32)}
    x0 = np.array([1.0, -2.0, 0.5], np.float32)
    for huge in (False, True):
        s = build_strategy("fedasync:alpha=0.5,staleness=poly,staleness-a=1", num_clients=3)
        jobs = async_jobs(s, x0, [102, 100, 101])
        first = np.full(3, 1e5, np.float32) if huge else np.array([0.1, 0.1, 0.1], np.float32)
        out = [s.arrive(reply(jobs[102][0], x0 + first, **{"client-id": 2}), *jobs[102], {100, 101, 102})]
        out += [s.arrive(reply(jobs[n][0], x0 + d[n], **{"client-id": n - 100}), *jobs[n], {100, 101, 102}) for n in d]
        assert [o.held for o in out] == [True, True, False] and [o.aggregated for o in out] == [False, False, True]
        norms = [float(np.linalg.norm(v)) for v in (first, *d.values())]
        limit = s.bounds.max_norm_ratio * sorted(norms)[1]  # the lower median of the majority's 3 entries
        applied = first * np.float32(limit / norms[0]) if huge else first
        x = 0.5 * x0 + 0.5 * (x0 + applied)
        for n in d:  # released together: each staleness 0, mixed in arrival order into one version
            x = 0.5 * x + 0.5 * (x0 + d[n])
        np.testing.assert_allclose(s.current, x, rtol=1e-5)
        assert s.version == 1 and s.round_log.rejected == []
        assert [n for n, _ in s.round_log.cut] == ([102] if huge else [])


def test_a_start_up_hold_without_a_majority_ends_after_max_staleness_arrivals(caplog):
    """Churn may keep most nodes away: 2 nodes of 8 replying, the hold ends after max-staleness + 1
    held arrivals and applies them all (no reference yet: max-update-norm alone, logged), none dropped."""
    s = build_strategy("fedasync:max-staleness=2", num_clients=8)
    s.begin(named_arrays({"w": np.zeros(2, np.float32)}))
    outcomes = []
    for i in range(4):
        msg, version = s.job(100 + i % 2, i + 1)
        msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        outcomes.append(s.arrive(reply(msg, s.snapshots.get(version, s.current) + 0.1, **{"client-id": i % 2}),
                                 msg, version, {100, 101}))
    assert [o.held for o in outcomes] == [True, True, True, False] and outcomes[-1].aggregated
    assert s.version == 1 and len(s.applied) == 4 and not s.round_log.rejected
    assert "start-up hold ends after 3 held arrivals" in caplog.text


def test_staleness_functions_by_hand():
    assert staleness_weight("constant", 7, 0.5, 4) == 1.0
    assert staleness_weight("poly", 3, 0.5, 4) == pytest.approx(0.5)  # (1 + 3)^-0.5
    assert staleness_weight("hinge", 4, 10, 4) == 1.0
    assert staleness_weight("hinge", 6, 10, 4) == pytest.approx(1 / 21)  # 1 / (10 (6 − 4) + 1)
    with pytest.raises(ValueError, match="staleness"):
        build_strategy("fedasync:staleness=linear", num_clients=2)


def test_fedbuff_weights_stale_updates_by_the_papers_scaling():
    s = build_strategy("fedbuff:k=2,max-norm-ratio=0", num_clients=3)  # the paper (no start-up hold); poly, a = 0.5: 1 / sqrt(1 + staleness)
    x0 = np.zeros(2, np.float32)
    jobs = async_jobs(s, x0, [100, 101, 102])
    d = {100: np.array([1.0, 0.0], np.float32), 101: np.array([0.0, 1.0], np.float32),
         102: np.array([1.0, 1.0], np.float32)}
    for n in (100, 101):
        s.arrive(reply(jobs[n][0], x0 + d[n], **{"client-id": n - 100}), *jobs[n], {100, 101, 102})
    np.testing.assert_allclose(s.current, (d[100] + d[101]) / 2)
    msg, v = s.job(100, 2)
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    x1 = s.current.copy()
    o = s.arrive(reply(jobs[102][0], x0 + d[102], **{"client-id": 2}), *jobs[102], {100, 101, 102})
    assert o.staleness == 1 and not o.aggregated
    o = s.arrive(reply(msg, x1 + d[100], **{"client-id": 0}), msg, v, {100, 101, 102})
    assert o.aggregated and o.staleness == 0
    np.testing.assert_allclose(s.current, x1 + (d[102] / math.sqrt(2) + d[100]) / 2, rtol=1e-6)


# ------------------------------------------------------------------ the staleness bound
def test_an_arrival_staler_than_max_staleness_is_rejected_and_recorded():
    s = build_strategy("fedbuff:k=1,max-staleness=1,staleness=constant,max-norm-ratio=0", num_clients=3)
    x0 = np.zeros(3, np.float32)
    jobs = async_jobs(s, x0, [100, 101, 102])
    d = np.array([0.1, 0.2, 0.3], np.float32)
    for n in (100, 101):
        assert s.arrive(reply(jobs[n][0], x0 + d, **{"client-id": n - 100}), *jobs[n], {100, 101, 102}).aggregated
    before, history = s.current.copy(), list(s.bounds.history)
    o = s.arrive(reply(jobs[102][0], x0 + 100 * d, **{"client-id": 2}), *jobs[102], {100, 101, 102})
    assert not o.aggregated and o.staleness == 2 and o.reason.startswith("stale")
    assert s.round_log.rejected[-1] == (102, "stale: staleness 2 > max-staleness 1")
    np.testing.assert_array_equal(s.current, before)
    assert list(s.bounds.history) == history and s.version == 2 and not s.snapshots.get(0)
    with pytest.raises(ValueError, match="max-staleness"):
        build_strategy("fedasync:max-staleness=-1", num_clients=2)


def test_a_stale_run_records_its_rejections(tmp_path):
    """Uneven local steps make stale arrivals; with max-staleness=0 they are rejected, recorded in
    the rows, and the run still reaches its aggregations."""
    d = run_inprocess({**TINY, "strategy": "fedasync:max-staleness=0", "local-steps": "epochs:min=1,max=3",
                       "batch-size": 128, "num-server-rounds": 4, "results-dir": str(tmp_path), "run-name": "s"})
    rows = read_metrics(d)
    assert len(rows) == 4 and all(st == 0 for r in rows for _, st in r["arrivals"])
    stale = [why for r in rows for _, why in r["rejected"] if why.startswith("stale")]
    assert stale and sum(r["num-stale"] for r in rows) == len(stale)


# ------------------------------------------------------------------ determinism
def test_the_same_seed_gives_the_same_event_order(tmp_path):
    cfg = {**TINY, "num-clients": 6, "strategy": "fedasync", "local-steps": "epochs:min=1,max=4", "batch-size": 64,
           "availability": "sine:gamma=0.5,period=4", "num-server-rounds": 10, "results-dir": str(tmp_path)}
    a, b = (rows_of(run_inprocess({**cfg, "run-name": name})) for name in "ab")
    assert a == b
    times = [r["virtual-time"] for r in a]
    assert times == sorted(times) and len(set(times)) > 3  # arrivals spread in time
    assert any(st > 0 for r in a for _, st in r["arrivals"])  # and stale ones among them
    c = rows_of(run_inprocess({**cfg, "run-name": "c", "schedule-seed": 7}))
    assert [r["arrivals"] for r in c] != [r["arrivals"] for r in a]  # the seed matters


# ------------------------------------------------------------------ hostile replies
def hostile_app():
    """The project's ClientApp, except that client 3 replies something hostile each time."""
    kinds = itertools.cycle(["nan", "shape", "huge", "error", "examples", "strings"])

    def app(msg: Message, context):
        out = client_app(msg, context)
        if context.node_config["partition-id"] != 3 or out.has_error() or "arrays" not in out.content:
            return out
        kind, arrays = next(kinds), out.content["arrays"]
        metrics = dict(out.content["metrics"])
        if kind == "error":
            return Message(Error(code=7, reason="hostile"), reply_to=msg)
        new = {k: a.numpy().copy() for k, a in arrays.items()}
        first = next(iter(new))
        if kind == "nan":
            new[first][...] = np.nan
        elif kind == "shape":
            new[first] = new[first].ravel()[:-1].copy()
        elif kind == "huge":
            new = {k: v + 1e12 if v.dtype.kind == "f" else v for k, v in new.items()}
        elif kind == "examples":
            metrics["num-examples"] = -5
        else:
            new[first] = np.array(["x"] * 3)
        record = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in new.items()})
        return Message(RecordDict({"arrays": record, "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


@pytest.mark.parametrize(("spec", "aggregations"), [("fedasync", 19), ("fedbuff:k=3", 7)])
def test_hostile_replies_cannot_crash_the_async_loop(tmp_path, spec, aggregations):
    """Client 3's six hostile replies in turn (one per virtual instant) are each rejected or lost."""
    d = run_inprocess({**TINY, "strategy": spec, "num-server-rounds": aggregations, "results-dir": str(tmp_path),
                       "run-name": "h", "local-steps": "steps:n=1"}, client_app=hostile_app())
    rows = read_metrics(d)
    assert len(rows) == aggregations and all(3 not in r["participants"] for r in rows)
    assert sum(len(r["rejected"]) + r["unavailable-nodes"] for r in rows) >= 6
    model = torch.load(d / "final_model.pt")
    assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point())


def test_rounds_of_the_sync_interface_still_run():
    """Under a synchronous loop (Flower's start, a drop-in app) a round's replies are arrivals."""
    s = build_strategy("fedasync:alpha=1,staleness=constant", num_clients=2)
    x = run_round(s, 1, np.zeros(2, np.float32), {0: np.array([1.0, 0.0]), 1: np.array([0.0, 1.0])})
    np.testing.assert_allclose(x, [0.0, 1.0])  # α = 1: the last arrival's model


# ------------------------------------------------------------------ a real deployment
# rows = schedule rounds, columns = clients; the churn driver reads one non-empty round per aggregation
CHURN_TRACE = """\
0,1,2
1,1,1
1,1,1
1,1,0
1,1,0
0,0,0
0,0,1
0,0,1
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_async_deployment_follows_the_churn_driver(tmp_path):
    """Three SuperNodes (real processes), FedBuff with K = 2 on real time, no round barrier, and the
    churn driver (``run_deployment(churn="rounds")``: deploy.async_churn) following the trace above
    by aggregations: node 2 is stopped (SIGTERM) after aggregation 2, the empty round is passed
    over, then nodes 0 and 1 stop and node 2 comes back as a new SuperNode process that alone makes
    aggregations 5 and 6. Jobs in flight to stopped nodes are recorded lost, nobody arrives while
    down, and no process is left afterwards."""
    import shutil

    if shutil.which("flower-superlink") is None:
        pytest.skip("flower-superlink not on PATH")
    from deploy.local import ProcessSite
    from deploy.procs import zombie_children
    from deploy.run import run_deployment

    trace = tmp_path / "trace.csv"
    trace.write_text(CHURN_TRACE)
    cfg = {"num-server-rounds": 6, "strategy": "fedbuff:k=2,max-norm-ratio=0",  # every buffer of 2: no start-up hold
           "availability": f"trace-matrix:path={trace}",
           "dataset": "digits", "model": "logreg", "local-steps": "steps:n=2", "partition": "iid",
           "round-timeout": 120.0, "round-deadline": 15.0, "checkpoint-every": 0, "device": "cpu",
           "results-dir": str(tmp_path / "results"), "progress": False}
    with ProcessSite(3, tmp_path / "work") as dep:
        out = run_deployment(dep, cfg, churn="rounds", timeout=500)
        dep.client_of_node()  # records the running incarnations' node ids
        node_ids = {i: list(dep.nodes[i].node_ids) for i in range(3)}
    assert out.completed, out.status
    assert out.ok and out.report is None and out.off_arrivals == {}  # nobody arrived while down
    driver = out.driver
    assert driver.skipped == [4] and [driver.slot(r) for r in range(1, 7)] == [0, 1, 2, 3, 5, 6]
    assert [(e["action"], e["round"], e["client"]) for e in driver.events] == [
        ("start", 1, 0), ("start", 1, 1), ("start", 1, 2), ("stop", 3, 2), ("stop", 5, 0), ("stop", 5, 1),
        ("start", 5, 2)]
    assert driver.up_during[4] == {0, 1} and driver.up_during[6] == {2}  # who ran while they were made
    rows = read_metrics(out.run_dir)
    assert [r["round"] for r in rows] == list(range(1, 7)) and all(len(r["arrivals"]) == 2 for r in rows)
    assert 2 not in rows[3]["participants"]  # stopped after row 2: at most row 3 holds its last job
    assert rows[5]["participants"] == [2]  # the new incarnation's replies make the last aggregation
    assert len(node_ids[2]) == 2 and len(set(node_ids[2])) == 2  # a new SuperNode process, a new node id
    # every lost job was a stopped incarnation's, and the stops of row 4 lost at least one of 0's and 1's
    lost = [node for r in rows for node in r["lost-nodes"]]
    assert sum(r["unavailable-nodes"] for r in rows) == len(lost)
    assert set(lost) <= {node_ids[0][0], node_ids[1][0], node_ids[2][0]}
    assert set(lost) & {node_ids[0][0], node_ids[1][0]}
    assert dep.leftovers() == [] and zombie_children() == []
    assert json.loads((out.run_dir / "config.json").read_text())["loop"] == "asynchronous"
