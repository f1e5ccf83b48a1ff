"""Whether each host of a deployment answers (:class:`HostProbes`): one thread a host asks its
engine every :data:`PROBE` seconds (a container engine's ``/_ping``, a process host's runtime API)
and which of its clients run; a host that does not answer is logged once (``host h unreachable:
why``), again when it is back (``host h reachable again after X s``), and kept as an outage. The
churn driver reads :meth:`HostProbes.unreachable` during every round (every host down now or since
its last read), so a cut-off host's clients miss that round with their host named as the cause.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .hostengine import HostEngine, HostUnreachable
from .hosts import HostSpec, HostsPlan

PROBE = 1.0  # seconds between two probes of a host


class HostProbes:
    def __init__(self, plan: HostsPlan, engines: Mapping[str, HostEngine], log: Callable[[str], None],
                 stopping: threading.Event) -> None:
        self.plan = plan
        self.engines = engines
        self.log = log
        self.stopping = stopping
        self.lock = threading.Lock()
        self.running: dict[str, tuple[float, set[int]]] = {}  # host -> (read at, its running clients)
        self.down: dict[str, str] = {}  # host -> why it is unreachable now
        self.down_since_read: dict[str, str] = {}  # host -> why, every host down since unreachable() ran
        self.outages: list[dict[str, Any]] = []  # {"host", "why", "from", "to"} on the driver's clock

    def threads(self) -> list[threading.Thread]:
        return [threading.Thread(target=self._watch, args=(h,), name=f"probe-{h.name}", daemon=True)
                for h in self.plan.hosts]

    def _watch(self, host: HostSpec) -> None:
        engine = self.engines[host.name]
        while not self.stopping.is_set():
            try:
                why = engine.reachable(2.0)
                running = engine.running() if why is None else None
            except HostUnreachable as err:
                why, running = err.why, None
            except Exception as err:  # noqa: BLE001  (an engine error is the host's, never the run's end)
                why, running = f"its engine failed: {err}", None
            self._note(host.name, why, running, time.monotonic())
            self.stopping.wait(PROBE)

    def _note(self, host: str, why: str | None, running: set[int] | None, now: float) -> None:
        with self.lock:
            if why is not None:
                if host not in self.down:
                    self.log(f"host {host} unreachable: {why}")
                    self.outages.append({"host": host, "why": why, "from": now, "to": None})
                self.down[host] = why
                self.down_since_read[host] = why
                return
            if host in self.down:
                for outage in reversed(self.outages):
                    if outage["host"] == host and outage["to"] is None:
                        outage["to"] = now
                        self.log(f"host {host} reachable again after {now - outage['from']:.1f} s")
                        break
            self.down.pop(host, None)
            self.running[host] = (now, running or set())

    def running_read(self, host: str) -> tuple[float, set[int]] | None:
        """(when, the clients running on ``host``) of its latest answer."""
        with self.lock:
            return self.running.get(host)

    def unreachable(self) -> dict[int, str]:
        """Client -> "host h unreachable: why", for every host down now or since the last call."""
        with self.lock:
            down, self.down_since_read = dict(self.down_since_read), {}
            down.update(self.down)
        return {c: f"host {h} unreachable: {why}" for h, why in down.items() for c in self.plan.host(h).clients}
