"""Test hosts that are network namespaces with their own addresses (root): a bridge on a private
/24 that only they use, this machine (the SuperLink's host) at ``.1`` on it, host ``j`` in
namespace ``flcmh<k>n<j>`` at ``.(10 + j)`` behind a veth pair whose bridge end can be taken down
(a cut link). :meth:`NamespaceHosts.remove` deletes every namespace and interface made, and
:func:`leftovers` lists any that remain.
"""

from __future__ import annotations

import os
import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PREFIX = "flcmh"
NETNS_DIR = Path("/run/netns")


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def can_make_hosts() -> str | None:
    """None when this process can make namespace hosts, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if subprocess.run(["which", "ip"], capture_output=True).returncode != 0:
        return "needs iproute2's ip"
    return None


@dataclass
class NamespaceHosts:
    count: int
    group: str = field(default_factory=lambda: f"{random.randrange(16**4):04x}")
    octet: int = 0
    made_ns: list[str] = field(default_factory=list)
    made_links: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        used = ip("-4", "route", "show", check=False).stdout
        free = [o for o in range(100, 250) if f"10.213.{o}." not in used]
        self.octet = random.choice(free)

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.group}b"

    @property
    def superlink_address(self) -> str:
        return f"10.213.{self.octet}.1"

    def ns(self, j: int) -> str:
        return f"{PREFIX}{self.group}n{j}"

    def address(self, j: int) -> str:
        return f"10.213.{self.octet}.{10 + j}"

    def link(self, j: int) -> str:
        """The bridge end of host j's veth pair: down = host j cut off."""
        return f"{PREFIX}{self.group}h{j}"

    def create(self) -> NamespaceHosts:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            self.made_links.append(self.bridge)
            ip("addr", "add", f"{self.superlink_address}/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for j in range(self.count):
                ns, outer, inner = self.ns(j), self.link(j), f"{PREFIX}{self.group}c{j}"
                ip("netns", "add", ns)
                self.made_ns.append(ns)
                ip("link", "add", outer, "type", "veth", "peer", "name", inner)
                self.made_links.append(outer)
                ip("link", "set", inner, "netns", ns)
                ip("link", "set", outer, "master", self.bridge)
                ip("link", "set", outer, "up")
                ip("-n", ns, "addr", "add", f"{self.address(j)}/24", "dev", inner)
                ip("-n", ns, "link", "set", inner, "up")
                ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def cut(self, j: int) -> None:
        ip("link", "set", self.link(j), "down")

    def mend(self, j: int) -> None:
        ip("link", "set", self.link(j), "up")

    def remove(self) -> list[str]:
        """Delete what was made; the names that could not be deleted."""
        left = []
        for ns in self.made_ns:
            if (NETNS_DIR / ns).exists() and ip("netns", "del", ns, check=False).returncode != 0:
                left.append(ns)
        for link in reversed(self.made_links):  # a veth goes with its namespace, perhaps only now
            if ip("link", "del", link, check=False).returncode != 0 and \
                    ip("link", "show", link, check=False).returncode == 0:
                left.append(link)
        return left

    def leftovers(self) -> list[str]:
        name = f"{PREFIX}{self.group}"
        links = [line.split(":")[1].strip().split("@")[0] for line in ip("-o", "link", check=False).stdout.splitlines()
                 if f": {name}" in line]
        spaces = [p.name for p in NETNS_DIR.glob(f"{name}n*")] if NETNS_DIR.is_dir() else []
        return sorted(links + spaces)


def assert_rows_follow(rows: list[dict[str, Any]], spec: str, num_clients: int,
                       explained: dict[tuple[int, int], str]) -> np.ndarray:
    """Every round's participants were online in schedule ``spec`` (seed 0: the off nodes were really
    down, on their own host), and every online client took part unless the churn driver explained
    its miss ((round, client) in ``explained``: a cut host, a late node); the schedule's on matrix."""
    from availability import build_schedule

    want = build_schedule(spec, num_clients, 0).matrix(len(rows)).astype(bool)
    for t, row in enumerate(rows):
        r, got = t + 1, set(row["participants"])
        on = set(np.flatnonzero(want[t]).tolist())
        assert got <= on, (r, got, on)
        assert {c for c in on if (r, c) not in explained} <= got, (r, got, on, explained)
    return want
