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

A node can die while none of the round's messages runs on it (Flower's pool hands out the actors
that came back last, so an idle one may not be asked again): at each round's end Ray's own node
table is read too, and a node alive when the run began that Ray now lists dead is reported the
same way (``error``: ``node died``, no actor), once.
"""

from __future__ import annotations

import threading
from logging import WARNING
from typing import Any

from flwr.common.logger import log

from flowerlink import guard_ray_actor_pool, ray_actor_node

from .versions import driven_ray, node_record

ROW_KEY = "ray-workers-lost"
NODE_DIED = "node died"  # the error of a loss read from Ray's node table (no actor was running there)


def dead_ray_nodes() -> dict[str, str] | None:
    """Node id -> address of every node Ray lists as dead; None when this process drives no Ray."""
    ray = driven_ray()
    if ray is None:
        return None
    try:
        return {r["node-id"]: r["address"] for r in map(node_record, ray.nodes()) if not r["alive"]}
    except Exception:  # noqa: BLE001 - a record; the round's row is written either way
        return None


class LostWorkers:
    """The losses seen since the last :meth:`take` (a Flower worker thread notes them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: list[dict[str, str]] = []
        self._reported: set[str] = set()  # nodes already in a row, or dead before the run began

    def begin(self) -> None:
        """The run starts: nodes Ray already lists as dead are not this run's losses."""
        with self._lock:
            self._seen, self._reported = [], set(dead_ray_nodes() or {})

    def note(self, actor_id: str, error: BaseException) -> None:
        entry = {**ray_actor_node(actor_id), "actor": actor_id, "error": type(error).__name__}
        with self._lock:
            self._seen.append(entry)
        where = f"node {entry.get('ray-node') or 'unknown'} ({entry.get('address') or 'address unknown'})"
        log(WARNING, "Ray worker lost: %s, actor %s (%s); its message runs again on a live actor: a lost worker, "
            "not an offline client", where, actor_id, type(error).__name__)

    def take(self) -> dict[str, Any]:
        """``{"ray-workers-lost": [...]}`` for a round's row, emptied; {} when none was lost: the
        actors lost under a message, then the nodes Ray lists dead that no row named yet."""
        dead = dead_ray_nodes() or {}
        with self._lock:
            seen, self._seen = self._seen, []
            self._reported |= {e.get("ray-node", "") for e in seen}
            died = {node: address for node, address in dead.items() if node not in self._reported}
            self._reported |= set(died)
        for node, address in died.items():
            log(WARNING, "Ray worker lost: node %s (%s) is dead in Ray's node table (no message failed on it): a "
                "lost worker, not an offline client", node, address or "address unknown")
        seen += [{"ray-node": node, "address": address, "actor": "", "error": NODE_DIED} for node, address in died.items()]
        return {ROW_KEY: seen} if seen else {}


LOST = LostWorkers()


def watch_ray_workers() -> bool:
    """Install the guard (idempotent); False where Flower's Ray backend is not importable."""
    return guard_ray_actor_pool(LOST.note)
