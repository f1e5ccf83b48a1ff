"""FL-FDMS, Stale and Full (Wang & Xu): hand-computed rounds, races, clustered data, checkpoints."""

import math

import numpy as np
import pytest
import torch
from replies import reply, run_round, start_round

from strategies import STRATEGIES, build_strategy
from strategies.base import ClientReport
from strategies.protocol import IGNORE_AVAILABILITY
from strategies.rules.fdms import FLFDMS, Full, Stale, _components

R_DIAG = 0.5 * (1 + 1 / math.sqrt(2))  # r of [1,0] (or [0,1]) with [1,1]


def reports(updates: dict[int, list[float]]) -> list[ClientReport]:
    return [ClientReport(c, 100 + c, np.asarray(d, np.float32), 10) for c, d in sorted(updates.items())]


def test_registered_with_spec_parameters():
    assert {"fl-fdms", "stale", "full"} <= set(STRATEGIES)
    s = build_strategy("fl-fdms:reduction=true,theta-scale=0.5,beta=1.0,theta-offset=0.01", num_clients=20)
    assert isinstance(s, FLFDMS) and s.reduction
    # the authors' code (comr.py): 0.5 sqrt((2 ln(2·20²·500·3) − 2 ln 0.01) / (2·0.5·t)) + 0.01, t = 1-based
    arg = 2 * math.log(2 * 400 * 500 * 3) - 2 * math.log(0.01)
    assert s.theta(99) == pytest.approx(0.5 * math.sqrt(arg / 100) + 0.01)
    paper = build_strategy("fl-fdms", num_clients=20)
    assert paper.theta(0) == pytest.approx(math.sqrt(arg / 0.5))
    with pytest.raises(ValueError, match="weights clients equally"):
        build_strategy("fl-fdms", num_clients=3, weighting="num-examples")
    with pytest.raises(ValueError, match="p=1.5"):
        FLFDMS(num_clients=3, p=1.5)


def test_similarities_running_mean_friend_and_substituted_update():
    s = FLFDMS(num_clients=3)
    # round 0 (server round 1): everyone
    x1 = run_round(s, 1, np.zeros(2), {0: np.array([1.0, 0]), 1: np.array([0.0, 1]), 2: np.array([1.0, 1])})
    np.testing.assert_allclose(x1, [2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(s.R, [[0, 0.5, R_DIAG], [0.5, 0, R_DIAG], [R_DIAG, R_DIAG, 0]])
    assert s.count.tolist() == [[0, 1, 1], [1, 0, 1], [1, 1, 0]]
    # round 1: client 1 dropped; its friend by the previous scores: R_12 > R_10 -> client 2
    x2 = run_round(s, 2, x1, {0: np.array([1.0, 0]), 2: np.array([-1.0, 0])})
    assert s.friends == {1: 2}
    np.testing.assert_allclose(x2, x1 + (np.array([1.0, 0]) + 2 * np.array([-1.0, 0])) / 3, rtol=1e-6)
    # cos(Δ0, Δ2) = −1 -> r = 0 enters the running mean of pair (0, 2) only
    assert s.R[0, 2] == s.R[2, 0] == pytest.approx(R_DIAG / 2)
    assert s.R[0, 1] == 0.5 and s.R[1, 2] == pytest.approx(R_DIAG)
    assert s.count[0, 2] == 2 and s.count[0, 1] == s.count[1, 2] == 1
    # round 2: client 2 dropped: R_21 = R_DIAG > R_20 = R_DIAG/2 -> client 1
    _, m = s.aggregate(2, x2, reports({0: [0.0, 3.0], 1: [0.0, 1.0]}))
    assert s.friends == {2: 1} and m["num-substituted"] == 1 and m["similarity-pairs"] == 1


def test_friend_is_the_best_running_mean_among_the_active():
    s = FLFDMS(num_clients=4)
    s.aggregate(0, np.zeros(2), reports({0: [1, 0], 1: [1, 0.2], 2: [0, 1], 3: [0.2, 1]}))
    # client 3 drops: R_32 ≈ .990 > R_31 ≈ .692 > R_30 ≈ .598
    x, m = s.aggregate(1, np.zeros(2), reports({0: [0, 1], 1: [0, -1], 2: [0, 1]}))
    assert s.friends == {3: 2}
    np.testing.assert_allclose(x, np.array([0, 1 - 1 + 2]) / 4)
    assert m["similarity-pairs"] == 3


def test_a_client_never_seen_with_the_active_ones_is_skipped():
    s = FLFDMS(num_clients=3)
    s.aggregate(0, np.zeros(1), reports({0: [1.0], 1: [2.0]}))  # client 2 failed in round 0
    x, m = s.aggregate(1, np.zeros(1), reports({0: [3.0]}))
    assert s.friends == {1: 0} and m["num-unmatched"] == 1
    np.testing.assert_allclose(x, [(3.0 + 3.0) / 3])


def test_empty_round_keeps_model_and_state():
    s = FLFDMS(num_clients=2, reduction=True)
    s.aggregate(0, np.zeros(1), reports({0: [1.0], 1: [1.0]}))
    before = FLFDMS.read_state(s.state_dict())
    x, m = s.aggregate(1, np.array([5.0], np.float32), [])
    assert x.tolist() == [5.0] and m["similarity-pairs"] == 0
    np.testing.assert_array_equal(s.R, before.R)


@pytest.mark.parametrize("cls", [FLFDMS, Stale])
def test_reply_without_client_id_is_rejected_not_a_crash(cls):
    s = cls(num_clients=2)
    sent = start_round(s, 1, np.zeros(1), [100, 101])
    # replies are judged in arrival order: the one without a client id after one that has it
    arrays, metrics = s.aggregate_train(1, [reply(sent[101], [3.0], **{"client-id": 1}), reply(sent[100], [1.0])])
    assert metrics["num-rejected"] == 1 and "client-id" in s.round_log.rejected[0][1]
    assert s.round_log.participants == [1]


def test_round_zero_and_full_ask_every_client():
    fdms, full = FLFDMS(num_clients=2), Full(num_clients=2)
    for rnd in (1, 2, 3):
        sent = start_round(fdms, rnd, np.zeros(1), [100, 101])
        assert all(m.content["config"].get(IGNORE_AVAILABILITY, False) == (rnd == 1) for m in sent.values())
        sent = start_round(full, rnd, np.zeros(1), [100, 101])
        assert all(m.content["config"][IGNORE_AVAILABILITY] is True for m in sent.values())
    assert FLFDMS(num_clients=2, warmup_rounds=0).train_config(0, []) == {}
    new = run_round(full, 1, np.zeros(2), {0: np.array([1.0, 0]), 1: np.array([3.0, 2])})
    np.testing.assert_allclose(new, [2.0, 1.0])


def test_stale_substitutes_last_uploads():
    s = Stale(num_clients=3)
    x = np.zeros(2, np.float32)
    x, m = s.aggregate(0, x, reports({0: [1, 0], 1: [0, 2]}))  # client 2 never seen: zero
    np.testing.assert_allclose(x, [1 / 3, 2 / 3])
    x1, m = s.aggregate(1, x, reports({2: [3, 3]}))
    np.testing.assert_allclose(x1, x + np.array([4, 5]) / 3, rtol=1e-6)
    assert m["num-stale"] == 2
    x2, _ = s.aggregate(2, x1, reports({0: [-1, 0]}))  # y_0 replaced
    np.testing.assert_allclose(x2, x1 + np.array([2, 5]) / 3, rtol=1e-6)
    x3, _ = s.aggregate(3, x2, [])
    np.testing.assert_array_equal(x3, x2)
    t = Stale(num_clients=3)
    t.load_state_dict(s.state_dict())
    a, _ = s.aggregate(4, x3, reports({1: [1, 1]}))
    b, _ = t.aggregate(4, x3, reports({1: [1, 1]}))
    np.testing.assert_array_equal(a, b)


def test_races_eliminate_and_compute_only_candidate_pairs():
    # Θ ≈ 0.3 (tiny square-root term), so one observation decides
    s = FLFDMS(num_clients=4, reduction=True, theta_scale=1e-12, theta_offset=0.3)
    _, m = s.aggregate(0, np.zeros(2), reports({0: [1, 0], 1: [1, 0.1], 2: [0, 1], 3: [-1, 0]}))
    assert m["similarity-pairs"] == 6 and m["theta"] == pytest.approx(0.3)
    # r01 ≈ .9975, r02 = .5, r03 = 0, r12 ≈ .5498, r13 ≈ .0025, r23 = .5
    assert s.candidates.tolist() == [[False, True, False, False], [True, False, False, False],
                                     [True, True, False, True], [False, False, True, False]]
    # round 1: 0 and 1 drop; neither has an active candidate -> fall back to all active clients
    x, m = s.aggregate(1, np.zeros(2), reports({2: [0, 1], 3: [-1, 0]}))
    assert s.friends == {0: 2, 1: 2} and m["friend-fallbacks"] == 2
    np.testing.assert_allclose(x, (3 * np.array([0, 1]) + np.array([-1, 0])) / 4)
    # all active: only pairs with a candidate on either side: (0,1), (0,2), (1,2), (2,3)
    before = s.R.copy()
    _, m = s.aggregate(2, np.zeros(2), reports({0: [1, 0], 1: [1, 0], 2: [1, 0], 3: [1, 0]}))
    assert m["similarity-pairs"] == 4
    assert s.R[0, 3] == before[0, 3] and s.R[1, 3] == before[1, 3] and s.count[0, 3] == 1
    assert s.count[2, 3] == 3  # rounds 0, 1, 2


def test_components_group_blocks():
    adj = np.zeros((5, 5), bool)
    for i, j in [(0, 3), (3, 4), (1, 2)]:
        adj[i, j] = adj[j, i] = True
    assert _components(adj).tolist() == [0, 1, 1, 0, 0]


def clustered_rounds(rounds, n=20, clusters=5, d=200, alpha=0.5, seed=0):
    """Updates = cluster centre + noise (and a random scale); dropout keeping one per cluster."""
    rng = np.random.default_rng(seed)
    cluster = np.arange(n) // (n // clusters)
    centres = rng.standard_normal((clusters, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    for t in range(rounds):
        active = np.arange(n)
        if t > 0:
            keep = [rng.choice(np.flatnonzero(cluster == c)) for c in range(clusters)]
            rest = np.setdiff1d(np.arange(n), keep)
            drop = rng.choice(rest, int(alpha * n), replace=False)
            active = np.setdiff1d(np.arange(n), drop)
        updates = {int(i): (centres[cluster[i]] + 0.3 * rng.standard_normal(d) / math.sqrt(d))
                   * rng.uniform(0.5, 2.0) for i in active}
        yield t, updates


def test_reduction_keeps_the_friends_and_computes_fewer_pairs():
    n, clusters = 20, 5
    cluster = np.arange(n) // (n // clusters)
    code = dict(theta_scale=0.5, beta=1.0, theta_offset=0.01)  # the authors' Θ_t
    full, fast = FLFDMS(num_clients=n, **code), FLFDMS(num_clients=n, reduction=True, **code)
    xa = xb = np.zeros(200, np.float32)
    pairs = {"full": 0, "fast": 0}
    for t, updates in clustered_rounds(120, n, clusters):
        xa, ma = full.aggregate(t, xa, reports(updates))
        xb, mb = fast.aggregate(t, xb, reports(updates))
        pairs["full"] += ma["similarity-pairs"]
        pairs["fast"] += mb["similarity-pairs"]
        assert fast.friends == full.friends
        assert all(cluster[k] == cluster[f] for k, f in full.friends.items())
        assert mb["similarity-dots"] <= ma["similarity-dots"]
    np.testing.assert_allclose(xa, xb, rtol=1e-5, atol=1e-6)
    assert pairs["fast"] < 0.6 * pairs["full"]  # elimination starts near round 45 (Θ_t ≈ gap ≈ .45)
    same = cluster[:, None] == cluster[None, :]
    assert not (fast.candidates & ~same).any()  # every candidate set shrank to its cluster ...
    assert (fast.candidates == (same & ~np.eye(n, dtype=bool))).all()  # ... and kept all of it
    # candidate pairs carry the same running means with and without the reduction
    np.testing.assert_allclose(fast.R[fast.candidates], full.R[fast.candidates], rtol=1e-5)


def test_checkpoint_round_trip_continues_identically():
    a = FLFDMS(num_clients=20, reduction=True, theta_scale=0.5, beta=1.0, theta_offset=0.01)
    b = None
    xa = xb = np.zeros(200, np.float32)
    for t, updates in clustered_rounds(70, seed=3):
        if t == 60:
            b = FLFDMS(num_clients=20, reduction=True, theta_scale=0.5, beta=1.0, theta_offset=0.01)
            b.load_state_dict(a.state_dict())
            xb = xa.copy()
        xa, ma = a.aggregate(t, xa, reports(updates))
        if b is not None:
            xb, mb = b.aggregate(t, xb, reports(updates))
            assert ma == mb and a.friends == b.friends
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(a.candidates, b.candidates)


def test_clustered_digits_run_finds_friends_in_the_own_cluster(tmp_path):
    """The real round loop + ClientApp: round 0 reaches everyone, then R ranks cluster mates first."""
    from experiments.inprocess import run_inprocess
    from server_app.results import read_metrics
    from workloads.partition import cluster_of

    n, rounds, part = 20, 3, "clustered:clusters=5,classes_per_cluster=2,samples=60"
    run_dir = run_inprocess({
        "num-clients": n, "num-server-rounds": rounds, "strategy": "fl-fdms", "dataset": "digits",
        "partition": part, "availability": "dropout:alpha=0.5,keep_per_cluster=true",
        "model": "logreg", "local-steps": "steps:n=3", "eval-every": 0, "checkpoint-every": rounds, "progress": False,
        "results-dir": str(tmp_path), "run-name": "fdms",
    })
    rows = read_metrics(run_dir)
    assert len(rows[0]["participants"]) == n and rows[0]["similarity-pairs"] == n * (n - 1) // 2
    assert all(len(r["participants"]) == n // 2 and r["num-substituted"] == n // 2 for r in rows[1:])
    state = torch.load(run_dir / "checkpoints" / f"round-{rounds:04d}.pt", weights_only=False)["strategy"]
    R = np.array(FLFDMS.read_state(state).R)  # through the rule, not raw keys
    np.fill_diagonal(R, -np.inf)
    cluster = cluster_of(part, n)
    assert (cluster[R.argmax(axis=1)] == cluster).all()


def test_one_client_similar_to_everyone_stands_in_for_at_most_its_share():
    """Client 0 is every dropped client's most similar (issue 27): with the default it stands in
    for max(2, ⌈0.5 x 6⌉) = 3 of the 6 dropped, the others take their next friend; with
    max-friend-share=1 (the paper's argmax) for all 6."""
    for share, coef0 in ((0.5, 1 + 3), (1.0, 1 + 6)):
        s = FLFDMS(num_clients=8, max_friend_share=share, warmup_rounds=0)
        s.aggregate(0, np.zeros(2), reports({c: [1.0, 0.1 * c] for c in range(8)}))
        s.R[2:, 0], s.R[2:, 1] = 0.99, 0.9  # client 0 most similar to every other, client 1 next
        x, m = s.aggregate(1, np.zeros(2), reports({0: [1.0, 0.0], 1: [0.0, 1.0]}))
        np.testing.assert_allclose(x, (coef0 * np.array([1.0, 0.0]) + (8 - coef0) * np.array([0.0, 1.0])) / 8)
        assert m["num-substituted"] == 6 and m.get("friends-moved", 0) == (3 if share < 1 else 0)
