"""FedScale-style device traces (per client: ``computation`` in ms per sample, ``communication``
in kbit/s; FedScale's ``client_device_capacity``: its own pickle or its text form (:mod:`.fedscale`),
or JSON or CSV) become device classes with
:func:`classes_from_trace`: N clients drawn with a seed, bucketed by speed into K classes whose
CPU fraction (a deployment's cap) and ``speed`` (the simulation's) are the fastest bucket's
median ms per sample over the bucket's, and whose bandwidth is the bucket's median.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

import virtualtime.fedscale as fedscale

from .errors import ProfileError


def read_trace(path: str | Path) -> dict[str, tuple[float, float]]:
    """client -> (ms per sample, kbit/s) from a FedScale-style device trace: FedScale's own pickle
    or its text form (:mod:`.fedscale`), JSON ``{"<client>": {"computation": ms, "communication":
    kbps}}`` or CSV with columns ``client,computation,communication``."""
    path = Path(path)
    try:
        if fedscale.is_pickle(path):
            return fedscale.capacity_rows(fedscale.read_pickle(path, fedscale.CAPACITY)[1])
        text = path.read_text()
    except OSError as err:
        raise ProfileError(f"device trace {path}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise ProfileError(f"device trace {path}: neither a pickle nor text ({err})") from err
    if text.lstrip().startswith('{"fedscale"'):
        kind, doc = fedscale.read_text(path)
        if kind != fedscale.CAPACITY:
            raise ProfileError(f"device trace {path}: a {kind}, not a {fedscale.CAPACITY}")
        return fedscale.capacity_rows(doc)
    out: dict[str, tuple[float, float]] = {}
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            rows = [(str(k), v) for k, v in json.loads(text).items()]
        except (json.JSONDecodeError, AttributeError) as err:
            raise ProfileError(f"{path}: not a JSON object of clients: {err}") from err
    else:
        rows = [(r.get("client", str(i)), r) for i, r in enumerate(csv.DictReader(text.splitlines()))]
    for client, row in rows:
        try:
            comp, comm = float(row["computation"]), float(row["communication"])
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileError(f"{path}: client {client}: needs numeric 'computation' (ms per sample) and "
                               f"'communication' (kbit/s), got {row!r}") from err
        if not (comp > 0 and comm > 0 and math.isfinite(comp) and math.isfinite(comm)):
            raise ProfileError(f"{path}: client {client}: computation and communication must be > 0, got "
                               f"{comp}, {comm}")
        out[client] = (comp, comm)
    if not out:
        raise ProfileError(f"{path}: no client in the trace")
    return out


def classes_from_trace(trace: Mapping[str, tuple[float, float]], num_nodes: int, num_classes: int,
                       seed: int = 0) -> str:
    """A devices file (TOML text) for ``num_nodes`` clients drawn from ``trace`` with ``seed``
    and bucketed by ms per sample into ``num_classes`` classes of (nearly) equal size."""
    if not 1 <= num_classes <= num_nodes:
        raise ProfileError(f"num_classes = {num_classes} must be between 1 and num_nodes = {num_nodes}")
    if len(trace) < num_nodes:
        raise ProfileError(f"the trace has {len(trace)} clients, fewer than the {num_nodes} SuperNodes")
    names = sorted(trace)
    drawn = [names[k] for k in np.random.default_rng(seed).choice(len(names), num_nodes, replace=False)]
    order = sorted(range(num_nodes), key=lambda i: trace[drawn[i]][0])  # fastest first
    buckets = [list(b) for b in np.array_split(np.array(order), num_classes)]
    med = [float(np.median([trace[drawn[i]][0] for i in b])) for b in buckets]
    out = [f"# {num_nodes} clients drawn from a FedScale-style trace (seed {seed}), {num_classes} classes by "
           f"ms per sample;\n# node i is trace client: "
           + ", ".join(f"{i}={drawn[i]}" for i in range(num_nodes)) + "\n"]
    for k, b in enumerate(buckets):
        kbps = int(round(float(np.median([trace[drawn[i]][1] for i in b]))))
        cpus = round(med[0] / med[k], 2)
        lines = [f"[class-{k}]", f"clients = {sorted(int(i) for i in b)}",
                 f"# median {med[k]:.1f} ms per sample, {kbps} kbit/s"]
        if cpus < 1.0:
            lines.append(f"cpus = {max(cpus, 0.05):g}")
        if med[k] > med[0]:
            lines.append(f"speed = {med[0] / med[k]:.4g}")
        lines += [f"up_kbps = {kbps}", f"down_kbps = {kbps}"]
        out.append("\n".join(lines) + "\n")
    return "\n".join(out)
