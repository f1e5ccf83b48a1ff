"""Churn for any Flower ServerApp: one line wraps its grid, and offline clients are not connected.

::

    from server_app.dropin import with_availability

    grid = with_availability(grid, "bernoulli:p=0.5", num_clients=4, seed=0, results_dir="out")
    result = strategy.start(grid=grid, ...)   # Flower's Strategy.start, its workflows, or your own loop

The ClientApp adds ``client_app.dropin.availability_mod`` to its mods, which tells the server
which client (``partition-id``) a node hosts. The grid (:class:`server_app.churngrid.ChurnGrid`,
built on :class:`server_app.network.AvailabilityGrid`, the class the project's own ServerApp
uses) lists only the nodes online in the round about to be addressed, answers a message to an
offline node with Flower's unavailable-node error reply, dates every message by its
``server-round``, its ``group_id`` (Flower's workflows, SecAgg+ included) or, on request, its own
count of train rounds, and refuses a message it cannot date. It fails closed (a node that has not
said which client it is is neither listed nor reached) and fails the run when no client's update
came back in ``max_idle_rounds`` rounds with clients online (:class:`~server_app.churngrid.NoWorkDone`).

With ``gate="client"`` every message is delivered and the client declines its offline rounds
itself (the mod reads ``availability-gate``, ``availability`` and ``schedule-seed`` from the run
config: put the same spec and seed there).

**Deployed** (``python -m deploy launch --app PATH --churn``: real SuperNodes stopped and restarted
by the schedule), the launcher tells the wrapper through the ServerApp's environment
(:class:`Deployed`): nothing is filtered (offline nodes are really gone), the wrapper checks its
schedule against the launcher's (a mismatch fails the run), writes ``config.json`` at its start
and one ``metrics.jsonl`` line per round as soon as the round's training is over (``round``,
``participants``), the files the launcher follows for the project's own app, and before listing
round r's nodes it waits (at most the bound) for the launcher's round-start signal
``<signal dir>/round-<r>``, written once round r's nodes are registered. The federated
evaluation of round r, which Flower's loops send after training, reaches the nodes of round r + 1
(in simulation too: the grid's clock).

With ``results_dir``, after every round the wrapper writes the schedule (``availability.csv``),
the realised participation (``participation.csv``: the clients whose training reply came back
without error, in a round that completed) and ``rounds.jsonl`` (one line per round: its number,
when its training went out, who was addressed, reached and replied, its SecAgg+ stages, the
problems seen), the same CSV layout as the project's runs (:func:`server_app.results.write_matrix`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.serverapp import Grid

from availability import Schedule, build_schedule
from availability.base import ScheduleError
from runconfig import AVAILABILITY_GATES, did_you_mean
from virtualtime import VirtualClock

from .churngrid import AVAILABILITY, ROUNDS, ChurnGrid, NoWorkDone
from .messages import RoundUnknown
from .network import fast_pull
from .results import METRICS
from .sessionstages import SessionStages

__all__ = ["AVAILABILITY", "ROUNDS", "ChurnGrid", "Deployed", "NoWorkDone", "RoundUnknown", "with_availability"]
flwr_log = logging.getLogger("flwr")
LabelDists = np.ndarray | str | Path | Callable[[int], Any]


def with_availability(grid: Grid, availability: str | Schedule, *, num_clients: int | None = None, seed: int = 0,
                      gate: str = "server", results_dir: str | Path | None = None,
                      identity_timeout: float = 300.0, count_rounds: bool = False, max_idle_rounds: int = 3,
                      label_dists: LabelDists | None = None,
                      departures: Mapping[tuple[int, int], str] | None = None, clock: VirtualClock | None = None,
                      local_steps: int = 1) -> ChurnGrid:
    """``grid`` with the availability schedule applied (see the module).

    ``availability``: a spec string (``"bernoulli:p=0.5"``) or a built Schedule. ``num_clients``:
    N, the number of partitions (required with a spec; a Schedule has its own). ``seed``: the
    schedule's. ``label_dists``: for the models that need the clients' label distributions
    (``cyclic``, ``sine``, ...): an N x C array (row i: client i's label frequencies, summing to
    1), a ``.npy`` / ``.csv`` file of it, or a function of N that returns it.
    ``identity_timeout``: the most seconds the first listing waits for the nodes to say who they
    are (the identity query is a node's first message: in simulation it meets the workers' cold
    start, which took over 2 minutes on a loaded 2-core machine); later rounds ask new nodes again
    for at most 10 s. ``count_rounds``: date messages that name no round by the grid's own count
    of train rounds (each send of such TRAIN messages is the next round) instead of refusing them.
    ``max_idle_rounds``: fail the run when that many rounds with clients online have passed and no
    client's update ever came back (0: never). ``departures``: {(round, client): SecAgg+ stage}, the
    client's node leaves that round before that stage (``"share_keys"``, ``"collect_masked_vectors"``,
    ``"unmask"``): a session that ends mid-round. ``clock``: the virtual clock of the clients' devices
    (``virtualtime.VirtualClock(read_profiles(devices_toml, N, seed=...), model_bytes=..., seed=...)``),
    whose sessions (``session_on_s``, ``session_off_s``) give the departures instead
    (:class:`~server_app.sessionstages.SessionStages`: a job is ``local_steps`` steps): a node whose
    session is off when its round starts is not listed, one whose session ends during its job or
    before the round's end leaves before SecAgg+'s training or unmasking stage.
    """
    if gate not in ("server", "client"):
        raise ValueError(f"with_availability: gate must be 'server' or 'client' (of {AVAILABILITY_GATES}; "
                         f"'none' means: do not wrap the grid), got {gate!r}{did_you_mean(gate, ('server', 'client'))}")
    if isinstance(availability, Schedule):
        if num_clients is not None and num_clients != availability.num_clients:
            raise ValueError(f"with_availability: num_clients={num_clients} but the schedule has "
                             f"{availability.num_clients} clients")
        schedule = availability
    elif isinstance(availability, str):
        if num_clients is None:
            raise ValueError("with_availability: a spec string needs num_clients=N (the number of partitions)")
        schedule = _build(availability, num_clients, seed, label_dists)
    else:
        raise TypeError(f"with_availability: availability must be a spec string or a Schedule, "
                        f"got {type(availability).__name__}")
    leaving: Mapping[tuple[int, int], str] | SessionStages | None = departures
    if clock is not None:
        if departures:
            raise ValueError("with_availability: give departures or a clock (its sessions give the departures), "
                             "not both")
        leaving = SessionStages(clock, schedule, local_steps)
    flwr_log.info("availability: %s over N=%d clients, %s gate%s", schedule.spec, schedule.num_clients, gate,
                  f", written to {Path(results_dir).resolve()}" if results_dir is not None else "")
    deployed = Deployed.from_env()
    if deployed is not None:
        flwr_log.info("availability: deployed by python -m deploy launch: nodes are stopped and started by the "
                      "schedule (nothing filtered here); rounds recorded in %s", deployed.run_dir)
        deployed.check(schedule)
        deployed.start(schedule)
        grid = fast_pull(grid)  # as the project's ServerApp: replies looked for every 0.1 s, not Flower's 3 s
    return ChurnGrid(grid, schedule, gate, None if results_dir is None else Path(results_dir), identity_timeout,
                     deployed, count_rounds=count_rounds, max_idle_rounds=max_idle_rounds, departures=leaving)


def _build(spec: str, num_clients: int, seed: int, label_dists: LabelDists | None) -> Schedule:
    dists = _label_dists(label_dists, num_clients)
    try:
        return build_schedule(spec, num_clients, seed, label_dists=dists)
    except ScheduleError as err:
        if dists is None and "label distributions" in str(err):
            raise ScheduleError(
                f"{err}. In your own app, give them: with_availability(..., label_dists=D) where D is an N x C array "
                f"(row i: the label frequencies of partition i), a .npy or .csv file of it, or a function of N that "
                f"returns it (e.g. from your partitioner: workloads.partition.label_distributions(labels, parts, C))"
            ) from err
        raise


def _label_dists(value: LabelDists | None, num_clients: int) -> np.ndarray | None:
    if value is None:
        return None
    if isinstance(value, (str, Path)):
        path = Path(value)
        return np.load(path) if path.suffix == ".npy" else np.loadtxt(path, delimiter=",", ndmin=2)
    if callable(value):
        return np.asarray(value(num_clients), dtype=np.float64)
    return np.asarray(value, dtype=np.float64)


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
        line = {"round": row["round"], "participants": row["participants"], "rejected": [],
                "unavailable-nodes": len(row["addressed"]) - len(row["replied"])}
        with (self.run_dir / METRICS).open("a") as fh:
            fh.write(json.dumps(line) + "\n")
