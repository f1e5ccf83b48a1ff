"""The worker process of one SuperNode: serves messages with the ClientApp's own handlers.

Started by :meth:`client_app.worker.NodeWorker.connect` as ``python -m client_app.worker_process``
at a node's first message, or, warm (``--warm-config``), by the launcher's SuperNode command when a
node returns to a run whose app it has installed already (``deploy.tuning``); see
``client_app.worker`` for its lifetime and identity rules.
"""

from __future__ import annotations

import argparse
import os
import pickle
import selectors
import socket
import sys
import traceback
from pathlib import Path

from flowerlink import set_task_identity

from .worker import address, recv_obj, same_user, send_obj, start_time


def warm(run_config_file: str) -> None:
    """Build what the first message would: the ClientApp's imports (torch), and the workload of the
    run config in ``run_config_file`` (JSON; the launcher's, with the node's data-dir), cached as
    ``client_app.app.workload_of`` finds it. Never fails the worker: the first message builds it."""
    import json
    import time

    t0 = time.monotonic()
    try:
        from runconfig import WorkloadConfig, from_run_config
        from workloads.workload import get_workload

        get_workload(from_run_config(WorkloadConfig, json.loads(Path(run_config_file).read_text())))
    except Exception:  # noqa: BLE001 - a warm-up that fails leaves the work to the first message
        traceback.print_exc()
        return
    print(f"client worker {os.getpid()}: warm, the run's workload built in {time.monotonic() - t0:.1f} s",
          file=sys.stderr, flush=True)


def serve(supernode: int, started: int, warm_config: str | None = None) -> int:
    """Serve messages until SuperNode ``supernode`` exits. Returns the exit code. The socket is
    bound before the imports, so a ClientApp that comes early waits for this worker instead of
    starting another; ``warm_config``: build the workload before the first message (:func:`warm`)."""
    try:
        watch = os.pidfd_open(supernode)
    except ProcessLookupError:
        return 0
    if start_time(supernode) != started:  # the pid was reused: that SuperNode is gone
        return 0
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(address(supernode, started))
    except OSError:  # another worker of this SuperNode listens already
        return 0
    server.listen(8)
    from .app import app as client_app  # torch (seconds): a ClientApp connecting meanwhile waits

    if warm_config:
        warm(warm_config)
    sel = selectors.DefaultSelector()
    sel.register(watch, selectors.EVENT_READ, "supernode")
    sel.register(server, selectors.EVENT_READ, "client")
    while True:
        for key, _ in sel.select():
            if key.data == "supernode":
                return 0  # the SuperNode exited: so does its worker, at once
            conn, _ = server.accept()
            with conn:
                handle(conn, client_app)  # the workload loads at the first message (unless warm)


def handle(conn: socket.socket, app) -> None:
    if not same_user(conn):
        return  # another user's process: not ours to answer
    try:
        identity, msg, context = recv_obj(conn)
        set_task_identity(*identity)
    except (EOFError, OSError):
        return
    try:
        out = ("reply", app(msg, context), context.state)
    except Exception as exc:  # noqa: BLE001 - handed back and raised in the ClientApp, as if local
        traceback.print_exc()  # into the SuperNode's log, with the worker's frames
        out = ("raised", _picklable(exc), None)
    try:
        send_obj(conn, out)
    except OSError:
        pass  # the ClientApp went (its SuperNode stopped): nobody to answer


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The client worker of one SuperNode (started by the ClientApp).")
    ap.add_argument("--supernode", type=int, required=True, help="pid of the SuperNode this worker serves")
    ap.add_argument("--started", type=int, required=True, help="its start time (/proc/PID/stat field 22)")
    ap.add_argument("--warm-config", default=None, help="a run config (JSON) whose workload to build at once")
    a = ap.parse_args(argv)
    return serve(a.supernode, a.started, a.warm_config)


if __name__ == "__main__":
    sys.exit(main())
