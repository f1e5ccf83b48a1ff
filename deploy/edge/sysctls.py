"""Host kernel settings that a deployment under emulation may change, read at setup and put back
at close: ``net.ipv4.ip_forward`` (:data:`KEPT`).

A Docker engine started for the run sets IP forwarding to 1 when it starts (``dockerd``'s default
``--ip-forward=true``), and so does routing by hand between namespaces, a bridge and the host; left
at 1 it turns the host into a router between every network it is on. The setting is per network
namespace: a node's namespace has its own and it goes with the namespace; this is the host's (the
namespace the launcher runs in). :class:`deploy.edge.limits.EdgeLimits` records it at setup and
restores it at close; what could not be restored is in the close's list of leftovers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import DeployError

PROC_SYS = Path("/proc/sys")
KEPT = ("net.ipv4.ip_forward",)


class HostSysctls:
    """The values of ``keys`` (dotted sysctl names) found by :meth:`record`, restored by :meth:`restore`;
    ``root``: where the sysctl files are (``/proc/sys``; a folder of the same layout in tests)."""

    def __init__(self, keys: Iterable[str] = KEPT, root: Path = PROC_SYS,
                 log: Callable[[str], None] | None = None) -> None:
        self.keys = tuple(keys)
        self.root = Path(root)
        self.log = log or (lambda line: None)
        self.found: dict[str, str] = {}

    def path(self, key: str) -> Path:
        return self.root / key.replace(".", "/")

    def read(self, key: str) -> str:
        try:
            return self.path(key).read_text().strip()
        except OSError as e:
            raise DeployError(f"cannot read {key} ({self.path(key)}): {e.strerror or e}") from None

    def record(self) -> None:
        """Read every kept setting now (at setup, before anything is changed)."""
        self.found = {key: self.read(key) for key in self.keys}

    def changed(self) -> list[str]:
        """``key=now (was found)`` for each setting that differs from what :meth:`record` read."""
        out = []
        for key, was in self.found.items():
            try:
                now = self.read(key)
            except DeployError as e:
                out.append(str(e))
                continue
            if now != was:
                out.append(f"{key}={now} (was {was})")
        return out

    def restore(self) -> list[str]:
        """Write back every setting that changed since :meth:`record`; the ones that could not be
        (``key=now (was found)``, also logged)."""
        left = []
        for key, was in self.found.items():
            now = "?"
            try:
                now = self.read(key)
                if now == was:
                    continue
                self.path(key).write_text(was + "\n")
                if (after := self.read(key)) != was:
                    raise DeployError(f"it reads {after} after writing {was}")
            except (OSError, DeployError) as e:
                left.append(f"{key}={now} (was {was})")
                self.log(f"could not restore {left[-1]}: {e}")
                continue
            self.log(f"{key}: {now} at close, restored to {was} (its value at setup)")
        return left
