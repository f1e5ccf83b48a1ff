"""A returning node's client worker started with the node (issue 40, item 6): imports only the
standard library and ``client_app.pidinfo``, so the SuperNode command (``python -m deploy.tuning
supernode``) starts the worker before its own imports of Flower, and the two start side by side.

The worker runs the app this node installed when it first took part, or the SuperLink's
(:func:`share_installed_app`; the newest under ``$FLWR_HOME/apps``), so the ClientApp finds it at
the address it computes (``client_app.worker.address``); with no app installed yet (round 1) no
worker starts early. It dies with the SuperNode (pidfd)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

WARM_VAR = "FLCHURN_WARM_WORKER"  # a run config (JSON) whose workload a returning node's worker builds at once


def installed_apps(flwr_home: Path) -> list[Path]:
    """The Flower apps installed in ``flwr_home`` (one folder per FAB), oldest first."""
    return sorted((d for d in (flwr_home / "apps").glob("*") if d.is_dir() and not d.name.startswith(".")),
                  key=lambda d: d.stat().st_mtime)


def share_installed_app(flwr_home: Path, source_home: Path) -> None:
    """A node that has not taken part in the run yet gets the app ``source_home`` installed (the
    SuperLink's: its ServerApp installed it, whole, before round 1's messages went out; the same
    FAB, byte for byte, at the folder Flower would install it in, which the node then uses as it
    is): so its worker can start warm too. The copy appears at once and whole (a rename), or not at
    all when Flower's own install of that folder came first; a node's half-written install (Flower
    writes it file by file) is never a source."""
    if installed_apps(flwr_home) or not (found := installed_apps(source_home)):
        return
    newest = found[-1]
    tmp = flwr_home / "apps" / f".{newest.name}.{os.getpid()}.partial"
    try:
        shutil.copytree(newest, tmp, dirs_exist_ok=True)
        os.rename(tmp, flwr_home / "apps" / newest.name)
    except OSError:  # Flower began its own install of it meanwhile (that one is the node's), a full disk:
        shutil.rmtree(tmp, ignore_errors=True)  # the node installs it itself and its worker starts cold


def start_warm_worker(run_config_file: str) -> subprocess.Popen | None:
    """This process's (the SuperNode's) client worker, started now instead of at its first
    message, building the workload of the run config in ``run_config_file``: what makes a
    returning node warm when its round starts (the look-ahead starts it a round early). None when
    this node has no app installed yet."""
    from client_app.pidinfo import start_time

    apps = installed_apps(Path(os.environ.get("FLWR_HOME", "")))
    if not apps or not (apps[-1] / "client_app" / "worker_process.py").is_file():
        return None
    path = os.pathsep.join(filter(None, [str(apps[-1]), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "client_app.worker_process", "--supernode", str(os.getpid()),
                             "--started", str(start_time(os.getpid())), "--warm-config", run_config_file],
                            cwd=apps[-1], stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
