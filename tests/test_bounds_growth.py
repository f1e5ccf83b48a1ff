"""The norm reference's capped growth (``max-reference-growth``, strategies.bounds): it follows the
nodes' latest norms up to G x their first ones, and SCAFFOLD's c_i bound follows the same capped
growth. The attack it stops is measured in tests/test_scaffold_channel.py; the honest cases that
chose G in tests/honest_cases.py (warm-up, warm-up-noisy, shift)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from strategies import build_strategy
from strategies.bounds import MAX_REFERENCE_GROWTH, NormBounds


def judge(bounds: NormBounds, norms: list[float]) -> list[int]:
    """One round: nodes 0.. reply with ``norms``; returns the rejected nodes (and commits)."""
    reports = [SimpleNamespace(node_id=i, norm=n) for i, n in enumerate(norms)]
    rejected: list[int] = []
    bounds.new_round(fix=True)
    kept = bounds.check(reports, lambda r: r.norm, lambda r: r.node_id, lambda node, why: rejected.append(node))
    bounds.commit(kept)
    return rejected


@pytest.mark.parametrize(("growth", "reference"), [(5.0, 5.0), (2.0, 2.0), (1.0, 1.0), (0.0, 16.0), (200.0, 16.0)])
def test_the_reference_follows_the_latest_norms_up_to_g_times_the_first(growth, reference):
    bounds = NormBounds(max_reference_growth=growth)
    for norm in (1.0, 4.0, 16.0):  # the honest norms grow 4 x a round, within 20 x any reference
        assert judge(bounds, [norm] * 8) == []
    assert bounds.reference({}) == reference  # max(first, min(latest, G x first)); 0: uncapped
    assert bounds.growth() == reference
    # a reply beyond R x the capped reference is rejected, one within it is not
    assert judge(bounds, [16.0] * 7 + [20.0 * reference * 1.01]) == [7]


def test_a_reference_below_the_first_norms_is_the_first_norms_and_growth_is_one():
    bounds = NormBounds()
    judge(bounds, [1.0] * 8)
    judge(bounds, [0.01] * 8)  # converging: the latest norms shrink, the first ones stay
    assert bounds.reference({}) == 1.0 and bounds.growth() == 1.0


def test_scaffolds_control_variate_bound_follows_the_models_capped_growth():
    s = build_strategy("scaffold", num_clients=8)
    assert s.variate_bounds.follows is s.bounds and s.variate_bounds.first_only
    judge(s.bounds, [1.0] * 8)
    judge(s.variate_bounds, [3.0] * 8)
    judge(s.bounds, [1e3] * 8)  # the honest updates grew 1000 x: the model's reference follows 5 x
    assert s.bounds.growth() == MAX_REFERENCE_GROWTH
    assert s.variate_bounds.reference({}) == 3.0 * MAX_REFERENCE_GROWTH  # first ‖c_j^+‖ x the capped growth


@pytest.mark.parametrize("value", ["0.5", "-1", "inf"])
def test_a_bad_max_reference_growth_names_the_key(value):
    with pytest.raises(ValueError, match="max-reference-growth"):
        build_strategy(f"fedavg-active:max-reference-growth={value}", num_clients=4)
