"""What ran, for ``config.json``: the project's fingerprint and, under Ray, the cluster's nodes.

:func:`project_fingerprint` is the installed distribution's version plus a hash of the source
files of the packages a ClientApp imports, as they are found on this machine's path (not
imported): two machines with the same fingerprint run the same client code.
``experiments.raycluster`` asks every node of a Ray cluster for it before a run, and the
ServerApp records its own. :func:`ray_record` reads the Ray this process is a driver of (Flower's
``flwr-simulation`` after its ``ray.init()``): the nodes (id, address, CPUs, GPUs, alive) and
the address it joined; {} where Ray is not running in this process (in-process runs,
deployments). Imports nothing of ours.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

DISTRIBUTION = "flchurn"
# what a ClientApp imports (tests/test_structure.py's arrows: client_app and everything it reaches)
CLIENT_PACKAGES = ("client_app", "availability", "flowerlink", "runconfig", "strategies", "workloads")


def package_files(name: str) -> dict[str, Path]:
    """The ``.py`` files of package ``name`` where this interpreter's path finds it, by their path
    inside the package ({} if it is found nowhere)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return {}
    root = Path(next(iter(spec.submodule_search_locations)))
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*.py")) if "__pycache__" not in p.parts}


def project_fingerprint(packages: tuple[str, ...] = CLIENT_PACKAGES) -> dict[str, str]:
    """``{"version": <flchurn's installed version or "not installed">, "sources": <16 hex digits>}``:
    the sha256 over each package's files (path inside the package, then bytes), in order; a package
    that is not found counts as its name with no files, so a node without it differs."""
    digest = hashlib.sha256()
    for name in packages:
        files = package_files(name)
        digest.update(f"package {name} {len(files)}\n".encode())
        for rel, path in files.items():
            digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return {"version": version, "sources": digest.hexdigest()[:16]}


def node_record(node: dict[str, Any]) -> dict[str, Any]:
    """One entry of ``ray.nodes()`` as ``config.json`` keeps it."""
    res = node.get("Resources") or {}
    return {"node-id": str(node.get("NodeID", "")), "address": str(node.get("NodeManagerAddress", "")),
            "cpus": float(res.get("CPU", 0.0)), "gpus": float(res.get("GPU", 0.0)),
            "alive": bool(node.get("Alive", False)), "head": "node:__internal_head__" in res}


def driven_ray() -> Any:
    """The ``ray`` module when this process is a Ray driver (initialised), else None; Ray is
    never imported here."""
    ray = sys.modules.get("ray")
    return ray if ray is not None and ray.is_initialized() else None


def ray_record() -> dict[str, Any]:
    """``{"ray": {...}}``: the Ray cluster this process drives (its nodes, the address asked for
    through ``RAY_ADDRESS``, Ray's version); {} when Ray is not initialised in this process."""
    ray = driven_ray()
    if ray is None:
        return {}
    try:
        nodes = [node_record(n) for n in ray.nodes()]
        gcs = ray.get_runtime_context().gcs_address
    except Exception as exc:  # noqa: BLE001 - a record, never the reason a run fails
        return {"ray": {"error": f"{type(exc).__name__}: {exc}", "version": ray.__version__}}
    return {"ray": {"version": ray.__version__, "ray-address": os.environ.get("RAY_ADDRESS", ""),
                    "gcs-address": gcs, "nodes": nodes}}
