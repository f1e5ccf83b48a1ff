"""Between the strategy and Flower's grid: who is connected, who they are, who is reachable.

- :func:`wait_for_nodes` waits (bounded) until the expected nodes are connected: in simulation
  round 1 can otherwise see zero nodes.
- :func:`discover_clients` asks every unknown node for its client id (a QUERY message), so the
  schedule can be applied by client id before any training.
- :class:`AvailabilityGrid` wraps a grid: a TRAIN or EVALUATE message for a client that is offline
  in that message's round is never delivered, so its reply never comes, as in a deployment
  where the node is really gone. The strategy learns availability only from who replied.
- :func:`fast_pull` wraps a deployment's grid in :class:`PollingGrid`: Flower's HTTP grid looks
  for replies every 3 s, which is most of a short round; this one looks every 0.1 s.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import cast

from flwr.app import Message, MessageType, RecordDict
from flwr.serverapp import Grid

from availability import Schedule
from strategies.protocol import IGNORE_AVAILABILITY, SERVER_ROUND

log = logging.getLogger(__name__)


class NodesMissing(RuntimeError):
    pass


def wait_for_nodes(grid: Grid, expected: int, timeout: float, poll: float = 0.2) -> list[int]:
    """Node ids once ``expected`` nodes are connected; NodesMissing after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= expected:
            return nodes
        if time.monotonic() >= deadline:
            raise NodesMissing(
                f"{len(nodes)} node(s) connected after {timeout:.0f} s, expected {expected} "
                f"(run config num-clients / min-nodes). In simulation pass --federation-config "
                f"\"num-supernodes={expected}\"; in a deployment start that many SuperNodes"
            )
        time.sleep(poll)


def discover_clients(grid: Grid, known: dict[int, int], timeout: float) -> dict[int, int]:
    """Update ``known`` (node id -> client id) for connected nodes not in it yet."""
    unknown = [n for n in sorted(grid.get_node_ids()) if n not in known]
    if not unknown:
        return known
    queries = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in unknown]
    for reply in grid.send_and_receive(queries, timeout=timeout):
        if reply.has_error() or "identity" not in reply.content:
            log.warning("node %d did not say who it is", reply.metadata.src_node_id)
            continue
        known[reply.metadata.src_node_id] = int(cast(int, reply.content.metric_records["identity"]["client-id"]))
    return known


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


PULL_INTERVAL_VAR = "FLCHURN_PULL_INTERVAL"  # env: seconds between two looks for replies (Flower's HTTP grid: 3)
PULL_INTERVAL = 0.1


class PollingGrid(DelegatingGrid):
    """``send_and_receive`` over the wrapped grid's ``push_messages`` / ``pull_messages``, looking
    for replies every ``interval`` seconds instead of Flower's 3 s. Same contract as Flower's:
    returns the replies that arrived before ``timeout`` (``None``: waits for all of them)."""

    def __init__(self, grid: Grid, interval: float = PULL_INTERVAL) -> None:
        if not interval > 0:
            raise ValueError(f"PollingGrid interval must be > 0 seconds, got {interval!r}")
        super().__init__(grid)
        self.interval = interval

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        pending = set(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if pending and deadline is not None and time.monotonic() >= deadline:
                break
            if pending:
                time.sleep(self.interval)
        return replies


def fast_pull(grid: Grid, interval: float | None = None) -> Grid:
    """``grid`` in a :class:`PollingGrid` when it is Flower's HTTP grid (a deployment); any other
    grid (simulation's in-memory grid polls every 0.1 s already; the in-process grid answers at
    once) is returned as it is."""
    from flwr.superlink.grid.http_grid import HttpGrid

    if interval is None:
        interval = float(os.environ.get(PULL_INTERVAL_VAR, PULL_INTERVAL))
    return PollingGrid(grid, interval) if isinstance(grid, HttpGrid) else grid


class AvailabilityGrid(DelegatingGrid):
    """A grid through which clients offline in a message's round are unreachable."""

    def __init__(self, grid: Grid, schedule: Schedule, client_of_node: dict[int, int],
                 discovery_timeout: float = 30.0) -> None:
        super().__init__(grid)
        self.schedule = schedule
        self.client_of_node = client_of_node
        self.discovery_timeout = discovery_timeout

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.grid.push_messages(self.reachable(list(messages)))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        keep = self.reachable(list(messages))
        return self.grid.send_and_receive(keep, timeout=timeout) if keep else []

    def reachable(self, messages: list[Message]) -> list[Message]:
        """The messages whose destination is online in the message's round."""
        if any(m.metadata.dst_node_id not in self.client_of_node for m in messages):
            discover_clients(self.grid, self.client_of_node, self.discovery_timeout)
        keep, online = [], {}  # online: 0-based round -> A(·, t), computed once per round
        for m in messages:
            client = self.client_of_node.get(m.metadata.dst_node_id)
            config = m.content.config_records.get("config")
            if client is None or config is None or SERVER_ROUND not in config:
                keep.append(m)  # not a round message, or a node that never said who it is
            elif config.get(IGNORE_AVAILABILITY, False):
                keep.append(m)  # an oracle round (e.g. FL-FDMS's round 0, the Full baseline)
            else:
                t = int(cast(int, config[SERVER_ROUND])) - 1
                if t not in online:
                    online[t] = self.schedule.available(t)
                if not 0 <= client < len(online[t]):
                    self.schedule.is_available(client, t)  # raises, naming the bad client id
                if online[t][client]:
                    keep.append(m)
        return keep
