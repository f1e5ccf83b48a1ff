"""The virtual clock against emulated edge devices (issue 29, item 4). Root; prints tables and a
verdict, asserts nothing (``tests/test_clock_emulation.py`` asserts, opt-in).

    sudo .venv/bin/python benchmarks/clock_vs_emulation.py [--devices benchmarks/clock_vs_emulation.toml]
        [--rounds 6] [--steps 1000] [--deadline auto] [--json OUT]

On one set of emulated SuperNodes (``deploy.local.ProcessSite`` with the devices file, what
``python -m deploy launch --devices FILE`` runs: cgroup CPU quotas, tbf bandwidth, the latency
relay), FedAvg on digits / mlp, every client scheduled on, three deployed runs:

1. ``probe``: 1 local step, no deadline. Per class, what a reply costs besides training, E - train
   (E: the server's seconds from pushing the round's messages to seeing the reply; train: the
   client's own seconds of local training). That is the deployment's per-message cost, which the
   clock does not model: Flower's polls, the ClientApp process Flower starts for every message
   (under the class's CPU cap), (de)serialisation, the hand-off to the node's worker. A class with
   network limits takes the cost of the unshaped class with the same CPU cap, so that its own
   transfers are left to the clock.
2. ``timing``: ``--steps`` local steps, no deadline (every reply is timed). Per class, the median E
   of rounds 2+ against the clock's prediction: ``VirtualClock.job_time(client, steps).total``
   (download + compute + upload, from the same devices file plus ``step_ms`` from this run's own
   calibration under the caps) + the class's per-message cost from the probe.
3. ``deadline``: the same with ``round-deadline`` D (auto: in the widest gap between the classes'
   predicted times): the realised participation (``deploy.realised`` statuses) against the
   clock's (on time iff predicted E <= D).

Round 1 of every run is left out: it also starts each node's worker for the run (imports, the
workload) and waits ``round-timeout``, not the deadline; its E is printed apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's packages
from deploy.edge.clockcheck import (  # noqa: E402
    Reply,
    agreement,
    choose_deadline,
    class_median,
    participation,
    per_message_cost,
    profile_text,
    read_replies,
    same_matrix,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DEVICES = ROOT / "benchmarks" / "clock_vs_emulation.toml"


def simulated(cfg: Mapping[str, Any], profile: Path, num_nodes: int, deadline: float,
              results: Path) -> list[Reply]:
    """The same run in process on the virtual clock (run config ``devices``, ``virtual-deadline``),
    as :class:`Reply` records: status on time / late / lost, ``reply`` = the clock's job time."""
    from experiments.inprocess import run_inprocess

    run_dir = run_inprocess({**cfg, "devices": str(profile), "virtual-deadline": deadline, "round-deadline": 0.0,
                             "availability-gate": "server", "num-clients": num_nodes, "results-dir": str(results),
                             "run-name": f"sim-{cfg['run-name']}"})
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        times = row.get("client-virtual-time", {})
        late, lost = set(row.get("late", [])), set(row.get("lost", []))
        for c in range(num_nodes):
            status = "late" if c in late else "lost" if c in lost else "on time" if c in row["participants"] else "off"
            out.append(Reply(int(row["round"]), c, status, times.get(str(c)), None, None, None, None))
    return out


# ---------------------------------------------------------------------- the deployed runs
def run_config(a: argparse.Namespace, results: Path, name: str, steps: int, deadline: float) -> dict[str, Any]:
    return {"num-server-rounds": a.rounds, "strategy": "fedavg-all", "availability": "always", "dataset": "digits",
            "model": a.model, "local-steps": f"steps:n={steps}", "partition": "iid", "round-timeout": 600.0,
            "round-deadline": deadline, "checkpoint-every": 0, "eval-every": 0, "device": "cpu",
            "progress": False, "results-dir": str(results), "run-name": name, "train-seed": 0}


def deployed(site: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    from deploy.record import run_recorded

    shutil.rmtree(site.state_dir / "timing", ignore_errors=True)  # the client records of this run only
    load0, t0 = os.getloadavg(), time.monotonic()
    out, rec, counts = run_recorded(site, cfg, timeout=3600)
    if not out.completed:
        raise SystemExit(f"run {cfg['run-name']} did not complete ({out.status}); see {site.logs}")
    return {"name": cfg["run-name"], "replies": read_replies(out.run_dir), "calibration": rec.calibration if rec else {},
            "counts": counts, "load": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
            "wall": round(time.monotonic() - t0, 1), "round-times": [round(r["round-time"], 3) for r in out.rows],
            "bytes": _bytes(out.run_dir)}


def _bytes(run_dir: Path) -> dict[str, list[float]]:
    """client -> bytes in + out of its node per round (a shaped node's interface counters)."""
    out: dict[str, list[float]] = {}
    for line in (run_dir / "clients.jsonl").read_text().splitlines():
        for c, fig in json.loads(line).get("node", {}).items():
            if fig.get("bytes-in") or fig.get("bytes-out"):
                out.setdefault(c, []).append(fig.get("bytes-in", 0) + fig.get("bytes-out", 0))
    return out


def model_bytes(model: str) -> int:
    from runconfig import WorkloadConfig, from_run_config
    from runconfig.defaults import default_run_config
    from workloads.workload import get_workload

    wl = get_workload(from_run_config(WorkloadConfig, {**default_run_config(ROOT), "dataset": "digits",
                                                       "model": model, "num-clients": 1}))
    return sum(t.numel() * t.element_size() for t in wl.new_model().state_dict().values())


def clock_predictions(profile: Path, num_nodes: int, mbytes: int, steps: int,
                      names: Mapping[str, int]) -> dict[str, dict[str, float]]:
    """Class -> the clock's download, compute, upload and total for ``steps`` local steps of the
    class's first client (``names``: class -> that client)."""
    from virtualtime import VirtualClock, read_profiles

    clock = VirtualClock(read_profiles(profile, num_nodes), model_bytes=mbytes, seed=0)
    out = {}
    for name, client in names.items():
        jt = clock.job_time(client, steps)
        out[name] = {"download": jt.download, "compute": jt.compute, "upload": jt.upload, "total": jt.total}
    return out


def class_result(dc: Any, runs: Mapping[str, Any], cls: Mapping[int, str], pred: Mapping[str, float],
                 probe1: Mapping[str, float], cost: float, step_ms: float | None, client: int) -> dict[str, Any]:
    """One class's numbers: the clock, the cost, the measured E of the timing run and its parts,
    and (a shaped class) its transfers in the probe."""
    name, rs = dc.name, runs["timing"]["replies"]
    es = [r.reply for r in rs if r.round >= 2 and cls[r.client] == name and r.reply is not None]
    measured = statistics.median(es) if es else None
    ratio, within = agreement(measured, pred["total"] + cost)
    med = {k: class_median(rs, cls, name, k) for k in ("pre", "train", "post", "work")}
    transfer = None
    if dc.shaped:
        diffs = [r.reply - r.train for r in runs["probe"]["replies"] if r.round >= 2 and cls[r.client] == name
                 and r.reply is not None and r.train is not None]
        t_meas = statistics.median(diffs) - cost if diffs else None
        t_clock = probe1["download"] + probe1["upload"]
        nbytes = runs["probe"]["bytes"].get(str(client))
        transfer = {"measured": t_meas, "clock": t_clock, "ratio": agreement(t_meas, t_clock)[0],
                    "bytes": int(statistics.median(nbytes)) if nbytes else None}
    first_round = [r.reply for r in rs if r.round == 1 and cls[r.client] == name and r.reply is not None]
    return {"limits": ", ".join(f"{k}={v:g}" for k, v in dc.limits.items()), "step_ms": step_ms, "clock": pred,
            "cost": cost, "predicted": pred["total"] + cost, "measured": measured, "min": min(es) if es else None,
            "max": max(es) if es else None, "n": len(es), "ratio": ratio, "within": within,
            "ratio-clock-alone": agreement(measured, pred["total"])[0],
            "decomposition": {"pre": med["pre"], "train": med["train"], "post": med["post"],
                              "work-train": None if med["work"] is None or med["train"] is None
                              else med["work"] - med["train"]},
            "transfer": transfer, "first-round": first_round[0] if first_round else None}


def fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def tables(res: dict[str, Any]) -> list[str]:
    classes = res["classes"]
    md = [f"Host: {res['host']['cpus']} CPUs; load average (1 min) before/after each run: "
          + ", ".join(f"{k} {v['load'][0]}/{v['load'][1]}" for k, v in res["runs"].items())
          + f". Model {res['model']}: {res['model-bytes']} bytes; {res['steps']} local steps; rounds 2-{res['rounds']}"
          " of each run (round 1 starts the workers under round-timeout).", "",
          "## Per-client round time E (timing run, no deadline): clock vs deployment", "",
          "| class | limits | step_ms (calibrated) | clock: down + compute + up = total (s) | per-message cost "
          "(probe, s) | predicted E (s) | measured E, median [min-max] (n) | measured/predicted | within 15% "
          "| measured/clock alone |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in classes.items():
        p = c["clock"]
        md.append(f"| {name} | {c['limits'] or 'none'} | {fmt(c['step_ms'], 3)} | {p['download']:.2f} + "
                  f"{p['compute']:.2f} + {p['upload']:.2f} = {p['total']:.2f} | {c['cost']:.2f} | "
                  f"{c['predicted']:.2f} | {fmt(c['measured'])} [{fmt(c['min'])}-{fmt(c['max'])}] ({c['n']}) | "
                  f"{fmt(c['ratio'], 3)} | {'yes' if c['within'] else 'NO'} | {fmt(c['ratio-clock-alone'], 3)} |")
    md += ["", "## Where E goes (timing run, medians of rounds 2+, s)", "",
           "pre: the server created the message -> the node's worker took it up (SuperLink, the node's poll, "
           "the download, the ClientApp process start, the hand-off); work: the worker's decode + train + "
           "encode; post: reply built -> the server saw it (the upload, the node's push, the server's 0.1 s "
           "poll). E ~ pre + work + post (less the server's push).", "",
           "| class | pre | clock download | train | clock compute | work - train | post | clock upload | E | "
           "first round E (worker start) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in classes.items():
        d, p = c["decomposition"], c["clock"]
        md.append(f"| {name} | {fmt(d['pre'])} | {p['download']:.2f} | {fmt(d['train'])} | {p['compute']:.2f} | "
                  f"{fmt(d['work-train'])} | {fmt(d['post'])} | {p['upload']:.2f} | {fmt(c['measured'])} | "
                  f"{fmt(c['first-round'])} |")
    shaped = {n: c for n, c in classes.items() if c.get("transfer") is not None}
    if shaped:
        md += ["", "## Transfers alone (probe, 1 step): E - train - the unshaped same-CPU class's cost, vs the "
               "clock's download + upload", "", "| class | measured (s) | clock (s) | measured/clock | bytes in+out "
               "per round (node counters) |", "|---|---|---|---|---|"]
        for name, c in shaped.items():
            t = c["transfer"]
            md.append(f"| {name} | {fmt(t['measured'])} | {t['clock']:.2f} | {fmt(t['ratio'], 3)} | "
                      f"{t['bytes'] or '-'} |")
    part = res["participation"]
    md += ["", f"## Realised participation under round-deadline {res['deadline']} s (deadline run, rounds 2+)", "",
           "| class | predicted E (s) | clock says | on time | late | lost | other | measured on-time share | "
           "agree | simulation: job time (s), on-time share |", "|---|---|---|---|---|---|---|---|---|---|"]
    sim = res["simulation"]
    for name, p in part.items():
        k = p["counts"]
        other = sum(v for s, v in k.items() if s not in ("on time", "late", "lost"))
        md.append(f"| {name} | {classes[name]['predicted']:.2f} | {p['clock']} | {k.get('on time', 0)} | "
                  f"{k.get('late', 0)} | {k.get('lost', 0)} | {other} | {fmt(p['on-time-share'])} | "
                  f"{'yes' if p['agree'] else 'NO'} | {fmt(sim['job-time'][name])}, "
                  f"{fmt(sim['participation'][name]['on-time-share'])} |")
    md += ["", "Simulation: the same run in process with run config `devices` (the profile above, each class's "
           "rtt_ms raised by half its per-message cost so that a job takes that cost longer) and "
           f"`virtual-deadline` {res['deadline']}: the same who-answered-in-time matrix as the deployment in "
           f"rounds 2+: {'yes' if sim['same-matrix'] else 'NO'}."]
    md += ["", f"Verdict: median E within 15% for {sum(c['within'] for c in classes.values())} of {len(classes)} "
           f"classes; participation agrees for {sum(p['agree'] for p in part.values())} of {len(part)}."]
    return md


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default=str(DEFAULT_DEVICES))
    ap.add_argument("--rounds", type=int, default=6, help="rounds per run (round 1 is left out)")
    ap.add_argument("--steps", type=int, default=1000, help="local steps per round in the timing and deadline runs")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--deadline", default="auto", help="round-deadline of the third run, s (auto: from the clock)")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--verbose", action="store_true", help="print the deployment's log lines")
    a = ap.parse_args()

    from deploy.edge.devices import load_devices
    from deploy.local import ProcessSite
    from deploy.procs import exit_on_signals

    exit_on_signals()  # Ctrl-C / kill: the deployment closes, no cgroup or namespace is left
    doc = tomllib.loads(Path(a.devices).read_text())
    n = sum(int(t.get("count", len(t.get("clients", [])))) for t in doc.values())
    plan = load_devices(a.devices, n)
    cls = {c: dc.name for dc in plan.classes for c in dc.clients}
    first = {dc.name: dc.clients[0] for dc in plan.classes}
    mbytes = model_bytes(a.model)
    log_lines: list[str] = []
    log = print if a.verbose else log_lines.append
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="clock-vs-emulation-") as d:
        tmp = Path(d)
        site = ProcessSite(n, tmp / "work", devices=plan, log=log)
        try:
            with site:
                print(f"devices: {plan.describe()}; load {os.getloadavg()[0]:.2f}", flush=True)
                runs["probe"] = deployed(site, run_config(a, tmp / "results", "probe", 1, 0.0))
                print(f"probe done ({runs['probe']['wall']} s)", flush=True)
                runs["timing"] = deployed(site, run_config(a, tmp / "results", "timing", a.steps, 0.0))
                print(f"timing done ({runs['timing']['wall']} s)", flush=True)
                step_ms = {k: 1000 * v["seconds-per-step"] for k, v in runs["timing"]["calibration"].items()
                           if "seconds-per-step" in v}
                profile = tmp / "profile.toml"
                profile.write_text(profile_text(doc, step_ms))
                pred = clock_predictions(profile, n, mbytes, a.steps, first)
                probe1 = clock_predictions(profile, n, mbytes, 1, first)  # the probe's single step
                cost = per_message_cost(runs["probe"]["replies"], cls, {dc.name: dc.cpus for dc in plan.classes},
                                        {dc.name: dc.shaped for dc in plan.classes})
                predicted = {name: pred[name]["total"] + cost[name] for name in first}
                deadline = choose_deadline(predicted) if a.deadline == "auto" else float(a.deadline)
                print(f"clock: {json.dumps({k: round(v, 2) for k, v in predicted.items()})}; deadline {deadline} s",
                      flush=True)
                runs["deadline"] = deployed(site, run_config(a, tmp / "results", "deadline", a.steps, deadline))
            sim_profile = tmp / "profile-with-cost.toml"
            sim_profile.write_text(profile_text(doc, step_ms, cost))
            sim = simulated(run_config(a, tmp / "results", "deadline", a.steps, deadline), sim_profile, n, deadline,
                            tmp / "sim")
        except BaseException:
            print("\n".join(log_lines[-40:]))
            raise
        leftovers = [*(site.edge.leftovers() if site.edge is not None else []), *site.leftovers()]
    classes = {dc.name: class_result(dc, runs, cls, pred[dc.name], probe1[dc.name], cost[dc.name],
                                     step_ms.get(dc.name), first[dc.name]) for dc in plan.classes}
    predicted = {name: c["predicted"] for name, c in classes.items()}
    res = {"host": {"cpus": os.cpu_count(), "load-end": os.getloadavg()}, "model": a.model, "model-bytes": mbytes,
           "steps": a.steps, "rounds": a.rounds, "deadline": deadline, "classes": classes,
           "participation": participation(runs["deadline"]["replies"], cls, predicted, deadline),
           "simulation": {"participation": participation(sim, cls, predicted, deadline),
                          "job-time": {name: class_median(sim, cls, name, "reply") for name in first},
                          "same-matrix": same_matrix(runs["deadline"]["replies"], sim)},
           "runs": {k: {kk: vv for kk, vv in v.items() if kk != "replies"} for k, v in runs.items()},
           "replies": {k: [asdict(r) for r in v["replies"]] for k, v in runs.items()}, "leftovers": leftovers,
           "command": "benchmarks/clock_vs_emulation.py " + " ".join(
               f"--{k} {v}" for k, v in vars(a).items() if k not in ("json", "verbose"))}
    print("\n".join(tables(res)))
    print(f"left behind (cgroups, namespaces, interfaces, processes): {leftovers or 'nothing'}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
