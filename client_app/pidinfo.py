"""A process's start time from /proc, without Flower or torch: what names a SuperNode's worker
(``client_app.worker.address``), read also by the SuperNode command before its own imports
(``deploy.warmstart``)."""

from __future__ import annotations

from pathlib import Path


def start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
