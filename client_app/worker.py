"""A long-lived worker per SuperNode behind a thin ClientApp (deployments only): the ClientApp's side.

The worker process itself (serving messages with the ClientApp's handlers) is
``client_app.worker_process``; this module is what the ClientApp needs to reach it: the switch,
the mod, finding the SuperNode, starting and calling its worker, and the framing both sides speak.

Flower 1.41 starts a fresh ``flwr-clientapp`` process for every message; importing torch and
building the workload there cost ~6 s a message. With node config ``client-worker=true`` (set by
``deploy.tuning.NODE_CONFIG``), the ClientApp's mod :func:`through_worker` hands the message and
the node's context to this node's worker process instead, which keeps torch and the workload
loaded, calls the same ClientApp handlers, and sends back the reply and the updated
``context.state``. Without the key (simulation, in-process runs, tests) the handlers are called
directly, so the numbers are the same either way.

Lifetime and identity:

- The worker belongs to one SuperNode process (its pid and start time), found through the
  ``--parent-pid`` arguments Flower passes down (SuperNode -> SuperExec -> ClientApp). The first message starts it; it listens on
  an abstract Unix socket named after that pid, start time and the installed app's folder.
- It exits as soon as that SuperNode process exits, whatever the signal (SIGTERM, SIGKILL): it
  holds a pidfd of the SuperNode and waits on it. A restarted SuperNode is a new process, so it
  gets a new worker; a stopped node's worker is never addressed again (nor can it be: its name
  holds the old process's start time).
- It caches only what is a pure function of the run config (the workload, the schedule).
  Client-held state (FedAWE's copy) travels with every message in ``context.state`` and is
  written under ``state-dir`` by the handlers, exactly as without the worker.
- It handles one message at a time, as the SuperNode does. Only processes of the same user may
  talk to it (``SO_PEERCRED``); messages are pickled, so it trusts that user.

Stragglers (run config ``straggler-policy=partial``, no ``devices``): a TRAIN message goes to
the worker with node config ``train-until`` (:func:`train_until`, epoch seconds): the round's
deadline minus ``straggler-upload-s``; local training stops there (after at least
``straggler-min-steps`` steps) and the reply says how many steps it did (``num-steps``).

Linux only (pidfd, abstract sockets, /proc); elsewhere the switch is an error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import cast

from flwr.app import Context, Message, MessageType

from flowerlink import task_identity
from runconfig import ConfigError, StragglerConfig, from_run_config
from strategies.protocol import SERVER_ROUND

from .pidinfo import start_time

log = logging.getLogger(__name__)

FORKED_BY = "FLCHURN_FORKED_BY"  # env: the SuperNode whose forker (deploy.prefork) forked this process's chain
SWITCH = "client-worker"  # node_config key: true = hand messages to this node's worker
TRAIN_UNTIL = "train-until"  # node_config key the worker's handlers see: a straggler's stop (epoch seconds)
APP_ROOT = Path(__file__).resolve().parent.parent  # the installed app (Flower unpacks one per FAB)
START_TIMEOUT = 120.0  # seconds a new worker may take to listen
_HEADER = struct.Struct("!Q")


class WorkerError(RuntimeError):
    """The worker could not be started or reached, or died while handling a message."""


def uses_worker(context: Context) -> bool:
    value = context.node_config.get(SWITCH, False)
    if not isinstance(value, bool):
        raise ConfigError(f"node config {SWITCH}={value!r}: use true or false (no quotes)")
    if value and not sys.platform.startswith("linux"):
        raise ConfigError(f"node config {SWITCH}=true needs Linux (pidfd, /proc); set it to false")
    return value


def through_worker(msg: Message, context: Context, call_next):
    """Flower mod: to the node's worker when the node config asks for it, else straight on."""
    if not uses_worker(context):
        return call_next(msg, context)
    return NodeWorker.of_this_process().call(msg, context)


def train_until(msg: Message, context: Context) -> float | None:
    """When a deployed client under ``straggler-policy=partial`` stops local training (epoch
    seconds): the message's ``created_at`` (the server's clock: deployments on one host or with
    synchronised clocks) + the round's wait - ``straggler-upload-s``. The round's wait is what the
    ServerApp waits (``server_app.experiment.train_timeout``): ``round-deadline``, except in round 1,
    where every node also starts its worker and the server waits ``round-timeout`` (a resumed run's
    first round waits ``round-timeout`` too; this stops at ``round-deadline`` there, early but on time).
    None for any other message, policy or a run on the virtual clock (``devices``: the clock's budget)."""
    run_config = context.run_config
    stragglers = from_run_config(StragglerConfig, run_config).validate()
    if (msg.metadata.message_type != MessageType.TRAIN or stragglers.straggler_policy != "partial"
            or run_config.get("devices", "")):
        return None
    config = msg.content.config_records.get("config")
    first = config is not None and int(cast(int, config.get(SERVER_ROUND, 0))) == 1
    wait = float(cast(float, run_config.get("round-timeout" if first else "round-deadline", 0.0)))
    if wait <= 0:
        return None
    return float(msg.metadata.created_at) + wait - stragglers.straggler_upload_s


# ---------------------------------------------------------------------- processes (/proc)
def parent_pid_arg(pid: int) -> int | None:
    """The ``--parent-pid`` argument of process ``pid`` (Flower passes it down its process chain)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return parent_pid_in(argv)


def parent_pid_in(argv: list[str]) -> int | None:
    """The ``--parent-pid`` argument in ``argv`` (a ``flwr-clientapp`` forked by :mod:`deploy.prefork`
    has its arguments in ``sys.argv``, its forker's in /proc)."""
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "--parent-pid" and value.isdigit():
            return int(value)
    return None


def supernode_of(pid: int) -> int | None:
    """The SuperNode that process ``pid`` (a ``flwr-clientapp``) works for, or None.

    Flower's chain: ``flower-supernode`` starts ``flower-superexec --parent-pid SUPERNODE``, which
    starts ``flwr-clientapp --parent-pid SUPEREXEC`` for each message. The launcher's SuperNode forks
    both (:mod:`deploy.prefork`), so their /proc arguments are the SuperNode's: its environment
    (``FORKED_BY``, inherited by its descendants only) names it then.
    """
    superexec = parent_pid_arg(pid) if pid != os.getpid() else parent_pid_in(sys.argv)
    if superexec is None:
        return None
    supernode = parent_pid_arg(superexec)
    if supernode is None and pid == os.getpid() and (forked := os.environ.get(FORKED_BY, "")).isdigit():
        supernode = int(forked)  # a SuperExec forked by deploy.prefork: its /proc arguments are its SuperNode's
    return supernode


def address(supernode: int, started: int) -> str:
    """The worker's abstract socket name: one per SuperNode process and installed app."""
    app = hashlib.sha1(str(APP_ROOT).encode()).hexdigest()[:12]
    return f"\0flchurn-worker-{supernode}-{started}-{app}"


# ---------------------------------------------------------------------- framing
def send_obj(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_obj(sock: socket.socket):
    header = recv_exactly(sock, _HEADER.size)
    return pickle.loads(recv_exactly(sock, _HEADER.unpack(header)[0]))


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock`` (EOFError when it closes first)."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        buf += chunk
    return bytes(buf)


def same_user(conn: socket.socket) -> bool:
    """Whether the process at the other end of Unix socket ``conn`` runs as this user (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1] == os.getuid()


# ---------------------------------------------------------------------- the ClientApp side
class NodeWorker:
    """The worker of one SuperNode process, as seen from a ``flwr-clientapp`` process."""

    def __init__(self, supernode: int) -> None:
        self.supernode = supernode
        self.started = start_time(supernode)
        self.address = address(supernode, self.started)

    @classmethod
    def of_this_process(cls) -> NodeWorker:
        supernode = supernode_of(os.getpid())
        if supernode is None:
            raise WorkerError(
                f"node config {SWITCH}=true, but this ClientApp (pid {os.getpid()}) was not started by a "
                "SuperNode's own SuperExec (isolation 'process' or a simulation?); set it to false there")
        return cls(supernode)

    def call(self, msg: Message, context: Context) -> Message:
        """The reply to ``msg``; ``context.state`` is replaced by the worker's updated state."""
        sock = self.connect()
        node_config = {k: v for k, v in context.node_config.items() if k not in (SWITCH, TRAIN_UNTIL)}
        if (until := train_until(msg, context)) is not None:
            node_config[TRAIN_UNTIL] = until
        plain = Context(run_id=context.run_id, node_id=context.node_id, state=context.state,
                        run_config=context.run_config, series_id=context.series_id, node_config=node_config)
        identity = task_identity()
        try:
            with sock:
                send_obj(sock, (identity, msg, plain))
                status, payload, state = recv_obj(sock)
        except (EOFError, OSError) as err:
            raise WorkerError(f"the client worker of SuperNode {self.supernode} died while handling "
                              f"the message ({err}); the next message starts a new one") from err
        if status == "raised":
            raise payload
        context.state = state
        return payload

    def connect(self, timeout: float = START_TIMEOUT) -> socket.socket:
        """A connection to the worker, starting it first when it is not there."""
        if (sock := self._try_connect()) is not None:
            return sock
        proc = subprocess.Popen(
            [sys.executable, "-m", "client_app.worker_process", "--supernode", str(self.supernode),
             "--started", str(self.started)],
            cwd=APP_ROOT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(APP_ROOT),
                                                                             os.environ.get("PYTHONPATH")]))},
        )
        deadline = time.monotonic() + timeout
        while (sock := self._try_connect()) is None:
            if proc.poll() is not None:  # (exit 0 and a listener: another one of this node won the race)
                if (sock := self._try_connect()) is not None:
                    return sock
                raise WorkerError(f"the client worker of SuperNode {self.supernode} exited with code "
                                  f"{proc.returncode} before listening (see the SuperNode's log)")
            if time.monotonic() > deadline:
                proc.kill()
                raise WorkerError(f"the client worker of SuperNode {self.supernode} did not listen "
                                  f"within {timeout:.0f} s")
            time.sleep(0.02)
        return sock

    def _try_connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.address)
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            return None
        return sock
