"""Lost Ray workers in a simulation: named, and never counted as offline clients.

In Flower 1.42's Ray simulation an actor whose node dies (a worker machine lost, its raylet
killed) went back into the actor pool, and every later message handed to it failed at once
with ``RayActorError``: Flower made those error replies, which the strategy reads as clients
that were unavailable (``docs/engines.md``, "A Ray cluster"). :func:`watch_ray_workers` installs
:func:`flowerlink.guard_ray_actor_pool` in the ``flwr-simulation`` process: the lost actor leaves
the pool and the message it was running runs again on a live actor, so the round gets that
client's reply as if nothing happened. Each loss is logged at once (``Ray worker lost: node
<id> (<address>) ...``) and kept for the round's row in ``metrics.jsonl``
(``ray-workers-lost``: the Ray node, its address, the actor, the error).
"""

from __future__ import annotations

import threading
from logging import WARNING
from typing import Any

from flwr.common.logger import log

from flowerlink import guard_ray_actor_pool, ray_actor_node

ROW_KEY = "ray-workers-lost"


class LostWorkers:
    """The losses seen since the last :meth:`take` (a Flower worker thread notes them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[dict[str, str]] = []

    def note(self, actor_id: str, error: BaseException) -> None:
        entry = {**ray_actor_node(actor_id), "actor": actor_id, "error": type(error).__name__}
        with self._lock:
            self._seen.append(entry)
        where = f"node {entry.get('ray-node') or 'unknown'} ({entry.get('address') or 'address unknown'})"
        log(WARNING, "Ray worker lost: %s, actor %s (%s); its message runs again on a live actor: a lost worker, "
            "not an offline client", where, actor_id, type(error).__name__)

    def take(self) -> dict[str, Any]:
        """``{"ray-workers-lost": [...]}`` for a round's row, emptied; {} when none was lost."""
        with self._lock:
            seen, self._seen = self._seen, []
        return {ROW_KEY: seen} if seen else {}


LOST = LostWorkers()


def watch_ray_workers() -> bool:
    """Install the guard (idempotent); False where Flower's Ray backend is not importable."""
    return guard_ray_actor_pool(LOST.note)
