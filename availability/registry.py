"""The registry of availability models and the entry points: ``build_schedule`` from a spec, and
``schedule_for`` from a run config (the one the ServerApp, the ClientApp's gate and the churn
driver all build, so they agree on every client and round)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from runconfig import AvailabilityConfig, WorkloadConfig, from_run_config

from .base import Schedule, ScheduleError
from .models import (
    Always,
    Bernoulli,
    Cyclic,
    Dropout,
    FedAUBernoulli,
    GroupCyclic,
    InterleavedSine,
    LogNormal,
    Markov,
    Sine,
    SineLogNormal,
    Staircase,
    Stationary,
)
from .spec import SpecError, parse_spec
from .traces import TraceIntervals, TraceMatrix

#: spec name -> Schedule subclass (its docstring cites the paper; ``defaults`` lists parameters).
SCHEDULES: dict[str, type[Schedule]] = {cls.name: cls for cls in (
    Always, Bernoulli, Stationary, Staircase, Sine, InterleavedSine, FedAUBernoulli, Markov,
    Cyclic, GroupCyclic, Dropout, LogNormal, SineLogNormal, TraceMatrix, TraceIntervals)}


def build_schedule(spec: str, num_clients: int, seed: int, label_dists: np.ndarray | None = None,
                   clusters: np.ndarray | None = None) -> Schedule:
    """Build the schedule a spec string names, e.g. ``build_schedule("sine:gamma=0.3", 100, 0,
    label_dists)``. Raises ScheduleError (a SpecError, a ValueError) naming what is wrong."""
    try:
        parsed = parse_spec(spec)
    except SpecError as err:
        raise ScheduleError(str(err)) from err
    if parsed.name not in SCHEDULES:
        raise ScheduleError(f"unknown availability model '{parsed.name}'; known: "
                            f"{', '.join(sorted(SCHEDULES))}")
    return SCHEDULES[parsed.name](spec, num_clients, seed, label_dists=label_dists,
                                  clusters=clusters)


def _model_of(spec: str) -> tuple[type[Schedule], dict[str, Any]]:
    try:
        parsed = parse_spec(spec)
        if parsed.name not in SCHEDULES:
            raise ScheduleError(f"unknown availability model '{parsed.name}'; known: "
                                f"{', '.join(sorted(SCHEDULES))}")
        cls = SCHEDULES[parsed.name]
        return cls, parsed.take(cls.defaults, what="availability model")
    except ScheduleError:
        raise
    except SpecError as err:
        raise ScheduleError(str(err)) from err


def schedule_needs(spec: str) -> frozenset[str]:
    """What the schedule ``spec`` names is built from besides the spec and seed: a subset of
    ``{"label_dists", "clusters"}`` (the workload's), e.g. ``sine`` needs the label distributions,
    ``dropout:keep_per_cluster=true`` the clusters, ``bernoulli`` nothing."""
    cls, params = _model_of(spec)
    return cls.needs(params)


class WorkloadInputs(Protocol):
    """What a schedule may need from the workload (``workloads.workload.Workload`` has both)."""

    label_dists: np.ndarray | None
    clusters: np.ndarray | None


def schedule_for(run_config: Mapping[str, Any],
                 workload: WorkloadInputs | Callable[[], WorkloadInputs] | None = None) -> Schedule:
    """The schedule of a run config: its ``availability`` spec, ``schedule-seed`` and ``num-clients``.

    ``workload`` gives the label distributions and clusters when the model needs them: the
    workload itself, or a function that builds it, called only when needed (so the churn driver
    loads no data for ``bernoulli``). None is fine for a model that needs neither; for one that
    does it is a ScheduleError naming what is missing.
    """
    acfg = from_run_config(AvailabilityConfig, run_config).validate()
    num_clients = from_run_config(WorkloadConfig, run_config).num_clients
    needs = schedule_needs(acfg.availability)
    inputs: dict[str, Any] = {"label_dists": None, "clusters": None}
    if needs:
        if workload is None:
            raise ScheduleError(f"availability '{acfg.availability}' needs the workload's "
                                f"{' and '.join(sorted(needs))}; pass the workload to schedule_for")
        wl = workload() if callable(workload) else workload
        inputs.update({k: getattr(wl, k) for k in needs})
    return build_schedule(acfg.availability, num_clients, acfg.schedule_seed, **inputs)


def model_help() -> dict[str, dict]:
    """Name -> {parameters with defaults, first docstring line}: for CLI help and docs."""
    return {name: {"params": dict(cls.defaults),
                   "doc": (cls.__doc__ or "").strip().splitlines()[0]}
            for name, cls in sorted(SCHEDULES.items())}
