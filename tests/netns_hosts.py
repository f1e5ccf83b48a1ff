"""Test hosts with real Docker engines on this machine (root): the namespace hosts of
``tests/multihost_hosts.py`` (network namespaces on a bridge of a private /24), each running its own
``dockerd`` (own data root, exec root, pidfile, cgroup parent,
a unix socket and ``tcp://ADDR:2376`` with mutual TLS from certificates made here).

``DockerHosts(["h1", "h2"])`` as a context manager makes them; its exit (a finalizer that runs on
failure too) stops every engine and removes every namespace, interface, cgroup, socket and
(unless kept: ``FLCHURN_DOCKER_DATA``) data root; :meth:`DockerHosts.leftovers` lists whatever
remains (namespaces, links, engine processes, cgroups, iptables rules naming the subnet).

The engines use the host network only (``--bridge none --iptables=false``): the SuperNode
containers share their namespace's address, and no iptables rule is ever written outside a
namespace. ``dockerd`` is started with ``nsenter --net=`` (``ip netns exec`` remounts /sys and
dockerd then fails with "Devices cgroup isn't mounted").
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from deploy.dockerapi import DockerAPI
from tests.multihost_hosts import NamespaceHosts

PREFIX = "flcd"  # every engine folder (/run/flcd) and cgroup parent made here starts with it
CGROUP_ROOT = Path("/sys/fs/cgroup")


def sh(*argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()[-500:]}")
    return res


# ---------------------------------------------------------------------- certificates (docker's layout)
def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(subject: str, key, issuer_name: x509.Name | None, issuer_key, *, ca: bool = False,
          ips: tuple[str, ...] = (), client: bool = False) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = dt.datetime.now(dt.UTC)
    b = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer_name or name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ips:
        b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(a)) for a in ips]),
                            critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def engine_certs(folder: Path, addresses: dict[str, str]) -> None:
    """``folder/ca.pem``; per host ``folder/<name>/server-{cert,key}.pem`` (SAN its address);
    the client's ``folder/client/{ca,cert,key}.pem`` (what a hosts file's ``tls-dir`` names)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca = _cert("flchurn-test-engines-ca", ca_key, None, ca_key, ca=True)
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    (folder / "ca.pem").write_bytes(ca_pem)
    for name, address in addresses.items():
        k = _key()
        d = folder / name
        d.mkdir(exist_ok=True)
        (d / "server-cert.pem").write_bytes(_cert(name, k, ca.subject, ca_key, ips=(address,))
                                            .public_bytes(serialization.Encoding.PEM))
        (d / "server-key.pem").write_bytes(_pem_key(k))
        os.chmod(d / "server-key.pem", 0o600)
    k = _key()
    c = folder / "client"
    c.mkdir(exist_ok=True)
    (c / "ca.pem").write_bytes(ca_pem)
    (c / "cert.pem").write_bytes(_cert("flchurn-driver", k, ca.subject, ca_key, client=True)
                                 .public_bytes(serialization.Encoding.PEM))
    (c / "key.pem").write_bytes(_pem_key(k))
    os.chmod(c / "key.pem", 0o600)


# ---------------------------------------------------------------------- hosts
@dataclass
class DockerHost:
    name: str
    ns: str  # network namespace
    veth: str  # its interface on the bridge (this machine's end): down = the host is cut off
    address: str
    run_dir: Path  # sockets, pidfile, exec root
    data_root: Path
    tls_dir: Path  # the driver's client certificates (ca.pem, cert.pem, key.pem)
    proc: subprocess.Popen | None = None

    @property
    def socket(self) -> str:
        return f"unix://{self.run_dir}/docker.sock"

    @property
    def tcp(self) -> str:
        return f"tcp://{self.address}:2376"

    @property
    def cgroup_parent(self) -> str:
        return f"{PREFIX}-{self.name}"


class DockerHosts:
    """Namespaced Docker engines ``names`` (host ``j`` of a :class:`NamespaceHosts`), this machine at
    ``bridge_ip`` on their bridge."""

    def __init__(self, names: list[str], log=print, registry_port: int | None = None) -> None:
        self.net = NamespaceHosts(len(names))
        self.subnet = self.net.superlink_address.rsplit(".", 1)[0]
        self.bridge_ip = self.net.superlink_address
        self.log = log
        self.work = Path(tempfile.mkdtemp(prefix="flchurn-dockerhosts-"))
        keep = os.environ.get("FLCHURN_DOCKER_DATA")  # keep the engines' images between runs
        self.data_base = Path(keep) if keep else self.work / "data"
        self.keep_data = bool(keep)
        self.insecure_registry = f"{self.bridge_ip}:{registry_port}" if registry_port else None
        self.hosts = {n: DockerHost(n, self.net.ns(j), self.net.link(j), self.net.address(j),
                                    Path(f"/run/{PREFIX}/{n}"), self.data_base / n, self.work / "tls" / "client")
                      for j, n in enumerate(names)}
        self.made = False

    # -- make
    def __enter__(self) -> DockerHosts:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> None:
        engine_certs(self.work / "tls", {n: h.address for n, h in self.hosts.items()})
        self.made = True
        self.net.create()
        for h in self.hosts.values():
            self._start_engine(h)
        for h in self.hosts.values():
            self._wait_engine(h)

    def _start_engine(self, h: DockerHost) -> None:
        h.run_dir.mkdir(parents=True, exist_ok=True)
        h.data_root.mkdir(parents=True, exist_ok=True)
        srv = self.work / "tls" / h.name
        argv = ["nsenter", f"--net=/var/run/netns/{h.ns}", "dockerd", "--data-root", str(h.data_root),
                "--exec-root", str(h.run_dir / "exec"), "--pidfile", str(h.run_dir / "dockerd.pid"),
                "-H", h.socket, "-H", h.tcp, "--tlsverify", "--tlscacert", str(self.work / "tls" / "ca.pem"),
                "--tlscert", str(srv / "server-cert.pem"), "--tlskey", str(srv / "server-key.pem"),
                "--bridge", "none", "--iptables=false", "--ip-forward=false", "--ip-masq=false",
                "--cgroup-parent", h.cgroup_parent, "--shutdown-timeout", "5"]
        if self.insecure_registry:
            argv += ["--insecure-registry", self.insecure_registry]
        log = open(self.work / f"dockerd-{h.name}.log", "wb")  # noqa: SIM115 (the engine's life)
        h.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def _wait_engine(self, h: DockerHost, timeout: float = 120) -> None:
        api = DockerAPI(h.socket, timeout=5)
        deadline = time.monotonic() + timeout
        while (why := api.ping(5)) is not None:
            if h.proc is not None and h.proc.poll() is not None:
                raise RuntimeError(f"dockerd of {h.name} exited {h.proc.returncode}: "
                                   f"{(self.work / f'dockerd-{h.name}.log').read_text()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"dockerd of {h.name} did not answer in {timeout:.0f} s: {why}")
            time.sleep(0.5)

    # -- act
    def link(self, name: str, up: bool) -> None:
        """Cut (``up=False``) or restore host ``name``'s link to the bridge."""
        sh("ip", "link", "set", self.hosts[name].veth, "up" if up else "down")

    def nsexec(self, name: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("nsenter", f"--net=/var/run/netns/{self.hosts[name].ns}", *argv, check=check)

    # -- clean
    def close(self) -> None:
        """Stop every engine, remove everything made (each step tried even if one fails)."""
        for h in self.hosts.values():
            if h.proc is not None and h.proc.poll() is None:
                try:  # the containers first: dockerd stops but keeps them
                    api = DockerAPI(h.socket, timeout=20)
                    for c in api.json("GET", "/containers/json?all=1") or []:
                        api.request("DELETE", f"/containers/{c['Id']}?force=1&v=1")
                except Exception as err:  # noqa: BLE001
                    self.log(f"{h.name}: containers not removed: {err}")
                os.killpg(h.proc.pid, signal.SIGTERM)
        for h in self.hosts.values():
            if h.proc is not None:
                try:
                    h.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(h.proc.pid, signal.SIGKILL)
                    h.proc.wait(timeout=10)
            for p in _engine_pids(h):
                os.kill(p, signal.SIGKILL)
        for h in self.hosts.values():
            for d in _cgroups(h.cgroup_parent):
                for sub in sorted(d.glob("*/"), reverse=True):
                    _rmdir(sub)
                _rmdir(d)
            for m in _mounts(h.run_dir):  # dockerd's bind of its namespace (exec-root/netns/default)
                subprocess.run(["umount", "-l", m], capture_output=True, check=False)
            shutil.rmtree(h.run_dir, ignore_errors=True)
        shutil.rmtree(f"/run/{PREFIX}", ignore_errors=True)
        if not self.keep_data:
            for h in self.hosts.values():
                _rm_data(h.data_root)
        shutil.rmtree(self.work, ignore_errors=True)
        left = self.net.remove() if self.made else []
        if left:
            self.log(f"could not remove {left}")

    def leftovers(self) -> list[str]:
        """What of these hosts still exists (empty after :meth:`close`)."""
        left = [f"namespace or link {n}" for n in self.net.leftovers()]
        left += [f"iptables: {r}" for r in sh("iptables", "-S", check=False).stdout.splitlines() if self.subnet in r]
        left += [f"iptables nat: {r}" for r in sh("iptables", "-t", "nat", "-S", check=False).stdout.splitlines()
                 if self.subnet in r]
        for h in self.hosts.values():
            left += [f"process {p} of {h.name}'s engine" for p in _engine_pids(h)]
            left += [f"cgroup {d}" for d in _cgroups(h.cgroup_parent)]
        left += [f"mount {m}" for m in _mounts(Path(f"/run/{PREFIX}"))]
        if Path(f"/run/{PREFIX}").exists():
            left.append(f"/run/{PREFIX}")
        return left


def _engine_pids(h: DockerHost) -> list[int]:
    """dockerd / containerd / shim processes whose command line names this host's run dir."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        if str(h.run_dir).encode() in cmd and int(p.name) != os.getpid():
            out.append(int(p.name))
    return out


def _cgroups(parent: str) -> list[Path]:
    return [d for d in CGROUP_ROOT.glob(f"*/{parent}") if d.is_dir()]


def _rmdir(d: Path) -> None:
    try:
        d.rmdir()
    except OSError:
        pass


def _mounts(root: Path) -> list[str]:
    """Mount points under ``root``, deepest first."""
    return sorted((line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                   if line.split()[1].startswith(f"{root}/") or line.split()[1] == str(root)), reverse=True)


def _rm_data(root: Path) -> None:
    """A data root: its overlay mounts first (none once dockerd stopped cleanly)."""
    for m in _mounts(root):
        subprocess.run(["umount", "-l", m], capture_output=True, check=False)
    shutil.rmtree(root, ignore_errors=True)
