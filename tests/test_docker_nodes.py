"""deploy.containers.DockerNodes against a fake Docker Engine API: a node the churn driver has
already sent SIGTERM (all leaving nodes at once) is waited for, never sent a second SIGTERM (which
lands after Flower restored the default handler and kills it mid-exit: exit 143); a node's stop
grace is the container's own times the host's slowdown (a graceful exit at load 26 outlived 10 s)."""

import json
import signal

import pytest

from deploy import containers
from deploy.containers import DockerNodes


@pytest.fixture(autouse=True)
def host_three_times_slower(monkeypatch):
    monkeypatch.setattr(containers, "host_slowdown", lambda: 3.0)


class FakeEngine:
    def __init__(self, exits_after_polls: int | None, stop_timeout: int = 1) -> None:
        self.calls: list[tuple[str, str]] = []
        self.polls = 0
        self.exits_after = exits_after_polls
        self.stop_timeout = stop_timeout

    def api(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        self.calls.append((method, path))
        if path.endswith("/json"):
            self.polls += 1
            running = self.exits_after is None or self.polls <= self.exits_after
            return 200, json.dumps({"State": {"Running": running}, "Config": {"StopTimeout": self.stop_timeout}}).encode()
        if "/logs" in path:
            return 200, b"SuperNode ID: 7\n"
        return 204, b""


def nodes_with(engine: FakeEngine) -> DockerNodes:
    nodes = DockerNodes(2, log=lambda _line: None)
    nodes._api = engine.api  # type: ignore[method-assign]
    return nodes


def posts(engine: FakeEngine) -> list[str]:
    return [p for m, p in engine.calls if m == "POST"]


def test_a_node_already_sent_sigterm_is_waited_for_not_signalled_again():
    engine = FakeEngine(exits_after_polls=3)
    nodes = nodes_with(engine)
    nodes.signal_node(0, signal.SIGTERM)
    nodes.stop_node(0, "term")
    assert posts(engine) == ["/containers/flchurn-supernode-0/kill?signal=SIGTERM"]  # one SIGTERM, no stop


def test_a_node_that_outlives_its_grace_is_killed():
    engine = FakeEngine(exits_after_polls=None, stop_timeout=0)
    nodes = nodes_with(engine)
    nodes.signal_node(1, signal.SIGTERM)
    nodes.stop_node(1, "term")
    assert posts(engine) == ["/containers/flchurn-supernode-1/kill?signal=SIGTERM",
                             "/containers/flchurn-supernode-1/kill?signal=SIGKILL"]


def test_a_node_not_signalled_before_gets_docker_stop_with_its_own_grace():
    engine = FakeEngine(exits_after_polls=0, stop_timeout=4)
    nodes = nodes_with(engine)
    nodes.stop_node(0, "term")
    assert posts(engine) == ["/containers/flchurn-supernode-0/stop?t=12"]  # stop_grace_period x the slowdown
    nodes.stop_node(0, "term", timeout=5)
    assert posts(engine)[-1] == "/containers/flchurn-supernode-0/stop?t=5"


def test_a_docker_engine_call_waits_as_long_as_the_host_needs():
    """30 s on an idle host, x the host's slowdown (3 here): a loaded daemon's answer is not a failure."""
    assert DockerNodes(1, log=lambda _line: None).request_timeout == pytest.approx(90.0)
