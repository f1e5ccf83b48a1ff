"""A host whose SuperNodes are processes this machine starts (:class:`ProcessEngine`, a
:class:`deploy.hostengine.HostEngine`): in the host's own network namespace (``netns``: the test
hosts of ``tests/multihost_hosts.py``, each with its own address on a bridge), or in this
machine's network. The same SuperNode command as a container's (TLS, the node's key, its
runtime API on ``0.0.0.0`` so the driver can probe the host), started through
:class:`deploy.procs.Spawner` (tagged, parent-death signal, nothing left at close).

Reachability: the driver opens a TCP connection to a running node's runtime API at the host's
address, from this machine's own network, as it would reach any remote host; a host whose
link is down does not answer.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

from .flwr_cli import toml_value
from .hostengine import NodeLaunch
from .hosts import HostSpec
from .procs import PortReservation, Proc, Spawner
from .tuning import SUPERNODE as TUNING_SUPERNODE

NETNS_DIR = Path("/run/netns")


def supernode_argv(launch: NodeLaunch, ca: str, key: str, port: int) -> list[str]:
    """The SuperNode command of a deployment across hosts (as the containers run it)."""
    config = " ".join(f"{k}={toml_value(v)}" for k, v in launch.node_config.items())
    return [*TUNING_SUPERNODE, "--root-certificates", ca, "--superlink", launch.superlink,
            "--auth-supernode-private-key", key, "--host", "0.0.0.0", "--port", str(port), "--node-config", config]


class ProcessEngine:
    """SuperNode processes for one host's clients, in its network namespace if it has one."""

    def __init__(self, host: HostSpec, spawner: Spawner, work_dir: Path,
                 log: Callable[[str], None] | None = None) -> None:
        self.host = host
        self.spawner = spawner
        self.work_dir = Path(work_dir) / "hosts" / host.name  # this host's disk: keys, FLWR_HOMEs
        self.log = log or (lambda line: None)
        self.procs: dict[int, Proc] = {}
        self.ports: dict[int, int] = {}
        self.reservations: dict[int, PortReservation] = {}
        self.started: dict[int, str] = {}
        self.closed = False

    # ------------------------------------------------------------------ HostEngine
    def reachable(self, timeout: float = 2.0) -> str | None:
        if self.host.netns and not (NETNS_DIR / self.host.netns).exists():
            return f"its network namespace {self.host.netns} is gone"
        address = self.host.address or "127.0.0.1"
        ports = [self.ports[i] for i in sorted(self.running()) if i in self.ports]
        if not ports:
            return None  # nothing runs there to answer: nothing of the run depends on it now
        why = ""
        for port in ports[:2]:
            try:
                with socket.create_connection((address, port), timeout=timeout):
                    return None
            except ConnectionRefusedError:
                return None  # the host answered (a node still starting has not bound its port yet)
            except OSError as err:
                why = f"no answer from {address}:{port} (a SuperNode's runtime API) within {timeout:g} s ({err})"
        return why

    def start(self, launch: NodeLaunch) -> None:
        i = launch.client
        if i in self.running():
            return
        home = self.work_dir / f"node-{i}"
        home.mkdir(parents=True, exist_ok=True)
        ca, key = home / "ca.crt", home / "node.key"
        ca.write_bytes(launch.ca_cert)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(launch.private_key)
        if self.host.netns:
            port = launch.runtime_port  # the namespace's own port space
        else:  # this machine's: a port nobody else holds
            self.reservations[i] = PortReservation.replacing(self.reservations.get(i))
            port = self.reservations[i].port
        self.ports[i] = port
        preexec = None
        if self.host.netns:
            from .edge.netns import enter_namespace

            ns = self.host.netns

            def preexec() -> None:
                enter_namespace(ns)
        n = sum(1 for p in self.spawner.spawned if p.name.startswith(f"{launch.name}."))
        self.procs[i] = self.spawner.spawn(f"{launch.name}.{n + 1}", supernode_argv(launch, str(ca), str(key), port),
                                           home, {"FLWR_HOME": str(home / "flwr"), **launch.env}, preexec)
        self.started[i] = dt.datetime.now(dt.UTC).isoformat()

    def signal(self, client: int, sig: int) -> None:
        proc = self.procs.get(client)
        if proc is not None and proc.alive:
            proc.popen.send_signal(sig)

    def stop(self, client: int, grace: float) -> int | None:
        proc = self.procs.get(client)
        if proc is None or not proc.alive:
            return proc.popen.returncode if proc is not None else None
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.log(f"host {self.host.name}: node {client} did not exit {grace:.0f} s after SIGTERM; killing it")
        return self._finish(client, proc)

    def kill(self, client: int) -> int | None:
        proc = self.procs.get(client)
        if proc is None:
            return None
        return self._finish(client, proc)

    def _finish(self, client: int, proc: Proc) -> int | None:
        code = proc.popen.poll()
        proc.kill_tree()  # its ClientApp and worker too
        if client in self.reservations and not self.host.netns:
            self.reservations.pop(client).release()
        return code if code is not None else proc.popen.returncode

    def running(self) -> set[int]:
        return {i for i, p in self.procs.items() if p.alive}

    def state(self, client: int) -> str:
        proc = self.procs.get(client)
        return "absent" if proc is None else "running" if proc.alive else "exited"

    def started_at(self, client: int) -> str | None:
        return self.started.get(client)

    def logs(self, client: int) -> str:
        proc = self.procs.get(client)
        try:
            return proc.output() if proc is not None else ""
        except OSError:
            return ""

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for i, proc in self.procs.items():
            if proc.alive:
                self._finish(i, proc)
        for r in self.reservations.values():
            r.release()
