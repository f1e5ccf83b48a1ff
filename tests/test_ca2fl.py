"""CA2FL (Wang et al., ICLR 2024, Alg. 2) against a plain numpy reference written from the paper.

The reference (:func:`ca2fl_reference`) simulates the whole asynchronous algorithm on quadratic
clients with exact gradients (float64): a script of job dispatches and arrivals in a fixed order,
each client training from the model version it was sent, a buffer of M arrivals, the cache h^i of
every client (zero at start) and h_t = (1/N) Σ_{i∈[N]} h_t^i. The rule runs the same script through
its loop hooks (``job``, ``arrive``: the reply checks and the buffer) with float32 replies; the two
agree to float32 rounding, and FedBuff on the same script does not (the test can fail).
"""

from __future__ import annotations

import shutil
import uuid

import numpy as np
import pytest
import torch
from reference_rules import local_sgd, quadratic_clients
from replies import reply

from experiments.inprocess import run_inprocess
from server_app import checkpoint
from server_app.results import read_metrics
from strategies import STRATEGIES, build_strategy, named_arrays

N, D, STEPS, LR = 4, 5, 3, 0.1
PAPER = "max-norm-ratio=0,max-silent-rounds=0"  # the paper's rule: no start-up hold, no share cut, no expiry


def script(seed: int, events: int = 40) -> list[tuple[str, int]]:
    """A fixed order of ("send", i) and ("arrive", i) events: every client first gets a job; then
    at random an idle client gets one or a busy one arrives (so a fast client may arrive twice in a
    buffer, and updates arrive from old versions)."""
    rng = np.random.default_rng(seed)
    out, busy = [("send", i) for i in range(N)], set(range(N))
    for _ in range(events):
        idle = sorted(set(range(N)) - busy)
        if idle and (not busy or rng.random() < 0.5):
            i = int(rng.choice(idle))
            busy.add(i)
            out.append(("send", i))
        else:
            i = int(rng.choice(sorted(busy)))
            busy.discard(i)
            out.append(("arrive", i))
    return out


def ca2fl_reference(h, e, events, x0, m, eta):
    """CA2FL, Alg. 2, from the paper: h_1^i = 0; per buffer S_t, on each arrival of client i
    Δ_t ← Δ_t + (Δ^i − h_t^i) and h_{t+1}^i ← Δ^i; once |S_t| = M: v_t = h_t + Δ_t / M,
    x_{t+1} = x_t + η v_t, and h_{t+1} = (1/N) Σ_{i∈[N]} h_{t+1}^i (clients not in S_t keep h_t^i).
    Returns the model after every aggregation."""
    n = h.shape[0]
    x = np.array(x0, np.float64)
    cache = np.zeros((n, len(x0)))  # h_t^i, fixed during the buffer
    cache_next = cache.copy()  # h_{t+1}^i
    hbar = np.zeros(len(x0))  # h_t
    sent: dict[int, np.ndarray] = {}
    acc, size, models = np.zeros(len(x0)), 0, []
    for kind, i in events:
        if kind == "send":
            sent[i] = x.copy()
            continue
        start = sent.pop(i)
        delta = local_sgd(h, e, i, start, STEPS, LR)[0] - start
        acc += delta - cache[i]
        cache_next[i] = delta
        size += 1
        if size == m:
            x = x + eta * (hbar + acc / m)
            cache = cache_next.copy()
            hbar = cache.mean(axis=0)
            acc, size = np.zeros(len(x0)), 0
            models.append(x.copy())
    return models


def drive(spec, h, e, events, x0, eta=1.0):
    """The rule through its loop hooks on ``events``: float32 replies of the same local SGD from
    the model version each job was sent. Returns the model after every aggregation."""
    s = build_strategy(spec, num_clients=N, server_lr=eta)
    s.begin(named_arrays({"w": np.asarray(x0, np.float32)}))
    jobs, models, nodes = {}, [], {100 + i for i in range(N)}
    for kind, i in events:
        if kind == "send":
            msg, version = s.job(100 + i, 1)
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            jobs[i] = (msg, version, msg.content["arrays"]["w"].numpy().astype(np.float64))
            continue
        msg, version, start = jobs.pop(i)
        trained = local_sgd(h, e, i, start, STEPS, LR)[0]
        out = s.arrive(reply(msg, trained, **{"client-id": i}), msg, version, nodes)
        assert out.reason == "", out.reason
        if out.aggregated:
            models.append(np.array(s.current, np.float64))
    return models


@pytest.mark.parametrize("seed, m, eta", [(0, 3, 1.0), (1, 2, 0.5), (2, 4, 1.0), (3, 1, 1.0)])
def test_ca2fl_follows_the_papers_algorithm_on_a_fixed_arrival_order(seed, m, eta):
    h, e = quadratic_clients(N, D, seed)
    x0 = np.random.default_rng(seed + 10).uniform(-1, 1, D)
    events = script(seed)
    want = ca2fl_reference(h, e, events, x0, m, eta)
    got = drive(f"ca2fl:k={m},{PAPER}", h, e, events, x0, eta)
    assert len(want) == len(got) >= 4
    scale = max(np.abs(w).max() for w in want)
    assert max(np.abs(a - b).max() for a, b in zip(got, want, strict=True)) < 1e-5 * scale
    # FedBuff (the same buffer, no calibration) leaves the reference on the same script: the
    # comparison above can fail; their first aggregations agree (the caches are all zero then)
    fedbuff = drive(f"fedbuff:k={m},staleness=constant,max-norm-ratio=0", h, e, events, x0, eta)
    np.testing.assert_allclose(fedbuff[0], want[0], rtol=1e-5, atol=1e-6)
    assert max(np.abs(a - b).max() for a, b in zip(fedbuff, want, strict=True)) > 1e-2 * scale


def test_a_buffer_of_every_client_once_is_fedavg_and_the_cache_mean_runs_over_n():
    """With K = N and each client once in the buffer, h̄ − mean_B h_i cancels: x + mean Δ_i. With
    K = 2 of N = 4 after one full buffer, the step is mean_B(Δ_i − h_i) + (1/N) Σ_j h_j."""
    s = build_strategy(f"ca2fl:k=2,{PAPER}", num_clients=N)
    s.begin(named_arrays({"w": np.zeros(2, np.float32)}))
    d = {0: [1.0, 0.0], 1: [0.0, 2.0], 2: [4.0, 4.0], 3: [-1.0, 1.0]}
    x = np.zeros(2)
    for pair in ((0, 1), (2, 3)):  # first buffers: the caches of the pair are zero
        jobs = {i: s.job(100 + i, 1) for i in pair}
        for i, (msg, v) in jobs.items():
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            s.arrive(reply(msg, msg.content["arrays"]["w"].numpy() + np.float32(d[i]), **{"client-id": i}), msg, v,
                     {100, 101, 102, 103})
        hbar = np.mean([d[j] for j in (0, 1)], axis=0) * 2 / N if pair == (2, 3) else np.zeros(2)
        x = x + hbar + np.mean([d[i] for i in pair], axis=0)
        np.testing.assert_allclose(s.current, x, rtol=1e-6)
    assert s.table is not None and s.table.num_seen == N
    np.testing.assert_allclose(s.table.mean(), np.mean(list(d.values()), axis=0), rtol=1e-6)


def test_ca2fl_is_registered_asynchronous_with_equal_weights_only():
    cls = STRATEGIES["ca2fl"]
    assert cls.asynchronous and cls.needs_client_ids and cls.needs_num_clients
    with pytest.raises(ValueError, match="weighting"):
        build_strategy("ca2fl", num_clients=N, weighting="num-examples")
    with pytest.raises(ValueError, match="k=0"):
        build_strategy("ca2fl:k=0", num_clients=N)


def test_a_cached_update_expires_after_max_silent_rounds_aggregations():
    """Client 3 replies once, then is absent from 3 aggregations: with max-silent-rounds=2 its
    entry is cleared at the aggregation that finds it silent a third time (num-expired)."""
    s = build_strategy("ca2fl:k=1,max-norm-ratio=0,max-silent-rounds=2", num_clients=N)
    s.begin(named_arrays({"w": np.zeros(2, np.float32)}))
    expired = []
    for i in (3, 0, 0, 0):
        msg, v = s.job(100 + i, 1)
        msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        s.arrive(reply(msg, msg.content["arrays"]["w"].numpy() + 1, **{"client-id": i}), msg, v, {100, 103})
        expired.append(s.last_metrics.get("num-expired", 0.0))
    assert expired == [0.0, 0.0, 0.0, 1.0]
    assert s.table is not None and s.table.seen.tolist() == [True, False, False, False]


def test_the_state_with_a_half_full_buffer_resumes_to_the_same_numbers():
    """state_dict / load_state_dict between arrivals: the cache, the buffer and the kept versions
    come back, and the next arrivals give the same model bit for bit."""
    h, e = quadratic_clients(N, D, 5)
    events = script(5)
    cut = [k for k, (kind, _) in enumerate(events) if kind == "arrive"][7]  # mid-run, mid-buffer
    spec = f"ca2fl:k=3,{PAPER}"
    a = build_strategy(spec, num_clients=N)
    a.begin(named_arrays({"w": np.zeros(D, np.float32)}))
    jobs, nodes = {}, {100 + i for i in range(N)}

    def step(s, kind, i):
        if kind == "send":
            msg, version = s.job(100 + i, 1)
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            jobs[i] = (msg, version)
            return
        msg, version = jobs.pop(i)
        start = msg.content["arrays"]["w"].numpy().astype(np.float64)
        s.arrive(reply(msg, local_sgd(h, e, i, start, STEPS, LR)[0], **{"client-id": i}), msg, version, nodes)

    for kind, i in events[:cut]:
        step(a, kind, i)
    assert a.pending and a.table is not None
    saved = a.state_dict()
    b = build_strategy(spec, num_clients=N)
    b.load_state_dict(saved)
    b.current, b.layout, b._users = a.current.copy(), a.layout, dict(a._users)
    np.testing.assert_array_equal(b.table.rows, a.table.rows)
    for s in (a, b):
        in_flight = dict(jobs)
        for kind, i in events[cut:]:
            step(s, kind, i)
        jobs.clear()
        jobs.update(in_flight)
    assert a.version == b.version and np.array_equal(a.current, b.current)
    assert STRATEGIES["ca2fl"].read_state(saved).table["seen"].any()


QUADRATIC = {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "num-clients": N,
             "num-server-rounds": 6, "local-steps": "epochs:min=1,max=3", "batch-size": 1, "lr": 0.3,
             "availability": "bernoulli:p=0.7", "schedule-seed": 3, "progress": False, "eval-every": 0,
             "checkpoint-every": 2, "device": "cpu", "strategy": "ca2fl:k=2"}


def test_a_resumed_ca2fl_run_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    """The asynchronous loop on the virtual clock, a checkpoint at aggregation 2 (with the cache
    and the buffer), resumed: the same rows and the same final model, bit for bit."""
    monkeypatch.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)
    full = run_inprocess({**QUADRATIC, "results-dir": str(tmp_path), "run-name": "full"})
    copy = tmp_path / "cut"
    shutil.copytree(full, copy)
    (copy / "final_model.pt").unlink()
    for later in (copy / checkpoint.FOLDER).glob("round-*.pt"):
        if int(later.stem.split("-")[1]) > 2:
            later.unlink()
    saved = checkpoint.load(checkpoint.path_of(copy, 2))
    assert STRATEGIES["ca2fl"].read_state(saved["strategy"]).table is not None
    resumed = run_inprocess({**QUADRATIC, "results-dir": str(tmp_path), "resume-from": str(checkpoint.path_of(copy, 2))})

    def rows(run):
        return [{k: v for k, v in r.items() if k not in ("round-time", "wall-time")} for r in read_metrics(run)]

    assert len(rows(full)) == 6 and rows(resumed) == rows(full)
    a, b = torch.load(full / "final_model.pt"), torch.load(resumed / "final_model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
