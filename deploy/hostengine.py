"""What the multi-host driver (:mod:`deploy.multihost`) needs of one host's engine:
:class:`HostEngine`, the same operations as :class:`deploy.nodes.Nodes` for the clients that one
host holds, acted through that host's own engine (its Docker Engine API, or processes this
machine starts in the host's network namespace), never through a protocol of ours.

Everything that tells time about a node comes from its engine (``started_at``: the engine's own
clock, e.g. a container's ``State.StartedAt``); the driver never compares its clock with a host's.
:class:`NodeLaunch` is what any engine needs to start client ``i``'s SuperNode: the SuperLink's
address, its CA certificate, the node's private key (authentication: the node id comes from the
key) and its node config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .hosts import HostSpec


class HostUnreachable(Exception):
    """The host's engine did not answer (its link is down, the host is off): a named cause."""

    def __init__(self, host: str, why: str) -> None:
        super().__init__(f"host {host} unreachable: {why}")
        self.host = host
        self.why = why


@dataclass(frozen=True)
class NodeLaunch:
    """How client ``client``'s SuperNode starts, whatever runs it."""

    client: int
    name: str  # container / process name: flchurn-<deployment tag>-<host>-node-<client>
    superlink: str  # ADDRESS:PORT the SuperNode dials (the SuperLink's Fleet API)
    ca_cert: bytes  # PEM: the CA the SuperLink's certificate is signed by (--root-certificates)
    private_key: bytes  # OpenSSH PEM: its SuperNode key (--auth-supernode-private-key)
    node_config: Mapping[str, Any]  # partition-id, num-partitions, data-dir, ...
    runtime_port: int = 9094  # its ClientAppIo API (--port), bound on 0.0.0.0 (--host) for probes
    env: Mapping[str, str] = field(default_factory=dict)


class HostEngine(Protocol):
    """One host's engine for its clients' SuperNodes. Every call may raise
    :class:`HostUnreachable`; no call waits longer than its ``timeout``."""

    host: HostSpec

    def reachable(self, timeout: float = 2.0) -> str | None:
        """None when the engine answers within ``timeout``, else why not (one line)."""

    def start(self, launch: NodeLaunch) -> None:
        """Create (first time, or when ``launch`` changed) and start client ``launch.client``'s
        SuperNode; returns once the engine has started it (not once it registered)."""

    def signal(self, client: int, sig: int) -> None:
        """Send ``sig`` to the SuperNode's main process; returns at once."""

    def stop(self, client: int, grace: float) -> int | None:
        """SIGTERM, SIGKILL after ``grace`` s; returns once it exited, with its exit code (None
        if it was not running)."""

    def kill(self, client: int) -> int | None:
        """SIGKILL (a crash); returns once it exited, with its exit code."""

    def running(self) -> set[int]:
        """The clients whose SuperNode runs on this host now."""

    def state(self, client: int) -> str:
        """The engine's word for the node: ``running``, ``exited``, ``created`` or ``absent``."""

    def started_at(self, client: int) -> str | None:
        """When the current incarnation started, on the engine's own clock (ISO 8601)."""

    def logs(self, client: int) -> str:
        """The current incarnation's output."""

    def close(self) -> None:
        """Remove every container / process this engine made (idempotent)."""
