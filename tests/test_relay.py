"""The latency/loss relay (deploy/relay.py) on loopback, no root: the round trip through it is at
least the configured RTT, the data arrives intact and in order, and a seeded loss holds some
chunks back one RTO without dropping or reordering any."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from deploy.procs import free_port, port_open
from deploy.relay import Impairment, Relay, argv


async def _echo_server() -> tuple[asyncio.Server, int]:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


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
    assert sum(d >= imp.rto_s for d in relay.up.delays + relay.down.delays) == held
    # the same seed draws the same chunks: the run is reproducible
    _, _, _, again = _through_relay(imp, msgs)
    assert (again.up.retransmitted, again.down.retransmitted) == (relay.up.retransmitted, relay.down.retransmitted)


def test_bad_impairments_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="loss = 1.0 must be >= 0 and < 1"):
        Impairment(rtt_ms=10, loss=1.0)
    with pytest.raises(ValueError, match="rtt_ms = -1 must be"):
        Impairment(rtt_ms=-1)
    res = subprocess.run([sys.executable, "-m", "deploy.relay", "--listen", "nowhere", "--to", "127.0.0.1:1"],
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
