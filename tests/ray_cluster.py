"""A real Ray cluster on this machine for the tests: a head and workers started with ``ray start``
as subprocesses, in a private temp dir (so no other ``ray.init()`` on the machine finds it), each
node's processes tagged in their environment (``FLCHURN_RAY_NODE``), so that one node can be
killed (its raylet, workers and agents: a lost machine) and everything removed at the end, by pid.

With ``hosts`` (``tests/multihost_hosts.py``'s namespace hosts, as root) the head listens on the
bridge's address, not on loopback, and the last worker runs in host 0's network namespace with its
own address: its raylet, object manager and actors reach the head over the bridge, as a second
machine's would. The GCS marks a node dead after ``DEATH_CHECKS`` failed health checks
``DEATH_CHECK_MS`` apart (Ray's defaults: 5 × 3 s, after a 5 s delay).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from deploy.procs import free_port, kill_pids, tagged_pids
from deploy.waits import host_slowdown

NODE_VAR = "FLCHURN_RAY_NODE"  # <cluster tag>-<node name>, in every process of that node
# `ray start`, with Ray's hard-coded 30 s wait for a raylet to register (ray._private.node) stretched
# to 30 s x PATIENCE: on this 2-core machine at load 30-47 a raylet registered later than that and
# `ray start` failed (4 of 4 attempts of the head), leaving a node that would have come up
RAY_START = """
import os, sys, time
import ray._private.node as node
import ray._private.services
from ray.scripts.scripts import main

class Patient:
    def __getattr__(self, name):
        return getattr(time, name)

    def monotonic(self):
        return time.monotonic() / {patience}

node.time = Patient()
# the node's processes (GCS, raylet, agents, workers) ahead of the machine's other work: the raylet
# aborts when its dashboard agent has not written its port file within ~20 s, which it missed at
# load 30 on these 2 cores even as in a minimal install
os.nice(-10)
# the dashboard agent as in a minimal install (no dashboard modules): the raylet aborts when the agent
# has not written its port file within 30 s, which the full agent missed here at load 14-47
ray._private.services.ray._private.utils.get_dashboard_dependency_error = lambda: "not needed by these tests"
sys.argv = ["ray", *sys.argv[1:]]
sys.exit(main())
"""
QUIET = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "FLWR_TELEMETRY_ENABLED": "0"}
DEATH_CHECK_MS, DEATH_CHECKS = 500, 4


class RayCluster:
    """``ray start --head`` and ``workers`` × ``ray start --address``, 1 CPU each."""

    def __init__(self, workers: int = 2, cpus: int = 1, hosts: Any = None) -> None:
        self.hosts = hosts  # NamespaceHosts (created) or None: every node on loopback
        self.tag = uuid.uuid4().hex[:10]
        self.temp = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # short: Ray's socket paths are long
        self.port = free_port()
        self.address = ""
        self.cpus = cpus
        self.names = ["head", *(f"w{i}" for i in range(1, workers + 1))]
        self.started_s = 0.0

    def env(self, name: str) -> dict[str, str]:
        patience = min(4.0, max(1.0, host_slowdown()))
        # the raylet's own waits (RayConfig): for its agents' port files (30 s; it aborted at load 47
        # with "Timed out waiting for file .../dashboard_agent_listen_port_<node>") and to register
        waits = {"RAY_agent_register_timeout_ms": str(int(30_000 * patience)),
                 "RAY_raylet_start_wait_time_s": str(int(30 * patience))}
        health = {"RAY_health_check_period_ms": str(DEATH_CHECK_MS), "RAY_health_check_failure_threshold": str(DEATH_CHECKS),
                  "RAY_health_check_initial_delay_ms": str(DEATH_CHECK_MS),
                  "RAY_health_check_timeout_ms": str(int(DEATH_CHECK_MS * 2 * patience))}
        env = {**os.environ, **QUIET, **waits, **health, NODE_VAR: f"{self.tag}-{name}"}
        env.pop("RAY_ADDRESS", None)
        return env

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.temp / f"{name}.out").open("wb")  # each attempt anew
        code = RAY_START.format(patience=min(4.0, max(1.0, host_slowdown())))
        prefix: list[str] = []  # this node a host of its own: started in its network namespace
        where: list[str] = []
        if self.hosts is not None:
            ip = self.node_ip(name)
            where = [f"--node-ip-address={ip}"]
            if ip != self.hosts.superlink_address:
                prefix = ["nsenter", f"--net=/run/netns/{self.hosts.ns(0)}", "--"]
        return subprocess.Popen([*prefix, sys.executable, "-c", code, "start", f"--num-cpus={self.cpus}",
                                 "--disable-usage-stats", *where, *args],
                                env=self.env(name), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)

    def start(self) -> RayCluster:
        t0 = time.monotonic()
        self._up(["head"], "--head", f"--port={self.port}", f"--temp-dir={self.temp}", "--include-dashboard=false")
        self.address = f"{self.node_ip('head')}:{self.port}"
        for name in self.names[1:]:  # one at a time: two at once took the same raylet socket name (raylet.1)
            self._up([name], f"--address={self.address}")
        self.started_s = time.monotonic() - t0
        return self

    def node_ip(self, name: str) -> str:
        """The address node ``name`` listens on: loopback; with hosts, the bridge's address, and
        host 0's for the last worker."""
        if self.hosts is None:
            return "127.0.0.1"
        return self.hosts.address(0) if name == self.names[-1] and len(self.names) > 1 else self.hosts.superlink_address

    def _up(self, names: list[str], *args: str) -> None:
        """Start nodes ``names``; one whose raylet missed Ray's hard-coded 30 s registration
        wait (a loaded machine) is killed and started again, up to 4 times."""
        todo = list(names)
        for attempt in range(4):
            procs = {n: self._start(n, *args) for n in todo}
            failed = {n: self._wait(p, n) for n, p in procs.items()}
            todo = [n for n, out in failed.items() if out]
            for n in todo:
                kill_pids(tagged_pids(f"{self.tag}-{n}", NODE_VAR))
            if not todo:
                return
            if attempt == 3 or not all("timed out during startup" in failed[n] for n in todo):
                raise RuntimeError(f"ray start ({', '.join(todo)}) failed: " + failed[todo[0]][-2000:])

    def _wait(self, proc: subprocess.Popen, name: str) -> str:
        """'' when ``ray start`` for ``name`` succeeded, else its output."""
        limit = 200.0  # `ray start` took 10-27 s here at load 2; it gives up after 30 s x 4 at most
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = None
        out = (self.temp / f"{name}.out").read_text(errors="replace")
        return "" if rc == 0 else f"exit {rc}: {out}"

    def nodes(self) -> list[dict]:
        """``ray.nodes()`` as seen by a fresh driver (a subprocess: this process stays Ray-free)."""
        return json.loads(self.query("json.dumps([{'id': n['NodeID'], 'alive': n['Alive'], 'socket': "
                                     "n['RayletSocketName'], 'cpus': n['Resources'].get('CPU', 0), "
                                     "'ip': n['NodeManagerAddress']} for n in ray.nodes()])"))

    def actors(self, class_name: str) -> list[dict]:
        """Every actor of ``class_name`` the cluster ever had: id, node, state (Ray's actor table)."""
        return json.loads(self.query(
            "json.dumps([{'id': k, 'node': v['Address']['NodeID'], 'state': v['State']} for k, v in "
            f"ray._private.state.actors().items() if v['ActorClassName'] == {class_name!r}])"))

    def query(self, expr: str) -> str:
        code = ("import json, ray, ray._private.state\n"
                f"ray.init(address={self.address!r}, include_dashboard=False, log_to_driver=False, "
                "configure_logging=False)\n"
                f"print('RESULT', {expr})\n")
        out = subprocess.run([sys.executable, "-c", code], env=self.env("query"), capture_output=True, text=True,
                             timeout=120 * host_slowdown())
        found = [ln[7:] for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        assert found, out.stdout[-2000:] + out.stderr[-2000:]
        return found[-1]

    def node_id(self, name: str) -> str:
        """The Ray node id of node ``name`` (its raylet's socket is named in its processes' argv)."""
        for pid in tagged_pids(f"{self.tag}-{name}", NODE_VAR):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            sockets = [a.split(b"=", 1)[1].decode() for a in argv if a.startswith(b"--raylet_socket_name=")]
            if sockets and Path(argv[0].decode()).name == "raylet":
                return next(n["id"] for n in self.nodes() if n["socket"] == sockets[0])
        raise LookupError(f"no raylet of node {name}")

    def revive(self, name: str) -> None:
        """Start worker ``name`` again if it was killed (a new Ray node: a new node id)."""
        if not tagged_pids(f"{self.tag}-{name}", NODE_VAR):
            self._up([name], f"--address={self.address}")

    def kill(self, name: str) -> list[int]:
        """SIGKILL every process of node ``name`` (a machine lost); returns their pids."""
        pids = tagged_pids(f"{self.tag}-{name}", NODE_VAR)
        kill_pids(pids, signal.SIGKILL)
        return pids

    def stop(self) -> None:
        """Kill every process of every node (by pid), then remove the temp dir."""
        for _ in range(3):
            pids = [p for n in [*self.names, "query"] for p in tagged_pids(f"{self.tag}-{n}", NODE_VAR)]
            if not pids:
                break
            kill_pids(pids, signal.SIGKILL)
            time.sleep(0.5)
        shutil.rmtree(self.temp, ignore_errors=True)

    def leftovers(self) -> list[int]:
        return [p for n in [*self.names, "query"] for p in tagged_pids(f"{self.tag}-{n}", NODE_VAR)]
