"""Real device limits for the process launcher: every SuperNode (and all it starts) in its own
cgroup (CPU quota, memory cap; CPU time and peak memory measured), and a node whose class limits
bandwidth, latency or loss in its own network namespace (:mod:`deploy.edge.netns`); latency and loss
by ``netem`` where the kernel has it, otherwise through a user-space relay per node
(:mod:`deploy.edge.relay`: the node's SuperNode reaches the SuperLink through it, on its veth pair's
host end; started with the SuperLink, stopped with the deployment). :class:`EdgeLimits` makes them
from a :class:`deploy.edge.devices.DevicePlan`, hands the launcher what a node's process must do
before exec (:meth:`EdgeLimits.preexec`) and the SuperLink address it must use, and removes
everything it made at :meth:`EdgeLimits.close` (the launcher's exit, failure, Ctrl-C), and puts back the
host's IP forwarding as it found it at setup (:mod:`deploy.edge.sysctls`).
"""

from __future__ import annotations

import math
import os
import shutil
import time
import zlib
from collections.abc import Callable
from typing import Any

from ..errors import DeployError
from ..procs import Proc, free_port, port_open
from ..tuning import compute_threads_env
from .cgroups import NodeCgroup, cgroup_version, leftover_cgroups, remove_group
from .devices import DevicePlan, check_host
from .netns import NodeNet, leftover_net, netem_available, subnet_free
from .relay import Impairment, argv as relay_argv
from .sysctls import HostSysctls


def requirements(plan: DevicePlan) -> str | None:
    """Why this host cannot apply ``plan`` (None: it can)."""
    if os.geteuid() != 0:
        return "device limits need root (cgroups, network namespaces): run the launcher as root"
    if cgroup_version() is None:
        return "no cgroup filesystem under /sys/fs/cgroup (v1 cpu + memory, or v2)"
    shaped = [dc for dc in plan.classes if dc.shaped]
    if shaped and not (shutil.which("ip") and shutil.which("tc")):
        return "bandwidth limits need the ip and tc commands (Debian: iproute2)"
    return None  # rtt_ms/loss: netem, or the relay where the kernel has no netem


class EdgeLimits:
    """The cgroups and network paths of one deployment's nodes."""

    def __init__(self, plan: DevicePlan, group: str, log: Callable[[str], None] | None = None,
                 sysctls: HostSysctls | None = None) -> None:
        self.plan = plan
        self.group = group[:8]
        self.log = log or (lambda line: None)
        self.cgroups: dict[int, NodeCgroup] = {}
        self.nets: dict[int, NodeNet] = {}
        self.relayed: dict[int, Impairment] = {}  # nodes whose rtt_ms/loss go through a relay
        self.relays: dict[int, tuple[Proc, str]] = {}  # node -> (relay process, "host:port")
        self.sysctls = sysctls or HostSysctls(log=self.log)  # the host's settings, as found at setup
        self.closed = False

    @property
    def shaped(self) -> bool:
        return any(dc.shaped for dc in self.plan.classes)

    def setup(self) -> None:
        """Check, then make every cgroup and network path (all or nothing)."""
        why = requirements(self.plan)
        if why:
            raise DeployError(why)
        check_host(self.plan)
        self.sysctls.record()
        octet = self._octet()
        delayed = [i for i in range(self.plan.num_nodes) if self.plan.of(i).rtt_ms or self.plan.of(i).loss]
        if delayed and not netem_available():
            self.relayed = {i: Impairment(self.plan.of(i).rtt_ms or 0.0, self.plan.of(i).loss or 0.0, seed=i)
                            for i in delayed}
        try:
            for i in range(self.plan.num_nodes):
                dc = self.plan.of(i)
                cg = NodeCgroup(self.group, f"node-{i}", cpus=dc.cpus, mem_mb=dc.mem_mb)
                self.cgroups[i] = cg
                cg.create()
                if dc.shaped:
                    net = NodeNet(self.group, i, octet, up_kbps=dc.up_kbps, down_kbps=dc.down_kbps,
                                  rtt_ms=None if i in self.relayed else dc.rtt_ms,
                                  loss=None if i in self.relayed else dc.loss)
                    self.nets[i] = net
                    net.create()
        except BaseException:
            self.close()
            raise
        self.log("device limits: " + self.plan.describe()
                 + (f" (rtt_ms/loss of nodes {sorted(self.relayed)} through a relay: no netem here)"
                    if self.relayed else ""))

    def _octet(self) -> int:
        base = zlib.crc32(self.group.encode()) % 50
        for k in range(50):
            octet = 200 + (base + k) % 50
            if subnet_free(f"10.{octet}."):
                return octet
        raise DeployError("no free 10.200-249.x.x subnet for the nodes' network paths")

    def preexec(self, i: int) -> Callable[[], None]:
        """What node ``i``'s process does between fork and exec: join its cgroups and namespace."""
        cg, net = self.cgroups.get(i), self.nets.get(i)

        def enter() -> None:
            if cg is not None:
                cg.join()
            if net is not None:
                net.enter()

        return enter

    def env(self, i: int) -> dict[str, str]:
        """Environment of node ``i``: as many compute threads as whole CPUs its quota gives, one
        for a node without a CPU cap (the nodes share the host). Threads beyond what a process
        gets only spin and wait (OpenMP busy-waiting burns a CFS quota, and on a shared host:
        measured 20-70x slower local steps with torch's default threads)."""
        cpus = self.plan.of(i).cpus
        return compute_threads_env(math.ceil(cpus) if cpus is not None else 1)

    def superlink_host(self, i: int) -> str:
        """The host node ``i`` reaches the SuperLink at."""
        return self.nets[i].host_ip if i in self.nets else "127.0.0.1"

    def superlink_address(self, i: int, superlink_port: int) -> str:
        """HOST:PORT node ``i``'s SuperNode connects to: its relay, or the SuperLink's Fleet API."""
        if i in self.relays:
            return self.relays[i][1]
        return f"{self.superlink_host(i)}:{superlink_port}"

    def start_relays(self, spawn: Callable[[str, list[str]], Proc], superlink_port: int,
                     timeout: float = 30.0) -> None:
        """(Re)start one relay per relayed node, forwarding to the SuperLink on ``superlink_port``
        and listening on the host end of the node's veth pair; ``spawn(name, argv)`` starts a
        process of the deployment (stopped and swept with it)."""
        self.stop_relays()
        for i, imp in self.relayed.items():
            host, port = self.nets[i].host_ip, free_port()
            proc = spawn(f"relay-{i}", relay_argv((host, port), ("127.0.0.1", superlink_port), imp))
            self.relays[i] = (proc, f"{host}:{port}")
            deadline = time.monotonic() + timeout
            while not port_open(port, host):
                if not proc.alive or time.monotonic() > deadline:
                    raise DeployError(f"node {i}'s relay did not listen on {host}:{port} "
                                      f"({'exited' if not proc.alive else f'{timeout:g} s'}); see {proc.log}")
                time.sleep(0.05)
            self.log(f"node {i}: relay on {host}:{port} adds rtt {imp.rtt_ms:g} ms, loss {imp.loss:g} "
                     f"(log {proc.log})")

    def relay_procs(self) -> list[Proc]:
        return [proc for proc, _ in self.relays.values()]

    def stop_relays(self) -> None:
        for proc, _ in self.relays.values():
            proc.kill_tree()
        self.relays.clear()

    def measure(self, i: int) -> dict[str, Any]:
        """Node ``i`` so far: CPU seconds, peak memory, OOM kills, bytes in and out."""
        out: dict[str, Any] = {}
        if (cg := self.cgroups.get(i)) is not None:
            out.update({"cpu-seconds": round(cg.cpu_seconds(), 3), "peak-mb": round(cg.peak_mb(), 1),
                        "oom-kills": cg.oom_kills()})
        if (net := self.nets.get(i)) is not None:
            out["bytes-in"], out["bytes-out"] = net.bytes()
        return out

    def close(self) -> list[str]:
        """Remove every namespace, interface and cgroup made (the nodes' processes must be gone) and
        restore the host settings found at setup; returns what could not be removed or restored
        (also logged)."""
        if self.closed:
            return []
        self.closed = True
        left: list[str] = []
        for net in self.nets.values():
            left += net.remove()
        for cg in self.cgroups.values():
            left += cg.remove()
        left += remove_group(self.group)
        left += [n for n in leftover_net(self.group) if n not in left]
        left += self.sysctls.restore()
        if left:
            self.log(f"device limits: could not remove {left}")
        return left

    def leftovers(self) -> list[str]:
        return leftover_cgroups(self.group) + leftover_net(self.group) + self.sysctls.changed()
