"""A user-space TCP relay that adds latency and TCP-level loss to one node's path to the SuperLink:
the fallback for ``rtt_ms``/``loss`` where the kernel has no ``netem`` qdisc (:mod:`deploy.edge.netns`).

The node's SuperNode connects to the relay instead of the SuperLink's Fleet API; the relay opens
one upstream connection per node connection and forwards both directions. Each chunk read from
one side is stamped with its arrival time and written to the other side ``rtt_ms / 2`` later (a
queue per direction, one timestamp per chunk, no per-byte sleeping), so a request and its answer
cross it with ``rtt_ms`` added, and the order of the bytes is kept.

Loss. A relay above TCP cannot drop bytes: the kernel's TCP below it has already delivered them
in order. What a lost segment costs a TCP stream is a retransmission: the data arrives one
retransmission timeout (RTO) late, and everything behind it waits (head-of-line blocking). So
with probability ``loss`` per chunk (a seeded draw, per connection and direction) the chunk is
held back an extra RTO of ``max(200 ms, 2 * rtt_ms)`` (Linux's minimum RTO is 200 ms,
``TCP_RTO_MIN``; RFC 6298 sets RTO >= SRTT + 4 RTTVAR), and the chunks after it are never
delivered before it. No byte is dropped or reordered; this is loss as TCP's user sees it, not
packet loss on the wire (no congestion-window reduction, one draw per chunk, not per segment).

Run as ``python -m deploy.edge.relay --listen HOST:PORT --to HOST:PORT --rtt-ms 100 --loss 0.01
--seed 0``; the process launcher starts one per node that needs it (:mod:`deploy.edge.limits`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field

CHUNK = 64 * 1024
QUEUE = 256  # chunks in flight per direction (up to 16 MiB): a full queue stops reading (back-pressure)
MIN_RTO_S = 0.2


@dataclass(frozen=True)
class Impairment:
    """Added round-trip time (ms) and per-chunk loss probability of one path, with its seed."""

    rtt_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.rtt_ms >= 0 and self.rtt_ms < float("inf")):
            raise ValueError(f"rtt_ms = {self.rtt_ms!r} must be a finite number >= 0")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss = {self.loss!r} must be >= 0 and < 1")

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    @property
    def rto_s(self) -> float:
        """What one lost segment costs: a retransmission timeout, max(200 ms, 2 RTT)."""
        return max(MIN_RTO_S, 2 * self.rtt_ms / 1000.0)

    def rng(self, conn: int, direction: str) -> random.Random:
        """The loss draws of connection ``conn`` (0, 1, ...) in ``direction`` ("up"/"down")."""
        return random.Random(f"{self.seed}:{conn}:{direction}")  # str seeds are stable across runs


@dataclass
class Stats:
    """What one relay forwarded: connections, chunks and bytes, chunks held back by an RTO."""

    connections: int = 0
    chunks: int = 0
    bytes: int = 0
    retransmitted: int = 0
    delays: deque[float] = field(default_factory=lambda: deque(maxlen=10_000), repr=False)  # last chunks: s held


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, imp: Impairment,
                rng: random.Random, stats: Stats) -> None:
    """Forward ``reader`` to ``writer``, each chunk due at arrival + one-way delay (+ an RTO if
    drawn lost), never before the chunk ahead of it; half-close ``writer`` at EOF."""
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(QUEUE)

    async def read() -> None:
        last_due = 0.0
        try:
            while data := await reader.read(CHUNK):
                now = time.monotonic()
                lost = imp.loss > 0 and rng.random() < imp.loss
                due = max(now + imp.one_way_s + (imp.rto_s if lost else 0.0), last_due)
                last_due = due
                stats.chunks += 1
                stats.bytes += len(data)
                stats.retransmitted += lost
                stats.delays.append(due - now)
                await queue.put((due, data))
        finally:
            await queue.put(None)

    async def write() -> None:
        while (item := await queue.get()) is not None:
            due, data = item
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    reading = asyncio.create_task(read())
    try:
        await write()
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
            await reading


class Relay:
    """Listens on ``listen``; every connection is forwarded to ``target`` with ``imp`` added."""

    def __init__(self, target: tuple[str, int], imp: Impairment, log=None) -> None:
        self.target = target
        self.imp = imp
        self.log = log or (lambda line: None)
        self.up, self.down = Stats(), Stats()
        self.server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen (``port`` 0: any free port); the port listened on."""
        self.server = await asyncio.start_server(self._serve, host, port)
        return self.server.sockets[0].getsockname()[1]

    async def _serve(self, node_r: asyncio.StreamReader, node_w: asyncio.StreamWriter) -> None:
        conn = self.up.connections
        self.up.connections += 1
        self.down.connections += 1
        try:
            link_r, link_w = await asyncio.open_connection(*self.target)
        except OSError as err:
            self.log(f"connection {conn}: cannot reach {self.target[0]}:{self.target[1]}: {err}")
            node_w.close()
            return
        try:
            await asyncio.gather(_pipe(node_r, link_w, self.imp, self.imp.rng(conn, "up"), self.up),
                                 _pipe(link_r, node_w, self.imp, self.imp.rng(conn, "down"), self.down))
        except (ConnectionError, OSError) as err:
            self.log(f"connection {conn}: {err!r}")
        except asyncio.CancelledError:  # the relay stops: end this connection's task quietly
            pass
        finally:
            for w in (link_w, node_w):
                w.close()
                with contextlib.suppress(ConnectionError, OSError):
                    await w.wait_closed()
            self.log(f"connection {conn} closed; all connections so far: up {self.up.chunks} chunks / {self.up.bytes} B "
                     f"({self.up.retransmitted} held an RTO), down {self.down.chunks} chunks / "
                     f"{self.down.bytes} B ({self.down.retransmitted} held an RTO)")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def argv(listen: tuple[str, int], target: tuple[str, int], imp: Impairment) -> list[str]:
    """The command line of a relay process (see the module docstring)."""
    return [sys.executable, "-m", "deploy.edge.relay", "--listen", f"{listen[0]}:{listen[1]}",
            "--to", f"{target[0]}:{target[1]}", "--rtt-ms", f"{imp.rtt_ms:g}", "--loss", f"{imp.loss:g}",
            "--seed", str(imp.seed)]


async def _main(args: argparse.Namespace) -> None:
    imp = Impairment(args.rtt_ms, args.loss, args.seed)

    def log(line: str) -> None:
        print(f"relay {args.listen[0]}:{args.listen[1]}: {line}", flush=True)

    relay = Relay(args.to, imp, log)
    port = await relay.start(*args.listen)
    log(f"listening on port {port}, forwarding to {args.to[0]}:{args.to[1]} with rtt {imp.rtt_ms:g} ms, "
        f"loss {imp.loss:g} (RTO {imp.rto_s * 1000:g} ms), seed {imp.seed}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await relay.close()
    log("stopped")


def main(args: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m deploy.edge.relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", type=_address, required=True, help="HOST:PORT to listen on")
    p.add_argument("--to", type=_address, required=True, help="HOST:PORT to forward to (the Fleet API)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time, ms")
    p.add_argument("--loss", type=float, default=0.0, help="per-chunk loss probability (costs an RTO)")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(args)
    try:
        Impairment(ns.rtt_ms, ns.loss, ns.seed)
    except ValueError as err:
        p.error(str(err))
    asyncio.run(_main(ns))


if __name__ == "__main__":
    main()
