"""The devices' own figures in a process deployment with device classes: :class:`DeviceFigures`
(used by :func:`deploy.record.run_recorded` only when the site has device classes).

Before the run it calibrates each class under its limits: one process in the class's first
node's cgroup and namespace builds the workload and times a local training call
(``python -m deploy.edge.calibrate``), giving seconds per local step. During the run it samples
each node's cgroup (OOM kills, CPU seconds, peak memory) and network counters at every round's
line. After the run it writes ``devices.csv`` in the run folder: client, class, the limits
applied, the calibration, and what the node used (CPU seconds, peak MiB, OOM kills, bytes
in/out); the per-round differences go into ``clients.jsonl`` (:mod:`deploy.record`).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..procs import child_setup
from ..waits import Waits, host_slowdown, slowest_cap
from .devices import LIMITS
from .limits import EdgeLimits


def separation(calibration: Mapping[str, Mapping[str, Any]], caps: Mapping[str, float | None]) -> str | None:
    """Why these calibration figures cannot tell the classes apart, or None when they can (or
    there is nothing to tell apart). A CPU-bound local step under a cap of ``c`` CPUs takes about
    ``1 / min(c, 1)`` times its uncapped time, so the most and least capped classes should differ
    by the ratio of their caps; a measured ratio under half way there (e.g. 1.1 where 5 was due)
    means something else set the pace: the host's load slowed every class alike."""
    timed = {name: float(c["seconds-per-step"]) for name, c in calibration.items() if "seconds-per-step" in c}
    share = {name: min(1.0, float(caps.get(name) or 1.0)) for name in timed}
    if len(timed) < 2:
        return None
    low, high = min(share, key=share.__getitem__), max(share, key=share.__getitem__)
    due = share[high] / share[low]
    if due < 1.5 or timed[high] <= 0:
        return None
    measured = timed[low] / timed[high]
    if measured >= 1 + (due - 1) / 2:
        return None
    return (f"calibration cannot separate the classes: [{low}] ({share[low]:g} CPU) {timed[low]:g} s/step against "
            f"[{high}] ({share[high]:g} CPU) {timed[high]:g} s/step, x{measured:.2f} where the caps give "
            f"x{due:.1f}; the host's load (1-minute {os.getloadavg()[0]:.1f}) sets the pace of every class: "
            "calibrate on a quieter host for figures that tell the classes apart")


class DeviceFigures:
    """Calibration and per-round samples of the nodes of ``edge`` (see the module docstring)."""

    def __init__(self, edge: EdgeLimits, num_nodes: int, work_dir: Path,
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.edge = edge
        self.num_nodes = num_nodes
        self.work_dir = work_dir
        self.log = log
        self.calibration: dict[str, dict[str, Any]] = {}
        self.samples: dict[int, dict[int, dict[str, Any]]] = {}  # round -> node -> measure

    def classes(self) -> dict[int, str]:
        return {i: self.edge.plan.of(i).name for i in range(self.num_nodes)}

    def calibrate(self, run_config: Mapping[str, Any], timeout: float | None = None) -> dict[str, dict[str, Any]]:
        """Seconds per local step of each class, measured under its limits (all classes at once);
        each may take ``timeout`` s (default 600 s scaled to the host and the slowest cap:
        deploy.waits). Says so when the figures cannot separate the classes (:func:`separation`)."""
        if timeout is None:
            timeout = 600.0 * Waits().scaled(host_slowdown(), slowest_cap(dc.cpus for dc in self.edge.plan.classes)
                                             ).round_factor
        cfg = json.dumps({**run_config, "num-clients": self.num_nodes})
        procs: dict[str, subprocess.Popen] = {}
        try:
            for dc in self.edge.plan.classes:
                i = dc.clients[0]
                procs[dc.name] = subprocess.Popen(
                    [sys.executable, "-m", "deploy.edge.calibrate", cfg, str(i)], cwd=self.work_dir,
                    env={**os.environ, **self.edge.env(i)},
                    preexec_fn=child_setup(self.edge.preexec(i)),  # its limits; dies with us
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, p in procs.items():
                try:
                    out, err = p.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    out, err = p.communicate()
                if p.returncode == 0:
                    self.calibration[name] = json.loads(out.strip().splitlines()[-1])
                else:
                    oom = p.returncode == -9
                    self.calibration[name] = {"error": "out of memory" if oom else f"exit {p.returncode}: {err[-300:]}"}
                self.log(f"calibration [{name}]: {self.calibration[name]}")
        finally:  # interrupted: no calibration outlives us (nor keeps a cgroup busy)
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.samples[0] = self._measure()  # after calibration: the run's figures are differences
        warning = separation(self.calibration, {dc.name: dc.cpus for dc in self.edge.plan.classes})
        if warning:
            self.log(warning)
        return self.calibration

    def _measure(self) -> dict[int, dict[str, Any]]:
        return {i: self.edge.measure(i) for i in range(self.num_nodes)}

    def on_row(self, row: Mapping[str, Any]) -> None:
        self.samples[int(row["round"])] = self._measure()

    def per_round(self) -> dict[int, dict[int, dict[str, Any]]]:
        """round -> node -> what it used in that round (differences of the cumulative figures)."""
        out: dict[int, dict[int, dict[str, Any]]] = {}
        rounds = sorted(self.samples)
        for prev, r in zip(rounds, rounds[1:], strict=False):
            out[r] = {i: {k: round(v - self.samples[prev].get(i, {}).get(k, 0), 3) for k, v in m.items()
                          if k in ("cpu-seconds", "bytes-in", "bytes-out", "oom-kills")}
                      for i, m in self.samples[r].items()}
        return out

    def oom_rounds(self) -> set[tuple[int, int]]:
        """(round, client): an OOM kill in the node's cgroup between the round's start and end lines."""
        out = set()
        rounds = sorted(self.samples)
        for prev, r in zip(rounds, rounds[1:], strict=False):
            for i, m in self.samples[r].items():
                if m.get("oom-kills", 0) > self.samples[prev].get(i, {}).get("oom-kills", 0):
                    out.add((r, i))
        return out

    def write(self, path: Path, timing: Mapping[tuple[int, int], Mapping[str, Any]]) -> None:
        """``devices.csv``: per client, its class, limits, calibration and what its node used."""
        first, last = self.samples.get(0, {}), self.samples[max(self.samples)] if self.samples else {}
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["client", "class", *LIMITS, "calibration-s-per-step", "mean-train-s", "cpu-seconds",
                        "peak-mb", "oom-kills", "bytes-in", "bytes-out"])
            for i in range(self.num_nodes):
                dc = self.edge.plan.of(i)
                cal = self.calibration.get(dc.name, {})
                times = [rec["train-time"] for (_, c), rec in timing.items() if c == i]
                a, b = first.get(i, {}), last.get(i, {})
                used = {k: b.get(k, 0) - a.get(k, 0) for k in ("cpu-seconds", "oom-kills", "bytes-in", "bytes-out")}
                w.writerow([i, dc.name, *[getattr(dc, k) if getattr(dc, k) is not None else "" for k in LIMITS],
                            cal.get("seconds-per-step", cal.get("error", "")),
                            round(float(np.mean(times)), 4) if times else "", round(used["cpu-seconds"], 2),
                            b.get("peak-mb", ""), used["oom-kills"], used["bytes-in"], used["bytes-out"]])
