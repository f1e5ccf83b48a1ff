"""One deployed run, end to end, on any :class:`deploy.nodes.Site` (processes of
:mod:`deploy.local` or the containers of :mod:`deploy.containers`): :func:`run_deployment`.

The run config is built once (:func:`deploy.submission.build_run_config`: one run name, so the
churn driver and the server follow the same folder), the nodes started, the run submitted and
followed; a run can continue from a checkpoint (``resume_from``: a fresh SuperLink and fresh
nodes, the same run folder). Afterwards the realised participation is compared with the
schedule (:func:`deploy.participation.participation_report`); :attr:`RunOutcome.ok` requires both a
completed run and no difference beyond the timing slack.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from availability import Schedule
from runconfig.defaults import default_run_config
from strategies.registry import is_asynchronous_spec

from .app import AppRun
from .async_churn import AggregationChurn
from .auth import note_auth_failures
from .churn import ChurnDriver, Crash, RoundChurn, WallClockChurn
from .errors import DeployError
from .flwr_cli import COMPLETED, FINISHED, FlwrCli
from .follow import RoundFinished, RunDone, RunFollower, Submitted
from .nodes import Site
from .participation import ParticipationReport, participation_report
from .submission import (
    build_run_config,
    build_run_schedule,
    check_run_config,
    prepare_resume,
    run_dir_of,
)

# seconds before each round under churn (round-start-delay): a returning SuperNode, started one round
# early, needs 2-5 s to register, and a tuned round can be shorter than that
DEFAULT_GRACE = 3.0
# with the round-start signal, the most a round waits for its devices to register (then: late)
DEFAULT_BOUND = 30.0


@dataclass
class RunOutcome:
    status: str
    run_id: int
    run_dir: Path
    rows: list[dict[str, Any]]  # the rounds this run recorded (a resumed run: checkpoint + 1 on)
    run_config: dict[str, Any]
    driver: ChurnDriver | None = None
    wall: float = 0.0
    submitted_at: float = 0.0
    report: ParticipationReport | None = None  # realised participation vs the schedule
    # an asynchronous run under churn: row -> clients that arrived although their node was down
    off_arrivals: dict[int, list[int]] | None = None
    # "node i" / "SuperLink" -> its tasks' calls answered 401 (task-token authentication failed)
    auth_failures: dict[str, int] = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        return self.status == COMPLETED

    @property
    def ok(self) -> bool:
        """Completed, and participation followed the schedule up to the documented timing slack
        (an asynchronous run: nobody arrived from a node the driver had down)."""
        return (self.completed and (self.report is None or not self.report.failures)
                and not self.off_arrivals)


def churn_grace(grace: float | None, signal: bool = False) -> float:
    """``round-start-delay`` under churn: ``grace``, by default :data:`DEFAULT_BOUND` with the
    round-start signal (the most a round waits), else :data:`DEFAULT_GRACE` (a fixed wait)."""
    return (DEFAULT_BOUND if signal else DEFAULT_GRACE) if grace is None else float(grace)


@dataclass
class Drive:
    """How one run's nodes churn (``run_deployment``'s churn arguments, ``grace`` decided)."""

    churn: str | None  # None, "rounds" or "wallclock"
    mode: str = "term"
    grace: float = 0.0  # round-start-delay: with signal_dir, the most a round waits for its nodes
    lookahead: bool = True
    crashes: Mapping[int, list[Crash]] | None = None
    speedup: float = 1.0
    signal_dir: Path | None = None


@dataclass
class Follow:
    """How a submitted run is followed: DeployError after ``timeout`` s (the run stopped), rows to
    ``on_row``, the status read every ``status_every`` s."""

    timeout: float = 1800.0
    on_row: Callable[[dict[str, Any]], None] | None = None
    status_every: float = 10.0


def decide_timing(site: Site, user: Mapping[str, Any], drive: Drive, grace: float | None,
                  round_start_signal: bool | None) -> bool:
    """Set ``drive.grace`` and say whether rounds start on the driver's signal. ``round_start_signal``
    (default: round churn on a site whose ServerApp sees our files): each round starts once its nodes
    are registered, ``grace`` (default 30 s) the most it waits; without it ``grace`` is a fixed
    ``round-start-delay`` (default 3 s). An asynchronous rule has no round starts to delay or signal."""
    if asynchronous_run(site, user):  # no round starts to delay or signal (deploy.async_churn)
        if drive.crashes:
            raise DeployError("crashes on purpose happen in a round; an asynchronous rule has none (its churn "
                              "driver follows the aggregations, deploy.async_churn): leave out crashes")
        return False
    if round_start_signal is None:
        round_start_signal = drive.churn == "rounds" and site.local_files
    drive.grace = churn_grace(grace, bool(round_start_signal)) if drive.churn else 0.0
    return bool(round_start_signal and drive.churn)


def asynchronous_run(site: Site, user: Mapping[str, Any]) -> bool:
    """Whether the run's strategy (the user's, else the project's default) is an asynchronous rule."""
    return is_asynchronous_spec(str(user.get("strategy") or default_run_config(site.project).get("strategy", "")))


@contextlib.contextmanager
def signal_folder(cfg: dict[str, Any], drive: Drive, signal: bool) -> Iterator[None]:
    """With ``signal``: a temporary folder for the round-start signal, in ``cfg`` and ``drive``."""
    if not signal:
        yield
        return
    drive.signal_dir = Path(tempfile.mkdtemp(prefix="flchurn-signal-"))
    cfg["round-start-signal"] = str(drive.signal_dir)
    try:
        yield
    finally:
        shutil.rmtree(drive.signal_dir, ignore_errors=True)


def churn_driver(site: Site, schedule: Schedule | None, num_rounds: int, drive: Drive, start_round: int = 1,
                 asynchronous: bool = False) -> ChurnDriver | None:
    """The driver ``drive.churn`` names (None without churn)."""
    if drive.churn is None:
        return None
    assert schedule is not None
    if drive.churn == "rounds" and asynchronous:
        return AggregationChurn(site, schedule, num_rounds, mode=drive.mode, start_aggregation=start_round)
    if drive.churn == "rounds":
        return RoundChurn(site, schedule, num_rounds, mode=drive.mode, grace=drive.grace, lookahead=drive.lookahead,
                          crashes=drive.crashes, start_round=start_round, signal_dir=drive.signal_dir)
    if drive.churn == "wallclock":
        return WallClockChurn(site, schedule, mode=drive.mode, speedup=drive.speedup)
    raise ValueError(f"churn must be None, 'rounds' or 'wallclock', not {drive.churn!r}")


def run_app(site: Site, user_config: Mapping[str, Any], app: AppRun, drive: Drive, follow: Follow) -> RunOutcome:
    """Another Flower app (:mod:`deploy.app`): ``user_config`` submitted as it is; the rounds, run
    folder, schedule and signal folder are the app run's. No look-ahead: the app lists round r's
    nodes after its round r - 1 evaluation, later than the signal, so a node started early for
    round r + 1 would be addressed in round r."""
    drive.grace, drive.lookahead = (app.bound if drive.churn else 0.0), False
    drive.signal_dir = app.signal_dir if drive.churn == "rounds" else None
    schedule = app.schedule if drive.churn else None
    driver = churn_driver(site, schedule, app.num_rounds, drive)
    return run_with(site, dict(user_config), driver, schedule, follow, app.num_rounds, app.run_dir)


def first_round(cfg: Mapping[str, Any], run_dir: Path) -> int:
    """The run's first round: 1, in a folder that holds no run yet, or a resumed checkpoint's + 1."""
    if cfg.get("resume-from"):
        return prepare_resume(cfg) + 1
    if (run_dir / "metrics.jsonl").exists():
        raise DeployError(f"{run_dir} already holds a run; pick another run-name (or resume it)")
    return 1


def run_deployment(site: Site, user_config: Mapping[str, Any], *, churn: str | None = None, churn_mode: str = "term",
                   grace: float | None = None, lookahead: bool = True, crashes: Mapping[int, list[Crash]] | None = None,
                   speedup: float = 1.0, timeout: float = 1800.0, on_row: Callable[[dict[str, Any]], None] | None = None,
                   status_every: float = 10.0, resume_from: str | Path | None = None,
                   round_start_signal: bool | None = None, app: AppRun | None = None) -> RunOutcome:
    """Start the nodes (all, or the schedule's first-round set), submit the run, drive churn, wait,
    then compare the realised participation with the schedule (``RunOutcome.report``). ``churn``: None
    (all nodes stay up), ``"rounds"`` (:class:`deploy.churn.RoundChurn`) or ``"wallclock"``
    (:class:`deploy.churn.WallClockChurn`); ``grace`` and ``round_start_signal``: :func:`decide_timing`;
    ``resume_from``: a checkpoint, continued in its own folder on a fresh SuperLink and fresh nodes;
    ``timeout``, ``on_row``, ``status_every``: :class:`Follow`; ``app``: :func:`run_app`."""
    drive = Drive(churn, churn_mode, 0.0, lookahead, crashes, speedup)
    follow = Follow(timeout, on_row, status_every)
    if app is not None:
        return run_app(site, user_config, app, drive, follow)
    user = {**user_config, **({"resume-from": str(resume_from)} if resume_from else {})}
    signal = decide_timing(site, user, drive, grace, round_start_signal)
    cfg = build_run_config(site.num_nodes, user, grace=drive.grace, project=site.project)  # the one run name
    with signal_folder(cfg, drive, signal):
        check_run_config(cfg)  # every key checked before any process trains
        run_dir, num_rounds = run_dir_of(cfg), int(cfg["num-server-rounds"])
        asynchronous = is_asynchronous_spec(str(cfg.get("strategy", "")))
        start_round = first_round(cfg, run_dir)
        schedule = build_run_schedule(cfg) if churn else None
        driver = churn_driver(site, schedule, num_rounds, drive, start_round, asynchronous)
        if driver is not None:  # the ServerApp waits for them before its first round
            cfg["min-nodes"] = driver.min_nodes
        if hasattr(site, "warm_workers"):  # returning nodes: their worker ready for their round
            site.warm_workers(cfg)
        return run_with(site, cfg, driver, schedule, follow, num_rounds, run_dir, start_round, asynchronous)


def run_with(site: Site, cfg: dict[str, Any], driver: ChurnDriver | None, schedule: Schedule | None, follow: Follow,
             num_rounds: int, run_dir: Path, start_round: int = 1, asynchronous: bool = False) -> RunOutcome:
    """Start the nodes, submit ``cfg``, follow the run to its end, compare participation
    (``asynchronous``: the rule is, and the rows are aggregations)."""
    site.ensure_superlink(fresh=start_round > 1)
    start_nodes(site, driver)
    cli = site.cli
    if cli is None:
        raise DeployError("the site has no flwr CLI: its SuperLink did not start")
    follower = RunFollower(run_dir)  # the one follower: the driver's events, on_row's rows
    t0 = time.monotonic()
    run_id = cli.submit(site.project, cfg)
    out = RunOutcome("", run_id, run_dir, follower.rows, cfg, driver, submitted_at=t0)
    if driver is not None:
        driver.on_event(Submitted(t0))
    follow_run(site, cli, out, follower, follow, num_rounds)
    if driver is not None:
        driver.on_event(RunDone(time.monotonic()))
    out.wall = time.monotonic() - t0
    compare_participation(site, out, schedule, num_rounds, asynchronous)
    return out


def start_nodes(site: Site, driver: ChurnDriver | None) -> None:
    """The first round's nodes (the driver's), or every node, started and registered."""
    if driver is not None:
        driver.prepare()
        return
    for i in range(site.num_nodes):
        site.start_node(i)
    for i in range(site.num_nodes):
        site.wait_registered(i)


def follow_run(site: Site, cli: FlwrCli, out: RunOutcome, follower: RunFollower, follow: Follow,
               num_rounds: int) -> None:
    """Hand the follower's events to the driver and the rows to ``on_row`` until the run has
    finished (any status) or the SuperLink died; DeployError after the timeout."""
    next_status = out.submitted_at + follow.status_every
    while True:
        for event in follower.events():
            if out.driver is not None:
                out.driver.on_event(event)
            if isinstance(event, RoundFinished):
                note_auth_failures(site, out.auth_failures)
                if follow.on_row:
                    follow.on_row(event.row)
        if not site.superlink_alive():
            out.status = "superlink-died"
            break
        now = time.monotonic()
        if now >= next_status and (status := cli.poll_status(out.run_id)) is not None:  # else: ask again
            site.housekeeping()
            out.status = status
            if status.startswith(FINISHED):
                break
            done = bool(out.rows) and out.rows[-1]["round"] >= num_rounds
            next_status = now + (1.0 if done else follow.status_every)
        if now - out.submitted_at > follow.timeout:
            give_up(cli, out.run_id, follow.timeout)
        time.sleep(0.1)
    cli.close()
    follower.poll()
    note_auth_failures(site, out.auth_failures)


def give_up(cli: FlwrCli, run_id: int, timeout: float) -> NoReturn:
    """Stop the run (``flwr stop``) and raise: it did not finish within ``timeout`` s."""
    cli.close()
    cli.stop(run_id)
    raise DeployError(f"run {run_id} not finished after {timeout:.0f} s (stopped)")


def compare_participation(site: Site, out: RunOutcome, schedule: Schedule | None, num_rounds: int,
                          asynchronous: bool = False) -> None:
    """``out.report``: each round's participants against the schedule (round churn or none). Not
    for wall-clock churn (time, not rounds) nor an asynchronous rule (``out.off_arrivals``)."""
    driver = out.driver
    if asynchronous or isinstance(driver, WallClockChurn):
        out.off_arrivals = driver.took_part_while_off(out.rows) if isinstance(driver, AggregationChurn) else None
        return
    expected = (schedule.matrix(num_rounds).astype(bool) if schedule is not None
                else np.ones((num_rounds, site.num_nodes), dtype=bool))
    rounds = driver if isinstance(driver, RoundChurn) else None
    out.report = participation_report(
        expected, out.rows, explained=rounds.explained() if rounds is not None else {},
        client_of_node=site.client_of_node(), diagnose=rounds.diagnose if rounds is not None else None)
