"""What the devices did, round by round (pure): each scheduled client's status, and the realised
participation written as a ``trace-matrix`` file that a simulation replays
(``availability=trace-matrix:path=<run>/realised-trace.csv``).

Statuses of a client the schedule has on in round r:

- ``on time``: its reply reached the server before the round closed (``participants``);
- ``rejected``: it replied in time, but the strategy rejected the reply (``rejected``);
- ``out of memory``: its node's memory cgroup killed a process during round r;
- ``late``: it trained and replied (its own timing record says so) but after the round closed
  (``round-deadline``, or ``round-timeout``): the server dropped the reply;
- ``lost``: no reply and no record (stopped, crashed, not registered in time, ...).

A client the schedule has off is ``off``. The realised trace has a 1 where the client answered
in time (on time or rejected): what a simulation must make available to replay the run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from client_app.timing import TIMING_DIR  # <state-dir>/timing/client-<id>.jsonl, one line per reply

ON_TIME, REJECTED, OOM, LATE, LOST, OFF = "on time", "rejected", "out of memory", "late", "lost", "off"
STATUSES = (ON_TIME, REJECTED, OOM, LATE, LOST, OFF)


def read_client_timing(state_dir: str | Path) -> dict[tuple[int, int], dict[str, Any]]:
    """(round, client) -> the client's own record of a training reply (``train-time`` ...),
    from ``<state_dir>/timing/client-*.jsonl`` (the ClientApp writes them with ``report-timing``)."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for path in sorted((Path(state_dir) / TIMING_DIR).glob("client-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[int(rec["round"]), int(rec["client"])] = rec
    return out


def classify(
    schedule: np.ndarray,
    rows: Iterable[Mapping[str, Any]],
    timing: Mapping[tuple[int, int], Mapping[str, Any]],
    *,
    oom: Iterable[tuple[int, int]] = (),
    client_of_node: Mapping[int, int] | None = None,
) -> dict[int, dict[int, str]]:
    """round -> client -> status, for every recorded round (see the module docstring).
    ``schedule``: (rounds, clients) bool; ``oom``: (round, client) pairs with an OOM kill."""
    oom = set(oom)
    client_of_node = client_of_node or {}
    out: dict[int, dict[int, str]] = {}
    for row in rows:
        r = int(row["round"])
        took_part = {int(c) for c in row["participants"]}
        rejected = {client_of_node[int(node)] for node, _ in row.get("rejected", []) if int(node) in client_of_node}
        status = {}
        for c in range(schedule.shape[1]):
            if not schedule[r - 1, c]:
                status[c] = ON_TIME if c in took_part else OFF
            elif c in took_part:
                status[c] = ON_TIME
            elif c in rejected:
                status[c] = REJECTED
            elif (r, c) in oom:
                status[c] = OOM
            elif (r, c) in timing:
                status[c] = LATE
            else:
                status[c] = LOST
        out[r] = status
    return out


def realised_matrix(statuses: Mapping[int, Mapping[int, str]], num_clients: int) -> np.ndarray:
    """(rounds, clients) bool: answered in time (on time or rejected), rounds in order."""
    rounds = sorted(statuses)
    m = np.zeros((len(rounds), num_clients), dtype=bool)
    for t, r in enumerate(rounds):
        for c, s in statuses[r].items():
            m[t, c] = s in (ON_TIME, REJECTED)
    return m


def write_trace_matrix(path: str | Path, matrix: np.ndarray, comment: str = "") -> Path:
    """``matrix`` in the ``trace-matrix`` format (availability/traces.py): a header of client
    labels (``c0,c1,...``: a header of ids ``0,1`` would read back as a round when N <= 2), one
    0/1 row per round."""
    path = Path(path)
    n = matrix.shape[1]
    lines = [f"# {line}" for line in comment.splitlines()] + [",".join(f"c{i}" for i in range(n))]
    lines += [",".join("1" if v else "0" for v in row) for row in matrix]
    path.write_text("\n".join(lines) + "\n")
    return path


# what a client records per reply: seconds, peak MiB, and wall-clock times (s since the epoch) of the
# server's message ("sent-at", its created_at) and of the reply built ("at")
TIMED = ("train-time", "cpu-time", "num-steps", "receive-to-reply", "peak-rss-mb", "sent-at", "at")


def write_clients_jsonl(path: str | Path, statuses: Mapping[int, Mapping[int, str]],
                        timing: Mapping[tuple[int, int], Mapping[str, Any]],
                        classes: Mapping[int, str] | None = None,
                        nodes: Mapping[int, Mapping[int, Mapping[str, Any]]] | None = None) -> Path:
    """One line per round: each client's status, what it recorded of its reply (:data:`TIMED`,
    client -> value) and, with ``nodes`` (round -> client -> figures), what its node used in
    the round (``node``: CPU seconds, bytes in/out, ...)."""
    path = Path(path)
    with path.open("w") as fh:
        for r in sorted(statuses):
            rec: dict[str, Any] = {"round": r, "status": {str(c): s for c, s in sorted(statuses[r].items())}}
            for key in TIMED:
                values = {str(c): timing[r, c][key] for c in statuses[r] if key in timing.get((r, c), {})}
                if values:
                    rec[key] = values
            if nodes and r in nodes:
                rec["node"] = {str(c): dict(v) for c, v in sorted(nodes[r].items())}
            if classes:
                rec["class"] = {str(c): classes[c] for c in sorted(statuses[r])}
            fh.write(json.dumps(rec) + "\n")
    return path


def per_class(statuses: Mapping[int, Mapping[int, str]], classes: Mapping[int, str]) -> dict[str, dict[str, int]]:
    """class -> status -> count over every round (``off`` left out)."""
    out: dict[str, dict[str, int]] = {}
    for status in statuses.values():
        for c, s in status.items():
            if s != OFF:
                counts = out.setdefault(classes[c], {})
                counts[s] = counts.get(s, 0) + 1
    return out
