"""Round latency in a real deployment vs in simulation, for the same small workload, plus the
cost of node churn. Prints a table; asserts nothing (a measurement, not a test).

What is measured:
- in-process simulation (``experiments.inprocess.run_inprocess``): median round time;
- Ray simulation through ``flwr run`` (only with ``--ray``): median round time;
- deployment (``deploy.run_deployment``, N SuperNode processes on loopback), once per variant
  (``--variants``): ``tuned`` (``deploy.tuning``: SuperNode idle sleep 0.2 s, SuperExec poll
  0.1 s, one long-lived client worker per SuperNode) and ``defaults`` (Flower's: idle sleep 3 s,
  SuperExec poll 1 s, a fresh ClientApp process per message, the model and workload rebuilt in it): median round time of rounds 2+,
  round 1, the time from ``flwr run`` to round 1's line, and the whole run;
- where a round's seconds go: the poll intervals on the path (from ``deploy.tuning``) and the
  measured cost of a cold ClientApp process's imports, workload build and training;
- a SuperNode's start -> registered time (what a churn grace must cover without look-ahead);
- SIGTERM of a node 2 s into a round -> the server closes that round (line written);
- SIGKILL of a node 2 s into a round -> the server closes that round (heartbeat expiry, ~60 s,
  bounded by round-timeout; here round-timeout is 120 s so the expiry is what is seen);
- the churn driver's grace: ``round-start-delay`` seconds per round when the ServerApp has it
  (a sleep, so its cost is exactly D per round); with look-ahead starts it can be ~0-1 s.

    python benchmarks/deploy_latency.py [--nodes 4] [--rounds 6] [--ray] [--no-churn]
        [--variants tuned defaults]
    python benchmarks/deploy_latency.py --returning [--nodes 4] [--rounds 6] [--warm-only]
        (the README's churn launch with the app's default model: rounds where a group returns vs
        continuing rounds, the waits between rounds, the returning node's worker warm and cold;
        beside it Flower's own deployment of the same app without churn, and the ratio)

The ServerApp pulls replies every 0.1 s (``server_app.network.fast_pull``); ``defaults`` sets
``FLCHURN_PULL_INTERVAL=3`` on the SuperLink, Flower's own 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def workload(n: int, rounds: int, results: Path, name: str) -> dict:
    return {"num-clients": n, "num-server-rounds": rounds, "strategy": "fedavg-all", "availability": "always",
            "dataset": "digits", "model": "logreg", "local-steps": "steps:n=2", "partition": "iid",
            "checkpoint-every": 0, "device": "cpu", "results-dir": str(results / "results"), "run-name": name,
            "progress": False, "round-timeout": 120.0}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def inprocess(n: int, rounds: int, tmp: Path) -> float:
    from experiments.inprocess import run_inprocess

    run_dir = run_inprocess(workload(n, rounds, tmp, "inproc"))
    return statistics.median(r["round-time"] for r in rows(run_dir))


def ray(n: int, rounds: int, tmp: Path) -> float:
    home = tmp / "ray-home"
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    cfg = workload(n, rounds, tmp, "ray")
    rc = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else v}"
                  for k, v in cfg.items())
    try:
        subprocess.run(["flwr", "run", str(ROOT), "--stream", "--run-config", rc, "--federation-config",
                        f"num-supernodes={n} client-resources-num-cpus=1"], env=env, capture_output=True,
                       timeout=600, cwd=tmp)
    finally:  # the local SuperLink that flwr run leaves behind
        out = subprocess.run(["pgrep", "-f", str(home)], capture_output=True, text=True).stdout.split()
        for pid in out:
            subprocess.run(["kill", pid])
    return statistics.median(r["round-time"] for r in rows(tmp / "results" / "ray"))


def variant_options(name: str, n: int) -> dict:
    """ProcessSite(...) keyword arguments of a variant. ``tuned`` is deploy.tuning as the launcher
    applies it (given explicitly, in case the launcher does not yet); ``defaults`` overrides it
    back to Flower's defaults on the nodes."""
    from deploy import tuning
    from deploy.tuning import CLIENT_WORKER

    if name == "tuned":
        return {"node_env": {i: dict(tuning.ENV) for i in range(n)},
                "node_config_extra": {i: dict(tuning.NODE_CONFIG) for i in range(n)}}
    if name == "defaults":
        return {"node_env": {i: {"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "1.0"} for i in range(n)},
                "node_config_extra": {i: {CLIENT_WORKER: False} for i in range(n)}}
    raise SystemExit(f"unknown variant {name!r}: use tuned or defaults")


def deployment_class(variant: str):
    """The launcher's ProcessSite; for ``defaults``, with plain ``flower-supernode`` nodes and the
    ServerApp pulling replies every 3 s (Flower's HttpGrid)."""
    from deploy import local, tuning
    from server_app.network import PULL_INTERVAL_VAR

    k = len(tuning.SUPERNODE)

    class Bench(local.ProcessSite):
        def _spawn(self, name, argv, flwr_home, cwd, extra_env=None, preexec=None):
            if variant == "defaults" and argv[:k] == tuning.SUPERNODE:
                argv = ["flower-supernode", *argv[k:]]
            if variant == "defaults" and argv[0] == "flower-superlink":
                extra_env = {**(extra_env or {}), PULL_INTERVAL_VAR: "3"}
            return super()._spawn(name, argv, flwr_home, cwd, extra_env, preexec)

    return Bench


def deployment(n: int, rounds: int, tmp: Path, variant: str, project: Path = ROOT) -> dict:
    from deploy.run import run_deployment

    Site = deployment_class(variant)
    with Site(n, tmp / f"dep-{variant}", project=project, **variant_options(variant, n)) as dep:
        res = run_deployment(dep, workload(n, rounds, tmp, f"dep-{variant}"))
        rs = rows(res.run_dir)
        times = [r["round-time"] for r in rs]
        return {"round": statistics.median(times[1:]) if len(times) > 1 else times[0],
                "rounds": times, "round-1": times[0], "first-line": rs[0]["wall-time"],
                "run": res.wall, "status": res.status}


def churn_costs(n: int, tmp: Path, project: Path) -> dict:
    from deploy.local import ProcessSite
    from deploy.run import run_deployment

    out: dict = {}
    with ProcessSite(n, tmp / "restart", project=project) as dep:  # a node's restart: start -> registered
        for i in range(n):
            dep.start_node(i)
        t = []
        for _ in range(2):
            dep.stop_node(0, "term")
            t0 = time.monotonic()
            dep.start_node(0)
            dep.wait_registered(0)
            t.append(time.monotonic() - t0)
        out["node-start"] = statistics.mean(t)
    # SIGTERM in round 2, SIGKILL in round 3 (all nodes scheduled on; nobody restarted after)
    trace = tmp / "all-on.csv"
    trace.write_text("\n".join([",".join(["1"] * n)] * 3) + "\n")
    with ProcessSite(n, tmp / "churn", project=project) as dep:
        cfg = {**workload(n, 3, tmp, "churn"), "availability": f"trace-matrix:path={trace}"}
        res = run_deployment(dep, cfg, churn="rounds", crashes={2: [(n - 1, 2.0, "term")], 3: [(n - 2, 2.0, "kill")]})
        ev = {e["action"]: e["t"] for e in res.driver.events if e["action"] in ("term", "crash")}
        ends = {r["round"]: r["wall-time"] for r in rows(res.run_dir)}  # from the server's round-1 start
        t_first = res.driver.started_at  # ~ the server's round-1 start (monotonic)
        out["term->round-end"] = ends[2] - (ev["term"] - t_first)
        out["kill->round-end"] = ends[3] - (ev["crash"] - t_first)
        out["churn-status"] = res.status
    return out


COLD_CLIENT = """
import time, sys
t0 = time.perf_counter(); import flwr.app, flwr.clientapp; t1 = time.perf_counter()
import client_app.app; t2 = time.perf_counter()
import torch, workloads.workload; t3 = time.perf_counter()
from flwr.app import Context, RecordDict
from client_app.app import workload_of
cfg = {**%(cfg)r}
ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config=cfg,
              node_config={"partition-id": 0, "num-partitions": cfg["num-clients"]})
wl, pid = workload_of(ctx); t4 = time.perf_counter()
model = wl.new_model(); wl.train_client(model, pid, 0); t5 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
"""


def cold_client(n: int, tmp: Path) -> dict:
    """What a fresh ClientApp process spends before and on its work (a cold python process)."""
    cfg = {**__import__("experiments.inprocess", fromlist=["x"]).default_run_config(), **workload(n, 1, tmp, "x")}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", COLD_CLIENT % {"cfg": cfg}], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    total = time.perf_counter() - t0
    flwr_s, app_s, torch_s, build_s, train_s = map(float, out)
    return {"python+flwr": total - (app_s + torch_s + build_s + train_s), "thin-app": app_s,
            "torch+workload-module": torch_s, "workload-build": build_s, "train": train_s}


def launch_config(n: int, rounds: int, tmp: Path, name: str, availability: str) -> dict:
    """What ``python -m deploy launch --num-nodes N --run-config "num-server-rounds=R
    availability=..."`` runs: the app's defaults (digits, the cnn, 10 steps of 32) for the rest."""
    return {"num-clients": n, "num-server-rounds": rounds, "availability": availability,
            "results-dir": str(tmp / "results"), "run-name": name, "progress": False}


def timed_rounds(rs: list[dict]) -> dict:
    """Round times, split into rounds in which a node returns and continuing ones (round 1 is
    neither: every node starts), and the waits between rounds (the server waiting for returning
    nodes to register, outside any round's time)."""
    back, going = [], []
    for prev, row in zip(rs, rs[1:], strict=False):
        (back if set(row["participants"]) - set(prev["participants"]) else going).append(row)
    gaps = [row["wall-time"] - row["round-time"] - prev["wall-time"] for prev, row in zip(rs, rs[1:], strict=False)]
    return {"median": statistics.median(r["round-time"] for r in rs), "rounds": [r["round-time"] for r in rs],
            "returning": [r["round-time"] for r in back], "continuing": [r["round-time"] for r in going],
            "returning-reply": [max(r.get("client-reply-time", {"-": 0.0}).values()) for r in back],
            "gaps": gaps, "run": rs[-1]["wall-time"]}


def returning_rounds(n: int, rounds: int, tmp: Path, warm: bool) -> dict:
    """The README's churn launch (``group-cyclic:groups=2,window=2``, the app's default model):
    round times of the rounds in which a group returns against the continuing ones; ``warm``
    (``--warm-workers``, the default): the look-ahead start also readies the returning node's
    client worker (deploy.warmstart.start_warm_worker), else the worker starts at its first message."""
    from deploy.local import ProcessSite
    from deploy.run import run_deployment

    name = f"returning-{'warm' if warm else 'cold'}"
    cfg = launch_config(n, rounds, tmp, name, "group-cyclic:groups=2,window=2")
    with ProcessSite(n, tmp / name, warm_workers=warm) as dep:
        out = run_deployment(dep, cfg, churn="rounds")
    return {"status": out.status, **timed_rounds(rows(out.run_dir))}


def flower_without_churn(n: int, rounds: int, tmp: Path) -> dict:
    """The same app and workload deployed as Flower deploys it: ``flower-supernode`` with Flower's
    waits, a ``flwr-clientapp`` process per message that builds the workload, the ServerApp's
    3 s pulls (variant ``defaults``), every node on every round."""
    from deploy.run import run_deployment

    Site = deployment_class("defaults")
    cfg = launch_config(n, rounds, tmp, "flower-defaults", "always")
    with Site(n, tmp / "flower-defaults", **variant_options("defaults", n)) as dep:
        out = run_deployment(dep, cfg)
    return {"status": out.status, **timed_rounds(rows(out.run_dir))}


def main_returning(a: argparse.Namespace) -> None:
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="deploy-bench-") as d:
        res = {f"launcher, churn, {'warm' if w else 'cold'} returning workers": returning_rounds(
            a.nodes, a.rounds, Path(d), w) for w in ((True,) if a.warm_only else (True, False))}
        flower = flower_without_churn(a.nodes, a.rounds, Path(d))
    print(f"\n{a.nodes} nodes, the README's churn launch (group-cyclic:groups=2,window=2, the app's defaults: "
          f"digits, cnn, 10 steps of 32), {a.rounds} rounds; {os.cpu_count()} CPUs; load before "
          f"{load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}")
    print("| deployment | median round | rounds a group returns (slowest reply) | continuing rounds | "
          "waits between rounds | round 1 -> last round's end |")
    print("|---|---|---|---|---|---|")
    for label, r in res.items():
        back = ", ".join(f"{t:.1f} ({s:.1f})" for t, s in zip(r["returning"], r["returning-reply"], strict=True))
        print(f"| {label} | {r['median']:.2f} | {back} | {', '.join(f'{t:.1f}' for t in r['continuing'])} | "
              f"{', '.join(f'{g:.1f}' for g in r['gaps'])} | {r['run']:.1f} | ({r['status']})")
    print(f"| Flower's own (flower-supernode, defaults), no churn | {flower['median']:.2f} | - | "
          f"{', '.join(f'{t:.1f}' for t in flower['rounds'][1:])} | {', '.join(f'{g:.1f}' for g in flower['gaps'])} "
          f"| {flower['run']:.1f} | ({flower['status']})")
    ours = next(iter(res.values()))
    print(f"launcher with churn / Flower's own without: median round {ours['median'] / flower['median']:.2f}x, "
          f"round 1 -> end {ours['run'] / flower['run']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ray", action="store_true", help="also time a Ray simulation through flwr run")
    ap.add_argument("--no-churn", action="store_true", help="skip the restart, SIGTERM and SIGKILL measurements")
    ap.add_argument("--variants", nargs="+", default=["tuned", "defaults"], help="deployment variants to time")
    ap.add_argument("--returning", action="store_true",
                    help="only: the README's churn launch (returning vs continuing rounds, the returning worker "
                         "warm and cold) beside Flower's own deployment of the app without churn")
    ap.add_argument("--warm-only", action="store_true", help="with --returning: skip the cold-worker launch")
    a = ap.parse_args()
    if a.returning:
        return main_returning(a)
    from deploy import tuning

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="deploy-bench-") as d:
        tmp = Path(d)
        res = {"inprocess-round": inprocess(a.nodes, a.rounds, tmp)}
        if a.ray:
            res["ray-round"] = ray(a.nodes, a.rounds, tmp)
        cold = cold_client(a.nodes, tmp)
        deps = {v: deployment(a.nodes, a.rounds, tmp, v) for v in a.variants}
        if not a.no_churn:
            res.update(churn_costs(a.nodes, tmp, ROOT))
    load_after = os.getloadavg()
    print(f"\n{a.nodes} clients, digits/logreg, steps:n=2, fedavg-all, {a.rounds} rounds; {os.cpu_count()} CPUs; "
          f"load average (1/5/15 min) before {'/'.join(f'{x:.1f}' for x in load_before)}, "
          f"after {'/'.join(f'{x:.1f}' for x in load_after)}")
    print("| measurement | seconds |\n|---|---|")
    print(f"| round, in-process simulation (median) | {res['inprocess-round']:.2f} |")
    if "ray-round" in res:
        print(f"| round, Ray simulation (flwr run, median) | {res['ray-round']:.2f} |")
    for v, r in deps.items():
        print(f"| round, deployment `{v}` (median of rounds 2+) | {r['round']:.2f} |")
        print(f"| round 1, deployment `{v}` (starts the client processes / workers) | {r['round-1']:.2f} |")
        print(f"| deployment `{v}`: flwr run -> finished ({r['status']}) | {r['run']:.1f} |")
    labels = {
        "node-start": "SuperNode start -> registered",
        "term->round-end": "SIGTERM 2 s into a round -> round closed",
        "kill->round-end": "SIGKILL 2 s into a round -> round closed (round-timeout 120 s)",
    }
    for k, label in labels.items():
        if k in res:
            print(f"| {label} | {res[k]:.1f} |")
    if not a.no_churn:
        print("| churn grace per round (round-start-delay) | D (a sleep); 0 with look-ahead starts |")
    for v, r in deps.items():
        print(f"rounds, `{v}`: " + " ".join(f"{t:.2f}" for t in r["rounds"]))
    poll = float(tuning.ENV.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", 1.0))
    print("\nwhere a deployed round's seconds go (waits: Flower's intervals, mean wait = half; work: measured "
          "in a cold python process)")
    print("| step | defaults | tuned |\n|---|---|---|")
    print(f"| SuperNode idle sleep before it pulls the round's message | <= 3 | <= {tuning.IDLE_SLEEP:g} |")
    print(f"| SuperExec looks for the task | <= 1 | <= {poll:g} |")
    print(f"| process start, python + flwr imports | {cold['python+flwr']:.2f} | {cold['python+flwr']:.2f} |")
    print(f"| import the ClientApp module (thin, no torch) | {cold['thin-app']:.2f} | {cold['thin-app']:.2f} |")
    print(f"| import torch + workload code | {cold['torch+workload-module']:.2f} | 0 (worker keeps it) |")
    print(f"| build the workload (data, partition) | {cold['workload-build']:.2f} | 0 (worker keeps it) |")
    print(f"| train (logreg, 2 steps) | {cold['train']:.2f} | {cold['train']:.2f} |")
    print(f"| SuperNode looks for the reply to push | <= 0.5 | <= {min(0.5, tuning.IDLE_SLEEP):g} |")
    print("| ServerApp looks for replies | <= 3 | <= 0.1 (fast_pull) |")


if __name__ == "__main__":
    main()
