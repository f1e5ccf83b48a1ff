"""The virtual clock at scale: 10,000 clients with device profiles, an MLP, in process (prints;
never asserts).

1. Memory per idle client: the profile plan and the clock (with its session cursors) for 1,000
   and 10,000 clients, measured with tracemalloc after every client's sessions were asked about
   at t = 2000 s (the cursors moved, about 20 sessions each): bytes per client at both sizes (O(1): the same).
2. A run: ``--clients`` clients (MNIST split iid, the FedAWE/FedAU MLP, the cohort engine,
   ``--availability`` picks who is scheduled on), rounds on the clock (three device classes with
   sessions, a deadline), and the same run without ``devices``, one after the other. Each round's
   CPU time is the process's CPU seconds from one round's training send to the next; the clock's
   bookkeeping is the CPU seconds spent in :class:`server_app.clockgrid.VirtualClockGrid` (planning
   and closing rounds, outside the wrapped grid): its share of the round. CPU time, not wall time,
   because the machine is shared (the load average is printed). Plots are skipped (their cost is
   not a round's).

    python -m benchmarks.clock_scale --clients 10000 --rounds 100
    python -m benchmarks.clock_scale --clients 1000 --rounds 5 --skip-plain
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from virtualtime import VirtualClock, parse_profiles

DEVICES = """
[slow]
count = {slow}
up_kbps = 1000
down_kbps = 2000
rtt_ms = 150
step_ms = 2.8
session_on_s = 120
session_off_s = 60

[mid]
count = {mid}
up_kbps = 5000
down_kbps = 10000
rtt_ms = 60
step_ms = 0.9
session_on_s = 300
session_off_s = 60

[fast]
count = {fast}
up_kbps = 20000
down_kbps = 50000
rtt_ms = 20
step_ms = 0.46
"""


def devices_text(n: int) -> str:
    slow, mid = int(0.3 * n), int(0.4 * n)
    return DEVICES.format(slow=slow, mid=mid, fast=n - slow - mid)


def memory_per_client(n: int) -> float:
    """Bytes the plan + clock hold per client, after every client's sessions moved to t = 2000 s."""
    import tomllib

    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    plan = parse_profiles(tomllib.loads(devices_text(n)), n)
    clock = VirtualClock(plan, model_bytes=800_000, seed=1)
    for c in range(n):
        clock.online(c, 2000.0)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(s.size_diff for s in after.compare_to(before, "filename"))
    del plan, clock
    return used / n


def run(n: int, rounds: int, availability: str, deadline: float, devices: str, out: Path, name: str) -> dict:
    from experiments.inprocess import run_inprocess
    from server_app import clockgrid

    cpu: dict[str, list[float]] = {"clock": [], "round": []}
    marks: list[float] = []

    class Timed(clockgrid.VirtualClockGrid):
        def _plan(self, *a, **kw):
            t = time.process_time()
            try:
                return super()._plan(*a, **kw)
            finally:
                cpu["clock"].append(time.process_time() - t)

        def _close(self, *a, **kw):
            t = time.process_time()
            try:
                return super()._close(*a, **kw)
            finally:
                cpu["clock"][-1] += time.process_time() - t

    import server_app.experiment as experiment
    import server_app.results as results
    from experiments.cohort_grid import CohortGrid

    original_send = CohortGrid.send_and_receive

    def send(self, messages, *, timeout=None):
        messages = list(messages)
        if any(m.metadata.message_type == "train" for m in messages):
            marks.append(time.process_time())
        return original_send(self, messages, timeout=timeout)

    experiment.VirtualClockGrid = Timed  # type: ignore[misc]
    results.plot_run = lambda *a, **kw: None
    CohortGrid.send_and_receive = send  # type: ignore[method-assign]
    cfg = {"dataset": "mnist", "model": "mlp", "partition": "iid", "num-clients": n, "num-server-rounds": rounds,
           "availability": availability, "local-steps": "steps:n=5", "batch-size": 5, "engine": "cohort",
           "eval-every": 0, "checkpoint-every": 0, "progress": False, "device": "cpu",
           "results-dir": str(out), "run-name": name, "wait-for-nodes": 600.0, "round-timeout": 600.0,
           "data-dir": os.environ["FLCHURN_DATA_DIR"]}
    if devices:
        cfg |= {"devices": devices, "virtual-deadline": deadline}
    t0 = time.monotonic()
    try:
        run_inprocess(cfg)
    finally:
        experiment.VirtualClockGrid = clockgrid.VirtualClockGrid  # type: ignore[misc]
        CohortGrid.send_and_receive = original_send  # type: ignore[method-assign]
    cpu["round"] = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {"wall": time.monotonic() - t0, **cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--availability", default="bernoulli:p=0.01")
    ap.add_argument("--deadline", type=float, default=2.0, help="virtual-deadline, s")
    ap.add_argument("--skip-plain", action="store_true", help="only the run on the clock")
    a = ap.parse_args()
    os.environ.setdefault("FLCHURN_DATA_DIR", str(Path(__file__).resolve().parent.parent.parent / "shared" / "data"))
    print(f"load average before: {os.getloadavg()}")
    for n in (1_000, 10_000):
        print(f"memory per idle client, {n} clients: {memory_per_client(n):.1f} bytes (plan + clock + cursors)")
    with tempfile.TemporaryDirectory() as tmp:
        dev = Path(tmp) / "devices.toml"
        dev.write_text(devices_text(a.clients))
        runs = {"clock": run(a.clients, a.rounds, a.availability, a.deadline, str(dev), Path(tmp), "clock")}
        if not a.skip_plain:
            runs["plain"] = run(a.clients, a.rounds, a.availability, a.deadline, "", Path(tmp), "plain")
    for name, r in runs.items():
        rounds = r["round"][1:] or r["round"]  # round 1 warms up
        line = (f"{name}: {a.clients} clients, {a.rounds} rounds, {r['wall']:.0f} s wall; round CPU median "
                f"{statistics.median(rounds):.3f} s" if rounds else f"{name}: {r['wall']:.0f} s wall")
        if r["clock"]:
            clock = r["clock"][1:len(rounds) + 1] or r["clock"]
            share = sum(clock) / max(sum(rounds), 1e-12)
            line += f"; clock bookkeeping median {statistics.median(clock) * 1000:.1f} ms/round = {100 * share:.2f}% of round CPU"
        print(line)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
