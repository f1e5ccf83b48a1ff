"""Settings that cut a deployed round's latency; the launcher applies them to every process.

- ``ENV`` is merged into the environment of every spawned SuperLink and SuperNode (and so of
  their ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp`` children).
- ``NODE_CONFIG`` is merged into every SuperNode's ``--node-config``.
- ``SUPERNODE`` is the command that starts a SuperNode in place of ``flower-supernode`` (same
  arguments): Flower's own, with the idle sleep between two pulls cut to ``IDLE_SLEEP``.

Where a deployed round waits in Flower 1.42 (``site-packages/flwr``) and what can be set:

| wait | where | default | settable |
|---|---|---|---|
| SuperNode idle sleep between pulls | ``supernode/start_client_internal.py`` | 3 s | no (hard-coded): ``SUPERNODE`` |
| SuperNode waits for the ClientApp's reply | same, ``_push_messages`` | 0.5 s polls | no (hard-coded): ``SUPERNODE`` |
| SuperExec looks for a task to launch | ``supercore/superexec/run_superexec.py`` | 1 s | ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` (0.01-60 s) |
| ServerApp looks for replies | ``superlink/grid/http_grid.py`` ``send_and_receive`` | 3 s | no: ``server_app.network.fast_pull`` (0.1 s) |
| a fresh ``flwr-clientapp`` process per message | ``supernode/runtime/run_clientapp.py`` | imports + workload, ~6 s | ``client-worker`` below |
| that process imports Flower's SuperNode CLI | ``supernode/cli/flwr_clientapp.py`` | 1.5-2.6 s a message | no: ``SUPERNODE`` forks it (:mod:`deploy.prefork`) |
| a SuperNode's SuperExec imports Flower's CLI | ``supercore/cli/flower_superexec.py`` | 1.5-2.7 s a start | no: ``SUPERNODE`` forks it (:mod:`deploy.prefork`) |
| a returning SuperNode's start (imports, its worker's torch) | before its round can start | 5-6 s (busy 2 cores) | booted ahead, released to connect (:mod:`deploy.boot`) |
| a claimed task's first heartbeat, then between two | ``supercore/corestate/*_corestate.py`` | 30 s, then 60 s | no (hard-coded): ``SUPERNODE``, ``SUPERLINK`` |

A node that has just replied looks for the next message at once, finds none (the server is still
collecting the round), then sleeps 3 s: with ``flower-supernode`` that sleep is the floor of every
round after the first. ``SUPERNODE`` caps both hard-coded sleeps of that loop at ``IDLE_SLEEP``
(more pulls: 4 nodes x 5 small HTTP requests a second to the SuperLink).

A claimed task (a message's ``flwr-clientapp``, a run's ``flwr-serverapp``) whose process has not
sent its first heartbeat within 30 s loses its token: on a busy machine a ``flwr-clientapp`` that
takes longer to import is answered ``401 Runtime task-token authentication failed`` and its reply
is lost (the cause of the lost replies of issue 40). ``SUPERNODE`` and ``SUPERLINK`` replace both
waits by the task patience of :mod:`deploy.waits` (``FLCHURN_TASK_PATIENCE``; default scaled to
the host).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

warm_worker = None  # this SuperNode's client worker, started with it (deploy.warmstart), if it could be
if __name__ == "__main__":
    # A SuperNode stopped while it starts (the churn driver's `docker stop` of a node that is off
    # in round 1, a second after `up`): until Flower registers its own handlers (imports, then
    # flower_supernode's setup: 1-4 s) SIGTERM would kill it (exit 143); it is a clean stop (0).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from deploy.warmstart import (  # no Flower: the worker starts before its imports
        WARM_VAR,
        start_warm_worker,
    )
    if sys.argv[1:2] == ["supernode"] and os.environ.get(WARM_VAR):
        # a returning node's worker, beside this process's imports (None: no app installed yet)
        warm_worker = start_warm_worker(os.environ[WARM_VAR])

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
SUPERLINK: list[str] = [sys.executable, "-m", "deploy.tuning", "superlink"]


class _CappedSleep:
    """The ``time`` module, but ``sleep`` never longer than ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))


def patch_task_patience(seconds: float) -> None:
    """Flower's claimed tasks (this process's Runtime API state) keep their token ``seconds`` until
    the task's first heartbeat and ``seconds`` between two heartbeats (Flower: 30 s and 2 x 30 s)."""
    from flowerlink import set_task_heartbeat_window

    set_task_heartbeat_window(seconds)


def task_patience() -> float:
    """The task patience this process was given (``FLCHURN_TASK_PATIENCE``), else scaled to the host."""
    from .waits import for_host, task_patience_from_env

    return task_patience_from_env(for_host().task_patience)


def run_supernode(argv: list[str]) -> None:
    """``flower-supernode ARGV`` (Flower 1.42's own) with its pull loop's sleeps capped at IDLE_SLEEP,
    its ClientApps' task patience lengthened (:func:`patch_task_patience`) and each message's
    ``flwr-clientapp`` forked from a process that has imported it (:mod:`deploy.prefork`)."""
    from flowerlink import cap_supernode_sleeps, flower_entry_point, run_flower_supernode

    from .boot import wait_for_release
    from .prefork import COMMANDS, start_for_this_process
    from .warmstart import WARM_VAR, start_warm_worker

    for command in COMMANDS:  # Flower's CLI modules: the SuperNode imports most of them anyway
        flower_entry_point(command)
    os.environ.update(start_for_this_process())  # forked now, before Flower starts a thread
    if wait_for_release() and os.environ.get(WARM_VAR) and warm_worker is None:
        start_warm_worker(os.environ[WARM_VAR])  # booted with no app to start its worker from: now there is one
    patch_task_patience(task_patience())
    cap_supernode_sleeps(_CappedSleep(IDLE_SLEEP))  # the loop calls time.sleep(3) / (0.5)
    run_flower_supernode(argv)


def run_superlink(argv: list[str]) -> None:
    """``flower-superlink ARGV`` (Flower 1.42's own) with its ServerApps' task patience lengthened."""
    from flowerlink import run_flower_superlink

    patch_task_patience(task_patience())
    run_flower_superlink(argv)


if __name__ == "__main__":
    commands = {"supernode": run_supernode, "superlink": run_superlink}
    if sys.argv[1:2] == [] or sys.argv[1] not in commands:
        sys.exit("usage: python -m deploy.tuning supernode|superlink [flower-supernode|flower-superlink arguments]")
    commands[sys.argv[1]](sys.argv[2:])
