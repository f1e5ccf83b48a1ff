"""Round latency and churn costs of the compose stack (containers), the container counterpart of
benchmarks/deploy_latency.py (processes): same workload (4 clients, digits/logreg, steps:n=2,
fedavg-all). Prints a table; asserts nothing (a measurement, not a test).

- round time in containers: the churn service with ``availability=always``: mean ``round-time``
  of rounds 2+, the server's start -> round 1 done, and ``flwr run`` -> the service's exit;
- a SuperNode container's ``docker start`` -> registered ("SuperNode ID" in its log);
- ``docker stop`` (SIGTERM) of a node container 2 s into round 2 -> the server closes round 2
  (and how long the ``docker stop`` call itself takes: until the container has exited);
- ``docker kill`` (SIGKILL) of a node container 2 s into round 3 -> the server closes round 3
  (heartbeat expiry; round-timeout is 120 s).

    sudo .venv/bin/python docker/bench.py [--rounds 5]      (root: the Docker socket, chown)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import stack

WORKLOAD = {"AVAILABILITY": "always", "ROUND_TIMEOUT": "120"}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_lines(path: Path, n: int, timeout: float = 300.0) -> float:
    """Wait until ``path`` has ``n`` lines; the monotonic time it was seen (0.05 s polls)."""
    deadline = time.monotonic() + timeout
    while lines(path) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not reach {n} lines within {timeout:.0f} s")
        time.sleep(0.05)
    return time.monotonic()


def node_start(i: int) -> float:
    """``docker start`` of a stopped node container -> "SuperNode ID" in its log (seconds)."""
    name = stack.NODE_CONTAINER.format(i=i)
    def registrations() -> int:  # the log keeps every incarnation's lines
        res = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
        return (res.stdout + res.stderr).count("SuperNode ID")

    subprocess.run(["docker", "stop", name], check=True, capture_output=True)
    before = registrations()
    t0 = time.monotonic()
    subprocess.run(["docker", "start", name], check=True, capture_output=True)
    while registrations() == before:
        time.sleep(0.05)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    reason = stack.unavailable()
    if reason:
        raise SystemExit(f"cannot run the stack: {reason}")
    res: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="container-bench-") as d, stack.Stack(Path(d), project="flchurn-bench") as s:
        # 1) undisturbed rounds
        t0 = time.monotonic()
        out = s.churn(RUN_NAME="always", NUM_ROUNDS=str(a.rounds), **WORKLOAD)
        res["churn-run"] = time.monotonic() - t0
        if out.returncode != 0:
            raise SystemExit(f"churn service exited {out.returncode}:\n{out.stdout[-3000:]}")
        rows = s.rows("always")
        res["round"] = statistics.mean(r["round-time"] for r in rows[1:])
        res["first-line"] = rows[0]["wall-time"]
        res["node-start"] = statistics.mean(node_start(0) for _ in range(3))
        # 2) docker stop 2 s into round 2, docker kill 2 s into round 3 (all scheduled on)
        metrics = s.results / "stops" / "metrics.jsonl"
        proc = s.start_churn(RUN_NAME="stops", NUM_ROUNDS="3", **WORKLOAD)
        try:
            for r, verb, key in ((2, "stop", "term"), (3, "kill", "kill")):
                time.sleep(max(0.0, wait_lines(metrics, r - 1) + 2.0 - time.monotonic()))
                t_signal = time.monotonic()
                subprocess.run(["docker", verb, stack.NODE_CONTAINER.format(i=5 - r)], check=True,
                               capture_output=True)
                res[f"{key}-call"] = time.monotonic() - t_signal
                res[f"{key}->round-end"] = wait_lines(metrics, r) - t_signal
            proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    load = os.getloadavg()[0]
    print(f"\n4 clients in containers, digits/logreg, steps:n=2, fedavg-all; {os.cpu_count()} CPUs, load {load:.1f}")
    print("| measurement | seconds |\n|---|---|")
    labels = {
        "round": "round, containers (rounds 2+)",
        "first-line": "containers: server start -> round 1 done",
        "churn-run": f"containers: churn service, {a.rounds} rounds (submit -> exit)",
        "node-start": "SuperNode container start -> registered",
        "term-call": "docker stop (SIGTERM) of a busy node container: the call (container exited)",
        "term->round-end": "docker stop (SIGTERM) 2 s into a round -> round closed",
        "kill-call": "docker kill (SIGKILL): the call",
        "kill->round-end": "docker kill (SIGKILL) 2 s into a round -> round closed (round-timeout 120 s)",
    }
    for k, label in labels.items():
        print(f"| {label} | {res[k]:.1f} |")


if __name__ == "__main__":
    main()
