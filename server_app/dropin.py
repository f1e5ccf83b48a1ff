"""Churn for any Flower ServerApp: one line wraps its grid, and offline clients are unreachable.

::

    from server_app.dropin import with_availability

    grid = with_availability(grid, "bernoulli:p=0.5", num_clients=4, seed=0, results_dir="out")
    result = strategy.start(grid=grid, ...)   # the app's own loop, Flower's strategy or any rule

The ClientApp adds ``client_app.dropin.availability_mod`` to its mods, which tells the server
which client (``partition-id``) a node hosts. The schedule is applied by client id, from the round
in the message's config (``server-round``: Flower's strategies and the project's set it), in
:class:`server_app.network.AvailabilityGrid`, the one implementation the project's own ServerApp
uses too; it fails closed (a node that has not said which client it is receives nothing).

With ``gate="client"`` every message is delivered and the client declines its offline rounds
itself (the mod reads ``availability-gate``, ``availability`` and ``schedule-seed`` from the run
config: put the same spec and seed there).

**Deployed** (``python -m deploy launch --app PATH --churn``: real SuperNodes stopped and restarted
by the schedule), the launcher tells the wrapper through the ServerApp's environment
(:class:`Deployed`): nothing is filtered (offline nodes are really gone), the wrapper checks its
schedule against the launcher's (a mismatch fails the run), writes ``config.json`` at its start
and one ``metrics.jsonl`` line per round as soon as the round's train replies are in (``round``,
``participants``), the files the launcher follows for the project's own app, and before listing
round r's nodes it waits (at most the bound) for the launcher's round-start signal
``<signal dir>/round-<r>``, written once round r's nodes are registered. So rounds are known from
the app's own train messages (their ``server-round``); the federated evaluation of round r, which
Flower's loops send after training, reaches the nodes of round r + 1.

With ``results_dir``, after every round the wrapper writes the schedule (``availability.csv``),
the realised participation (``participation.csv``: the clients whose train reply came back
without error) and ``rounds.jsonl`` (one line per round: its number, when its train messages
went out, who was addressed, reached and replied), the same CSV layout as the project's runs
(:func:`server_app.results.write_matrix`), so realised can be checked against scheduled.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from availability import Schedule, build_schedule
from runconfig import AVAILABILITY_GATES
from strategies.protocol import server_round_of

from .network import AvailabilityGrid
from .results import METRICS, PARTICIPATION, write_matrix

flwr_log = logging.getLogger("flwr")
AVAILABILITY = "availability.csv"
ROUNDS = "rounds.jsonl"


def with_availability(grid: Grid, availability: str | Schedule, *, num_clients: int | None = None, seed: int = 0,
                      gate: str = "server", results_dir: str | Path | None = None,
                      identity_timeout: float = 300.0) -> ChurnGrid:
    """``grid`` with the availability schedule applied (see the module).

    ``availability``: a spec string (``"bernoulli:p=0.5"``; models that need the workload's label
    distributions take a built :class:`Schedule` instead) or a Schedule. ``num_clients``: N, the
    number of partitions (required with a spec; a Schedule has its own). ``seed``: the schedule's.
    ``identity_timeout``: the most seconds the first round waits for the nodes to say who they are
    (the identity query is a node's first message: in simulation it meets the workers' cold start,
    which took over 2 minutes on a loaded 2-core machine); later rounds ask new nodes again for at
    most 10 s.
    """
    if gate not in ("server", "client"):
        raise ValueError(f"with_availability: gate must be 'server' or 'client' (of {AVAILABILITY_GATES}; "
                         f"'none' means: do not wrap the grid), got {gate!r}")
    if isinstance(availability, Schedule):
        if num_clients is not None and num_clients != availability.num_clients:
            raise ValueError(f"with_availability: num_clients={num_clients} but the schedule has "
                             f"{availability.num_clients} clients")
        schedule = availability
    elif isinstance(availability, str):
        if num_clients is None:
            raise ValueError("with_availability: a spec string needs num_clients=N (the number of partitions)")
        schedule = build_schedule(availability, num_clients, seed)
    else:
        raise TypeError(f"with_availability: availability must be a spec string or a Schedule, "
                        f"got {type(availability).__name__}")
    flwr_log.info("availability: %s over N=%d clients, %s gate%s", schedule.spec, schedule.num_clients, gate,
                  f", written to {Path(results_dir).resolve()}" if results_dir is not None else "")
    deployed = Deployed.from_env()
    if deployed is not None:
        flwr_log.info("availability: deployed by python -m deploy launch: nodes are stopped and started by the "
                      "schedule (nothing filtered here); rounds recorded in %s", deployed.run_dir)
    return ChurnGrid(grid, schedule, gate, None if results_dir is None else Path(results_dir), identity_timeout,
                     deployed)


RUN_DIR_VAR = "FLCHURN_APP_RUN_DIR"  # the launcher's run folder (config.json, metrics.jsonl)
SIGNAL_VAR = "FLCHURN_APP_ROUND_SIGNAL"  # the folder of the round-start signals
BOUND_VAR = "FLCHURN_APP_ROUND_BOUND"  # the most seconds a round waits for its signal
SCHEDULE_VAR = "FLCHURN_APP_SCHEDULE"  # JSON {"spec", "seed", "num_clients"}: the launcher's schedule


@dataclass
class Deployed:
    """What ``python -m deploy launch --app`` tells the wrapper (environment variables above)."""

    run_dir: Path
    signal_dir: Path | None
    bound: float
    schedule: dict[str, Any]

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Deployed | None:
        if RUN_DIR_VAR not in env:
            return None
        signal = env.get(SIGNAL_VAR)
        return cls(Path(env[RUN_DIR_VAR]), Path(signal) if signal else None, float(env.get(BOUND_VAR, "30")),
                   json.loads(env.get(SCHEDULE_VAR, "{}")))

    def env(self) -> dict[str, str]:
        """The environment variables that say this to the ServerApp (the launcher sets them)."""
        out = {RUN_DIR_VAR: str(self.run_dir), BOUND_VAR: str(self.bound), SCHEDULE_VAR: json.dumps(self.schedule)}
        if self.signal_dir is not None:
            out[SIGNAL_VAR] = str(self.signal_dir)
        return out

    def check(self, schedule: Schedule) -> None:
        """ValueError unless ``schedule`` is the launcher's (spec, seed, N)."""
        mine = {"spec": schedule.spec, "seed": schedule.seed, "num_clients": schedule.num_clients}
        if self.schedule and self.schedule != mine:
            raise ValueError(f"with_availability: the ServerApp's schedule {mine} is not the launcher's "
                             f"{self.schedule}: pass the same spec, seed and N to both")

    def start(self, schedule: Schedule) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / METRICS).write_text("")
        (self.run_dir / "config.json").write_text(json.dumps({"schedule": schedule.describe()}, indent=2) + "\n")

    def wait_signal(self, rnd: int) -> None:
        """Until ``<signal dir>/round-<rnd>`` exists, at most ``bound`` seconds."""
        if self.signal_dir is None:
            return
        flag, deadline = self.signal_dir / f"round-{rnd}", time.monotonic() + self.bound
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    def record(self, row: dict[str, Any]) -> None:
        line = {"round": row["round"], "participants": row["replied"], "rejected": [],
                "unavailable-nodes": len(row["addressed"]) - len(row["replied"])}
        with (self.run_dir / METRICS).open("a") as fh:
            fh.write(json.dumps(line) + "\n")


class ChurnGrid(AvailabilityGrid):
    """:class:`AvailabilityGrid` (gate ``server``) or a pass-through that still learns identities
    (gate ``client``), recording who was addressed, reached and replied per round."""

    def __init__(self, grid: Grid, schedule: Schedule, gate: str, results_dir: Path | None,
                 identity_timeout: float, deployed: Deployed | None = None) -> None:
        super().__init__(grid, schedule, {}, identity_timeout)
        self.gate = "none" if deployed is not None else gate  # deployed: offline nodes are really gone
        self.results_dir = results_dir
        self.deployed = deployed
        self.rounds: dict[int, dict[str, Any]] = {}  # 1-based round -> its record
        self.signalled = 0  # the last round whose start signal was waited for
        if results_dir is not None:
            results_dir.mkdir(parents=True, exist_ok=True)
            (results_dir / ROUNDS).write_text("")
        if deployed is not None:
            deployed.check(schedule)
            deployed.start(schedule)

    def get_node_ids(self) -> Iterable[int]:
        """The grid's nodes; deployed, first the round-start signal of the next round (once)."""
        upcoming = max(self.rounds, default=0) + 1
        if self.deployed is not None and self.signalled < upcoming:
            self.signalled = upcoming
            self.deployed.wait_signal(upcoming)
        return self.grid.get_node_ids()

    def reachable(self, messages: list[Message]) -> list[Message]:  # noqa: D102
        if self.gate == "server":
            return super().reachable(messages)
        self.identify(messages)  # the client gates itself, or the node is gone: ids for the record only
        return messages

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == MessageType.TRAIN
                 and server_round_of(m.content) is not None]
        sent = time.time()
        keep = self.reachable(messages)
        replies = list(self.grid.send_and_receive(keep, timeout=timeout)) if keep else []
        if train:
            reached = {m.metadata.dst_node_id for m in keep} & {m.metadata.dst_node_id for m in train}
            rnd = server_round_of(train[0].content)
            assert rnd is not None
            self.record(rnd, sent, [m.metadata.dst_node_id for m in train], reached,
                        [r.metadata.src_node_id for r in replies if not r.has_error()])
        return replies

    def clients(self, nodes: Iterable[int]) -> list[int]:
        return sorted(self.client_of_node[n] for n in nodes if n in self.client_of_node)

    def record(self, rnd: int, sent: float, addressed: list[int], reached: set[int], replied: list[int]) -> None:
        """Note round ``rnd``'s train messages and replies; write the files when asked to."""
        row = {"round": rnd, "sent": sent, "addressed": self.clients(addressed), "reached": self.clients(reached),
               "replied": self.clients(n for n in replied if n in reached)}
        self.rounds[rnd] = row
        if self.deployed is not None:
            self.deployed.record(row)
        if self.results_dir is None:
            return
        with (self.results_dir / ROUNDS).open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        last = max(self.rounds)
        write_matrix(self.results_dir / AVAILABILITY, self.schedule.matrix(last))
        write_matrix(self.results_dir / PARTICIPATION, self.participation(last))

    def participation(self, num_rounds: int) -> np.ndarray:
        """Realised participation: (rounds, N) bool, row t = the clients whose round-(t+1) train reply
        came back without error."""
        out = np.zeros((num_rounds, self.schedule.num_clients), dtype=bool)
        for rnd, row in self.rounds.items():
            if rnd <= num_rounds:
                out[rnd - 1, [c for c in row["replied"] if 0 <= c < out.shape[1]]] = True
        return out
