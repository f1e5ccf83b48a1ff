"""``python -m deploy churn``: the compose stack's ``churn`` service (this module was ``compose.py``). It puts the round-1 node
containers in place, submits the run to the ``superlink`` service and follows it with the
churn driver, through the same :func:`deploy.run.run_deployment` as the process launcher, on a
:class:`deploy.containers.ComposeSite`; exit 0 only if the run completed and its participation
followed the schedule up to the timing slack."""

from __future__ import annotations

import argparse
import time

from runconfig.defaults import default_run_config

from .containers import ComposeSite
from .errors import DeployError
from .nodes import Site
from .run import run_deployment
from .submission import parse_run_config
from .waits import for_host, scale_run_waits


def log(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, flush=True)


def service_main(args: argparse.Namespace) -> int:
    """``python -m deploy churn``: the run on the stack's containers; the exit status."""
    site = ComposeSite(args.num_nodes, address=args.superlink, cli_home=args.cli_home, project=args.project,
                       root_certificates=args.root_certificates, container=args.container,
                       socket_path=args.docker_socket, log=log)
    return drive(site, args)


def drive(site: Site, args: argparse.Namespace) -> int:
    """The churn service's run on ``site`` (containers in the stack; any :class:`deploy.nodes.Site`
    works, which tests/test_deploy.py checks with processes): submit, follow with the round
    churn driver, print the participation report; 0 only if ``RunOutcome.ok``."""
    user = {"results-dir": args.results_dir, **parse_run_config(args.run_config)}
    given = getattr(args, "round_timeout", 0.0)
    if given and "round-timeout" not in user:
        user["round-timeout"] = float(given)
    for line in scale_run_waits(user, default_run_config(), for_host().round_factor):
        site.log(line)  # a busy host (the compose stack's containers share it): replies come later

    def on_row(row: dict) -> None:
        site.log(f"round {row['round']}: participants {row['participants']}")

    try:
        out = run_deployment(site, user, churn="rounds", churn_mode=args.churn_mode, grace=args.grace,
                             timeout=args.timeout, on_row=on_row)
    except DeployError as err:
        site.log(f"error: {err}")
        return 1
    report = out.report  # round churn: always compared with the schedule
    site.log(f"run {out.run_id}: {out.status}\n{report.summary() if report else '(no participation report)'}")
    if out.off_arrivals:  # an asynchronous rule: churn by aggregations
        site.log(f"arrived while their node was down: {out.off_arrivals}")
    if report is not None and report.failures:
        site.log(f"participation departs from the schedule beyond the timing slack: {report.failure_text()}")
    return 0 if out.ok else 1
