"""``python -m deploy launch ...`` (processes) and ``python -m deploy churn ...`` (the compose
stack's churn service): see ``deploy/__init__.py`` and ``docker/README.md``."""

from __future__ import annotations

import argparse
import sys

from .compose import add_churn_args, compose_main
from .composedevices import add_compose_devices_args, compose_devices_main
from .launch import add_devices_args, add_launch_args, devices_main, launch_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy",
                                     description="Run the app on a real Flower deployment (loopback).")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="SuperLink + N SuperNodes + one run (+ churn)")
    add_launch_args(launch)
    churn = sub.add_parser("churn", help="the compose churn service: drive SuperNode containers (Docker API)")
    add_churn_args(churn)
    devices = sub.add_parser("devices", help="a devices file (TOML) from a FedScale-style device trace")
    add_devices_args(devices)
    cdev = sub.add_parser("compose-devices", help="a compose override that applies a devices file to the stack's nodes")
    add_compose_devices_args(cdev)
    args = parser.parse_args(argv)
    if args.command == "launch":
        return launch_main(args)
    if args.command == "churn":
        return compose_main(args)
    if args.command == "devices":
        return devices_main(args)
    if args.command == "compose-devices":
        return compose_devices_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
