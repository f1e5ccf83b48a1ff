"""An in-process Grid: the real ClientApp called directly for every message, no Ray.

:class:`InProcessGrid` is a Flower ``Grid`` whose nodes are plain contexts in this process: a
message is delivered by calling the ClientApp directly. Results are identical to a simulation
for the same config (the client's randomness is keyed by seeds, client and round).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from client_app.app import app as default_client_app

log = logging.getLogger("flwr")
NODE_ID_BASE = 1000  # node ids differ from client ids on purpose, as in Flower


class InProcessGrid(Grid):
    """Nodes ``NODE_ID_BASE + i`` (or ``node_ids[i]``: any uint64, as Flower draws them) host
    partition ``i``; ``down(round, client)`` drops replies."""

    def __init__(
        self,
        num_nodes: int,
        run_config: Mapping[str, Any],
        client_app: ClientApp = default_client_app,
        down: Callable[[int, int], bool] | None = None,
        node_ids: Sequence[int] | None = None,
    ) -> None:
        TaskIdentity.task_id = TaskIdentity.run_id = TaskIdentity.node_id = 1  # Message() needs them
        self.app = client_app
        self.down = down
        ids = list(node_ids) if node_ids is not None else [NODE_ID_BASE + i for i in range(num_nodes)]
        if len(ids) != num_nodes or len(set(ids)) != num_nodes or not all(0 < n < 2**64 for n in ids):
            raise ValueError(f"node_ids must be {num_nodes} distinct uint64 ids > 0, got {ids}")
        self.partition_of = {int(node): i for i, node in enumerate(ids)}
        self.contexts = {
            node: Context(run_id=1, node_id=node, state=RecordDict(), run_config=dict(run_config),
                          node_config={"partition-id": pid, "num-partitions": num_nodes})
            for node, pid in self.partition_of.items()
        }
        self.delivered: list[Message] = []
        self._run = None

    def set_run(self, run):  # noqa: D102
        self._run = run

    @property
    def run(self):  # noqa: D102
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: D102
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return list(self.partition_of)

    def push_messages(self, messages):  # noqa: D102
        raise NotImplementedError("InProcessGrid delivers through send_and_receive only")

    def pull_messages(self, message_ids):  # noqa: D102
        raise NotImplementedError("InProcessGrid delivers through send_and_receive only")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            context = self.deliver(msg)
            if context is not None:
                replies.append(self.app(msg, context))
        return replies

    def deliver(self, msg: Message) -> Context | None:
        """Give ``msg`` its id and note it delivered; the destination's context, or None when
        ``down`` drops it (the reply never comes)."""
        msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        self.delivered.append(msg)
        node = msg.metadata.dst_node_id
        if node not in self.contexts:  # as Flower's SuperLink: logged, dropped, no reply ever
            log.error("Invalid destination node ID for Message: %d", node)
            return None
        config: Mapping[str, Any] = msg.content.config_records.get("config", {})
        if self.down and "server-round" in config and self.down(int(config["server-round"]), self.partition_of[node]):
            return None
        return self.contexts[node]
