"""Which node may speak for which client: stable client ids bound to nodes.

A reply reports its ``client-id`` (the partition id; the node id when it reports none). The first
node whose reply for a client id is accepted is bound to that id for the run, so no node can write
into another client's stored state. :class:`ClientBinding` holds the binding (part of every
checkpoint), decides which claims of a round stand (:meth:`ClientBinding.check`) and binds the
accepted ones (:meth:`ClientBinding.bind`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)
flwr_log = logging.getLogger("flwr")


class IdClaim(Protocol):
    """What a claim needs: the node that sent it and the client id it claims."""

    node_id: int
    client_id: int


C = TypeVar("C", bound=IdClaim)


class ClientBinding:
    """The node <-> client id binding of a run.

    ``node_of_client``: client id -> the node bound to it; ``client_of_node``: node id -> client
    id of its last accepted reply (or probe).
    """

    def __init__(self) -> None:
        self.client_of_node: dict[int, int] = {}
        self.node_of_client: dict[int, int] = {}

    def check(self, claims: list[C], connected: set[int], reject: Callable[[int, str], None]) -> list[C]:
        """The claims that stand, in the order given (a round's arrival order); the others go to
        ``reject`` (:class:`RoundClaims`, one claim at a time)."""
        round_claims = self.round(connected)
        return [r for r in claims if round_claims.take(r, reject)]

    def round(self, connected: set[int]) -> RoundClaims:
        """The verdicts on one round's claims, one claim at a time (:class:`RoundClaims`)."""
        return RoundClaims(self, connected)

    def bind(self, accepted: Sequence[IdClaim]) -> None:
        """Bind the accepted claims (a rejected one must leave no trace: bind only these)."""
        for r in accepted:
            owner = self.node_of_client.get(r.client_id)
            if owner is not None and owner != r.node_id:
                log.info("client %d moves from node %d (gone) to node %d", r.client_id, owner, r.node_id)
                self.client_of_node.pop(owner, None)
            self.node_of_client[r.client_id] = r.node_id
            self.client_of_node[r.node_id] = r.client_id

    def row(self, node: int, num_clients: int, rows: dict[int, int], rule: str, others_report: bool) -> int:
        """A client id in [0, N) for a node whose reply reports none: the one it is bound to, else
        the lowest id bound to no node and not yet in ``rows`` (this round's, updated); the first
        time, a warning that state is then kept per node. ReplyRejected when every id is bound, or
        when other replies of the run report theirs (``others_report``: a free id may be theirs)."""
        from .replies import ReplyRejected

        if others_report:
            raise ReplyRejected("the reply carries no 'client-id' while other replies of this run do: with "
                                "per-client state every reply must say which client it is (the partition id)")
        if node in rows:
            return rows[node]
        row = self.client_of_node.get(node)
        if row is None:
            taken = set(self.node_of_client) | set(rows.values())
            row = next((c for c in range(num_clients) if c not in taken), None)
            if row is None:
                raise ReplyRejected(
                    f"the reply carries no 'client-id' and all N={num_clients} client ids are bound to other "
                    f"nodes: report 'client-id' (the partition id; client_app.dropin.client_rule_mod adds it)")
            if not self.node_of_client and not rows:
                flwr_log.warning(
                    "%s: replies carry no 'client-id': per-client state is kept per node (node %d -> client "
                    "%d, ...), so a node that restarts with a new node id counts as a new client. Report "
                    "'client-id' (client_app.dropin.availability_mod adds the partition id)", rule, node, row)
        rows[node] = row
        return row

    def may_claim(self, node: int, client: int) -> bool:
        """Whether ``node`` may say it is ``client`` (the id is free or bound to that node)."""
        return self.node_of_client.get(client, node) == node

    def client(self, node: int, default: int) -> int:
        """The client id ``node`` last spoke for, else ``default``."""
        return self.client_of_node.get(node, default)

    # -------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"client_of_node": dict(self.client_of_node), "node_of_client": dict(self.node_of_client)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.client_of_node = dict(state["client_of_node"])
        self.node_of_client = dict(state["node_of_client"])


class RoundClaims:
    """One round's claims on client ids, judged one at a time as the replies arrive, so that a
    claim's verdict is final when it is made (a streaming rule folds the reply in at once).

    Rejected: a node that claims another id than the one it is bound to (or than its first claim
    this round); a claim of an id bound to another node that is still connected (listed by the
    grid at this round's configure_train). A node restarted without a registered key gets a new
    node id from Flower, so it takes its id back once its old node is gone from the grid's list;
    with SuperNode authentication the restarted node keeps its node id (the SuperLink maps the
    registered public key to the node id), so a binding to a node id is a binding to a key.
    Several claims of one id in a round: the first to arrive wins (the bound owner always wins:
    no other node's claim of its id stands while it is connected).
    """

    def __init__(self, binding: ClientBinding, connected: set[int]) -> None:
        self.binding = binding
        self.connected = connected
        self.bound_to = {node: client for client, node in binding.node_of_client.items()}
        self.winner: dict[int, int] = {}  # client id -> the node whose claim stands this round

    def take(self, r: IdClaim, reject: Callable[[int, str], None]) -> bool:
        """Whether ``r`` stands; if not, ``reject`` is told why."""
        own = self.bound_to.setdefault(r.node_id, r.client_id)  # a node's first claim this round
        if own != r.client_id:
            reject(r.node_id, f"node {r.node_id} is bound to client {own}; it may not claim client {r.client_id}")
            return False
        client = r.client_id
        owner = self.binding.node_of_client.get(client)
        first = self.winner.get(client)
        if first is not None:
            if first == r.node_id:
                why = f"node {r.node_id} replied before"
            elif first == owner:
                why = f"node {owner} is bound to it"
            else:
                why = f"node {first} claimed it first"
            reject(r.node_id, f"second reply for client {client} this round: {why}")
            return False
        if owner is not None and owner != r.node_id and owner in self.connected:
            reject(r.node_id, f"client {client} belongs to node {owner}, still connected (if node {r.node_id} is "
                              f"client {client}'s own, node {owner} squats its id: without SuperNode "
                              f"authentication a node id proves nothing)")
            return False
        self.winner[client] = r.node_id
        return True
