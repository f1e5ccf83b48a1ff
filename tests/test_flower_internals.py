"""Every touch of Flower's internals (flowerlink.internals.TOUCHES), checked against the installed
Flower: a change in Flower fails here, naming the touch, before it fails somewhere deep in a run.

CI also runs this file against Flower's nightly (``flwr-nightly``, .ci/run), reporting what breaks
without failing the build."""

from __future__ import annotations

import inspect
import sys
import time

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

import flowerlink
from flowerlink import internals


def test_every_touch_has_a_check_here_and_a_line_in_the_versions_page():
    """A touch added to TOUCHES without a test below or a line in docs/flower-versions.md fails."""
    from pathlib import Path

    source = Path(__file__).read_text()
    page = (Path(__file__).resolve().parent.parent / "docs" / "flower-versions.md").read_text()
    for touch in internals.TOUCHES:
        for name in touch.split(" / "):
            assert f"def test_{name}" in source, f"no test for Flower touch {name!r}"
            assert f"`{name}`" in page, f"docs/flower-versions.md does not list the touch {name!r}"


def test_no_module_of_ours_reaches_flowers_private_objects_outside_flowerlink():
    """The private objects of TOUCHES are named nowhere else in the project's packages."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    private = ('"_message_id"', "TaskIdentity", "grid.http_grid", "import start_client_internal",
               "flwr.supernode.cli", "flwr.superlink.cli", "flwr.supercore.corestate", "flwr.common.serde", "linkstate.utils",
               "recorddict_pb2")
    found = [f"{p.relative_to(root)}: {name}" for p in root.glob("*/**/*.py")
             if p.parts[len(root.parts)] not in {"flowerlink", "tests", ".venv", "examples", "benchmarks"}
             for name in private if name in p.read_text()]
    assert not found, found


def make_message() -> Message:
    internals.set_task_identity(1, 1, 1)
    return Message(RecordDict({"config": ConfigRecord({"a": 1})}), dst_node_id=7, message_type=MessageType.TRAIN)


def test_set_message_id():
    msg = make_message()
    internals.set_message_id(msg, "abc123")
    assert msg.metadata.message_id == "abc123"
    reply = Message(RecordDict({"m": MetricRecord({"x": 1.0})}), reply_to=msg)
    assert reply.metadata.reply_to_message_id == "abc123"


def test_task_identity():
    internals.set_task_identity(5, 6, 7)
    assert internals.task_identity() == (5, 6, 7)
    internals.set_task_identity(1, 1, 1)
    assert make_message().metadata.dst_node_id == 7  # Message() builds with an identity set


def test_set_task_identity():
    internals.set_task_identity(11, 12, 13)
    assert internals.task_identity() == (11, 12, 13)


def test_wrap_http_grid_object_pulls(monkeypatch):
    from flwr.superlink.grid import http_grid

    original = http_grid.pull_objects
    params = inspect.signature(original).parameters
    for name in ("object_ids", "pull_object_fn", "max_time", "initial_backoff", "backoff_cap"):
        assert name in params, f"Flower's pull_objects lost its parameter {name!r} (server_app.network bounds it)"
    monkeypatch.setattr(http_grid, "pull_objects", original)
    calls = []

    def wrap(fn):
        def bounded(*args, **kwargs):
            calls.append(kwargs)
            return fn(*args, **kwargs)
        bounded.bounded = True  # type: ignore[attr-defined]
        return bounded

    assert internals.wrap_http_grid_object_pulls(wrap) is True
    assert internals.wrap_http_grid_object_pulls(wrap) is False  # once
    assert "pull_objects(" in inspect.getsource(http_grid.HttpGrid.pull_messages)  # what the grid calls


def test_is_http_grid():
    from flwr.superlink.grid.http_grid import HttpGrid

    assert not internals.is_http_grid(object())
    assert issubclass(HttpGrid, flowerlink.internals.__class__) is False  # a class to test against exists
    assert internals.is_http_grid(HttpGrid.__new__(HttpGrid))


def test_cap_supernode_sleeps(monkeypatch):
    from flwr.supernode import start_client_internal as pull_loop

    source = inspect.getsource(pull_loop)
    assert "time.sleep(3)" in source or "time.sleep(0.5)" in source, "the SuperNode's pull loop no longer sleeps via time"
    monkeypatch.setattr(pull_loop, "time", time)
    sentinel = type("Sleeps", (), {"sleep": staticmethod(lambda s: None)})()
    internals.cap_supernode_sleeps(sentinel)
    assert pull_loop.time is sentinel


def test_run_flower_supernode():
    from flwr.supernode import cli

    assert callable(cli.flower_supernode), "flwr.supernode.cli.flower_supernode is gone (deploy.tuning runs it)"


@pytest.mark.parametrize("command, flag", [("flwr-clientapp", "--runtime-api-address"),
                                           ("flower-superexec", "--runtime-api-address")])
def test_flower_entry_point(command, flag, monkeypatch, capsys):
    """Flower's own entry point of each command deploy.prefork forks: it parses sys.argv as the
    command does (its --help names the flag the SuperNode passes), and an unknown command is named."""
    monkeypatch.setattr(sys, "argv", [command, "--help"])
    with pytest.raises(SystemExit) as stop:
        internals.flower_entry_point(command)()
    assert stop.value.code == 0 and flag in capsys.readouterr().out
    with pytest.raises(ValueError, match="flwr-cliantapp.*known: flwr-clientapp"):
        internals.flower_entry_point("flwr-cliantapp")


def test_set_task_heartbeat_window(monkeypatch):
    from flwr.supercore.corestate import in_memory_corestate, sql_corestate

    for state in (in_memory_corestate, sql_corestate):
        for name in ("HEARTBEAT_DEFAULT_INTERVAL", "HEARTBEAT_PATIENCE"):
            assert hasattr(state, name), f"{state.__name__}.{name} is gone (deploy.tuning's task patience)"
            monkeypatch.setattr(state, name, getattr(state, name))
    internals.set_task_heartbeat_window(77.0)
    assert in_memory_corestate.HEARTBEAT_DEFAULT_INTERVAL == sql_corestate.HEARTBEAT_DEFAULT_INTERVAL == 77.0
    assert in_memory_corestate.HEARTBEAT_PATIENCE == 1
    assert "HEARTBEAT_DEFAULT_INTERVAL" in inspect.getsource(in_memory_corestate)  # read where tokens expire


def test_unavailable_node_reply():
    msg = make_message()
    internals.set_message_id(msg, "m-1")
    reply = internals.unavailable_node_reply(msg)
    assert reply.has_error() and reply.metadata.reply_to_message_id == "m-1"
    assert reply.metadata.dst_node_id == msg.metadata.src_node_id


def test_run_flower_superlink():
    from flwr.superlink import cli

    assert callable(cli.flower_superlink), "flwr.superlink.cli.flower_superlink is gone (deploy.tuning runs it)"


@pytest.mark.parametrize("kind", ["arrays", "metrics"])
def test_recorddict_to_bytes(kind):
    record = (RecordDict({"a": ArrayRecord([np.arange(6, dtype=np.float32).reshape(2, 3)])}) if kind == "arrays"
              else RecordDict({"m": MetricRecord({"x": 1.5, "n": 3})}))
    back = internals.recorddict_from_bytes(internals.recorddict_to_bytes(record))
    if kind == "arrays":
        np.testing.assert_array_equal(back["a"].to_numpy_ndarrays()[0], np.arange(6, dtype=np.float32).reshape(2, 3))
    else:
        assert dict(back["m"]) == {"x": 1.5, "n": 3}


def test_recorddict_from_bytes():
    with pytest.raises(Exception):  # noqa: B017 (protobuf's own error: what matters is that junk raises)
        internals.recorddict_from_bytes(b"\xff\xff\xff not a protobuf")


def test_control_client():
    """What ControlClient reaches: the CLI's connection and HTTP client, ListNodes / RegisterNode
    with the fields it reads (the real calls run in tests/test_multihost.py against a SuperLink)."""
    import inspect

    from flwr.cli.typing import SuperLinkConnection
    from flwr.cli.utils import init_http_client_from_connection
    from flwr.proto.control_pb2 import ListNodesResponse, RegisterNodeRequest, RegisterNodeResponse
    from flwr.proto.node_pb2 import NodeInfo
    from flwr.supercore.control import ControlHttpClient

    assert list(inspect.signature(init_http_client_from_connection).parameters)[0] == "connection"
    assert {"name", "address", "root_certificates", "insecure"} <= set(inspect.signature(SuperLinkConnection).parameters)
    assert callable(ControlHttpClient.ListNodes) and callable(ControlHttpClient.RegisterNode)
    assert "public_key" in RegisterNodeRequest.DESCRIPTOR.fields_by_name
    assert "node_id" in RegisterNodeResponse.DESCRIPTOR.fields_by_name
    assert "nodes_info" in ListNodesResponse.DESCRIPTOR.fields_by_name
    assert {"node_id", "status", "public_key", "online_until", "last_activated_at"} <= set(NodeInfo.DESCRIPTOR.fields_by_name)


class _FakeActor:
    """A Ray actor handle as Flower's pool uses it: ``_actor_id.hex()`` and ``run.remote``."""

    def __init__(self, name: str, dies: bool) -> None:
        self.name, self.dies = name, dies
        self._actor_id = type("Id", (), {"hex": lambda _self: name})()
        self.run = type("Run", (), {"remote": lambda _self, *args: (self, args)})()


def test_guard_ray_actor_pool(monkeypatch):
    import ray
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    lost: list[str] = []
    assert internals.guard_ray_actor_pool(lambda actor, err: lost.append(actor))

    def fake_get(future):
        actor, _ = future
        if actor.dies:
            raise ray.exceptions.ActorUnavailableError("node died", bytes(16))
        return None, f"reply from {actor.name}", "context"

    monkeypatch.setattr(ray, "get", fake_get)
    pool = BasicActorPool.__new__(BasicActorPool)
    pool.pool, pool.num_actors, pool._future_to_actor = [_FakeActor("b", False), _FakeActor("a", True)], 2, {}
    backend = RayBackend.__new__(RayBackend)
    backend.pool, backend.app_fn = pool, lambda: None
    context = type("Ctx", (), {"node_config": {"partition-id": 0}})()
    # Flower pops "a" (the pool's last), which is lost: the message runs again on "b"
    assert RayBackend.process_message(backend, "message", context) == ("reply from b", "context")
    assert len(lost) == 1 and [x.name for x in pool.pool] == ["b"] and pool._future_to_actor == {}
    assert RayBackend.process_message(backend, "message", context) == ("reply from b", "context")  # not "a" again


def test_ray_actor_node():
    assert internals.ray_actor_node("ffffffffffffffffffffffff01000000") == {}  # Ray not running here: nothing known
    import ray._private.state as ray_state

    assert callable(ray_state.actors), "ray._private.state.actors is gone (server_app.raylost names lost nodes by it)"
