"""The numbers of a sweep's report, from its results folders: each run summarised over a window of
its evaluations (``Window``), cells of seeds, rankings, seed-paired gaps and the verdict on each of
the claims a study declares (a paper's). Everything :func:`summarise` returns is JSON; ``experiments.report`` renders it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from experiments.study import Claim, Sweep
from experiments.sweep import SWEEP_LOG
from server_app.results import read_metrics

PAPER_METRIC = "test-accuracy"  # what the presets' paper numbers are
XBAR = "-xbar"  # suffix of the x̄ score's metric (``test-accuracy-xbar``)
HIDDEN_KEYS = {"results-dir", "run-name", "data-dir", "progress", "resume-from", "device", "state-dir",
               "seeds", "versions", "schedule", "train-seed", "data-seed", "schedule-seed"}


@dataclass(frozen=True)
class Window:
    """Which evaluations summarise a run: those in the last ``fraction`` of rounds, the last
    ``evals``, or (``early``) those in the first ``fraction`` of rounds, while the rules still learn."""

    fraction: float = 0.1
    evals: int = 0  # > 0: the last K evaluations instead
    early: bool = False

    def span(self, rounds: int) -> tuple[int, int]:
        k = max(1, math.ceil(self.fraction * rounds))
        return (1, k) if self.early else (rounds - k + 1, rounds)

    def describe(self, rounds: list[int], counts: list[int]) -> str:
        got = _span(counts)
        if self.evals:
            return f"mean over the last {self.evals} evaluations of each run ({got} actually averaged per run)"
        spans = ", ".join(f"round {a} of {r}" if a == b else f"rounds {a}–{b} of {r}"
                          for r in rounds for a, b in [self.span(r)])
        where = "first" if self.early else "last"
        return f"mean over the evaluations in the {where} {self.fraction:.0%} of rounds ({spans}: {got} per run)"

    def pick(self, rows: list[dict[str, Any]], metric: str) -> list[float]:
        if self.evals:
            return [r[metric] for r in rows if metric in r][-self.evals:]
        first, last = self.span(max(r["round"] for r in rows))
        return [r[metric] for r in rows if metric in r and first <= r["round"] <= last]


def _span(values: Iterable[int]) -> str:
    values = sorted(set(values))
    return "none" if not values else str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"


@dataclass
class Cell:
    """One combination of axis labels (a table cell), over the seeds found."""

    scores: dict[int, float] = field(default_factory=dict)  # seed -> summary (scaled)
    xbar: dict[int, float] = field(default_factory=dict)
    evals: list[int] = field(default_factory=list)
    curves: list[tuple[list[int], list[float], list[float]]] = field(default_factory=list)  # rounds, x^t, x̄
    secs: list[float] = field(default_factory=list)


def find_runs(sweep: Sweep, results: Path) -> dict[tuple[str, ...], dict[int, Path]]:
    """(axis labels) -> seed -> finished run folder ``<label>__...__s<seed>``, whatever seeds ran."""
    found: dict[tuple[str, ...], dict[int, Path]] = {}
    if not results.is_dir():
        return found
    for run_dir in sorted(results.iterdir()):
        *labels, seed = run_dir.name.split("__")
        if (len(labels) != len(sweep.axes) or not seed.startswith("s") or not seed[1:].isdigit()
                or not (run_dir / "final_model.pt").exists()
                or any(label not in values for label, values in zip(labels, sweep.axes.values(), strict=True))):
            continue
        found.setdefault(tuple(labels), {})[int(seed[1:])] = run_dir
    return found


def collect(sweep: Sweep, results: Path, metric: str, window: Window, scale: float) -> dict[tuple[str, ...], Cell]:
    table: dict[tuple[str, ...], Cell] = {}
    for labels, runs in find_runs(sweep, results).items():
        cell = Cell()
        for seed, run_dir in sorted(runs.items()):
            rows = read_metrics(run_dir)
            values = window.pick(rows, metric) if rows else []
            if not values:
                continue
            cell.scores[seed] = scale * float(np.mean(values))
            cell.evals.append(len(values))
            if xbar := window.pick(rows, metric + XBAR):
                cell.xbar[seed] = scale * float(np.mean(xbar))
            cell.curves.append(([r["round"] for r in rows if metric in r], [r[metric] for r in rows if metric in r],
                                [r[metric + XBAR] for r in rows if metric + XBAR in r]))
            cell.secs.append(rows[-1]["wall-time"])
        if cell.scores:
            table[labels] = cell
    return table


def _stats(scores: dict[int, float], digits: int) -> dict[str, Any]:
    """Mean, std, the 95% confidence interval of the mean over seeds (Student's t; None for one
    seed) and the per-seed values."""
    from scipy import stats

    values = np.array(list(scores.values()))
    mean, std = float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0
    half = float(stats.t.ppf(0.975, len(values) - 1)) * std / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": round(mean, digits), "std": round(std, digits),
            "ci95": None if half is None else [round(mean - half, digits), round(mean + half, digits)],
            "n": len(values), "seeds": {str(k): round(v, digits + 1) for k, v in sorted(scores.items())}}


def paired_gap(a: dict[str, Any], b: dict[str, Any], sign: float, digits: int) -> dict[str, Any]:
    """a − b (times ``sign``) seed by seed: same seed, same data, schedule and training seeds.

    ``order``: "ahead" / "behind" when every shared seed agrees (one seed: its sign), "mixed" when
    the order flips between seeds; a gap that rounds to 0 at ``digits`` is never ahead or behind.
    """
    seeds = sorted(set(a["seeds"]) & set(b["seeds"]), key=int)
    per_seed = [round(sign * (a["seeds"][k] - b["seeds"][k]), digits + 1) for k in seeds]
    gap = round(float(np.mean(per_seed)), digits) if per_seed else 0.0
    order = ("ahead" if gap > 0 and all(g > 0 for g in per_seed) else
             "behind" if gap < 0 and all(g < 0 for g in per_seed) else "mixed")
    return {"gap": gap, "per-seed": per_seed, "seeds-ahead": sum(g > 0 for g in per_seed), "order": order}


def verdict_word(held: int, total: int) -> str:
    """Reproduced: held in every comparison; not: in none; partly: in between."""
    return ("no runs" if not total else "reproduced" if held == total
            else "not reproduced" if held == 0 else "partly reproduced")


def columns_of(sweep: Sweep) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [()]
    for values in list(sweep.axes.values())[:-1]:
        out = [(*prefix, v) for prefix in out for v in values]
    return out


DP_FIGURES = ("dp-epsilon", "dp-epsilon-worst-client", "dp-delta")


def privacy_of(found: dict[tuple[str, ...], dict[int, Path]]) -> dict[str, dict[str, Any]]:
    """Cell label -> the (ε, δ) its DP runs ended with (their last row's ``dp-*`` figures, the mean
    over seeds; runs without DP are left out) and the mean participants per round."""
    out: dict[str, dict[str, Any]] = {}
    for labels, runs in found.items():
        ended = [rows for rows in map(read_metrics, runs.values()) if rows and "dp-epsilon" in rows[-1]]
        if ended:
            out[" / ".join(labels)] = {
                **{k: float(np.mean([rows[-1][k] for rows in ended])) for k in DP_FIGURES},
                "dp-noise-multiplier": max(r.get("dp-noise-multiplier", 0.0) for rows in ended for r in rows),
                "participants-per-round": float(np.mean([len(r["participants"]) for rows in ended for r in rows])),
                "rounds": sorted({rows[-1]["round"] for rows in ended}), "seeds": len(ended)}
    return out


def summarise(sweep: Sweep, results: Path, metric: str = "test-accuracy", window: Window = Window()) -> dict[str, Any]:
    """Everything the report states, computed from the results folder (JSON-serialisable)."""
    higher = "accuracy" in metric
    sign = 1 if higher else -1  # gaps are signed so that > 0 favours the first rule
    scale = 100.0 if higher else 1.0
    digits = 1 if higher else 3  # accuracy in points, losses and distances as they are
    table = collect(sweep, results, metric, window, scale)
    papers = sweep.paper if metric == PAPER_METRIC else {}  # the papers' numbers are accuracies
    found = find_runs(sweep, results)
    configs = [json.loads((d / "config.json").read_text()) for runs in found.values() for d in runs.values()
               if (d / "config.json").exists()]
    rounds = sorted({c["num-server-rounds"] for c in configs})
    row_axis = list(sweep.axes)[-1]
    columns = {}
    for col in columns_of(sweep):
        entries = []  # (label, stats, paper)
        for rule in sweep.axes[row_axis]:
            cell = table.get((*col, rule))
            if cell is None:
                continue
            paper = papers.get(" / ".join((*col, rule)))
            entries.append({"label": rule, **_stats(cell.scores, digits), "paper": None if cell.xbar else paper})
            if cell.xbar:
                entries.append({"label": f"{rule} [x̄]", **_stats(cell.xbar, digits), "paper": paper})
        columns[" / ".join(col) or sweep.name] = {"entries": entries, **_findings(entries, sign, digits)}
    constant = {k: configs[0][k] for k in sorted(configs[0]) if k not in HIDDEN_KEYS
                and all(c.get(k) == configs[0][k] for c in configs)} if configs else {}
    varying = sorted({k for c in configs for k in c if k not in HIDDEN_KEYS and k not in constant})
    paper_setup = {k: {"paper": v, "ours": sorted({str(c.get(k)) for c in configs})}
                   for k, v in sweep.paper_setup.items() if any(str(c.get(k)) != str(v) for c in configs)}
    return {
        "preset": sweep.name, "study": sweep.name, "metric": metric, "scale": scale, "higher-is-better": higher,
        "digits": digits, "verdicts": [verdict(claim, columns, sign, digits) for claim in sweep.claims],
        "window": window.describe(rounds, [n for c in table.values() for n in c.evals]),
        "rounds": rounds, "seeds": sorted({s for runs in found.values() for s in runs}),
        "runs-found": sum(len(runs) for runs in found.values()),
        "runs-per-seed": len(sweep.runs(seeds=[0])),
        "sweep-invocations": (log := _sweep_log(results)),
        "sweep-wall-minutes": round(sum(i["wall-seconds"] for i in log) / 60, 1),
        "sweep-runs-done": sum(i["runs-done"] for i in log),
        "sweep-commands": sweep_commands(log),
        **_run_times(found, log, table),
        "columns": columns, "setup": constant,
        "setup-varying": {k: sorted({str(c.get(k)) for c in configs}) for k in varying},
        "differs-from-paper": paper_setup,
        "privacy": privacy_of(found),
    }


def verdict(claim: Claim, columns: dict[str, Any], sign: int, digits: int) -> dict[str, Any]:
    """Check ``claim`` in every column it names: each gap rule − other (signed so that > 0 is better).

    The gap is paired by seed (:func:`paired_gap`). Beats: held when ``rule`` is ahead in every
    seed. Within w: held when the mean gap is >= -w. The verdict: :func:`verdict_word`.
    """
    comparisons = []
    for name in claim.columns or list(columns):
        entries = {e["label"]: e for e in columns.get(name, {}).get("entries", [])}
        for other in claim.others:
            a, b = entries.get(claim.rule), entries.get(other)
            if a is None or b is None:
                continue
            pair = paired_gap(a, b, sign, digits)
            held = pair["order"] == "ahead" if claim.within is None else pair["gap"] >= -claim.within
            paper_gap = None if a["paper"] is None or b["paper"] is None else round(sign * (a["paper"] - b["paper"]), 1)
            comparisons.append({"column": name, "other": other, **pair, "held": held, "paper-gap": paper_gap})
    held = sum(c["held"] for c in comparisons)
    return {"claim": claim.text, "rule": claim.rule, "within": claim.within,
            "verdict": verdict_word(held, len(comparisons)), "why": claim.why, "held": held, "comparisons": comparisons}


def _run_times(found: dict[tuple[str, ...], dict[int, Path]], log: list[dict[str, Any]],
               table: dict[tuple[str, ...], Cell]) -> dict[str, Any]:
    """Seconds per run as the sweep measured them (its log's ``run-seconds``, the newest
    invocation's for a run done twice), else the runs' own loop clock (``wall-time``)."""
    measured: dict[str, float] = {}
    for entry in log:
        measured.update(entry.get("run-seconds", {}))
    names = [d.name for runs in found.values() for d in runs.values()]
    if names and all(n in measured for n in names):
        return {"wall-time-per-run": round(float(np.mean([measured[n] for n in names])), 1),
                "wall-time-source": "sweep"}
    secs = [s for c in table.values() for s in c.secs]
    return {"wall-time-per-run": round(float(np.mean(secs)), 1) if secs else None, "wall-time-source": "loop"}


def sweep_commands(log: list[dict[str, Any]]) -> list[str]:
    """The distinct command lines that made these results, in the order first used."""
    return list(dict.fromkeys(entry["command"] for entry in log if entry.get("command")))


def _sweep_log(results: Path) -> list[dict[str, Any]]:
    path = results / SWEEP_LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _findings(entries: list[dict[str, Any]], sign: int, digits: int) -> dict[str, Any]:
    """Ordering by mean, gaps between neighbours (paired by seed: does the order hold in every seed?), paper pairs."""
    ranked = sorted(entries, key=lambda e: -sign * e["mean"])
    gaps = [{"between": [a["label"], b["label"]], "gap": round(abs(a["mean"] - b["mean"]), digits),
             "seeds": len(pair["per-seed"]), "order": pair["order"]}
            for a, b in zip(ranked, ranked[1:], strict=False) for pair in [paired_gap(a, b, sign, digits)]]
    with_paper = [e for e in entries if e["paper"] is not None]
    pairs = [(a, b) for i, a in enumerate(with_paper) for b in with_paper[i + 1:] if a["paper"] != b["paper"]]
    disagree = [[a["label"], b["label"]] for a, b in pairs if (a["mean"] - b["mean"]) * (a["paper"] - b["paper"]) <= 0]
    return {"ranking": [e["label"] for e in ranked], "gaps": gaps,
            "paper-pairs": len(pairs), "paper-pairs-agree": len(pairs) - len(disagree), "paper-disagree": disagree}
