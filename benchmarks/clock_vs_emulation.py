"""The virtual clock against emulated edge devices (issue 29, item 4). Root; prints tables and a
verdict, asserts nothing (``tests/test_clock_emulation.py`` asserts, opt-in).

    sudo .venv/bin/python benchmarks/clock_vs_emulation.py [--devices benchmarks/clock_vs_emulation.toml]
        [--rounds 11] [--steps 1000] [--other-steps 3000] [--deadline auto] [--json OUT] [--profile OUT]

On one set of emulated SuperNodes (``deploy.local.ProcessSite`` with the devices file, what
``python -m deploy launch --devices FILE`` runs: cgroup CPU quotas, tbf bandwidth, the latency
relay), FedAvg on digits / mlp, every client scheduled on, four deployed runs:

1. ``calibration``: ``--steps`` local steps, no deadline (every reply timed). Per class, from its
   rounds 2+, the clock's profile: ``step_ms`` = median training seconds / steps and
   ``overhead_ms`` = median (E - train) - the clock's download + upload (E: the server's seconds
   from pushing the round's messages to seeing the reply). The overhead is the deployment's cost
   per message that is neither training nor the transfers the clock times (the ``flwr-clientapp``
   process Flower starts for every message, under the class's CPU cap; polls; (de)serialisation;
   a shaped link's extra round trips). ``--profile OUT`` keeps this profile, a devices file a
   simulation can use (run config ``devices``).
2. ``timing``: a second run of the same config. Per class, its median E of rounds 2+ against
   the clock's ``VirtualClock.job_time(client, steps).total`` for the calibrated profile: the
   issue's bar, within 15%.
3. ``other``: ``--other-steps`` local steps: the same comparison where the compute term weighs
   differently (is the overhead a fixed cost per job, is compute linear in the steps?).
4. ``deadline``: ``--steps`` with ``round-deadline`` D (auto: in the widest gap between the
   classes' predicted times): the realised participation (``deploy.realised`` statuses) against
   the clock's (on time iff predicted E <= D), and the same run simulated in process on the
   calibrated profile (``devices``, ``virtual-deadline`` D): the same who-answered-in-time matrix?

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
    calibrate,
    choose_deadline,
    class_median,
    participation,
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
    """Class -> the clock's download, overhead, compute, upload and total for ``steps`` local
    steps of the class's first client (``names``: class -> that client)."""
    from virtualtime import VirtualClock, read_profiles

    clock = VirtualClock(read_profiles(profile, num_nodes), model_bytes=mbytes, seed=0)
    out = {}
    for name, client in names.items():
        jt = clock.job_time(client, steps)
        out[name] = {"download": jt.download, "overhead": jt.overhead, "compute": jt.compute, "upload": jt.upload,
                     "total": jt.total}
    return out


def compare(replies: list[Reply], cls: Mapping[int, str], name: str, predicted: float) -> dict[str, Any]:
    """A class's measured E (rounds 2+) against the clock's ``predicted``."""
    es = [r.reply for r in replies if r.round >= 2 and cls[r.client] == name and r.reply is not None]
    measured = statistics.median(es) if es else None
    ratio, within = agreement(measured, predicted)
    return {"predicted": predicted, "measured": measured, "min": min(es) if es else None,
            "max": max(es) if es else None, "n": len(es), "ratio": ratio, "within": within}


def class_result(dc: Any, runs: Mapping[str, Any], cls: Mapping[int, str], pred: Mapping[str, float],
                 other: Mapping[str, float], calib: Mapping[str, float], launcher_step_ms: float | None,
                 unshaped_same_cpu: str | None) -> dict[str, Any]:
    """One class's numbers: its calibrated profile, the clock against the timing and the other
    run, where E goes in the timing run, and (a shaped class) its transfers in the calibration
    run against the clock's."""
    name, rs = dc.name, runs["timing"]["replies"]
    med = {k: class_median(rs, cls, name, k) for k in ("pre", "train", "post", "work")}
    transfer = None
    if dc.shaped and unshaped_same_cpu is not None:
        def rest(c: str) -> float | None:
            v = [r.reply - r.train for r in runs["calibration"]["replies"] if r.round >= 2 and cls[r.client] == c
                 and r.reply is not None and r.train is not None]
            return statistics.median(v) if v else None
        mine, base = rest(name), rest(unshaped_same_cpu)
        t_meas = mine - base if mine is not None and base is not None else None
        t_clock = pred["download"] + pred["upload"]
        transfer = {"measured": t_meas, "clock": t_clock, "ratio": agreement(t_meas, t_clock)[0],
                    "versus": unshaped_same_cpu}
    first_round = [r.reply for r in rs if r.round == 1 and cls[r.client] == name and r.reply is not None]
    return {"clients": list(dc.clients), "limits": ", ".join(f"{k}={v:g}" for k, v in dc.limits.items()),
            "step_ms": calib["step_ms"],
            "overhead_ms": calib["overhead_ms"], "launcher-step-ms": launcher_step_ms, "clock": pred,
            **compare(rs, cls, name, pred["total"]),
            "other": compare(runs["other"]["replies"], cls, name, other["total"]),
            "decomposition": {"pre": med["pre"], "train": med["train"], "post": med["post"],
                              "work-train": None if med["work"] is None or med["train"] is None
                              else med["work"] - med["train"]},
            "transfer": transfer, "first-round": first_round[0] if first_round else None}


def fmt(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def measured_cells(c: Mapping[str, Any]) -> str:
    """'median [min-max] (n) | ratio | yes/NO' of a :func:`compare` result."""
    return (f"{fmt(c['measured'])} [{fmt(c['min'])}-{fmt(c['max'])}] ({c['n']}) | {fmt(c['ratio'], 3)} | "
            f"{'yes' if c['within'] else 'NO'}")


def run_medians(res: Mapping[str, Any], run: str) -> dict[str, float | None]:
    """Class -> median E of rounds 2+ of one deployed run of ``res`` (the JSON's replies)."""
    rs = [Reply(**r) for r in res["replies"][run]]
    cls = {c: name for name, c_ in res["classes"].items() for c in c_["clients"]}
    return {name: class_median(rs, cls, name, "reply") for name in res["classes"]}


def tables(res: dict[str, Any]) -> list[str]:
    classes = res["classes"]
    calib_e = run_medians(res, "calibration")
    md = [f"Host: {res['host']['cpus']} CPUs; load average (1 min) before/after each run: "
          + ", ".join(f"{k} {v['load'][0]}/{v['load'][1]}" for k, v in res["runs"].items())
          + f". Model {res['model']}: {res['model-bytes']} bytes; {res['steps']} local steps (other run: "
          f"{res['other-steps']}); rounds 2-{res['rounds']} of each run (round 1 starts the workers under "
          "round-timeout).", "",
          "## The clock's profile, calibrated on the calibration run", "",
          "| class | limits | step_ms (run; launcher's calibration) | overhead_ms | clock's download + upload (s) |",
          "|---|---|---|---|---|"]
    for name, c in classes.items():
        p = c["clock"]
        md.append(f"| {name} | {c['limits'] or 'none'} | {c['step_ms']:.3f}; {fmt(c['launcher-step-ms'], 3)} | "
                  f"{c['overhead_ms']:.0f} | {p['download']:.2f} + {p['upload']:.2f} |")
    md += ["", f"## Per-client round time E: the clock against the timing run ({res['steps']} steps) and the "
           f"other run ({res['other-steps']} steps)", "",
           "The last column is the deployment against itself: the timing run's median E over the calibration "
           "run's, the same config run twice.", "",
           ]
    md += md_table(["class", "clock: down + overhead + compute + up = E (s)", "measured E, median [min-max] (n)",
                    "measured/clock", "within 15%", "other run: clock E (s)", "measured E, median [min-max] (n)",
                    "measured/clock", "within 15%", "timing / calibration run"],
                   [[name, f"{c['clock']['download']:.2f} + {c['clock']['overhead']:.2f} + "
                     f"{c['clock']['compute']:.2f} + {c['clock']['upload']:.2f} = {c['clock']['total']:.2f}",
                     measured_cells(c), f"{c['other']['predicted']:.2f}", measured_cells(c['other']),
                     fmt(agreement(c['measured'], calib_e[name] or 0.0)[0], 3)] for name, c in classes.items()])
    md += ["", "## Where E goes (timing run, medians of rounds 2+, s)", "",
           "pre: the server created the message -> the node's worker took it up (SuperLink, the node's poll, "
           "the download, the ClientApp process start, the hand-off); work: the worker's decode + train + "
           "encode; post: reply built -> the server saw it (the upload, the node's push, the server's 0.1 s "
           "poll). E ~ pre + work + post (less the server's push).", "",
           ]
    md += md_table(["class", "pre", "clock download + overhead", "train", "clock compute", "work - train", "post",
                    "clock upload", "E", "first round E (worker start)"],
                   [[name, fmt(c["decomposition"]["pre"]), f"{c['clock']['download'] + c['clock']['overhead']:.2f}",
                     fmt(c["decomposition"]["train"]), f"{c['clock']['compute']:.2f}",
                     fmt(c["decomposition"]["work-train"]), fmt(c["decomposition"]["post"]),
                     f"{c['clock']['upload']:.2f}", fmt(c["measured"]), fmt(c["first-round"])]
                    for name, c in classes.items()])
    shaped = {n: c for n, c in classes.items() if c.get("transfer") is not None}
    if shaped:
        md += ["", "## Transfers alone (calibration run): E - train of the shaped class minus that of the "
               "unshaped class with its CPU, against the clock's download + upload", "",
               "| class | against | measured (s) | clock (s) | measured/clock |", "|---|---|---|---|---|"]
        for name, c in shaped.items():
            t = c["transfer"]
            md.append(f"| {name} | {t['versus']} | {fmt(t['measured'])} | {t['clock']:.2f} | {fmt(t['ratio'], 3)} |")
    part = res["participation"]
    md += ["", f"## Realised participation under round-deadline {res['deadline']} s (deadline run, rounds 2+)", "",
           "| class | clock E (s) | clock says | on time | late | lost | other | measured on-time share | "
           "agree | simulation: job time (s), on-time share |", "|---|---|---|---|---|---|---|---|---|---|"]
    sim = res["simulation"]
    for name, p in part.items():
        k = p["counts"]
        other = sum(v for s, v in k.items() if s not in ("on time", "late", "lost"))
        md.append(f"| {name} | {classes[name]['predicted']:.2f} | {p['clock']} | {k.get('on time', 0)} | "
                  f"{k.get('late', 0)} | {k.get('lost', 0)} | {other} | {fmt(p['on-time-share'])} | "
                  f"{'yes' if p['agree'] else 'NO'} | {fmt(sim['job-time'][name])}, "
                  f"{fmt(sim['participation'][name]['on-time-share'])} |")
    md += ["", "Simulation: the same run in process with run config `devices` (the calibrated profile) and "
           f"`virtual-deadline` {res['deadline']}: the same who-answered-in-time matrix as the deployment in "
           f"rounds 2+: {'yes' if sim['same-matrix'] else 'NO'}."]
    n = len(classes)
    md += ["", f"Verdict: median E within 15% for {sum(c['within'] for c in classes.values())} of {n} classes at "
           f"{res['steps']} steps and {sum(c['other']['within'] for c in classes.values())} of {n} at "
           f"{res['other-steps']} steps; participation under the deadline agrees for "
           f"{sum(p['agree'] for p in part.values())} of {len(part)}; the simulated matrix "
           f"{'equals' if sim['same-matrix'] else 'differs from'} the deployment's."]
    return md


def write_report(path: Path, res: Mapping[str, Any], numbers: str | None, profile: str | None) -> None:
    path.write_text("\n".join([
        "# The virtual clock against emulated devices (issue 29, item 4)", "",
        f"Generated by `{res['command']}` (root) on {res.get('date', 'an unrecorded date')}"
        + (f"; numbers in `{numbers}`" if numbers else "") + (f", the calibrated profile in `{profile}`"
                                                             if profile else "")
        + ". Method: docs/edge.md.", "", *tables(dict(res)), "",
        f"Left behind (cgroups, namespaces, interfaces, processes): {res['leftovers'] or 'nothing'}.", ""]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default=str(DEFAULT_DEVICES))
    ap.add_argument("--rounds", type=int, default=11, help="rounds per run (round 1 is left out)")
    ap.add_argument("--steps", type=int, default=1000, help="local steps per round (calibration, timing, deadline)")
    ap.add_argument("--other-steps", type=int, default=3000, help="local steps per round of the other run")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--deadline", default="auto", help="round-deadline of the deadline run, s (auto: from the clock)")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--profile", help="write the calibrated profile (a devices file) here")
    ap.add_argument("--report", help="write the tables as a markdown report here (with --json beside it)")
    ap.add_argument("--verbose", action="store_true", help="print the deployment's log lines")
    ap.add_argument("--from-json", help="write --report from this run's --json instead of running")
    a = ap.parse_args()
    if a.from_json:
        if not a.report:
            ap.error("--from-json writes --report: give both")
        res = json.loads(Path(a.from_json).read_text())
        write_report(Path(a.report), res, Path(a.from_json).name, a.profile and Path(a.profile).name)
        return

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
                runs["calibration"] = deployed(site, run_config(a, tmp / "results", "calibration", a.steps, 0.0))
                print(f"calibration done ({runs['calibration']['wall']} s)", flush=True)
                # the transfers the clock times need only the devices file; step_ms 1 is a placeholder
                bare = tmp / "bare.toml"
                bare.write_text(profile_text(doc, dict.fromkeys(first, 1.0)))
                transfers = {k: v["download"] + v["upload"]
                             for k, v in clock_predictions(bare, n, mbytes, 0, first).items()}
                calib = calibrate(runs["calibration"]["replies"], cls, a.steps, transfers)
                profile = tmp / "profile.toml"
                profile.write_text(profile_text(doc, {k: v["step_ms"] for k, v in calib.items()},
                                                {k: v["overhead_ms"] for k, v in calib.items()}))
                pred = clock_predictions(profile, n, mbytes, a.steps, first)
                other = clock_predictions(profile, n, mbytes, a.other_steps, first)
                predicted = {name: pred[name]["total"] for name in first}
                deadline = choose_deadline(predicted) if a.deadline == "auto" else float(a.deadline)
                print(f"clock: {json.dumps({k: round(v, 2) for k, v in predicted.items()})}; deadline {deadline} s",
                      flush=True)
                runs["timing"] = deployed(site, run_config(a, tmp / "results", "timing", a.steps, 0.0))
                print(f"timing done ({runs['timing']['wall']} s)", flush=True)
                runs["other"] = deployed(site, run_config(a, tmp / "results", "other", a.other_steps, 0.0))
                print(f"other done ({runs['other']['wall']} s)", flush=True)
                runs["deadline"] = deployed(site, run_config(a, tmp / "results", "deadline", a.steps, deadline))
            sim = simulated(run_config(a, tmp / "results", "deadline", a.steps, deadline), profile, n, deadline,
                            tmp / "sim")
            profile_doc = profile.read_text()
        except BaseException:
            print("\n".join(log_lines[-40:]))
            raise
        leftovers = [*(site.edge.leftovers() if site.edge is not None else []), *site.leftovers()]
    launcher = {k: 1000 * v["seconds-per-step"] for k, v in runs["calibration"]["calibration"].items()
                if "seconds-per-step" in v}

    def unshaped_like(dc: Any) -> str | None:
        same = [o.name for o in plan.classes if not o.shaped and o.cpus == dc.cpus]
        return same[0] if same else None

    classes = {dc.name: class_result(dc, runs, cls, pred[dc.name], other[dc.name], calib[dc.name],
                                     launcher.get(dc.name), unshaped_like(dc)) for dc in plan.classes}
    res = {"host": {"cpus": os.cpu_count(), "load-end": os.getloadavg()},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": a.model, "model-bytes": mbytes,
           "steps": a.steps, "other-steps": a.other_steps, "rounds": a.rounds, "deadline": deadline,
           "profile": profile_doc, "classes": classes,
           "participation": participation(runs["deadline"]["replies"], cls, predicted, deadline),
           "simulation": {"participation": participation(sim, cls, predicted, deadline),
                          "job-time": {name: class_median(sim, cls, name, "reply") for name in first},
                          "same-matrix": same_matrix(runs["deadline"]["replies"], sim)},
           "runs": {k: {kk: vv for kk, vv in v.items() if kk != "replies"} for k, v in runs.items()},
           "replies": {k: [asdict(r) for r in v["replies"]] for k, v in runs.items()}, "leftovers": leftovers,
           "command": "benchmarks/clock_vs_emulation.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
               if k not in ("json", "verbose", "profile", "report"))}
    print("\n".join(tables(res)))
    print(f"left behind (cgroups, namespaces, interfaces, processes): {leftovers or 'nothing'}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    if a.profile:
        Path(a.profile).write_text(f"# calibrated by {res['command']}\n" + profile_doc)
    if a.report:
        write_report(Path(a.report), res, a.json and Path(a.json).name, a.profile and Path(a.profile).name)


if __name__ == "__main__":
    main()
