"""CPU quota and memory cap for one SuperNode and everything it starts, with cgroups (v1 or v2,
no systemd): :class:`NodeCgroup`. Needs root.

A SuperNode joins its cgroups between fork and exec (:meth:`NodeCgroup.join`), so its
flower-superexec, its ``flwr-clientapp`` processes and its long-lived client worker are born in
them. v1 (``/sys/fs/cgroup/cpu``, ``cpuacct``, ``memory``): ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``, ``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes``: no
swapping around the cap). v2 (``/sys/fs/cgroup/cgroup.controllers``): ``cpu.max``,
``memory.max``, ``memory.swap.max = 0``. The kernel's OOM killer acts inside the cgroup when the
cap is hit; :meth:`NodeCgroup.oom_kills` counts its kills. Unlimited cgroups are made too, to
measure CPU time and peak memory.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ..errors import DeployError

ROOT = Path("/sys/fs/cgroup")
# CFS period: the quota is cpus x PERIOD_US of CPU per PERIOD_US. A short period (10 ms, not the
# kernel's 100 ms default) makes a short burst of work (a few local steps) as slow as a long one:
# with 100 ms, 20 ms of work fit in one period's quota at 0.2 CPU and run at full speed.
PERIOD_US = 10_000
PREFIX = "flchurn-"


def cgroup_version(root: Path = ROOT) -> int | None:
    """1 (v1 cpu + memory hierarchies), 2 (unified) or None (no usable cgroup filesystem)."""
    if (root / "cpu" / "cpu.cfs_quota_us").exists() and (root / "memory" / "memory.limit_in_bytes").exists():
        return 1
    if (root / "cgroup.controllers").exists():
        return 2
    return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as err:
        raise DeployError(f"cannot write {value!r} to {path}: {err.strerror}") from err


def _read_int(path: Path, key: str | None = None) -> int:
    try:
        text = path.read_text()
    except OSError:
        return 0
    if key is None:
        return int(text.split()[0])
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return int(parts[1])
    return 0


class NodeCgroup:
    """The cgroup(s) of one node: ``<root>/<controller>/flchurn-<group>/<name>`` (v1) or
    ``<root>/flchurn-<group>/<name>`` (v2)."""

    def __init__(self, group: str, name: str, *, cpus: float | None = None, mem_mb: int | None = None,
                 root: Path = ROOT) -> None:
        self.version = cgroup_version(root)
        if self.version is None:
            raise DeployError(f"no cgroup filesystem under {root}: CPU and memory caps need cgroups v1 or v2")
        self.root, self.group, self.name = root, PREFIX + group, name
        self.cpus, self.mem_mb = cpus, mem_mb
        if self.version == 1:
            self.cpu = root / "cpu" / self.group / name
            self.acct = (root / "cpuacct" / self.group / name) if (root / "cpuacct").is_dir() else None
            self.mem = root / "memory" / self.group / name
            self.dirs = [d for d in (self.cpu, self.acct, self.mem) if d is not None]
        else:
            self.cpu = self.acct = self.mem = root / self.group / name
            self.dirs = [self.cpu]
        self.created: list[Path] = []

    def create(self) -> None:
        """Make the cgroup(s) and set the limits."""
        for d in self.dirs:  # the group's folder is shared by its nodes: remove_group() removes it
            d.parent.mkdir(exist_ok=True)
        if self.version == 2:
            for p in (self.root, self.root / self.group):
                _write(p / "cgroup.subtree_control", "+cpu +memory")
        for d in self.dirs:
            if not d.exists():
                d.mkdir()
                self.created.append(d)
        if self.version == 1:
            if self.cpus is not None:
                _write(self.cpu / "cpu.cfs_period_us", str(PERIOD_US))
                _write(self.cpu / "cpu.cfs_quota_us", str(max(1000, int(self.cpus * PERIOD_US))))
            if self.mem_mb is not None:
                limit = str(self.mem_mb * 2**20)
                _write(self.mem / "memory.limit_in_bytes", limit)
                if (self.mem / "memory.memsw.limit_in_bytes").exists():
                    _write(self.mem / "memory.memsw.limit_in_bytes", limit)
        else:
            if self.cpus is not None:
                _write(self.cpu / "cpu.max", f"{max(1000, int(self.cpus * PERIOD_US))} {PERIOD_US}")
            if self.mem_mb is not None:
                _write(self.mem / "memory.max", str(self.mem_mb * 2**20))
                if (self.mem / "memory.swap.max").exists():
                    _write(self.mem / "memory.swap.max", "0")

    def join(self) -> None:
        """Move the calling process into the cgroup(s) (runs in the child, before exec)."""
        for d in self.dirs:
            with open(d / "cgroup.procs", "w") as fh:
                fh.write(str(os.getpid()))

    def pids(self) -> list[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(out)

    def oom_kills(self) -> int:
        """Processes the OOM killer has killed in this cgroup so far."""
        if self.version == 1:
            return _read_int(self.mem / "memory.oom_control", "oom_kill")
        return _read_int(self.mem / "memory.events", "oom_kill")

    def peak_mb(self) -> float:
        """Peak memory use of the cgroup so far, MiB."""
        f = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return _read_int(self.mem / f) / 2**20

    def cpu_seconds(self) -> float:
        """CPU time used by the cgroup's processes so far."""
        if self.version == 1:
            return _read_int(self.acct / "cpuacct.usage") / 1e9 if self.acct is not None else 0.0
        return _read_int(self.cpu / "cpu.stat", "usage_usec") / 1e6

    def remove(self, timeout: float = 30.0) -> list[str]:
        """Remove what :meth:`create` made; a process still inside (ours by construction: a
        straggler of a killed tree) is SIGKILLed first. Returns the paths that could not be
        removed."""
        deadline = time.monotonic() + timeout
        while (left_pids := self.pids()) and time.monotonic() < deadline:
            for pid in left_pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        left = []
        for p in reversed(self.created):
            while p.exists():
                try:
                    p.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(str(p))
                        break
                    time.sleep(0.1)
        self.created = [p for p in self.created if p.exists()]
        return left


def remove_group(group: str, root: Path = ROOT) -> list[str]:
    """Remove the (empty) group folders of deployment ``group``; the ones that could not be."""
    left = []
    for p in leftover_cgroups(group, root):
        try:
            os.rmdir(p)
        except OSError:
            left.append(p)
    return left


def leftover_cgroups(group: str, root: Path = ROOT) -> list[str]:
    """Cgroup folders of deployment ``group`` that still exist."""
    name = PREFIX + group
    return sorted(str(p) for p in [*root.glob(f"*/{name}"), root / name] if p.exists())
