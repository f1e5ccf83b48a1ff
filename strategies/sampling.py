"""Which connected nodes a round addresses: Flower's FedAvg arguments, without waiting forever.

Flower's ``FedAvg`` addresses ``max(int(len(connected) * fraction), min_nodes)`` nodes after
``sample_nodes`` has waited, sleeping 1 s for as long as it takes, until ``min_available_nodes``
are connected, and draws them with Python's global ``random``. :class:`Sampling` keeps those sizes
(never more nodes than are connected), draws with the strategy's own seeded generator, and waits
for ``min_available_nodes`` only before the first round and at most ``node_wait`` seconds: after
that, a node that is not connected is an unavailable client, which is what these rules are for.

Node ids are Flower's uint64: a list of them never goes through NumPy (ids on both sides of 2^63
make a float64 array, whose values are other, non-existent, nodes). A draw picks indices into the
list; :func:`check_destinations` makes a message to a node the grid never listed an error.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
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
        """``size`` of ``nodes``, drawn without replacement by ``rng`` (all of them: no draw).
        The draw is of indices (:func:`draw`): the ids themselves never become a NumPy array."""
        nodes = sorted(int(n) for n in nodes)
        k = self.size(len(nodes), train)
        if k >= len(nodes):
            return nodes
        return sorted(draw(nodes, k, rng))

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


def draw(nodes: list[int], k: int, rng: np.random.Generator, p: np.ndarray | None = None) -> list[int]:
    """``k`` of ``nodes`` without replacement (probabilities ``p``, default uniform), in draw order.
    Draws indices, so any Python int id comes back as it was (uint64 included)."""
    return [nodes[int(i)] for i in rng.choice(len(nodes), size=k, replace=False, p=p)]


def check_destinations(node_ids: Iterable[int], connected: Iterable[int], who: str) -> list[int]:
    """``node_ids`` sorted; ValueError when ``node_ids`` holds a node that is not among the ``connected`` ones: Flower
    would drop such a message ("Invalid destination node ID") and no reply would ever come, which
    a rule would count as an unavailable client. A wrong id is a bug, never unavailability."""
    node_ids, connected = sorted(node_ids), set(connected)
    unknown = sorted(set(node_ids) - connected)
    if unknown:
        raise ValueError(f"{who} addressed {len(unknown)} node id(s) that are not connected "
                         f"({unknown[:3]}{'...' if len(unknown) > 3 else ''}; connected: {len(connected)}): "
                         f"node ids are uint64, never pass them through NumPy (draw indices instead)")
    return node_ids
