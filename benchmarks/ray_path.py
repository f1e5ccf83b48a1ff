"""The project's app on Flower's Ray simulation beside a plain Flower FedAvg app on the same work
(issue 49 item 5; prints figures, never asserts).

Both run with ``flwr run`` on one private local SuperLink (``experiments.run.FlowerRun``: its own
FLWR_HOME and ports), Ray started by Flower's ``flwr-simulation`` as for any user:

- ``flchurn``: this project's ServerApp and ClientApp (``fedavg-active``, availability
  ``group-cyclic:groups=10,window=1``: 10 of the 100 nodes a round, as FedAvg's sampling; no
  evaluation but the last round's, no checkpoints);
- ``flower``: ``benchmarks/plain_flower_app``: ``flwr.serverapp.strategy.FedAvg(fraction_train=0.1)``
  and a ClientApp with a plain PyTorch loop, on the project's data, model, partition and
  mini-batches (the same work: MNIST, the 2NN MLP, 100 clients, 10 local steps of 32).

**CPU seconds**: the user + system time of every process the SuperLink starts (it and its
descendants carry one tag in their environment: the simulation, Ray's GCS, raylet and workers;
this benchmark's own ``flwr run`` and ``flwr ls``, which carry it too, are left out),
sampled while they live and read as each round ends: when its line appears in the project's
``metrics.jsonl``, or in the plain app's round log (its FedAvg's ``evaluate_fn`` appends the round;
polled every 20 ms). **Per round** = the CPU between the end of round 2 (the actors are warm) and
the end of round R − 1 (the project evaluates in round R), over those rounds; **start-up** = the
CPU to the end of round 1 minus one round (the FAB install, Ray, the actors, the workload build,
the project's identity query). Wall seconds likewise. Each figure is the best of ``--repeats``
(interleaved: a load spike hits both apps alike).

    python -m benchmarks.ray_path                      # 12 rounds, best of 3
    python -m benchmarks.ray_path --repeats 3 --apps flchurn
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from deploy.procs import tagged_pids
from experiments.presets import DATA_DIR
from experiments.run import TAG_VAR, FlowerRun

ROOT = Path(__file__).resolve().parent.parent
PLAIN_APP = ROOT / "benchmarks" / "plain_flower_app"
WORK = {"dataset": "mnist", "model": "mlp", "num-clients": 100, "partition": "client-dirichlet:alpha=0.1",
        "local-steps": "steps:n=10", "batch-size": 32, "lr": 0.05, "data-dir": DATA_DIR}
FLCHURN = {**WORK, "strategy": "fedavg-active", "availability": "group-cyclic:groups=10,window=1", "eval-every": 0,
           "checkpoint-every": 0, "progress": False, "device": "cpu"}
PLAIN = {**WORK, "fraction-train": 0.1}
TICK = 1.0 / os.sysconf("SC_CLK_TCK")
CLI = "flwr cli"  # the kind of this benchmark's own flwr commands, left out of every figure
STATUS_EVERY = 10.0  # s between `flwr ls` calls while a run goes (each is a Python process of ~1 CPU s)


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process (its own, not its children's: those are sampled themselves)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * TICK


class TreeCpu:
    """The CPU seconds of every process carrying ``tag``, sampled every ``every`` s and at each
    :meth:`sample` (the largest reading of each pid counts: a process's time only grows)."""

    def __init__(self, tag: str, every: float = 0.2) -> None:
        self.tag, self.every = tag, every
        self.seen: dict[int, float] = {}  # pid -> the largest CPU seconds read
        self.pids: list[int] = []
        self.kinds: dict[int, str] = {}  # pid -> process_kind, read when first seen
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        with self.lock:
            for pid in self.pids:
                if (cpu := cpu_seconds(pid)) is not None:
                    self.seen[pid] = max(cpu, self.seen.get(pid, 0.0))

    def _run(self) -> None:
        next_scan = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_scan:  # a /proc environ scan is dear: once a second
                pids, next_scan = tagged_pids(self.tag, TAG_VAR), time.monotonic() + 1.0
                for pid in pids:
                    if pid not in self.kinds:
                        self.kinds[pid] = process_kind(pid)
                with self.lock:
                    self.pids = pids
            self.sample()
            self._stop.wait(self.every)

    def __enter__(self) -> TreeCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def snapshot(self) -> dict[int, float]:
        with self.lock:
            return dict(self.seen)

    def total(self, exclude: dict[int, float] | None = None) -> float:
        """Seconds since ``exclude``'s readings (a process alive before: its earlier time left out),
        this benchmark's own ``flwr`` commands left out."""
        exclude = exclude or {}
        with self.lock:
            return sum(cpu - exclude.get(pid, 0.0) for pid, cpu in self.seen.items() if self.kinds.get(pid) != CLI)


def process_kind(pid: int) -> str:
    """What a process of the run is, from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    text = b" ".join(argv).decode(errors="replace")
    if argv[1:2] and argv[1].endswith(b"/flwr"):
        return CLI  # this benchmark's own `flwr run` / `flwr ls`: not the run's
    for key, kind in (("superlink", "superlink"), ("flower-superexec", "superexec"), ("flwr-simulation", "serverapp+ray driver"),
                      ("ClientAppActor", "ray workers"), ("default_worker.py", "ray workers"), ("raylet/raylet", "raylet"),
                      ("gcs_server", "ray gcs"), ("log_monitor", "ray log monitor"), ("dashboard", "ray dashboard")):
        if key in text:
            return kind
    return "ray other"


def one_run(flwr: FlowerRun, app: str, rounds: int, folder: Path) -> dict[int, tuple[float, float]]:
    """One run: round -> (wall s, CPU s) since its submission, read as the round ended: when its
    line appears in the project's metrics.jsonl, or in the plain app's round log."""
    before = {pid: cpu for pid in tagged_pids(flwr.tag, TAG_VAR) if (cpu := cpu_seconds(pid)) is not None}
    federation = f"num-supernodes={WORK['num-clients']} client-resources-num-cpus=1"
    name = f"{app}-{time.time_ns()}"
    marks: dict[int, tuple[float, float]] = {}
    snapshots: dict[int, dict[int, float]] = {}
    with TreeCpu(flwr.tag) as tree:
        t0 = time.monotonic()
        if app == "flchurn":
            log = folder / name / "metrics.jsonl"
            run_id = flwr.submit({**FLCHURN, "num-server-rounds": rounds, "results-dir": str(folder), "run-name": name},
                                 federation)
        else:
            log = folder / f"{name}.log"
            run_id = flwr.cli.submit(PLAIN_APP, {**PLAIN, "num-server-rounds": rounds, "round-log": str(log)},
                                     federation_config=federation)
        ended: list[tuple[str, str]] = []  # the run's (status, details), from a thread (flwr ls takes seconds)
        def wait_for_the_end() -> None:
            while not (info := flwr.cli.run_info(run_id))[0].startswith("finished"):
                time.sleep(STATUS_EVERY)
            ended.append(info)

        waiter = threading.Thread(target=wait_for_the_end, daemon=True)
        waiter.start()
        seen = 0
        while len(marks) < rounds:
            text = log.read_text() if log.exists() else ""
            lines = text[: text.rfind("\n") + 1].splitlines()  # whole lines only: the writer may be mid-line
            if len(lines) > seen:
                tree.sample()  # as the round's line appears
                now = (time.monotonic() - t0, tree.total(before))
                per_pid = tree.snapshot()
                for line in lines[seen:]:
                    rnd = int(json.loads(line)["round"]) if app == "flchurn" else int(line)
                    if rnd > 0:  # Flower's evaluate_fn also runs before round 1 (round 0)
                        marks[rnd] = now
                        snapshots[rnd] = per_pid
                seen = len(lines)
            elif ended:
                break  # finished, and nothing more came
            time.sleep(0.02)
        waiter.join()
        status, details = ended[0]
        kinds = tree.kinds
    if status != "finished:completed" or len(marks) < rounds:
        raise SystemExit(f"{app}: run {run_id} ended {status}: {details}")
    first, last = snapshots[2], snapshots[rounds - 1]
    by_kind: dict[str, float] = {}
    for pid, cpu in last.items():
        if (kind := kinds.get(pid, "gone")) == CLI:
            continue
        by_kind[kind] = by_kind.get(kind, 0.0) + (cpu - first.get(pid, 0.0)) / (rounds - 3)
    print(f"    {app} CPU s a round by process: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(by_kind.items())),
          flush=True)
    return marks


def figures(marks: dict[int, tuple[float, float]], rounds: int) -> dict[str, float]:
    """Per round (rounds 3..R-1) and start-up, in CPU and wall seconds."""
    first, last = marks[2], marks[rounds - 1]
    per = {"wall": (last[0] - first[0]) / (rounds - 3), "cpu": (last[1] - first[1]) / (rounds - 3)}
    return {"cpu": per["cpu"], "wall": per["wall"], "start_cpu": marks[1][1] - per["cpu"],
            "start_wall": marks[1][0] - per["wall"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--apps", nargs="*", default=["flower", "flchurn"], choices=["flower", "flchurn"])
    ap.add_argument("--rounds", type=int, default=12, help="rounds a run (>= 5: rounds 3..R-1 are timed)")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    if a.rounds < 5:
        ap.error(f"--rounds must be >= 5 (rounds 3..R-1 are timed); got {a.rounds}")
    runs: dict[str, list[dict[str, float]]] = {app: [] for app in a.apps}
    with tempfile.TemporaryDirectory() as home:
        flwr = FlowerRun(Path(home))
        flwr.start_superlink(timeout=120.0 * flwr.waits.host)
        try:
            print(f"load average at start {os.getloadavg()[0]:.2f}; cpus {os.cpu_count()}", flush=True)
            for rep in range(a.repeats):
                for app in a.apps:
                    fig = figures(one_run(flwr, app, a.rounds, Path(home)), a.rounds)
                    runs[app].append(fig)
                    print(f"  repeat {rep + 1}: {app:8} {fig['cpu']:6.3f} CPU s a round, {fig['wall']:6.3f} s wall; "
                          f"start-up {fig['start_cpu']:5.1f} CPU s, {fig['start_wall']:5.1f} s wall", flush=True)
        finally:
            flwr.stop_superlink()
    print(f"\nbest of {a.repeats}, rounds 3..{a.rounds - 1} of {a.rounds} ({WORK['num-clients']} clients, 10 a round)")
    print(f"{'app':8} {'CPU s/round':>11} {'wall s/round':>12} {'start-up CPU s':>14} {'start-up wall s':>15}")
    best = {app: {k: min(r[k] for r in rows) for k in rows[0]} for app, rows in runs.items()}
    for app, b in best.items():
        print(f"{app:8} {b['cpu']:11.3f} {b['wall']:12.3f} {b['start_cpu']:14.1f} {b['start_wall']:15.1f}")
    if {"flower", "flchurn"} <= set(best):
        print(f"\nflchurn / flower: CPU per round {best['flchurn']['cpu'] / best['flower']['cpu']:.2f}x, "
              f"wall per round {best['flchurn']['wall'] / best['flower']['wall']:.2f}x, "
              f"start-up CPU {best['flchurn']['start_cpu'] / best['flower']['start_cpu']:.2f}x")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
