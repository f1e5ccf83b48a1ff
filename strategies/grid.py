"""A grid that hands every call to the grid it wraps: the base of the grids that change some
calls (the secure driver's stage grid here; the ServerApp's availability, polling and virtual-clock
grids in :mod:`server_app`)."""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


class DelegatingGrid(Grid):
    """A grid that hands every call to the grid it wraps (subclasses change some)."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def set_run(self, run):  # noqa: D102
        self.grid.set_run(run)

    @property
    def run(self):  # noqa: D102
        return self.grid.run

    def create_message(self, *args, **kwargs):  # noqa: D102
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.grid.send_and_receive(messages, timeout=timeout)
