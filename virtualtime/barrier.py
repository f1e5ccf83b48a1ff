"""The synchronous barrier as a policy of the event loop (:func:`.events.run_events`): when a
round closes.

A round that started at T closes at ``min(T + deadline, the min_replies-th arrival)``; when every
client still coming (none lost) is in before that, at the last arrival. With no deadline and no
close among the arrivals: at the last arrival, or with none, when the first absent client is back
online (T if none ever is). An arrival after the close is late (:meth:`.jobs.JobFate.late`); its
device stays busy until it ends. Arrivals are events before the deadline's at the same time: a
reply that comes exactly at the deadline is on time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from .events import Event, EventQueue, run_events

ARRIVAL, DEADLINE = "arrival", "deadline"


def barrier_close(t0: float, arrivals: Mapping[int, float], *, deadline: float = math.inf, min_replies: int = 0,
                  none_lost: bool = True, back: Iterable[float] = ()) -> float:
    """When the round that started at ``t0`` closes (the module docstring). ``arrivals``: client ->
    its reply's arrival time (replies that come); ``deadline``: seconds after ``t0`` (inf: none);
    ``none_lost``: no addressed client lost its job; ``back``: when the absent clients are online again."""
    queue = EventQueue()
    for client, t in arrivals.items():
        queue.push(t, ARRIVAL, client)
    if math.isfinite(deadline):
        queue.push(t0 + deadline, DEADLINE)
    came = 0

    def handle(event: Event) -> bool:
        nonlocal came
        if event.kind == DEADLINE:
            return True
        came += 1
        return came == min_replies or (none_lost and came == len(arrivals))

    last = run_events(queue, handle)
    if last is not None:
        return last.time
    later = [b for b in back if math.isfinite(b)]
    return min(later) if later else t0
