"""A deterministic event queue in virtual time: events leave in (time, sequence) order, the
sequence being the order they were pushed, so two events at the same time leave in push order
and a run is the same whatever the payloads are (they are never compared)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, order=True)
class Event:
    time: float
    seq: int
    kind: str = field(compare=False)
    payload: Any = field(compare=False, default=None)


class EventQueue:
    """``push(time, kind, payload)``; ``pop()`` the earliest (ties: first pushed); ``peek()``."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = 0

    def push(self, time: float, kind: str, payload: Any = None) -> Event:
        if not (isinstance(time, (int, float)) and not math.isnan(time)):
            raise ValueError(f"event time must be a number, got {time!r}")
        event = Event(float(time), self._seq, kind, payload)
        self._seq += 1
        heapq.heappush(self._heap, (event.time, event.seq, event))
        return event

    def pop(self) -> Event:
        if not self._heap:
            raise IndexError("pop from an empty EventQueue")
        return heapq.heappop(self._heap)[2]

    def peek(self) -> Event | None:
        return self._heap[0][2] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def events(self) -> list[Event]:
        """The queued events in the order they will leave (a checkpoint's copy; the queue is unchanged)."""
        return [entry[2] for entry in sorted(self._heap)]

    @property
    def next_seq(self) -> int:
        """The sequence number the next push gets."""
        return self._seq

    @classmethod
    def restored(cls, events: list[Event], next_seq: int) -> EventQueue:
        """A queue holding ``events`` (each keeps its time and sequence number) whose next push gets
        ``next_seq``: it releases events exactly as the queue they were copied from."""
        queue = cls()
        seqs = [e.seq for e in events]
        if len(set(seqs)) != len(seqs) or any(not 0 <= q < next_seq for q in seqs):
            raise ValueError(f"restored events need distinct sequence numbers below next_seq={next_seq}, got {seqs}")
        queue._heap = [(e.time, e.seq, e) for e in events]
        heapq.heapify(queue._heap)
        queue._seq = int(next_seq)
        return queue


def run_events(queue: EventQueue, handle: Callable[[Event], bool]) -> Event | None:
    """The event loop of every simulated run: pop events in (time, sequence) order and hand each to
    ``handle`` (the policy: the asynchronous buffer, the synchronous barrier) until it returns True
    (stop) or the queue is empty. Returns the last event handled (None: none was)."""
    last = None
    while queue:
        last = queue.pop()
        if handle(last):
            break
    return last
