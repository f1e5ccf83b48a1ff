"""Default bounds drawn from honest variation (issue 27, items 2 and 4, data sizes).

Round 1 has no history: half the replies huge are rejected (the lower median is an honest norm),
and one or two replies are bounded relative to the model. A reply just under the ratio bound is
accepted, just over it rejected. num-examples is cut (not rejected) under data-size weighting.
"""

import numpy as np
import pytest
from replies import build_rule, rule_reply, start_round

from strategies import STRATEGIES
from strategies.bounds import MAX_EXAMPLES_RATIO, MAX_MODEL_RATIO, NormBounds, lower_median

assert MAX_MODEL_RATIO == 0.0  # the model-relative bound is opt-in (bounds.py says why)

RULES = sorted(STRATEGIES)
X = np.full(3, 12.0 / np.sqrt(3), np.float32)  # ‖x‖ = 12, as the honest model


def first_round(name, updates, n=None, **kwargs):
    n = n or len(updates)
    s = build_rule(name, n=n, max_failed_rounds=0, **kwargs)
    sent = start_round(s, 1, X, [100 + c for c in range(n)])
    replies = [rule_reply(name, sent[100 + c], X + u, c, u) for c, u in enumerate(updates) if 100 + c in sent]
    out, _ = s.aggregate_train(1, replies)
    return out["w"].numpy(), s


@pytest.mark.parametrize("name", RULES)
def test_round_one_half_the_replies_huge_are_rejected(name):
    honest = [np.array([0.1 * (1 + c), -0.05, 0.02], np.float32) for c in range(4)]
    huge = [np.array([9e5, 0.0, 0.0], np.float32)] * 4
    x, s = first_round(name, honest + huge)
    rejected = {node for node, _ in s.round_log.rejected}
    assert rejected == {104, 105, 106, 107} & set(s.round_log.sent)
    assert np.linalg.norm(x - X) < 1.0


@pytest.mark.parametrize("name", RULES)
def test_round_one_with_two_replies_is_bounded_by_the_model(name):
    spec = ("pow-d:variant=rpow-d," if name == "pow-d" else f"{name}:") + "max-model-ratio=10"  # opt-in
    x, s = first_round(name, [np.array([1e3, 0, 0], np.float32), np.array([0, 1e3, 0], np.float32)], spec=spec)
    reasons = [why for _, why in s.round_log.rejected]
    if "pow-d" not in name:
        assert len(reasons) == 2 and all("max-model-ratio 10 x the model's norm 12" in r
                                         for r in reasons)
    assert np.linalg.norm(x - X) < 1e-3


def test_just_under_the_ratio_bound_is_accepted_just_over_is_rejected():
    ratio = NormBounds().max_norm_ratio
    norms = [1.0, 1.2, 1.4, 1.6]  # with the extra one, the lower median is 1.4
    for extra, ok in ((0.999 * ratio * 1.4, True), (1.001 * ratio * 1.4, False)):
        reports = [*norms, extra]
        rejected: list[int] = []
        kept = NormBounds().check(reports, float, reports.index, lambda node, why, out=rejected: out.append(node))
        assert lower_median(reports) == 1.4
        assert (extra in kept) is ok and (rejected == []) is ok


@pytest.mark.parametrize("name", ["fedavg-active", "fednova", "pow-d"])
def test_a_huge_data_size_is_cut_to_the_bound_and_said(name):
    s = build_rule(name, n=4, weighting="num-examples")
    sent = start_round(s, 1, X, [100, 101, 102, 103])
    replies = [rule_reply(name, sent[100 + c], X + 0.1, c, **{"num-examples": 10}) for c in range(3)]
    replies.append(rule_reply(name, sent[103], X + 0.1, 3, **{"num-examples": 10**9}))
    _, metrics = s.aggregate_train(1, [r for r, c in zip(replies, range(4), strict=True) if 100 + c in sent])
    if 103 in sent:
        assert metrics["num-examples-clipped"] == 1 and s.round_log.rejected == []
        w = s.weights([type("R", (), {"num_examples": n})() for n in (10, 10, 10, int(MAX_EXAMPLES_RATIO * 10))])
        assert w[-1] == pytest.approx(MAX_EXAMPLES_RATIO / (MAX_EXAMPLES_RATIO + 3))


def test_honest_data_sizes_are_not_cut():
    """The measured honest spread (synthetic, lognormal sizes: 632 / 70 = 9 x the median) passes."""
    bounds = NormBounds()
    sizes = [40, 43, 50, 54, 68, 73, 87, 94, 130, 197, 330, 632]
    reports = [type("R", (), {"num_examples": n})() for n in sizes]
    assert bounds.clip_examples(reports) == 0 and [r.num_examples for r in reports] == sizes
