"""The churn driver: stop and start SuperNode processes so that the connected nodes follow the
availability schedule, in rounds (any spec) or in wall-clock seconds (``trace-intervals``).

Round mode (:class:`RoundChurn`)
--------------------------------
It follows the server through ``<run dir>/metrics.jsonl``: when round t's line appears, the
server is about to start round t + 1. In Flower round r (1-based; schedule round r - 1) the
connected nodes should be exactly {i : A(i, r - 1) = 1}, built from the same spec,
``schedule-seed`` and label distributions as the simulation (:func:`build_run_schedule`).

Timing semantics. Write L_t for the moment line t is written (L_0: ``config.json`` appears,
just before the server waits for ``min-nodes``) and D for the ServerApp's ``round-start-delay``
(0 until the server has that key). Round r's TRAIN messages go to the nodes connected at
S_r = L_{r-1} + D; a node that registers later is not addressed in round r, a node that
leaves after S_r still gets a message (its reply is an error or never comes).

- Stops happen at L_{r-1} for the nodes off in r. ``term`` (SIGTERM, ``docker stop``): the node
  deactivates at once and the SuperLink answers its pending messages with NODE_UNAVAILABLE, so
  even with D = 0 it only costs an error reply (a ClientApp needs seconds to start, so it cannot
  reply in between). ``kill`` (SIGKILL of the node's whole tree, a crash): the SuperLink still
  lists the node until its heartbeat expires (30 s x 2), every round in between waits its full
  ``round-timeout`` for that node, then gets NODE_UNAVAILABLE; the run still ends.
- Starts are the slow part: a SuperNode needs ~2 s (idle machine) to ~6 s (loaded 2-core box) to
  register. ``lookahead`` (default): the nodes that come on in round r are started during round
  r - 1, at S_{r-1} + ``margin``, i.e. after round r - 1's messages went out, so they are
  connected but unaddressed until S_r. They are in time when round r - 1 lasts longer than a
  node start (a round lasts at least one ClientApp start, several seconds; an empty round
  lasts ~0 s, so nodes after an empty round come late unless D covers a start). Caveat: a
  look-ahead node is connected during the end of round r - 1, so round r - 1's federated
  evaluation / round-end broadcast (messages addressed to *all connected* nodes after training)
  reach it; use ``lookahead=False`` with D >= a node's start time to be exact there.
  Without lookahead, nodes are started at L_{r-1} and the driver waits up to D for them.
- A node that is not registered at S_r is reported "late" (``self.late``); its reply for round r
  is missing. :attr:`missed` lists every (round, client) that the schedule has on but that the
  deployment could not serve (late, crashed), so a reference simulation can drop exactly those.
- Crashes on purpose: ``crashes={r: [(client, seconds_after_S_r[, "kill"|"term"]), ...]}``
  SIGKILLs (default; a power cut) or SIGTERMs a node in the middle of round r; the schedule
  decides when it comes back.

After the run (:func:`participation_report`): every recorded round's participants are compared
with the schedule. A difference is within the timing slack when it has a reason: the node was
late or taken down on purpose (:meth:`RoundChurn.explained`), or its reply was rejected (the
round's ``rejected`` list). Anything else (a client on in the schedule with no reply and no
reason, a client that took part while off) fails the run, naming rounds and clients.

A restarted SuperNode gets a new Flower node id (ephemeral identity); strategies key their
state by the ``client-id`` the ClientApp reports (its ``partition-id``), so nothing else is
needed (``tests/test_deploy.py`` checks that).

Wall-clock mode (:class:`WallClockChurn`)
-----------------------------------------
For ``trace-intervals`` specs: client i is connected while the elapsed time (x ``speedup``) mod
the trace's period lies in one of its on-intervals, independent of rounds; the server just
trains whoever is connected when a round starts.

The drivers are stepped from the caller's loop (``step()``): single-threaded on purpose.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from availability import Schedule, build_schedule, read_trace_intervals

from .launch import DeployError, Deployment

MODES = ("term", "kill")


def build_run_schedule(run_config: Mapping[str, Any]) -> Schedule:
    """The schedule the server builds for ``run_config`` (same spec, seed, label distributions)."""
    from workloads.config import AvailabilityConfig, WorkloadConfig, from_run_config
    from workloads.workload import get_workload

    wcfg = from_run_config(WorkloadConfig, run_config)
    acfg = from_run_config(AvailabilityConfig, run_config)
    needs_workload = acfg.availability.split(":", 1)[0] not in (
        "always", "bernoulli", "group-cyclic", "ln", "sln", "trace-matrix", "trace-intervals")
    label_dists = clusters = None
    if needs_workload or acfg.availability.startswith("dropout"):
        wl = get_workload(wcfg)
        label_dists, clusters = wl.label_dists, wl.clusters
    return build_schedule(acfg.availability, wcfg.num_clients, acfg.schedule_seed,
                          label_dists=label_dists, clusters=clusters)


def server_supports(key: str) -> bool:
    """Whether the ServerApp's run config has ``key`` (e.g. ``round-start-delay``)."""
    from server_app.config import ServerConfig

    return key.replace("-", "_") in {f.name for f in dataclasses.fields(ServerConfig)}


class RunFollower:
    """Tails a run folder's ``metrics.jsonl`` and notices the server's start (``config.json``
    written). Only what the server writes after construction counts: a resumed run's folder
    already holds ``config.json`` and the checkpoint's rounds (the launcher has cut
    ``metrics.jsonl`` back to them), so the start is a new ``config.json`` and the rows are those
    appended from then on."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.rows: list[dict[str, Any]] = []
        self.started_at: float | None = None
        self._config_was = self._config_stamp()
        metrics = self.run_dir / "metrics.jsonl"
        self._offset = metrics.stat().st_size if metrics.exists() else 0
        self._partial = ""

    def _config_stamp(self) -> tuple[int, int] | None:
        try:
            st = (self.run_dir / "config.json").stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_ino

    def poll(self) -> list[dict[str, Any]]:
        if self.started_at is None:
            stamp = self._config_stamp()
            if stamp is None or stamp == self._config_was:
                return []
            self.started_at = time.monotonic()
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        with path.open() as fh:
            fh.seek(self._offset)
            chunk = fh.read()
            self._offset = fh.tell()
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()  # an unfinished line waits for the next poll
        new = [json.loads(line) for line in lines if line.strip()]
        self.rows.extend(new)
        return new


class RoundChurn:
    """Round-following churn driver (see the module docstring for the timing semantics)."""

    def __init__(
        self,
        deployment: Deployment,
        schedule: Schedule,
        num_rounds: int,
        run_dir: str | Path,
        *,
        mode: str = "term",
        grace: float = 0.0,
        lookahead: bool = True,
        margin: float = 1.0,
        crashes: Mapping[int, list[tuple[int, float]]] | None = None,
        log: Callable[[str], None] | None = None,
        start_round: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"churn mode must be one of {MODES}, not {mode!r}")
        if schedule.num_clients != deployment.num_nodes:
            raise DeployError(f"schedule has {schedule.num_clients} clients, deployment {deployment.num_nodes} nodes")
        self.dep = deployment
        self.schedule = schedule
        self.num_rounds = num_rounds
        self.follow = RunFollower(Path(run_dir))
        self.start_round = int(start_round)  # a resumed run starts at its checkpoint's round + 1
        self.mode = mode
        self.grace = float(grace)
        self.lookahead = lookahead
        self.margin = float(margin)
        self.crashes = {int(r): list(v) for r, v in (crashes or {}).items()}
        self.log = log or deployment.log
        self.matrix = schedule.matrix(num_rounds).astype(bool)  # (R, N), row t = schedule round t
        self.timers: list[tuple[float, str, int, int]] = []  # (when, action, round, client)
        self.round = 0  # the server round in progress (0: not started)
        self.late: dict[int, list[int]] = {}
        # round -> {client: incarnation} up at the round's start / still up when it ended
        self.up_at_start: dict[int, dict[int, int]] = {}
        self.up_at_end: dict[int, dict[int, int]] = {}
        self.crashed: dict[int, list[int]] = {}
        self.events: list[dict[str, Any]] = []
        self.done = False
        if not self.on(self.start_round):
            raise DeployError(f"the schedule has nobody online in round {self.start_round}; min-nodes cannot "
                              "express that (0 means num-clients): choose another schedule-seed or trace")

    def on(self, r: int) -> set[int]:
        """Clients online in Flower round r (1-based)."""
        if not 1 <= r <= self.num_rounds:
            return set()
        return {int(i) for i in np.flatnonzero(self.matrix[r - 1])}

    @property
    def min_nodes(self) -> int:
        return len(self.on(self.start_round))

    @property
    def missed(self) -> set[tuple[int, int]]:
        """(round, client) pairs the schedule has on but the deployment did not serve."""
        out = {(r, c) for r, cs in self.late.items() for c in cs}
        return out | {(r, c) for r, cs in self.crashed.items() for c in cs}

    def _event(self, action: str, r: int, client: int, **extra: Any) -> None:
        self.events.append({"t": time.monotonic(), "action": action, "round": r, "client": client, **extra})

    def _up(self) -> dict[int, int]:
        return {i: self.dep.nodes[i].incarnations for i in self.dep.running_nodes()}

    def diagnose(self, r: int, client: int) -> str | None:
        """What the driver saw of a miss it cannot explain: the node stayed up through round r
        (a slow client: no reply within round-timeout) or went down without being told to."""
        start, end = self.up_at_start.get(r), self.up_at_end.get(r)
        if start is None or end is None or client not in start:
            return None
        if end.get(client) == start[client]:
            return "its node stayed up through the round but gave no valid reply within round-timeout"
        return "its node went down during the round although the driver did not stop it"

    def explained(self) -> dict[tuple[int, int], str]:
        """(round, client) -> why a client the schedule has on could not take part, for the
        misses the timing semantics allow: late nodes and nodes taken down on purpose."""
        out = {(r, c): "late: not registered when the round started" for r, cs in self.late.items() for c in cs}
        for e in self.events:
            if e["action"] in ("crash", "term"):
                how = "SIGKILL" if e["action"] == "crash" else "SIGTERM"
                out[e["round"], e["client"]] = f"taken down mid-round ({how}, asked for)"
        return out

    def prepare(self, timeout: float = 90.0) -> None:
        """Start the first round's nodes and wait until they are registered (before ``flwr run``)."""
        first = self.on(self.start_round)
        for i in sorted(first):
            self.dep.start_node(i)
            self._event("start", self.start_round, i)
        for i in sorted(first):
            self.dep.wait_registered(i, timeout)

    def step(self) -> None:
        """Act on new rounds and due timers; call every ~0.1 s."""
        if self.done:
            return
        was_started = self.follow.started_at is not None
        new_rows = self.follow.poll()
        if not was_started and self.follow.started_at is not None:
            self._begin(self.start_round, self.follow.started_at)
        for row in new_rows:
            finished = int(row["round"])
            self.up_at_end[finished] = self._up()
            if finished >= self.num_rounds:
                self.done = True
                self.timers.clear()
                return
            self._begin(finished + 1, time.monotonic())
        now = time.monotonic()
        due = [t for t in self.timers if t[0] <= now]
        self.timers = [t for t in self.timers if t[0] > now]
        for _, action, r, client in sorted(due):
            if action == "lookahead" and r == self.round + 1 and not self.dep.nodes[client].running:
                self.dep.start_node(client)
                self._event("start", r, client, lookahead=True)
            elif action in ("crash", "term") and r == self.round and self.dep.nodes[client].running:
                mode = "kill" if action == "crash" else "term"
                self.log(f"round {r}: taking node {client} down mid-round ({mode})")
                self.dep.stop_node(client, mode)
                self.crashed.setdefault(r, []).append(client)
                self._event(action, r, client)

    def _begin(self, r: int, at: float) -> None:
        """The server finished round r - 1 at ``at`` and starts round r at ``at`` + grace."""
        self.round = r
        want = self.on(r)
        leaving = sorted(self.dep.running_nodes() - want)
        if self.mode == "term":  # all leave at once; waiting for each exit comes after the check below
            for i in leaving:
                self.dep.signal_node(i, signal.SIGTERM)
        missing = sorted(i for i in want if not self.dep.nodes[i].running)
        for i in missing:  # not started ahead (no lookahead, a crash, or a node that died)
            self.dep.start_node(i)
            self._event("start", r, i, lookahead=False)
        deadline = at + max(0.0, self.grace - 0.3)
        while time.monotonic() < deadline and any(self.dep.registered_id(i) is None for i in want):
            time.sleep(0.05)
        late = sorted(i for i in want if self.dep.registered_id(i) is None)
        self.up_at_start[r] = {i: n for i, n in self._up().items() if i in want and i not in late}
        if late:
            self.late[r] = late
            self.log(f"round {r}: node(s) {late} not registered when the round started: they miss it")
        for i in leaving:
            self.dep.stop_node(i, self.mode)
            self._event("stop", r, i, mode=self.mode)
        for client, after, *how in self.crashes.get(r, []):
            if client in want:
                self.timers.append((at + self.grace + after, "crash" if not how or how[0] == "kill" else "term",
                                    r, client))
        if self.lookahead and r < self.num_rounds:
            when = at + self.grace + self.margin
            for i in sorted(self.on(r + 1) - want):
                self.timers.append((when, "lookahead", r + 1, i))

    def expected(self) -> np.ndarray:
        """The participation the deployment should realise: the schedule minus :attr:`missed`."""
        m = self.matrix.copy()
        for r, c in self.missed:
            m[r - 1, c] = False
        return m


@dataclass
class RoundReport:
    """One round: who the schedule has on, who took part, and why they differ."""

    round: int
    expected: list[int]
    got: list[int]
    why: dict[int, str]  # client -> why its participation differs from the schedule
    failed: list[int]  # the clients whose difference is beyond the documented timing slack


@dataclass
class ParticipationReport:
    """Realised participation (``metrics.jsonl``) against the schedule, round by round."""

    rounds: list[RoundReport]

    @property
    def differences(self) -> list[RoundReport]:
        return [r for r in self.rounds if r.why]

    @property
    def failures(self) -> list[RoundReport]:
        return [r for r in self.rounds if r.failed]

    def summary(self) -> str:
        diff = self.differences
        lines = [f"participation vs schedule: {len(diff)} of {len(self.rounds)} rounds differ, "
                 f"{len(self.failures)} beyond the timing slack"]
        for r in diff:
            lines.append(f"  round {r.round}: expected {r.expected}, got {r.got}; " + "; ".join(
                f"client {c}: {why}" + (" [FAIL]" if c in r.failed else "") for c, why in sorted(r.why.items())))
        return "\n".join(lines)

    def failure_text(self) -> str:
        return "; ".join(f"round {r.round}: " + ", ".join(f"client {c} ({r.why[c]})" for c in r.failed)
                         for r in self.failures)


def participation_report(
    expected: np.ndarray,
    rows: list[Mapping[str, Any]],
    *,
    explained: Mapping[tuple[int, int], str] | None = None,
    client_of_node: Mapping[int, int] | None = None,
    diagnose: Callable[[int, int], str | None] | None = None,
) -> ParticipationReport:
    """Compare each recorded round's ``participants`` with row ``round - 1`` of ``expected``
    (rounds x clients, the schedule the server uses; all ones when nothing churns).

    Within the documented timing slack (reported, not failed): a miss listed in ``explained``
    (a late node, a node taken down on purpose: :meth:`RoundChurn.explained`) and a reply the
    strategy rejected (the round's ``rejected`` list, node ids mapped by ``client_of_node``).
    Beyond it (failed): a client on in the schedule with no valid reply and no such reason (a
    node that stopped out of schedule, a client slower than round-timeout, or a driver that
    followed another schedule), and a client that took part while the schedule has it off.
    ``diagnose(round, client)`` (:meth:`RoundChurn.diagnose`) may say more about such a miss.
    """
    explained = explained or {}
    client_of_node = client_of_node or {}
    out = []
    for row in rows:
        r = int(row["round"])
        want = {int(c) for c in np.flatnonzero(expected[r - 1])}
        got = {int(c) for c in row["participants"]}
        rejected = {client_of_node[int(node)]: reason for node, reason in row.get("rejected", [])
                    if int(node) in client_of_node}
        why, failed = {}, []
        for c in sorted(want - got):
            if (r, c) in explained:
                why[c] = explained[r, c]
            elif c in rejected:
                why[c] = f"reply rejected: {rejected[c]}"
            else:
                why[c] = "on in the schedule but no valid reply: " + (
                    (diagnose and diagnose(r, c))
                    or "its node stopped out of schedule, was not addressed, or replied after round-timeout")
                failed.append(c)
        for c in sorted(got - want):
            why[c] = "took part while the schedule has it offline"
            failed.append(c)
        out.append(RoundReport(r, sorted(want), sorted(got), why, sorted(failed)))
    return ParticipationReport(out)


class WallClockChurn:
    """Wall-clock churn for ``trace-intervals`` schedules: node i is up while
    (elapsed x speedup) mod period is inside one of its intervals."""

    def __init__(self, deployment: Deployment, schedule: Schedule, *, mode: str = "term",
                 speedup: float = 1.0, log: Callable[[str], None] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"churn mode must be one of {MODES}, not {mode!r}")
        if schedule.name != "trace-intervals":
            raise DeployError(f"wall-clock churn needs a trace-intervals schedule, not {schedule.name!r}")
        if speedup <= 0:
            raise ValueError("speedup must be > 0")
        self.dep = deployment
        self.mode = mode
        self.speedup = float(speedup)
        self.log = log or deployment.log
        self.period, self.intervals = read_trace_intervals(schedule.path, schedule.num_clients)
        self.t0: float | None = None
        self.events: list[dict[str, Any]] = []
        self.done = False

    def on_at(self, seconds: float) -> set[int]:
        tau = seconds % self.period
        return {i for i, iv in enumerate(self.intervals)
                if np.any((tau - iv[:, 0]) % self.period < iv[:, 1] - iv[:, 0])}

    @property
    def min_nodes(self) -> int:
        n = len(self.on_at(0.0))
        if n == 0:
            raise DeployError("the trace has nobody online at time 0; min-nodes cannot express that")
        return n

    def prepare(self, timeout: float = 90.0) -> None:
        for i in sorted(self.on_at(0.0)):
            self.dep.start_node(i)
        for i in sorted(self.on_at(0.0)):
            self.dep.wait_registered(i, timeout)
        self.t0 = time.monotonic()

    def step(self) -> None:
        if self.t0 is None or self.done:
            return
        elapsed = (time.monotonic() - self.t0) * self.speedup
        want = self.on_at(elapsed)
        running = self.dep.running_nodes()
        for i in sorted(running - want):
            self.dep.stop_node(i, self.mode)
            self.events.append({"t": elapsed, "action": "stop", "client": i})
        for i in sorted(want - running):
            self.dep.start_node(i)
            self.events.append({"t": elapsed, "action": "start", "client": i})


# ---------------------------------------------------------------------- containers (compose)
class DockerNodes:
    """The node interface :class:`RoundChurn` needs, over Docker containers instead of processes.

    Talks to the Docker Engine API on a unix socket (``/var/run/docker.sock`` mounted into the
    churn service; no docker CLI needed). ``stop_node(i, "term")`` = ``docker stop`` (SIGTERM to
    the SuperNode, PID 1 under ``init: true``), ``"kill"`` = ``docker kill`` (SIGKILL);
    ``start_node`` = ``docker start``. Registration is read from the container's log since its
    last start ("SuperNode ID: ...").
    """

    class _Node:
        def __init__(self, owner: DockerNodes, i: int) -> None:
            self.owner, self.i = owner, i
            self.node_ids: list[int] = []
            self.incarnations = 0
            self.since = 0

        @property
        def running(self) -> bool:
            return self.owner._running(self.i)

    def __init__(self, num_nodes: int, container: str = "flchurn-supernode-{i}",
                 socket_path: str = "/var/run/docker.sock", log: Callable[[str], None] | None = None) -> None:
        self.num_nodes = num_nodes
        self.container = container
        self.socket_path = socket_path
        self.log = log or print
        self.nodes = {i: DockerNodes._Node(self, i) for i in range(num_nodes)}

    def _api(self, method: str, path: str, timeout: float = 30.0) -> tuple[int, bytes]:
        import http.client
        import socket

        class _Conn(http.client.HTTPConnection):
            def connect(conn) -> None:  # noqa: N805
                conn.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.sock.settimeout(timeout)
                conn.sock.connect(self.socket_path)

        c = _Conn("localhost", timeout=timeout)
        try:
            c.request(method, path)
            res = c.getresponse()
            return res.status, res.read()
        finally:
            c.close()

    def _name(self, i: int) -> str:
        return self.container.format(i=i)

    def _running(self, i: int) -> bool:
        status, body = self._api("GET", f"/containers/{self._name(i)}/json")
        return status == 200 and bool(json.loads(body)["State"]["Running"])

    def running_nodes(self) -> set[int]:
        return {i for i in self.nodes if self._running(i)}

    def start_node(self, i: int, wait: bool = False, timeout: float = 90.0) -> None:
        node = self.nodes[i]
        node.since = int(time.time()) - 1
        status, body = self._api("POST", f"/containers/{self._name(i)}/start")
        if status not in (204, 304):
            raise DeployError(f"docker start {self._name(i)}: {status} {body[:200]!r}")
        node.incarnations += 1
        self.log(f"node {i}: started ({self._name(i)})")
        if wait:
            self.wait_registered(i, timeout)

    def signal_node(self, i: int, sig: int = signal.SIGTERM) -> None:
        self.registered_id(i)
        name = signal.Signals(sig).name
        status, body = self._api("POST", f"/containers/{self._name(i)}/kill?signal={name}")
        if status not in (204, 304, 409):
            raise DeployError(f"docker kill --signal {name} {self._name(i)}: {status} {body[:200]!r}")

    def stop_node(self, i: int, mode: str = "term", timeout: float = 10.0) -> None:
        self.registered_id(i)
        path = (f"/containers/{self._name(i)}/stop?t={int(timeout)}" if mode == "term"
                else f"/containers/{self._name(i)}/kill?signal=SIGKILL")
        status, body = self._api("POST", path, timeout=timeout + 30)
        if status not in (204, 304, 409):
            raise DeployError(f"docker {mode} {self._name(i)}: {status} {body[:200]!r}")
        self.log(f"node {i}: stopped ({mode})")

    def registered_id(self, i: int) -> int | None:
        from .launch import NODE_ID_RE

        node = self.nodes[i]
        status, body = self._api("GET", f"/containers/{self._name(i)}/logs?stdout=1&stderr=1&since={node.since}")
        ids = NODE_ID_RE.findall(body.decode(errors="replace")) if status == 200 else []
        if not ids:
            return None
        nid = int(ids[-1])
        if not node.node_ids or node.node_ids[-1] != nid:
            node.node_ids.append(nid)
        return nid

    def wait_registered(self, i: int, timeout: float = 90.0) -> int:
        deadline = time.monotonic() + timeout
        while (nid := self.registered_id(i)) is None:
            if time.monotonic() > deadline:
                raise DeployError(f"{self._name(i)} did not register within {timeout:.0f} s")
            time.sleep(0.5)
        return nid


def compose_main(args) -> int:
    """The compose ``churn`` service: put the round-1 nodes in place, submit the run to the
    SuperLink service, follow it with :class:`RoundChurn` over :class:`DockerNodes`, exit 0 only
    if the run completed."""
    from .launch import (
        COMPLETED,
        CONNECTION,
        build_run_config,
        parse_run_config,
        run_dir_of,
    )

    def log(line: str) -> None:
        print(time.strftime("%H:%M:%S"), line, flush=True)

    nodes = DockerNodes(args.num_nodes, args.container, args.docker_socket, log=log)
    home = Path(args.cli_home)
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{args.superlink}"\n'
        + (f'root-certificates = "{args.root_certificates}"\n' if args.root_certificates else "insecure = true\n"))

    class _Shim:  # what build_run_config reads from a Deployment
        num_nodes = args.num_nodes

    user = {"results-dir": args.results_dir, **parse_run_config(args.run_config)}
    grace = args.grace if server_supports("round-start-delay") else 0.0
    cfg = build_run_config(_Shim(), user, grace=grace, project=args.project)  # the one run name
    rounds = int(cfg["num-server-rounds"])
    schedule = build_run_schedule(cfg)
    driver = RoundChurn(nodes, schedule, rounds, run_dir_of(cfg), mode=args.churn_mode,
                        grace=grace, log=log)  # type: ignore[arg-type]
    cfg["min-nodes"] = driver.min_nodes
    want = driver.on(1)
    for i in sorted(nodes.running_nodes() - want):
        nodes.stop_node(i, "term")
    for i in sorted(want):
        if not nodes.nodes[i].running:
            nodes.start_node(i)
    for i in sorted(want):
        nodes.wait_registered(i)
    path = Path(args.cli_home) / "run-config.toml"
    from .launch import toml_value

    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in cfg.items()))
    import os
    import subprocess

    env = {**os.environ, "FLWR_HOME": str(home)}
    res = subprocess.run(["flwr", "run", str(args.project), CONNECTION, "--run-config", str(path), "--format", "json"],
                         env=env, capture_output=True, text=True, timeout=300)
    doc = json.loads(res.stdout[res.stdout.index("{"):]) if "{" in res.stdout else {}
    if not doc.get("success"):
        log(f"flwr run failed: {res.stdout}\n{res.stderr}")
        return 1
    run_id = int(doc["run-id"])
    log(f"run {run_id} submitted; following {run_dir_of(cfg)}")
    # the status is read by a `flwr ls` in the background, so the driver never waits for it
    status, next_check, ls = "", time.monotonic() + 10, None
    while True:
        driver.step()
        if ls is None and time.monotonic() >= next_check:
            ls = subprocess.Popen(["flwr", "ls", CONNECTION, "--run-id", str(run_id), "--format", "json"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        elif ls is not None and ls.poll() is not None:
            out, ls = ls.communicate()[0] or "", None
            try:
                runs = json.loads(out[out.index("{"):]).get("runs", [])
                status = str(runs[0].get("status", "")) if runs else ""
            except ValueError:
                status = ""
            if status.startswith("finished"):
                break
            next_check = time.monotonic() + (2 if driver.done else 10)
        time.sleep(0.2)
    driver.follow.poll()
    report = participation_report(schedule.matrix(rounds).astype(bool), driver.follow.rows,
                                  explained=driver.explained(), diagnose=driver.diagnose,
                                  client_of_node={nid: i for i, n in nodes.nodes.items() for nid in n.node_ids})
    log(f"run {run_id}: {status}\n{report.summary()}")
    if report.failures:
        log(f"participation departs from the schedule beyond the timing slack: {report.failure_text()}")
    return 0 if status == COMPLETED and not report.failures else 1


def add_churn_args(p) -> None:
    p.add_argument("--num-nodes", type=int, required=True)
    p.add_argument("--run-config", default="", help="the run config, as for flwr run")
    p.add_argument("--churn-mode", choices=MODES, default="term")
    p.add_argument("--grace", type=float, default=3.0, help="round-start-delay (if the ServerApp has it)")
    p.add_argument("--superlink", default="superlink:8000", help="SuperLink address for the flwr CLI")
    p.add_argument("--root-certificates", default="", help="CA file: TLS connection (else insecure)")
    p.add_argument("--results-dir", default="/results",
                   help="results-dir as the ServerApp sees it (shared volume); a results-dir in --run-config wins")
    p.add_argument("--project", default="/app", help="the Flower app to submit")
    p.add_argument("--cli-home", default="/tmp/flwr-cli", help="FLWR_HOME of the flwr CLI")
    p.add_argument("--container", default="flchurn-supernode-{i}", help="container name pattern of node i")
    p.add_argument("--docker-socket", default="/var/run/docker.sock")
