"""Device classes for edge emulation: which SuperNode gets which CPU, memory and network limits.

A devices file (TOML, ``--devices FILE``) has one table per class::

    [slow]
    count = 2          # the next 2 clients not yet placed (or: clients = [0, 3])
    cpus = 0.2         # a CPU fraction (CFS quota), > 0
    mem_mb = 256       # memory cap of the SuperNode and everything it starts, MiB
    up_kbps = 1000     # node -> SuperLink bandwidth, kbit/s
    down_kbps = 1000   # SuperLink -> node bandwidth, kbit/s
    rtt_ms = 100       # added round-trip time, ms (netem, or the node's relay: deploy.edge.relay)
    loss = 0.01        # loss probability in [0, 1) (netem; relay: a chunk held one RTO)

    [fast]
    count = 2

Every key but ``count``/``clients`` is optional; clients no class covers run unconstrained
(class ``unconstrained``). Classes with an explicit ``clients`` list are placed first, then
``count`` classes take the lowest free client ids in file order.

FedScale-style traces (per client: ``computation`` in ms per sample, ``communication`` in kbit/s;
FedScale's ``client_device_capacity``, as JSON or CSV) become classes with
:func:`classes_from_trace`: N clients drawn with a seed, bucketed by speed into K classes whose
CPU fraction is the fastest bucket's median ms per sample over the bucket's and whose bandwidth
is the bucket's median.
"""

from __future__ import annotations

import csv
import difflib
import json
import math
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DeployError
from ..tuning import host_capacity  # noqa: F401  (the host check's numbers; re-exported)

LIMITS = ("cpus", "mem_mb", "up_kbps", "down_kbps", "rtt_ms", "loss")
KEYS = ("count", "clients", *LIMITS)
UNCONSTRAINED = "unconstrained"


@dataclass(frozen=True)
class DeviceClass:
    """One class: its clients and its limits (None: not limited)."""

    name: str
    clients: tuple[int, ...]
    cpus: float | None = None
    mem_mb: int | None = None
    up_kbps: int | None = None
    down_kbps: int | None = None
    rtt_ms: float | None = None
    loss: float | None = None

    @property
    def limits(self) -> dict[str, float]:
        """The limits this class sets, by key."""
        return {k: getattr(self, k) for k in LIMITS if getattr(self, k) is not None}

    @property
    def shaped(self) -> bool:
        """Whether it needs its own network path (bandwidth, latency or loss)."""
        return any(getattr(self, k) is not None for k in ("up_kbps", "down_kbps", "rtt_ms", "loss"))


@dataclass(frozen=True)
class DevicePlan:
    """Every client's class, for ``num_nodes`` SuperNodes."""

    num_nodes: int
    classes: tuple[DeviceClass, ...]
    _of: dict[int, DeviceClass] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        placed = {c: dc for dc in self.classes for c in dc.clients}
        free = tuple(i for i in range(self.num_nodes) if i not in placed)
        if free:
            rest = DeviceClass(UNCONSTRAINED, free)
            object.__setattr__(self, "classes", (*self.classes, rest))
            placed.update(dict.fromkeys(free, rest))
        self._of.update(placed)

    def of(self, client: int) -> DeviceClass:
        return self._of[client]

    def describe(self) -> str:
        return "; ".join(f"{dc.name}: clients {list(dc.clients)}"
                         + (" " + ", ".join(f"{k}={v}" for k, v in dc.limits.items()) if dc.limits else "")
                         for dc in self.classes)


def _number(name: str, key: str, value: Any, *, integer: bool = False, low: float = 0.0,
            low_open: bool = True, high: float | None = None, high_open: bool = False) -> float | int:
    kind = "an integer" if integer else "a number"
    bad_type = isinstance(value, bool) or not isinstance(value, (int, float)) or (
        integer and not isinstance(value, int))
    if bad_type or (not bad_type and not math.isfinite(value)):
        raise DeployError(f"device class [{name}]: {key} = {value!r} must be {kind}")
    ok = (value > low if low_open else value >= low) and (
        high is None or (value < high if high_open else value <= high))
    if not ok:
        rng = f"{'>' if low_open else '>='} {low:g}" + (
            f" and {'<' if high_open else '<='} {high:g}" if high is not None else "")
        raise DeployError(f"device class [{name}]: {key} = {value!r} must be {rng}")
    return value


def parse_devices(doc: Mapping[str, Any], num_nodes: int, source: str = "devices file") -> DevicePlan:
    """A :class:`DevicePlan` from a parsed devices file, with errors that name the class, the
    key, the value and what is allowed."""
    if num_nodes < 1:
        raise DeployError("num_nodes must be >= 1")
    if not doc:
        raise DeployError(f"{source}: no device class (one [name] table per class, e.g. [slow] count = 2 cpus = 0.2)")
    specs: list[tuple[str, dict[str, Any]]] = []
    for name, table in doc.items():
        if not isinstance(table, Mapping):
            raise DeployError(f"{source}: {name} = {table!r} is not a class table; write [{name}] and its keys")
        for key in table:
            if key not in KEYS:
                close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.5)
                raise DeployError(f"device class [{name}]: unknown key {key!r}"
                                  + (f" (did you mean {close[0]!r}?)" if close else "")
                                  + f"; known keys: {', '.join(KEYS)}")
        if ("count" in table) == ("clients" in table):
            raise DeployError(f"device class [{name}]: give exactly one of count (how many clients) "
                              f"and clients (a list of client ids)")
        limits = {}
        for key in LIMITS:
            if key not in table:
                continue
            v = table[key]
            if key == "loss":
                limits[key] = float(_number(name, key, v, low=0.0, low_open=False, high=1.0, high_open=True))
            elif key == "rtt_ms":
                limits[key] = float(_number(name, key, v, low=0.0, low_open=False))
            elif key == "cpus":
                limits[key] = float(_number(name, key, v, low=0.0))
            else:
                limits[key] = int(_number(name, key, v, integer=True, low=0))
        if limits.get("mem_mb") is not None and limits["mem_mb"] < 32:
            raise DeployError(f"device class [{name}]: mem_mb = {limits['mem_mb']} is below 32 MiB, too "
                              f"little for a Python process to start")
        specs.append((name, {**table, **limits}))
    taken: dict[int, str] = {}
    clients_of: dict[str, tuple[int, ...]] = {}
    for name, table in specs:
        if "clients" not in table:
            continue
        ids = table["clients"]
        if not isinstance(ids, list) or not ids or not all(isinstance(c, int) and not isinstance(c, bool)
                                                           for c in ids):
            raise DeployError(f"device class [{name}]: clients = {ids!r} must be a non-empty list of client ids")
        for c in ids:
            if not 0 <= c < num_nodes:
                raise DeployError(f"device class [{name}]: client {c} does not exist (clients are 0..{num_nodes - 1} "
                                  f"for {num_nodes} SuperNodes)")
            if c in taken:
                raise DeployError(f"device class [{name}]: client {c} is already in class [{taken[c]}]")
            taken[c] = name
        clients_of[name] = tuple(ids)
    for name, table in specs:
        if "count" not in table:
            continue
        count = int(_number(name, "count", table["count"], integer=True, low=0))
        free = [i for i in range(num_nodes) if i not in taken]
        if count > len(free):
            raise DeployError(f"device class [{name}]: count = {count} but only {len(free)} of {num_nodes} "
                              f"clients are left for it (the classes ask for more clients than --num-nodes)")
        clients_of[name] = tuple(free[:count])
        taken.update(dict.fromkeys(free[:count], name))
    classes = tuple(DeviceClass(name, clients_of[name], **{k: t[k] for k in LIMITS if k in t})
                    for name, t in specs)
    return DevicePlan(num_nodes, classes)


def load_devices(path: str | Path, num_nodes: int) -> DevicePlan:
    """Read and check a devices file (TOML)."""
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as err:
        raise DeployError(f"devices file {path}: {err.strerror or err}") from err
    except tomllib.TOMLDecodeError as err:
        raise DeployError(f"devices file {path} is not valid TOML: {err}") from err
    return parse_devices(doc, num_nodes, source=f"devices file {path}")


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


# ---------------------------------------------------------------------- FedScale-style traces
def read_trace(path: str | Path) -> dict[str, tuple[float, float]]:
    """client -> (ms per sample, kbit/s) from a FedScale-style device trace: JSON
    ``{"<client>": {"computation": ms, "communication": kbps}}`` or CSV with columns
    ``client,computation,communication``."""
    path = Path(path)
    text = path.read_text()
    out: dict[str, tuple[float, float]] = {}
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        rows = [(str(k), v) for k, v in json.loads(text).items()]
    else:
        rows = [(r.get("client", str(i)), r) for i, r in enumerate(csv.DictReader(text.splitlines()))]
    for client, row in rows:
        try:
            comp, comm = float(row["computation"]), float(row["communication"])
        except (KeyError, TypeError, ValueError) as err:
            raise DeployError(f"{path}: client {client}: needs numeric 'computation' (ms per sample) and "
                              f"'communication' (kbit/s), got {row!r}") from err
        if not (comp > 0 and comm > 0 and math.isfinite(comp) and math.isfinite(comm)):
            raise DeployError(f"{path}: client {client}: computation and communication must be > 0, got "
                              f"{comp}, {comm}")
        out[client] = (comp, comm)
    if not out:
        raise DeployError(f"{path}: no client in the trace")
    return out


def classes_from_trace(trace: Mapping[str, tuple[float, float]], num_nodes: int, num_classes: int,
                       seed: int = 0) -> str:
    """A devices file (TOML text) for ``num_nodes`` clients drawn from ``trace`` with ``seed``
    and bucketed by ms per sample into ``num_classes`` classes of (nearly) equal size."""
    if not 1 <= num_classes <= num_nodes:
        raise DeployError(f"num_classes = {num_classes} must be between 1 and num_nodes = {num_nodes}")
    if len(trace) < num_nodes:
        raise DeployError(f"the trace has {len(trace)} clients, fewer than the {num_nodes} SuperNodes")
    names = sorted(trace)
    drawn = [names[k] for k in np.random.default_rng(seed).choice(len(names), num_nodes, replace=False)]
    order = sorted(range(num_nodes), key=lambda i: trace[drawn[i]][0])  # fastest first
    buckets = [list(b) for b in np.array_split(np.array(order), num_classes)]
    med = [float(np.median([trace[drawn[i]][0] for i in b])) for b in buckets]
    out = [f"# {num_nodes} clients drawn from a FedScale-style trace (seed {seed}), {num_classes} classes by "
           f"ms per sample;\n# node i is trace client: "
           + ", ".join(f"{i}={drawn[i]}" for i in range(num_nodes)) + "\n"]
    for k, b in enumerate(buckets):
        kbps = int(round(float(np.median([trace[drawn[i]][1] for i in b]))))
        cpus = round(med[0] / med[k], 2)
        lines = [f"[class-{k}]", f"clients = {sorted(int(i) for i in b)}",
                 f"# median {med[k]:.1f} ms per sample, {kbps} kbit/s"]
        if cpus < 1.0:
            lines.append(f"cpus = {max(cpus, 0.05):g}")
        lines += [f"up_kbps = {kbps}", f"down_kbps = {kbps}"]
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)


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
