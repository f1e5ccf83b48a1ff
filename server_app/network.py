"""Between the strategy and Flower's grid: who is connected, who they are, who is reachable.

- :func:`wait_for_nodes` waits (bounded) until the expected nodes are connected: in simulation
  round 1 can otherwise see zero nodes.
- :class:`AvailabilityGrid` wraps a grid: a TRAIN or EVALUATE message for a client that is offline
  in that message's round is never delivered, so its reply never comes, as in a deployment
  where the node is really gone, and once the round loop has said which round it runs
  (:meth:`~AvailabilityGrid.begin_round`) an offline node is not even listed by ``get_node_ids``
  (a deployment's SuperLink lists only the SuperNodes running). The strategy learns availability
  only from who replied. Who a node is comes from :mod:`server_app.identity`
  (:func:`~server_app.identity.discover_clients`, before any training).
- :func:`fast_pull` wraps a deployment's grid in :class:`PollingGrid`: Flower's HTTP grid looks
  for replies every 3 s, which is most of a short round; this one looks every 0.1 s, and holds
  the round's deadline also while a reply's body is still uploading (:func:`bounded_object_pulls`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from flwr.app import Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from availability import Schedule
from flowerlink import is_http_grid, wrap_http_grid_object_pulls
from strategies.grid import DelegatingGrid
from strategies.protocol import IGNORE_AVAILABILITY, server_round_of

from .identity import discover_clients

log = logging.getLogger(__name__)
flwr_log = logging.getLogger("flwr")  # Flower's logger: `flwr run --stream` shows what it says


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


PULL_INTERVAL_VAR = "FLCHURN_PULL_INTERVAL"  # env: seconds between two looks for replies (Flower's HTTP grid: 3)
PULL_INTERVAL = 0.1


OBJECT_BACKOFF = 0.05  # s: the first wait for a reply's object that is not uploaded yet (Flower: 1 s)
OBJECT_BACKOFF_CAP = 0.2  # s: the longest such wait (Flower: 10 s, doubling from 1 s)
_PULL_UNTIL: ContextVar[float | None] = ContextVar("pull_until", default=None)  # monotonic deadline


def _bounded(pull_objects: Callable[..., dict[str, bytes]]) -> Callable[..., dict[str, bytes]]:
    def pull_objects_until(object_ids: list[str], pull_object_fn: Callable[[str], bytes],
                           **kwargs: Any) -> dict[str, bytes]:
        until = _PULL_UNTIL.get()
        if until is not None:
            kwargs["max_time"] = max(0.0, until - time.monotonic())
        kwargs.update(initial_backoff=OBJECT_BACKOFF, backoff_cap=OBJECT_BACKOFF_CAP)
        return pull_objects(object_ids, pull_object_fn, **kwargs)

    pull_objects_until.bounded = True  # type: ignore[attr-defined]
    return pull_objects_until


def bounded_object_pulls() -> None:
    """Make Flower's HTTP grid (the ServerApp's side of a deployment) wait for a reply's objects
    at most until :class:`PollingGrid`'s deadline, looking every 0.05-0.2 s.

    Flower 1.42's ``HttpGrid.pull_messages`` takes a reply as soon as its message reaches the
    SuperLink, then pulls its objects (the arrays) with retries that back off 1, 2, 4 ... 10 s
    for up to 7,200 s. So a node that has sent its reply's message but is still uploading the
    model held the round past ``round-deadline`` (a 1 mbit/s node, on time at 7-10 s under a
    5.9 s deadline; a hostile node, for two hours), and a reply's measured time was rounded up
    to the backoff (1-3 s more). Idempotent; the pinned Flower's function is checked by
    ``tests/test_clock_emulation.py``."""
    wrap_http_grid_object_pulls(_bounded)


@contextlib.contextmanager
def _objects_until(deadline: float | None) -> Iterator[None]:
    token = _PULL_UNTIL.set(deadline)
    try:
        yield
    finally:
        _PULL_UNTIL.reset(token)


def _incomplete(m: Message) -> bool:
    """A reply Flower's grid gave up on because its objects did not all arrive (here: by the
    deadline): the node replied, its reply is late."""
    return m.has_error() and m.error.code == ErrorCode.MESSAGE_UNAVAILABLE


class PollingGrid(DelegatingGrid):
    """``send_and_receive`` over the wrapped grid's ``push_messages`` / ``pull_messages``, looking
    for replies every ``interval`` seconds instead of Flower's 3 s. Same contract as Flower's:
    returns the replies that arrived before ``timeout`` (``None``: waits for all of them), whole:
    a reply whose arrays are still uploading at the deadline is dropped, late (with
    :func:`bounded_object_pulls`). ``arrived`` keeps, for the last call, each answered message's
    seconds from the end of the push (where ``timeout`` starts) to the look that found its whole
    reply (:func:`reply_seconds`); ``incomplete``, the ids of the replies dropped so."""

    def __init__(self, grid: Grid, interval: float = PULL_INTERVAL) -> None:
        if not interval > 0:
            raise ValueError(f"PollingGrid interval must be > 0 seconds, got {interval!r}")
        super().__init__(grid)
        self.interval = interval
        self.arrived: dict[str, float] = {}  # of the last send_and_receive: message id -> s to its reply
        self.incomplete: set[str] = set()  # of the last send_and_receive: replies whose body missed the deadline

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        pending = set(self.grid.push_messages(messages))
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        replies: list[Message] = []
        self.arrived, self.incomplete = {}, set()
        while pending:
            with _objects_until(deadline):
                got = list(self.grid.pull_messages(pending))
            seen = time.monotonic() - start
            for m in got:
                if deadline is not None and _incomplete(m):
                    self.incomplete.add(m.metadata.reply_to_message_id)
                    flwr_log.debug("a reply's arrays were still uploading at the round's deadline: late (node "
                                   "%s)", m.metadata.src_node_id)
                    continue
                replies.append(m)
                self.arrived.setdefault(m.metadata.reply_to_message_id, seen)
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
    if interval is None:
        interval = float(os.environ.get(PULL_INTERVAL_VAR, PULL_INTERVAL))
    if not is_http_grid(grid):
        return grid
    bounded_object_pulls()
    return PollingGrid(grid, interval)


def reply_seconds(grid: Grid) -> dict[str, float]:
    """Message id -> seconds from its push to its reply's arrival, for the last ``send_and_receive``
    of the :class:`PollingGrid` in or under ``grid`` (a deployment); {} for any other grid."""
    inner: Any = grid
    while inner is not None:
        if isinstance(inner, PollingGrid):
            return dict(inner.arrived)
        inner = getattr(inner, "grid", None)
    return {}


class AvailabilityGrid(DelegatingGrid):
    """A grid through which clients offline in a message's round are unreachable.

    A round message (one whose config carries ``server-round``) reaches its node only when the
    node's client is online in that round. It FAILS CLOSED: a node whose client id is not known
    yet is asked (:func:`discover_clients`, at most ``discovery_timeout`` s the first time, at most
    ``retry_timeout`` s in later rounds) and receives nothing until it has answered; each round
    that withholds messages so says on Flower's logger (WARNING: ``flwr run --stream`` shows it).
    Messages without a round (queries, the user's own) pass unchanged. The round of a message is
    :meth:`round_of` (here ``server-round``; :class:`server_app.churngrid.ChurnGrid` dates more);
    each call of :meth:`reachable` leaves the messages it held back in ``withheld``.
    """

    def __init__(self, grid: Grid, schedule: Schedule, client_of_node: dict[int, int],
                 discovery_timeout: float = 30.0, retry_timeout: float = 10.0) -> None:
        super().__init__(grid)
        self.schedule = schedule
        self.client_of_node = client_of_node
        self.discovery_timeout = discovery_timeout
        self.retry_timeout = min(retry_timeout, discovery_timeout)
        self.asked: set[int] = set()  # nodes asked who they are at least once
        self.refused: set[int] = set()  # nodes whose QUERY reply stated no usable client id
        self.out_of_range: set[int] = set()  # nodes that stated a client id the schedule lacks (logged once)
        self.withheld: list[Message] = []  # of the last reachable(): the messages not delivered
        self.identity_errors: dict[int, str] = {}  # node -> why its identity answer was refused
        self.asked_in: dict[int, int] = {}  # node -> the listing round it was last asked who it is
        self.round_now: int | None = None  # the loop's round (begin_round); None: every connected node listed

    @property
    def num_clients(self) -> int:
        """N, the schedule's clients: a rule not told N takes it from here, not from the nodes
        listed at its first round (only the online ones)."""
        return self.schedule.num_clients

    def round_of(self, m: Message) -> int | None:
        """The 1-based round of message ``m`` (None: not a round message)."""
        return server_round_of(m.content)

    # ------------------------------------------------------------------ listing
    def begin_round(self, rnd: int, every_node: bool = False) -> None:
        """The round loop starts round ``rnd``: from now :meth:`get_node_ids` lists the connected
        nodes whose client is online in it, as a deployment's SuperLink lists only the SuperNodes
        the churn driver left running, so a rule's sampling (``fraction_train``, power-of-choice's
        candidates, ``fraction_evaluate``) chooses among the online in simulation too. With
        ``every_node`` (an oracle round: ``ignore-availability``) every connected node is listed."""
        self.round_now = None if every_node else int(rnd)

    def listing_round(self) -> int | None:
        """The round whose online nodes :meth:`get_node_ids` lists (None: every connected node;
        before :meth:`begin_round`, e.g. while the nodes are discovered)."""
        return self.round_now

    def get_node_ids(self) -> Iterable[int]:
        """The connected nodes online in :meth:`listing_round` (every connected node without one).
        A node whose client id is unknown is asked (:meth:`learn`, once per round); until it has
        answered it stays listed, as a connected SuperNode that does not answer is in a deployment,
        and receives nothing (fail closed: :meth:`reachable`), so the strategy counts it unavailable."""
        nodes = sorted(self.grid.get_node_ids())
        rnd = self.listing_round()
        if rnd is None:
            return nodes
        self.learn(nodes, rnd)
        online = set(self.online_nodes(nodes, rnd))
        return [n for n in nodes if n in online or n not in self.client_of_node]

    def online_nodes(self, nodes: Iterable[int], rnd: int) -> list[int]:
        """Those of ``nodes`` whose client is online in round ``rnd`` (1-based; round 0: round 1's)."""
        online = self.schedule.available(max(rnd, 1) - 1)
        return [n for n in nodes if (c := self.client_of_node.get(n)) is not None and 0 <= c < len(online)
                and online[c]]

    def learn(self, nodes: list[int], rnd: int) -> None:
        """Ask the listed nodes whose client id is unknown (each at most once per listing round)."""
        unknown = [n for n in nodes if n not in self.client_of_node and n not in self.refused
                   and self.asked_in.get(n) != rnd]
        if not unknown:
            return
        wait = self.retry_timeout if all(n in self.asked_in for n in unknown) else self.discovery_timeout
        for n in unknown:
            self.asked_in[n] = rnd
        self.asked |= set(unknown)
        discover_clients(self.grid, self.client_of_node, wait, self.refused, rnd, nodes=unknown,
                         errors=self.identity_errors)

    def availability_round(self, rnd: int) -> int:
        """The round whose schedule decides whether a message of round ``rnd`` is delivered."""
        return rnd

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.grid.push_messages(self.reachable(list(messages)))

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        keep = self.reachable(list(messages))
        return self.grid.send_and_receive(keep, timeout=timeout) if keep else []

    def identify(self, messages: list[Message]) -> None:
        """Ask the destinations of round messages whose client id is unknown (bounded wait)."""
        unknown = {m.metadata.dst_node_id for m in messages if self.round_of(m) is not None
                   and m.metadata.dst_node_id not in self.client_of_node} - self.refused
        if unknown:
            wait = self.retry_timeout if unknown <= self.asked else self.discovery_timeout
            self.asked |= unknown
            discover_clients(self.grid, self.client_of_node, wait, self.refused, errors=self.identity_errors)

    def reachable(self, messages: list[Message]) -> list[Message]:
        """The messages whose destination is online in the message's round."""
        self.identify(messages)
        keep: list[Message] = []
        self.withheld = []
        online: dict[int, Any] = {}  # 0-based round -> A(·, t), computed once per round
        withheld: dict[int, list[int]] = {}  # round -> nodes whose client id is unknown
        for m in messages:
            rnd = self.round_of(m)
            node = m.metadata.dst_node_id
            client = self.client_of_node.get(node)
            oracle = any(r.get(IGNORE_AVAILABILITY, False) for r in m.content.config_records.values())
            if rnd is None or oracle:
                keep.append(m)  # not a round message, or an oracle round (FL-FDMS's round 0, Full)
            elif client is None:
                withheld.setdefault(rnd, []).append(node)  # fail closed: unknown until it says
                self.withheld.append(m)
            else:
                t = max(self.availability_round(rnd), 1) - 1  # round 0 (initial parameters): round 1's
                if t not in online:
                    online[t] = self.schedule.available(t)
                if not 0 <= client < len(online[t]):
                    self.unscheduled(node, client, len(online[t]))  # fail closed, as an unknown node
                    self.withheld.append(m)
                elif online[t][client]:
                    keep.append(m)
                else:
                    self.withheld.append(m)
        for rnd, nodes in withheld.items():
            flwr_log.warning("availability, round %d: %d node(s) have not said which client they are (%s): they "
                             "receive nothing until they do (%s)", rnd, len(nodes),
                             ", ".join(str(n) for n in sorted(nodes)[:5]), self.why_unknown(nodes))
        return keep

    def why_unknown(self, nodes: list[int]) -> str:
        """Why these nodes' client ids are unknown: the exception their identity answer raised, else
        the likely fix."""
        said = sorted({self.identity_errors[n] for n in nodes if n in self.identity_errors})
        if said:
            return "their answer: " + "; ".join(said[:3])
        return ("no answer: does their ClientApp use client_app.dropin.availability_mod (and, with "
                "@app.train handlers, app.query(\"identity\")(identity)), with a partition-id in its node config?")

    def unscheduled(self, node: int, client: int, n: int) -> None:
        """Log once that ``node`` states a client id outside the schedule's [0, n)."""
        if node not in self.out_of_range:
            self.out_of_range.add(node)
            flwr_log.warning("availability: node %d says it hosts client %d, outside the schedule's clients "
                             "[0, %d): it receives no round message", node, client, n)
