"""A node's own network path: a network namespace joined to the host by a veth pair, with a
token bucket (``tc qdisc tbf``) on each end. Needs root, ``ip`` and ``tc``.

Traffic from the node leaves through the namespace's end of the pair, traffic to the node
through the host's end, so shaping the *egress* of both ends limits both directions: upload
(node -> SuperLink) on the namespace side, download on the host side. (This is what an IFB
device on the host end's ingress would do, with one device less.) The node reaches the SuperLink
at the host end's address; its own loopback (ClientAppIo, the client worker's socket) stays
inside the namespace.

Latency and loss: Linux's ``netem`` qdisc where the kernel has it (:func:`netem_available`);
otherwise both go through a user-space TCP relay per node (:mod:`deploy.edge.relay`, started by
:mod:`deploy.edge.limits`): rtt/2 each way, and loss as TCP sees it (a lost chunk costs an RTO).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

from ..errors import DeployError

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/run/netns")
PREFIX = "flc"


def enter_namespace(ns: str) -> None:
    """Move the calling process into network namespace ``ns`` (``ip netns add``'s; in a child,
    before exec)."""
    fd = os.open(NETNS_DIR / ns, os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {ns}")
    finally:
        os.close(fd)


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise DeployError(f"ip {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def tc(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    argv = (["ip", "netns", "exec", ns, "tc"] if ns else ["tc"]) + list(args)
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise DeployError(f"tc {' '.join(args)}: {res.stderr.strip() or res.returncode}")
    return res


def tbf_args(kbps: int) -> list[str]:
    """A token bucket of ``kbps`` kbit/s: burst of 20 ms of traffic (at least two full frames),
    up to 200 ms of queue."""
    burst = max(3200, kbps * 1000 // 8 // 50)
    return ["tbf", "rate", f"{kbps}kbit", "burst", str(burst), "latency", "200ms"]


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (probed on a throw-away dummy link)."""
    name = f"{PREFIX}probe{os.getpid() % 10000}"
    if ip("link", "add", name, "type", "dummy", check=False).returncode != 0:
        return False
    try:
        return tc(None, "qdisc", "add", "dev", name, "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        ip("link", "del", name, check=False)


def subnet_free(prefix: str) -> bool:
    """Whether no host route uses ``prefix`` (e.g. ``10.201.3.``)."""
    return prefix not in ip("-4", "route", "show", check=False).stdout


class NodeNet:
    """Namespace ``flc<group>n<i>``, host end ``flc<group>h<i>`` (``10.<a>.<i>.1/30``), node end
    ``flc<group>c<i>`` (``.2``)."""

    def __init__(self, group: str, i: int, octet: int, *, up_kbps: int | None, down_kbps: int | None,
                 rtt_ms: float | None = None, loss: float | None = None) -> None:
        if not 0 <= i < 256:
            raise DeployError("a shaped network path is made for at most 256 nodes")
        self.ns = f"{PREFIX}{group}n{i}"
        self.host_if, self.node_if = f"{PREFIX}{group}h{i}", f"{PREFIX}{group}c{i}"
        self.host_ip, self.node_ip = f"10.{octet}.{i}.1", f"10.{octet}.{i}.2"
        self.up_kbps, self.down_kbps = up_kbps, down_kbps
        self.rtt_ms, self.loss = rtt_ms, loss
        self.made_ns = self.made_link = False

    def create(self) -> None:
        ip("netns", "add", self.ns)
        self.made_ns = True
        ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.node_if)
        self.made_link = True
        ip("link", "set", self.node_if, "netns", self.ns)
        ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        ip("link", "set", self.host_if, "up")
        ip("-n", self.ns, "addr", "add", f"{self.node_ip}/30", "dev", self.node_if)
        ip("-n", self.ns, "link", "set", self.node_if, "up")
        ip("-n", self.ns, "link", "set", "lo", "up")
        self._shape(None, self.host_if, self.down_kbps)
        self._shape(self.ns, self.node_if, self.up_kbps)

    def _shape(self, ns: str | None, dev: str, kbps: int | None) -> None:
        """Egress of ``dev``: netem (half the RTT, the loss) with tbf under it, or tbf alone.
        (netem: where the kernel has it; untested on the machines this was written on.)"""
        if self.rtt_ms or self.loss:
            netem = ["netem", "delay", f"{(self.rtt_ms or 0) / 2:g}ms", "loss", f"{100 * (self.loss or 0):g}%"]
            tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
            if kbps:
                tc(ns, "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf_args(kbps))
        elif kbps:
            tc(ns, "qdisc", "add", "dev", dev, "root", *tbf_args(kbps))

    def enter(self) -> None:
        """Move the calling process into the namespace (runs in the child, before exec)."""
        enter_namespace(self.ns)

    def bytes(self) -> tuple[int, int]:
        """(bytes received by the node, bytes it sent) so far, counted at the host end."""
        stats = Path("/sys/class/net") / self.host_if / "statistics"
        try:
            return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())
        except OSError:
            return 0, 0

    def remove(self) -> list[str]:
        """Delete the pair and the namespace; the names that could not be removed."""
        left = []
        if self.made_link and ip("link", "show", self.host_if, check=False).returncode == 0:
            if ip("link", "del", self.host_if, check=False).returncode != 0:
                left.append(self.host_if)
        if self.made_ns and (NETNS_DIR / self.ns).exists():
            if ip("netns", "del", self.ns, check=False).returncode != 0:
                left.append(self.ns)
        return left


def leftover_net(group: str) -> list[str]:
    """Namespaces and links of deployment ``group`` that still exist."""
    name = f"{PREFIX}{group}"
    links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", check=False).stdout.splitlines()
             if f": {name}" in line]
    spaces = [p.name for p in NETNS_DIR.glob(f"{name}n*")] if NETNS_DIR.is_dir() else []
    return sorted(links + spaces)
