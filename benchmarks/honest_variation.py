"""How much honest replies vary within a round: the data behind the default bounds (issue 27).

Honest in-process runs (the real ServerApp loop and ClientApp, cohort engine) over the project's
workloads: non-IID Dirichlet partitions, heterogeneous local work (``local-steps`` =
``epochs:min=..,max=..``), local momentum, data sizes that differ by orders of magnitude (the
FedProx synthetic data), and every rule's own checked quantity. Each reply's numbers are recorded
where the base checks them (:meth:`strategies.bounds.NormBounds.check`, before any rejection):

- ``norm/round-median``: the rule's checked norm (``update_norm``: ‖Δ_i‖, FedAWE's ‖u_i‖/(t − τ_i))
  over the median of the same round's replies (rounds with 3+ replies);
- ``norm/reference``: the same norm over the reference the ratio test uses (the median of the
  last 64 accepted norms and this round's);
- ``norm/model``: ‖Δ_i‖ / ‖x^t‖ (the scale a first round without history can use), also round 1
  alone;
- ``num-steps/round-median`` and ``num-examples/round-median`` (data-size weights);
- FedNova: ``a-norm/num-steps`` (1 for plain SGD, up to 1/(1 − β) with momentum β) and the
  normalised update ‖Δ_i‖/‖a_i‖_1 over its round median;
- FedAWE: the raw echo ‖u_i‖ over its round median, and the echo factor t − τ_i.

It prints, per quantity, the quantiles over all replies, and the false-rejection rate (share of
honest replies above the bound) at candidate bounds.

    python benchmarks/honest_variation.py              # every workload (a few minutes on 2 cores)
    python benchmarks/honest_variation.py --quick      # two workloads, fewer rounds
    python benchmarks/honest_variation.py --rounds 30 --workloads digits-dir0.2-momentum --save rows.json
    python benchmarks/honest_variation.py --load rows.json other.json   # the report of saved rows
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import tempfile
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import numpy as np

from experiments.inprocess import run_inprocess
from strategies import STRATEGIES, bounds as bounds_module

DIGITS = {"dataset": "digits", "model": "mlp", "num-clients": 20, "batch-size": 32, "lr": 0.05}
SYNTHETIC = {"dataset": "synthetic", "model": "logreg", "num-clients": 16, "partition": "natural",
             "batch-size": 16, "lr": 0.01, "weighting": "num-examples"}
# rules whose checked quantity or trajectory differ (fedavg-all, fedau, fedvarp and stale train the
# clients exactly as fedavg-active, mifa or fl-fdms do: the same local solver from the same kind of model)
ALL_RULES = ("fedavg-active", "mifa", "fl-fdms", "fedexp", "fedaware", "fednova", "fedawe", "pow-d")
# name -> (run config, rules): each workload one kind of honest heterogeneity
WORKLOADS: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "digits-dir0.5": ({**DIGITS, "partition": "dirichlet:alpha=0.5", "local-steps": "steps:n=10",
                       "availability": "bernoulli:p=0.5"}, ALL_RULES),
    "digits-cnn-dir0.5": ({**DIGITS, "model": "cnn", "partition": "dirichlet:alpha=0.5", "local-steps": "steps:n=10",
                           "availability": "bernoulli:p=0.5"}, ("fedavg-active", "fednova")),
    "digits-dir0.2-hetero-steps": ({**DIGITS, "partition": "dirichlet:alpha=0.2", "local-steps": "epochs:min=1,max=5",
                                    "availability": "bernoulli:p=0.5"},
                                   ("fedavg-active", "fednova", "fedawe", "mifa", "fedvarp", "fedexp")),
    "digits-dir0.2-momentum": ({**DIGITS, "partition": "dirichlet:alpha=0.2", "local-steps": "epochs:min=1,max=3",
                                "solver": "momentum", "momentum": 0.9, "lr": 0.01, "availability": "bernoulli:p=0.5"},
                               ("fedavg-active", "fednova", "fedawe", "mifa")),
    "synthetic-hetero-sizes": ({**SYNTHETIC, "local-steps": "epochs:min=2,max=5", "availability": "always"},
                               ("fedavg-active", "fednova", "fedavg-all")),
    "synthetic-momentum": ({**SYNTHETIC, "local-steps": "epochs:min=2,max=5", "solver": "momentum",
                            "momentum": 0.9, "availability": "bernoulli:p=0.7"}, ("fedavg-active", "fednova")),
}
QUICK = ("digits-dir0.5", "synthetic-hetero-sizes")
BOUNDS = (2, 3, 5, 10, 20, 50, 100, 1000)
QUANTILES = (50, 90, 99, 99.9, 100)
HISTORY = 64  # the previous reference (issue 27): the last 64 accepted norms, kept beside the per-node one


class Recorder:
    """Wraps :meth:`NormBounds.check` to see every parsed reply of a round before the verdict."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.run: tuple[str, str] = ("", "")
        self.round = 0
        self.model_norm = math.nan
        self.history: deque[float] = deque(maxlen=HISTORY)
        self._check = bounds_module.NormBounds.check

    def new_run(self, workload: str, rule: str) -> None:
        self.run, self.round, self.history = (workload, rule), 0, deque(maxlen=HISTORY)

    def install(self) -> None:
        recorder = self

        def check(bounds, reports, norm_of, node_of, reject, *args, **kwargs):  # scale, clip: as NormBounds.check
            recorder.observe(reports, norm_of)
            kept = recorder._check(bounds, reports, norm_of, node_of, reject, *args, **kwargs)
            recorder.observe_reference(bounds, reports, norm_of, node_of, kwargs)
            return kept

        bounds_module.NormBounds.check = check  # type: ignore[method-assign]

    def uninstall(self) -> None:
        bounds_module.NormBounds.check = self._check  # type: ignore[method-assign]

    def observe_reference(self, bounds: Any, reports: list[Any], norm_of, node_of, kwargs: dict[str, Any]) -> None:
        """Each reply's norm / (the per-node reference x its widenings): what ``max-norm-ratio``
        is compared with (:meth:`NormBounds.check`), in the rows :meth:`observe` just added."""
        ref, work = bounds.last_reference, bounds.work.fixed
        rows = self.rows[len(self.rows) - len(reports):] if reports else []
        for row, r in zip(rows, reports, strict=False):
            steps = kwargs.get("steps_of", lambda _: None)(r)
            widen = bounds.work_factor(steps, work) * (bounds.gap_factor(node_of(r)) if kwargs.get("stateful") else 1.0)
            row["norm/per-node reference"] = float(norm_of(r)) / (ref * widen) if ref else math.nan

    def observe(self, reports: list[Any], norm_of) -> None:
        self.round += 1
        norms = [float(norm_of(r)) for r in reports]
        if not reports:
            return
        pool = [*self.history, *norms]
        reference = float(np.median(pool)) if len(pool) >= 3 else math.nan
        med = float(np.median(norms)) if len(norms) >= 3 else math.nan
        steps = [r.num_steps for r in reports if r.num_steps]
        sizes = [r.num_examples for r in reports]
        normalised = [r.norm / r.a_norm for r in reports if r.a_norm and r.norm is not None]
        echo = [r.payload_norms["update"] for r in reports if "update" in r.payload_norms]  # FedAWE's u_i
        for r, norm in zip(reports, norms, strict=True):
            row = {"workload": self.run[0], "rule": self.run[1], "round": self.round, "replies": len(reports),
                   "norm/round-median": norm / med if med > 0 else math.nan,
                   "norm/reference": norm / reference if reference > 0 else math.nan,
                   "norm/model": (r.norm if r.norm is not None else norm) / self.model_norm,
                   "num-examples/round-median": r.num_examples / float(np.median(sizes)) if len(sizes) >= 3 else math.nan}
            if r.num_steps and len(steps) >= 3:
                row["num-steps/round-median"] = r.num_steps / float(np.median(steps))
            if r.a_norm and r.num_steps:
                row["fednova a-norm/num-steps"] = r.a_norm / r.num_steps
            if r.a_norm and r.norm is not None and len(normalised) >= 3:
                row["fednova normalised/round-median"] = (r.norm / r.a_norm) / float(np.median(normalised))
            if "update" in r.payload_norms:
                row["fedawe echo/round-median"] = (r.payload_norms["update"] / float(np.median(echo)) if len(echo) >= 3
                                                   else math.nan)
                row["fedawe echo-factor"] = float(r.payloads["echo-factor"][0])
            self.rows.append(row)
        self.history.extend(norms)  # honest: every reply is accepted


def model_norm_hook(recorder: Recorder) -> Any:
    """Wrap the base's ``set_global`` so the recorder knows ‖x^t‖ (the model each round starts from)."""
    from strategies.base import AvailabilityStrategy

    original = AvailabilityStrategy.set_global

    def set_global(self, arrays):
        original(self, arrays)
        recorder.model_norm = float(np.linalg.norm(self.current.astype(np.float64)))

    AvailabilityStrategy.set_global = set_global  # type: ignore[method-assign]
    return lambda: setattr(AvailabilityStrategy, "set_global", original)


def measure(names: list[str], rounds: int, recorder: Recorder, results_dir: str,
            save: str = "", only: list[str] | None = None) -> list[dict[str, Any]]:
    rejected: list[dict[str, Any]] = []
    for workload in names:
        config, rules = WORKLOADS[workload]
        for rule in rules:
            if only and rule not in only:
                continue
            recorder.new_run(workload, rule)
            t0 = time.monotonic()
            try:
                run_dir = run_inprocess({**config, "strategy": rule, "num-server-rounds": rounds, "eval-every": 0,
                                         "checkpoint-every": 0, "progress": False, "engine": "cohort",
                                         "results-dir": results_dir, "run-name": f"{workload}-{rule}".replace(":", "_")})
            except Exception as exc:  # noqa: BLE001 (a benchmark reports what it could measure)
                print(f"  {workload:28s} {rule:26s} FAILED: {type(exc).__name__}: {exc}", flush=True)
                continue
            from server_app.results import read_metrics

            rows = read_metrics(run_dir)
            n_rej = sum(len(r["rejected"]) for r in rows)
            n_acc = sum(len(r["participants"]) for r in rows)
            rejected.append({"workload": workload, "rule": rule, "accepted": n_acc, "rejected": n_rej})
            print(f"  {workload:28s} {rule:26s} {n_acc:4d} replies, {n_rej} rejected by the current defaults "
                  f"({time.monotonic() - t0:.1f} s)", flush=True)
            if save:
                Path(save).write_text(json.dumps(recorder.rows))
    return rejected


def report(rows: list[dict[str, Any]]) -> None:
    keys = sorted({k for r in rows for k in r if "/" in k or k.startswith("fed")} - {"workload", "rule"})
    head = "".join(f"{'q' + format(q, 'g'):>9s}" for q in QUANTILES)
    rate = "".join(f"{'>' + str(b):>8s}" for b in BOUNDS)
    print(f"\n{'quantity':34s}{'n':>6s}{head}   false-rejection rate at bound{rate}")
    for key in keys:
        values = np.array([r[key] for r in rows if key in r and math.isfinite(r[key])])
        if not values.size:
            continue
        qs = "".join(f"{np.percentile(values, q):9.3g}" for q in QUANTILES)
        rates = "".join(f"{np.mean(values > b):8.2%}" for b in BOUNDS)
        print(f"{key:34s}{values.size:6d}{qs}   {'':30s}{rates}")
    print(f"\nat the defaults ({defaults_line()}):")
    for label, over in at_defaults(rows).items():
        print(f"  {label:50s} {over[0]:5d} of {over[1]} honest replies ({over[0] / max(over[1], 1):.3%})")
    first = np.array([r["norm/model"] for r in rows if r["round"] == 1 and math.isfinite(r["norm/model"])])
    if first.size:
        print(f"{'norm/model, round 1 only':34s}{first.size:6d}"
              + "".join(f"{np.percentile(first, q):9.3g}" for q in QUANTILES))
    print("\nper workload and rule: max of norm/round-median, norm/reference (and FedNova's num-steps ratio)")
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by[(r["workload"], r["rule"])].append(r)
    for (workload, rule), group in by.items():
        print(f"  {workload:28s} {rule:26s} round {top(group, 'norm/round-median')}  reference "
              f"{top(group, 'norm/reference')}  model {top(group, 'norm/model')}  num-steps "
              f"{top(group, 'num-steps/round-median')}  examples {top(group, 'num-examples/round-median')}")


def defaults_line() -> str:
    return (f"max-norm-ratio {bounds_module.MAX_NORM_RATIO:g} (FedAWE {STRATEGIES['fedawe'].default_norm_ratio:g}), "
            f"max-steps-ratio {bounds_module.MAX_STEPS_RATIO:g}, max-examples-ratio "
            f"{bounds_module.MAX_EXAMPLES_RATIO:g}")


def at_defaults(rows: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """(replies beyond, replies) for each default bound: the honest false-rejection (or cut) rate."""
    def beyond(key: str, limit) -> tuple[int, int]:
        values = [(r, r[key]) for r in rows if key in r and math.isfinite(r[key])]
        return sum(v > limit(r) for r, v in values), len(values)

    def ratio(r: dict[str, Any]) -> float:
        return float(STRATEGIES[r["rule"].split(":")[0]].default_norm_ratio)

    return {
        "rejected by max-norm-ratio (norm/per-node reference)": beyond("norm/per-node reference", ratio),
        "beyond max-norm-ratio x the previous reference (64 accepted norms)": beyond("norm/reference", ratio),
        "rejected by max-steps-ratio (FedNova num-steps)": beyond(
            "num-steps/round-median", lambda r: bounds_module.MAX_STEPS_RATIO if r["rule"].startswith("fednova") else math.inf),
        "num-examples cut by max-examples-ratio": beyond("num-examples/round-median",
                                                          lambda r: bounds_module.MAX_EXAMPLES_RATIO or math.inf),
    }


def top(group: list[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in group if key in r and math.isfinite(r[key])]
    return f"{max(values):7.3g}" if values else "      -"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK}, 8 rounds")
    parser.add_argument("--workloads", nargs="*", default=None, choices=sorted(WORKLOADS))
    parser.add_argument("--rules", nargs="*", default=None, help="only these rules (of each workload's)")
    parser.add_argument("--save", default="", help="write the per-reply rows to this JSON file after each run")
    parser.add_argument("--load", nargs="*", default=(), help="report rows saved by --save (no runs)")
    args = parser.parse_args()
    names = list(args.workloads or (QUICK if args.quick else WORKLOADS))
    rounds = 8 if args.quick else args.rounds
    logging.getLogger("flwr").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    recorder = Recorder()
    if args.load:
        report([row for path in args.load for row in json.loads(Path(path).read_text())])
        return
    recorder.install()
    restore = model_norm_hook(recorder)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"honest runs: {rounds} rounds each, workloads {names}")
            measure(names, rounds, recorder, tmp, args.save, args.rules)
    finally:
        recorder.uninstall()
        restore()
    report(recorder.rows)


if __name__ == "__main__":
    main()
