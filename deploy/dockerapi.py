"""The one Docker Engine API client of the project: HTTP/1.1 to an engine at ``unix:///path``,
``tcp://HOST:PORT`` (mutual TLS, docker's ``--tlsverify`` layout: ``ca.pem``, ``cert.pem``,
``key.pem``) or ``ssh://[USER@]HOST[:PORT]`` (the API tunnelled through ``ssh HOST docker system
dial-stdio``, as the docker CLI does). No docker CLI or SDK on this side; nothing but the
standard library.

Used by :class:`deploy.containers.DockerNodes` (the compose stack's local socket) and
:class:`deploy.dockerengine.DockerEngine` (one host's engine of a multi-host deployment). Every
request has a timeout; an engine that cannot be reached (refused, no route, timed out, TLS
refused, ssh failed) raises :class:`EngineUnreachable` with the reason in one line. An engine that
answers with an error status is not unreachable: :meth:`DockerAPI.request` returns the status.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import ssl
import subprocess
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import DeployError

TLS_FILES = ("ca.pem", "cert.pem", "key.pem")
DEFAULT_TIMEOUT = 10.0  # seconds, any request that does not say otherwise
SSH_REMOTE = ("docker", "system", "dial-stdio")  # what the docker CLI runs on an ssh:// host


class EngineUnreachable(DeployError):
    """The engine did not answer: ``why`` is one line (refused, timed out, TLS, ssh ...)."""

    def __init__(self, url: str, why: str) -> None:
        super().__init__(f"Docker engine {url}: {why}")
        self.url = url
        self.why = why


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


class _SshConnection(http.client.HTTPConnection):
    """HTTP over ``ssh HOST docker system dial-stdio``: one end of a socket pair is the ssh
    process's stdin and stdout, the other is this connection's socket (timeouts work as on a
    real socket)."""

    def __init__(self, argv: list[str], timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.argv = argv
        self.proc: subprocess.Popen[bytes] | None = None
        self.said = ""  # ssh's last words when it exited non-zero

    def connect(self) -> None:
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(self.argv, stdin=theirs.fileno(), stdout=theirs.fileno(), stderr=subprocess.PIPE,
                                         start_new_session=True)
        except OSError as err:
            mine.close()
            raise EngineUnreachable(" ".join(self.argv[:1]), f"cannot run ssh ({err})") from None
        finally:
            theirs.close()
        mine.settimeout(self.timeout)
        self.sock = mine

    def ssh_error(self) -> str:
        """What ssh said when it exited on its own (after the connection closed), one line."""
        self.close()
        return self.said

    def close(self) -> None:
        super().close()
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            proc.wait(timeout=0.5)  # ssh that failed has exited already
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stderr:
                proc.stderr.close()
            return
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        if proc.stderr:
            proc.stderr.close()
        lines = [line.strip() for line in err.splitlines() if line.strip()]
        if proc.returncode:
            self.said = f"ssh exited {proc.returncode}" + (f": {lines[-1]}" if lines else "")


def tls_context(tls_dir: Path | str) -> ssl.SSLContext:
    """The client side of docker's ``--tlsverify``: the engine's certificate checked against
    ``ca.pem`` (and its name or IP against the address dialled), ours from ``cert.pem`` / ``key.pem``."""
    d = Path(tls_dir).expanduser()
    missing = [f for f in TLS_FILES if not (d / f).is_file()]
    if missing:
        raise DeployError(f"TLS directory {d}: missing {', '.join(missing)} (docker's layout: {', '.join(TLS_FILES)})")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(d / "ca.pem"))
    ctx.load_cert_chain(str(d / "cert.pem"), str(d / "key.pem"))
    return ctx


SSH_CONFIG_VAR = "FLCHURN_SSH_CONFIG"  # an ssh_config file for ssh:// engines (else ~/.ssh/config)


def ssh_argv(url: str, timeout: float, control_dir: str | None = None) -> list[str]:
    """``ssh`` arguments that run ``docker system dial-stdio`` on the host of ``ssh://[USER@]HOST[:PORT]``
    (key-based, never a password prompt; one master connection per host when ``control_dir``;
    ``$FLCHURN_SSH_CONFIG``: the ssh_config file to use)."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise DeployError(f"Docker engine {url}: no host in the ssh:// address (ssh://USER@HOST[:PORT])")
    argv = ["ssh"]
    if os.environ.get(SSH_CONFIG_VAR):
        argv += ["-F", os.environ[SSH_CONFIG_VAR]]
    argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(timeout))}",
             "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2"]
    if control_dir:
        argv += ["-o", "ControlMaster=auto", "-o", f"ControlPath={control_dir}/%C", "-o", "ControlPersist=60"]
    if parts.port:
        argv += ["-p", str(parts.port)]
    if parts.username:
        argv += ["-l", parts.username]
    return [*argv, "--", parts.hostname, *SSH_REMOTE]


class DockerAPI:
    """A Docker Engine API at ``url`` (``unix://``, ``tcp://`` + ``tls_dir``, ``ssh://``)."""

    def __init__(self, url: str = "unix:///var/run/docker.sock", tls_dir: Path | str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, ssh_control_dir: str | None = None) -> None:
        self.url = url
        self.timeout = timeout
        scheme, _, rest = url.partition("://")
        self.scheme = scheme
        if scheme == "unix":
            if not rest.startswith("/"):
                raise DeployError(f"Docker engine {url}: unix:// needs an absolute socket path")
            self.socket_path = rest
        elif scheme == "tcp":
            if tls_dir is None:
                raise DeployError(f"Docker engine {url}: tcp:// needs a TLS directory (mutual TLS; an engine "
                                  "open on the network without it is root on that host for anyone)")
            parts = urllib.parse.urlsplit(url)
            if not parts.hostname:
                raise DeployError(f"Docker engine {url}: no host in the tcp:// address")
            self.address = (parts.hostname, parts.port or 2376)
            self.context = tls_context(tls_dir)
        elif scheme == "ssh":
            self.ssh_control_dir = ssh_control_dir
            ssh_argv(url, timeout, ssh_control_dir)  # checks the address now
        else:
            raise DeployError(f"Docker engine {url}: unknown scheme {scheme!r} (unix://, tcp://, ssh://)")

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.scheme == "unix":
            return _UnixConnection(self.socket_path, timeout)
        if self.scheme == "tcp":
            host, port = self.address
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self.context)
        return _SshConnection(ssh_argv(self.url, timeout, self.ssh_control_dir), timeout)

    def request(self, method: str, path: str, body: bytes | None = None, *, timeout: float | None = None,
                headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """``method path`` on the engine; (status, body). :class:`EngineUnreachable` when it does
        not answer within ``timeout`` (default the client's)."""
        t = self.timeout if timeout is None else timeout
        conn = self._connection(t)
        try:
            conn.request(method, path, body=body, headers=dict(headers or {}))
            res = conn.getresponse()
            return res.status, res.read()
        except (OSError, http.client.HTTPException) as err:
            why = _why(err, t)
            if isinstance(conn, _SshConnection) and (said := conn.ssh_error()):
                why = f"{why} ({said})"
            raise EngineUnreachable(self.url, f"{method} {path.split('?')[0]}: {why}") from None
        finally:
            conn.close()

    def json(self, method: str, path: str, payload: Any = None, *, timeout: float | None = None,
             ok: tuple[int, ...] = (200, 201, 204, 304)) -> Any:
        """A request with a JSON body (if any) whose JSON answer is returned; any other status
        than ``ok`` raises :class:`DockerError` with the engine's message."""
        body = None if payload is None else json.dumps(payload).encode()
        status, data = self.request(method, path, body, timeout=timeout,
                                    headers={"Content-Type": "application/json"} if body is not None else None)
        if status not in ok:
            raise DockerError(self.url, method, path, status, data)
        return json.loads(data) if data.strip() else None

    def close(self) -> None:
        """An ssh:// engine: end its master connection (the others hold nothing between requests)."""
        if self.scheme == "ssh" and self.ssh_control_dir:
            argv = ssh_argv(self.url, 5, self.ssh_control_dir)
            subprocess.run([*argv[:argv.index("--")], "-O", "exit", "--", argv[argv.index("--") + 1]],
                           capture_output=True, timeout=15, check=False, stdin=subprocess.DEVNULL)

    def ping(self, timeout: float = 2.0) -> str | None:
        """None when ``GET /_ping`` answers OK within ``timeout``, else why not (one line)."""
        try:
            status, body = self.request("GET", "/_ping", timeout=timeout)
        except EngineUnreachable as err:
            return err.why
        return None if status == 200 else f"GET /_ping answered {status} {body[:100]!r}"


class DockerError(DeployError):
    """The engine answered an operation with an error status (its message included)."""

    def __init__(self, url: str, method: str, path: str, status: int, body: bytes) -> None:
        try:
            message = json.loads(body).get("message", "")
        except (ValueError, AttributeError):
            message = body[:200].decode(errors="replace")
        super().__init__(f"Docker engine {url}: {method} {path.split('?')[0]} -> {status}: {message}")
        self.status = status
        self.message = message


def _why(err: BaseException, timeout: float) -> str:
    if isinstance(err, TimeoutError | socket.timeout):
        return f"no answer within {timeout:g} s"
    if isinstance(err, ssl.SSLError):
        return f"TLS failed ({err.reason or err})"
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, FileNotFoundError):
        return f"no socket ({err.filename or err})"
    if isinstance(err, OSError) and err.strerror:
        return err.strerror.lower()
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def demux_logs(data: bytes) -> str:
    """The text of ``GET /containers/ID/logs`` of a container without a TTY: frames of an 8-byte
    header (stream, 3 zero bytes, big-endian length) and a payload; raw text otherwise."""
    out: list[bytes] = []
    i = 0
    while i + 8 <= len(data) and data[i] in (0, 1, 2) and data[i + 1:i + 4] == b"\0\0\0":
        n = int.from_bytes(data[i + 4:i + 8], "big")
        out.append(data[i + 8:i + 8 + n])
        i += 8 + n
    if i < len(data):
        out.append(data[i:])
    return b"".join(out).decode(errors="replace")

