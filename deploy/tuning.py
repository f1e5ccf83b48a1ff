"""Settings that cut a deployed round's latency; the launcher applies them to every process.

- ``ENV`` is merged into the environment of every spawned SuperLink and SuperNode (and so of
  their ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp`` children).
- ``NODE_CONFIG`` is merged into every SuperNode's ``--node-config``.
- ``SUPERNODE`` is the command that starts a SuperNode in place of ``flower-supernode`` (same
  arguments): Flower's own, with the idle sleep between two pulls cut to ``IDLE_SLEEP``.

Where a deployed round waits in Flower 1.41 (``site-packages/flwr``) and what can be set:

| wait | where | default | settable |
|---|---|---|---|
| SuperNode idle sleep between pulls | ``supernode/start_client_internal.py`` | 3 s | no (hard-coded): ``SUPERNODE`` |
| SuperNode waits for the ClientApp's reply | same, ``_push_messages`` | 0.5 s polls | no (hard-coded): ``SUPERNODE`` |
| SuperExec looks for a task to launch | ``supercore/superexec/run_superexec.py`` | 1 s | ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (0.01-60 s) |
| ServerApp looks for replies | ``superlink/grid/http_grid.py`` ``send_and_receive`` | 3 s | no: ``server_app.network.fast_pull`` (0.1 s) |
| a fresh ``flwr-clientapp`` process per message | ``supernode/runtime/run_clientapp.py`` | imports + workload, ~6 s | ``client-worker`` below |

A node that has just replied looks for the next message at once, finds none (the server is still
collecting the round), then sleeps 3 s: with ``flower-supernode`` that sleep is the floor of every
round after the first. ``SUPERNODE`` caps both hard-coded sleeps of that loop at ``IDLE_SLEEP``
(more pulls: 4 nodes x 5 small HTTP requests a second to the SuperLink).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    # A SuperNode stopped while it starts (the churn driver's `docker stop` of a node that is off
    # in round 1, a second after `up`): until Flower registers its own handlers (imports, then
    # flower_supernode's setup: 1-4 s) SIGTERM would kill it (exit 143); it is a clean stop (0).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

from client_app.worker import SWITCH as CLIENT_WORKER  # noqa: E402  (after the early SIGTERM handler)

ENV: dict[str, str] = {
    # the SuperExec of every SuperLink and SuperNode looks for a new task every 0.1 s, not 1 s
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1",
}

NODE_CONFIG: dict = {
    # messages go to a long-lived worker per SuperNode (torch and the workload stay loaded)
    CLIENT_WORKER: True,
}


def compute_threads_env(threads: int) -> dict[str, str]:
    """Environment that gives a node's torch / BLAS ``threads`` compute threads (at least one)."""
    n = str(max(1, threads))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


def host_capacity() -> tuple[float, int]:
    """(CPUs this process may use, MiB of memory available now)."""
    cpus = float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            mem = int(line.split()[1]) // 1024
    return cpus, mem


def host_share(num_nodes: int) -> int:
    """Compute threads per node when ``num_nodes`` nodes share this host: its CPUs split evenly,
    at least one. torch's default (a thread per CPU in every node) makes the nodes' OpenMP threads
    spin against each other: measured here, 4 nodes on 2 CPUs took 0.7-3.2 s for 10 local CNN
    steps that take 0.03 s alone."""
    return max(1, int(host_capacity()[0]) // max(1, num_nodes))


IDLE_SLEEP = 0.2  # seconds: what SUPERNODE sleeps when it has nothing to pull (flower-supernode: 3)
SUPERNODE: list[str] = [sys.executable, "-m", "deploy.tuning", "supernode"]


class _CappedSleep:
    """The ``time`` module, but ``sleep`` never longer than ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))


def run_supernode(argv: list[str]) -> None:
    """``flower-supernode ARGV`` (Flower 1.41's own) with its pull loop's sleeps capped at IDLE_SLEEP."""
    from flowerlink import cap_supernode_sleeps, run_flower_supernode

    cap_supernode_sleeps(_CappedSleep(IDLE_SLEEP))  # the loop calls time.sleep(3) / (0.5)
    run_flower_supernode(argv)


if __name__ == "__main__":
    if sys.argv[1:2] != ["supernode"]:
        sys.exit("usage: python -m deploy.tuning supernode [flower-supernode arguments]")
    run_supernode(sys.argv[2:])
