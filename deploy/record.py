"""The per-client record every process deployment keeps, written in the run folder after the
run: :func:`run_recorded`.

- ``clients.jsonl``: each client's status per round (:mod:`deploy.realised`) and its train times;
- ``realised-trace.csv``: who answered in time, in the ``trace-matrix`` format, so that a
  simulation replays the run (``availability=trace-matrix:path=...``).

With device classes (``ProcessSite(devices=...)``) the devices' own figures come from
:class:`deploy.edge.figures.DeviceFigures` (calibration, per-round cgroup samples, ``devices.csv``),
imported only then: a launch without devices never passes through :mod:`deploy.edge`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runconfig.defaults import default_run_config

from .local import ProcessSite
from .realised import (
    OOM,
    classify,
    per_class,
    read_client_timing,
    realised_matrix,
    write_clients_jsonl,
    write_trace_matrix,
)
from .run import RunOutcome, run_deployment


class NodeFigures(Protocol):
    """What a node sampler adds to the record (:class:`deploy.edge.figures.DeviceFigures`)."""

    def on_row(self, row: Mapping[str, Any]) -> None: ...
    def classes(self) -> dict[int, str]: ...
    def per_round(self) -> dict[int, dict[int, dict[str, Any]]]: ...
    def oom_rounds(self) -> set[tuple[int, int]]: ...
    def write(self, path: Path, timing: Mapping[tuple[int, int], Mapping[str, Any]]) -> None: ...


def finish(site: ProcessSite, out: RunOutcome, figures: NodeFigures | None = None) -> dict[str, dict[str, int]]:
    """Write clients.jsonl, realised-trace.csv (and, with ``figures``, devices.csv); return the
    per-class counts (one class ``all`` without devices)."""
    n = site.num_nodes
    num_rounds = int(out.run_config["num-server-rounds"])
    schedule = np.zeros((num_rounds, n), dtype=bool)  # what the participation report expected
    assert out.report is not None
    for rr in out.report.rounds:
        schedule[rr.round - 1, rr.expected] = True
    timing = read_client_timing(site.state_dir)
    statuses = classify(schedule, out.rows, timing, oom=figures.oom_rounds() if figures else set(),
                        client_of_node=site.client_of_node())
    classes = figures.classes() if figures else {i: "all" for i in range(n)}
    if figures is not None:
        nodes = figures.per_round()
    else:  # one (empty) entry per round after the first seen, as the samples' differences give
        seen = sorted({int(row["round"]) for row in out.rows})
        nodes = {r: {} for r in seen[1:]}
    write_clients_jsonl(out.run_dir / "clients.jsonl", statuses, timing, classes, nodes)
    realised = realised_matrix(statuses, n)
    write_trace_matrix(out.run_dir / "realised-trace.csv", realised,
                       comment=f"realised participation of {out.run_dir.name}: 1 = answered before the "
                               f"round closed\nreplay: availability=trace-matrix:path=<this file>")
    if figures is not None:
        figures.write(out.run_dir / "devices.csv", timing)
    return per_class(statuses, classes)


def run_recorded(site: ProcessSite, user_config: Mapping[str, Any], *,
                 on_row: Callable[[dict[str, Any]], None] | None = None,
                 **kwargs: Any) -> tuple[RunOutcome, NodeFigures | None, dict[str, dict[str, int]]]:
    """:func:`deploy.run.run_deployment` on ``site``, then the per-client files; with device
    classes, calibrate them first and sample the nodes at every round. Returns (outcome, the
    devices' figures or None, per-class counts)."""
    figures = device_figures(site, user_config)

    def both(row: dict[str, Any]) -> None:
        if figures is not None:
            figures.on_row(row)
        if on_row is not None:
            on_row(row)

    out = run_deployment(site, user_config, on_row=both, **kwargs)
    counts = finish(site, out, figures) if out.rows and out.report is not None else {}
    return out, figures, counts


def device_figures(site: ProcessSite, user_config: Mapping[str, Any]) -> NodeFigures | None:
    """With device classes: their figures, calibrated (the SuperLink started first: it makes the
    device limits); None without (run_deployment starts the SuperLink)."""
    if site.edge is None:
        return None
    if site.superlink is None:
        site.start_superlink()
    from .edge.figures import DeviceFigures

    figures = DeviceFigures(site.edge, site.num_nodes, site.work_dir, site.log)
    figures.calibrate({**default_run_config(site.project), **user_config})
    return figures


def summary(counts: Mapping[str, Mapping[str, int]]) -> str:
    """One line per class: how often its clients were on time, late, out of memory, lost."""
    return "\n".join(f"  [{name}] " + ", ".join(f"{s}: {k}" for s, k in sorted(c.items()))
                     for name, c in counts.items()) or "  (no scheduled client)"


__all__ = ["OOM", "NodeFigures", "finish", "run_recorded", "summary"]
