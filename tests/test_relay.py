"""The latency/loss relay (deploy/relay.py) on loopback, no root: the round trip through it is at
least the configured RTT, the data arrives intact and in order, and a seeded loss holds some
chunks back one RTO without dropping or reordering any."""

from __future__ import annotations

import asyncio
import socket
import socketserver
import subprocess
import sys
import threading
import time

import pytest
from launching import launch_until_submitted

from deploy.edge.relay import Impairment, Relay, argv
from deploy.procs import free_port, port_open


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while data := await r.read(65536):
                w.write(data)
                await w.drain()
        except asyncio.CancelledError:  # the test's loop ends first: quietly
            pass
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while data := self.request.recv(65536):
            self.request.sendall(data)


async def _round_trips(port: int, messages: list[bytes]) -> tuple[list[float], bytes]:
    """Send each message and wait for its echo: (seconds per round trip, all bytes echoed)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    times, got = [], b""
    for m in messages:
        t0 = time.perf_counter()
        w.write(m)
        await w.drain()
        back = await r.readexactly(len(m))
        times.append(time.perf_counter() - t0)
        got += back
    w.close()
    await w.wait_closed()
    return times, got


def _through_relay(imp: Impairment, messages: list[bytes]):
    async def go():
        server, port = await _echo_server()
        relay = Relay(("127.0.0.1", port), imp)
        rport = await relay.start("127.0.0.1", 0)
        direct, _ = await _round_trips(port, messages[:5])
        via, got = await _round_trips(rport, messages)
        await relay.close()
        server.close()
        return direct, via, got, relay

    return asyncio.run(go())


@pytest.mark.parametrize("rtt_ms", [50, 100])
def test_the_relay_adds_the_configured_round_trip_and_keeps_the_data(rtt_ms):
    msgs = [bytes([k % 256]) * (100 + 997 * k) for k in range(8)]
    _, via, got, relay = _through_relay(Impairment(rtt_ms=rtt_ms), msgs)
    assert got == b"".join(msgs)  # intact and in order
    assert min(via) >= rtt_ms / 1000  # each direction held rtt/2
    assert relay.up.retransmitted == relay.down.retransmitted == 0
    assert relay.up.bytes == relay.down.bytes == len(got)


def test_a_seeded_loss_holds_some_chunks_one_rto_and_loses_or_reorders_none():
    imp = Impairment(rtt_ms=20, loss=0.3, seed=7)
    msgs = [k.to_bytes(4, "big") * 64 for k in range(40)]  # distinct, so a reordering would show
    _, via, got, relay = _through_relay(imp, msgs)
    assert got == b"".join(msgs)
    held = relay.up.retransmitted + relay.down.retransmitted
    assert 0 < held < relay.up.chunks + relay.down.chunks
    assert imp.rto_s == 0.2  # max(200 ms, 2 * 20 ms)
    slow = [t for t in via if t >= imp.rtt_ms / 1000 + imp.rto_s]
    assert len(slow) >= 1  # a held chunk cost its round trip an RTO
    assert sum(d >= imp.rto_s for d in [*relay.up.delays, *relay.down.delays]) == held
    # the same seed draws the same chunks: the run is reproducible
    _, _, _, again = _through_relay(imp, msgs)
    assert (again.up.retransmitted, again.down.retransmitted) == (relay.up.retransmitted, relay.down.retransmitted)


def test_bad_impairments_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="loss = 1.0 must be >= 0 and < 1"):
        Impairment(rtt_ms=10, loss=1.0)
    with pytest.raises(ValueError, match="rtt_ms = -1 must be"):
        Impairment(rtt_ms=-1)
    res = subprocess.run([sys.executable, "-m", "deploy.edge.relay", "--listen", "nowhere", "--to", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "'nowhere' is not HOST:PORT" in res.stderr


def test_the_relay_process_forwards_and_stops_on_sigterm():
    async def go(rport: int) -> bytes:
        _, got = await _round_trips(rport, [b"hello", b"world"])
        return got

    async def with_server() -> tuple[bytes, str]:
        server, port = await _echo_server()
        rport = free_port()
        proc = await asyncio.create_subprocess_exec(
            *argv(("127.0.0.1", rport), ("127.0.0.1", port), Impairment(rtt_ms=10)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            for _ in range(100):
                if port_open(rport):
                    break
                await asyncio.sleep(0.1)
            got = await go(rport)
        finally:
            proc.terminate()
            out, _ = await asyncio.wait_for(proc.communicate(), 10)
            server.close()
        assert proc.returncode == 0
        return got, out.decode()

    got, log = asyncio.run(with_server())
    assert got == b"helloworld"
    assert "rtt 10 ms" in log and "stopped" in log


def test_edge_limits_start_a_relay_per_relayed_node_and_point_its_supernode_at_it(tmp_path):
    """The launcher's wiring without root: a relayed node's SuperNode address is its relay, the
    relay forwards to the SuperLink's port, a restart replaces it, and closing the spawner stops it."""
    from types import SimpleNamespace

    from deploy.edge.devices import parse_devices
    from deploy.edge.limits import EdgeLimits
    from deploy.procs import Spawner

    plan = parse_devices({"far": {"count": 1, "rtt_ms": 40}}, 2)
    limits = EdgeLimits(plan, "relaytst")
    limits.nets = {0: SimpleNamespace(host_ip="127.0.0.1")}  # what setup() makes as root
    limits.relayed = {0: Impairment(rtt_ms=40, seed=0)}
    spawner = Spawner("relaytest" + str(free_port()), tmp_path, {})
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def through(addr: str, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", int(addr.rsplit(":", 1)[1])), timeout=10) as s:
            s.sendall(data)
            return s.recv(len(data))

    def spawn(name, a):  # from this thread: a child's parent-death signal follows its spawning thread
        return spawner.spawn(name, a, tmp_path)

    try:
        limits.start_relays(spawn, port)
        first = limits.superlink_address(0, port)
        got = through(first, b"abc")
        old = limits.relay_procs()
        limits.start_relays(spawn, port)
        second = limits.superlink_address(0, port)
        again = through(second, b"def")
        assert got == b"abc" and again == b"def"
        assert len(old) == 1 and not old[0].alive and limits.relay_procs() != old  # a restart replaces it
        assert limits.superlink_address(1, 1234) == "127.0.0.1:1234"  # an unrelayed node: the SuperLink
        procs = limits.relay_procs()
        assert len(procs) == 1 and procs[0].alive
    finally:
        spawner.close(limits.relay_procs())
        server.shutdown()
    assert not procs[0].alive and spawner.leftovers() == []
    assert "rtt 40 ms" in (tmp_path / "relay-0.log").read_text()


# ---------------------------------------------------------------------- a real deployment (root, opt-in)
HTTP_RTT = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((host, port), timeout=20)
buf = b""
rtts = []
for k in range(6):  # keep-alive GETs on one connection: each costs one round trip
    t = time.perf_counter()
    s.sendall(b"GET /flchurn-rtt-probe HTTP/1.1\r\nHost: superlink\r\n\r\n")
    while b"\r\n\r\n" not in buf:
        c = s.recv(65536)
        assert c, "connection closed"
        buf += c
    head, buf = buf.split(b"\r\n\r\n", 1)
    n = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(buf) < n:
        c = s.recv(65536)
        assert c, "connection closed"
        buf += c
    buf = buf[n:]
    rtts.append(time.perf_counter() - t)
print(min(rtts[1:]))
"""


def _root_skip() -> str | None:
    import os

    from deploy.edge.limits import requirements

    if os.environ.get("FLCHURN_EDGE_TESTS") != "1":
        return "edge limit tests are opt-in: FLCHURN_EDGE_TESTS=1 (root: cgroups, network namespaces)"
    from deploy.edge.devices import parse_devices
    return requirements(parse_devices({"x": {"count": 1, "rtt_ms": 50}}, 1))


ROOT_SKIP = _root_skip()


@pytest.mark.skipif(ROOT_SKIP is not None, reason=str(ROOT_SKIP))
@pytest.mark.slow
def test_a_real_deployment_with_an_rtt_class_completes_and_its_node_measures_the_rtt(tmp_path):
    """Two SuperNodes, one in a 100 ms, 2 % loss class: the run completes, and an HTTP request from the far
    node's namespace to the address its SuperNode uses (its relay; Flower 1.41's Fleet API is
    HTTP) takes >= 100 ms, while the near node reaches the SuperLink directly."""
    from deploy.edge.devices import parse_devices
    from deploy.local import ProcessSite
    from deploy.run import run_deployment

    rtt_ms = 100
    plan = parse_devices({"far": {"count": 1, "rtt_ms": rtt_ms, "loss": 0.02}, "near": {"count": 1}}, 2)
    cfg = {"num-server-rounds": 2, "strategy": "fedavg-all", "availability": "always", "dataset": "digits",
           "model": "logreg", "local-steps": "steps:n=5", "partition": "iid", "round-timeout": 300.0,
           "checkpoint-every": 0, "device": "cpu", "progress": False, "results-dir": str(tmp_path / "results")}
    lines: list[str] = []
    dep = ProcessSite(2, tmp_path / "work", devices=plan, log=lines.append)
    try:
        with dep:
            out = run_deployment(dep, cfg, timeout=900)
            assert out.completed, (out.status, lines)
            far = dep.edge.superlink_address(0, dep.superlink_port)
            near = dep.edge.superlink_address(1, dep.superlink_port)
            probe = {}
            for i, addr in ((0, far), (1, near)):
                host, port = addr.rsplit(":", 1)
                res = subprocess.run([sys.executable, "-c", HTTP_RTT, host, port], preexec_fn=dep.edge.preexec(i),
                                     capture_output=True, text=True, timeout=120)
                assert res.returncode == 0, res.stderr
                probe[i] = float(res.stdout)
            relays = dep.edge.relay_procs()
    finally:
        dep.close()
    print(f"HTTP round trip to the Fleet API: node 0 via its {rtt_ms} ms relay {probe[0] * 1000:.1f} ms, node 1 direct "
          f"{probe[1] * 1000:.2f} ms; round times {[round(r['round-time'], 2) for r in out.rows]}")
    assert far != near and near.endswith(f":{dep.superlink_port}")
    assert probe[0] >= rtt_ms / 1000
    relay_log = relays[0].log.read_text()
    print(relay_log.splitlines()[-2] if len(relay_log.splitlines()) > 1 else relay_log)
    assert "rtt 100 ms, loss 0.02 (RTO 200 ms), seed 0" in relay_log and "stopped" in relay_log
    assert len(relays) == 1 and not relays[0].alive
    assert dep.edge.leftovers() == [] and dep.leftovers() == []


@pytest.mark.skipif(ROOT_SKIP is not None, reason=str(ROOT_SKIP))
@pytest.mark.slow
def test_ctrl_c_stops_the_relays_with_the_launcher(tmp_path):
    """The launcher with an rtt class, interrupted (SIGINT) once its nodes run: exit 130, and its
    relay processes are gone with the nodes."""
    import signal

    def relays() -> set[str]:
        out = subprocess.run(["pgrep", "-f", "deploy.edge.relay --listen"], capture_output=True, text=True).stdout
        return set(out.split())

    before = relays()
    proc, seen = launch_until_submitted(tmp_path, "[far]\ncount = 1\nrtt_ms = 60\n\n[near]\ncount = 1\n")
    assert "relay on" in seen, seen
    during = relays() - before
    assert len(during) == 1, during
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, seen + out
    assert relays() & during == set()
