"""The asynchronous loop in a deployment: real time, Flower's Grid push and pull, no round barrier."""

from __future__ import annotations

from typing import Any


def run_realtime(grid: Any, setup: Any, strategy: Any, rec: Any) -> float:
    raise NotImplementedError
