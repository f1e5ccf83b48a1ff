"""``python -m deploy launch``: SuperLink + N SuperNodes as processes on loopback
(:class:`deploy.local.ProcessSite`) and one run (:func:`deploy.run.run_deployment`), with a
progress bar; exit status 0 only when the run completed and its participation followed the
schedule up to the timing slack. SIGINT/SIGTERM/SIGHUP stop everything."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from runconfig.defaults import default_run_config
from strategies.registry import is_asynchronous_spec

from .auth import auth_failure_text
from .errors import DeployError
from .local import ProcessSite
from .procs import exit_on_signals
from .record import run_recorded, summary
from .run import RunOutcome, run_deployment
from .submission import latest_checkpoint, parse_run_config
from .waits import Waits, for_host, scale_run_waits, slowest_cap

if TYPE_CHECKING:  # edge emulation is imported only with device classes, hosts only with --hosts
    from .edge.devices import DevicePlan
    from .multihost import MultiHostSite


def launch_main(args: argparse.Namespace) -> int:
    """``python -m deploy launch``: see the module docstring; the exit status."""
    console = Console(stderr=True)
    exit_on_signals()
    user = parse_run_config(args.run_config)
    if args.hosts:
        return launch_hosts(args, user, console)
    if args.num_nodes is None:
        console.print("[red]error:[/] --num-nodes N is required (or --hosts FILE, whose hosts hold the clients)")
        return 2
    if args.certs:
        console.print("[red]error:[/] --certs goes with --hosts (a deployment on this machine runs without TLS)")
        return 2
    if args.app:
        return launch_app(args, user, console)
    try:
        plan, waits = launch_devices(args)
    except DeployError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        return 2
    merged = {**default_run_config(), **user}
    for line in scale_run_waits(user, merged, waits.round_factor):  # a busy host: replies and nodes come later
        console.print(escape(line))
    bar = ProgressBar(console, merged)
    dep = ProcessSite(args.num_nodes, Path(args.work_dir).resolve() if args.work_dir else None,
                      data_dir=args.data_dir, keep_workdir=args.keep_workdir, devices=plan, waits=waits,
                      warm_workers=args.warm_workers, log=bar.log)

    def body() -> int:
        console.print(f"work dir: {dep.work_dir}")
        resume = resume_point(args)
        dep.start_superlink()
        with bar.progress:
            out, _, counts = run_recorded(
                dep, user, churn=("wallclock" if args.wall_clock else "rounds") if args.churn else None,
                churn_mode=args.churn_mode, grace=args.grace, lookahead=not args.no_lookahead,
                speedup=args.speedup, timeout=args.timeout, on_row=bar.on_row, resume_from=resume,
                round_start_signal=False if args.fixed_grace else None)
        return print_outcome(console, dep, out, counts, devices=plan is not None)

    return run_closing(dep, console, body)


def run_closing(site: ProcessSite | MultiHostSite, console: Console, body: Callable[[], int],
                interrupted: str = "interrupted: stopping everything") -> int:
    """``body()``'s exit status with ``site`` closed after it, whatever happens: a deployment
    error prints where the logs are (exit 1), an interrupt ``interrupted`` (exit 130)."""
    try:
        return body()
    except DeployError as err:
        console.print(f"[red]error:[/] {escape(str(err))}; logs in {site.logs} (--keep-workdir keeps them)")
        return 1
    except KeyboardInterrupt:
        console.print(interrupted)
        return 130
    finally:
        site.close()


def launch_devices(args: argparse.Namespace) -> tuple[DevicePlan | None, Waits]:
    """The device classes of ``--devices`` (edge emulation, imported only then) and the waits."""
    plan = None
    if args.devices:
        from .edge.devices import load_devices

        plan = load_devices(args.devices, args.num_nodes)
    return plan, launch_waits(args, slowest_cap(dc.cpus for dc in plan.classes) if plan else 1.0)


def resume_point(args: argparse.Namespace) -> Path | None:
    """``--resume-from``: a checkpoint file, or the newest checkpoint of a run folder."""
    if not args.resume_from:
        return None
    resume = Path(args.resume_from).resolve()
    return latest_checkpoint(resume) if resume.is_dir() else resume


class ProgressBar:
    """The launch's progress: a bar of rounds (aggregations for an asynchronous rule) on a
    terminal, a line per row otherwise; ``log`` prints above the bar."""

    def __init__(self, console: Console, run_config: dict[str, Any]) -> None:
        self.console = console
        self.unit = "aggregation" if is_asynchronous_spec(str(run_config.get("strategy", ""))) else "round"
        columns = (TextColumn(f"[bold]{self.unit}s"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[status]}"), TimeElapsedColumn())
        self.progress = Progress(*columns, console=console, disable=not console.is_terminal)
        self.task = self.progress.add_task("run", total=int(run_config["num-server-rounds"]), status="starting")

    def log(self, line: str) -> None:
        (self.console if not self.progress.live.is_started else self.progress.console).log(escape(line))

    def on_row(self, row: dict[str, Any]) -> None:
        status = f"{self.unit} {row['round']}: participants {row['participants']}" + (
            f", acc {row['test-accuracy']:.3f}" if "test-accuracy" in row else "")
        self.progress.update(self.task, completed=row["round"], status=status)
        if not self.console.is_terminal:
            self.console.print(status, soft_wrap=True)


def print_outcome(console: Console, dep: ProcessSite | MultiHostSite, out: RunOutcome, counts: dict[str, dict[str, int]],
                  devices: bool = False) -> int:
    """Print the run's outcome, participation report, per-class counts and 401s; the exit status
    (0 only when the run completed and its participation followed the schedule)."""
    console.print(f"run {out.run_id}: {out.status} in {out.wall:.1f} s; results: {out.run_dir}")
    if out.report is not None:
        console.print(escape(out.report.summary()), soft_wrap=True)
    if counts:
        console.print("clients per class (clients.jsonl, realised-trace.csv"
                      + (", devices.csv" if devices else "") + "):\n" + escape(summary(counts)), soft_wrap=True)
    if out.auth_failures:
        console.print(f"[red]{escape(auth_failure_text(dep, out.auth_failures))}[/]", soft_wrap=True)
    if out.off_arrivals is not None:
        console.print(off_arrivals_text(out.off_arrivals), soft_wrap=True)
    if not out.completed:
        console.print(f"[red]run did not complete[/]; see the logs in {dep.logs} (--keep-workdir keeps them)")
    elif not out.ok and out.report is not None:
        console.print(f"[red]participation departs from the schedule beyond the timing slack:[/] "
                      f"{escape(out.report.failure_text())}", soft_wrap=True)
    return 0 if out.ok else 1


def launch_waits(args: argparse.Namespace, cpu_cap: float = 1.0) -> Waits:
    """The launch's waits: scaled to this host (deploy.waits), the ones given by flag as given."""
    return for_host(cpu_cap).override(superlink=args.superlink_timeout, register=args.register_timeout,
                                      task_patience=args.task_patience, submit=args.submit_timeout,
                                      cli=args.cli_timeout)


def off_arrivals_text(off: dict[int, list[int]]) -> str:
    """An asynchronous run under churn: the aggregations that hold a client whose node was down."""
    if not off:
        return "churn by aggregations: no client arrived while its node was down"
    return "churn by aggregations: arrived while their node was down (FAIL): " + "; ".join(
        f"aggregation {r}: clients {cs}" for r, cs in sorted(off.items()))


def launch_app(args: argparse.Namespace, user: dict[str, Any], console: Console) -> int:
    """``--app PATH``: another Flower app on the same path (:mod:`deploy.app`); the exit status."""
    from .app import app_config, app_run, check_app_schedule

    try:
        app = Path(args.app).resolve()
        config = {**app_config(app), **user}
        spec = args.availability or config.get("availability")
        if not spec:
            raise DeployError("--app: give the schedule with --availability SPEC (the app's run config has no "
                              "'availability' key)")
        seed = args.schedule_seed if args.schedule_seed is not None else int(config.get("schedule-seed", 0))
        where = ("--availability" if args.availability else "--run-config 'availability'" if "availability" in user
                 else f"{app / 'pyproject.toml'}: run config 'availability'")
        check_app_schedule(str(spec), args.num_nodes, seed, where)  # before any process starts
        if args.wall_clock or args.resume_from or args.devices:
            raise DeployError("--app runs round churn only (no --wall-clock, --resume-from or --devices)")
        waits = launch_waits(args)
    except (DeployError, ValueError) as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        return 2
    dep = ProcessSite(args.num_nodes, Path(args.work_dir).resolve() if args.work_dir else None, project=app,
                      data_dir=args.data_dir, keep_workdir=args.keep_workdir, waits=waits,
                      log=lambda s: console.log(escape(s)))

    def body() -> int:
        plan = app_run(app, user, args.num_nodes, str(spec), seed, dep.work_dir,
                       bound=args.grace if args.grace is not None else 30.0, signal=bool(args.churn))
        dep.server_env = plan.server_env()
        console.print(f"work dir: {dep.work_dir}; app {app}; schedule {spec} (seed {seed}); rounds in {plan.run_dir}")
        dep.start_superlink()
        out = run_deployment(dep, user, churn="rounds" if args.churn else None, churn_mode=args.churn_mode,
                             lookahead=not args.no_lookahead, timeout=args.timeout, app=plan,
                             on_row=lambda row: console.print(f"round {row['round']}: participants "
                                                              f"{row['participants']}", soft_wrap=True))
        console.print(f"run {out.run_id}: {out.status} in {out.wall:.1f} s")
        if out.report is not None:
            console.print(escape(out.report.summary()), soft_wrap=True)
        return 0 if out.ok else 1

    return run_closing(dep, console, body)


def launch_hosts(args: argparse.Namespace, user: dict[str, Any], console: Console) -> int:
    """``--hosts FILE``: the SuperLink here, the SuperNodes on the hosts (:mod:`deploy.multihost`),
    one run; a hosts-file mistake exits 2 naming the key and the host, before anything starts."""
    from .hosts import load_hosts
    from .multihost import MultiHostSite

    try:
        if args.devices or args.app or args.wall_clock:
            raise DeployError("--hosts runs the project's app under round churn: no --devices (each host is its own "
                              "device), --app or --wall-clock yet")
        if args.churn_mode == "kill":
            raise DeployError("--churn-mode kill with --hosts: under SuperNode authentication a SIGKILLed node keeps its "
                              "session until its heartbeat expires (~60 s) and the SuperLink refuses its return until "
                              "then; use --churn-mode term (crashes on purpose still SIGKILL)")
        plan = load_hosts(args.hosts, args.num_nodes)
        waits = launch_waits(args)
    except DeployError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        return 2
    merged = {**default_run_config(), **user}
    for line in scale_run_waits(user, merged, waits.round_factor):
        console.print(escape(line))
    bar = ProgressBar(console, merged)
    site = MultiHostSite(plan, Path(args.work_dir).resolve() if args.work_dir else None, certs=args.certs,
                         data_dir=args.data_dir, keep_workdir=args.keep_workdir, waits=waits, log=bar.log)
    def body() -> int:
        console.print(f"work dir: {site.work_dir}; {len(plan.hosts)} hosts: " + ", ".join(
            f"{h.name} ({h.engine}, clients {list(h.clients)})" for h in plan.hosts))
        resume = resume_point(args)
        site.start_superlink()
        with bar.progress:
            out = run_deployment(site, user, churn="rounds" if args.churn else None, churn_mode=args.churn_mode,
                                 grace=args.grace, lookahead=not args.no_lookahead, timeout=args.timeout,
                                 on_row=bar.on_row, resume_from=resume,
                                 round_start_signal=False if args.fixed_grace else None)
        code = print_outcome(console, site, out, {})
        console.print("switch latency per host (engine calls):\n" + escape(site.switch_summary()), soft_wrap=True)
        return code

    return run_closing(site, console, body, "interrupted: stopping everything on every host")
