"""How long a deployment waits, in one place: every wait has a base (what an idle 2-core machine
needs, with room) scaled by what the host can do now, a flag to set it, and a message that names
the wait and the flag when it runs out.

The host's pace is measured when the launcher starts (:func:`host_slowdown`): the 1-minute load per
CPU this process may use, at least 1. A machine running 40 runnable processes on 2 CPUs starts a
Python process ~20 times slower than an idle one (a ``flwr-clientapp`` imports in 3-4 s idle here).
A node capped at a fraction of a CPU (edge device classes, ``cpus = 0.2``) is slower again by
``1 / cap``. The scaled waits only lengthen: a wait never drops below its base.

| wait | base | scaled by | flag (``python -m deploy launch``) |
|---|---|---|---|
| the SuperLink listens | 60 s | host | ``--superlink-timeout`` |
| a SuperNode registers | 60 s | host, the node's CPU cap | ``--register-timeout`` |
| a ClientApp's first heartbeat (task patience) | 120 s | host, the slowest CPU cap | ``--task-patience`` |
| a round's replies (run config ``round-timeout``, ``wait-for-nodes``) | the run config's | host, the slowest CPU cap | ``--run-config "round-timeout=..."`` (the compose churn service: ``--round-timeout``, ``ROUND_TIMEOUT``) |
| ``flwr run`` submits the app (builds and uploads it; ~200 s at load 22-25 on 2 CPUs) | 120 s | host | ``--submit-timeout`` |
| any other ``flwr`` command (``ls``, ``stop``, ``log``) | 60 s | host | ``--cli-timeout`` |

Graces that end in a harder stop rather than an error (a SIGTERM before SIGKILL) scale with
``Waits.host`` too.

The task patience is the SuperNode's: Flower 1.42 revokes a claimed task's token when its
``flwr-clientapp`` has not sent its first heartbeat within 30 s (then 60 s between heartbeats),
and the late ClientApp's every call is answered ``401 Runtime task-token authentication failed``:
its reply is lost, and the relaunched ClientApp is as slow. :mod:`deploy.tuning`'s SuperNode and
SuperLink commands replace those 30 / 60 s by the patience given in :data:`PATIENCE_VAR`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TypeVar

from .errors import DeployError

PATIENCE_VAR = "FLCHURN_TASK_PATIENCE"  # seconds; read by deploy.tuning's SuperNode and SuperLink
FLOWER_TASK_PATIENCE = 30.0  # Flower 1.42: a claimed task's first heartbeat (HEARTBEAT_DEFAULT_INTERVAL)
CHECK_EVERY = 10.0  # seconds between two progress lines of a wait
T = TypeVar("T")
FLAGS = {"superlink": "--superlink-timeout", "register": "--register-timeout", "task_patience": "--task-patience",
         "submit": "--submit-timeout", "cli": "--cli-timeout"}


def host_cpus() -> float:
    """CPUs this process may use."""
    return float(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else float(os.cpu_count() or 1)


def host_slowdown(load: float | None = None, cpus: float | None = None) -> float:
    """How many times slower than an idle machine a process runs here now: the 1-minute load per
    CPU, at least 1 (``load`` and ``cpus`` default to this host's)."""
    load = os.getloadavg()[0] if load is None else load
    cpus = host_cpus() if cpus is None else cpus
    return max(1.0, load / max(cpus, 1e-9))


@dataclass(frozen=True)
class Waits:
    """Seconds each wait of a deployment lasts at most (see the module's table)."""

    superlink: float = 60.0
    register: float = 60.0
    task_patience: float = 120.0
    round_factor: float = 1.0  # the run config's round-timeout is multiplied by this
    submit: float = 120.0  # flwr run: the app built, uploaded and stored by the SuperLink
    cli: float = 60.0  # every other flwr command (ls, stop, log)
    host: float = 1.0  # the host's slowdown these waits were scaled by (graces: base x host)

    def scaled(self, slowdown: float, cpu_cap: float = 1.0) -> Waits:
        """These waits on a host ``slowdown`` times slower than idle, for nodes capped at
        ``cpu_cap`` CPUs (the slowest node's; 1: no cap); never shorter than these."""
        if slowdown < 1.0 or not 0.0 < cpu_cap:
            raise ValueError(f"slowdown must be >= 1 and cpu_cap > 0, not {slowdown}, {cpu_cap}")
        node = slowdown / min(1.0, cpu_cap)
        return Waits(superlink=self.superlink * slowdown, register=self.register * node,
                     task_patience=self.task_patience * node, round_factor=self.round_factor * node,
                     submit=self.submit * slowdown, cli=self.cli * slowdown, host=self.host * slowdown)

    def override(self, **given: float | None) -> Waits:
        """These waits with the ones the user gave (None: keep); each must be positive."""
        chosen = {k: float(v) for k, v in given.items() if v is not None}
        bad = [f"{FLAGS[k]} {v:g}" for k, v in chosen.items() if not v > 0]
        if bad:
            raise DeployError(f"{', '.join(bad)}: a wait must be a positive number of seconds")
        return replace(self, **chosen)

    def env(self) -> dict[str, str]:
        """The environment that gives Flower's processes this task patience."""
        return {PATIENCE_VAR: f"{self.task_patience:g}"}


def slowest_cap(caps: Iterable[float | None]) -> float:
    """The smallest CPU cap among device classes (None: no cap), at most 1."""
    return min([1.0, *(float(c) for c in caps if c)])


def for_host(cpu_cap: float = 1.0) -> Waits:
    """The default waits, scaled to this host as it is now (and to the nodes' slowest CPU cap)."""
    return Waits().scaled(host_slowdown(), cpu_cap)


RUN_WAITS = ("round-timeout", "wait-for-nodes")  # run config keys scaled by Waits.round_factor


def scale_run_waits(user: dict, defaults: dict, round_factor: float) -> list[str]:
    """The run config's waits (:data:`RUN_WAITS`) that ``user`` does not set, scaled to the host:
    ``defaults``' value x ``round_factor`` put into ``user`` (nothing below 1). Returns a line per
    scaled wait, naming how to set it (the process launcher and the compose churn service)."""
    lines = []
    for key in RUN_WAITS:
        if key not in user and round_factor > 1.0:
            user[key] = float(round(float(defaults[key]) * round_factor))
            lines.append(f"{key} {user[key]:.0f} s: {defaults[key]} s scaled to this host (x{round_factor:.1f}; "
                         f"set it with --run-config \"{key}=...\")")
    return lines


def ran_out(what: str, seconds: float, flag: str, see: object = None) -> DeployError:
    """The error of a wait that ran out: which wait (``what``: "SuperNode 0 registers"), how long,
    and the flag that lengthens it."""
    where = f"; see {see}" if see is not None else ""
    return DeployError(f"gave up waiting until {what} after {seconds:.0f} s (lengthen this wait with {flag} SECONDS; its default "
                       f"scales with the host's load and the nodes' CPU caps: docs/deployment.md){where}")


def task_patience_from_env(default: float) -> float:
    """The task patience :data:`PATIENCE_VAR` gives (a Flower process's side), else ``default``."""
    text = os.environ.get(PATIENCE_VAR, "")
    try:
        value = float(text) if text else default
    except ValueError:
        raise SystemExit(f"{PATIENCE_VAR}={text!r}: expected seconds, e.g. 300") from None
    if not value > 0:
        raise SystemExit(f"{PATIENCE_VAR}={text!r}: must be positive")
    return value


def wait_for(done: Callable[[], T | None], timeout: float, *, what: str, flag: str, see: object,
             log: Callable[[str], None], gone: Callable[[], str | None] = lambda: None) -> T:
    """Poll ``done()`` until it answers (not None) and return that; a progress line every
    :data:`CHECK_EVERY` s (``waiting until <what> (12 s of 60 s)``); :func:`ran_out` naming ``what``
    and ``flag`` after ``timeout`` s; a DeployError with ``gone()``'s reason once that gives one (the
    awaited process exited)."""
    t0 = time.monotonic()
    next_note = t0 + CHECK_EVERY
    while (answer := done()) is None:
        if (reason := gone()) is not None:
            raise DeployError(f"{reason}; see {see}")
        now = time.monotonic()
        if now - t0 > timeout:
            raise ran_out(what, timeout, flag, see)
        if now >= next_note:
            log(f"waiting until {what} ({now - t0:.0f} s of {timeout:.0f} s)")
            next_note = now + CHECK_EVERY
        time.sleep(0.1)
    return answer
