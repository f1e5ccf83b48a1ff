"""``python -m deploy churn``: the compose stack's ``churn`` service. It puts the round-1 node
containers in place, submits the run to the ``superlink`` service and follows it with the
churn driver, through the same :func:`deploy.run.run_deployment` as the process launcher, on a
:class:`deploy.containers.ComposeSite`; exit 0 only if the run completed and its participation
followed the schedule up to the timing slack."""

from __future__ import annotations

import time

from .containers import ComposeSite
from .errors import DeployError
from .nodes import MODES, Site
from .run import run_deployment
from .runconfig import parse_run_config


def log(line: str) -> None:
    print(time.strftime("%H:%M:%S"), line, flush=True)


def compose_main(args) -> int:
    site = ComposeSite(args.num_nodes, address=args.superlink, cli_home=args.cli_home, project=args.project,
                       root_certificates=args.root_certificates, container=args.container,
                       socket_path=args.docker_socket, log=log)
    return drive(site, args)


def drive(site: Site, args) -> int:
    """The churn service's run on ``site`` (containers in the stack; any :class:`deploy.nodes.Site`
    works, which tests/test_deploy.py checks with processes): submit, follow with the round
    churn driver, print the participation report; 0 only if ``Outcome.ok``."""
    user = {"results-dir": args.results_dir, **parse_run_config(args.run_config)}

    def on_row(row: dict) -> None:
        site.log(f"round {row['round']}: participants {row['participants']}")

    try:
        out = run_deployment(site, user, churn="rounds", churn_mode=args.churn_mode, grace=args.grace,
                             timeout=args.timeout, on_row=on_row)
    except DeployError as err:
        site.log(f"error: {err}")
        return 1
    site.log(f"run {out.run_id}: {out.status}\n{out.report.summary()}")
    if out.report.failures:
        site.log(f"participation departs from the schedule beyond the timing slack: {out.report.failure_text()}")
    return 0 if out.ok else 1


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
    p.add_argument("--timeout", type=float, default=3600.0, help="give up (and stop the run) after this many seconds")
