"""Per-client timing of training replies, for edge emulation (deployments only).

With node config ``report-timing=true`` (the launcher sets it under ``--devices``), a training
reply carries ``train-time`` (seconds of local training, :data:`strategies.protocol.TRAIN_TIME`)
and the client appends one JSON line per reply to ``<state-dir>/timing/client-<id>.jsonl``:
round, train time, CPU time, receive-to-reply time, peak RSS of the process that trained, the
server's send time (the message's ``created_at``) and the reply's wall-clock time (``at``). The
launcher reads those lines after the run to tell a late reply (trained, but after the round
closed) from a lost one (``deploy/realised.py``). Without the key nothing is measured or written,
so simulations and their numbers are unchanged.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

from flwr.app import Context

SWITCH = "report-timing"
TIMING_DIR = "timing"


def reports_timing(context: Context) -> bool:
    return bool(context.node_config.get(SWITCH, False))


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def record(context: Context, client: int, server_round: int, values: dict) -> None:
    """Append this reply's timing to the client's file under the node's ``state-dir``."""
    root = context.node_config.get("state-dir", "")
    if not root:
        return
    folder = Path(str(root)) / TIMING_DIR
    folder.mkdir(parents=True, exist_ok=True)
    line = {"round": server_round, "client": client, "at": time.time(), **values}
    with (folder / f"client-{client}.jsonl").open("a") as fh:
        fh.write(json.dumps(line) + "\n")
