"""One host's Docker engine as a :class:`deploy.hostengine.HostEngine`: client ``i``'s SuperNode is
a container on the engine the hosts file names (``docker = "tcp://..."`` with mutual TLS,
``ssh://user@host`` or ``unix:///path``), driven through that engine's own API
(:class:`deploy.dockerapi.DockerAPI`), never through a protocol of ours.

A node's container (name ``launch.name``, image ``host.image``) runs Flower's SuperNode as the
compose TLS profile does (``python -m deploy.tuning supernode --root-certificates /certs/ca.crt
--auth-supernode-private-key /keys/node ...``), with

- ``init: true``: SIGTERM reaches the SuperNode (docker-init is PID 1 and forwards it), so
  ``docker stop`` is a clean exit (0) and ``docker kill`` a crash (137);
- the CA certificate and the node's private key copied into the container before its first start
  (``PUT /containers/ID/archive``, owned by the image's user): nothing of the deployment needs to
  exist on the host's disk, and no key travels in an environment variable or a command line;
- the host's network (``network_mode: host``): the SuperNode dials the SuperLink's address as the
  host routes it, and its runtime API (``--host 0.0.0.0 --port launch.runtime_port``) is on the
  host's own address for probes, so two clients on one host need two ports (checked);
- labels ``flchurn.deployment=<tag>``, ``flchurn.host``, ``flchurn.client`` and ``flchurn.launch``
  (a digest of what it was created with: a changed launch recreates it), by which :meth:`close`
  removes every container this deployment made on the engine.

Every call is bounded by a timeout; an engine that does not answer raises
:class:`deploy.hostengine.HostUnreachable` (``host h unreachable: why``). Times come from the
engine (``State.StartedAt``; the logs of the current start are read from it): nothing here
compares this machine's clock with the host's.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import shutil
import signal as signals
import tarfile
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .dockerapi import DockerAPI, DockerError, EngineUnreachable, demux_logs
from .errors import DeployError
from .flwr_cli import toml_value
from .hostengine import HostUnreachable, NodeLaunch
from .hosts import HostSpec
from .tuning import ENV as TUNING_ENV

LABEL = "flchurn.deployment"
CA_PATH, KEY_PATH = "/certs/ca.crt", "/keys/node"
ZERO_TIME = "0001-01-01T00:00:00Z"  # Docker's "never" (a created container's StartedAt)
STATES = {"running": "running", "paused": "running", "restarting": "running", "created": "created",
          "exited": "exited", "dead": "exited", "removing": "exited"}
_TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def supernode_command(launch: NodeLaunch) -> list[str]:
    """The container's command: Flower's SuperNode (with the latency settings of deploy.tuning)
    under TLS and node authentication, its runtime API open on the host's address."""
    config = " ".join(f"{k}={toml_value(v)}" for k, v in launch.node_config.items())
    return ["python", "-m", "deploy.tuning", "supernode", "--root-certificates", CA_PATH,
            "--superlink", launch.superlink, "--auth-supernode-private-key", KEY_PATH,
            "--host", "0.0.0.0", "--port", str(launch.runtime_port), "--node-config", config]


def secrets_tar(launch: NodeLaunch, uid: int = 0, gid: int = 0) -> bytes:
    """The tar extracted at ``/`` of a new container: the CA (0444) and the node key (0400),
    owned by ``uid:gid`` (the image's user: the SuperNode must read its key)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data, mode in ((CA_PATH, launch.ca_cert, 0o444), (KEY_PATH, launch.private_key, 0o400)):
            d = tarfile.TarInfo(path.rsplit("/", 1)[0].lstrip("/"))
            d.type, d.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(d)
            f = tarfile.TarInfo(path.lstrip("/"))
            f.size, f.mode, f.uid, f.gid = len(data), mode, uid, gid
            tar.addfile(f, io.BytesIO(data))
    return buf.getvalue()


def user_ids(user: str, passwd: str) -> tuple[int, int]:
    """``uid:gid`` of an image's ``User`` (``name``, ``uid``, ``name:group`` or ``uid:gid``) from the
    image's ``/etc/passwd`` text; root when it is empty."""
    name, _, group = (user or "").partition(":")
    if not name:
        return 0, 0
    entries = {f[0]: f for f in (line.split(":") for line in passwd.splitlines()) if len(f) >= 4}
    by_uid = {f[2]: f for f in entries.values()}
    entry = entries.get(name) or by_uid.get(name)
    if entry is None and not name.isdigit():
        raise DeployError(f"the image's user {name!r} is not in its /etc/passwd")
    uid = int(entry[2]) if entry else int(name)
    gid = int(group) if group.isdigit() else int(entry[3]) if entry else uid
    return uid, gid


def engine_seconds(stamp: str) -> str:
    """A Docker RFC 3339 time as the API's ``since`` wants it: ``SECONDS.NANOSECONDS`` (exact)."""
    import datetime as dt

    m = _TS.match(stamp)
    if not m:
        raise DeployError(f"Docker engine time {stamp!r} is not RFC 3339")
    tz = dt.UTC if m[3] == "Z" else dt.datetime.strptime(m[3].replace(":", ""), "%z").tzinfo
    secs = int(dt.datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=tz).timestamp())
    return f"{secs}.{(m[2] or '0')[:9].ljust(9, '0')}"


class DockerEngine:
    """The SuperNodes of one ``engine = "docker"`` host (see the module)."""

    def __init__(self, host: HostSpec, tag: str, log: Callable[[str], None] | None = None,
                 timeout: float = 10.0) -> None:
        if host.engine != "docker" or not host.docker:
            raise DeployError(f"host {host.name}: DockerEngine needs engine 'docker' and its 'docker' address")
        self.host = host
        self.tag = tag
        self.log = log or print
        self.timeout = timeout
        # ssh://: one master connection to the host, reused by every request (ssh's ControlMaster)
        self.ssh_dir = tempfile.mkdtemp(prefix="flchurn-ssh-") if host.docker_scheme == "ssh" else None
        self.api = DockerAPI(host.docker, host.tls_dir, timeout=timeout, ssh_control_dir=self.ssh_dir)
        self.names: dict[int, str] = {}  # client -> container name (those started by this engine)
        self.ports: dict[int, int] = {}  # client -> runtime port on the host
        self.term_sent: set[int] = set()  # SIGTERM sent by signal(), not yet stopped
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ plumbing
    @contextmanager
    def _engine(self) -> Iterator[None]:
        try:
            yield
        except EngineUnreachable as err:
            raise HostUnreachable(self.host.name, f"its Docker engine {self.host.docker}: {err.why}") from None

    def _call(self, method: str, path: str, payload: Any = None, *, timeout: float | None = None,
              ok: tuple[int, ...] = (200, 201, 204, 304)) -> Any:
        with self._engine():
            return self.api.json(method, path, payload, timeout=timeout, ok=ok)

    def _filters(self, **labels: str | int) -> str:
        wanted = [f"{LABEL}={self.tag}", f"flchurn.host={self.host.name}"]
        wanted += [f"flchurn.{k}={v}" for k, v in labels.items()]
        return urllib.parse.quote(json.dumps({"label": wanted}))

    def _containers(self, all_: bool = True, **labels: str | int) -> list[dict[str, Any]]:
        return self._call("GET", f"/containers/json?all={int(all_)}&filters={self._filters(**labels)}") or []

    def _name(self, client: int) -> str | None:
        """The container of ``client``: this engine's, else the deployment's on the engine."""
        if client in self.names:
            return self.names[client]
        found = self._containers(client=client)
        return found[0]["Names"][0].lstrip("/") if found else None

    def _inspect(self, client: int) -> dict[str, Any] | None:
        name = self._name(client)
        return None if name is None else self._container_json(name)

    def _container_json(self, name: str) -> dict[str, Any] | None:
        """The engine's inspect of container ``name``; None when it has none of that name."""
        with self._engine():
            status, body = self.api.request("GET", f"/containers/{name}/json")
        if status == 404:
            return None
        if status != 200:
            raise DockerError(self.api.url, "GET", f"/containers/{name}/json", status, body)
        return json.loads(body)

    def _where(self) -> str:
        return f"host {self.host.name} ({self.host.docker})"

    # ------------------------------------------------------------------ HostEngine
    def reachable(self, timeout: float = 2.0) -> str | None:
        return self.api.ping(timeout)

    def image_present(self) -> bool:
        """Whether the host's engine has ``host.image`` (``docker/push-images.sh`` sends it)."""
        with self._engine():
            status, _ = self.api.request("GET", f"/images/{urllib.parse.quote(self.host.image, safe='')}/json")
        return status == 200

    def start(self, launch: NodeLaunch) -> None:
        with self._lock:
            i = launch.client
            clash = [c for c, p in self.ports.items() if p == launch.runtime_port and c != i]
            if clash:
                raise DeployError(f"{self._where()}: clients {clash[0]} and {i} both want runtime port "
                                  f"{launch.runtime_port} (containers share the host's network)")
            self.ports[i] = launch.runtime_port
            spec = self._spec(launch)
            digest = spec["Labels"]["flchurn.launch"]
            info = self._existing(launch.name, digest)
            if info is not None and info["State"]["Running"]:
                self.names[i] = launch.name
                return
            if info is None:
                self._create(launch, spec)
            self.names[i] = launch.name
            self.term_sent.discard(i)
            t0 = time.monotonic()
            self._call("POST", f"/containers/{launch.name}/start", timeout=self.timeout + 20)
            self.log(f"{self._where()}: client {i} started ({launch.name}, {time.monotonic() - t0:.2f} s)")

    def _spec(self, launch: NodeLaunch) -> dict[str, Any]:
        env = {**TUNING_ENV, **launch.env}
        spec: dict[str, Any] = {
            "Image": self.host.image, "Cmd": supernode_command(launch),
            "Env": [f"{k}={v}" for k, v in sorted(env.items())], "Tty": False, "StopSignal": "SIGTERM",
            "Labels": {LABEL: self.tag, "flchurn.host": self.host.name, "flchurn.client": str(launch.client)},
            "HostConfig": {"Init": True, "NetworkMode": "host", "RestartPolicy": {"Name": "no"},
                           "LogConfig": {"Type": "json-file", "Config": {"max-size": "20m", "max-file": "2"}}},
        }
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode() + launch.ca_cert + launch.private_key)
        spec["Labels"]["flchurn.launch"] = digest.hexdigest()[:16]
        return spec

    def _existing(self, name: str, digest: str) -> dict[str, Any] | None:
        """The container ``name`` if it is this launch's; one of an older launch is removed; one
        this deployment did not make is an error (never removed)."""
        info = self._container_json(name)
        if info is None:
            return None
        labels = info["Config"].get("Labels") or {}
        if labels.get(LABEL) != self.tag:
            raise DeployError(f"{self._where()}: a container named {name} exists that deployment {self.tag} "
                              f"did not make (label {LABEL}={labels.get(LABEL)!r}): remove it or use another tag")
        if labels.get("flchurn.launch") == digest:
            return info
        self.log(f"{self._where()}: {name} was created for another launch: recreated")
        self._call("DELETE", f"/containers/{name}?force=1&v=1", ok=(204, 404))
        return None

    def _create(self, launch: NodeLaunch, spec: dict[str, Any]) -> None:
        name = urllib.parse.quote(launch.name)
        with self._engine():
            status, body = self.api.request("POST", f"/containers/create?name={name}", json.dumps(spec).encode(),
                                            headers={"Content-Type": "application/json"}, timeout=self.timeout + 20)
        if status == 404:
            raise DeployError(f"{self._where()}: image {self.host.image} is not on its engine (send it: "
                              f"docker/push-images.sh {self.host.image} {self.host.docker}; docs/multihost.md)")
        if status != 201:
            raise DockerError(self.api.url, "POST", "/containers/create", status, body)
        uid, gid = self._image_user(name)
        with self._engine():
            status, body = self.api.request("PUT", f"/containers/{name}/archive?path=/",
                                            secrets_tar(launch, uid, gid), headers={"Content-Type": "application/x-tar"})
        if status != 200:
            self._call("DELETE", f"/containers/{name}?force=1", ok=(204, 404))
            raise DockerError(self.api.url, "PUT", f"/containers/{name}/archive", status, body)

    def _image_user(self, name: str) -> tuple[int, int]:
        """The numeric user of container ``name`` (its ``User``, looked up in its own /etc/passwd:
        ``copyUIDGID`` would look a name up on the engine's host, dockerd 20.10)."""
        user = (self._call("GET", f"/containers/{name}/json")["Config"].get("User") or "")
        if not user or user.replace(":", "").isdigit():
            return user_ids(user, "")
        with self._engine():
            status, body = self.api.request("GET", f"/containers/{name}/archive?path=/etc/passwd")
        passwd = ""
        if status == 200:
            with tarfile.open(fileobj=io.BytesIO(body)) as tar:
                member = tar.extractfile("passwd")
                passwd = member.read().decode(errors="replace") if member else ""
        return user_ids(user, passwd)

    def signal(self, client: int, sig: int) -> None:
        name = self._name(client)
        if name is None:
            return
        sig_name = signals.Signals(sig).name
        self._call("POST", f"/containers/{name}/kill?signal={sig_name}", ok=(204, 304, 409))
        if sig == signals.SIGTERM:
            self.term_sent.add(client)

    def _exit_code(self, client: int, deadline: float) -> int | None:
        """Wait (until the monotonic ``deadline``) for the container to be down; its exit code,
        or None if it is still running then."""
        while True:
            info = self._inspect(client)
            if info is None:
                return None
            if not info["State"]["Running"]:
                return int(info["State"]["ExitCode"])
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def stop(self, client: int, grace: float) -> int | None:
        info = self._inspect(client)
        if info is None or not info["State"]["Running"]:
            signalled = client in self.term_sent
            self.term_sent.discard(client)
            # signal() sent SIGTERM and it is already down: that exit is this stop's
            return int(info["State"]["ExitCode"]) if info is not None and signalled else None
        name = info["Name"].lstrip("/")
        t0 = time.monotonic()
        if client in self.term_sent:
            # SIGTERM already went (signal(): every leaving node at once); a second one would land
            # after Flower restored the default handler and kill it mid-exit (143): wait, then SIGKILL
            self.term_sent.discard(client)
            code = self._exit_code(client, t0 + grace)
            if code is not None:
                self.log(f"{self._where()}: client {client} stopped ({time.monotonic() - t0:.2f} s, exit {code})")
                return code
            self._call("POST", f"/containers/{name}/kill?signal=SIGKILL", ok=(204, 304, 409))
        else:
            self._call("POST", f"/containers/{name}/stop?t={math.ceil(grace)}", ok=(204, 304),
                       timeout=grace + self.timeout + 20)
        code = self._exit_code(client, time.monotonic() + self.timeout)
        self.log(f"{self._where()}: client {client} stopped ({time.monotonic() - t0:.2f} s, exit {code})")
        return code

    def kill(self, client: int) -> int | None:
        info = self._inspect(client)
        if info is None or not info["State"]["Running"]:
            return None
        t0 = time.monotonic()
        self.term_sent.discard(client)
        self._call("POST", f"/containers/{info['Name'].lstrip('/')}/kill?signal=SIGKILL", ok=(204, 304, 409))
        code = self._exit_code(client, time.monotonic() + self.timeout)
        self.log(f"{self._where()}: client {client} killed ({time.monotonic() - t0:.2f} s, exit {code})")
        return code

    def running(self) -> set[int]:
        return {int(c["Labels"]["flchurn.client"]) for c in self._containers(all_=False)}

    def state(self, client: int) -> str:
        info = self._inspect(client)
        return "absent" if info is None else STATES.get(info["State"]["Status"], info["State"]["Status"])

    def started_at(self, client: int) -> str | None:
        info = self._inspect(client)
        stamp = info["State"]["StartedAt"] if info else None
        return None if not stamp or stamp == ZERO_TIME else stamp

    def exit_code(self, client: int) -> int | None:
        """The last exit code the engine recorded (None while running or never started)."""
        info = self._inspect(client)
        if info is None or info["State"]["Running"] or info["State"]["FinishedAt"] == ZERO_TIME:
            return None
        return int(info["State"]["ExitCode"])

    def logs(self, client: int) -> str:
        info = self._inspect(client)
        if info is None:
            return ""
        st = info["State"]
        since = "0"
        if st["StartedAt"] != ZERO_TIME and st["FinishedAt"] != ZERO_TIME:
            # an earlier start ended at FinishedAt (still shown while the new one runs): what came after it
            since = engine_seconds(st["FinishedAt"]) if st["Running"] else engine_seconds(st["StartedAt"])
        with self._engine():
            status, body = self.api.request(
                "GET", f"/containers/{info['Id']}/logs?stdout=1&stderr=1&since={since}", timeout=self.timeout + 10)
        if status != 200:
            raise DockerError(self.api.url, "GET", "/containers/ID/logs", status, body)
        return demux_logs(body)

    def close(self, grace: float = 10.0) -> None:
        """Stop the running ones (SIGTERM, SIGKILL after ``grace``: all at once), then remove every
        container of the deployment on this host. A clean stop matters under authentication: a
        node removed by force (SIGKILL) stays online at the SuperLink until its heartbeat expires
        (~60 s), and its key cannot activate a node again until then (Flower's code 2004)."""
        with self._lock:
            found = self._containers()
            stops = [threading.Thread(target=self._call, args=("POST", f"/containers/{c['Id']}/stop?t={math.ceil(grace)}"),
                                      kwargs={"ok": (204, 304, 404), "timeout": grace + self.timeout + 20}, daemon=True)
                     for c in found if c.get("State") == "running"]
            for t in stops:
                t.start()
            for t in stops:
                t.join(grace + self.timeout + 30)
            removed = 0
            for c in found:
                self._call("DELETE", f"/containers/{c['Id']}?force=1&v=1", ok=(204, 404), timeout=self.timeout + 20)
                removed += 1
            self.names.clear()
            self.ports.clear()
            self.term_sent.clear()
            if removed:
                self.log(f"{self._where()}: removed {removed} container(s) of deployment {self.tag}")
            self.api.close()
            if self.ssh_dir:
                shutil.rmtree(self.ssh_dir, ignore_errors=True)
