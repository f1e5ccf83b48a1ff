"""The worker process of one SuperNode: serves messages with the ClientApp's own handlers.

Started by :meth:`client_app.worker.NodeWorker.connect` as ``python -m client_app.worker_process``;
see ``client_app.worker`` for its lifetime and identity rules.
"""

from __future__ import annotations

import argparse
import os
import pickle
import selectors
import socket
import struct
import sys
import traceback

from flowerlink import set_task_identity

from .app import app as client_app
from .worker import address, recv_obj, send_obj, start_time


def serve(supernode: int, started: int) -> int:
    """Serve messages until SuperNode ``supernode`` exits. Returns the exit code."""
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
    sel = selectors.DefaultSelector()
    sel.register(watch, selectors.EVENT_READ, "supernode")
    sel.register(server, selectors.EVENT_READ, "client")
    while True:
        for key, _ in sel.select():
            if key.data == "supernode":
                return 0  # the SuperNode exited: so does its worker, at once
            conn, _ = server.accept()
            with conn:
                handle(conn, client_app)  # torch and the workload load at the first message


def handle(conn: socket.socket, app) -> None:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    if struct.unpack("3i", creds)[1] != os.getuid():
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
    a = ap.parse_args(argv)
    return serve(a.supernode, a.started)


if __name__ == "__main__":
    sys.exit(main())
