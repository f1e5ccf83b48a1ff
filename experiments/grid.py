"""An in-process Grid: the real ClientApp called directly for every message, no Ray.

:class:`InProcessGrid` is a Flower ``Grid`` whose nodes are plain contexts in this process: a
message is delivered by calling the ClientApp directly. Results are identical to a simulation
for the same config (the client's randomness is keyed by seeds, client and round).
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from client_app.app import app as default_client_app
from flowerlink import set_message_id, set_task_identity

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
        set_task_identity(1, 1, 1)  # Message() needs one
        self.app = client_app
        self.down = down
        ids = list(node_ids) if node_ids is not None else [NODE_ID_BASE + i for i in range(num_nodes)]
        if len(ids) != num_nodes or len(set(ids)) != num_nodes or not all(0 < n < 2**64 for n in ids):
            raise ValueError(f"node_ids must be {num_nodes} distinct uint64 ids > 0, got {ids}")
        self.partition_of = {int(node): i for i, node in enumerate(ids)}
        self.contexts = NodeContexts(self.partition_of, dict(run_config))
        self.delivered: list[Message] = []  # every message delivered (tests read it)
        self.keep_delivered = True  # False: a long or large run keeps none (benchmarks/scale.py)
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

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """The replies, in the messages' order. Every message is delivered now (its id, the
        ``down`` drops); a training message (type ``train``) is trained when its reply is pulled,
        so a streaming strategy holds one trained model at a time (:mod:`strategies.streaming`);
        any other message is answered now (a broadcast whose replies nobody reads still arrives)."""
        pending: list[tuple[Message, Context] | Message] = []
        for msg in messages:
            context = self.deliver(msg)
            if context is None:
                continue
            lazy = msg.metadata.message_type == MessageType.TRAIN
            pending.append((msg, context) if lazy else self.app(msg, context))
        return self._pulled(pending)

    def _pulled(self, pending: list[tuple[Message, Context] | Message]) -> Iterator[Message]:
        queue = deque(pending)
        del pending
        while queue:
            item = queue.popleft()  # let it go once answered
            yield self.app(*item) if isinstance(item, tuple) else item

    def deliver(self, msg: Message) -> Context | None:
        """Give ``msg`` its id and note it delivered; the destination's context, or None when
        ``down`` drops it (the reply never comes)."""
        set_message_id(msg, uuid.uuid4().hex)
        if self.keep_delivered:
            self.delivered.append(msg)
        node = msg.metadata.dst_node_id
        if node not in self.contexts:  # as Flower's SuperLink: logged, dropped, no reply ever
            log.error("Invalid destination node ID for Message: %d", node)
            return None
        config: Mapping[str, Any] = msg.content.config_records.get("config", {})
        if self.down and "server-round" in config and self.down(int(config["server-round"]), self.partition_of[node]):
            return None
        return self.contexts[node]


class NodeContexts(Mapping[int, Context]):
    """node id -> its Context, made the first time the node is addressed (a 100,000-node grid
    makes only those it uses). Every node reads one run config (a ClientApp does not write it)."""

    def __init__(self, partition_of: Mapping[int, int], run_config: dict[str, Any]) -> None:
        self.partition_of = partition_of
        self.run_config = run_config
        self.made: dict[int, Context] = {}

    def __getitem__(self, node: int) -> Context:
        context = self.made.get(node)
        if context is None:
            pid = self.partition_of[node]  # KeyError: no such node
            context = self.made[node] = Context(
                run_id=1, node_id=node, state=RecordDict(), run_config=self.run_config,
                node_config={"partition-id": pid, "num-partitions": len(self.partition_of)})
        return context

    def __contains__(self, node: object) -> bool:
        return node in self.partition_of

    def __iter__(self) -> Iterator[int]:
        return iter(self.partition_of)

    def __len__(self) -> int:
        return len(self.partition_of)
