"""A deployment across hosts (:class:`MultiHostSite`, a :class:`deploy.nodes.Site`): the SuperLink,
the ServerApp and the churn driver on this machine; each client's SuperNode on the host the hosts
file (:mod:`deploy.hosts`) names, started and stopped through that host's own engine
(:class:`deploy.hostengine.HostEngine`: its Docker engine, :mod:`deploy.dockerengine`, or
processes in its network namespace, :mod:`deploy.processengine`).

- **Identities are keys.** TLS and SuperNode authentication are always on: one key per client
  (:mod:`deploy.identity`), every public key registered at the SuperLink before round 1, so the
  SuperLink gives a node its id from its key: the same id across restarts and hosts, and nobody
  without the key gets one. A node counts as registered when the SuperLink itself lists its id
  ``online`` with an activation newer than the one it had when the driver started it (the
  Control API, read in this process about every half second: :func:`flowerlink.control_client`),
  never from a log line.
- **Switches go to every host at once.** Each host has its own worker thread; a start returns at
  once and a round's stops are signalled together, so a round pays the slowest host, not the sum.
  The time of every engine operation is kept per host (:attr:`MultiHostSite.switch_seconds`).
- **An unreachable host is a named cause** (:mod:`deploy.hostprobe`): its clients' misses in the
  rounds it is away are explained by the host, not counted as departures from the schedule; a
  node that exited meanwhile is started again by the driver's next round (:meth:`running_nodes`).
- **No clock but the engines'.** Start times come from each engine (``started_at``); the driver's
  own clock only orders its own actions.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from client_app.timing import SWITCH as TIMING
from flowerlink import control_client
from runconfig.defaults import ROOT

from .auth import new_auth_failures
from .errors import DeployError
from .flwr_cli import FLOWER_ENV, FlwrCli
from .hostengine import HostEngine, HostUnreachable, NodeLaunch
from .hostprobe import HostProbes
from .hosts import HostSpec, HostsPlan
from .identity import Identities, load_identities, make_identities
from .nodes import MODES
from .procs import Proc, SiteLifetime, Spawner, free_port, hold_signals, port_open, release_signals
from .tuning import ENV as TUNING_ENV, NODE_CONFIG as TUNING_NODE_CONFIG, SUPERLINK as TUNING_SUPERLINK
from .waits import Waits, for_host, wait_for

RUNTIME_PORT = 9094  # a node's runtime API in its own host's port space (+ its index on the host)
POLL = 0.5  # seconds between two reads of the SuperLink's node list


def make_engine(host: HostSpec, spawner: Spawner, work_dir: Path, tag: str, log: Callable[[str], None]) -> HostEngine:
    """The engine the host's ``engine`` key names."""
    if host.engine == "process":
        from .processengine import ProcessEngine

        return ProcessEngine(host, spawner, work_dir, log)
    if host.engine == "docker":
        from .dockerengine import DockerEngine

        return DockerEngine(host, tag, log)
    if host.engine == "kubernetes":
        from .k8sengine import KubernetesEngine, load_api_client

        return KubernetesEngine(host, host.namespace, api_client=load_api_client(host.kubeconfig, host.context))
    raise DeployError(f"host {host.name}: no engine {host.engine!r}")


class MultiHostSite(SiteLifetime):
    """SuperLink here, SuperNodes on the hosts of ``plan``. Always closes (context manager, atexit)."""

    local_files = True  # the ServerApp runs on this machine: it sees the round-start signal folder

    def __init__(self, plan: HostsPlan, work_dir: str | Path | None = None, *, project: str | Path = ROOT,
                 certs: str | Path | None = None, data_dir: str | None = None, keep_workdir: bool = False,
                 waits: Waits | None = None, log: Callable[[str], None] | None = None,
                 engines: Mapping[str, HostEngine] | None = None) -> None:
        self.plan = plan
        self.num_nodes = plan.num_clients
        self.remove_workdir = work_dir is None and not keep_workdir
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="flchurn-hosts-")).resolve()
        self.project = Path(project).resolve()
        self.certs_dir = Path(certs).resolve() if certs else self.work_dir / "certs"
        self.given_certs = certs is not None
        self.data_dir = data_dir
        self.log = log or (lambda line: None)
        self.waits = waits or for_host()
        self.tag = uuid.uuid4().hex[:10]
        self.logs = self.work_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.spawner = Spawner(self.tag, self.logs, {**TUNING_ENV, **FLOWER_ENV, **self.waits.env()})
        self.engines: dict[str, HostEngine] = dict(engines) if engines is not None else {
            h.name: make_engine(h, self.spawner, self.work_dir, self.tag, self.log) for h in plan.hosts}
        # one worker a host: its switches in order, every host's at the same time
        self.workers = {h.name: ThreadPoolExecutor(1, thread_name_prefix=f"host-{h.name}") for h in plan.hosts}
        self.identities: Identities | None = None
        self.superlink: Proc | None = None
        self.superlink_port = plan.superlink.port
        self.cli: FlwrCli | None = None
        self.lock = threading.Lock()
        self.node_id: dict[int, int] = {}  # client -> the node id its key was registered under
        self.node_ids: dict[int, list[int]] = {i: [] for i in range(self.num_nodes)}  # one per SuperLink
        self.listed: dict[int, dict[str, Any]] = {}  # node id -> the SuperLink's entry (latest read)
        self.activated_before: dict[int, str] = {}  # client -> its node's activation when last started
        self.up: set[int] = set()  # clients the driver has started and not stopped
        self.start_finished: dict[int, float] = {}  # client -> when its latest start returned (driver clock)
        self.failed: dict[int, str] = {}  # client -> why its last start failed
        self.incarnations = dict.fromkeys(range(self.num_nodes), 0)
        self.term_sent: set[int] = set()
        self.switch_seconds: dict[str, list[tuple[str, float]]] = {h.name: [] for h in plan.hosts}
        self.auth_seen: dict[str, int] = {}
        self.stopping = threading.Event()
        self.probes = HostProbes(plan, self.engines, self.log, self.stopping)
        self.threads: list[threading.Thread] = []
        self.close_at_exit()

    # ------------------------------------------------------------------ the SuperLink
    @property
    def address(self) -> str:
        return f"{self.plan.superlink.address}:{self.superlink_port}"

    def start_superlink(self, timeout: float | None = None) -> None:
        """Keys and certificates (made, or ``certs``), the SuperLink with TLS and SuperNode
        authentication on the hosts file's address, every client's key registered (checked in
        the SuperLink's own list), then the watchers of the SuperLink and of every host."""
        if self.identities is None:
            self.identities = (load_identities(self.certs_dir, self.num_nodes) if self.given_certs
                               else make_identities(self.certs_dir, self.plan.superlink.cert_names, self.num_nodes))
        ids = self.identities
        if not self.plan.superlink.port:
            self.superlink_port = free_port()
        home = self.work_dir / "superlink"
        home.mkdir(parents=True, exist_ok=True)
        self.superlink = self.spawner.spawn(
            "superlink",
            [*TUNING_SUPERLINK, "--ssl-ca-certfile", str(ids.ca_cert), "--ssl-certfile", str(ids.server_cert),
             "--ssl-keyfile", str(ids.server_key), "--enable-supernode-auth", "--disable-runtime-dependency-installation",
             "--host", self.plan.superlink.address, "--port", str(self.superlink_port)],
            home, {"FLWR_HOME": str(home)})
        link = self.superlink
        wait_for(lambda: True if port_open(self.superlink_port, self.plan.superlink.address) else None,
                 self.waits.superlink if timeout is None else timeout,
                 what=f"flower-superlink listens on {self.address}", flag="--superlink-timeout", see=link.log,
                 log=self.log, gone=lambda: None if link.alive else f"flower-superlink exited ({link.popen.returncode})")
        self.cli = FlwrCli(self.work_dir / "cli", self.address, root_certificates=str(ids.ca_cert),
                           env=self.spawner.env(None), cwd=self.work_dir, log=self.log, waits=self.waits)
        self.register_keys()
        if not self.threads:
            self.threads = [threading.Thread(target=self._watch_superlink, name="superlink-nodes", daemon=True)]
            self.threads += self.probes.threads()
            for t in self.threads:
                t.start()
        self.log(f"SuperLink on {self.address} (TLS, SuperNode authentication; log {link.log}); "
                 f"{self.num_nodes} keys registered")

    def register_keys(self) -> None:
        """Register every client's public key; confirm each id in the SuperLink's own list."""
        assert self.identities is not None
        control = control_client(self.address, str(self.identities.ca_cert))
        try:
            for i in range(self.num_nodes):
                nid = control.register(self.identities.public_key_pem(i))
                self.node_id[i] = nid
                self.node_ids[i].append(nid)
            listed = {n["node-id"]: n for n in control.nodes()}
        finally:
            control.close()
        missing = [i for i, nid in self.node_id.items() if nid not in listed]
        if missing:
            raise DeployError(f"the SuperLink does not list the node ids it gave clients {missing}: registration failed")
        with self.lock:
            self.listed = listed

    def _watch_superlink(self) -> None:
        """The SuperLink's node list, read every POLL s (the only source of 'registered')."""
        control, failing = None, False
        while not self.stopping.is_set():
            try:
                if control is None and self.identities is not None and self.superlink_alive():
                    control = control_client(self.address, str(self.identities.ca_cert))
                if control is not None:
                    listed = {n["node-id"]: n for n in control.nodes()}
                    with self.lock:
                        self.listed = listed
                failing = False
            except Exception as err:  # noqa: BLE001  (a SuperLink restarting: read again)
                if control is not None or not failing:  # once per outage, not every POLL
                    self.log(f"SuperLink node list unread ({type(err).__name__}: {err}); reading again every {POLL} s")
                failing, control = True, None
            self.stopping.wait(POLL)

    def superlink_alive(self) -> bool:
        return self.superlink is not None and self.superlink.alive

    def ensure_superlink(self, fresh: bool) -> None:
        if not self.superlink_alive() or (fresh and self.running_nodes()):
            self.restart()

    def restart(self) -> None:
        """A fresh SuperLink (empty state, the same keys registered again) and no node running."""
        for i in sorted(self.up):
            self.stop_node(i, "term")
        if self.superlink is not None:
            self.superlink.kill_tree()
        self.start_superlink()

    def housekeeping(self) -> None:
        self.spawner.reap_orphans()

    def auth_failures(self) -> dict[str, int]:
        return new_auth_failures([("SuperLink", self.logs / "superlink.log")], self.auth_seen)

    def run_log(self, run_id: int) -> str:
        if self.cli is None:
            raise DeployError("no SuperLink was started")
        return self.cli.run_log(run_id)

    # ------------------------------------------------------------------ nodes
    def node_config(self, i: int) -> dict[str, Any]:
        host = self.plan.host_for(i)
        cfg: dict[str, Any] = {**TUNING_NODE_CONFIG, TIMING: True, "partition-id": i, "num-partitions": self.num_nodes}
        data_dir = host.data_dir or self.data_dir
        if data_dir:
            cfg["data-dir"] = data_dir
        local = str(self.work_dir / "hosts" / host.name / "state")  # a process host's disk is this machine's
        cfg["state-dir"] = host.state_dir or (local if host.engine == "process" else "/state")  # in the container
        return cfg

    def launch(self, i: int) -> NodeLaunch:
        assert self.identities is not None
        host = self.plan.host_for(i)
        return NodeLaunch(client=i, name=f"flchurn-{self.tag}-{host.name}-node-{i}", superlink=self.address,
                          ca_cert=self.identities.ca_cert.read_bytes(),
                          private_key=self.identities.key(i).read_bytes(), node_config=self.node_config(i),
                          runtime_port=RUNTIME_PORT + host.clients.index(i))

    def _timed(self, host: str, op: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            self.switch_seconds[host].append((op, time.monotonic() - t0))

    def start_node(self, i: int) -> None:
        """Start client ``i``'s SuperNode on its host (returns at once: the host's worker does it)."""
        if self.cli is None:
            raise DeployError("start the SuperLink first")
        if i in self.up and i not in self._dead():
            return
        host = self.plan.host_for(i)
        engine = self.engines[host.name]
        with self.lock:
            entry = self.listed.get(self.node_id[i], {})
            self.activated_before[i] = str(entry.get("activated-at", ""))
        self.incarnations[i] += 1
        self.up.add(i)
        self.start_finished.pop(i, None)
        self.failed.pop(i, None)
        self.term_sent.discard(i)
        launch = self.launch(i)

        def start() -> None:
            try:
                self._timed(host.name, "start", lambda: engine.start(launch))
                self.start_finished[i] = time.monotonic()
            except Exception as err:
                self.failed[i] = f"host {host.name} unreachable: {err.why}" if isinstance(err, HostUnreachable) \
                    else f"its start on host {host.name} failed: {err}"
                self.log(f"node {i}: {self.failed[i]}")
                raise

        self.workers[host.name].submit(start)  # its failure is logged and read by _dead()
        self.log(f"node {i}: starting on host {host.name} (incarnation {self.incarnations[i]})")

    def _dead(self) -> set[int]:
        """Clients we started whose SuperNode is not running, by a host read newer than the start."""
        out = set(self.failed)
        for host in self.plan.hosts:
            read = self.probes.running_read(host.name)
            if read is None:
                continue
            at, running = read
            for i in host.clients:
                if i in self.up and i not in running and at > self.start_finished.get(i, float("inf")):
                    out.add(i)
        return out & self.up

    def signal_node(self, i: int, sig: int = signal.SIGTERM) -> None:
        host = self.plan.host_for(i)
        engine = self.engines[host.name]
        if sig == signal.SIGTERM:
            self.term_sent.add(i)
        self.workers[host.name].submit(self._quiet, host.name, "signal", lambda: engine.signal(i, sig))

    def _quiet(self, host: str, op: str, fn: Callable[[], Any]) -> Any:
        try:
            return self._timed(host, op, fn)
        except Exception as err:  # noqa: BLE001  (an unreachable host: its node is lost, the run goes on)
            self.log(f"host {host}: {op} failed: {err}")
            return None

    def stop_node(self, i: int, mode: str = "term", timeout: float | None = None) -> None:
        """Take client ``i``'s SuperNode down through its host's engine and wait for it (an
        unreachable host: logged, the node counted down; its host's engine finishes it later)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        host = self.plan.host_for(i)
        engine = self.engines[host.name]
        grace = timeout if timeout is not None else 10.0 * max(1.0, self.waits.register / 60.0)
        op = (lambda: engine.stop(i, grace)) if mode == "term" else (lambda: engine.kill(i))
        fut = self.workers[host.name].submit(self._quiet, host.name, "stop" if mode == "term" else "kill", op)
        try:
            code = fut.result(timeout=grace + 60.0)
        except TimeoutError:
            code = None
            self.log(f"node {i}: host {host.name} did not confirm the stop in {grace + 60:.0f} s")
        self.up.discard(i)
        self.start_finished.pop(i, None)
        self.term_sent.discard(i)
        self.log(f"node {i}: stopped ({mode}) on host {host.name}, exit {code}")

    def running_nodes(self) -> set[int]:
        return self.up - self._dead()

    def incarnation(self, i: int) -> int:
        return self.incarnations[i]

    def registered_id(self, i: int) -> int | None:
        """Client ``i``'s node id once the SuperLink lists it online, activated after its start."""
        if i not in self.up:
            return None
        nid = self.node_id.get(i)
        with self.lock:
            entry = self.listed.get(nid) if nid is not None else None
        if entry is None or entry["status"] != "online" or str(entry.get("activated-at", "")) == \
                self.activated_before.get(i, ""):
            return None
        return nid

    def wait_registered(self, i: int, timeout: float | None = None) -> int:
        timeout = self.waits.register if timeout is None else timeout
        host = self.plan.host_for(i)
        return wait_for(lambda: self.registered_id(i), timeout, what=f"SuperNode {i} (host {host.name}) registers",
                        flag="--register-timeout", see=self.logs, log=self.log,
                        gone=lambda: self.failed.get(i))

    def client_of_node(self) -> dict[int, int]:
        return {nid: i for i, ids in self.node_ids.items() for nid in ids}

    def unreachable(self) -> dict[int, str]:
        """Client -> "host h unreachable: why" (:meth:`deploy.hostprobe.HostProbes.unreachable`)."""
        return self.probes.unreachable()

    def switch_summary(self) -> str:
        """Per host: how long its engine took to start / stop a node (median, max)."""
        lines = []
        for host, ops in self.switch_seconds.items():
            parts = []
            for op in ("start", "stop", "kill"):
                xs = sorted(s for o, s in ops if o == op)
                if xs:
                    parts.append(f"{op} median {xs[len(xs) // 2]:.2f} s, max {xs[-1]:.2f} s (n={len(xs)})")
            lines.append(f"host {host}: " + ("; ".join(parts) or "no switch"))
        return "\n".join(lines)

    # ------------------------------------------------------------------ shutdown
    @property
    def closed(self) -> bool:
        return self.spawner.closed

    def close(self) -> None:
        """Stop every node on every host (at once), the watchers and the SuperLink (idempotent)."""
        if self.closed:
            return
        held = hold_signals()
        try:
            self.stopping.set()
            for worker in self.workers.values():
                worker.shutdown(wait=True, cancel_futures=True)
            closers = [threading.Thread(target=self._quiet, args=(name, "close", engine.close))
                       for name, engine in self.engines.items()]
            for t in closers:
                t.start()
            for t in closers:
                t.join(timeout=120)
            if self.cli is not None:
                self.cli.close()
            self.spawner.close([self.superlink] if self.superlink is not None else [])
        finally:
            release_signals(held)
        if self.remove_workdir:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def leftovers(self) -> list[int]:
        return self.spawner.leftovers()
