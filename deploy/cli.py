"""The ``deploy`` commands, their arguments in one place: ``python -m deploy launch | churn |
devices | compose-devices`` (see ``deploy/__init__.py``, docs/deployment.md and docs/containers.md; the compose
files call ``churn``). Each command imports its module only when run: ``launch`` without
``--devices`` never imports :mod:`deploy.edge`."""

from __future__ import annotations

import argparse
import tomllib

from .nodes import MODES


def add_launch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-nodes", type=int, default=None,
                   help="number of SuperNodes = num-clients (required without --hosts; with it, the hosts' clients)")
    p.add_argument("--hosts", default=None,
                   help="hosts file (TOML): the SuperLink here, each client's SuperNode on the host it names, "
                        "through that host's engine, with TLS and one key per client (docs/multihost.md)")
    p.add_argument("--certs", default=None,
                   help="with --hosts: a folder of keys and certificates in docker/gen-certs.sh's layout (default: "
                        "made in the work dir, outside the repository)")
    p.add_argument("--run-config", default="", help="run config overrides, as for flwr run: \"k=v k2='s'\"")
    p.add_argument("--churn", action="store_true", help="stop/start SuperNodes to follow the availability schedule")
    p.add_argument("--churn-mode", choices=MODES, default="term",
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
                   help="device classes (TOML): CPU, memory and bandwidth limits per SuperNode (root; see docs/edge.md)")
    p.add_argument("--superlink-timeout", type=float, default=None,
                   help="seconds the SuperLink may take to listen (default 60 s x the host's load per CPU)")
    p.add_argument("--register-timeout", type=float, default=None,
                   help="seconds a SuperNode may take to register (default 60 s x the host's load per CPU / the "
                        "slowest device's CPU cap)")
    p.add_argument("--task-patience", type=float, default=None,
                   help="seconds a ClientApp may take to start before its SuperNode revokes its task (a lost reply, "
                        "'401 task-token authentication failed'; Flower: 30 s; default 120 s x load per CPU / CPU cap)")
    p.add_argument("--submit-timeout", type=float, default=None,
                   help="seconds `flwr run` may take to submit the app (default 120 s x the host's load per CPU)")
    p.add_argument("--cli-timeout", type=float, default=None,
                   help="seconds any other flwr command (ls, stop, log) may take (default 60 s x load per CPU)")
    p.add_argument("--warm-workers", action=argparse.BooleanOptionalAction, default=True,
                   help="a node started early for its return also starts its client worker with the run's workload "
                        "built, so it is warm when its round starts (default; --no-warm-workers: at its first message)")
    p.add_argument("--app", default=None,
                   help="deploy this Flower app directory instead of the project's (its ServerApp wraps its grid "
                        "with server_app.dropin.with_availability: docs/dropin.md)")
    p.add_argument("--availability", default=None,
                   help="with --app: the schedule spec, as the app's with_availability gets it (default: the app's "
                        "run config key 'availability')")
    p.add_argument("--schedule-seed", type=int, default=None,
                   help="with --app: the schedule's seed (default: the app's run config key 'schedule-seed', else 0)")


def add_churn_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-nodes", type=int, required=True)
    p.add_argument("--run-config", default="", help="the run config, as for flwr run")
    p.add_argument("--churn-mode", choices=MODES, default="term")
    p.add_argument("--grace", type=float, default=3.0, help="round-start-delay (if the ServerApp has it)")
    p.add_argument("--round-timeout", type=float, default=0.0,
                   help="the run's round-timeout in seconds (a round-timeout in --run-config wins); 0: the app's "
                        "default scaled to the host's load, as python -m deploy launch does")
    p.add_argument("--superlink", default="superlink:8000", help="SuperLink address for the flwr CLI")
    p.add_argument("--root-certificates", default="", help="CA file: TLS connection (else insecure)")
    p.add_argument("--results-dir", default="/results",
                   help="results-dir as the ServerApp sees it (shared volume); a results-dir in --run-config wins")
    p.add_argument("--project", default="/app", help="the Flower app to submit")
    p.add_argument("--cli-home", default="/tmp/flwr-cli", help="FLWR_HOME of the flwr CLI")
    p.add_argument("--container", default="flchurn-supernode-{i}", help="container name pattern of node i")
    p.add_argument("--docker-socket", default="/var/run/docker.sock")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up (and stop the run) after this many seconds")


def add_devices_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-trace", required=True,
                   help="FedScale-style device trace: JSON {client: {computation: ms/sample, communication: kbps}} "
                        "or CSV client,computation,communication")
    p.add_argument("--num-nodes", type=int, required=True)
    p.add_argument("--classes", type=int, default=3, help="how many device classes")
    p.add_argument("--seed", type=int, default=0, help="which trace clients are drawn")
    p.add_argument("--output", "-o", default=None, help="write the devices file here (default: print it)")


def add_compose_devices_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", required=True, help="the devices file (TOML), as for python -m deploy launch")
    p.add_argument("--num-nodes", type=int, required=True, help="SuperNodes in the stack (supernode-0..N-1)")
    p.add_argument("--output", "-o", default=None, help="write the override here (default: print it)")
    p.add_argument("--no-host-check", action="store_true",
                   help="skip the caps-exceed-this-host check (the stack runs on another Docker host)")


def add_k8s_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hosts", required=True,
                   help="the hosts file (TOML): [superlink] address (outside the cluster), each host's clients and "
                        "k8s-node (default: the host's name), as kubernetes.io/hostname")
    p.add_argument("--out", required=True,
                   help="an absent or empty folder for the manifests (and the keys made when --certs is not given): "
                        "outside the git checkout, or git-ignored")
    p.add_argument("--image", default=None, help="the SuperNode image of every client (default: each host's image)")
    p.add_argument("--namespace", default="flchurn", help="the namespace of every object (default: flchurn)")
    p.add_argument("--certs", default=None,
                   help="a docker/gen-certs.sh folder: ca.crt, keys/node-<i>, keys/node-<i>.pub (default: make new "
                        "ones in OUT/identity)")
    p.add_argument("--replicas", type=int, choices=(0, 1), default=1,
                   help="each Deployment's replicas as applied (the driver scales 0 <-> 1 from there)")
    p.add_argument("--storage-class", default=None,
                   help="storageClassName of each client's state claim (default: the cluster's default class)")
    p.add_argument("--allow-kill", action="store_true",
                   help="let the driver delete pods (churn-mode kill: a crash); otherwise it only scales")


def k8s(args: argparse.Namespace) -> int:
    from .k8s import k8s_main

    return k8s_main(args)


def devices_main(args: argparse.Namespace) -> int:
    """``python -m deploy devices``: a devices file from a FedScale-style trace."""
    from .edge.devices import classes_from_trace, emit_text, parse_devices, read_trace

    def make() -> str:
        text = classes_from_trace(read_trace(args.from_trace), args.num_nodes, args.classes, args.seed)
        parse_devices(tomllib.loads(text), args.num_nodes)  # what the launcher will read
        return text

    return emit_text(make, args.output)


def launch(args: argparse.Namespace) -> int:
    from .launch import launch_main

    return launch_main(args)


def churn(args: argparse.Namespace) -> int:
    from .churn_service import service_main

    return service_main(args)


def compose_devices(args: argparse.Namespace) -> int:
    from .edge.composedevices import compose_devices_main

    return compose_devices_main(args)


COMMANDS = {  # name -> (help, its arguments, what runs it)
    "launch": ("SuperLink + N SuperNodes + one run (+ churn)", add_launch_args, launch),
    "churn": ("the compose churn service: drive SuperNode containers (Docker API)", add_churn_args, churn),
    "devices": ("a devices file (TOML) from a FedScale-style device trace", add_devices_args, devices_main),
    "compose-devices": ("a compose override that applies a devices file to the stack's nodes",
                        add_compose_devices_args, compose_devices),
    "k8s": ("Kubernetes manifests: a Deployment, a key Secret and a state claim per client, the driver's RBAC",
            add_k8s_args, k8s),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy",
                                description="Run the app on a real Flower deployment (loopback).")
    sub = p.add_subparsers(dest="command", required=True)
    for name, (text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=text))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return COMMANDS[args.command][2](args)
