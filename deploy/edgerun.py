"""Per-client timing of a process deployment, and (with device classes) the devices' own
figures: :class:`EdgeRecorder`.

Before the run (devices only) it calibrates each class under its limits: one process in the
class's first node's cgroup and namespace builds the workload and times a local training call
(``python -m deploy.calibrate``), giving seconds per local step. During the run it samples each
node's cgroup (OOM kills, CPU seconds, peak memory) and network counters at every round's line.
After the run it writes, in the run folder:

- ``clients.jsonl``: each client's status per round (:mod:`deploy.realised`) and train times;
- ``realised-trace.csv``: who answered in time, in the ``trace-matrix`` format, so that a
  simulation replays the devices (``availability=trace-matrix:path=...``);
- ``devices.csv`` (devices only): client, class, the limits applied, the calibration, and what
  the node used (CPU seconds, peak MiB, OOM kills, bytes in/out).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .devices import LIMITS
from .local import Deployment
from .procs import child_setup
from .realised import (
    OOM,
    classify,
    per_class,
    read_client_timing,
    realised_matrix,
    write_clients_jsonl,
    write_trace_matrix,
)
from .run import Outcome, run_deployment
from .runconfig import default_run_config


class EdgeRecorder:
    """Timing and device figures of one run on ``dep`` (see the module docstring)."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.edge = dep.edge
        self.calibration: dict[str, dict[str, Any]] = {}
        self.samples: dict[int, dict[int, dict[str, Any]]] = {}  # round -> node -> measure

    def classes(self) -> dict[int, str]:
        n = self.dep.num_nodes
        return {i: self.edge.plan.of(i).name if self.edge else "all" for i in range(n)}

    def calibrate(self, run_config: Mapping[str, Any], timeout: float = 600.0) -> dict[str, dict[str, Any]]:
        """Seconds per local step of each class, measured under its limits (all classes at once)."""
        if self.edge is None:
            return {}
        cfg = json.dumps({**run_config, "num-clients": self.dep.num_nodes})
        procs: dict[str, subprocess.Popen] = {}
        try:
            for dc in self.edge.plan.classes:
                i = dc.clients[0]
                procs[dc.name] = subprocess.Popen(
                    [sys.executable, "-m", "deploy.calibrate", cfg, str(i)], cwd=self.dep.work_dir,
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
                self.dep.log(f"calibration [{name}]: {self.calibration[name]}")
        finally:  # interrupted: no calibration outlives us (nor keeps a cgroup busy)
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        self.samples[0] = self._measure()  # after calibration: the run's figures are differences
        return self.calibration

    def _measure(self) -> dict[int, dict[str, Any]]:
        return {i: self.edge.measure(i) for i in range(self.dep.num_nodes)} if self.edge else {}

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

    def finish(self, out: Outcome) -> dict[str, dict[str, int]]:
        """Write clients.jsonl, realised-trace.csv (and devices.csv); return the per-class counts."""
        n = self.dep.num_nodes
        num_rounds = int(out.run_config["num-server-rounds"])
        schedule = np.zeros((num_rounds, n), dtype=bool)  # what the participation report expected
        for rr in out.report.rounds:
            schedule[rr.round - 1, rr.expected] = True
        timing = read_client_timing(self.dep.state_dir)
        statuses = classify(schedule, out.rows, timing, oom=self.oom_rounds(),
                            client_of_node=self.dep.client_of_node())
        classes = self.classes()
        write_clients_jsonl(out.run_dir / "clients.jsonl", statuses, timing, classes, self.per_round())
        realised = realised_matrix(statuses, n)
        write_trace_matrix(out.run_dir / "realised-trace.csv", realised,
                           comment=f"realised participation of {out.run_dir.name}: 1 = answered before the "
                                   f"round closed\nreplay: availability=trace-matrix:path=<this file>")
        if self.edge is not None:
            self._write_devices(out.run_dir / "devices.csv", timing)
        return per_class(statuses, classes)

    def _write_devices(self, path: Path, timing: Mapping[tuple[int, int], Mapping[str, Any]]) -> None:
        first, last = self.samples.get(0, {}), self.samples[max(self.samples)] if self.samples else {}
        with path.open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["client", "class", *LIMITS, "calibration-s-per-step", "mean-train-s", "cpu-seconds",
                        "peak-mb", "oom-kills", "bytes-in", "bytes-out"])
            for i in range(self.dep.num_nodes):
                dc = self.edge.plan.of(i)
                cal = self.calibration.get(dc.name, {})
                times = [rec["train-time"] for (_, c), rec in timing.items() if c == i]
                a, b = first.get(i, {}), last.get(i, {})
                used = {k: b.get(k, 0) - a.get(k, 0) for k in ("cpu-seconds", "oom-kills", "bytes-in", "bytes-out")}
                w.writerow([i, dc.name, *[getattr(dc, k) if getattr(dc, k) is not None else "" for k in LIMITS],
                            cal.get("seconds-per-step", cal.get("error", "")),
                            round(float(np.mean(times)), 4) if times else "", round(used["cpu-seconds"], 2),
                            b.get("peak-mb", ""), used["oom-kills"], used["bytes-in"], used["bytes-out"]])


def run_recorded(dep: Deployment, user_config: Mapping[str, Any], *, on_row=None,
                 **kwargs: Any) -> tuple[Outcome, EdgeRecorder, dict[str, dict[str, int]]]:
    """:func:`deploy.run.run_deployment` with an :class:`EdgeRecorder`: calibrate the device
    classes (if any), run, write the per-client files; (outcome, recorder, per-class counts)."""
    rec = EdgeRecorder(dep)
    if dep.superlink is None:
        dep.start_superlink()  # makes the device limits
    if dep.edge is not None:
        rec.calibrate({**default_run_config(dep.project), **user_config})

    def both(row: dict[str, Any]) -> None:
        rec.on_row(row)
        if on_row is not None:
            on_row(row)

    out = run_deployment(dep, user_config, on_row=both, **kwargs)
    counts = rec.finish(out) if out.rows and out.report is not None else {}
    return out, rec, counts


def summary(counts: Mapping[str, Mapping[str, int]]) -> str:
    """One line per class: how often its clients were on time, late, out of memory, lost."""
    return "\n".join(f"  [{name}] " + ", ".join(f"{s}: {k}" for s, k in sorted(c.items()))
                     for name, c in counts.items()) or "  (no scheduled client)"


__all__ = ["OOM", "EdgeRecorder", "summary"]
