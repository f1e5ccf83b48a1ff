"""The hosts file of a deployment across machines (``python -m deploy launch --hosts FILE``,
``python -m deploy k8s --hosts FILE``): where the SuperLink listens and, for every other host,
the engine that runs its SuperNodes and the clients it holds. Parsing only: nothing here touches
a host (:mod:`deploy.multihost` does).

.. code-block:: toml

    [superlink]                        # this machine: SuperLink, ServerApp and churn driver
    address = "192.168.1.10"           # the address SuperNodes dial (an IP or DNS name of this host;
                                       # it goes into the server certificate)
    port = 9092                        # optional (default: a free port)
    names = ["link.lab.example"]       # optional: more names / IPs for the certificate

    [defaults]                         # optional: keys every host inherits
    image = "flchurn-supernode:latest"

    [hosts.pi]                         # one table per host, named as you like
    engine = "docker"                  # its Docker engine: containers
    docker = "tcp://192.168.1.20:2376" # tcp:// (mutual TLS, tls-dir) | ssh://user@host | unix:///path
    tls-dir = "~/.docker/pi"           # docker's own layout: ca.pem, cert.pem, key.pem
    clients = [0, 1]                   # the client (partition) ids whose SuperNodes run there

    [hosts.rack]
    engine = "kubernetes"              # Deployments made by `python -m deploy k8s`, scaled 0 <-> 1
    namespace = "flchurn"              # optional; kubeconfig, context: optional
    clients = [4, 5]

    [hosts.lab]
    engine = "process"                 # SuperNode processes started from this machine
    netns = "lab"                      # optional: in this network namespace (test hosts, docs/multihost.md)
    address = "10.88.0.3"              # the host's address as the SuperLink sees it
    clients = [2, 3]

Every client id 0..N-1 is on exactly one host. A mistake raises :class:`HostsError` naming the
key, the host and, for a misspelt key, the closest known one (``deploy launch`` exits 2).
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runconfig.fields import closest

from .errors import DeployError

ENGINES = ("docker", "process", "kubernetes")
DOCKER_SCHEMES = ("tcp", "ssh", "unix")
TLS_FILES = ("ca.pem", "cert.pem", "key.pem")  # docker's --tlsverify layout (DOCKER_CERT_PATH)
SUPERLINK_KEYS = ("address", "port", "names")
HOST_KEYS = ("engine", "clients", "address", "docker", "tls-dir", "image", "netns", "data-dir", "state-dir",
             "k8s-node", "namespace", "kubeconfig", "context")
ENGINE_KEYS = {"docker": ("docker", "tls-dir", "image"), "process": ("netns",),
               "kubernetes": ("namespace", "kubeconfig", "context")}  # the keys only that engine has
TOP_KEYS = ("superlink", "defaults", "hosts")
HOST_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")  # a DNS label: container, k8s names
DEFAULT_IMAGE = "flchurn-supernode:latest"


class HostsError(DeployError):
    """A mistake in the hosts file: names the key and the host."""


@dataclass(frozen=True)
class SuperLinkSpec:
    address: str  # what SuperNodes dial; also in the server certificate
    port: int = 0  # 0: a free port
    names: tuple[str, ...] = ()  # more certificate names / IPs

    @property
    def cert_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((self.address, *self.names)))


@dataclass(frozen=True)
class HostSpec:
    name: str
    engine: str
    clients: tuple[int, ...]
    address: str | None = None  # the host as the SuperLink's machine reaches it (probes)
    docker: str | None = None  # engine "docker": its Engine API
    tls_dir: Path | None = None  # docker over tcp: ca.pem, cert.pem, key.pem
    image: str = DEFAULT_IMAGE  # engine "docker": the SuperNode image
    netns: str | None = None  # engine "process": a network namespace of this machine
    data_dir: str | None = None  # node config data-dir on that host
    state_dir: str | None = None  # node config state-dir on that host
    k8s_node: str | None = None  # `python -m deploy k8s`: the node it is placed on (kubernetes.io/hostname)
    namespace: str = "flchurn"  # engine "kubernetes": where `deploy k8s`'s Deployments are
    kubeconfig: str | None = None  # engine "kubernetes": the cluster's kubeconfig (default: the usual lookup)
    context: str | None = None  # engine "kubernetes": its context

    @property
    def docker_scheme(self) -> str | None:
        return self.docker.split("://", 1)[0] if self.docker else None


@dataclass(frozen=True)
class HostsPlan:
    superlink: SuperLinkSpec
    hosts: tuple[HostSpec, ...]
    source: str = "hosts file"
    host_of_client: dict[int, str] = field(default_factory=dict, compare=False)

    @property
    def num_clients(self) -> int:
        return sum(len(h.clients) for h in self.hosts)

    def host(self, name: str) -> HostSpec:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def host_for(self, client: int) -> HostSpec:
        return self.host(self.host_of_client[client])


def _unknown(keys: Mapping[str, Any], known: tuple[str, ...], where: str) -> None:
    for key in keys:
        if key not in known:
            hint = closest(key, known)
            raise HostsError(f"{where}: unknown key {key!r}" + (f" (did you mean {hint!r}?)" if hint else "")
                             + f"; known: {', '.join(known)}")


def _address(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise HostsError(f"{where}: must be an IP address or a DNS name (a string), not {value!r}")
    value = value.strip()
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", value):
            raise HostsError(f"{where}: {value!r} is neither an IP address nor a DNS name") from None
    return value


def _superlink(doc: Any, source: str, remote: bool) -> SuperLinkSpec:
    if not isinstance(doc, dict):
        raise HostsError(f"{source}: [superlink] is missing (its 'address' is what the SuperNodes dial)")
    _unknown(doc, SUPERLINK_KEYS, f"{source} [superlink]")
    if "address" not in doc:
        raise HostsError(f"{source} [superlink]: 'address' is missing: the address of this machine that the "
                         "SuperNodes dial")
    address = _address(doc["address"], f"{source} [superlink] address")
    if remote and _loopback(address):
        raise HostsError(f"{source} [superlink] address {address!r} is a loopback address: SuperNodes on other "
                         "hosts cannot reach it; give this machine's address on the network they share")
    port = doc.get("port", 0)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise HostsError(f"{source} [superlink] port: must be an integer 0-65535 (0: a free port), not {port!r}")
    names = doc.get("names", [])
    if not isinstance(names, list):
        raise HostsError(f"{source} [superlink] names: must be a list of names / IPs, not {names!r}")
    return SuperLinkSpec(address, port, tuple(_address(n, f"{source} [superlink] names") for n in names))


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _clients(value: Any, where: str) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value)):
        raise HostsError(f"{where}: must be a non-empty list of client ids (integers >= 0), not {value!r}")
    if len(set(value)) != len(value):
        raise HostsError(f"{where}: lists a client twice: {value!r}")
    return tuple(value)


def _host(name: str, raw: Any, defaults: Mapping[str, Any], source: str) -> HostSpec:
    where = f"{source} [hosts.{name}]"
    if not HOST_NAME_RE.match(name):
        raise HostsError(f"{where}: a host's name must be a DNS label (lower-case letters, digits and '-', at most "
                         "63): it names its containers and Kubernetes objects")
    if not isinstance(raw, dict):
        raise HostsError(f"{where}: must be a table of keys, not {raw!r}")
    _unknown(raw, HOST_KEYS, where)
    doc = {**defaults, **raw}
    engine = doc.get("engine")
    if engine not in ENGINES:
        hint = closest(str(engine), ENGINES) if isinstance(engine, str) else None
        raise HostsError(f"{where} engine: {engine!r} is not an engine" + (f" (did you mean {hint!r}?)" if hint else "")
                         + f"; known: {', '.join(ENGINES)}")
    if "clients" not in raw:
        raise HostsError(f"{where}: 'clients' is missing: the client ids whose SuperNodes run on this host")
    clients = _clients(raw["clients"], f"{where} clients")
    for other, keys in ENGINE_KEYS.items():
        for key in keys:
            if other != engine and key in raw and key not in ENGINE_KEYS[str(engine)]:
                raise HostsError(f"{where} {key}: only engine {other!r} has it (this host's engine is {engine!r})")
    strings = {k: doc[k] for k in HOST_KEYS if k not in ("engine", "clients") and k in doc}
    for key, value in strings.items():
        if not isinstance(value, str) or not value:
            raise HostsError(f"{where} {key}: must be a non-empty string, not {value!r}")
    address = _address(strings["address"], f"{where} address") if "address" in strings else None
    docker, tls_dir = strings.get("docker"), strings.get("tls-dir")
    if engine == "docker":
        if docker is None:
            raise HostsError(f"{where}: engine 'docker' needs 'docker', its Engine API: tcp://HOST:2376 (mutual "
                             "TLS, with tls-dir), ssh://USER@HOST or unix:///var/run/docker.sock")
        scheme = docker.split("://", 1)[0] if "://" in docker else ""
        if scheme not in DOCKER_SCHEMES:
            raise HostsError(f"{where} docker: {docker!r} has no known scheme; use one of "
                             + ", ".join(f"{s}://" for s in DOCKER_SCHEMES))
        if scheme == "tcp" and tls_dir is None:
            raise HostsError(f"{where} docker: {docker!r} over tcp:// needs 'tls-dir' ({', '.join(TLS_FILES)}): an "
                             "engine reachable without mutual TLS is root on that host for anyone on the network")
    path = Path(tls_dir).expanduser() if tls_dir else None
    if address is None and docker is not None and docker.startswith(("tcp://", "ssh://")):
        address = docker.split("://", 1)[1].rsplit("@", 1)[-1].split(":")[0].split("/")[0] or None
    return HostSpec(name=name, engine=str(engine), clients=clients, address=address, docker=docker,
                    tls_dir=path, image=strings.get("image", DEFAULT_IMAGE) if engine == "docker" else DEFAULT_IMAGE,
                    netns=strings.get("netns"), data_dir=strings.get("data-dir"), state_dir=strings.get("state-dir"),
                    k8s_node=strings.get("k8s-node"), namespace=strings.get("namespace", "flchurn"),
                    kubeconfig=strings.get("kubeconfig"), context=strings.get("context"))


def parse_hosts(doc: Mapping[str, Any], source: str = "hosts file", num_clients: int | None = None) -> HostsPlan:
    """A :class:`HostsPlan` from a parsed hosts file; ``num_clients``: the run's (``--num-nodes``)."""
    _unknown(doc, TOP_KEYS, source)
    hosts_doc = doc.get("hosts")
    if not isinstance(hosts_doc, dict) or not hosts_doc:
        raise HostsError(f"{source}: no [hosts.NAME] table: name at least one host and its clients")
    defaults = doc.get("defaults", {})
    if not isinstance(defaults, dict):
        raise HostsError(f"{source} [defaults]: must be a table of host keys")
    _unknown(defaults, tuple(k for k in HOST_KEYS if k != "clients"), f"{source} [defaults]")
    hosts = tuple(_host(name, raw, defaults, source) for name, raw in hosts_doc.items())
    owner: dict[int, str] = {}
    for h in hosts:
        for c in h.clients:
            if c in owner:
                raise HostsError(f"{source}: client {c} is on two hosts, [hosts.{owner[c]}] and [hosts.{h.name}]")
            owner[c] = h.name
    n = len(owner)
    missing = sorted(set(range(n)) - set(owner))
    if missing:
        raise HostsError(f"{source}: the clients must be 0..{n - 1}, each on one host; no host has client(s) "
                         f"{missing} (highest listed: {max(owner)})")
    if num_clients is not None and num_clients != n:
        raise HostsError(f"{source}: the hosts hold {n} clients but the run has {num_clients} (--num-nodes / "
                         "num-clients): list every client once")
    remote = any(h.engine == "kubernetes" or h.engine == "docker" and h.docker_scheme != "unix" or h.netns
                 for h in hosts)
    link = _superlink(doc.get("superlink"), source, remote)
    return HostsPlan(link, hosts, source, owner)


def load_hosts(path: str | Path, num_clients: int | None = None) -> HostsPlan:
    """Read and check a hosts file (TOML)."""
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except OSError as err:
        raise HostsError(f"hosts file {p}: cannot be read ({err.strerror or err})") from None
    except tomllib.TOMLDecodeError as err:
        raise HostsError(f"hosts file {p}: not valid TOML ({err})") from None
    return parse_hosts(doc, f"hosts file {p}", num_clients)
