"""CPU-scale checks of the headline claims of the five rules of issue 30 (reports/new-rules.md).

    python benchmarks/new_rules_study.py run [STUDY ...]      # results/new-rules/<study>/<row>__s<seed>
    python benchmarks/new_rules_study.py report [STUDY ...]   # the tables and verdicts, from the folders

Every run is an in-process run of the real ServerApp and ClientApp (``experiments.inprocess``,
per-client engine) on the digits dataset (offline, 1797 8×8 images) with logistic regression. A study's score is the mean over its seeds of the mean of the
last ``LAST`` evaluations of the test accuracy of the global model. Runs that
exist are not run again (delete the folder to redo one).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "new-rules"
LAST = 3  # evaluations averaged at the end of a run

DIGITS = {"dataset": "digits", "model": "logreg", "batch-size": 32, "local-steps": "steps:n=5",
          "lr": 0.05, "lr-schedule": "constant", "solver": "sgd", "eval-every": 5, "checkpoint-every": 0,
          "progress": False, "availability-gate": "server", "engine": "per-client",
          "max-update-norm": 0.0, "max-norm-ratio": 0.0}


@dataclass(frozen=True)
class Study:
    """Rows (label -> run config overrides) over a base, seeds, and the claim: ``better`` beats each of
    ``than`` (higher ``metric``, or lower where ``lower`` is set)."""

    base: dict[str, Any]
    rows: dict[str, dict[str, Any]]
    claim: str
    better: str
    than: tuple[str, ...]
    seeds: tuple[int, ...] = (0, 1)
    metric: str = "test-accuracy"
    lower: bool = False
    also: tuple[str, ...] = ("test-loss",)  # reported beside, not judged
    columns: dict[str, dict[str, Any]] = field(default_factory=lambda: {"": {}})


STUDIES: dict[str, Study] = {
    # Crawshaw & Liu (NeurIPS 2024): under cyclic participation Amplified SCAFFOLD beats FedAvg and
    # SCAFFOLD. As the official code's image runs (``-availability periodic``): 5 groups of clients
    # take turns, 4 rounds each (P = 20 rounds), γ = 1.5; shards of 2 labels; 5 periods.
    "cyclic": Study(
        base={**DIGITS, "num-clients": 20, "partition": "shards:per_client=2", "num-server-rounds": 100,
              "availability": "group-cyclic:groups=5,window=4"},
        rows={"fedavg": {"strategy": "fedavg-active", "weighting": "equal"},
              "scaffold": {"strategy": "scaffold"},
              "amplified-scaffold": {"strategy": "amplified-scaffold:period=20,gamma=1.5"}},
        columns={"": {}, "30 local steps (the code's I)": {"local-steps": "steps:n=30"}},
        claim="Amplified SCAFFOLD ahead of SCAFFOLD and FedAvg under cyclic participation",
        better="amplified-scaffold", than=("scaffold", "fedavg"), seeds=(0, 1, 2)),
    # Rodio & Neglia (arXiv 2405.04171): an intermediate β beats both FedAvg (β = 0) and FedVARP
    # (β = 1) at moderate heterogeneity. Half the clients always on, half with p = 0.5 (the paper's).
    "fedstale": Study(
        base={**DIGITS, "num-clients": 20, "num-server-rounds": 60,
              # p_i = max(0.5, ...) label-correlated, capped at 1: clients between p = 0.5 and always on
              "availability": "fedau-bernoulli:pbar=0.5,pmin=0.5"},
        rows={"beta=0 (fedavg)": {"strategy": "fedstale:beta=0"},
              "beta=0.5": {"strategy": "fedstale:beta=0.5"},
              "beta=1 (fedvarp)": {"strategy": "fedstale:beta=1"}},
        columns={"dirichlet 0.1": {"partition": "client-dirichlet:alpha=0.1"},
                 "dirichlet 1.0": {"partition": "client-dirichlet:alpha=1.0"},
                 # rarer participation (p_i in [0.1, 1], mostly low), where stale updates matter more
                 "dirichlet 0.1, p low": {"partition": "client-dirichlet:alpha=0.1",
                                          "availability": "fedau-bernoulli:pbar=0.2,pmin=0.1"}},
        claim="β = 0.5 ahead of both β = 0 (FedAvg) and β = 1 (FedVARP)",
        better="beta=0.5", than=("beta=0 (fedavg)", "beta=1 (fedvarp)")),
    # Xiang et al. (arXiv 2306.00280): FedPBC ahead of FedAvg (active) under non-stationary availability.
    "fedpbc": Study(
        base={**DIGITS, "num-clients": 20, "partition": "client-dirichlet:alpha=0.1", "num-server-rounds": 80},
        rows={"fedavg": {"strategy": "fedavg-active", "weighting": "equal"},
              "fedpbc": {"strategy": "fedpbc"},
              # the official code's offline computation: a returning client first trains the rounds it missed
              "fedpbc (catch-up)": {"strategy": "fedpbc:catch-up=true"},
              # FedAWE's echo makes up for the local work of the rounds a client was away, which the
              # FedPBC code has its offline clients do and ours cannot (reports/new-rules.md)
              "fedawe": {"strategy": "fedawe"}},
        also=("test-loss", "test-accuracy-xbar"),
        columns={"sine": {"availability": "sine:gamma=0.3,period=20"},
                 "staircase": {"availability": "staircase:period=20,low=0.4"}},
        claim="FedPBC (as the official code runs it: catch-up) ahead of FedAvg over the active clients "
              "under non-stationary availability",
        better="fedpbc (catch-up)", than=("fedavg",)),
    # Sun et al. (ICLR 2025): under Markov participation with heterogeneous stationary probabilities
    # FedAvg is biased towards the frequent clients; the debiased FedAvg reaches the unbiased optimum.
    # FedAU's Markov chains (q = 0.1) with label-correlated stationary p_i in [0.05, 1].
    "markov": Study(
        base={**DIGITS, "num-clients": 20, "partition": "client-dirichlet:alpha=0.1", "num-server-rounds": 80,
              "availability": "markov:q=0.1,pbar=0.3,pmin=0.05"},
        rows={"fedavg-active": {"strategy": "fedavg-active", "weighting": "equal"},
              "debiased-fedavg": {"strategy": "debiased-fedavg"}},
        claim="debiased FedAvg ahead of FedAvg over the active clients (a balanced test set: the unbiased objective)",
        better="debiased-fedavg", than=("fedavg-active",), seeds=(0, 1, 2)),
}


def run_configs(name: str) -> list[tuple[str, str, str, int, dict[str, Any]]]:
    study = STUDIES[name]
    out = []
    for column, col_over in study.columns.items():
        for row, row_over in study.rows.items():
            for seed in study.seeds:
                cfg = {**study.base, **col_over, **row_over}
                cfg.update({"train-seed": seed, "data-seed": seed, "schedule-seed": seed})
                label = "__".join(p for p in (column, row, f"s{seed}") if p).replace(" ", "_")
                out.append((column, row, label, seed, cfg))
    return out


def run(names: list[str]) -> None:
    from experiments.inprocess import run_inprocess

    for name in names:
        for _, _, label, _, cfg in run_configs(name):
            folder = RESULTS / name / label
            if (folder / "final_model.pt").exists():
                continue
            run_inprocess({**cfg, "results-dir": str(RESULTS / name), "run-name": label})
            print(name, label, "done", flush=True)


def score(folder: Path, metric: str) -> float | None:
    path = folder / "metrics.jsonl"
    if not path.exists():
        return None
    values = [r[metric] for r in map(json.loads, path.read_text().splitlines()) if metric in r]
    return sum(values[-LAST:]) / len(values[-LAST:]) if values else None


def table(study: Study, name: str, metric: str) -> tuple[list[str], dict[tuple[str, str], list[float]]]:
    cells: dict[tuple[str, str], list[float]] = {}
    for column, row, label, _, _ in run_configs(name):
        value = score(RESULTS / name / label, metric)
        if value is not None:
            cells.setdefault((column, row), []).append(value)
    cols = list(study.columns)
    lines = [f"{metric} (mean of the last {LAST} evaluations; mean ± half the spread over seeds "
             f"{list(study.seeds)}):", "",
             "| rule | " + " | ".join(c or metric for c in cols) + " |", "|---|" + "---|" * len(cols)]
    for row in study.rows:
        vals = []
        for c in cols:
            v = cells.get((c, row), [])
            vals.append(f"{sum(v) / len(v):.4f} ± {(max(v) - min(v)) / 2:.4f} (n={len(v)})" if v else "—")
        lines.append(f"| {row} | " + " | ".join(vals) + " |")
    return lines + [""], cells


def report(names: list[str]) -> str:
    lines = []
    for name in names:
        study = STUDIES[name]
        lines += [f"### {name}: {study.claim}", ""]
        main_lines, cells = table(study, name, study.metric)
        lines += main_lines
        for metric in study.also:
            lines += table(study, name, metric)[0]
        verdicts = []
        for c in study.columns:
            mine = cells.get((c, study.better), [])
            wins, clear = [], []
            for other in study.than:
                theirs = cells.get((c, other), [])
                if not mine or not theirs:
                    continue
                a, b = sum(mine) / len(mine), sum(theirs) / len(theirs)
                wins.append(a < b if study.lower else a > b)
                # a gap within either row's half spread over seeds is not told apart from noise
                clear.append(abs(a - b) > max(max(mine) - min(mine), max(theirs) - min(theirs)) / 2)
            verdict = ("no runs" if not wins else
                       "reproduced" if all(wins) and all(clear) else
                       "reproduced, within the seeds' spread" if all(wins) else
                       "not reproduced" if not any(wins) else "partly")
            verdicts.append(f"{c or 'all'}: {verdict}")
        lines += [f"verdict ({study.metric}, {'lower' if study.lower else 'higher'} is better): "
                  + "; ".join(verdicts), ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "report"):
        print(__doc__)
        return 2
    names = argv[1:] or list(STUDIES)
    unknown = [n for n in names if n not in STUDIES]
    if unknown:
        print(f"unknown studies {unknown}; known: {list(STUDIES)}")
        return 2
    if argv[0] == "run":
        run(names)
    else:
        print(report(names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
