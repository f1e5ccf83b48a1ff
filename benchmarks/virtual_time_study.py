"""Deadline-induced unavailability on the virtual clock (issue 29, item 6): FedAvg, FedAWE and MIFA
in synchronous rounds with a virtual deadline against FedBuff and FedAsync (asynchronous, no
barrier), on the same devices and seeds. Writes reports/virtual-time.md, its JSON and two plots,
every number computed from the runs' results folders (kept under --results).

    python benchmarks/virtual_time_study.py [--seeds 0 1 2] [--rules fedavg-active fedawe mifa fedbuff fedasync]
        [--results results/virtual-time-study] [--out reports/virtual-time.md]
    python benchmarks/virtual_time_study.py --from-results results/virtual-time-study   # only the report

Workload: digits, the MLP, 20 clients, ``dirichlet:alpha=0.5``, 1-3 local epochs per job
(``epochs:min=1,max=3``: job times vary per client and round), every client scheduled on
(``availability=always``): a client is missing only when its job misses the deadline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ROOT / "benchmarks" / "virtual_time_devices.toml"
SYNC = ("fedavg-active", "fedawe", "mifa")
ASYNC = ("fedbuff", "fedasync")
WORKLOAD = {"dataset": "digits", "model": "mlp", "num-clients": 20, "partition": "dirichlet:alpha=0.5",
            "local-steps": "epochs:min=1,max=3", "availability": "always", "checkpoint-every": 0,
            "device": "cpu", "progress": False, "eval-every": 1, "engine": "cohort"}


def run_config(rule: str, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {**WORKLOAD, "devices": str(Path(a.devices).resolve()), "train-seed": seed,
                           "data-seed": seed, "results-dir": str(Path(a.results).resolve()),
                           "run-name": f"{rule}-s{seed}"}
    if rule in ASYNC:
        cfg.update({"strategy": rule, "num-server-rounds": a.aggregations[rule],
                    "eval-every": a.fedasync_eval_every if rule == "fedasync" else 1})
    else:
        cfg.update({"strategy": rule, "num-server-rounds": a.rounds, "virtual-deadline": a.deadline})
    return cfg


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def curve(rows: Sequence[Mapping[str, Any]]) -> list[tuple[float, int, float]]:
    """(virtual time, row number, test accuracy) of every evaluated row."""
    return [(float(r["virtual-time"]), int(r["round"]), float(r["test-accuracy"]))
            for r in rows if "test-accuracy" in r and "virtual-time" in r]


def time_to(points: Sequence[tuple[float, int, float]], target: float) -> float | None:
    """The first virtual time at which the accuracy reaches ``target`` (None: never)."""
    return next((t for t, _, acc in points if acc >= target), None)


def accuracy_at(points: Sequence[tuple[float, int, float]], horizon: float) -> float | None:
    """The accuracy of the last evaluation at or before ``horizon``."""
    before = [acc for t, _, acc in points if t <= horizon]
    return before[-1] if before else None


def class_share(rows: Sequence[Mapping[str, Any]], classes: Mapping[int, str], horizon: float) -> dict[str, float]:
    """Per class: applied updates per client up to ``horizon`` (participants of the rows)."""
    size = Counter(classes.values())
    counts = dict.fromkeys(size, 0)
    for r in rows:
        if float(r.get("virtual-time", math.inf)) <= horizon:
            for c in r.get("participants", []):
                counts[classes[int(c)]] += 1
    return {name: counts[name] / size[name] for name in size}


def late_share(rows: Sequence[Mapping[str, Any]], classes: Mapping[int, str]) -> dict[str, float]:
    """Synchronous runs: per class, the share of (round, client) jobs recorded late."""
    size = Counter(classes.values())
    late = dict.fromkeys(size, 0)
    for r in rows:
        for c in r.get("late", []):
            late[classes[int(c)]] += 1
    return {name: late[name] / (size[name] * len(rows)) for name in size} if rows else {}


def summarise(results: Path, rules: Sequence[str], seeds: Sequence[int], target: float,
              classes: Mapping[int, str]) -> dict[str, Any]:
    """Every number of the report, from the results folders."""
    curves = {rule: {s: curve(read_rows(results / f"{rule}-s{s}")) for s in seeds} for rule in rules}
    rows = {rule: {s: read_rows(results / f"{rule}-s{s}") for s in seeds} for rule in rules}
    # the common horizon: the shortest run's last evaluated virtual time
    horizon = min(pts[-1][0] for per in curves.values() for pts in per.values() if pts)
    out: dict[str, Any] = {"target": target, "horizon": horizon, "seeds": list(seeds), "rules": {}}
    for rule in rules:
        tt = {s: time_to(curves[rule][s], target) for s in seeds}
        final = {s: accuracy_at(curves[rule][s], horizon) for s in seeds}
        reached = [v for v in tt.values() if v is not None]
        finals = [v for v in final.values() if v is not None]
        shares = [class_share(rows[rule][s], classes, horizon) for s in seeds]
        out["rules"][rule] = {
            "kind": "async" if rule in ASYNC else "sync",
            "time-to-target": tt, "time-to-target-mean": statistics.mean(reached) if len(reached) == len(seeds) else None,
            "reached": f"{len(reached)}/{len(seeds)}",
            "accuracy-at-horizon": final, "accuracy-mean": statistics.mean(finals) if finals else None,
            "accuracy-sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "updates-per-client": {name: statistics.mean(sh[name] for sh in shares) for name in shares[0]},
            "late-share": ({name: statistics.mean(late_share(rows[rule][s], classes)[name] for s in seeds)
                            for name in set(classes.values())} if rule not in ASYNC else None),
            "aggregations": {s: len(rows[rule][s]) for s in seeds},
            "wall-s": {s: round(sum(float(r.get("round-time", 0.0)) for r in rows[rule][s]), 1) for s in seeds},
        }
    out["curves"] = {rule: {str(s): curves[rule][s] for s in seeds} for rule in rules}
    out["deployment"] = deployment_pair(results)
    return out


def deployment_pair(results: Path) -> dict[str, Any] | None:
    """FedBuff deployed with churn and simulated (``benchmarks/fedbuff_deployment.py``'s folders),
    or None when they are missing."""
    dirs = {"deployment": results / "deploy-fedbuff", "simulation": results / "sim-fedbuff"}
    if not all((d / "metrics.jsonl").is_file() for d in dirs.values()):
        return None
    out: dict[str, Any] = {"setup": json.loads((dirs["deployment"] / "study-note.json").read_text())}
    for name, d in dirs.items():
        rows = read_rows(d)
        n = len(json.loads((d / "config.json").read_text()).get("devices-used", {})) or int(
            json.loads((d / "config.json").read_text())["num-clients"])
        stale = [int(s) for r in rows for _, s in r.get("arrivals", [])]
        out[name] = {"aggregations": len(rows), "final-accuracy": rows[-1].get("test-accuracy"),
                     "time": rows[-1].get("virtual-time"),
                     "arrivals-per-client": [sum(int(c) == i for r in rows for c in r["participants"]) for i in range(n)],
                     "mean-staleness": statistics.mean(stale) if stale else None,
                     "lost-jobs": sum(int(r.get("unavailable-nodes", 0)) for r in rows),
                     "participants": [sorted(int(c) for c in r["participants"]) for r in rows]}
    out["same-participants"] = out["deployment"]["participants"] == out["simulation"]["participants"]
    return out


def plot(summary: Mapping[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(10, 3.8))
    for i, (rule, per) in enumerate(summary["curves"].items()):
        style = "--" if summary["rules"][rule]["kind"] == "async" else "-"
        for k, (_, pts) in enumerate(sorted(per.items())):
            if not pts:
                continue
            t, r, acc = zip(*pts, strict=True)
            label = f"{rule} ({len(per)} seeds)" if k == 0 else None
            ax_t.plot(t, acc, style, lw=1, label=label, alpha=0.7, color=f"C{i}")
            ax_r.plot(r, acc, style, lw=1, color=f"C{i}", alpha=0.7)
    for ax in (ax_t, ax_r):
        ax.axhline(summary["target"], color="grey", lw=0.6, ls=":")
        ax.set_ylabel("test accuracy")
        ax.set_ylim(0, 1)
    ax_t.axvline(summary["horizon"], color="grey", lw=0.6)
    ax_t.set_xlabel("virtual seconds")
    ax_r.set_xscale("log")
    ax_r.set_xlabel("round (sync) / aggregation (async), log scale")
    ax_t.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    curves = out.with_name(out.stem + "-curves.png")
    fig.savefig(curves, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rules = list(summary["rules"])
    names = list(next(iter(summary["rules"].values()))["updates-per-client"])
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + k * width for i in range(len(rules))],
               [summary["rules"][r]["updates-per-client"][name] for r in rules], width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(rules))], rules, fontsize=8)
    ax.set_ylabel(f"updates applied per client\n(by {summary['horizon']:.0f} virtual s)")
    ax.legend(fontsize=7, title="device class", title_fontsize=7)
    fig.tight_layout()
    classes = out.with_name(out.stem + "-classes.png")
    fig.savefig(classes, dpi=110)
    plt.close(fig)
    return [curves.name, classes.name]


def reading(summary: Mapping[str, Any]) -> list[str]:
    """What the table says, in numbers computed here, and what differs between the runs."""
    rules = summary["rules"]
    def mean_of(kind: str, key: str) -> list[float]:
        return [r[key] for r in rules.values() if r["kind"] == kind and r[key] is not None]

    out = ["## Reading", ""]
    sync_t, async_t = mean_of("sync", "time-to-target-mean"), mean_of("async", "time-to-target-mean")
    if sync_t and async_t:
        out.append(f"- Time to {summary['target']}: the synchronous rules took {min(sync_t):.1f}-{max(sync_t):.1f} "
                   f"virtual s (means over seeds), the asynchronous {min(async_t):.1f}-{max(async_t):.1f} s: "
                   f"{min(sync_t) / max(async_t):.1f}-{max(sync_t) / min(async_t):.1f}x sooner.")
    out.append(f"- Reached {summary['target']} (seeds): " + ", ".join(
        f"{k} {r['reached']}" for k, r in rules.items()) + "; a dash in the table is a run that did not reach it "
        "in its rounds or aggregations.")
    acc = {k: r["accuracy-mean"] for k, r in rules.items() if r["accuracy-mean"] is not None}
    if acc:
        out.append(f"- At the horizon ({summary['horizon']:.1f} virtual s): " + ", ".join(
            f"{k} {v:.3f}" for k, v in acc.items()) + " (means over seeds).")
    slow = {k: r["updates-per-client"].get("slow") for k, r in rules.items()}
    late = [r["late-share"]["slow"] for r in rules.values() if r["late-share"]]
    if late:
        span = f"{min(late):.0%}" if min(late) == max(late) else f"{min(late):.0%}-{max(late):.0%}"
        out.append(f"- The deadline made the slow class late in {span} of its jobs; by the "
                   f"horizon a slow client had " + ", ".join(f"{k} {v:.1f}" for k, v in slow.items() if v is not None)
                   + " updates applied.")
    out += [
        "- Same for every run: the devices file, the seeds (data and training), the partition, the local work "
        "(1-3 epochs per job, drawn per client and job) and the model; every client scheduled on, so every "
        "missing update is a late one (sync) and nothing is missing in the asynchronous runs.",
        "- Differs by design: the synchronous rules run rounds that close at `virtual-deadline` (or when every "
        "client is in) and drop late replies (a late FedAWE client has trained, so its kept copy moved; a "
        "late device is busy until its job ends, as a SuperNode is, so it starts the next round's job late, "
        "which makes a device slower than the deadline late in nearly every round); "
        "FedBuff (K = 10, s = (1 + staleness)^-0.5) and FedAsync (alpha = 0.6, same s) give every idle "
        "client a new job at once and aggregate without a barrier; `num-server-rounds` counts aggregations, "
        "so the x-axes of the right-hand plot are not comparable.",
        "- Approximate: virtual time is download + compute + upload only, these devices having no "
        "`overhead_ms` (the server's aggregation and evaluation take none; a real deployment adds a "
        "per-message cost, see reports/clock-vs-emulation.md); FedAsync is evaluated every few aggregations (its time to target is the first "
        "evaluation at or above the target); an asynchronous client's data order and lr follow its own job "
        "count, not the model version (docs/engines.md); digits is small (360 test images: 0.003 per image).",
    ]
    return out


def report(summary: Mapping[str, Any], a: argparse.Namespace, figures: list[str], setup: str) -> str:
    seeds = summary["seeds"]
    md = ["# Deadline-induced unavailability on the virtual clock: sync rules with a deadline vs asynchronous rules",
          "", setup, "",
          f"Target accuracy {summary['target']}; horizon {summary['horizon']:.1f} virtual s (the shortest run's "
          f"last evaluation; every accuracy below is the last evaluation at or before it). Seeds {seeds}.", "",
          "| rule | kind | time to target (virtual s, per seed) | mean (all seeds reached) | accuracy at the horizon "
          "(mean ± sd) | per seed | applied updates per client (fast / mid / slow) | late share (fast / mid / slow) "
          "| rounds or aggregations |",
          "|---|---|---|---|---|---|---|---|---|"]
    order = ("fast", "mid", "slow")
    for rule, r in summary["rules"].items():
        tt = ", ".join("-" if r["time-to-target"][s] is None else f"{r['time-to-target'][s]:.1f}" for s in seeds)
        mean = "-" if r["time-to-target-mean"] is None else f"{r['time-to-target-mean']:.1f}"
        acc = " / ".join("-" if r["accuracy-at-horizon"][s] is None else f"{r['accuracy-at-horizon'][s]:.4f}"
                         for s in seeds)
        upd = " / ".join(f"{r['updates-per-client'].get(c, 0):.1f}" for c in order)
        late = "-" if r["late-share"] is None else " / ".join(f"{r['late-share'].get(c, 0):.2f}" for c in order)
        aggs = ", ".join(str(r["aggregations"][s]) for s in seeds)
        md.append(f"| {rule} | {r['kind']} | {tt} | {mean} ({r['reached']}) | {r['accuracy-mean']:.4f} ± "
                  f"{r['accuracy-sd']:.4f} | {acc} | {upd} | {late} | {aggs} |")
    md += ["", *reading(summary), "", f"![accuracy against virtual time and against rounds]({figures[0]})", "",
           f"![updates applied per client, by device class]({figures[1]})", ""]
    pair = summary.get("deployment")
    md += ["## FedBuff deployed with churn, next to its simulation", ""]
    if pair is None:
        md.append("Missing: no `deploy-fedbuff` / `sim-fedbuff` folders (run `benchmarks/fedbuff_deployment.py`).")
    else:
        st = pair["setup"]
        md += [f"`{st['command']}`: {st['nodes']} SuperNode processes (no device limits), `fedbuff:k={st['k']}`, digits "
               f"/ logreg, {st['steps']} local steps, `{st['availability']}`, {st['aggregations']} aggregations; the "
               f"churn driver stops (SIGTERM) and starts the nodes by the schedule; deployment wall "
               f"{st['deployment-wall-s']} s, load {st['load-before']} before, {st['load-after']} after.", "",
               "| | aggregations | final accuracy | time at the end | arrivals per client | mean staleness | lost jobs |",
               "|---|---|---|---|---|---|---|"]
        for name in ("deployment", "simulation"):
            r = pair[name]
            unit = "real s" if name == "deployment" else "virtual s"
            stale = "-" if r["mean-staleness"] is None else f"{r['mean-staleness']:.2f}"
            md.append(f"| {name} | {r['aggregations']} | {r['final-accuracy']:.4f} | {r['time']:.1f} {unit} | "
                      f"{r['arrivals-per-client']} | {stale} | {r['lost-jobs']} |")
        md += ["", f"The same clients in every aggregation: {'yes' if pair['same-participants'] else 'no'}. "
               "Setup differences: the deployment runs on real time (its ClientApps start a process per message, "
               "so arrivals interleave and some updates are one version stale; the churn driver stops a group's "
               "nodes while their next jobs are in flight: the lost jobs); the simulation runs without device "
               "profiles (every job takes its local steps x 1 virtual s, so both online clients arrive at the same "
               "instant, with staleness 0) and reads the schedule in slots of one such job, which here is one "
               "aggregation, as the churn driver's schedule round is. The accuracies come from one seed and 360 "
               "test images."]
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rules", nargs="+", default=[*SYNC, *ASYNC])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--devices", default=str(DEVICES))
    ap.add_argument("--deadline", type=float, default=4.0, help="virtual-deadline of the sync rules, s")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the sync rules")
    ap.add_argument("--fedbuff-aggregations", type=int, default=100)
    ap.add_argument("--fedasync-aggregations", type=int, default=900)
    ap.add_argument("--fedasync-eval-every", type=int, default=3, help="FedAsync: evaluate every n aggregations")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--results", default=str(ROOT / "results" / "virtual-time-study"))
    ap.add_argument("--out", default=str(ROOT / "reports" / "virtual-time.md"))
    ap.add_argument("--note", default="", help="a sentence for the report's setup line (e.g. the host's load)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the in-process runs")
    ap.add_argument("--from-results", action="store_true", help="only read the results folders and write the report")
    a = ap.parse_args()
    a.aggregations = {"fedbuff": a.fedbuff_aggregations, "fedasync": a.fedasync_aggregations}
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import torch

    torch.set_num_threads(a.threads)  # on a shared 2-core host, 2 threads made a step 10x slower (1.6 -> 20 ms)
    results = Path(a.results)
    from virtualtime import read_profiles

    plan = read_profiles(a.devices, WORKLOAD["num-clients"])
    classes = {c: dc.name for dc in plan.classes for c in dc.clients}
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    if not a.from_results:
        from experiments.inprocess import run_inprocess

        for rule in a.rules:
            for seed in a.seeds:
                cfg = run_config(rule, seed, a)
                shutil.rmtree(results / cfg["run-name"], ignore_errors=True)
                s = time.monotonic()
                run_inprocess(cfg)
                print(f"{rule} seed {seed}: {time.monotonic() - s:.1f} s", flush=True)
    summary = summarise(results, a.rules, a.seeds, a.target, classes)
    out = Path(a.out)
    spent = sum(w for r in summary["rules"].values() for w in r["wall-s"].values())
    ran = "" if a.from_results else f"; load {load0:.1f} before, {time.monotonic() - t0:.0f} s in all"
    setup = (f"Generated by `python benchmarks/virtual_time_study.py --seeds {' '.join(map(str, a.seeds))} "
             f"--deadline {a.deadline} --rounds {a.rounds} --fedbuff-aggregations {a.fedbuff_aggregations} "
             f"--fedasync-aggregations {a.fedasync_aggregations}` on {time.strftime('%Y-%m-%d')} (in process, "
             f"{os.cpu_count()} CPUs, 1 torch thread; the runs' rounds took {spent:.0f} wall s{ran}). Devices "
             f"`{Path(a.devices).relative_to(ROOT) if Path(a.devices).is_relative_to(ROOT) else a.devices}`: "
             f"{plan.describe()}." + (f" {a.note}" if a.note else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = plot(summary, out)
    out.write_text(report(summary, a, figures, setup))
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(out.read_text())


if __name__ == "__main__":
    main()
