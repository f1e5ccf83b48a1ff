"""Which connected nodes a round addresses: Flower's FedAvg arguments, without waiting forever.

Flower's ``FedAvg`` addresses ``max(int(len(connected) * fraction), min_nodes)`` nodes after
``sample_nodes`` has waited, sleeping 1 s for as long as it takes, until ``min_available_nodes``
are connected, and draws them with Python's global ``random``. :class:`Sampling` keeps those sizes
(never more nodes than are connected), draws with the strategy's own seeded generator, and waits
for ``min_available_nodes`` only before the first round and at most ``node_wait`` seconds: after
that, a node that is not connected is an unavailable client, which is what these rules are for.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
from flwr.serverapp import Grid

log = logging.getLogger("flwr")


@dataclass(frozen=True)
class Sampling:
    """Flower's sampling arguments (same names, same meaning) plus the bound on the first wait."""

    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_nodes: int = 2
    min_evaluate_nodes: int = 2
    min_available_nodes: int = 2
    node_wait: float = 60.0  # seconds; the most the first round waits for min_available_nodes

    def __post_init__(self) -> None:
        for name in ("fraction_train", "fraction_evaluate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1] (Flower's meaning: the share of "
                                 f"the connected nodes a round addresses), got {value!r}")
        for name in ("min_train_nodes", "min_evaluate_nodes", "min_available_nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not (math.isfinite(self.node_wait) and self.node_wait >= 0):
            raise ValueError(f"node_wait must be a finite number of seconds >= 0, got {self.node_wait!r}")

    def size(self, connected: int, train: bool) -> int:
        """How many of ``connected`` nodes a round addresses (0 when the fraction is 0, as Flower)."""
        fraction = self.fraction_train if train else self.fraction_evaluate
        minimum = self.min_train_nodes if train else self.min_evaluate_nodes
        if fraction == 0.0:
            return 0
        return min(connected, max(int(connected * fraction), minimum))

    def sample(self, nodes: list[int], train: bool, rng: np.random.Generator) -> list[int]:
        """``size`` of ``nodes``, drawn without replacement by ``rng`` (all of them: no draw)."""
        nodes = sorted(nodes)
        k = self.size(len(nodes), train)
        if k >= len(nodes):
            return nodes
        return sorted(int(n) for n in rng.choice(nodes, size=k, replace=False))

    def wait(self, grid: Grid, minimum: int, settle: float = 0.0, poll: float = 0.1) -> list[int]:
        """The connected node ids once ``minimum`` are connected (and, with ``settle`` > 0, their
        number has not changed for ``settle`` seconds), or after ``node_wait`` seconds with whoever
        is connected then: never forever."""
        deadline = time.monotonic() + self.node_wait
        nodes = sorted(grid.get_node_ids())
        stable_since, count = time.monotonic(), len(nodes)
        while time.monotonic() < deadline:
            if len(nodes) != count:
                stable_since, count = time.monotonic(), len(nodes)
            if len(nodes) >= minimum and time.monotonic() - stable_since >= settle:
                return nodes
            time.sleep(poll)
            nodes = sorted(grid.get_node_ids())
        if len(nodes) < minimum:
            log.warning("%d node(s) connected after waiting node_wait=%gs for min_available_nodes=%d; "
                        "going on with them (a node that is not connected counts as unavailable)",
                        len(nodes), self.node_wait, minimum)
        return nodes
