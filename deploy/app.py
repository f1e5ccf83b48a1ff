"""``python -m deploy launch --app PATH``: the launcher for any Flower app, not only the project's.

The app's ServerApp wraps its grid with ``server_app.dropin.with_availability`` and its ClientApp
answers the identity query (``client_app.dropin``; docs/dropin.md). Everything else is the
project's own deployment path (:func:`deploy.run.run_deployment`: the SuperLink and SuperNodes as
processes, the round churn driver that stops and restarts SuperNodes by the schedule, the
follower, the participation report). How the launcher knows the app's rounds: the wrapper, told by
the ServerApp's environment (:class:`server_app.dropin.Deployed`, set on the SuperLink here),
writes ``config.json`` when it starts and a ``metrics.jsonl`` line (round, participants) as soon
as a round's train replies are in, into the run folder the launcher follows, and waits for the
launcher's round-start signal before listing the next round's nodes: the same files and signal
as the project's ServerApp. The wrapper waits for round r's signal at its first listing of nodes
after round r - 1's training, which is the round r - 1 evaluation in Flower's loops: that
evaluation reaches round r's nodes, and nodes are started when their round's signal is due, not
one round ahead (no look-ahead: a node started early would be listed for round r). The schedule is given here (``--availability``, ``--schedule-seed``;
N = ``--num-nodes``) and the wrapper refuses to run with another one.
"""

from __future__ import annotations

import tempfile
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from availability import Schedule, build_schedule
from server_app.dropin import Deployed

from .errors import DeployError


@dataclass
class AppRun:
    """One run of a Flower app that is not the project's: what the launcher follows."""

    app: Path
    schedule: Schedule
    num_rounds: int
    run_dir: Path  # the wrapper's config.json and metrics.jsonl
    signal_dir: Path | None  # the round-start signals (None: no signal)
    bound: float  # the most a round waits for its signal

    def server_env(self) -> dict[str, str]:
        """The environment of the SuperLink (and so of the ServerApp it starts) for this run."""
        sched = {"spec": self.schedule.spec, "seed": self.schedule.seed, "num_clients": self.schedule.num_clients}
        return Deployed(self.run_dir, self.signal_dir, self.bound, sched).env()


def app_config(app: Path) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]`` (DeployError naming the file when it has none)."""
    path = app / "pyproject.toml"
    try:
        return dict(tomllib.loads(path.read_text())["tool"]["flwr"]["app"].get("config", {}))
    except (OSError, KeyError, tomllib.TOMLDecodeError) as err:
        raise DeployError(f"--app {app}: {path} is not a Flower app's pyproject.toml ({type(err).__name__}: {err})") \
            from err


def check_app_schedule(spec: str, num_nodes: int, seed: int, where: str) -> Schedule:
    """The schedule the launcher and the app's wrapper will both build, built here first, before
    any SuperLink or SuperNode starts: a DeployError naming ``where`` the spec came from, the
    problem and the closest known model (``did you mean 'bernoulli'?``)."""
    try:
        return build_schedule(spec, num_nodes, seed)
    except ValueError as err:  # ScheduleError, SpecError
        raise DeployError(f"{where} = {spec!r}: {err}") from err


def app_run(app: str | Path, overrides: Mapping[str, Any], num_nodes: int, availability: str, seed: int,
            work_dir: Path, bound: float = 30.0, signal: bool = True) -> AppRun:
    """The :class:`AppRun` of ``app`` with run-config ``overrides``: its rounds from
    ``num-server-rounds`` (overrides first, then the app's own config)."""
    app = Path(app).resolve()
    config = {**app_config(app), **overrides}
    if "num-server-rounds" not in config:
        raise DeployError(f"--app {app}: its run config has no 'num-server-rounds': the launcher needs the number "
                          f"of rounds (add it, or pass --run-config \"num-server-rounds=R\")")
    run_dir = Path(tempfile.mkdtemp(prefix="app-run-", dir=work_dir))
    signal_dir = run_dir / "signals" if signal else None
    if signal_dir is not None:
        signal_dir.mkdir()
    return AppRun(app, build_schedule(availability, num_nodes, seed), int(config["num-server-rounds"]), run_dir,
                  signal_dir, bound)
