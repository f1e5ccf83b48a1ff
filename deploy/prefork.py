"""Flower's own ``flwr-clientapp`` per message (and ``flower-superexec`` per SuperNode), forked
from a process that has imported them.

Flower's SuperExec starts a ``flwr-clientapp`` process (found on ``PATH``) for every message a
SuperNode receives. Before that process pulls its message it imports Flower's whole SuperNode CLI
(the SQL object store, alembic, FastAPI: 1.5 s on an idle core of this project's machine, 2.6 s in
a deployed round), every message, every round. A deployed round of the README's churn launch
trained for 0.05 s and spent 2.6 s there (docs/deployment.md, "Round latency").

With the launcher's tuning (:mod:`deploy.tuning`), each SuperNode, once it has imported Flower's
entry points and before it starts a thread, forks a *forker* that waits. The SuperExec that the
SuperNode starts (``flower-superexec``, found on ``PATH`` too) imports Flower's CLI as well (2.7 s)
before the node's first message can start: it goes the same way. The SuperNode's ``PATH`` starts
with a folder whose ``flwr-clientapp`` and ``flower-superexec`` are launchers of a few lines of the
standard library (:func:`launcher_dir`): a launcher hands its arguments, working folder, environment
and standard streams to the forker, which forks a child that runs Flower's own entry point of that
command with them, and the launcher exits with the child's exit status. Nothing of the ClientApp's
work changes: the child is a fresh process (its own pid, its own memory), pulls its message with its
own token, installs the FAB, loads the ClientApp and pushes its reply through Flower's code, exactly
as a started ``flwr-clientapp`` does.

- The child forgets this checkout's modules (:func:`forget_our_modules`): the app is loaded from the
  installed FAB, as Flower does. The forker holds no thread, so forking it is safe.
- It exits when its SuperNode process exits (it waits on a pidfd of it) or on SIGTERM; a launcher
  that cannot reach it runs Flower's ``flwr-clientapp`` itself (``os.execv``), so a forker that is
  gone costs the imports, never a message.
- Only processes of the same user reach it (``SO_PEERCRED``; an abstract Unix socket named after
  the SuperNode's pid and start time).
- ``FLCHURN_PREFORK=0`` in the SuperNode's environment turns it off.

Linux only (pidfd, abstract sockets); elsewhere the SuperNode runs Flower's ``flwr-clientapp``.
"""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path

from client_app.pidinfo import start_time
from client_app.worker import FORKED_BY, recv_exactly, same_user

ADDRESS_VAR = "FLCHURN_PREFORK_ADDRESS"  # the launcher's environment: this SuperNode's forker
SWITCH_VAR = "FLCHURN_PREFORK"  # "0": no forker, Flower's flwr-clientapp is started per message
COMMANDS = ("flwr-clientapp", "flower-superexec")  # what a SuperNode starts, each through the forker
PROJECT = Path(__file__).resolve().parent.parent  # this checkout (its modules are never a FAB's)
_HEADER = struct.Struct("!Q")
_STATUS = struct.Struct("!qi")  # (child pid, exit status); status _FORKED = forked, still running
_FORKED = -1000

LAUNCHER = '''#!{python} -S
"""{command} through this SuperNode's forker (deploy/prefork.py); Flower's own if unreachable."""
import json, os, socket, struct, sys
REAL = {real!r}
def flower_own():
    os.execv(REAL, [REAL, *sys.argv[1:]])
address = os.environ.get({address_var!r})
if not address:
    flower_own()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    sock.connect("\\0" + address)
    body = json.dumps({{"command": {command!r}, "argv": sys.argv[1:], "cwd": os.getcwd(),
                       "env": dict(os.environ)}}).encode()
    socket.send_fds(sock, [struct.pack({header!r}, len(body))], [0, 1, 2])
    sock.sendall(body)
    forked = sock.recv({size}, socket.MSG_WAITALL)
except OSError:
    forked = b""
if len(forked) < {size}:
    flower_own()  # not forked: the task is still unclaimed
done = sock.recv({size}, socket.MSG_WAITALL)
sys.exit(struct.unpack({status!r}, done)[1] if len(done) == {size} else 1)
'''


def enabled(env: dict[str, str] | os._Environ) -> bool:
    return sys.platform.startswith("linux") and env.get(SWITCH_VAR, "1") != "0"


def address(supernode: int) -> str:
    """The forker's abstract socket name (without the leading NUL): one per SuperNode process."""
    return f"flchurn-prefork-{supernode}-{start_time(supernode)}"


def launcher_dir(python: str = sys.executable) -> Path:
    """A folder holding a launcher of each of :data:`COMMANDS` for ``python`` (written once, atomically)."""
    texts = {command: LAUNCHER.format(python=python, command=command, real=str(Path(python).parent / command),
                                      address_var=ADDRESS_VAR, header=_HEADER.format, status=_STATUS.format,
                                      size=_STATUS.size)
             for command in COMMANDS}
    key = hashlib.sha1("".join(texts.values()).encode()).hexdigest()[:12]
    folder = Path.home() / ".cache" / "flchurn" / "prefork" / key
    for command, text in texts.items():
        if not (exe := folder / command).is_file():
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{command}.{os.getpid()}"
            tmp.write_text(text)
            tmp.chmod(0o755)
            os.replace(tmp, exe)
    return folder


def start_for_this_process(python: str = sys.executable) -> dict[str, str]:
    """Fork the forker of this process (a SuperNode that has imported Flower and not yet started a
    thread) and return what its environment needs so that its SuperExec's ``flwr-clientapp`` goes
    through the forker ({} when off, or when this process already has a thread: no fork then)."""
    import threading

    if not enabled(os.environ):
        return {}
    if threading.active_count() > 1:
        print("deploy.prefork: this process has threads; each message's flwr-clientapp starts cold",
              file=sys.stderr)
        return {}
    try:
        launchers = launcher_dir(python)
    except OSError as err:  # a read-only home (a container): Flower's commands, started cold
        print(f"deploy.prefork: cannot write the launchers ({err}); each message's flwr-clientapp starts cold",
              file=sys.stderr)
        return {}
    supernode = os.getpid()
    if os.fork() == 0:
        code = 0
        try:
            serve(supernode)
        except (SystemExit, KeyboardInterrupt):  # SIGTERM, Ctrl-C: a clean stop
            pass
        except BaseException:  # noqa: BLE001  (the forker's end; never back into the SuperNode's code)
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    path = os.environ.get("PATH", os.defpath)
    return {"PATH": f"{launchers}{os.pathsep}{path}", ADDRESS_VAR: address(supernode), FORKED_BY: str(supernode)}


# ---------------------------------------------------------------------- the forker
def _request(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _flags, _addr = socket.recv_fds(conn, _HEADER.size, 3)
    if len(header) < _HEADER.size:
        header += recv_exactly(conn, _HEADER.size - len(header))
    return json.loads(recv_exactly(conn, _HEADER.unpack(header)[0])), list(fds)


def _run_child(request: dict, fds: list[int], forker_side: list) -> None:
    """In the forked child: close the forker's side (``forker_side``: its sockets, selector and
    pidfds), become ``COMMAND ARGV`` and run Flower's entry point of it; never returns. Anything
    that fails before Flower's code runs replaces this process by Flower's own ``COMMAND``."""
    code = 1
    try:
        try:
            for held in forker_side:
                held.close() if hasattr(held, "close") else os.close(held)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
                os.close(fd)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())  # a booted SuperNode's blocked release (deploy.boot)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            command = request["command"]  # an unknown one: flower_entry_point names it, then Flower's own
            sys.argv = [command, *request["argv"]]
            if "numpy" in sys.modules:  # a fresh process draws its global numpy state from the OS
                sys.modules["numpy"].random.seed()
            from flowerlink import flower_entry_point

            entry = flower_entry_point(command)
            forget_our_modules()  # the ClientApp imports the app from the installed FAB, not from here
        except BaseException:  # noqa: BLE001  (not forked cleanly: Flower's own process instead)
            traceback.print_exc()
            real = str(Path(sys.executable).parent / request["command"])
            os.execv(real, [real, *request["argv"]])
        try:
            entry()
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001  (the child's last act: report and exit, never return)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def forget_our_modules() -> None:
    """Drop this project's modules (those loaded from its folder, not from an installed package)
    from ``sys.modules``: a forked ``flwr-clientapp`` then imports the app from the FAB Flower
    installed, as a started one does."""
    import sysconfig

    installed = tuple({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib", "stdlib", "platstdlib")})
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None) or ""
        if name != "__main__" and file.startswith(str(PROJECT) + os.sep) and not file.startswith(installed):
            del sys.modules[name]


def serve(supernode: int) -> None:
    """The forker of SuperNode ``supernode`` (forked from it once it has imported Flower's entry
    points of :data:`COMMANDS`): fork one child per launcher, report the child's pid and exit
    status to it, and exit when the SuperNode exits."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address(supernode))
    listener.listen(16)
    node = os.pidfd_open(supernode)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(node, selectors.EVENT_READ, "node")
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, the launcher's connection)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        for key, _ in sel.select():
            if key.data == "node":
                return
            if key.data == "accept":
                conn, _ = listener.accept()
                try:
                    if not same_user(conn):
                        conn.close()
                        continue
                    conn.settimeout(30.0)
                    request, fds = _request(conn)
                except (OSError, EOFError, ValueError):
                    conn.close()
                    continue
                forker_side = [sel, listener, node, conn, *children, *(c for _, c in children.values())]
                pid = os.fork()
                if pid == 0:
                    _run_child(request, fds, forker_side)
                for fd in fds:
                    os.close(fd)
                child = os.pidfd_open(pid)
                children[child] = (pid, conn)
                sel.register(child, selectors.EVENT_READ, "child")
                try:
                    conn.sendall(_STATUS.pack(pid, _FORKED))
                except OSError:
                    pass
            else:  # a child exited
                pid, conn = children.pop(key.fd)
                sel.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    conn.sendall(_STATUS.pack(pid, os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


