"""``python -m deploy compose-devices``: the device classes of a devices file (:mod:`deploy.edge.devices`)
as a compose override for the stack's SuperNode containers (``docker/compose.yml``).

Per node ``supernode-I`` of a limited class:

- ``cpu_period`` / ``cpu_quota`` with the launcher's short CFS period
  (:data:`deploy.edge.cgroups.PERIOD_US`, 10 ms: Docker's ``cpus`` uses 100 ms, in which a short burst
  of local training runs at full speed), and ``cpus: 0`` to clear the base file's ``cpus``
  (Docker refuses both at once); one compute thread per whole CPU of the quota
  (``OMP_NUM_THREADS``..., as :meth:`deploy.edge.EdgeLimits.env`);
- ``mem_limit`` = ``memswap_limit`` (no swap beyond the cap);
- bandwidth, latency and loss: the container shapes its own link at every start
  (:mod:`deploy.edge.edgenode` as the entrypoint, ``cap_add: [NET_ADMIN]``, started as root and
  dropping to the image's ``app`` user before the SuperNode starts).

Caps that add up to more than the host has are refused, as by the launcher
(:func:`deploy.edge.devices.check_host`). Unlimited nodes keep the base file's settings.
"""

from __future__ import annotations

import argparse
import math

import yaml

from ..tuning import compute_threads_env
from .cgroups import PERIOD_US
from .devices import DevicePlan, check_host, emit_text, load_devices
from .edgenode import ENV_LIMITS

SERVICE = "supernode-{i}"
APP_USER = "1000:1000"  # the images' `app` user (docker/Dockerfile, docker/Dockerfile.client)


def node_override(plan: DevicePlan, i: int) -> dict:
    """The compose settings of node ``i`` (empty for an unlimited class)."""
    dc = plan.of(i)
    if not dc.limits:
        return {}
    out: dict = {}
    env = {"FLCHURN_DEVICE_CLASS": dc.name}
    if dc.cpus is not None:
        out.update({"cpus": 0, "cpu_period": PERIOD_US, "cpu_quota": max(1000, int(dc.cpus * PERIOD_US))})
        env.update(compute_threads_env(math.ceil(dc.cpus)))
        # a graceful exit (Flower's handlers, the ClientApp's last message) runs at the capped speed:
        # docker stop's SIGKILL comes after 10 s / cpus, not the base file's 10 s
        out["stop_grace_period"] = f"{max(10, math.ceil(10 / dc.cpus))}s"
    if dc.mem_mb is not None:
        out["mem_limit"] = out["memswap_limit"] = f"{dc.mem_mb}m"
    if dc.shaped:
        env.update({var: f"{getattr(dc, key):g}" for key, var in ENV_LIMITS.items() if getattr(dc, key) is not None})
        env["FLCHURN_RUN_AS"] = APP_USER
        out.update({"user": "root", "cap_add": ["NET_ADMIN"], "entrypoint": ["python", "-m", "deploy.edge.edgenode"]})
    out["environment"] = env
    return out


def compose_override(plan: DevicePlan, source: str = "") -> str:
    """The override file's text (YAML) for every limited node of ``plan``."""
    services = {SERVICE.format(i=i): node for i in range(plan.num_nodes) if (node := node_override(plan, i))}
    head = [f"# Device classes{f' from {source}' if source else ''}: python -m deploy compose-devices "
            "(deploy/edge/composedevices.py). Use as",
            "#   docker compose -f docker/compose.yml -f THIS_FILE up -d ...",
            *[f"#   {line}" for line in plan.describe().split("; ")]]
    return "\n".join(head) + "\n" + yaml.safe_dump({"services": services}, sort_keys=False)


def compose_devices_main(args: argparse.Namespace) -> int:
    """``python -m deploy compose-devices``: the override, printed or written."""
    def make() -> str:
        plan = load_devices(args.devices, args.num_nodes)
        if not args.no_host_check:
            check_host(plan)
        return compose_override(plan, source=str(args.devices))

    return emit_text(make, args.output)
