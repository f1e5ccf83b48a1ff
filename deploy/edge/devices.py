"""Device classes for edge emulation: which SuperNode gets which CPU, memory and network limits.

The devices file (TOML, ``--devices FILE``) and its parser live in :mod:`virtualtime.profiles`:
the simulation's virtual clock (run config ``devices``) reads the same file with the same
parser. A deployment applies each class's limits (``cpus``, ``mem_mb``, ``up_kbps``,
``down_kbps``, ``rtt_ms``, ``loss``) and ignores the simulation's keys (``step_ms``, ``speed``, ``overhead_ms``,
``session_*``). FedScale-style traces become classes with :func:`classes_from_trace`
(:mod:`virtualtime.traces`). Here every error of those readers is a :class:`DeployError`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from virtualtime import profiles as _profiles, traces as _traces
from virtualtime.errors import ProfileError
from virtualtime.profiles import KEYS, LIMITS, UNCONSTRAINED  # noqa: F401  (re-exported)

from ..errors import DeployError
from ..tuning import host_capacity  # noqa: F401  (the host check's numbers; re-exported)

DeviceClass = _profiles.DeviceProfile
DevicePlan = _profiles.ProfilePlan


def parse_devices(doc: Mapping[str, Any], num_nodes: int, source: str = "devices file") -> DevicePlan:
    """A :class:`DevicePlan` from a parsed devices file (:func:`virtualtime.parse_profiles`)."""
    try:
        return _profiles.parse_profiles(doc, num_nodes, source)
    except ProfileError as err:
        raise DeployError(str(err)) from err


def load_devices(path: str | Path, num_nodes: int) -> DevicePlan:
    """Read and check a devices file (TOML)."""
    try:
        return _profiles.read_profiles(path, num_nodes)
    except ProfileError as err:
        raise DeployError(str(err)) from err


def read_trace(path: str | Path) -> dict[str, tuple[float, float]]:
    """client -> (ms per sample, kbit/s) from a FedScale-style device trace (:func:`virtualtime.read_trace`)."""
    try:
        return _traces.read_trace(path)
    except ProfileError as err:
        raise DeployError(str(err)) from err


def classes_from_trace(trace: Mapping[str, tuple[float, float]], num_nodes: int, num_classes: int,
                       seed: int = 0) -> str:
    """A devices file (TOML text) from a trace (:func:`virtualtime.classes_from_trace`)."""
    try:
        return _traces.classes_from_trace(trace, num_nodes, num_classes, seed)
    except ProfileError as err:
        raise DeployError(str(err)) from err


# ---------------------------------------------------------------------- what the host can honour
def check_host(plan: DevicePlan, cpus: float | None = None, mem_mb: int | None = None) -> None:
    """Refuse caps that add up to more than the host can honour (each node's cap times its
    clients, summed over classes), naming the numbers."""
    if cpus is None or mem_mb is None:
        host_cpus, host_mem = host_capacity()
        cpus = host_cpus if cpus is None else cpus
        mem_mb = host_mem if mem_mb is None else mem_mb
    want_cpu = sum(dc.cpus * len(dc.clients) for dc in plan.classes if dc.cpus is not None)
    want_mem = sum(dc.mem_mb * len(dc.clients) for dc in plan.classes if dc.mem_mb is not None)
    problems = []
    if want_cpu > cpus + 1e-9:
        parts = " + ".join(f"{len(dc.clients)} x {dc.cpus:g} ({dc.name})" for dc in plan.classes if dc.cpus)
        problems.append(f"CPU caps add up to {want_cpu:g} CPUs ({parts}) but this host has {cpus:g}")
    if want_mem > mem_mb:
        parts = " + ".join(f"{len(dc.clients)} x {dc.mem_mb} MiB ({dc.name})" for dc in plan.classes if dc.mem_mb)
        problems.append(f"memory caps add up to {want_mem} MiB ({parts}) but {mem_mb} MiB are available")
    if problems:
        raise DeployError("the device classes ask for more than the host can honour: " + "; ".join(problems)
                          + ". Lower the caps or the counts (a cap the host cannot give is not a cap).")


def emit_text(make: Callable[[], str], output: str | None) -> int:
    """The devices CLIs' ending: ``make()`` the text, then write it to ``output`` or print it;
    a bad file or value prints ``error: ...`` and gives exit code 2."""
    try:
        text = make()
    except (DeployError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if output:
        Path(output).write_text(text)
    else:
        print(text, end="")
    return 0
