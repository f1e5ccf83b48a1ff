"""Reports state only what their results support: numbers, rounds, seeds, evaluation counts and
orderings are recomputed here from the runs' own files and compared with the text."""

import json
import math
import re

import numpy as np
import pytest

from experiments.presets import PRESETS
from experiments.report import Window, write_report
from experiments.study import Claim, Sweep
from experiments.sweep import run_sweep
from server_app.results import read_metrics

TINY = Sweep(
    name="tiny",
    base={**PRESETS["smoke"].base, "num-server-rounds": 3},
    axes={"dynamics": {"sine": {"availability": "sine:gamma=0.3,period=4"}},
          "rule": {"fedavg-active": {"strategy": "fedavg-active"}, "fedavg-all": {"strategy": "fedavg-all"},
                   "fedawe": {"strategy": "fedawe:clip=0.5"}}},
    seeds=(0,),
    notes="A tiny sweep for the report tests.",
    paper={"sine / fedavg-active": 62.1, "sine / fedavg-all": 52.1, "sine / fedawe": 63.5},
    paper_setup={"num-server-rounds": 2000, "num-clients": 6},
    claims=(Claim("FedAWE beats both FedAvgs", "fedawe [x̄]", ("fedavg-active", "fedavg-all")),
            Claim("FedAvg over all clients stays close to FedAvg over the active ones", "fedavg-all",
                  ("fedavg-active",), within=0.5)),
)
NUMBER = re.compile(r"\d+(?:\.\d+)?")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    done = run_sweep(TINY, out, num_cpus=1)
    assert [error for _, _, error in done] == ["", "", ""]
    return out


def report_of(results, tmp_path, window=None):
    md = write_report(TINY, results, tmp_path / "tiny", window=window or Window())
    return md.read_text(), json.loads(md.with_suffix(".json").read_text())


def truth(results, window_first_round=None, last=None):
    """label -> score × 100, recomputed from metrics.jsonl without the report's code."""
    out, counts = {}, []
    for rule in TINY.axes["rule"]:
        rows = read_metrics(results / f"sine__{rule}__s0")
        rounds = max(r["round"] for r in rows)
        for metric, label in (("test-accuracy", rule), ("test-accuracy-xbar", f"{rule} [x̄]")):
            values = [(r["round"], r[metric]) for r in rows if metric in r]
            if not values:
                continue
            first = rounds - math.ceil(0.1 * rounds) + 1
            picked = [v for rnd, v in values if rnd >= first] if last is None else [v for _, v in values][-last:]
            out[label] = round(100 * float(np.mean(picked)), 1)
            counts.append(len(picked))
    return out, counts


def allowed_numbers(obj):
    """Every number in the summary, as the report may print it, and those inside its strings."""
    if isinstance(obj, bool) or obj is None:
        return set()
    if isinstance(obj, (int, float)):  # the text's numbers are matched without their sign
        obj = abs(obj)
        return {str(obj), f"{obj:.1f}"} | ({str(int(obj))} if float(obj).is_integer() else set())
    if isinstance(obj, str):
        return set(NUMBER.findall(obj))
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    return {n for k, v in items for n in allowed_numbers(v) | allowed_numbers(k if isinstance(k, str) else None)}


def test_every_number_in_the_report_is_computed_from_the_results(results, tmp_path):
    text, summary = report_of(results, tmp_path)
    body = text.replace(TINY.notes, "")  # the preset's fixed text: citations and the paper's setup
    stray = set(NUMBER.findall(body)) - allowed_numbers(summary)
    assert not stray, f"numbers in the report that the results do not give: {sorted(stray)}"
    # the rounds, seeds and evaluations stated are the runs'
    rounds = {max(r["round"] for r in read_metrics(results / f"sine__{rule}__s0")) for rule in TINY.axes["rule"]}
    assert rounds == {3} and "rounds per run: 3;" in text and "seeds found: 0)" in text
    _, counts = truth(results)
    assert set(counts) == {1} and "(round 3 of 3: 1 per run)" in text
    assert "- `num-server-rounds`: paper `2000`, here `3`" in text and "`num-clients`: paper" not in text


def test_orderings_and_gaps_agree_with_the_recomputed_scores(results, tmp_path):
    text, summary = report_of(results, tmp_path)
    scores, _ = truth(results)
    assert set(scores) == {"fedavg-active", "fedavg-all", "fedawe", "fedawe [x̄]"}  # x̄ only for FedAWE
    line = next(line for line in text.splitlines() if line.startswith("- **sine** (higher is better): "))
    ranked = [(m.group(1), float(m.group(2)))
              for m in re.finditer(r"([a-z-]+(?: \[x̄\])?) (\d+\.\d)", line.split(": ", 1)[1])]
    assert sorted(label for label, _ in ranked) == sorted(scores)
    assert all(scores[label] == value for label, value in ranked)
    assert [v for _, v in ranked] == sorted(scores.values(), reverse=True)
    for a, b in zip(ranked, ranked[1:], strict=False):
        assert f"{a[0]} vs {b[0]}: {abs(a[1] - b[1]):.1f} apart (one seed: no spread measured)." in text
    paper = {"fedavg-active": 62.1, "fedavg-all": 52.1, "fedawe [x̄]": 63.5}  # FedAWE's paper number: x̄ row
    pairs = [(a, b) for a in paper for b in paper if a < b]
    agree = sum((scores[a] - scores[b]) * (paper[a] - paper[b]) > 0 for a, b in pairs)
    assert f"Paper: {agree} of {len(pairs)} pairs ordered as in the paper" in text
    assert f"| fedawe [x̄] | {scores['fedawe [x̄]']:.1f} (n=1) [paper 63.5] |" in text


def test_last_k_evaluations_says_how_many_were_averaged(results, tmp_path):
    text, _ = report_of(results, tmp_path, Window(evals=5))
    scores, counts = truth(results, last=5)
    assert set(counts) == {3}  # 3 rounds, one evaluation each: fewer than the 5 asked for
    assert "mean over the last 5 evaluations of each run (3 actually averaged per run)" in text
    assert f"| fedavg-all | {scores['fedavg-all']:.1f} (n=1) [paper 52.1] |" in text


def test_no_results_gives_a_report_that_says_so(tmp_path):
    text = write_report(TINY, tmp_path / "nothing", tmp_path / "r").read_text()
    assert "No finished runs found." in text and "|" not in text


def test_verdicts_follow_the_recomputed_gaps(results, tmp_path):
    text, summary = report_of(results, tmp_path)
    raw = {}  # unrounded scores × 100
    for rule in TINY.axes["rule"]:
        rows = read_metrics(results / f"sine__{rule}__s0")
        for metric, label in (("test-accuracy", rule), ("test-accuracy-xbar", f"{rule} [x̄]")):
            if any(metric in r for r in rows):
                raw[label] = 100 * float(np.mean([r[metric] for r in rows if metric in r and r["round"] == 3]))
    beats, near = summary["verdicts"]
    for c in beats["comparisons"]:
        gap = raw["fedawe [x̄]"] - raw[c["other"]]
        assert abs(c["gap"] - gap) < 0.07
        if abs(gap) > 0.1:  # one seed: held exactly when FedAWE is ahead
            assert c["held"] == (gap > 0)
    held = sum(c["held"] for c in beats["comparisons"])
    assert beats["verdict"] == {2: "reproduced", 1: "partly reproduced", 0: "not reproduced"}[held]
    assert [c["paper-gap"] for c in beats["comparisons"]] == [1.4, 11.4]  # 63.5 - 62.1, 63.5 - 52.1
    (c,) = near["comparisons"]
    assert c["held"] == (c["gap"] >= -0.5)
    assert near["verdict"] == ("reproduced" if c["held"] else "not reproduced")
    assert (f"- **{beats['verdict']}**: FedAWE beats both FedAvgs (fedawe [x̄] ahead in every seed in {held} "
            "of 2 comparisons).") in text
    gap = beats["comparisons"][1]["gap"]
    ahead = int(raw["fedawe [x̄]"] - raw["fedavg-all"] > 0)  # one seed
    assert (f"  - sine, fedawe [x̄] vs fedavg-all: {gap:+.1f} in fedawe [x̄]'s favour (per seed "
            f"{beats['comparisons'][1]['per-seed'][0]:+.2f}: ahead in {ahead} of 1; paper +11.4)") in text


def test_the_early_window_averages_the_first_rounds(results, tmp_path):
    text, _ = report_of(results, tmp_path, Window(fraction=0.5, early=True))
    rows = read_metrics(results / "sine__fedavg-all__s0")
    first = [r["test-accuracy"] for r in rows if r["round"] <= 2 and "test-accuracy" in r]  # ceil(0.5 * 3) = 2
    assert len(first) == 2
    assert "mean over the evaluations in the first 50% of rounds (rounds 1–2 of 3: 2 per run)" in text
    assert f"| fedavg-all | {100 * float(np.mean(first)):.1f} (n=1) [paper 52.1] |" in text
