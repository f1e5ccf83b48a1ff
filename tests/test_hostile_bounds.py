"""Default bounds drawn from honest variation (issue 27, items 2 and 4, data sizes).

Round 1 has no history: half the replies huge are cut to the ratio bound, newcomers' (the lower
median is an honest norm), and one or two replies are bounded relative to the model. A reply just under the ratio bound is
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


def at_the_limit(updates):
    """The round-1 limit of ``updates`` (max-norm-ratio x the lower median of their norms, as the
    strategy takes them: Δ_i = (x + u) − x in float32) and each update scaled down to it."""
    deltas = [(X + u) - X for u in updates]
    limit = NormBounds().max_norm_ratio * lower_median(float(np.linalg.norm(d.astype(np.float64))) for d in deltas)
    return limit, [u if np.linalg.norm(d) <= limit else d * np.float32(limit / np.linalg.norm(d.astype(np.float64)))
                   for u, d in zip(updates, deltas, strict=True)]


@pytest.mark.parametrize("name", RULES)
def test_round_one_half_the_replies_huge_are_cut_to_one_limit_each(name):
    """Round 1 has no entries: the huge replies are newcomers', cut to the limit (not rejected)
    and reported; the round is the round in which they replied at the limit. A rule whose cut
    payload cannot be scaled with Δ_i (SCAFFOLD's Δc_i, FedAWE's and FedPBC's echoes) still
    rejects them (strategies/bounds.py)."""
    honest = [np.array([0.1 * (1 + c), -0.05, 0.02], np.float32) for c in range(4)]
    huge = [np.array([9e5, 0.0, 0.0], np.float32)] * 4
    x, s = first_round(name, honest + huge)
    hostile = {104, 105, 106, 107} & set(s.round_log.sent)
    if name.startswith(("scaffold", "amplified-scaffold", "fedawe", "fedpbc")):
        assert {node for node, _ in s.round_log.rejected} == hostile and np.linalg.norm(x - X) < 1.0
        return
    assert s.round_log.rejected == [] and {node for node, _ in s.round_log.cut} == hostile
    assert all("a newcomer: cut to the bound" in why for _, why in s.round_log.cut)
    limit, capped = at_the_limit(honest + huge)
    assert all(np.linalg.norm(u) <= limit * (1 + 1e-6) for u in capped)
    want, _ = first_round(name, capped)  # the same round, the huge replies at the limit
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5 * limit)


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


def test_data_sizes_are_not_cut_by_default():
    """Honest data sizes span 1 to 10,000 (issue 39): a claim cannot be told from a large client."""
    assert MAX_EXAMPLES_RATIO == 0.0


@pytest.mark.parametrize("name", ["fedavg-active", "fednova", "pow-d"])
def test_a_huge_data_size_is_cut_to_the_bound_and_said(name):
    spec = ("pow-d:variant=rpow-d," if name == "pow-d" else f"{name}:") + "max-examples-ratio=30"
    s = build_rule(name, n=4, spec=spec, weighting="num-examples")
    sent = start_round(s, 1, X, [100, 101, 102, 103])
    replies = [rule_reply(name, sent[100 + c], X + 0.1, c, **{"num-examples": 10}) for c in range(3)]
    replies.append(rule_reply(name, sent[103], X + 0.1, 3, **{"num-examples": 10**9}))
    _, metrics = s.aggregate_train(1, [r for r, c in zip(replies, range(4), strict=True) if 100 + c in sent])
    if 103 in sent:
        assert metrics["num-examples-clipped"] == 1 and s.round_log.rejected == []
        w = s.weights([type("R", (), {"num_examples": n})() for n in (10, 10, 10, 30 * 10)])
        assert w[-1] == pytest.approx(30 / (30 + 3))


def test_honest_data_sizes_are_not_cut():
    """The measured honest spread (synthetic, lognormal sizes: 632 / 70 = 9 x the median) passes
    the opt-in cut at 30."""
    bounds = NormBounds(max_examples_ratio=30)
    sizes = [40, 43, 50, 54, 68, 73, 87, 94, 130, 197, 330, 632]
    reports = [type("R", (), {"num_examples": n})() for n in sizes]
    assert bounds.clip_examples(reports) == 0 and [r.num_examples for r in reports] == sizes


# ---------------------------------------------- robust aggregation (spec key robust, item 3)
MEAN_RULES = sorted(n for n, c in STRATEGIES.items() if c.mean_of_updates)


def one_round(spec, updates, **kwargs):
    name = spec.split(":")[0]
    s = build_rule(name, n=len(updates), spec=spec, max_failed_rounds=0, **kwargs)
    sent = start_round(s, 1, X, [100 + c for c in range(len(updates))])
    out, metrics = s.aggregate_train(1, [rule_reply(name, sent[100 + c], X + u, c, u)
                                         for c, u in enumerate(updates) if 100 + c in sent])
    return out["w"].numpy() - X, metrics, s


def test_the_rules_that_average_the_rounds_updates_are_the_ones_robust_applies_to():
    assert MEAN_RULES == ["fedadagrad", "fedadam", "fedavg-active", "fedavg-all", "fedavgm", "fednova",
                          "fedyogi", "full", "pow-d"]


@pytest.mark.parametrize("name", sorted(set(RULES) - set(MEAN_RULES)))
def test_median_is_refused_where_the_update_is_no_mean_of_the_rounds_updates(name):
    with pytest.raises(ValueError, match="robust=median replaces a mean"):
        build_rule(name, spec=f"{name}:robust=median")


@pytest.mark.parametrize("spec", ["fedavg-active:robust=median", "fedavg-active:robust=trimmed-mean:beta=0.25",
                                  "full:robust=median", "fedavgm:robust=median", "fedavg-all:robust=median"])
def test_median_and_trimmed_mean_are_the_coordinatewise_statistics(spec):
    rng = np.random.default_rng(0)
    ups = [rng.normal(0, 0.1, 3).astype(np.float32) for _ in range(7)] + [np.array([0.4, -0.4, 0.4], np.float32)]
    step, _, s = one_round(spec, ups, weighting="equal" if "fedavg-all" not in spec else "auto")
    want = np.median(ups, axis=0) if "median" in spec else np.mean(np.sort(ups, axis=0)[2:-2], axis=0)
    np.testing.assert_allclose(step, want, rtol=1e-5, atol=1e-6)
    assert s.round_log.rejected == []  # the outlier is within the ratio bound: robust, not rejected


# SCAFFOLD's control-variate bound (Δc_i) still rejects: clip scales Δ_i only
@pytest.mark.parametrize("name", sorted(set(RULES) - {"fedawe", "fedpbc", "scaffold", "amplified-scaffold"}))
def test_clip_scales_an_update_beyond_the_bound_to_it_instead_of_rejecting(name):
    spec = ("pow-d:variant=rpow-d," if name == "pow-d" else f"{name}:") + "robust=clip,max-norm-ratio=2"
    honest = [np.array([0.1 * (1 + c / 10), 0.0, 0.0], np.float32) for c in range(5)]
    _, metrics, s = one_round(spec, [*honest, np.array([0.0, 50.0, 0.0], np.float32)])
    if 105 in s.round_log.sent:
        assert s.round_log.rejected == [] and metrics["num-clipped"] == 1 and 5 in s.round_log.participants
        assert s.bounds.history[-1] == pytest.approx(2 * 0.12, rel=1e-6)  # the clipped norm: 2 x lower median


def test_clip_is_refused_for_the_echo_rules_and_bad_values_name_the_key():
    for name in ("fedawe", "fedpbc"):
        with pytest.raises(ValueError, match="robust=clip"):
            build_rule(name, spec=f"{name}:robust=clip")
    for bad in ("mean", "trimmed-mean:beta=0.7", "median:beta=0.1"):
        with pytest.raises(ValueError, match="robust"):
            build_rule("fedavg-active", spec=f"fedavg-active:robust={bad}")


def test_robust_off_is_the_papers_mean_bit_for_bit():
    rng = np.random.default_rng(1)
    ups = [rng.normal(0, 0.1, 3).astype(np.float32) for _ in range(6)]
    for name in MEAN_RULES:
        spec = "pow-d:variant=rpow-d" if name == "pow-d" else name
        a, _, _ = one_round(spec, ups)
        b, _, _ = one_round(spec + (",robust=off" if ":" in spec else ":robust=off"), ups)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("n", [1, 2, 3, 8, 21])
def test_the_statistics_are_numpys_median_and_scipys_trimmed_mean(n):
    from scipy.stats import trim_mean

    from strategies.robust import Robust

    a = np.random.default_rng(n).normal(size=(n, 50)).astype(np.float32)
    np.testing.assert_allclose(Robust("median").combine(a), np.median(a, axis=0), rtol=1e-6, atol=1e-7)
    for beta in (0.1, 0.2, 0.45):
        np.testing.assert_allclose(Robust("trimmed-mean", beta).combine(a), trim_mean(a.astype(np.float64), beta, axis=0),
                                   rtol=1e-5, atol=1e-6)
