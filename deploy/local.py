"""A real Flower deployment on loopback, as processes: one SuperLink and N SuperNodes
(:class:`ProcessSite`, a :class:`deploy.nodes.Site`).

- ``flower-superlink --insecure`` (``deploy.tuning.SUPERLINK``) on a reserved 127.0.0.1 port (a
  ``deploy.procs.PortReservation``), its own ``FLWR_HOME`` and cwd, no dependency install, no telemetry;
- N SuperNodes (``deploy.tuning.SUPERNODE``) ``--insecure --superlink 127.0.0.1:PORT --port P_i`` (a
  reserved port) ``--node-config "partition-id=i num-partitions=N state-dir=... [data-dir=...]"``, each
  with its own ``FLWR_HOME``; a node can be stopped (SIGTERM) or crashed (SIGKILL of its process tree),
  booted ahead of its round (:mod:`deploy.boot`) and started again, which gives it a new Flower node id;
- a ``flwr`` CLI (:class:`deploy.flwr_cli.FlwrCli`) connected to the SuperLink.

Every wait comes from :mod:`deploy.waits` (scaled to the host, settable, named when it runs out);
401s to ClientApps (lost replies) are named from the logs as they happen (:mod:`deploy.auth`).
No process outlives the deployment (:mod:`deploy.procs`): :meth:`ProcessSite.close` (context-manager
exit, ``atexit``, the CLI's SIGINT/SIGTERM handlers) kills every process it started and reaps the
helpers; it removes a temp work dir (``/tmp/flchurn-deploy-*``) unless ``keep_workdir``. Everything is
single-threaded: the churn driver is stepped from the caller's loop, so a parent-death signal can
never fire because a helper thread ended.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from client_app.timing import SWITCH as TIMING  # clients time their training (client_app/timing.py)
from runconfig.defaults import ROOT, default_run_config

from .auth import new_auth_failures
from .boot import BOOTED_VAR, RELEASE, blocking_release
from .errors import DeployError
from .flwr_cli import FLOWER_ENV, FlwrCli, toml_value
from .localnode import Node
from .nodes import MODES, NODE_ID_RE
from .procs import PortReservation, Proc, SiteLifetime, Spawner, hold_signals, port_open, release_signals
from .tuning import (  # round-latency settings: env, node config, the SuperNode and SuperLink commands
    ENV as TUNING_ENV,
    NODE_CONFIG as TUNING_NODE_CONFIG,
    SUPERLINK as TUNING_SUPERLINK,
    SUPERNODE as TUNING_SUPERNODE,
    compute_threads_env,
    host_share,
)
from .waits import Waits, for_host, slowest_cap, wait_for
from .warmstart import WARM_VAR, share_installed_app  # returning nodes' workers started warm

if TYPE_CHECKING:  # edge emulation is imported only when a site has device classes
    from .edge.devices import DevicePlan
    from .edge.limits import EdgeLimits

BASE_ENV = {**TUNING_ENV, **FLOWER_ENV}


class ProcessSite(SiteLifetime):
    """SuperLink + N SuperNodes on loopback. Use as a context manager; always closes."""

    local_files = True  # the ServerApp runs here: it sees the churn driver's round-start signal

    def __init__(
        self,
        num_nodes: int,
        work_dir: str | Path | None = None,
        *,
        project: str | Path = ROOT,
        data_dir: str | Path | None = None,
        node_env: Mapping[int, Mapping[str, str]] | None = None,
        node_config_extra: Mapping[int, Mapping[str, Any]] | None = None,
        log: Callable[[str], None] | None = None,
        keep_workdir: bool = False,
        devices: DevicePlan | None = None,
        server_env: Mapping[str, str] | None = None,
        waits: Waits | None = None,
        warm_workers: bool = True,
    ) -> None:
        if num_nodes < 1:
            raise DeployError("num_nodes must be >= 1")
        self.num_nodes = num_nodes
        # the nodes share this host: its CPUs split among them (torch's default spins: tuning.host_share)
        self.threads_env = compute_threads_env(host_share(num_nodes))
        # a temp work dir we made is removed by close() unless keep_workdir; a given one is kept
        self.remove_workdir = work_dir is None and not keep_workdir
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="flchurn-deploy-")).resolve()
        self.project = Path(project).resolve()
        self.data_dir = Path(data_dir).resolve() if data_dir else None
        self.node_env = {int(k): dict(v) for k, v in (node_env or {}).items()}
        self.server_env = dict(server_env or {})  # the SuperLink's, so its ServerApps' (deploy.app)
        self.node_config_extra = {int(k): dict(v) for k, v in (node_config_extra or {}).items()}
        self.log = log or (lambda line: None)
        # how long each wait lasts: scaled to this host now (and the slowest device's CPU cap)
        self.waits = waits or for_host(slowest_cap(dc.cpus for dc in devices.classes) if devices else 1.0)
        self.tag = uuid.uuid4().hex
        self.superlink_reservation: PortReservation | None = None
        self.auth_seen: dict[str, int] = {}  # node log -> 401 lines already reported
        self.warm = warm_workers  # returning nodes start their client worker at once (warm_workers)
        self.warm_env: dict[str, str] = {}  # set by warm_workers
        self.superlink: Proc | None = None
        self.superlink_port = 0
        self.nodes = {i: Node(i, 0) for i in range(num_nodes)}
        self.cli_home = self.work_dir / "cli"
        self.state_dir = self.work_dir / "state"
        self.logs = self.work_dir / "logs"
        for d in (self.cli_home, self.state_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        if devices is not None and devices.num_nodes != num_nodes:
            raise DeployError(f"the device plan is for {devices.num_nodes} nodes, not {num_nodes}")
        self.edge: EdgeLimits | None = None  # device limits (root): made with the SuperLink, removed by close()
        if devices is not None:
            from .edge.limits import EdgeLimits

            self.edge = EdgeLimits(devices, self.tag, self.log)
        self.spawner = Spawner(self.tag, self.logs, {**BASE_ENV, **self.waits.env()})
        self.cli: FlwrCli | None = None  # once the SuperLink listens
        self.close_at_exit()

    @property
    def closed(self) -> bool:
        return self.spawner.closed

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, argv: list[str], flwr_home: Path, cwd: Path,
               extra_env: Mapping[str, str] | None = None, preexec: Callable[[], None] | None = None) -> Proc:
        flwr_home.mkdir(parents=True, exist_ok=True)
        return self.spawner.spawn(name, argv, cwd, {"FLWR_HOME": str(flwr_home), **(extra_env or {})}, preexec)

    def start_superlink(self, timeout: float | None = None) -> None:
        """Start the SuperLink on a reserved port; wait until it listens (``timeout``, default
        the site's ``waits.superlink``); then the ``flwr`` CLI that talks to it."""
        host = self._edge_setup()
        self.superlink_reservation = PortReservation.replacing(self.superlink_reservation)
        self.superlink_port = self.superlink_reservation.port
        home = self.work_dir / "superlink"
        self.superlink = self._spawn(
            "superlink",
            [*TUNING_SUPERLINK, "--insecure", "--disable-runtime-dependency-installation",
             "--host", host, "--port", str(self.superlink_port)],
            home, home, self.server_env,
        )
        superlink = self.superlink
        wait_for(lambda: True if port_open(self.superlink_port) else None,
                 self.waits.superlink if timeout is None else timeout,
                 what=f"flower-superlink listens on 127.0.0.1:{self.superlink_port}", flag="--superlink-timeout",
                 see=superlink.log, log=self.log,
                 gone=lambda: None if superlink.alive else f"flower-superlink exited ({superlink.popen.returncode})")
        self._edge_relays()
        # the CLI carries the deployment's tag (close() sweeps a stray one), not a node's
        self.cli = FlwrCli(self.cli_home, f"127.0.0.1:{self.superlink_port}", env=self.spawner.env(None),
                           cwd=self.work_dir, log=self.log, waits=self.waits)
        self.log(f"SuperLink on 127.0.0.1:{self.superlink_port} (log {self.superlink.log})")

    def node_config(self, i: int) -> str:
        cfg: dict[str, Any] = {**TUNING_NODE_CONFIG, TIMING: True, "partition-id": i,
                               "num-partitions": self.num_nodes, "state-dir": str(self.state_dir)}
        if self.data_dir:
            cfg["data-dir"] = str(self.data_dir)
        cfg.update(self.node_config_extra.get(i, {}))
        return " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items())

    def start_node(self, i: int) -> Node:
        """Start SuperNode ``i`` (no-op if running; a booted one is released, :mod:`deploy.boot`) on
        a port it holds while it runs, with its ``partition-id`` in its node config; returns at once
        (:meth:`wait_registered`)."""
        node = self.nodes[i]
        if node.running:
            return node
        booted, node.booted = node.booted, None
        if booted is not None and booted.alive:  # released: its worker starts then if it could not at boot
            self._share_app(i)
            node.proc = booted
            booted.popen.send_signal(RELEASE)
        else:
            node.proc = self._spawn_node(i, booted=False)
        self.log(f"node {i}: started (incarnation {node.incarnations}, pid {node.proc.popen.pid}"
                 f"{', booted ahead' if node.proc is booted else ''})")
        return node

    def boot_node(self, i: int) -> None:
        """Start node ``i``'s process ahead of its round, unconnected until :meth:`start_node`."""
        node = self.nodes[i]
        if not node.running and (node.booted is None or not node.booted.alive):
            node.booted = self._spawn_node(i, booted=True)
            self.log(f"node {i}: booted (incarnation {node.incarnations}, pid {node.booted.popen.pid})")

    def _share_app(self, i: int) -> Path:
        """Node ``i``'s home, given the SuperLink's app if it has none and starts warm (share_installed_app)."""
        home = self.work_dir / f"node-{i}"
        if self.warm_env:
            share_installed_app(home, self.work_dir / "superlink")
        return home

    def _spawn_node(self, i: int, booted: bool) -> Proc:
        if self.superlink is None:
            raise DeployError("start the SuperLink first")
        node = self.nodes[i]
        node.incarnations += 1
        node.reserve_port()
        home = self._share_app(i)
        link, env, preexec = self._node_limits(i)
        env = {**env, **self.warm_env, **self.node_env.get(i, {}), **({BOOTED_VAR: "1"} if booted else {})}
        return self._spawn(
            f"node-{i}.{node.incarnations}",
            [*TUNING_SUPERNODE, "--insecure", "--superlink", link,
             "--host", "127.0.0.1", "--port", str(node.port), "--node-config", self.node_config(i)],
            home, home, env, blocking_release(preexec) if booted else preexec)

    # ------------------------------------------------------------------ edge emulation (opt-in: devices)
    def _edge_setup(self) -> str:
        """The device limits in place (before any process: all, or none and an error); the host
        the SuperLink listens on (nodes in their own network namespace come through a veth pair)."""
        if self.edge is not None and not self.edge.cgroups:
            self.edge.setup()
        return "0.0.0.0" if self.edge is not None and self.edge.shaped else "127.0.0.1"

    def _edge_relays(self) -> None:
        if self.edge is not None:  # nodes with rtt_ms/loss and no netem: their relays, to this port
            self.edge.start_relays(lambda name, argv: self.spawner.spawn(name, argv, self.work_dir),
                                   self.superlink_port)

    def _node_limits(self, i: int) -> tuple[str, dict[str, str], Callable[[], None] | None]:
        """Node ``i``'s SuperLink address, environment (its threads) and first step (its limits)."""
        if self.edge is None:
            return f"127.0.0.1:{self.superlink_port}", self.threads_env, None
        return self.edge.superlink_address(i, self.superlink_port), self.edge.env(i), self.edge.preexec(i)

    def warm_workers(self, run_config: Mapping[str, Any]) -> None:
        """With ``warm_workers``: from now on a node (re)started into the run of ``run_config`` starts
        its client worker at once, the run's workload built (``deploy.warmstart.start_warm_worker``)."""
        if not self.warm:
            return
        cfg = {**default_run_config(self.project), **run_config}
        if self.data_dir:
            cfg["data-dir"] = str(self.data_dir)
        path = self.work_dir / "warm-run-config.json"
        path.write_text(json.dumps(cfg))
        self.warm_env = {WARM_VAR: str(path)}

    def incarnation(self, i: int) -> int:
        return self.nodes[i].incarnations

    def registered_id(self, i: int) -> int | None:
        """The Flower node id of node ``i``'s current incarnation, once it has registered."""
        node = self.nodes[i]
        if node.proc is None:
            return None
        try:
            text = node.proc.output()  # a relaunch (--resume-from, same --work-dir) appends to the same log
        except OSError:
            return None
        m = NODE_ID_RE.search(text)
        if m is None:
            return None
        nid = int(m.group(1))
        if len(node.node_ids) < node.incarnations:
            node.node_ids.append(nid)
        return nid

    def wait_registered(self, i: int, timeout: float | None = None) -> int:
        """Node ``i``'s Flower node id once it has registered; waits at most ``timeout`` (default
        the site's ``waits.register``), with a progress line every 10 s."""
        timeout = self.waits.register if timeout is None else timeout
        node = self.nodes[i]
        return wait_for(lambda: self.registered_id(i), timeout, what=f"SuperNode {i} registers",
                        flag="--register-timeout", see=node.proc.log if node.proc is not None else self.logs,
                        log=self.log, gone=lambda: None if node.running else f"SuperNode {i} exited before registering")

    def auth_failures(self) -> dict[str, int]:
        """Process -> its tasks' calls answered 401 since the last call (:mod:`deploy.auth`):
        ``node i`` (its ClientApps, each a lost reply) or ``SuperLink`` (its ServerApp)."""
        logs = [("SuperLink", self.logs / "superlink.log")]
        logs += [(f"node {i}", path) for i in self.nodes for path in sorted(self.logs.glob(f"node-{i}.*.log"))]
        return new_auth_failures(logs, self.auth_seen)

    def client_of_node(self) -> dict[int, int]:
        for i in self.nodes:
            self.registered_id(i)  # record the current incarnation's node id
        return {nid: i for i, node in self.nodes.items() for nid in node.node_ids}

    def unreachable(self) -> dict[int, str]:
        return {}  # one host: a node is reached or down, never cut off

    def stop_node(self, i: int, mode: str = "term", timeout: float | None = None) -> None:
        """``term``: SIGTERM to the SuperNode (it deactivates; the SuperLink answers its pending
        messages with NODE_UNAVAILABLE), then the rest of its tree after at most ``timeout`` s
        (default 10 s x the host's slowdown: a loaded host's graceful stop is not made a crash);
        ``kill``: SIGKILL the tree (a crash: the SuperLink notices only when the heartbeat expires)."""
        timeout = 10.0 * self.waits.host if timeout is None else timeout
        node = self.nodes[i]
        if node.proc is None:
            return
        if mode not in MODES:
            raise ValueError(f"mode must be 'term' or 'kill', not {mode!r}")
        self.registered_id(i)  # remember its id before it goes
        if mode == "term" and node.proc.alive:
            try:
                if not node.proc.term_sent:
                    self.signal_node(i, signal.SIGTERM)
                node.proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.log(f"node {i}: no exit {timeout:.0f} s after SIGTERM; killing it")
        node.proc.kill_tree()
        if node.reservation is not None:
            node.reservation.release()
            node.reservation = None
        self.log(f"node {i}: stopped ({mode})")

    def signal_node(self, i: int, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to SuperNode ``i`` and return at once (:meth:`stop_node` then finishes it):
        lets several nodes shut down at the same time."""
        proc = self.nodes[i].proc
        if proc is not None and proc.alive:
            self.registered_id(i)  # remember its id before it goes
            proc.popen.send_signal(sig)
            proc.term_sent |= sig == signal.SIGTERM

    def running_nodes(self) -> set[int]:
        return {i for i, n in self.nodes.items() if n.running}

    # ------------------------------------------------------------------ the SuperLink
    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink and everything under it (its SuperExec and the ServerApp): a crash."""
        if self.superlink is not None:
            self.superlink.kill_tree()
            self.log("SuperLink killed (with its ServerApp)")

    def restart(self) -> None:
        """A fresh SuperLink (new port, empty state) and no SuperNode running: what a resumed run
        starts from. The nodes are started again by the caller (the churn driver or run_deployment)."""
        for i, node in self.nodes.items():
            self.stop_node(i, "kill")
            if node.booted is not None:  # booted for the old SuperLink's port
                node.booted.kill_tree()
                node.booted = None
        self.kill_superlink()
        self.reap_orphans()
        self.start_superlink()

    def superlink_alive(self) -> bool:
        return self.superlink is not None and self.superlink.alive

    def ensure_superlink(self, fresh: bool) -> None:
        if not self.superlink_alive() or (fresh and self.running_nodes()):
            self.restart()

    def reap_orphans(self) -> None:
        self.spawner.reap_orphans()

    housekeeping = reap_orphans

    def run_log(self, run_id: int) -> str:
        if self.cli is None:
            raise DeployError("no SuperLink was started")
        return self.cli.run_log(run_id)

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop every process of this deployment (idempotent, safe from atexit and handlers)."""
        if self.closed:
            return
        held = hold_signals()  # a second Ctrl-C or kill waits until everything is removed
        try:
            if self.cli is not None:
                self.cli.close()
            procs = [p for n in self.nodes.values() for p in (n.proc, n.booted) if p is not None]
            procs += [self.superlink] if self.superlink is not None else []
            if self.edge is not None:
                procs += self.edge.relay_procs()
            self.spawner.close(procs)
            for reservation in [self.superlink_reservation, *(n.reservation for n in self.nodes.values())]:
                if reservation is not None:
                    reservation.release()
            if self.edge is not None:
                self.edge.close()  # the processes are gone: cgroups can be removed
        finally:
            release_signals(held)
        if self.remove_workdir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.log(f"deployment stopped; work dir {self.work_dir} removed (keep it with --keep-workdir)")
        else:
            self.log(f"deployment stopped; logs in {self.logs}")

    def leftovers(self) -> list[int]:
        return self.spawner.leftovers()
