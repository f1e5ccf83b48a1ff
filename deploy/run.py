"""One deployed run, end to end, on any :class:`deploy.nodes.Site` (processes of
:mod:`deploy.local` or the containers of :mod:`deploy.containers`): :func:`run_deployment`.

The run config is built once (:func:`deploy.submission.build_run_config`: one run name, so the
churn driver and the server follow the same folder), the nodes started, the run submitted and
followed; a run can continue from a checkpoint (``resume_from``: a fresh SuperLink and fresh
nodes, the same run folder). Afterwards the realised participation is compared with the
schedule (:func:`deploy.participation.participation_report`); :attr:`Outcome.ok` requires both a
completed run and no difference beyond the timing slack.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runconfig.defaults import default_run_config
from strategies.registry import is_asynchronous_spec

from .app import AppRun
from .async_churn import AggregationChurn
from .churn import ChurnDriver, Crash, RoundChurn, WallClockChurn
from .errors import DeployError
from .flwr_cli import COMPLETED, FINISHED
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
class Outcome:
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


def auth_failure_text(site: Site, found: Mapping[str, int]) -> str:
    """What a 401 to a ClientApp (or the ServerApp) means, and the flag that prevents it."""
    waits = getattr(site, "waits", None)
    patience = f" ({waits.task_patience:.0f} s)" if waits is not None else ""
    where = ", ".join(f"{name}: {n}" for name, n in sorted(found.items()))
    return (f"calls answered 401 'task-token authentication failed' ({where}): Flower revoked the task of a "
            f"ClientApp (a SuperNode's; its reply is lost) or ServerApp (the SuperLink's) that did not start "
            f"within the task patience{patience} on this busy machine; lengthen it with --task-patience SECONDS")


def note_auth_failures(site: Site, out: Outcome) -> None:
    """Name the 401s the site's processes logged since the last look (a site that cannot tell: none)."""
    found: Mapping[str, int] = getattr(site, "auth_failures", dict)()
    if found:
        for name, n in found.items():
            out.auth_failures[name] = out.auth_failures.get(name, 0) + n
        site.log(auth_failure_text(site, found))


def run_deployment(
    site: Site,
    user_config: Mapping[str, Any],
    *,
    churn: str | None = None,
    churn_mode: str = "term",
    grace: float | None = None,
    lookahead: bool = True,
    crashes: Mapping[int, list[Crash]] | None = None,
    speedup: float = 1.0,
    timeout: float = 1800.0,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    status_every: float = 10.0,
    resume_from: str | Path | None = None,
    round_start_signal: bool | None = None,
    app: AppRun | None = None,
) -> Outcome:
    """Start the nodes (all, or the schedule's round-1 set), submit the run, drive churn, wait,
    then compare the realised participation with the schedule (``Outcome.report``).

    ``churn``: None (all nodes stay up), ``"rounds"`` (:class:`deploy.churn.RoundChurn`) or
    ``"wallclock"`` (:class:`deploy.churn.WallClockChurn`, trace-intervals specs). ``grace`` is
    passed as ``round-start-delay`` (default 3 s under churn). ``resume_from``: a checkpoint file; the run continues from
    it in its own run folder, on a fresh SuperLink and freshly started nodes.
    ``round_start_signal`` (default: round churn on a site whose ServerApp sees our files): each
    round starts as soon as its nodes are registered, ``grace`` (default 30 s) being the most it
    waits (:class:`deploy.churn.RoundChurn`). The run's status is
    read in the background every ``status_every`` seconds (the churn driver is never held up).
    Returns when the run has finished (any status) or the SuperLink died, or raises DeployError
    after ``timeout`` seconds (after ``flwr stop``).

    ``app``: a Flower app that is not the project's (:mod:`deploy.app`): ``user_config`` is
    submitted as it is, and the rounds, run folder, schedule and signal folder are the app run's.
    """
    if app is not None:
        # no look-ahead: the app lists round r's nodes after its round r - 1 evaluation, later than
        # the signal, so a node started early for round r + 1 would be addressed in round r
        return _run(site, dict(user_config), churn=churn, churn_mode=churn_mode, g=app.bound if churn else 0.0,
                    lookahead=False, crashes=crashes, speedup=speedup, timeout=timeout, on_row=on_row,
                    status_every=status_every, signal_dir=app.signal_dir if churn == "rounds" else None, app=app)
    user = {**user_config, **({"resume-from": str(resume_from)} if resume_from else {})}
    if asynchronous_run(site, user):  # no round starts to delay or signal (deploy.async_churn)
        if crashes:
            raise DeployError("crashes on purpose happen in a round; an asynchronous rule has none (its churn "
                              "driver follows the aggregations, deploy.async_churn): leave out crashes")
        round_start_signal, g = False, 0.0
    else:
        if round_start_signal is None:
            round_start_signal = churn == "rounds" and site.local_files
        g = churn_grace(grace, bool(round_start_signal)) if churn else 0.0
    cfg = build_run_config(site.num_nodes, user, grace=g, project=site.project)  # the one run name
    signal_dir = Path(tempfile.mkdtemp(prefix="flchurn-signal-")) if round_start_signal and churn else None
    if signal_dir is not None:
        cfg["round-start-signal"] = str(signal_dir)
    try:
        return _run(site, cfg, churn=churn, churn_mode=churn_mode, g=g, lookahead=lookahead, crashes=crashes,
                    speedup=speedup, timeout=timeout, on_row=on_row, status_every=status_every,
                    signal_dir=signal_dir)
    finally:
        if signal_dir is not None:
            shutil.rmtree(signal_dir, ignore_errors=True)


def asynchronous_run(site: Site, user: Mapping[str, Any]) -> bool:
    """Whether the run's strategy (the user's, else the project's default) is an asynchronous rule."""
    return is_asynchronous_spec(str(user.get("strategy") or default_run_config(site.project).get("strategy", "")))


def _run(site: Site, cfg: dict[str, Any], *, churn: str | None, churn_mode: str, g: float, lookahead: bool,
         crashes: Mapping[int, list[Crash]] | None, speedup: float, timeout: float,
         on_row: Callable[[dict[str, Any]], None] | None, status_every: float,
         signal_dir: Path | None, app: AppRun | None = None) -> Outcome:
    start_round = 1
    if app is not None:  # another Flower app: its rounds, folder and schedule come with it
        num_rounds, run_dir, schedule = app.num_rounds, app.run_dir, app.schedule if churn else None
    else:
        check_run_config(cfg)  # every key checked before any process trains
        num_rounds = int(cfg["num-server-rounds"])
        run_dir = run_dir_of(cfg)
        if cfg.get("resume-from"):
            start_round = prepare_resume(cfg) + 1
        elif (run_dir / "metrics.jsonl").exists():
            raise DeployError(f"{run_dir} already holds a run; pick another run-name (or resume it)")
        schedule = build_run_schedule(cfg) if churn else None
    driver: ChurnDriver | None = None
    asynchronous = app is None and is_asynchronous_spec(str(cfg.get("strategy", "")))
    if churn == "rounds" and schedule is not None and asynchronous:
        driver = AggregationChurn(site, schedule, num_rounds, mode=churn_mode, start_aggregation=start_round)
    elif churn == "rounds" and schedule is not None:
        driver = RoundChurn(site, schedule, num_rounds, mode=churn_mode, grace=g, lookahead=lookahead,
                            crashes=crashes, start_round=start_round, signal_dir=signal_dir)
    elif churn == "wallclock" and schedule is not None:
        driver = WallClockChurn(site, schedule, mode=churn_mode, speedup=speedup)
    elif churn is not None:
        raise ValueError(f"churn must be None, 'rounds' or 'wallclock', not {churn!r}")
    if driver is not None and app is None:  # the project's ServerApp waits for them before round 1
        cfg["min-nodes"] = driver.min_nodes
    if app is None and hasattr(site, "warm_workers"):  # returning nodes: their worker ready for their round
        site.warm_workers(cfg)
    site.ensure_superlink(fresh=start_round > 1)
    if driver is not None:
        driver.prepare()
    else:
        for i in range(site.num_nodes):
            site.start_node(i)
        for i in range(site.num_nodes):
            site.wait_registered(i)
    cli = site.cli
    if cli is None:
        raise DeployError("the site has no flwr CLI: its SuperLink did not start")
    follow = RunFollower(run_dir)  # the one follower: the driver gets its events, on_row its rows
    t0 = time.monotonic()
    run_id = cli.submit(site.project, cfg)
    if driver is not None:
        driver.on_event(Submitted(t0))
    out = Outcome("", run_id, run_dir, follow.rows, cfg, driver, submitted_at=t0)
    next_status = t0 + status_every
    while True:
        for event in follow.events():
            if driver is not None:
                driver.on_event(event)
            if isinstance(event, RoundFinished):
                note_auth_failures(site, out)
                if on_row:
                    on_row(event.row)
        if not site.superlink_alive():
            out.status = "superlink-died"
            break
        now = time.monotonic()
        if now >= next_status:
            status = cli.poll_status(run_id)
            if status is not None:  # an answer came: ask again later
                site.housekeeping()
                out.status = status
                if status.startswith(FINISHED):
                    break
                done = bool(out.rows) and out.rows[-1]["round"] >= num_rounds
                next_status = now + (1.0 if done else status_every)
        if now - t0 > timeout:
            cli.close()
            cli.stop(run_id)
            raise DeployError(f"run {run_id} not finished after {timeout:.0f} s (stopped)")
        time.sleep(0.1)
    cli.close()
    follow.poll()
    note_auth_failures(site, out)
    if driver is not None:
        driver.on_event(RunDone(time.monotonic()))
    out.wall = time.monotonic() - t0
    if isinstance(driver, AggregationChurn):
        out.off_arrivals = driver.took_part_while_off(out.rows)
    # wall-clock churn follows time, not rounds; an asynchronous rule's rows are aggregations, not rounds
    if not isinstance(driver, WallClockChurn) and not asynchronous:
        expected = (schedule.matrix(num_rounds).astype(bool) if schedule is not None
                    else np.ones((num_rounds, site.num_nodes), dtype=bool))
        rounds = driver if isinstance(driver, RoundChurn) else None
        out.report = participation_report(
            expected, out.rows, explained=rounds.explained() if rounds is not None else {},
            client_of_node=site.client_of_node(), diagnose=rounds.diagnose if rounds is not None else None)
    return out
