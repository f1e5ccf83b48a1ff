"""Stragglers on the virtual clock (issue 38, item 2): FedAvg and FedNova under the three
``straggler-policy`` values (drop, partial, wait) against FedBuff (no round, no deadline), on the
bundled device profile (``virtualtime/example-devices.toml``), same seeds. Writes
reports/stragglers.md and its JSON, every number computed from the runs' results folders (kept
under --results).

    python benchmarks/straggler_study.py [--seeds 0 1 2] [--rounds 20] [--deadline 0.4]
        [--results results/straggler-study] [--out reports/stragglers.md]
    python benchmarks/straggler_study.py --from-results    # only the report, from the folders

Workload: digits, logistic regression, 20 clients, ``dirichlet:alpha=0.5``, 100 local steps a
job, every client scheduled on (``availability=always``; the devices' own sessions still take
clients offline). On these devices a 100-step job takes 0.61 s on the slow class (0.33 s of it
transfers), 0.22 s on mid and 0.09 s on fast, so a 0.4 s deadline cuts the slow class only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from virtual_time_study import accuracy_at, curve, read_rows, time_to  # noqa: E402 (the one reading of a run)

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ROOT / "virtualtime" / "example-devices.toml"
SYNC = ("fedavg-active", "fednova")
POLICIES = ("drop", "partial", "wait")
ASYNC = "fedbuff"
WORKLOAD = {"dataset": "digits", "model": "logreg", "num-clients": 20, "partition": "dirichlet:alpha=0.5",
            "local-steps": "steps:n=100", "availability": "always", "checkpoint-every": 0, "device": "cpu",
            "progress": False, "eval-every": 1, "engine": "cohort"}


def arms(rules: Sequence[str]) -> list[tuple[str, str]]:
    """(run name stem, policy) of every arm: each synchronous rule under each policy, FedBuff once."""
    return [(f"{r}-{p}", p) for r in rules if r != ASYNC for p in POLICIES] + (
        [(ASYNC, "drop")] if ASYNC in rules else [])


def run_config(stem: str, policy: str, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    rule = ASYNC if stem == ASYNC else stem.rsplit("-", 1)[0]
    cfg: dict[str, Any] = {**WORKLOAD, "devices": str(Path(a.devices).resolve()), "train-seed": seed,
                           "data-seed": seed, "schedule-seed": seed, "results-dir": str(Path(a.results).resolve()),
                           "run-name": f"{stem}-s{seed}", "strategy": rule}
    if rule == ASYNC:
        cfg["num-server-rounds"] = a.fedbuff_aggregations
    else:
        cfg.update({"num-server-rounds": a.rounds, "virtual-deadline": a.deadline, "straggler-policy": policy,
                    "straggler-min-steps": a.min_steps})
    return cfg


def steps_by_class(rows: Sequence[Mapping[str, Any]], classes: Mapping[int, str]) -> dict[str, float]:
    """Per class: mean local steps of the updates applied (the rows' ``client-steps``)."""
    got: dict[str, list[int]] = {}
    for r in rows:
        for c, k in r.get("client-steps", {}).items():
            got.setdefault(classes[int(c)], []).append(int(k))
    return {name: statistics.mean(v) for name, v in got.items()}


def updates_by_class(rows: Sequence[Mapping[str, Any]], classes: Mapping[int, str], horizon: float) -> dict[str, float]:
    """Per class: updates applied per client up to ``horizon``."""
    size: dict[str, int] = {}
    for name in classes.values():
        size[name] = size.get(name, 0) + 1
    counts = dict.fromkeys(size, 0)
    for r in rows:
        if float(r.get("virtual-time", 0.0)) <= horizon:
            for c in r.get("participants", []):
                counts[classes[int(c)]] += 1
    return {name: counts[name] / size[name] for name in size}


def summarise(results: Path, stems: Sequence[str], seeds: Sequence[int], target: float,
              classes: Mapping[int, str]) -> dict[str, Any]:
    rows = {stem: {s: read_rows(results / f"{stem}-s{s}") for s in seeds} for stem in stems}
    curves = {stem: {s: curve(rows[stem][s]) for s in seeds} for stem in stems}
    horizon = min(pts[-1][0] for per in curves.values() for pts in per.values() if pts)
    out: dict[str, Any] = {"target": target, "horizon": horizon, "seeds": list(seeds), "arms": {},
                           "curves": {stem: {str(s): curves[stem][s] for s in seeds} for stem in stems}}
    for stem in stems:
        tt = {s: time_to(curves[stem][s], target) for s in seeds}
        acc = {s: accuracy_at(curves[stem][s], horizon) for s in seeds}
        reached, finals = [v for v in tt.values() if v is not None], [v for v in acc.values() if v is not None]
        per_seed_steps = [steps_by_class(rows[stem][s], classes) for s in seeds]
        names = sorted({n for d in per_seed_steps for n in d})
        out["arms"][stem] = {
            "time-to-target": tt, "reached": f"{len(reached)}/{len(seeds)}",
            "time-to-target-mean": statistics.mean(reached) if len(reached) == len(seeds) else None,
            "accuracy-at-horizon": acc, "accuracy-mean": statistics.mean(finals) if finals else None,
            "accuracy-sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "round-time-mean": statistics.mean(float(r["virtual-round-time"]) for s in seeds for r in rows[stem][s]
                                               if "virtual-round-time" in r) if stem != ASYNC else None,
            "steps-per-update": {n: statistics.mean(d[n] for d in per_seed_steps if n in d) for n in names},
            "updates-per-client": {n: statistics.mean(updates_by_class(rows[stem][s], classes, horizon)[n]
                                                      for s in seeds) for n in set(classes.values())},
            "late-jobs": {s: sum(len(r.get("late", [])) for r in rows[stem][s]) for s in seeds},
            "rows": {s: len(rows[stem][s]) for s in seeds},
        }
    return out


ORDER = ("fast", "mid", "slow")


def num(x: float | None, fmt: str = ".4f") -> str:
    return "-" if x is None else format(x, fmt)


def same_curves(summary: Mapping[str, Any], a: str, b: str) -> float | None:
    """The largest accuracy difference between arms ``a`` and ``b`` over every seed's evaluations
    (None when their evaluations are not at the same virtual times)."""
    gaps = []
    for seed, pts in summary["curves"][a].items():
        other = summary["curves"][b][seed]
        if [p[0] for p in pts] != [p[0] for p in other]:
            return None
        gaps += [abs(p[2] - q[2]) for p, q in zip(pts, other, strict=True)]
    return max(gaps, default=0.0)


def reading(summary: Mapping[str, Any]) -> list[str]:
    """What the table says, in numbers computed here."""
    arms_, target = summary["arms"], summary["target"]
    if not all(f"{r}-{p}" in arms_ for r in SYNC for p in POLICIES):
        return ["## Reading", "", "- (every synchronous arm is needed for the reading)"]

    def val(stem: str, key: str, fmt: str = ".4f") -> str:
        return num(arms_[stem][key], fmt)

    out = ["## Reading", ""]
    for rule in SYNC:
        out.append(f"- {rule}: time to {target} (mean) " + ", ".join(
            f"{p} {val(f'{rule}-{p}', 'time-to-target-mean', '.2f')} s" for p in POLICIES)
            + "; accuracy at the horizon " + ", ".join(f"{p} {val(f'{rule}-{p}', 'accuracy-mean')}" for p in POLICIES)
            + ".")
    fa, fn = arms_["fedavg-active-partial"], arms_["fednova-partial"]
    gap = (fn["accuracy-mean"] or 0.0) - (fa["accuracy-mean"] or 0.0)
    out.append(
        f"- `partial`: the slow class ran {num(fa['steps-per-update'].get('slow'), '.0f')} of 100 steps a job (mean "
        "over its updates), the others all 100, and no job was late. FedNova divides each update by its steps and "
        "scales the sum by tau_eff (Wang et al. 2020, Eq. 7); FedAvg weighs an update by its examples whatever its "
        f"steps, so a slow client's short update pulls less. FedNova reached {target} at "
        f"{val('fednova-partial', 'time-to-target-mean', '.2f')} s against FedAvg's "
        f"{val('fedavg-active-partial', 'time-to-target-mean', '.2f')} s and stood {gap:+.4f} above it at the horizon "
        f"({gap * 360:+.1f} of 360 test images; the seeds' sd is {fa['accuracy-sd']:.4f} for FedAvg, "
        f"{fn['accuracy-sd']:.4f} for FedNova): the direction the paper predicts, small on this convex task.")
    eq = [same_curves(summary, f"fedavg-active-{p}", f"fednova-{p}") for p in ("drop", "wait")]
    same = "identical in every evaluation" if all(e == 0.0 for e in eq) else (
        "apart by at most " + ", ".join(num(e) for e in eq) + " (drop, wait)")
    drop, wait, part = arms_["fedavg-active-drop"], arms_["fedavg-active-wait"], fa
    out.append(
        "- `drop` and `wait`: every update has 100 steps, so FedNova's normalisation changes nothing (with equal "
        f"steps FedNova is FedAvg): the two rules' curves are {same}. `drop` loses the slow class (late jobs per "
        f"run: {statistics.mean(drop['late-jobs'].values()):.0f}; {drop['updates-per-client']['slow']:.1f} updates "
        f"per slow client by the horizon against {part['updates-per-client']['slow']:.1f} under `partial`); `wait` "
        f"stretches every round to the slowest job ({val('fedavg-active-wait', 'round-time-mean', '.3f')} s against "
        f"{val('fedavg-active-drop', 'round-time-mean', '.3f')} s), so it is the slowest to {target} although every "
        f"update is whole ({wait['updates-per-client']['slow']:.1f} slow updates per slow client by the horizon).")
    if ASYNC in arms_:
        b = arms_[ASYNC]
        out.append(
            f"- FedBuff has no round and no deadline, so the policies do not apply (one arm): it reached {target} at "
            f"{val(ASYNC, 'time-to-target-mean', '.2f')} s (mean) with accuracy {val(ASYNC, 'accuracy-mean')} at the "
            f"horizon; by then it had applied {b['updates-per-client']['fast']:.1f} updates per fast client and "
            f"{b['updates-per-client']['slow']:.1f} per slow one (stale ones included).")
    out += [
        "- Same in every arm: the devices file (its sessions included: a client in an offline session gets no "
        "job), the seeds (data, training, sessions), the partition, the model and 100 local steps a job (fewer "
        "only for a `partial` straggler). Differs by design: the policy, and FedBuff's buffer (its default K) "
        "instead of rounds.",
        "- Approximate: virtual time is download + compute + upload only (these devices have no overhead_ms; the "
        "server's aggregation and evaluation take none); a round's evaluation comes every 0.4-0.6 virtual s, so "
        "a time to target is exact only to a round; digits is small (360 test images: 0.0028 per image) and "
        "logistic regression convex, so the rules' drift shows as small accuracy gaps.",
    ]
    return out


def report(summary: Mapping[str, Any], setup: str) -> str:
    seeds = summary["seeds"]
    md = ["# Stragglers on the virtual clock: drop, partial work, wait (FedAvg, FedNova) and FedBuff", "", setup, "",
          f"Target accuracy {summary['target']}; horizon {summary['horizon']:.2f} virtual s (the shortest run's last "
          f"evaluation; each accuracy is the last evaluation at or before it). Seeds {seeds}.", "",
          "| arm | time to target (virtual s, per seed) | mean (seeds reached) | accuracy at the horizon (mean ± sd) "
          "| per seed | mean round (virtual s) | steps per update (fast / mid / slow) | updates per client by the "
          "horizon (fast / mid / slow) | late jobs (per seed) |",
          "|---|---|---|---|---|---|---|---|---|"]
    for stem, r in summary["arms"].items():
        tt = ", ".join("-" if r["time-to-target"][s] is None else f"{r['time-to-target'][s]:.2f}" for s in seeds)
        mean = "-" if r["time-to-target-mean"] is None else f"{r['time-to-target-mean']:.2f}"
        acc = " / ".join("-" if r["accuracy-at-horizon"][s] is None else f"{r['accuracy-at-horizon'][s]:.4f}"
                         for s in seeds)
        rt = "-" if r["round-time-mean"] is None else f"{r['round-time-mean']:.3f}"
        steps = " / ".join("-" if c not in r["steps-per-update"] else f"{r['steps-per-update'][c]:.0f}" for c in ORDER)
        upd = " / ".join(f"{r['updates-per-client'].get(c, 0):.1f}" for c in ORDER)
        late = ", ".join(str(r["late-jobs"][s]) for s in seeds)
        am = "-" if r["accuracy-mean"] is None else f"{r['accuracy-mean']:.4f} ± {r['accuracy-sd']:.4f}"
        md.append(f"| {stem} | {tt} | {mean} ({r['reached']}) | {am} "
                  f"| {acc} | {rt} | {steps} | {upd} | {late} |")
    return "\n".join([*md, "", *reading(summary), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", nargs="+", default=[*SYNC, ASYNC])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--devices", default=str(DEVICES))
    ap.add_argument("--deadline", type=float, default=0.4, help="virtual-deadline of the sync rules, s")
    ap.add_argument("--min-steps", type=int, default=5, help="straggler-min-steps under partial")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the sync rules")
    ap.add_argument("--fedbuff-aggregations", type=int, default=90)
    ap.add_argument("--target", type=float, default=0.94)
    ap.add_argument("--results", default=str(ROOT / "results" / "straggler-study"))
    ap.add_argument("--out", default=str(ROOT / "reports" / "stragglers.md"))
    ap.add_argument("--from-results", action="store_true", help="only read the results folders and write the report")
    a = ap.parse_args()
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import torch

    torch.set_num_threads(1)  # a shared 2-core host
    from virtualtime import read_profiles

    plan = read_profiles(a.devices, WORKLOAD["num-clients"])
    classes = {c: dc.name for dc in plan.classes for c in dc.clients}
    results, plan_arms = Path(a.results), arms(a.rules)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    note = results / "study-run.json"  # what the runs took, for a report written later --from-results
    if not a.from_results:
        from experiments.inprocess import run_inprocess

        for stem, policy in plan_arms:
            for seed in a.seeds:
                cfg = run_config(stem, policy, seed, a)
                shutil.rmtree(results / cfg["run-name"], ignore_errors=True)
                s = time.monotonic()
                run_inprocess(cfg)
                print(f"{stem} seed {seed}: {time.monotonic() - s:.1f} s", flush=True)
        note.write_text(json.dumps({"seconds": round(time.monotonic() - t0), "load-before": round(load0, 1)}))
    summary = summarise(results, [s for s, _ in plan_arms], a.seeds, a.target, classes)
    took = json.loads(note.read_text()) if note.is_file() else None
    ran = "" if took is None else f"; the runs took {took['seconds']} s, load {took['load-before']} before"
    setup = (f"Generated by `python benchmarks/straggler_study.py --seeds {' '.join(map(str, a.seeds))} --rounds "
             f"{a.rounds} --deadline {a.deadline} --min-steps {a.min_steps} --fedbuff-aggregations "
             f"{a.fedbuff_aggregations} --target {a.target}` on {time.strftime('%Y-%m-%d')} (in process, cohort "
             f"engine, 1 torch thread, {os.cpu_count()} CPUs"
             f"{ran}). Workload: digits, logistic regression, 20 clients, `dirichlet:alpha=0.5`, 100 local steps a "
             f"job, `availability=always`; devices `virtualtime/example-devices.toml`: {plan.describe()}. "
             f"Synchronous arms: `virtual-deadline={a.deadline}`, `straggler-min-steps={a.min_steps}`.")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report(summary, setup))
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(out.read_text())


if __name__ == "__main__":
    main()
