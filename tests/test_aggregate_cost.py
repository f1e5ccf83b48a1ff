"""The server's fast paths give the numbers of the plain ones: reply rows slotted by client id,
weighted sums as BLAS products over them, client tables updated blockwise, .npy headers parsed
once (strategies.layout, strategies.weighting, strategies.memory, strategies.replies)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array

from strategies.layout import Scratch
from strategies.memory import ClientTable
from strategies.replies import HEADERS, ReplyRejected, decode
from strategies.weighting import matrix_runs, weighted_sum


def test_weighted_sum_of_scratch_rows_equals_the_plain_sum_whatever_the_order():
    rng = np.random.default_rng(0)
    scratch = Scratch()
    scratch.new_round(7, 300)
    rows = []
    for slot in rng.permutation(7):  # replies arrive in any order; each fills its slot
        scratch.begin(int(slot))
        row = scratch.row(300)
        row[...] = rng.normal(size=300)
        rows.append((int(slot), row))
    ordered = [r for _, r in sorted(rows, key=lambda p: p[0])]
    w = rng.random(7)
    plain = sum(np.float32(wi) * v.astype(np.float64) for wi, v in zip(w, ordered, strict=True))
    for pick in ([0, 1, 2, 3, 4, 5, 6], [6, 2, 0, 4], [5], [1, 3, 5]):  # runs, strided runs, gaps
        got = weighted_sum(w[pick], [ordered[i] for i in pick])
        assert got.dtype == np.float32
        want = sum(np.float32(w[i]) * ordered[i].astype(np.float64) for i in pick)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        shuffled = rng.permutation(len(pick))
        again = weighted_sum(w[pick][shuffled], [ordered[pick[i]] for i in shuffled])
        np.testing.assert_array_equal(got, again)  # the rows' order, not the order given
    np.testing.assert_allclose(weighted_sum(w, ordered), plain, rtol=1e-5, atol=1e-6)
    assert len(matrix_runs(ordered)) == 1 and len(matrix_runs([ordered[0], ordered[2], ordered[3]])) == 2
    assert scratch.stacked("s", ordered).base is not None  # the rows themselves, no copy
    np.testing.assert_array_equal(scratch.stacked("s", ordered[::-1]), np.stack(ordered[::-1]))


def test_scratch_without_slots_and_beyond_the_announced_replies():
    scratch = Scratch()
    scratch.new_round(2, 5)
    rows = [scratch.row(5) for _ in range(4)]  # two more than announced: rows of their own
    for i, r in enumerate(rows):
        r[...] = i
    assert len({r.ctypes.data for r in rows}) == 4
    np.testing.assert_array_equal(weighted_sum([1, 1, 1, 1], rows), np.full(5, 6.0))
    scratch.new_round(0, 5)
    assert len(scratch.pools[0]) >= 4  # grown to what the last round needed
    float64 = [np.ones(3), 2 * np.ones(3)]
    assert weighted_sum([0.5, 0.25], float64).dtype == np.float64 and weighted_sum([], []) == 0


def test_set_rows_equals_set_row_one_by_one():
    rng = np.random.default_rng(1)
    a, b = ClientTable(9, 1000), ClientTable(9, 1000)
    for _ in range(30):
        ids = [int(i) for i in rng.choice(9, size=int(rng.integers(1, 9)), replace=False)]
        vectors = [rng.normal(size=1000).astype(np.float32) for _ in ids]
        scales = rng.random(len(ids)).tolist()
        weights = rng.random(len(ids)).tolist()
        fresh, stale = np.zeros(1000), np.zeros(1000)
        want_fresh = sum(w * np.float32(s) * v.astype(np.float64) for w, s, v in zip(weights, scales, vectors, strict=True))
        want_stale = sum(w * a.rows[i].astype(np.float64) for w, i in zip(weights, ids, strict=True))
        a.set_rows(ids, vectors, scales, weights=weights, fresh=fresh, stale=stale)
        for i, v, s in zip(ids, vectors, scales, strict=True):
            b.set_row(i, v * np.float32(s))
        np.testing.assert_allclose(fresh, want_fresh, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(stale, want_stale, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(a.rows, b.rows)
    np.testing.assert_array_equal(a.seen, b.seen)
    np.testing.assert_allclose(a.mean(), b.mean(), rtol=1e-5, atol=1e-6)  # float32 block sums per round
    a.recompute_sum()
    np.testing.assert_allclose(a.mean(), a.rows.mean(axis=0, dtype=np.float64), atol=1e-12)
    with pytest.raises(ValueError, match="distinct"):
        a.set_rows([1, 1], [np.zeros(1000, np.float32)] * 2)


def test_a_remembered_header_says_what_numpy_says():
    HEADERS.clear()
    for value in (np.arange(6, dtype=np.float32).reshape(2, 3), np.asfortranarray(np.ones((3, 2))),
                  np.array(2.5, np.float16), np.arange(4, dtype=np.int64)):
        array = Array(value)
        first, second = decode(array, "w"), decode(array, "w")  # parsed, then remembered
        np.testing.assert_array_equal(first, value)
        np.testing.assert_array_equal(second, value)
        assert second.dtype == value.dtype and second.shape == value.shape
    assert len(HEADERS) == 4
    broken = Array(np.ones(3, np.float32))
    broken.data = broken.data[:-4]  # a remembered header, too few bytes behind it
    with pytest.raises(ReplyRejected, match="data bytes"):
        decode(broken, "w")


@pytest.mark.parametrize("spec", ["fedavg-active:stream=false", "fedexp:stream=false", "fednova:stream=false",
                                  "fedvarp", "fl-fdms", "fedaware:min-seen=1", "fedavg-active", "fedexp", "fednova"])
def test_the_order_replies_arrive_in_does_not_change_the_model(spec):
    """Holding every reply (slotted by client id): bit for bit. A rule that streams folds the
    replies in arrival order (float64 sums, strategies.streaming): equal to float rounding."""
    from strategies import build_strategy
    from tests.replies import reply, start_round

    rng = np.random.default_rng(5)
    x = rng.normal(size=50).astype(np.float32)
    updates = {c: rng.normal(size=50).astype(np.float32) * 0.1 for c in range(6)}
    out = []
    for order in ([0, 1, 2, 3, 4, 5], [4, 0, 5, 2, 1, 3]):
        s = build_strategy(spec, num_clients=6)
        sent = start_round(s, 1, x, [100 + c for c in range(6)])
        replies = [reply(sent[100 + c], x + updates[c], **{"client-id": c, "num-examples": 10 + c, "num-steps": 5,
                                                            "a-norm": 5.0}) for c in order]
        arrays, _ = s.aggregate_train(1, replies)
        assert not s.round_log.rejected
        out.append(arrays["w"].numpy())
        streams = not s.reason_held()
    if streams:
        np.testing.assert_allclose(out[0], out[1], rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(out[0], out[1])


def test_the_aggregate_time_benchmark_times_every_registered_rule(monkeypatch):
    """benchmarks/aggregate_time.py builds replies every rule accepts (the payloads each declares
    it reads back: SCAFFOLD's Δc_i, FedAWE's and FedPBC's u_i and echo factor) and times them:
    every registered rule, a warm-up and a timed round, nothing rejected (it asserts so)."""
    import importlib.util
    from pathlib import Path

    from flwr.supercore.task_identity import TaskIdentity

    from strategies import STRATEGIES

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "aggregate_time.py"
    spec = importlib.util.spec_from_file_location("aggregate_time", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.gc, "collect", lambda: 0)  # the benchmark's pauses between timings
    TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = 1  # Message() needs them
    x = bench.model_arrays(64, np.random.default_rng(0))
    timed = []
    for name in sorted(STRATEGIES):
        ours, theirs, _ = bench.time_side_by_side(bench.SPECS.get(name, name).format(r=4), 4, x, 1)
        assert ours.shape == theirs.shape == (1, 2) and np.all(ours >= 0)
        timed.append(name)
    assert timed == sorted(STRATEGIES) and {"scaffold", "amplified-scaffold", "fedpbc", "fedawe"} <= set(timed)
