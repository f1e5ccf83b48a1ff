"""Follow a run through the folder its ServerApp writes: ``config.json`` (the server has
started) and ``metrics.jsonl`` (one line per finished round), as typed events for the churn
driver (:meth:`RunFollower.events`): :class:`RunStarted`, :class:`RoundFinished`, :class:`Tick`;
the run loop adds :class:`Submitted` and :class:`RunDone`. ``t`` is ``time.monotonic()``."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Submitted:
    """``flwr run`` has accepted the run (wall-clock churn counts from here)."""

    t: float


@dataclass(frozen=True)
class RunStarted:
    """The server has started (a new ``config.json``): it waits for ``min-nodes``, then round 1."""

    t: float


@dataclass(frozen=True)
class RoundFinished:
    """Round ``round``'s line is in ``metrics.jsonl``: the server is about to start the next."""

    round: int
    t: float
    row: dict[str, Any] = field(compare=False)


@dataclass(frozen=True)
class Tick:
    """Time passes (the run loop's every ~0.1 s): due timers fire."""

    t: float


@dataclass(frozen=True)
class RunDone:
    """The run has finished (any status) or was given up: nothing more to drive."""

    t: float


Event = Submitted | RunStarted | RoundFinished | Tick | RunDone


class RunFollower:
    """Tails a run folder's ``metrics.jsonl`` and notices the server's start (``config.json``
    written). Only what the server writes after construction counts: a resumed run's folder
    already holds ``config.json`` and the checkpoint's rounds (the launcher has cut
    ``metrics.jsonl`` back to them), so the start is a new ``config.json`` and the rows are those
    appended from then on."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.rows: list[dict[str, Any]] = []
        self.started_at: float | None = None
        self._config_was = self._config_stamp()
        metrics = self.run_dir / "metrics.jsonl"
        self._offset = metrics.stat().st_size if metrics.exists() else 0
        self._partial = ""

    def _config_stamp(self) -> tuple[int, int] | None:
        try:
            st = (self.run_dir / "config.json").stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def poll(self) -> list[dict[str, Any]]:
        if self.started_at is None:
            stamp = self._config_stamp()
            if stamp is None or stamp == self._config_was:
                return []
            self.started_at = time.monotonic()
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        with path.open() as fh:
            fh.seek(self._offset)
            chunk = fh.read()
            self._offset = fh.tell()
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()  # an unfinished line waits for the next poll
        new = [json.loads(line) for line in lines if line.strip()]
        self.rows.extend(new)
        return new

    def events(self) -> Iterator[Event]:
        """What happened since the last call: :class:`RunStarted` (once), a :class:`RoundFinished`
        per new line, then a :class:`Tick`. Lazy: each event's ``t`` is taken when it is handed
        out, after the previous one was handled (a driver may wait while handling one)."""
        was_started = self.started_at is not None
        rows = self.poll()
        if not was_started and self.started_at is not None:
            yield RunStarted(self.started_at)
        for row in rows:
            yield RoundFinished(int(row["round"]), time.monotonic(), row)
        yield Tick(time.monotonic())
