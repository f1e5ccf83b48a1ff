"""SuperNodes as Docker containers (:class:`DockerNodes`, a :class:`deploy.nodes.Nodes`) and the
compose stack's SuperLink as seen from its ``churn`` service (:class:`ComposeSite`, a
:class:`deploy.nodes.Site`): the same churn driver and the same :func:`deploy.run.run_deployment`
as the processes of :mod:`deploy.local`, over the Docker Engine API on a unix socket
(:class:`deploy.dockerapi.DockerAPI`, the project's one Docker API client)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path

from .dockerapi import DockerAPI
from .errors import DeployError
from .flwr_cli import FlwrCli
from .nodes import NODE_ID_RE
from .waits import Waits, host_slowdown


class DockerNodes:
    """SuperNode containers ``flchurn-supernode-{i}`` driven through the Docker Engine API.

    Talks to the Docker Engine API on a unix socket (``/var/run/docker.sock`` mounted into the
    churn service; no docker CLI needed). ``stop_node(i, "term")`` = ``docker stop`` (SIGTERM to
    the SuperNode, PID 1 under ``init: true``), ``"kill"`` = ``docker kill`` (SIGKILL);
    ``start_node`` = ``docker start``. Registration is read from the container's log since its
    last start ("SuperNode ID: ...").
    """

    def __init__(self, num_nodes: int, container: str = "flchurn-supernode-{i}",
                 socket_path: str = "/var/run/docker.sock", log: Callable[[str], None] | None = None) -> None:
        self.num_nodes = num_nodes
        self.container = container
        self.socket_path = socket_path
        self.request_timeout = 30.0 * host_slowdown()  # a Docker Engine call on this (loaded) host
        self.api = DockerAPI(f"unix://{socket_path}", timeout=self.request_timeout)
        self.log = log or print
        self.node_ids: dict[int, list[int]] = {i: [] for i in range(num_nodes)}
        self.incarnations = dict.fromkeys(range(num_nodes), 0)
        self.since = dict.fromkeys(range(num_nodes), 0)  # log lines from this time on are the incarnation's
        self.term_sent: set[int] = set()  # nodes sent SIGTERM by signal_node, not yet stopped

    def _api(self, method: str, path: str, timeout: float | None = None) -> tuple[int, bytes]:
        return self.api.request(method, path, timeout=self.request_timeout if timeout is None else timeout)

    def _name(self, i: int) -> str:
        return self.container.format(i=i)

    def _running(self, i: int) -> bool:
        status, body = self._api("GET", f"/containers/{self._name(i)}/json")
        return status == 200 and bool(json.loads(body)["State"]["Running"])

    def running_nodes(self) -> set[int]:
        return {i for i in range(self.num_nodes) if self._running(i)}

    def incarnation(self, i: int) -> int:
        return self.incarnations[i]

    def start_node(self, i: int) -> None:
        if self._running(i):
            return
        self.since[i] = int(time.time()) - 1
        status, body = self._api("POST", f"/containers/{self._name(i)}/start")
        if status not in (204, 304):
            raise DeployError(f"docker start {self._name(i)}: {status} {body[:200]!r}")
        self.incarnations[i] += 1
        self.term_sent.discard(i)
        self.log(f"node {i}: started ({self._name(i)})")

    def signal_node(self, i: int, sig: int = signal.SIGTERM) -> None:
        self.registered_id(i)
        name = signal.Signals(sig).name
        status, body = self._api("POST", f"/containers/{self._name(i)}/kill?signal={name}")
        if status not in (204, 304, 409):
            raise DeployError(f"docker kill --signal {name} {self._name(i)}: {status} {body[:200]!r}")
        if sig == signal.SIGTERM:
            self.term_sent.add(i)

    def _stop_grace(self, i: int) -> float:
        """The container's own stop grace (compose's ``stop_grace_period``; Docker's default 10 s)
        times the host's slowdown (``deploy.waits.host_slowdown``): at load 26 on 2 cores a node's
        graceful exit took over 10 s and ``docker stop`` SIGKILLed it (exit 137)."""
        status, body = self._api("GET", f"/containers/{self._name(i)}/json")
        grace = json.loads(body)["Config"].get("StopTimeout") if status == 200 else None
        return (float(grace) if grace is not None else 10.0) * host_slowdown()

    def stop_node(self, i: int, mode: str = "term", timeout: float | None = None) -> None:
        """``term``: ``docker stop``, SIGKILL after ``timeout`` s or, by default, after the
        container's own stop grace (``stop_grace_period``: compose-devices lengthens it for a
        CPU-capped node, whose graceful exit is as slow as its CPU); ``kill``: ``docker kill``."""
        self.registered_id(i)
        if mode == "term" and i in self.term_sent:
            # SIGTERM already went (signal_node, all leaving nodes at once): a second one would land
            # after Flower has put the default handler back, and kill the node mid-exit (exit 143).
            # Wait for the exit, SIGKILL only after the grace, as docker stop would.
            deadline = time.monotonic() + (timeout if timeout is not None else self._stop_grace(i))
            while self._running(i) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.term_sent.discard(i)
            if not self._running(i):
                self.log(f"node {i}: stopped (term)")
                return
            mode = "kill"
        self.term_sent.discard(i)
        grace = timeout if timeout is not None else self._stop_grace(i) if mode == "term" else 0.0
        path = (f"/containers/{self._name(i)}/stop?t={int(grace)}" if mode == "term"
                else f"/containers/{self._name(i)}/kill?signal=SIGKILL")
        status, body = self._api("POST", path, timeout=grace + 2 * self.request_timeout)
        if status not in (204, 304, 409):
            raise DeployError(f"docker {mode} {self._name(i)}: {status} {body[:200]!r}")
        self.log(f"node {i}: stopped ({mode})")

    def registered_id(self, i: int) -> int | None:
        status, body = self._api("GET", f"/containers/{self._name(i)}/logs?stdout=1&stderr=1&since={self.since[i]}")
        ids = NODE_ID_RE.findall(body.decode(errors="replace")) if status == 200 else []
        if not ids:
            return None
        nid = int(ids[-1])
        if not self.node_ids[i] or self.node_ids[i][-1] != nid:
            self.node_ids[i].append(nid)
        return nid

    def wait_registered(self, i: int, timeout: float | None = None) -> int:
        """Node ``i``'s id once registered; by default waits 90 s scaled to the host's load (a
        container starts slower than a process: deploy.waits)."""
        if timeout is None:
            timeout = Waits(register=90.0).scaled(host_slowdown()).register
        deadline = time.monotonic() + timeout
        while (nid := self.registered_id(i)) is None:
            if time.monotonic() > deadline:
                raise DeployError(f"{self._name(i)} did not register within {timeout:.0f} s")
            time.sleep(0.5)
        return nid

    def client_of_node(self) -> dict[int, int]:
        return {nid: i for i, ids in self.node_ids.items() for nid in ids}

    def unreachable(self) -> dict[int, str]:
        return {}  # one engine, which this driver reaches over its socket


class ComposeSite(DockerNodes):
    """The compose stack from its ``churn`` service: node containers, and the ``superlink``
    service reached by the flwr CLI (``address``; TLS with ``root_certificates``). The SuperLink
    is the stack's, not ours: it is neither started nor restarted here (no resume). The ServerApp
    runs in the superlink container: no round-start signal (rounds start after the fixed grace)."""

    local_files = False

    def __init__(self, num_nodes: int, *, address: str, cli_home: str | Path, project: str | Path,
                 root_certificates: str | None = None, **nodes_kwargs) -> None:
        super().__init__(num_nodes, **nodes_kwargs)
        self.project = Path(project)
        self.cli = FlwrCli(cli_home, address, root_certificates=root_certificates or None, log=self.log)

    def ensure_superlink(self, fresh: bool) -> None:
        if fresh:
            raise DeployError("the compose driver cannot resume a run: the SuperLink is the stack's "
                              "(resume with python -m deploy launch --resume-from)")

    def superlink_alive(self) -> bool:
        return True  # the stack's: a dead one shows as a run that never finishes (timeout)

    def housekeeping(self) -> None:
        pass
