"""Processes on Linux, without leftovers: reserved ports, tagged processes, children, kill.

Every process the launcher starts carries a tag in its environment (``FLCHURN_DEPLOY_TAG``,
inherited by flower-superexec, flwr-serverapp and flwr-clientapp), starts in its own session
(process group) and gets ``PR_SET_PDEATHSIG=SIGKILL`` (the launcher dying kills it). A
:class:`Spawner` starts such processes and, at :meth:`Spawner.close`, kills their groups and
sweeps ``/proc`` for anything still carrying the tag. While a spawner is open the launcher is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): helpers orphaned by a killed parent are
re-parented to it and reaped (:meth:`Spawner.reap_orphans`), not left to a PID 1 that may not
reap. Nothing here knows Flower.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from .errors import DeployError

TAG_VAR = "FLCHURN_DEPLOY_TAG"
NODE_TAG_VAR = "FLCHURN_NODE_TAG"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LINUX = sys.platform.startswith("linux")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now, and may be taken by anyone a moment later:
    for a port that a process we start binds, hold a :class:`PortReservation` instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortReservation:
    """A TCP port on 127.0.0.1 that no other process can take until :meth:`release`: a socket bound
    to it with ``SO_REUSEADDR`` that never listens. The kernel hands the port to nobody else (no
    other ``bind(port 0)`` nor outgoing connection gets it; a plain ``bind`` to it fails), while the
    Flower process we start binds and listens on it (uvicorn and asyncio set ``SO_REUSEADDR``:
    Linux lets such a socket listen beside a bound, non-listening one). A port chosen "free right
    now" and bound later by a child could be taken in between by any process on the machine,
    another deployment's SuperNode or ClientApp included. Not inherited by children (CLOEXEC)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port = int(self._sock.getsockname()[1])

    @property
    def held(self) -> bool:
        return self._sock is not None

    @classmethod
    def replacing(cls, old: PortReservation | None) -> PortReservation:
        """A fresh reservation, ``old`` (if any) released first (a restarted process gets a new port)."""
        if old is not None:
            old.release()
        return cls()

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def venv_path(env: Mapping[str, str]) -> str:
    """``PATH`` with this Python's folder (the venv's bin) first: Flower starts its helpers
    (``flower-superexec``, ``flwr-serverapp``, ``flwr-clientapp``) by name from ``PATH``, and they
    must be the ones installed beside the Python that runs us, activated venv or not."""
    here = str(Path(sys.executable).parent)
    rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p != here]
    return os.pathsep.join([here, *rest])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` through libc; False where it fails or is not Linux."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value) == 0
    except Exception:  # noqa: BLE001 - Linux only
        return False


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the launcher dying kills the child


def exit_on_signals() -> None:
    """SIGTERM and SIGHUP raise SystemExit, SIGINT KeyboardInterrupt (even where a shell started us
    with SIGINT ignored): every ``finally`` and context manager runs, so nothing is left behind."""
    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # nohup: stay immune
        signal.signal(signal.SIGHUP, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


CLEANUP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def hold_signals() -> tuple[dict, list[int]] | None:
    """Hold SIGINT/SIGTERM/SIGHUP back (a cleanup must not be cut short by a second Ctrl-C or
    kill): until :func:`release_signals`, they are only noted, then re-raised. Main thread only
    (where Python runs handlers); elsewhere None and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return None
    noted: list[int] = []
    old = {s: signal.getsignal(s) for s in CLEANUP_SIGNALS}
    for s, h in old.items():
        if h is not signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: noted.append(signum))  # noqa: ARG005
    return old, noted


def release_signals(held: tuple[dict, list[int]] | None) -> None:
    if held is None:
        return
    old, noted = held
    for s, h in old.items():
        signal.signal(s, h if h is not None else signal.SIG_DFL)
    if noted:
        signal.raise_signal(noted[0])  # now the original handler acts on it


def child_setup(then: Callable[[], None] | None) -> Callable[[], None]:
    """The function a child runs between fork and exec: parent-death signal, then ``then``."""
    def setup() -> None:
        _set_pdeathsig()
        if then is not None:
            then()

    return setup


def tagged_pids(value: str, var: str = TAG_VAR) -> list[int]:
    """Pids of live processes whose environment has ``var=value`` (Linux /proc; [] elsewhere)."""
    needle = f"{var}={value}".encode()
    out: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            continue  # a zombie is already dead
        if needle in env.split(b"\0"):
            out.append(int(entry.name))
    return out


def children(parent: int | None = None) -> dict[int, str]:
    """pid -> state letter (R, S, Z, ...) of every child of ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out[int(entry.name)] = fields[0]
    return out


def zombie_children(parent: int | None = None) -> list[int]:
    """Pids of Z-state (dead, not yet reaped) children of ``parent`` (default: this process)."""
    return [pid for pid, state in children(parent).items() if state == "Z"]


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def find_exe(name: str) -> str:
    """``name`` next to this Python (the venv's bin) or on PATH."""
    exe = shutil.which(name, path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise DeployError(f"{name} not found next to {sys.executable} or on PATH")
    return exe


@dataclass
class Proc:
    """A process we started (in its own session), its log and its tag."""

    name: str
    popen: subprocess.Popen
    log: Path
    tag: str
    started: float = field(default_factory=time.monotonic)
    term_sent: bool = False
    log_from: int = 0  # where this process's output starts in ``log`` (a relaunch appends to the same file)

    def output(self) -> str:
        """What this process wrote to its log (not an earlier launch's process of the same name)."""
        with self.log.open("rb") as fh:
            fh.seek(self.log_from)
            return fh.read().decode(errors="replace")

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # pgid == pid: start_new_session=True
        except (ProcessLookupError, PermissionError):
            pass

    def kill_tree(self) -> None:
        """SIGKILL the group, then anything else that still carries this process's tag."""
        self.signal_group(signal.SIGKILL)
        kill_pids(tagged_pids(self.tag, NODE_TAG_VAR))
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Spawner:
    """Starts tagged processes with their logs in ``logs``; :meth:`close` leaves none behind."""

    def __init__(self, tag: str, logs: Path, base_env: Mapping[str, str]) -> None:
        self.tag = tag
        self.logs = Path(logs)
        self.base_env = dict(base_env)
        self.spawned: list[Proc] = []  # every process started (reaped by close)
        self.closed = False
        self.subreaper = LINUX and prctl(PR_SET_CHILD_SUBREAPER, 1)

    def env(self, node_tag: str | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {**os.environ, **self.base_env, TAG_VAR: self.tag}
        env["PATH"] = venv_path(env)
        if node_tag is not None:
            env[NODE_TAG_VAR] = node_tag
        else:
            env.pop(NODE_TAG_VAR, None)
        env.update(extra or {})
        return env

    def spawn(self, name: str, argv: list[str], cwd: Path, env: Mapping[str, str] | None = None,
              preexec: Callable[[], None] | None = None) -> Proc:
        """Start ``argv`` (its own session, parent-death signal, tag ``<tag>-<name>``), output to
        ``logs/<name>.log``; ``env`` is added to the spawner's environment; ``preexec`` runs in
        the child before exec (e.g. join a cgroup and a network namespace)."""
        if self.closed:
            raise DeployError("deployment is closed")
        cwd.mkdir(parents=True, exist_ok=True)
        node_tag = f"{self.tag}-{name}"
        log_path = self.logs / f"{name}.log"
        with log_path.open("ab") as fh:
            log_from = fh.tell()
            popen = subprocess.Popen(
                [find_exe(argv[0]), *argv[1:]], cwd=cwd, env=self.env(node_tag, env),
                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=child_setup(preexec) if LINUX else preexec,
            )
        self.spawned.append(Proc(name, popen, log_path, node_tag, log_from=log_from))
        return self.spawned[-1]

    def _orphans(self) -> dict[int, str]:
        """Helpers re-parented to us (we are their subreaper): our children we did not spawn."""
        own = {p.popen.pid for p in self.spawned}
        return {pid: state for pid, state in children().items() if pid not in own}

    def reap_orphans(self) -> None:
        """Reap our dead children: the processes we spawned (through Popen) and helpers
        re-parented to us."""
        for p in self.spawned:
            p.popen.poll()
        for pid in [pid for pid, state in self._orphans().items() if state == "Z"]:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    def close(self, procs: list[Proc]) -> None:
        """SIGTERM ``procs`` (5 s), SIGKILL their groups, then sweep and reap every tagged
        process (re-parented helpers: flower-superexec, flwr-serverapp/clientapp, workers)."""
        if self.closed:
            return
        self.closed = True
        for p in procs:
            if p.alive:
                try:
                    p.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            p.signal_group(signal.SIGKILL)
        for p in procs:
            try:
                p.popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while True:
            left = tagged_pids(self.tag)
            kill_pids(left)
            self.reap_orphans()  # the killed ones that were re-parented to us
            # (a helper that is dying has no readable environment and is not a zombie yet: wait for it)
            if (not left and not self._orphans() and all(p.popen.returncode is not None for p in self.spawned)
                    or time.monotonic() > deadline):
                break
            time.sleep(0.1)
        if self.subreaper:
            prctl(PR_SET_CHILD_SUBREAPER, 0)

    def leftovers(self) -> list[int]:
        return tagged_pids(self.tag)


_OPEN_SITES: weakref.WeakSet[Any] = weakref.WeakSet()


class SiteLifetime:
    """What every site of ours does with its life: ``with site:`` starts its SuperLink (and closes
    everything if that fails), leaving the block closes it, and so does the interpreter's exit
    (:func:`close_open_sites`). A subclass defines ``start_superlink()`` and an idempotent ``close()``."""

    def start_superlink(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def close_at_exit(self) -> None:
        _OPEN_SITES.add(self)

    def __enter__(self) -> Self:
        try:
            self.start_superlink()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def close_open_sites() -> None:
    for site in list(_OPEN_SITES):
        site.close()
