"""How many SuperNodes one SuperLink (and the driver beside it) holds on this machine: memory per
node, round overhead per node, and the CLI and registration as nodes grow. A benchmark: it prints
figures and asserts nothing. The figures and the 1,000-node estimate built on them are in
docs/deployment.md ("Scale: how many SuperNodes one SuperLink holds").

Everything runs as the project's process deployment (:class:`deploy.local.ProcessSite`: Flower's
``flower-superlink`` and ``flower-supernode`` through ``deploy.tuning``, on loopback, insecure).
Processes are grouped by the tag every spawned process and its children carry
(``FLCHURN_NODE_TAG=<deployment>-superlink`` / ``-node-I.K``: the SuperLink with its SuperExec and
the ServerApp; a SuperNode with its SuperExec, its ``flwr-clientapp`` processes and its client
worker). Memory: RSS and PSS summed over a group's live processes (``/proc/PID/smaps_rollup``;
PSS counts a shared page once across the processes that share it, so PSS sums add up to what the
host really spends). CPU: ``utime + stime + cutime + cstime`` summed over a group (reaped
children included).

1. **Idle nodes** (one SuperLink, nodes started in steps up to ``--max-nodes``): after each step,
   the SuperLink's RSS/PSS (growth per registered node), an idle registered SuperNode's RSS/PSS,
   how long the step's nodes took from start to registered (all at once: the host's CPUs are the
   limit), a node's restart -> registered with the others registered, and ``flwr supernode ls
   --format json`` (best of ``--repeats``; the CLI's own start-up is in it: the 0-node line).
2. **Rounds** (a fresh deployment per count in ``--round-nodes``): ``--rounds`` rounds of the
   smallest workload (digits, logreg, 1 local step, every node every round, no evaluation, no
   checkpoints); per round after the first (the first starts every client worker): the wall time
   (median and best), the CPU seconds the SuperLink side (SuperLink + ServerApp) and the nodes
   spent, per node; the clients' own training seconds (``client-train-time``), so the rest is the
   path's overhead; the SuperLink side's peak RSS during the rounds.
3. **A worker training the default model** (``--worker-model``, default the app's ``cnn``, 2
   rounds on 2 nodes, the app's default local steps): one client worker's peak RSS (VmHWM) and
   PSS after training.

    python benchmarks/superlink_scale.py                       # 4, 8, 16, 32 idle; rounds at 4, 8, 16
    python benchmarks/superlink_scale.py --max-nodes 8 --round-nodes 4 --rounds 3   # ~2 minutes
    python benchmarks/superlink_scale.py --json out.json       # the figures as JSON too

Needs Linux (``/proc``). The host's load is printed before and after each part: on a shared host,
compare best-of figures and CPU seconds (which do not grow with the load) over wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from deploy_latency import deployment_class, variant_options  # noqa: E402  (benchmarks/: tuned | defaults)

from deploy.local import ProcessSite  # noqa: E402
from deploy.procs import NODE_TAG_VAR, tagged_pids  # noqa: E402
from deploy.run import run_deployment  # noqa: E402
from runconfig.defaults import default_run_config  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
MIB = 1024 * 1024

TRIVIAL = {"strategy": "fedavg-all", "availability": "always", "dataset": "digits", "model": "logreg",
           "local-steps": "steps:n=1", "partition": "iid", "batch-size": 32, "eval-every": 0,
           "checkpoint-every": 0, "device": "cpu", "progress": False, "round-timeout": 300.0}


# ---------------------------------------------------------------- /proc
def proc_memory(pid: int) -> tuple[int, int, int]:
    """(RSS, PSS, peak RSS) of ``pid`` in bytes; zeros for a process gone meanwhile."""
    rss = pss = hwm = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss, hwm


def proc_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its reaped children."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / TICK  # utime stime cutime cstime


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def group(site: ProcessSite, name: str) -> list[int]:
    """Live pids of the spawned process ``name`` (``superlink``, ``node-3.1``) and its descendants."""
    return tagged_pids(f"{site.tag}-{name}", NODE_TAG_VAR)


def node_name(site: ProcessSite, i: int) -> str:
    return f"node-{i}.{site.nodes[i].incarnations}"


def memory_of(pids: list[int]) -> dict[str, float]:
    rows = [proc_memory(p) for p in pids]
    return {"rss": sum(r[0] for r in rows) / MIB, "pss": sum(r[1] for r in rows) / MIB, "procs": len(pids)}


def cpu_of(pids: list[int], marker: str | None = None) -> float:
    """CPU seconds of ``pids`` (only those whose command line has ``marker``, when given)."""
    return sum(proc_cpu(p) for p in pids if marker is None or marker in cmdline(p))


def idle_cpu(site: ProcessSite, n: int, window: float) -> tuple[float, float, float]:
    """CPU seconds per second (cores) the SuperLink side, the ``n`` idle nodes and their SuperExecs
    spend: the lowest of two ``window``-second windows (a SuperExec still importing inflates the first)."""
    def now() -> tuple[float, float, float]:
        nodes = [p for i in range(n) for p in group(site, node_name(site, i))]
        return cpu_of(group(site, "superlink")), cpu_of(nodes), cpu_of(nodes, "flower-superexec")
    rates = []
    for _ in range(2):
        c0, t0 = now(), time.monotonic()
        time.sleep(window)
        c1, dt = now(), time.monotonic() - t0
        rates.append(tuple((b - a) / dt for a, b in zip(c0, c1, strict=True)))
    return min(r[0] for r in rates), min(r[1] for r in rates), min(r[2] for r in rates)


def settle(site: ProcessSite, n: int, timeout: float = 300.0) -> None:
    """Wait until each of the ``n`` registered nodes runs its SuperExec (started after registering),
    then 3 s more: the nodes are in their idle pull loop."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(any("flower-superexec" in cmdline(p) for p in group(site, node_name(site, i))) for i in range(n)):
            break
        time.sleep(1.0)
    else:
        print(f"  (not every node's SuperExec runs {timeout:.0f} s after registering: measuring anyway)", flush=True)
    time.sleep(3.0)


def load() -> float:
    return os.getloadavg()[0]


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


# ---------------------------------------------------------------- 1. idle nodes
def supernode_ls(site: ProcessSite, repeats: int) -> tuple[float, int, float, float]:
    """``flwr supernode ls --format json``: (best seconds, nodes listed online, best CPU seconds of
    the CLI process, of the SuperLink side during the call). The CPU figures do not grow with the
    host's load as the wall time does."""
    assert site.cli is not None
    best, listed, cli_cpu, link_cpu = float("inf"), -1, float("inf"), float("inf")
    for _ in range(repeats):
        c0, l0, t0 = os.times(), cpu_of(group(site, "superlink")), time.perf_counter()
        res = site.cli("supernode", "ls", *site.cli.target, "--format", "json", timeout=300)
        best = min(best, time.perf_counter() - t0)
        c1 = os.times()
        cli_cpu = min(cli_cpu, c1.children_user + c1.children_system - c0.children_user - c0.children_system)
        link_cpu = min(link_cpu, cpu_of(group(site, "superlink")) - l0)
        if res.returncode != 0:
            raise SystemExit(f"flwr supernode ls exited {res.returncode}: {(res.stdout + res.stderr)[-1500:]}")
        doc = json.loads(res.stdout[res.stdout.index("{"):])
        listed = sum(1 for n in doc.get("nodes", []) if str(n.get("status", "")).lower() == "online")
    return best, listed, cli_cpu, link_cpu


def site_of(variant: str, n: int, work: Path, **kw: Any) -> ProcessSite:
    """A deployment of ``n`` nodes as the launcher makes it (``tuned``) or with Flower's own
    SuperNode loop and SuperExec poll (``defaults``): benchmarks/deploy_latency.py's variants."""
    return deployment_class(variant)(n, work, **variant_options(variant, n), **kw)


def idle_part(steps: list[int], repeats: int, tmp: Path, idle_window: float = 10.0,
              variant: str = "tuned") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with site_of(variant, steps[-1], tmp / "idle", warm_workers=False) as site:
        time.sleep(2.0)
        base = memory_of(group(site, "superlink"))
        ls0, _, ls0_cpu, _ = supernode_ls(site, repeats)
        cores0, _, _ = idle_cpu(site, 0, idle_window)
        out.append({"nodes": 0, "superlink": base, "ls": ls0, "ls-cli-cpu": ls0_cpu, "link-idle-cores": cores0,
                    "load": load()})
        print(f"  0 nodes: SuperLink {base['rss']:.0f} MiB RSS / {base['pss']:.0f} MiB PSS "
              f"({base['procs']} processes), idle {cores0 * 1000:.0f} ms CPU/s; `flwr supernode ls` {ls0:.2f} s "
              f"(the CLI {ls0_cpu:.2f} CPU-s) "
              f"(load {load():.1f})", flush=True)
        started, prev = 0, base["rss"]
        for n in steps:
            t0 = time.perf_counter()
            for i in range(started, n):
                site.start_node(i)
            for i in range(started, n):
                site.wait_registered(i)
            reg = time.perf_counter() - t0
            batch = n - started
            started = n
            settle(site, n)
            link = memory_of(group(site, "superlink"))
            nodes = [memory_of(group(site, node_name(site, i))) for i in range(n)]
            link_cores, node_cores, exec_cores = idle_cpu(site, n, idle_window)
            ls, online, ls_cpu, ls_link = supernode_ls(site, repeats)
            # one node's restart -> registered, with the others registered (what a returning node waits)
            site.stop_node(0, "term")
            t1 = time.perf_counter()
            site.start_node(0)
            site.wait_registered(0)
            rejoin = time.perf_counter() - t1
            row = {"nodes": n, "superlink": link, "node-rss": statistics.median(x["rss"] for x in nodes),
                   "node-pss": statistics.median(x["pss"] for x in nodes),
                   "node-procs": statistics.median(x["procs"] for x in nodes),
                   "register-batch": batch, "register-s": reg, "rejoin-s": rejoin, "ls": ls, "online": online,
                   "ls-cli-cpu": ls_cpu, "ls-link-cpu": ls_link,
                   "link-idle-cores": link_cores, "node-idle-cores": node_cores, "superexec-idle-cores": exec_cores,
                   "load": load(), "mem-available-mib": mem_available()}
            out.append(row)
            grow, prev = (link["rss"] - prev) / batch, link["rss"]  # the first step has the SuperLink's warm-up too
            print(f"{n:3d} nodes: SuperLink {link['rss']:.0f} MiB RSS / {link['pss']:.0f} MiB PSS "
                  f"(+{grow:.2f} MiB RSS per node added); a SuperNode {row['node-rss']:.0f} MiB RSS / "
                  f"{row['node-pss']:.0f} MiB PSS ({row['node-procs']:.0f} processes); {batch} started -> registered "
                  f"{reg:.1f} s ({reg / batch:.2f} s/node); one restart -> registered {rejoin:.1f} s; "
                  f"`flwr supernode ls` {ls:.2f} s ({online} online listed; CPU-s: the CLI {ls_cpu:.2f}, the SuperLink "
                  f"{ls_link:.3f}); idle CPU: SuperLink side "
                  f"{link_cores * 1000:.0f} ms/s, a node {node_cores / n * 1000:.0f} ms/s (its SuperExec "
                  f"{exec_cores / n * 1000:.0f}) (load {row['load']:.1f})",
                  flush=True)
    return out


# ---------------------------------------------------------------- 2. rounds
class Sampler:
    """CPU and memory of the SuperLink side and of the nodes, sampled at every round's line."""

    def __init__(self, site: ProcessSite) -> None:
        self.site = site
        self.samples: list[dict[str, Any]] = []

    def __call__(self, row: dict[str, Any]) -> None:
        link = group(self.site, "superlink")
        nodes = [p for i in self.site.nodes for p in group(self.site, node_name(self.site, i))]
        self.samples.append({"round": row.get("round"), "t": time.monotonic(), "link-cpu": cpu_of(link),
                             "serverapp-cpu": cpu_of(link, "flwr-serverapp"), "node-cpu": cpu_of(nodes),
                             "worker-cpu": cpu_of(nodes, "client_app.worker_process"),
                             "superexec-cpu": cpu_of(nodes, "flower-superexec"), "link-rss": memory_of(link)["rss"],
                             "link-hwm": sum(proc_memory(p)[2] for p in link) / MIB})


def train_seconds(row: dict[str, Any]) -> float | None:
    """The longest of the round's clients' training seconds, where the row has them."""
    v = row.get("client-train-time")
    if isinstance(v, dict):
        vals = [float(x) for x in v.values()]
    elif isinstance(v, list):
        vals = [float(x) for x in v]
    elif isinstance(v, int | float):
        vals = [float(v)]
    else:
        return None
    return max(vals) if vals else None


def round_part(n: int, rounds: int, tmp: Path, variant: str = "tuned") -> dict[str, Any]:
    load0 = load()
    with site_of(variant, n, tmp / f"rounds-{n}") as site:
        sampler = Sampler(site)
        cfg = {**TRIVIAL, "num-server-rounds": rounds, "results-dir": str(tmp / "results"), "run-name": f"scale-{n}"}
        res = run_deployment(site, cfg, on_row=sampler, timeout=1800)
        if not res.completed:
            raise SystemExit(f"the {n}-node run ended {res.status}; see {site.logs}")
        rows = res.rows
    times = [float(r["round-time"]) for r in rows][1:]
    s = sampler.samples
    def per_round(key: str) -> float | None:
        deltas = [b[key] - a[key] for a, b in zip(s, s[1:], strict=False)]
        return statistics.median(deltas) if deltas else None

    trains = [t for t in (train_seconds(r) for r in rows[1:]) if t is not None]
    out = {"nodes": n, "rounds": len(rows), "round-median": statistics.median(times), "round-best": min(times),
           "link-cpu-round": per_round("link-cpu"), "serverapp-cpu-round": per_round("serverapp-cpu"),
           "node-cpu-round": per_round("node-cpu"), "worker-cpu-round": per_round("worker-cpu"),
           "superexec-cpu-round": per_round("superexec-cpu"),
           "train-max": statistics.median(trains) if trains else None,
           "link-rss-max": max(x["link-rss"] for x in s), "link-hwm": max(x["link-hwm"] for x in s),
           "load-before": load0, "load-after": load()}
    lc, sc, nc, wc, xc = (out[k] or 0.0 for k in ("link-cpu-round", "serverapp-cpu-round", "node-cpu-round",
                                                 "worker-cpu-round", "superexec-cpu-round"))
    print(f"{n:3d} nodes: round {out['round-median']:.2f} s median, {out['round-best']:.2f} s best "
          f"(rounds 2-{len(rows)}); CPU per round: SuperLink side {lc:.2f} s ({lc / n * 1000:.0f} ms/node; "
          f"the ServerApp {sc:.2f} s of it), nodes {nc:.2f} s ({nc / n * 1000:.0f} ms/node: SuperExec + its "
          f"flwr-clientapp processes {xc / n * 1000:.0f}, the worker {wc / n * 1000:.0f}, the SuperNode the rest); "
          f"slowest client's training "
          f"{out['train-max'] if out['train-max'] is not None else float('nan'):.3f} s; SuperLink side RSS "
          f"{out['link-rss-max']:.0f} MiB at most (load {load0:.1f} -> {out['load-after']:.1f})", flush=True)
    return out


# ---------------------------------------------------------------- 3. a worker training the default model
def worker_part(model: str, tmp: Path) -> dict[str, Any]:
    defaults = default_run_config()
    seen: dict[str, float] = {"hwm": 0.0, "pss": 0.0, "rss": 0.0}
    with ProcessSite(2, tmp / "worker") as site:
        def sample(row: dict[str, Any]) -> None:
            for i in site.nodes:
                for p in group(site, node_name(site, i)):
                    if "client_app.worker_process" in cmdline(p):
                        rss, pss, hwm = proc_memory(p)
                        seen["hwm"] = max(seen["hwm"], hwm / MIB)
                        seen["pss"] = max(seen["pss"], pss / MIB)
                        seen["rss"] = max(seen["rss"], rss / MIB)

        cfg = {**TRIVIAL, "model": model, "local-steps": defaults["local-steps"], "num-server-rounds": 2,
               "results-dir": str(tmp / "results"), "run-name": f"worker-{model}"}
        res = run_deployment(site, cfg, on_row=sample, timeout=1800)
        if not res.completed:
            raise SystemExit(f"the worker run ended {res.status}; see {site.logs}")
    print(f"a client worker training {model!r} ({defaults['local-steps']}, batch {TRIVIAL['batch-size']}): "
          f"{seen['rss']:.0f} MiB RSS, {seen['pss']:.0f} MiB PSS, peak RSS {seen['hwm']:.0f} MiB", flush=True)
    return {"model": model, **seen}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-nodes", type=int, default=32, help="idle part: the last step (default 32)")
    p.add_argument("--steps", type=int, nargs="*", help="idle part's node counts (default 4, 8, 16, ... up to --max-nodes)")
    p.add_argument("--round-nodes", type=int, nargs="*", default=None,
                   help="node counts of the round part (default 4, 8, 16, capped at --max-nodes; none: skip)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per count (the first is not counted)")
    p.add_argument("--repeats", type=int, default=3, help="best of this many `flwr supernode ls`")
    p.add_argument("--idle-window", type=float, default=10.0, help="seconds over which idle CPU is measured")
    p.add_argument("--worker-model", default=default_run_config()["model"], help="part 3's model ('' skips it)")
    p.add_argument("--variant", choices=["tuned", "defaults"], default="tuned",
                   help="parts 1 and 2: the launcher's node settings (deploy.tuning: 0.2 s idle pull sleep, "
                        "0.1 s SuperExec poll, a client worker) or Flower's (3 s, 1 s, a ClientApp process per message)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args(argv)
    if a.max_nodes < 1 or a.rounds < 2:
        p.error("--max-nodes must be >= 1 and --rounds >= 2 (the first round is not counted)")
    steps = a.steps or [n for n in (4, 8, 16, 32, 64, 128) if n < a.max_nodes] + [a.max_nodes]
    round_nodes = [4, 8, 16] if a.round_nodes is None else a.round_nodes
    round_nodes = [n for n in round_nodes if n <= a.max_nodes]
    t0 = time.monotonic()
    print(f"host: {os.cpu_count()} CPUs, {mem_available()} MiB available, load {load():.1f}; Flower "
          f"{__import__('flwr').__version__}", flush=True)
    figures: dict[str, Any] = {"cpus": os.cpu_count(), "load-start": load(), "variant": a.variant}
    with tempfile.TemporaryDirectory(prefix="superlink-scale-") as d:
        tmp = Path(d)
        print("\n1. idle registered SuperNodes", flush=True)
        figures["idle"] = idle_part(sorted(set(steps)), a.repeats, tmp, a.idle_window, a.variant)
        if round_nodes:
            print(f"\n2. rounds of the smallest workload (digits, logreg, 1 local step; {a.rounds} rounds)", flush=True)
            figures["rounds"] = [round_part(n, a.rounds, tmp, a.variant) for n in round_nodes]
        if a.worker_model:
            print("\n3. a client worker training the default model", flush=True)
            figures["worker"] = worker_part(a.worker_model, tmp)
    figures["load-end"], figures["seconds"] = load(), time.monotonic() - t0
    print(f"\nload {figures['load-start']:.1f} at the start, {figures['load-end']:.1f} at the end; "
          f"{figures['seconds']:.0f} s in all")
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
