"""The widening channels, declared work and silence, against an adaptive attacker (issue 39, item 6).

A reply's norm bound is ``max-norm-ratio`` x the reference x its work factor (√(declared num-steps
/ the nodes' median), at most ``WORK_RATIO``) x its gap factor (1 + the rounds since its node was
last judged, at most ``GAP_RATIO``, rules whose client keeps state), the product at most
``WIDEN_RATIO``. :func:`attacks.widening` declares the num-steps that maximise its bound and stays
silent before its reply; its measured influence (m, one of 8) is the table "The widening channels"
of ``docs/threat-model.md`` (read from the file: the documented numbers are the tested ones, the
measured ones + 20 %).
"""

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from attacks import widening

from strategies import bounds as bounds_module
from strategies.bounds import GAP_RATIO, WIDEN_RATIO, WORK_RATIO, NormBounds

DOC = Path(__file__).resolve().parent.parent / "docs" / "threat-model.md"


def documented() -> dict[tuple[str, str], tuple[float, float]]:
    """(rule, attack) -> (m in the largest round, over the run) from the rows ``| `rule` | attack |
    round | run | ...`` of the section's table (after the cap: the first two numbers)."""
    text = DOC.read_text().split("**The widening channels, measured**")[1].split("\n\n")[1]
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\s*\|\s*`([^`]+)`\s*\|\s*([^|]+?)\s*\|\s*([\d.,]+)\s*\|\s*([\d.,]+)\s*\|", line)
        if m:
            rows[(m.group(1), m.group(2))] = (float(m.group(3).replace(",", "")), float(m.group(4).replace(",", "")))
    return rows


CLAIMS = {  # (rule, the table's attack) -> the attacker's arguments (cheap: few rounds)
    ("fedavg-active", "declared steps, every round, 5 rounds"): dict(declare=True, rounds=5),
    ("fednova", "declared steps, every round, 5 rounds"): dict(declare=True, rounds=5),
    ("mifa", "declared steps, silent 49, one reply"): dict(declare=True, gap=49),
    ("scaffold", "declared steps, silent 49, one reply"): dict(declare=True, gap=49),
    ("fedawe", "declared steps, silent 49, one reply"): dict(declare=True, gap=49),
}


@pytest.mark.parametrize(("rule", "attack"), sorted(CLAIMS))
def test_the_widening_attacker_stays_within_the_documented_figures(rule, attack):
    per_round, run = documented()[(rule, attack)]
    got = widening(rule, **CLAIMS[(rule, attack)])
    assert got["finite"] and got["honest-rejected"] == 0 and got["accepted"] == got["replies"]
    assert got["per-round"] <= per_round and got["run"] <= run, (rule, attack, got["per-round"], got["run"])
    # not vacuous: the declared work is accepted (FedNova: up to max-steps-ratio 300 x the honest 2)
    assert all(a.steps[0] == (600 if rule == "fednova" else 10**4) for a in got["attacks"])
    assert got["per-round"] > per_round / 1.2 / 1.5


def test_silence_and_declared_work_do_not_compound():
    """SCAFFOLD, silent 49 rounds: declaring 5,000 x the median steps on top gains nothing (the
    product is capped at WIDEN_RATIO = GAP_RATIO), where without the cap it gains 10 x."""
    silent = widening("scaffold", gap=49)
    both = widening("scaffold", gap=49, declare=True)
    assert both["per-round"] == pytest.approx(silent["per-round"], rel=0.05)
    assert silent["per-round"] > 20 * 2.69  # the gap is used: the every-round attacker gets 2.69 m


def judge(b: NormBounds, norms: dict[int, float], steps: dict[int, float]) -> set[int]:
    rejected: set[int] = set()
    reports = [SimpleNamespace(node=n, norm=v) for n, v in norms.items()]
    b.check(reports, lambda r: r.norm, lambda r: r.node, lambda n, _: rejected.add(n),
            steps_of=lambda r: steps[r.node], stateful=True)
    b.commit([])
    return rejected


@pytest.mark.parametrize("cap", [WIDEN_RATIO, math.inf])
def test_the_widening_product_is_capped_and_off_with_max_norm_ratio_0(cap, monkeypatch):
    """Node 8 back after 49 silent rounds (gap factor 50) declaring 100 x the median steps (work
    factor 10): its limit is R x the reference x min(500, WIDEN_RATIO)."""
    assert (WORK_RATIO, GAP_RATIO, WIDEN_RATIO) == (10, 50, 50)
    monkeypatch.setattr(bounds_module, "WIDEN_RATIO", cap)
    for over, ratio in ((0.99, 20.0), (1.01, 20.0), (1.01, 0.0)):
        b = NormBounds(max_norm_ratio=ratio)
        judge(b, dict.fromkeys(range(1, 9), 1.0), dict.fromkeys(range(1, 9), 2.0))
        for _ in range(49):
            judge(b, dict.fromkeys(range(1, 8), 1.0), dict.fromkeys(range(1, 8), 2.0))
        assert b.gap_factor(8) == 50 and b.work_factor(200.0, 2.0) == 10
        norm = over * 20 * min(500, cap)
        got = judge(b, {**dict.fromkeys(range(1, 8), 1.0), 8: norm}, {**dict.fromkeys(range(1, 8), 2.0), 8: 200.0})
        assert got == ({8} if over > 1 and ratio else set()), (over, ratio, cap)
