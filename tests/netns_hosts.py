"""Test hosts with real Docker engines on this machine (root): network namespaces on a bridge of a
private subnet, each running its own ``dockerd`` (own data root, exec root, pidfile, cgroup parent,
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

PREFIX = "flcd"  # every namespace, interface and cgroup made here starts with it
SUBNET = "10.213.7"  # bridge .1, hosts .11, .12, ...
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
    """Namespaced Docker engines ``names`` on bridge ``flcd0`` (``SUBNET.1``)."""

    def __init__(self, names: list[str], subnet: str = SUBNET, log=print,
                 insecure_registry: str | None = None) -> None:
        self.subnet = subnet
        self.bridge = f"{PREFIX}0"
        self.bridge_ip = f"{subnet}.1"
        self.log = log
        self.work = Path(tempfile.mkdtemp(prefix="flchurn-dockerhosts-"))
        keep = os.environ.get("FLCHURN_DOCKER_DATA")  # keep the engines' images between runs
        self.data_base = Path(keep) if keep else self.work / "data"
        self.keep_data = bool(keep)
        self.insecure_registry = insecure_registry
        self.hosts = {n: DockerHost(n, f"{PREFIX}-{n}", f"{PREFIX}v{i}", f"{subnet}.{11 + i}",
                                    Path(f"/run/{PREFIX}/{n}"), self.data_base / n, self.work / "tls" / "client")
                      for i, n in enumerate(names)}
        self.made: list[tuple[str, str]] = []

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
        if f"{self.subnet}." in sh("ip", "-4", "route", check=False).stdout:
            raise RuntimeError(f"subnet {self.subnet}.0/24 is in use here (a leftover? ip route)")
        engine_certs(self.work / "tls", {n: h.address for n, h in self.hosts.items()})
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        sh("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for h in self.hosts.values():
            sh("ip", "netns", "add", h.ns)
            self.made.append(("netns", h.ns))
            sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", f"{h.veth}p")
            self.made.append(("link", h.veth))
            sh("ip", "link", "set", f"{h.veth}p", "netns", h.ns)
            sh("ip", "link", "set", h.veth, "master", self.bridge, "up")
            sh("ip", "-n", h.ns, "link", "set", f"{h.veth}p", "name", "eth0")
            sh("ip", "-n", h.ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            sh("ip", "-n", h.ns, "link", "set", "eth0", "up")
            sh("ip", "-n", h.ns, "link", "set", "lo", "up")
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
        for kind, name in reversed(self.made):
            if kind == "netns":
                sh("ip", "netns", "del", name, check=False)
            else:
                sh("ip", "link", "del", name, check=False)
        self.made.clear()
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

    def leftovers(self) -> list[str]:
        """What of these hosts still exists (empty after :meth:`close`)."""
        left = [f"netns {n}" for n in sh("ip", "netns", "list", check=False).stdout.split() if n.startswith(PREFIX)]
        for line in sh("ip", "-o", "link", check=False).stdout.splitlines():
            name = line.split(":")[1].strip().split("@")[0]
            if name.startswith(PREFIX):
                left.append(f"link {name}")
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
