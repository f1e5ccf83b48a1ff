"""``python -m experiments.run --ray-address HOST:PORT``: the checks before a run on a Ray cluster.

Flower's ``flwr-simulation`` calls ``ray.init()`` without an address, so the cluster reaches it
through ``RAY_ADDRESS`` in the private SuperLink's environment (:func:`ray_address_env`); without
the flag that variable is ``local``, with which Ray 2.55 starts a fresh local instance even when
another cluster runs on the machine (without it, ``ray.init()`` joins the cluster named in
``<temp dir>/ray_current_cluster``: a stray ``ray start`` would be joined silently).

Before anything is submitted, :func:`check_cluster` (each failure a :class:`ClusterError`, exit 2):

- the settings a cluster run cannot take (:func:`refuse_settings`): Flower's
  ``init-args-num-cpus`` / ``init-args-num-gpus`` (Ray refuses them when joining a cluster: a
  node's resources are set by its ``ray start``), a backend other than ``ray``, a relative
  ``data-dir`` (each node would resolve it in its own working directory);
- the cluster answers at the address (a TCP connect first, then ``ray.init``), naming the address;
- one client actor (``--num-cpus`` / ``--num-gpus``) fits at least one live node;
- every live node, by a Ray task pinned to it (``NodeAffinitySchedulingStrategy``, no CPU
  reserved), imports the project's ClientApp and answers its fingerprint
  (:func:`server_app.versions.project_fingerprint`: version + hash of the client packages'
  sources) and its flwr, torch, numpy and ray versions, which must equal this machine's; an
  import failure, a mismatch or a node that does not answer names the node;
- paths the clients use must be the same folder on every node: ``data-dir`` must exist on each,
  and a non-empty ``state-dir`` (client state) must be a folder every node shares: this machine
  writes a marker file into it and every node must see that file. A ``state-dir`` on one node's
  disk is refused; a shared file system (NFS, ...) mounted at the same path passes. That is how a
  user declares it shared: by sharing it.

The ServerApp records the nodes and versions in ``config.json`` (``ray``, ``versions``).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runconfig import ConfigError, closest
from server_app.versions import node_record, project_fingerprint

RAY_ADDRESS_VAR = "RAY_ADDRESS"
LOCAL = "local"  # Ray 2.55: ray.init() starts a new local instance, never joins another
REFUSED_INIT_ARGS = ("init-args-num-cpus", "init-args-num-gpus")
MARKER = ".flchurn-shared-"  # a state-dir marker file: <state-dir>/.flchurn-shared-<uuid>
# set by the flags --num-supernodes, --num-cpus, --num-gpus; not by --federation-config
FLAG_OF = {"num-supernodes": "--num-supernodes", "client-resources-num-cpus": "--num-cpus",
           "client-resources-num-gpus": "--num-gpus"}
CHECK_BASE_S = 60.0  # a node's answer, on an idle machine (scaled by the host's load: deploy.waits)


def federation_keys() -> list[str]:
    """Flower 1.42's simulation federation keys (its ``SimulationConfig`` fields, as ``flwr run
    --federation-config`` spells them)."""
    from flwr.proto.federation_config_pb2 import SimulationConfig

    return [f.name.replace("_", "-") for f in SimulationConfig.DESCRIPTOR.fields]


def parse_federation(text: str) -> dict[str, Any]:
    """``--federation-config "k=v ..."`` with Flower's parser; an unknown key (with the closest
    known one) or a key one of our flags sets is a ConfigError."""
    from flwr.common.config import parse_config_args

    try:
        given = parse_config_args([text]) if text.strip() else {}
    except ValueError as err:
        raise ConfigError(f"--federation-config {text!r}: {err}") from None
    known = federation_keys()
    for key in given:
        if key in FLAG_OF:
            raise ConfigError(f"--federation-config {key}: set it with {FLAG_OF[key]}")
        if key not in known:
            near = closest(key, known)
            raise ConfigError(f"--federation-config {key}: not a Flower simulation key"
                              + (f" (did you mean {near!r}?)" if near else f"; known: {', '.join(known)}"))
    return dict(given)


class ClusterError(RuntimeError):
    """A setting or a cluster that a run on Ray cannot take (exit code 2)."""


def ray_address_env(address: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, str | None]:
    """(``RAY_ADDRESS`` for the SuperLink, a note for the user or None): the flag's address, else
    ``local``; a ``RAY_ADDRESS`` inherited from the shell is not followed without the flag."""
    if address:
        return address, None
    inherited = environ.get(RAY_ADDRESS_VAR, "")
    note = (f"{RAY_ADDRESS_VAR}={inherited} in this environment is not used: the run starts its own local Ray "
            f"(pass --ray-address {inherited} to run on that cluster)") if inherited and inherited != LOCAL else None
    return LOCAL, note


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` of a cluster's head (what ``ray start --head`` prints), else ClusterError."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"--ray-address {address!r}: give the cluster head's GCS address HOST:PORT (what "
                           "`ray start --head --port PORT` prints, e.g. 10.0.0.5:6379); Ray Client addresses "
                           "(ray://) are not supported: flwr-simulation joins the cluster as a driver on this machine")
    return host, int(port)


def refuse_settings(user: Mapping[str, Any], federation: Mapping[str, Any]) -> None:
    """What a cluster run cannot take, from the user's own run config overrides (before paths are
    made absolute) and the Flower federation config: ClusterError naming the key."""
    for key in REFUSED_INIT_ARGS:
        if key in federation:
            raise ClusterError(f"--federation-config {key}={federation[key]}: Ray refuses num_cpus / num_gpus when "
                               "joining an existing cluster (each node's resources are those of its `ray start "
                               "--num-cpus/--num-gpus`); leave it out with --ray-address")
    backend = federation.get("backend", "ray")
    if backend != "ray":
        raise ClusterError(f"--federation-config backend={backend}: --ray-address runs on Flower's Ray backend "
                           "(backend=ray)")
    data_dir = user.get("data-dir", "")
    if isinstance(data_dir, str) and data_dir and not Path(data_dir).expanduser().is_absolute():
        raise ClusterError(f"run config 'data-dir' = {data_dir!r} is relative: on a Ray cluster each client resolves "
                           "it in its own node's working directory; give an absolute path that every node mounts")


@dataclass(frozen=True)
class NodeAnswer:
    """What one node said to the version check."""

    node: dict[str, Any]  # server_app.versions.node_record
    versions: dict[str, Any]  # {} when the import failed
    error: str  # "" when the ClientApp imported
    sees: dict[str, bool]  # path -> exists there


def node_versions(paths: list[str]) -> tuple[dict[str, Any], str, dict[str, bool]]:
    """The body of the pinned task: import the ClientApp, return the versions and which ``paths`` exist."""
    sees = {p: os.path.exists(p) for p in paths}
    try:
        import flwr
        import numpy
        import ray
        import torch

        import client_app.app  # noqa: F401 - the import is the check
    except Exception as exc:  # noqa: BLE001 - any import failure is the answer
        return {}, f"{type(exc).__name__}: {exc}", sees
    return ({"flchurn": project_fingerprint(), "flwr": flwr.__version__, "torch": torch.__version__,
             "numpy": numpy.__version__, "ray": ray.__version__}, "", sees)


def local_versions() -> dict[str, Any]:
    """This machine's answer to :func:`node_versions` (what every node must equal)."""
    versions, error, _ = node_versions([])
    if error:
        raise ClusterError(f"the ClientApp does not import on this machine: {error}")
    return versions


def answers_differ(expected: Mapping[str, Any], answers: list[NodeAnswer]) -> list[str]:
    """One line per node that failed to import the ClientApp or runs other versions than ``expected``."""
    lines = []
    for a in answers:
        name = f"node {a.node['node-id']} ({a.node['address']})"
        if a.error:
            lines.append(f"{name}: the ClientApp does not import: {a.error}")
            continue
        diff = [f"{k} {a.versions.get(k)} (here {v})" for k, v in expected.items() if a.versions.get(k) != v]
        if diff:
            lines.append(f"{name}: {', '.join(diff)}")
    return lines


def paths_unseen(paths: Mapping[str, tuple[str, str]], answers: list[NodeAnswer]) -> list[str]:
    """``paths``: run config key -> (its value, the path every node must see: the value, or a
    marker file in it); one line per node that does not see one."""
    return [f"run config '{key}' = {value!r} is not there on node {a.node['node-id']} ({a.node['address']})"
            for a in answers for key, (value, path) in paths.items() if not a.sees.get(path, False)]


def fitting(nodes: list[dict[str, Any]], cpus: float, gpus: float) -> list[dict[str, Any]]:
    """The live nodes where one client actor (``cpus`` CPUs, ``gpus`` GPUs) fits."""
    return [n for n in nodes if n["alive"] and n["cpus"] >= cpus and (gpus <= 0 or n["gpus"] >= gpus)]


def connect(address: str, timeout: float = 5.0) -> Any:
    """``ray`` joined to the cluster at ``address`` (HOST:PORT), or ClusterError naming it."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as err:
        raise ClusterError(f"--ray-address {address}: the Ray cluster does not answer ({err.strerror or err}); start "
                           f"its head with `ray start --head --port {port}` on {host}, or check the address") from None
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # Ray's FutureWarning (deploy.flwr_cli)
    import ray

    pythonpath = os.pathsep.join(p for p in sys.path if p)  # as Flower's RayBackend gives its actors
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    except Exception as exc:  # noqa: BLE001 - Ray's own error, named with the address
        raise ClusterError(f"--ray-address {address}: could not join the Ray cluster: {type(exc).__name__}: "
                           f"{exc}") from None
    return ray


def ask_nodes(ray: Any, nodes: list[dict[str, Any]], paths: list[str], timeout: float) -> list[NodeAnswer]:
    """Run :func:`node_versions` once on every node in ``nodes`` (pinned, no CPU reserved)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(node_versions)
    refs = {task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["node-id"], soft=False)).remote(paths):
            n for n in nodes}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    if pending:
        late = ", ".join(f"{refs[r]['node-id']} ({refs[r]['address']})" for r in pending)
        raise ClusterError(f"node(s) {late} did not answer the version check within {timeout:.0f} s (a busy or "
                           "unreachable node; its raylet may be gone)")
    out = []
    for ref in ready:
        try:
            versions, error, sees = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - the task itself failed on that node
            versions, error, sees = {}, f"{type(exc).__name__}: {exc}", {}
        out.append(NodeAnswer(refs[ref], versions, error, sees))
    return out


def check_cluster(address: str, run_config: Mapping[str, Any], cpus: float, gpus: float,
                  slowdown: float = 1.0) -> list[dict[str, Any]]:
    """Every check of the module's list against the cluster at ``address``; returns its live nodes.
    ``run_config``: the resolved run config (absolute paths)."""
    expected = local_versions()
    marker = None
    state_dir = str(run_config.get("state-dir", "") or "")
    if state_dir:
        Path(state_dir).mkdir(parents=True, exist_ok=True)
        marker = Path(state_dir) / f"{MARKER}{uuid.uuid4().hex}"
        marker.write_text("written by python -m experiments.run to check that every Ray node shares state-dir\n")
    ray = connect(address)
    try:
        nodes = [node_record(n) for n in ray.nodes()]
        live = [n for n in nodes if n["alive"]]
        if not fitting(live, cpus, gpus):
            shape = ", ".join(f"{n['node-id'][:12]} {n['cpus']:g} CPU {n['gpus']:g} GPU" for n in live)
            raise ClusterError(f"client-resources-num-cpus={cpus:g} client-resources-num-gpus={gpus:g} (--num-cpus, "
                               f"--num-gpus): one client actor fits no live node of the cluster at {address} ({shape})")
        data_dir = str(run_config.get("data-dir", "") or "")
        paths = {**({"data-dir": (data_dir, data_dir)} if data_dir else {}),
                 **({"state-dir": (state_dir, str(marker))} if marker else {})}
        t0 = time.monotonic()
        answers = ask_nodes(ray, live, [p for _, p in paths.values()], CHECK_BASE_S * slowdown)
        print(f"Ray cluster at {address}: {len(live)} live node(s), checked in {time.monotonic() - t0:.1f} s: "
              + "; ".join(f"{n['node-id'][:12]} {n['address']} {n['cpus']:g} CPU {n['gpus']:g} GPU" for n in live),
              flush=True)
        if bad := answers_differ(expected, answers):
            raise ClusterError("not every Ray node runs this ClientApp: " + "; ".join(bad) + "; install the same "
                               "project (pip install -e . of the same commit) and the same flwr / torch on every node")
        if unseen := paths_unseen(paths, answers):
            raise ClusterError("a path the clients use is not there on every Ray node: " + "; ".join(unseen)
                               + " (client state must be on a folder every node mounts at the same path; a "
                               "state-dir on one node's disk is refused)")
        return live
    finally:
        ray.shutdown()
        if marker is not None:
            marker.unlink(missing_ok=True)
