"""The workload, built once per process (as Flower's examples cache their partitions): the
project's data, model, partition and mini-batch order, so both apps do the same work."""

from __future__ import annotations

from functools import cache
from typing import Any

from runconfig import WorkloadConfig, from_run_config
from workloads.workload import Workload, get_workload

KEYS = ("dataset", "model", "num-clients", "partition", "local-steps", "batch-size", "lr", "data-dir")


@cache
def _workload(items: tuple[tuple[str, Any], ...]) -> Workload:
    cfg = {k: v for k, v in items if not (k == "data-dir" and not v)}
    return get_workload(from_run_config(WorkloadConfig, {**cfg, "device": "cpu"}))


def workload(run_config: Any) -> Workload:
    return _workload(tuple((k, run_config[k]) for k in KEYS if k in run_config))
