"""What the churn driver and :func:`deploy.run.run_deployment` need of a set of SuperNodes,
whatever they run as: :class:`Nodes`. Two implementations: processes on loopback
(:class:`deploy.local.ProcessSite`) and Docker containers (:class:`deploy.containers.DockerNodes`).

Node ``i`` is client ``i`` (its ``partition-id``). Each start is a new *incarnation* that
registers with the SuperLink under a new Flower node id (ephemeral identity); a SuperNode logs
that id as ``SuperNode ID: <id>`` (:data:`NODE_ID_RE`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from .flwr_cli import FlwrCli

NODE_ID_RE = re.compile(r"SuperNode ID: (\d+)")
MODES = ("term", "kill")  # how a node goes offline: SIGTERM (graceful) or SIGKILL (a crash)


@runtime_checkable
class Nodes(Protocol):
    """N SuperNodes that can be started, signalled and stopped, and whose registration is seen."""

    num_nodes: int
    log: Callable[[str], None]

    def start_node(self, i: int) -> object:
        """Start node ``i`` (a no-op while it runs); returns at once (what it returns is the
        implementation's)."""

    def stop_node(self, i: int, mode: str = "term") -> None:
        """Take node ``i`` down (``mode`` in :data:`MODES`) and return once it is down."""

    def signal_node(self, i: int, sig: int) -> None:
        """Send ``sig`` to node ``i`` and return at once (``stop_node`` then finishes it)."""

    def running_nodes(self) -> set[int]:
        """The nodes whose SuperNode runs now."""

    def incarnation(self, i: int) -> int:
        """How many times node ``i`` has been started."""

    def registered_id(self, i: int) -> int | None:
        """The Flower node id of node ``i``'s current incarnation, once it has registered."""

    def wait_registered(self, i: int, timeout: float | None = None) -> int:
        """Wait until node ``i`` has registered (DeployError after ``timeout``; None: the
        implementation's registration wait)."""

    def client_of_node(self) -> dict[int, int]:
        """Flower node id -> client, for every incarnation seen so far."""

    def unreachable(self) -> dict[int, str]:
        """Client -> why it cannot be reached now or could not since the last call (its host did
        not answer: ``"host h unreachable: ..."``); empty where every node is on this machine."""


@runtime_checkable
class BootsAhead(Protocol):
    """Nodes whose process can start ahead of their round without connecting (:mod:`deploy.boot`)."""

    def boot_node(self, i: int) -> None:
        """Start node ``i``'s process now, unconnected (a no-op while it runs or is booted); the
        next ``start_node(i)`` connects it at once."""


@runtime_checkable
class Site(Nodes, Protocol):
    """Nodes plus the SuperLink they talk to: what one run needs (:func:`deploy.run.run_deployment`)."""

    @property
    def cli(self) -> FlwrCli | None:
        """The flwr CLI connected to the SuperLink (None until one serves)."""
    project: Path  # the Flower app that is submitted
    local_files: bool  # the ServerApp sees this machine's files (the round-start signal folder)

    def ensure_superlink(self, fresh: bool) -> None:
        """Make sure a SuperLink serves; ``fresh``: a new one and no node running (a resumed run)."""

    def superlink_alive(self) -> bool:
        """False once the SuperLink is known to have died (the run cannot finish)."""

    def housekeeping(self) -> None:
        """Called every few seconds while a run is followed (reap exited helpers, ...)."""
