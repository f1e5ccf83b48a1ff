"""The project's touches of Flower's internals (pinned Flower 1.42.0), one function each.

Each entry of :data:`TOUCHES` names a function here, the private Flower object it reaches, and
why the project needs it; ``tests/test_flower_internals.py`` checks every one against the
installed Flower, and ``docs/flower-versions.md`` lists them. Flower is imported lazily, inside
each function, so that importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable
from typing import Any

#: touch -> (Flower's private object, why the project needs it)
TOUCHES: dict[str, tuple[str, str]] = {
    "set_message_id": (
        "flwr.app.Message.metadata._message_id",
        "the in-process grid (experiments.grid) delivers messages without a SuperLink, which is what "
        "gives a message its id; replies point at it (reply_to_message_id)"),
    "task_identity / set_task_identity": (
        "flwr.supercore.task_identity.TaskIdentity",
        "Flower 1.42's Message() reads the running task's identity: the in-process grid sets one, and "
        "the per-SuperNode worker process (client_app.worker_process) takes its ClientApp task's"),
    "wrap_http_grid_object_pulls": (
        "flwr.superlink.grid.http_grid.pull_objects",
        "HttpGrid.pull_messages pulls a reply's arrays with backoffs of 1-10 s for up to 7,200 s: the "
        "round deadline must bound it (server_app.network.bounded_object_pulls)"),
    "is_http_grid": (
        "flwr.superlink.grid.http_grid.HttpGrid",
        "a deployment's grid is polled faster than Flower's 3 s (server_app.network.fast_pull)"),
    "run_flower_supernode / cap_supernode_sleeps": (
        "flwr.supernode.cli.flower_supernode, flwr.supernode.start_client_internal.time",
        "a SuperNode's idle sleeps (3 s, 0.5 s) capped so churned nodes pick up their task at once "
        "(deploy.tuning)"),
    "flower_entry_point": (
        "flwr.supernode.cli.flwr_clientapp, flwr.supercore.cli.flower_superexec",
        "every message's ClientApp process, and every SuperNode's SuperExec, imports Flower's CLI first "
        "(1.5-2.7 s); a forker per SuperNode imports them once and forks Flower's own entry points (deploy.prefork)"),
    "set_task_heartbeat_window": (
        "flwr.supercore.corestate.in_memory_corestate / sql_corestate: HEARTBEAT_DEFAULT_INTERVAL, "
        "HEARTBEAT_PATIENCE",
        "Flower revokes a claimed task's token when its app sends no heartbeat within 30 s: a ClientApp that "
        "imports slowly on a busy machine lost its reply (401); deploy.tuning lengthens the window"),
    "run_flower_superlink": (
        "flwr.superlink.cli.flower_superlink",
        "the tuned SuperLink runs Flower's own entry point (deploy.tuning superlink)"),
    "unavailable_node_reply": (
        "flwr.server.superlink.linkstate.utils.create_message_error_unavailable_res_message",
        "in simulation a message to an offline node gets the error reply Flower's SuperLink gives for an "
        "unavailable node (server_app.messages, the drop-in's churn grid)"),
    "recorddict_to_bytes / recorddict_from_bytes": (
        "flwr.common.serde.recorddict_to_proto / recorddict_from_proto, flwr.proto.recorddict_pb2",
        "an asynchronous run's checkpoint holds the replies of jobs in flight (server_app.async_resume)"),
    "control_client": (
        "flwr.cli.utils.init_http_client_from_connection, flwr.cli.typing.SuperLinkConnection, "
        "flwr.proto.control_pb2.ListNodesRequest / RegisterNodeRequest",
        "a deployment across hosts registers each client's public key and reads every node's status at the "
        "SuperLink about every second while a round waits for its nodes (deploy.multihost): `flwr supernode "
        "ls` costs a process start (~1 s of CPU) a call, the Control API 10-15 ms"),
    "guard_ray_actor_pool": (
        "flwr.simulation.ray_transport.ray_actor.BasicActorPool, "
        "flwr.server.superlink.fleet.vce.backend.raybackend.RayBackend.process_message",
        "Flower 1.42 puts an actor whose Ray node died back into its pool, and every later message handed "
        "to it fails at once (RayActorError): after one lost worker most clients' replies became errors, "
        "which read as offline clients (server_app.raylost)"),
    "ray_actor_node": (
        "ray._private.state.actors (Ray's actor table)",
        "a lost worker is named by its Ray node and address (server_app.raylost); Ray's public state API "
        "needs the dashboard, which a cluster need not run"),
}


def set_message_id(msg: Any, message_id: str) -> None:
    """Give ``msg`` the id a SuperLink would (Flower's ``Metadata`` has no public setter)."""
    msg.metadata.__dict__["_message_id"] = message_id


def task_identity() -> tuple[Any, Any, Any]:
    """(task id, run id, node id) of the task running in this process."""
    from flwr.supercore.task_identity import TaskIdentity

    return TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id


def set_task_identity(task_id: Any, run_id: Any, node_id: Any) -> None:
    """Take (task id, run id, node id) as this process's task (what Message() reads)."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = task_id, run_id, node_id


def wrap_http_grid_object_pulls(wrap: Callable[[Callable[..., dict[str, bytes]]], Callable[..., dict[str, bytes]]]
                                ) -> bool:
    """Replace the ``pull_objects`` that Flower's HTTP grid calls by ``wrap(pull_objects)`` (once: a
    function marked ``bounded`` is kept); True when it was replaced now."""
    from flwr.superlink.grid import http_grid

    if getattr(http_grid.pull_objects, "bounded", False):
        return False
    http_grid.pull_objects = wrap(http_grid.pull_objects)
    return True


def is_http_grid(grid: Any) -> bool:
    """Whether ``grid`` is Flower's HTTP grid (the ServerApp's side of a deployment)."""
    from flwr.superlink.grid.http_grid import HttpGrid

    return isinstance(grid, HttpGrid)


def cap_supernode_sleeps(sleeps: Any) -> None:
    """Make the SuperNode's pull loop sleep through ``sleeps`` (an object with ``sleep``; Flower's
    loop calls ``time.sleep(3)`` and ``time.sleep(0.5)`` through its module's ``time``)."""
    from flwr.supernode import start_client_internal as pull_loop

    pull_loop.time = sleeps


def run_flower_supernode(argv: list[str]) -> None:
    """``flower-supernode ARGV`` in this process (Flower's own entry point)."""
    import sys

    from flwr.supernode.cli import flower_supernode

    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


def flower_entry_point(command: str) -> Callable[[], Any]:
    """Flower's own entry point of console command ``command`` (``flwr-clientapp`` or
    ``flower-superexec``), imported: it reads this process's ``sys.argv`` as the command does."""
    if command == "flwr-clientapp":
        from flwr.supernode.cli import flwr_clientapp

        return flwr_clientapp
    if command == "flower-superexec":
        from flwr.supercore.cli import flower_superexec

        return flower_superexec
    raise ValueError(f"no Flower entry point {command!r} here; known: flwr-clientapp, flower-superexec")


def set_task_heartbeat_window(seconds: float) -> None:
    """Claimed tasks of this process's SuperLink or SuperNode keep their token ``seconds`` until
    their first heartbeat and ``seconds`` between heartbeats (Flower: 30 s, then 2 x 30 s)."""
    from flwr.supercore.corestate import in_memory_corestate, sql_corestate

    for state in (in_memory_corestate, sql_corestate):
        state.HEARTBEAT_DEFAULT_INTERVAL = seconds  # type: ignore[attr-defined]  # the claim's first window
        state.HEARTBEAT_PATIENCE = 1  # type: ignore[attr-defined]  # then: seconds between heartbeats


def run_flower_superlink(argv: list[str]) -> None:
    """``flower-superlink ARGV`` in this process (Flower's own entry point)."""
    import sys

    from flwr.superlink.cli import flower_superlink

    sys.argv = ["flower-superlink", *argv]
    flower_superlink()


def unavailable_node_reply(msg: Any) -> Any:
    """The reply Flower's SuperLink writes for ``msg`` when its node is unavailable (it must have its id)."""
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

    return create_message_error_unavailable_res_message(msg.metadata, "node_unavail")


def recorddict_to_bytes(record: Any) -> bytes:
    """A RecordDict as Flower's own protobuf bytes."""
    from flwr.common.serde import recorddict_to_proto

    return bytes(recorddict_to_proto(record).SerializeToString())


def recorddict_from_bytes(data: bytes) -> Any:
    """The RecordDict of :func:`recorddict_to_bytes`'s bytes."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    proto = ProtoRecordDict()
    proto.ParseFromString(data)
    return recorddict_from_proto(proto)


class ControlClient:
    """The SuperLink's Control API as ``flwr supernode register / ls`` use it, in this process."""

    def __init__(self, address: str, root_certificates: str | None) -> None:
        from flwr.cli.typing import SuperLinkConnection
        from flwr.cli.utils import init_http_client_from_connection

        connection = SuperLinkConnection(name="flchurn", address=address, root_certificates=root_certificates,
                                         insecure=root_certificates is None)
        with contextlib.redirect_stdout(io.StringIO()):  # Flower's CLI line "Using SuperLink: ...", per connect
            self.client = init_http_client_from_connection(connection)

    def register(self, public_key: bytes) -> int:
        """Register a SuperNode's public key (PEM, SubjectPublicKeyInfo); its node id."""
        from flwr.proto.control_pb2 import RegisterNodeRequest

        return int(self.client.RegisterNode(RegisterNodeRequest(public_key=public_key)).node_id)

    def nodes(self) -> list[dict[str, Any]]:
        """Every node the SuperLink knows: ``{"node-id", "status", "public-key", "online-until", "activated-at"}``
        (status: ``registered``, ``online``, ``offline`` or ``unregistered``)."""
        from flwr.proto.control_pb2 import ListNodesRequest

        res = self.client.ListNodes(ListNodesRequest())
        return [{"node-id": int(n.node_id), "status": str(n.status), "public-key": str(n.public_key),
                 "online-until": float(n.online_until), "activated-at": str(n.last_activated_at)}
                for n in res.nodes_info]

    def close(self) -> None:
        self.client.close()


def control_client(address: str, root_certificates: str | None) -> ControlClient:
    """A :class:`ControlClient` for the SuperLink's Control API at ``address`` (TLS with
    ``root_certificates``, else insecure)."""
    return ControlClient(address, root_certificates)
def guard_ray_actor_pool(on_loss: Callable[[str, BaseException], None]) -> bool:
    """Make Flower's Ray simulation survive a lost actor (its node died, its raylet or process was
    killed): the actor leaves the pool instead of going back to it, ``submit`` waits for a live
    actor (Flower's pops an empty list when a pool holds fewer actors than worker threads), and
    the message the actor was running is run again on a live one (Flower did not update the
    node's context for it: the same job), at most once per actor the pool started with;
    ``on_loss(actor id, error)`` is called for each loss. When no actor is left, the error is
    raised (Flower turns it into the message's error reply). Idempotent (a second call only
    replaces ``on_loss``); False where Flower's Ray backend cannot be imported."""
    try:
        import ray
        from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
        from flwr.simulation.ray_transport.ray_actor import BasicActorPool
    except ImportError:
        return False
    guard = getattr(BasicActorPool, "_flchurn_guard", None)
    if guard is not None:
        guard[0] = on_loss
        return True
    hooks: list[Callable[[str, BaseException], None]] = [on_loss]
    cond = threading.Condition()
    lost_error = ray.exceptions.RayActorError

    def key(actor: Any) -> str:
        return str(actor._actor_id.hex())

    def lost(pool: Any) -> set[str]:
        if not hasattr(pool, "_flchurn_lost"):
            pool._flchurn_lost = set()
        return pool._flchurn_lost

    def submit(self: Any, actor_fn: Any, job: Any) -> Any:
        with cond:
            while not self.pool:
                if self.num_actors - len(lost(self)) <= 0:
                    raise RuntimeError(f"every one of the simulation's {self.num_actors} Ray actors was lost")
                cond.wait(timeout=1.0)
            actor = self.pool.pop()
        app_fn, mssg, cid, context = job
        future = actor_fn(actor, app_fn, mssg, cid, context)
        with cond:
            self._future_to_actor[future] = actor
        return future

    def add_actor_back_to_pool(self: Any, future: Any) -> None:
        with cond:
            actor = self._future_to_actor.pop(future)
            if key(actor) not in lost(self):
                self.pool.append(actor)
                cond.notify()

    def fetch_result_and_return_actor_to_pool(self: Any, future: Any) -> tuple[Any, Any]:
        try:
            _, out_mssg, updated_context = ray.get(future)
        except lost_error:
            with cond:
                lost(self).add(key(self._future_to_actor[future]))
            raise
        self.add_actor_back_to_pool(future)
        return out_mssg, updated_context

    flower_process_message = RayBackend.process_message

    def process_message(self: Any, message: Any, context: Any) -> Any:
        for attempt in range(self.pool.num_actors + 1 if self.pool else 1):
            try:
                return flower_process_message(self, message, context)
            except lost_error as err:
                hooks[0](str(getattr(err, "actor_id", "") or "unknown"), err)
                if attempt >= (self.pool.num_actors if self.pool else 0):
                    raise
        raise AssertionError("unreachable")

    BasicActorPool.submit = submit  # type: ignore[method-assign]
    BasicActorPool.add_actor_back_to_pool = add_actor_back_to_pool  # type: ignore[method-assign]
    BasicActorPool.fetch_result_and_return_actor_to_pool = fetch_result_and_return_actor_to_pool  # type: ignore[method-assign]
    RayBackend.process_message = process_message  # type: ignore[method-assign]
    BasicActorPool._flchurn_guard = hooks  # type: ignore[attr-defined]
    return True


def ray_actor_node(actor_id: str) -> dict[str, str]:
    """``{"ray-node": <node id>, "address": <its IP>}`` of a Ray actor, from Ray's actor table
    (``ray._private.state.actors``: no dashboard needed); {} when Ray does not know it."""
    try:
        import ray._private.state as ray_state

        info = ray_state.actors(actor_id=actor_id) or {}
        address = info.get("Address") or {}
        return {"ray-node": str(address.get("NodeID", "")), "address": str(address.get("IPAddress", ""))}
    except Exception:  # noqa: BLE001 - a record; Ray's internal table may change
        return {}
