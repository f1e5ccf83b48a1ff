"""Who a node is: the identity query, its answer, and why an answer was refused.

- :func:`identity_query` asks a node which client (partition) it hosts; the project's ClientApp
  (``client_app.app``) and ``client_app.dropin`` answer it.
- :func:`identity` reads the answer, :func:`discover_clients` asks every unknown node at once
  (bounded wait) and keeps node id -> client id.
- why an answer was refused quotes the error reply (:func:`strategies.failures.quoted_error`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from strategies.failures import quoted_error
from strategies.protocol import CLIENT_ID, IDENTITY_QUERY, SERVER_ROUND
from strategies.replies import ReplyRejected, count

IDENTITY = "identity"  # the record of a QUERY reply (client_app.app: client-id, num-partitions)

flwr_log = logging.getLogger("flwr")  # Flower's logger: `flwr run --stream` shows what it says


def identity_query(node: int, server_round: int = 1) -> Message:
    """The query that asks ``node`` which client it is (``query.identity``: answered by the
    project's ClientApp and by ``client_app.dropin``). It carries what Flower's own messages carry,
    a ConfigRecord named ``config`` with ``server-round`` (the round the answer is needed for), so
    a user's mod that reads ``msg.content["config"]["server-round"]`` works on it too."""
    content = RecordDict({"config": ConfigRecord({SERVER_ROUND: int(server_round)})})
    return Message(content, dst_node_id=node, message_type=IDENTITY_QUERY)


def identity(reply: Message) -> int:
    """The client id a QUERY reply states: ``identity["client-id"]``, an integer >= 0;
    ReplyRejected (naming the problem, the value summarised) for anything else."""
    if reply.has_error():
        raise ReplyRejected(f"error reply: {quoted_error(reply.error.reason)}")
    if IDENTITY not in reply.content:
        raise ReplyRejected(f"no '{IDENTITY}' record in its reply")
    record = reply.content[IDENTITY]
    if not isinstance(record, Mapping):
        raise ReplyRejected(f"'{IDENTITY}' is a {type(record).__name__}, not a record of values")
    value: int = count(record, CLIENT_ID, 0, 2**63 - 1)
    return value


def discover_clients(grid: Grid, known: dict[int, int], timeout: float,
                     refused: set[int] | None = None, server_round: int = 1,
                     nodes: Iterable[int] | None = None, errors: dict[int, str] | None = None) -> dict[int, int]:
    """Update ``known`` (node id -> client id) for connected nodes (or ``nodes``) not in it yet nor
    in ``refused`` (waiting at most ``timeout`` s for their answers; the query names
    ``server_round``).

    A reply counts only when it answers one of these queries, from the node asked; ``errors`` (when
    given) keeps, per node, why its answer was refused (an error reply: the exception, quoted). A node whose
    reply states no usable client id (:func:`identity`) is logged and added to ``refused`` (not
    asked again); a node that did not reply is asked again next time. Never raises on a reply.
    """
    refused = set() if refused is None else refused
    listed = grid.get_node_ids() if nodes is None else nodes
    unknown = [n for n in sorted(listed) if n not in known and n not in refused]
    if not unknown:
        return known
    queries = [identity_query(n, server_round) for n in unknown]
    replies = list(grid.send_and_receive(queries, timeout=timeout))
    asked = {q.metadata.message_id: q.metadata.dst_node_id for q in queries}
    for reply in replies:
        node = asked.get(reply.metadata.reply_to_message_id)
        if "" in asked:  # a grid that gives messages no ids (a test double): trust the sender
            node = reply.metadata.src_node_id if reply.metadata.src_node_id in unknown else None
        if node is None or (node != reply.metadata.src_node_id and not reply.has_error()):
            flwr_log.warning("a QUERY reply from node %s answers no query of this discovery: ignored",
                             reply.metadata.src_node_id)
            continue
        try:
            known[node] = identity(reply)
        except ReplyRejected as exc:
            flwr_log.warning("node %d did not say which client it is: %s", node, exc)
            if errors is not None:
                errors[node] = str(exc)
            if not reply.has_error():  # an error (node gone) may answer next time
                refused.add(node)
    return known
