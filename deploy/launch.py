"""``python -m deploy launch``: SuperLink + N SuperNodes as processes on loopback
(:class:`deploy.local.Deployment`) and one run (:func:`deploy.run.run_deployment`), with a
progress bar; exit status 0 only when the run completed and its participation followed the
schedule up to the timing slack. SIGINT/SIGTERM/SIGHUP stop everything."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .devices import classes_from_trace, emit_text, load_devices, parse_devices, read_trace
from .edgerun import run_recorded, summary
from .errors import DeployError
from .local import Deployment
from .procs import exit_on_signals
from .runconfig import default_run_config, latest_checkpoint, parse_run_config


def add_launch_args(p) -> None:
    p.add_argument("--num-nodes", type=int, required=True, help="number of SuperNodes = num-clients")
    p.add_argument("--run-config", default="", help="run config overrides, as for flwr run: \"k=v k2='s'\"")
    p.add_argument("--churn", action="store_true", help="stop/start SuperNodes to follow the availability schedule")
    p.add_argument("--churn-mode", choices=("term", "kill"), default="term",
                   help="how a node goes offline: SIGTERM (graceful) or SIGKILL (crash)")
    p.add_argument("--wall-clock", action="store_true",
                   help="churn by elapsed time (trace-intervals specs) instead of by rounds")
    p.add_argument("--speedup", type=float, default=1.0, help="trace seconds per real second (wall-clock churn)")
    p.add_argument("--grace", type=float, default=None,
                   help="under churn, the most a round waits for its nodes to register (default 30 s); with "
                        "--fixed-grace, the fixed wait before every round (default 3 s)")
    p.add_argument("--fixed-grace", action="store_true",
                   help="wait a fixed --grace before every round instead of until its nodes are registered")
    p.add_argument("--no-lookahead", action="store_true",
                   help="start returning nodes only when their round starts (needs grace >= node start time)")
    p.add_argument("--work-dir", default=None,
                   help="where logs, FLWR_HOMEs and client state go (default: a temp dir, removed at exit)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp work dir (logs) after exit")
    p.add_argument("--data-dir", default=None, help="node_config data-dir of every SuperNode")
    p.add_argument("--resume-from", default=None,
                   help="continue a run from a checkpoint file, or from the newest checkpoint of a run folder "
                        "(pass the same --run-config; clients' state-dir survives only with the same --work-dir)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up (and stop the run) after this many seconds")
    p.add_argument("--devices", default=None,
                   help="device classes (TOML): CPU, memory and bandwidth limits per SuperNode (root; see README)")


def add_devices_args(p) -> None:
    p.add_argument("--from-trace", required=True,
                   help="FedScale-style device trace: JSON {client: {computation: ms/sample, communication: kbps}} "
                        "or CSV client,computation,communication")
    p.add_argument("--num-nodes", type=int, required=True)
    p.add_argument("--classes", type=int, default=3, help="how many device classes")
    p.add_argument("--seed", type=int, default=0, help="which trace clients are drawn")
    p.add_argument("--output", "-o", default=None, help="write the devices file here (default: print it)")


def devices_main(args) -> int:
    """``python -m deploy devices``: a devices file from a FedScale-style trace."""
    def make() -> str:
        text = classes_from_trace(read_trace(args.from_trace), args.num_nodes, args.classes, args.seed)
        parse_devices(tomllib.loads(text), args.num_nodes)  # what the launcher will read
        return text

    return emit_text(make, args.output)


def launch_main(args) -> int:
    console = Console(stderr=True)
    exit_on_signals()
    user = parse_run_config(args.run_config)
    num_rounds = int({**default_run_config(), **user}["num-server-rounds"])
    work = Path(args.work_dir).resolve() if args.work_dir else None
    resume = Path(args.resume_from).resolve() if args.resume_from else None
    try:
        plan = load_devices(args.devices, args.num_nodes) if args.devices else None
    except DeployError as err:
        console.print(f"[red]error:[/] {escape(str(err))}")
        return 2
    dep = Deployment(args.num_nodes, work, data_dir=args.data_dir, keep_workdir=args.keep_workdir, devices=plan,
                     log=lambda s: (console if not progress.live.is_started else progress.console).log(escape(s)))
    columns = (TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    progress = Progress(*columns, console=console, disable=not console.is_terminal)
    task = progress.add_task("run", total=num_rounds, status="starting")

    def on_row(row: dict[str, Any]) -> None:
        status = f"round {row['round']}: participants {row['participants']}" + (
            f", acc {row['test-accuracy']:.3f}" if "test-accuracy" in row else "")
        progress.update(task, completed=row["round"], status=status)
        if not console.is_terminal:
            console.print(status, soft_wrap=True)

    code = 1
    try:
        console.print(f"work dir: {dep.work_dir}")
        if resume is not None and resume.is_dir():
            resume = latest_checkpoint(resume)
        dep.start_superlink()
        with progress:
            out, _, counts = run_recorded(
                dep, user, churn=("wallclock" if args.wall_clock else "rounds") if args.churn else None,
                churn_mode=args.churn_mode, grace=args.grace, lookahead=not args.no_lookahead,
                speedup=args.speedup, timeout=args.timeout, on_row=on_row, resume_from=resume,
                round_start_signal=False if args.fixed_grace else None)
        console.print(f"run {out.run_id}: {out.status} in {out.wall:.1f} s; results: {out.run_dir}")
        if out.report is not None:
            console.print(escape(out.report.summary()), soft_wrap=True)
        if counts:
            console.print("clients per class (clients.jsonl, realised-trace.csv"
                          + (", devices.csv" if plan else "") + "):\n" + escape(summary(counts)), soft_wrap=True)
        code = 0 if out.ok else 1
        if not out.completed:
            console.print(f"[red]run did not complete[/]; see the logs in {dep.logs} (--keep-workdir keeps them)")
        elif not out.ok:
            console.print(f"[red]participation departs from the schedule beyond the timing slack:[/] "
                          f"{escape(out.report.failure_text())}", soft_wrap=True)
    except DeployError as err:
        console.print(f"[red]error:[/] {escape(str(err))}; logs in {dep.logs} (--keep-workdir keeps them)")
    except KeyboardInterrupt:
        console.print("interrupted: stopping everything")
        code = 130
    finally:
        dep.close()
    return code
