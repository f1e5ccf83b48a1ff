"""Device classes: which client is which device, from the devices file (TOML) that both the
simulation (run config ``devices``) and a deployment (``python -m deploy launch --devices FILE``)
read. One table per class::

    [slow]
    count = 2          # the next 2 clients not yet placed (or: clients = [0, 3])
    cpus = 0.2         # a CPU fraction (CFS quota), > 0
    mem_mb = 256       # memory cap of the SuperNode and everything it starts, MiB
    up_kbps = 1000     # node -> SuperLink bandwidth, kbit/s
    down_kbps = 1000   # SuperLink -> node bandwidth, kbit/s
    rtt_ms = 100       # added round-trip time, ms (netem, or the node's relay: deploy.edge.relay)
    loss = 0.01        # loss probability in [0, 1) (netem; relay: a chunk held one RTO)
    step_ms = 3.0      # simulation: ms per local step of the run's model on this device
    speed = 0.25       # ... or its compute speed relative to the reference device (1)
    overhead_ms = 900  # simulation: fixed ms per job besides transfers and training (process
                       # start, (de)serialisation, polls: what a deployment pays per message)
    session_on_s = 600     # simulation: mean length of an online session, s
    session_off_s = 300    # ... and of an offline gap, s
    session_model = "exponential"   # or "periodic": on for session_on_s from t = 0, off, repeat

    [fast]
    count = 2

Every key but ``count``/``clients`` is optional; clients no class covers are the reference device
with no network limit (class ``unconstrained``). Classes with an explicit ``clients`` list are
placed first, then ``count`` classes take the lowest free client ids in file order. A deployment
applies the limits (``cpus`` ... ``loss``) and ignores the simulation's keys; a simulation times
each client from ``step_ms`` (or ``speed``), ``overhead_ms``, the bandwidths and ``rtt_ms``, and its
sessions.
"""

from __future__ import annotations

import difflib
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ProfileError

LIMITS = ("cpus", "mem_mb", "up_kbps", "down_kbps", "rtt_ms", "loss")
SPEED_KEYS = ("step_ms", "speed")
JOB_KEYS = ("overhead_ms",)
SESSION_KEYS = ("session_on_s", "session_off_s", "session_model")
SESSION_MODELS = ("exponential", "periodic")
KEYS = ("count", "clients", *LIMITS, *SPEED_KEYS, *JOB_KEYS, *SESSION_KEYS)
UNCONSTRAINED = "unconstrained"


@dataclass(frozen=True)
class DeviceProfile:
    """One device class: its clients, its limits (None: not limited), its compute speed and its
    on/off sessions (None: always on)."""

    name: str
    clients: tuple[int, ...]
    cpus: float | None = None
    mem_mb: int | None = None
    up_kbps: int | None = None
    down_kbps: int | None = None
    rtt_ms: float | None = None
    loss: float | None = None
    step_ms: float | None = None
    speed: float | None = None
    overhead_ms: float | None = None
    session_on_s: float | None = None
    session_off_s: float | None = None
    session_model: str = "exponential"

    @property
    def limits(self) -> dict[str, float]:
        """The deployment limits this class sets, by key."""
        return {k: getattr(self, k) for k in LIMITS if getattr(self, k) is not None}

    @property
    def shaped(self) -> bool:
        """Whether it needs its own network path (bandwidth, latency or loss)."""
        return any(getattr(self, k) is not None for k in ("up_kbps", "down_kbps", "rtt_ms", "loss"))

    @property
    def has_sessions(self) -> bool:
        return self.session_on_s is not None

    def step_seconds(self, reference_step_ms: float | None) -> float:
        """Seconds per local step: ``step_ms``, else ``reference_step_ms / speed`` (speed 1 when
        not given); ProfileError when the reference is needed and unknown."""
        if self.step_ms is not None:
            return self.step_ms / 1000.0
        if reference_step_ms is None:
            raise ProfileError(
                f"device class [{self.name}] has no step_ms, so its step time is the reference device's "
                f"divided by its speed ({self.speed or 1:g}), and no reference step time is known: give "
                f"[{self.name}] a step_ms, or set the run config's reference-step-ms")
        return reference_step_ms / (self.speed or 1.0) / 1000.0

    def describe(self) -> str:
        keys = [k for k in (*LIMITS, *SPEED_KEYS, *JOB_KEYS, "session_on_s", "session_off_s")
                if getattr(self, k) is not None]
        if self.has_sessions:
            keys.append("session_model")
        return ", ".join(f"{k}={getattr(self, k)}" for k in keys)


@dataclass(frozen=True)
class ProfilePlan:
    """Every client's device class, for ``num_nodes`` clients (a deployment's SuperNodes)."""

    num_nodes: int
    classes: tuple[DeviceProfile, ...]
    reference_step_ms: float | None = None
    _of: dict[int, DeviceProfile] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        placed = {c: dc for dc in self.classes for c in dc.clients}
        free = tuple(i for i in range(self.num_nodes) if i not in placed)
        if free:
            rest = DeviceProfile(UNCONSTRAINED, free)
            object.__setattr__(self, "classes", (*self.classes, rest))
            placed.update(dict.fromkeys(free, rest))
        self._of.update(placed)

    @property
    def num_clients(self) -> int:
        return self.num_nodes

    def of(self, client: int) -> DeviceProfile:
        return self._of[client]

    def profile_of(self, client: int) -> DeviceProfile:
        """The class of ``client`` (a KeyError names a client outside [0, num_clients))."""
        try:
            return self._of[client]
        except KeyError:
            raise KeyError(f"client {client} is not in the device plan (clients 0..{self.num_nodes - 1})") from None

    def describe(self) -> str:
        return "; ".join(f"{dc.name}: clients {list(dc.clients)}" + (f" {dc.describe()}" if dc.describe() else "")
                         for dc in self.classes)

    def record(self) -> dict[str, Any]:
        """What a results folder keeps (config.json): per class its clients and keys."""
        out: dict[str, Any] = {}
        for dc in self.classes:
            keys = {k: getattr(dc, k) for k in (*LIMITS, *SPEED_KEYS, *JOB_KEYS, *SESSION_KEYS)
                    if getattr(dc, k) is not None}
            if not dc.has_sessions:
                keys.pop("session_model", None)
            out[dc.name] = {"clients": list(dc.clients), **keys}
        if self.reference_step_ms is not None:
            out["reference-step-ms"] = self.reference_step_ms
        return out


def _number(name: str, key: str, value: Any, *, integer: bool = False, low: float = 0.0,
            low_open: bool = True, high: float | None = None, high_open: bool = False) -> float | int:
    kind = "an integer" if integer else "a number"
    bad_type = isinstance(value, bool) or not isinstance(value, (int, float)) or (
        integer and not isinstance(value, int))
    if bad_type or (not bad_type and not math.isfinite(value)):
        raise ProfileError(f"device class [{name}]: {key} = {value!r} must be {kind}")
    ok = (value > low if low_open else value >= low) and (
        high is None or (value < high if high_open else value <= high))
    if not ok:
        rng = f"{'>' if low_open else '>='} {low:g}" + (
            f" and {'<' if high_open else '<='} {high:g}" if high is not None else "")
        raise ProfileError(f"device class [{name}]: {key} = {value!r} must be {rng}")
    return value


def _class_keys(name: str, table: Mapping[str, Any]) -> dict[str, Any]:
    """The checked keys of one class (all but count / clients)."""
    for key in table:
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.5)
            raise ProfileError(f"device class [{name}]: unknown key {key!r}"
                               + (f" (did you mean {close[0]!r}?)" if close else "")
                               + f"; known keys: {', '.join(KEYS)}")
    if ("count" in table) == ("clients" in table):
        raise ProfileError(f"device class [{name}]: give exactly one of count (how many clients) "
                           f"and clients (a list of client ids)")
    out: dict[str, Any] = {}
    for key in (*LIMITS, *SPEED_KEYS, *JOB_KEYS, "session_on_s", "session_off_s"):
        if key not in table:
            continue
        v = table[key]
        if key == "loss":
            out[key] = float(_number(name, key, v, low=0.0, low_open=False, high=1.0, high_open=True))
        elif key in ("rtt_ms", "overhead_ms", "session_off_s"):
            out[key] = float(_number(name, key, v, low=0.0, low_open=False))
        elif key in ("cpus", "step_ms", "speed", "session_on_s"):
            out[key] = float(_number(name, key, v, low=0.0))
        else:
            out[key] = int(_number(name, key, v, integer=True, low=0))
    if out.get("mem_mb") is not None and out["mem_mb"] < 32:
        raise ProfileError(f"device class [{name}]: mem_mb = {out['mem_mb']} is below 32 MiB, too "
                           f"little for a Python process to start")
    if "step_ms" in out and "speed" in out:
        raise ProfileError(f"device class [{name}]: give one of step_ms (ms per local step) and speed "
                           f"(relative to the reference device), not both")
    if ("session_on_s" in out) != ("session_off_s" in out):
        raise ProfileError(f"device class [{name}]: sessions need both session_on_s and session_off_s "
                           f"(mean online and offline seconds)")
    if "session_model" in table:
        model = table["session_model"]
        if model not in SESSION_MODELS:
            raise ProfileError(f"device class [{name}]: session_model = {model!r} must be one of "
                               f"{', '.join(map(repr, SESSION_MODELS))}")
        if "session_on_s" not in out:
            raise ProfileError(f"device class [{name}]: session_model needs session_on_s and session_off_s")
        out["session_model"] = model
    return out


def parse_profiles(doc: Mapping[str, Any], num_nodes: int, source: str = "devices file", *,
                   reference_step_ms: float | None = None) -> ProfilePlan:
    """A :class:`ProfilePlan` from a parsed devices file, with errors that name the class, the
    key, the value and what is allowed."""
    if num_nodes < 1:
        raise ProfileError("the number of clients must be >= 1")
    if reference_step_ms is not None and not (math.isfinite(reference_step_ms) and reference_step_ms > 0):
        raise ProfileError(f"reference step time = {reference_step_ms!r} ms must be a number > 0")
    if not doc:
        raise ProfileError(f"{source}: no device class (one [name] table per class, e.g. [slow] count = 2 cpus = 0.2)")
    specs: list[tuple[str, Mapping[str, Any], dict[str, Any]]] = []
    for name, table in doc.items():
        if not isinstance(table, Mapping):
            raise ProfileError(f"{source}: {name} = {table!r} is not a class table; write [{name}] and its keys")
        specs.append((name, table, _class_keys(name, table)))
    taken: dict[int, str] = {}
    clients_of: dict[str, tuple[int, ...]] = {}
    for name, table, _ in specs:
        if "clients" not in table:
            continue
        ids = table["clients"]
        if not isinstance(ids, list) or not ids or not all(isinstance(c, int) and not isinstance(c, bool)
                                                           for c in ids):
            raise ProfileError(f"device class [{name}]: clients = {ids!r} must be a non-empty list of client ids")
        for c in ids:
            if not 0 <= c < num_nodes:
                raise ProfileError(f"device class [{name}]: client {c} does not exist (clients are "
                                   f"0..{num_nodes - 1} for {num_nodes} clients)")
            if c in taken:
                raise ProfileError(f"device class [{name}]: client {c} is already in class [{taken[c]}]")
            taken[c] = name
        clients_of[name] = tuple(ids)
    free = iter(i for i in range(num_nodes) if i not in taken)
    left = num_nodes - len(taken)
    for name, table, _ in specs:
        if "count" not in table:
            continue
        count = int(_number(name, "count", table["count"], integer=True, low=0))
        if count > left:
            raise ProfileError(f"device class [{name}]: count = {count} but only {left} of {num_nodes} "
                               f"clients are left for it (the classes ask for more clients than there are)")
        clients_of[name] = tuple(next(free) for _ in range(count))
        left -= count
    classes = tuple(DeviceProfile(name, clients_of[name], **keys) for name, _, keys in specs)
    return ProfilePlan(num_nodes, classes, reference_step_ms)


def read_profiles(path: str | Path, num_clients: int, *, seed: int = 0,
                  reference_step_ms: float | None = None) -> ProfilePlan:
    """Read and check a devices file (TOML) for ``num_clients`` clients. ``seed`` is accepted for
    plans that draw (the placement itself is deterministic: file order); sessions are drawn by
    the clock with its own seed."""
    del seed  # placement is by file order; kept in the signature for plans drawn from traces
    path = Path(path)
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as err:
        raise ProfileError(f"devices file {path}: {err.strerror or err}") from err
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"devices file {path} is not valid TOML: {err}") from err
    return parse_profiles(doc, num_clients, source=f"devices file {path}", reference_step_ms=reference_step_ms)
