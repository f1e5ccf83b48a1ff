"""``python -m deploy.edge.edgenode COMMAND...``: a SuperNode's network limits applied from inside its
own network namespace (a container of the compose stack), then ``COMMAND`` exec'd in its place.

The process launcher shapes a node from the host (:mod:`deploy.edge.netns`, :mod:`deploy.edge.limits`); a
container already has its own namespace, which Docker recreates at every ``docker start``, so
the container shapes itself at each start. The limits come from the environment that
``python -m deploy compose-devices`` writes into the compose override:

- ``FLCHURN_UP_KBPS``: a token bucket (``tbf``, :func:`deploy.edge.netns.tbf_args`) on the egress of
  ``FLCHURN_NET_DEV`` (default ``eth0``): node -> SuperLink;
- ``FLCHURN_DOWN_KBPS``: the same bucket on an IFB device that the link's ingress is redirected
  to (SuperLink -> node);
- ``FLCHURN_RTT_MS`` / ``FLCHURN_LOSS``: this kernel family may have no ``netem``, so a
  user-space relay (:mod:`deploy.edge.relay`) runs in the container on ``127.0.0.1`` and the
  ``--superlink HOST:PORT`` argument of ``COMMAND`` is pointed at it (TLS: the server
  certificate must name 127.0.0.1, as ``docker/gen-certs.sh`` does).

Shaping needs ``CAP_NET_ADMIN`` (``cap_add: [NET_ADMIN]``) and root; the wrapper then drops to
``FLCHURN_RUN_AS`` (uid[:gid], the image's ``app`` user in the override) before the relay and
``COMMAND`` start, so the SuperNode never runs with the capability. ``COMMAND`` is exec'd: it
keeps the PID and gets the container's signals itself (``docker stop`` exits it gracefully).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ..errors import DeployError
from ..procs import port_open
from .netns import tbf_args
from .relay import Impairment, argv as relay_argv

ENV_LIMITS = {"up_kbps": "FLCHURN_UP_KBPS", "down_kbps": "FLCHURN_DOWN_KBPS",
              "rtt_ms": "FLCHURN_RTT_MS", "loss": "FLCHURN_LOSS"}
IFB = "flcifb0"


def limits_from_env(env: dict[str, str]) -> dict[str, float]:
    """The limits set in ``env`` (see the module docstring); a malformed value is an error."""
    out: dict[str, float] = {}
    for key, var in ENV_LIMITS.items():
        text = env.get(var, "").strip()
        if not text:
            continue
        try:
            value = float(text)
        except ValueError:
            raise DeployError(f"{var}={text!r} is not a number") from None
        if value < 0 or (key == "loss" and value >= 1) or (key.endswith("kbps") and value < 1):
            raise DeployError(f"{var}={text!r} is out of range")
        out[key] = value
    return out


def _run(*argv: str) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise DeployError(f"{' '.join(argv)}: {res.stderr.strip() or res.returncode}")


def shape_commands(dev: str, up_kbps: float | None, down_kbps: float | None) -> list[list[str]]:
    """The ``ip``/``tc`` commands that cap ``dev``'s egress at ``up_kbps`` and its ingress (through
    an IFB device) at ``down_kbps``."""
    cmds: list[list[str]] = []
    if up_kbps:
        cmds.append(["tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(int(up_kbps))])
    if down_kbps:
        cmds += [["ip", "link", "add", IFB, "type", "ifb"], ["ip", "link", "set", IFB, "up"],
                 ["tc", "qdisc", "add", "dev", dev, "handle", "ffff:", "ingress"],
                 ["tc", "filter", "add", "dev", dev, "parent", "ffff:", "protocol", "all", "u32", "match", "u32",
                  "0", "0", "action", "mirred", "egress", "redirect", "dev", IFB],
                 ["tc", "qdisc", "replace", "dev", IFB, "root", *tbf_args(int(down_kbps))]]
    return cmds


def superlink_index(argv: list[str]) -> int:
    """Index in ``argv`` of the value of ``--superlink`` (``--superlink X`` or ``--superlink=X``)."""
    for k, arg in enumerate(argv):
        if arg == "--superlink" and k + 1 < len(argv):
            return k + 1
        if arg.startswith("--superlink="):
            return k
    raise DeployError("rtt/loss go through a relay, but the command has no --superlink HOST:PORT to point at it")


def with_superlink(argv: list[str], address: str) -> list[str]:
    """``argv`` with its ``--superlink`` value replaced by ``address``."""
    k = superlink_index(argv)
    out = list(argv)
    out[k] = f"--superlink={address}" if argv[k].startswith("--superlink=") else address
    return out


def _superlink_value(argv: list[str]) -> str:
    k = superlink_index(argv)
    return argv[k].split("=", 1)[1] if argv[k].startswith("--superlink=") else argv[k]


def drop_privileges(spec: str) -> None:
    """Become ``uid[:gid]`` (no supplementary groups); nothing when not root or ``spec`` is empty."""
    if not spec or os.geteuid() != 0:
        return
    uid_text, _, gid_text = spec.partition(":")
    uid, gid = int(uid_text), int(gid_text or uid_text)
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def start_relay(target: str, rtt_ms: float, loss: float, port: int, timeout: float = 30.0) -> subprocess.Popen:
    """A relay on ``127.0.0.1:port`` to ``target`` (HOST:PORT), up and listening."""
    host, _, port_text = target.rpartition(":")
    if not host or not port_text.isdigit():
        raise DeployError(f"--superlink {target!r} is not HOST:PORT")
    proc = subprocess.Popen(relay_argv(("127.0.0.1", port), (host, int(port_text)), Impairment(rtt_ms, loss, seed=0)))
    deadline = time.monotonic() + timeout
    while not port_open(port, "127.0.0.1"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise DeployError(f"the relay to {target} did not listen on 127.0.0.1:{port}")
        time.sleep(0.05)
    return proc


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m deploy.edge.edgenode COMMAND [ARGS...]  (limits from FLCHURN_* variables)")
    env = dict(os.environ)
    try:
        limits = limits_from_env(env)
        dev = env.get("FLCHURN_NET_DEV", "eth0")
        cmds = shape_commands(dev, limits.get("up_kbps"), limits.get("down_kbps"))
        if cmds and os.geteuid() != 0:
            raise DeployError("bandwidth limits need root and CAP_NET_ADMIN in the container "
                              "(the compose override sets user: root and cap_add: [NET_ADMIN])")
        for cmd in cmds:
            _run(*cmd)
        shaped = ", ".join(f"{k}={v:g}" for k, v in limits.items())
        drop_privileges(env.get("FLCHURN_RUN_AS", ""))
        if limits.get("rtt_ms") or limits.get("loss"):
            port = int(env.get("FLCHURN_RELAY_PORT", "9099"))
            start_relay(_superlink_value(argv), limits.get("rtt_ms", 0.0), limits.get("loss", 0.0), port)
            argv = with_superlink(argv, f"127.0.0.1:{port}")
    except (DeployError, OSError, ValueError) as err:
        sys.exit(f"deploy.edge.edgenode: {err}")
    print(f"deploy.edge.edgenode: {shaped or 'no network limits'} on {dev}; exec {argv[0]}", flush=True)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
