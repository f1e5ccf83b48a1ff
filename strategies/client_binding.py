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


class Claim(Protocol):
    """What a claim needs: the node that sent it and the client id it claims."""

    node_id: int
    client_id: int


C = TypeVar("C", bound=Claim)


class ClientBinding:
    """The node <-> client id binding of a run.

    ``node_of_client``: client id -> the node bound to it; ``client_of_node``: node id -> client
    id of its last accepted reply (or probe).
    """

    def __init__(self) -> None:
        self.client_of_node: dict[int, int] = {}
        self.node_of_client: dict[int, int] = {}

    def check(self, claims: list[C], connected: set[int], reject: Callable[[int, str], None]) -> list[C]:
        """One claim per client id, from the node allowed to make it; the others go to ``reject``.

        Rejected: a node that claims another id than the one it is bound to; a claim of an id
        bound to another node that is still connected (listed by the grid at this round's
        configure_train). A node restarted without a registered key gets a new node id from
        Flower, so it takes its id back once its old node is gone from the grid's list; with
        SuperNode authentication the restarted node keeps its node id (the SuperLink maps the
        registered public key to the node id), so a binding to a node id is a binding to a key.
        Several claims of one free id in a round: the lowest node id wins.
        """
        bound_to = {node: client for client, node in self.node_of_client.items()}
        by_client: dict[int, list[C]] = {}
        for r in sorted(claims, key=lambda r: r.node_id):  # stable: a node's first reply first
            own = bound_to.setdefault(r.node_id, r.client_id)  # a node's first claim this round
            if own != r.client_id:
                reject(r.node_id, f"node {r.node_id} is bound to client {own}; it may not claim client {r.client_id}")
                continue
            by_client.setdefault(r.client_id, []).append(r)
        kept = []
        for client, group in by_client.items():
            owner = self.node_of_client.get(client)
            if owner is not None and owner not in {r.node_id for r in group} and owner in connected:
                for r in group:
                    reject(r.node_id, f"client {client} belongs to node {owner}, still connected")
                continue
            winner = next((r for r in group if r.node_id == owner), group[0])
            for r in group:
                if r is winner:
                    continue
                if r.node_id == winner.node_id:
                    why = f"node {r.node_id} replied before"
                elif winner.node_id == owner:
                    why = f"node {owner} is bound to it"
                else:
                    why = f"node {winner.node_id} claimed it too and the lower node id wins"
                reject(r.node_id, f"second reply for client {client} this round: {why}")
            kept.append(winner)
        return kept

    def bind(self, accepted: Sequence[Claim]) -> None:
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
                    "'client-id' (client_app.dropin.client_rule_mod adds the partition id)", rule, node, row)
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
