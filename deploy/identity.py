"""The keys and certificates of a deployment across hosts, in ``docker/gen-certs.sh``'s layout:

- ``ca.crt``, ``ca.key``: a self-signed CA (the key never leaves this machine);
- ``server.pem``, ``server.key``: the SuperLink's certificate, its subject alternative names the
  hosts file's ``[superlink] address`` and ``names`` (IPs as IP entries, the rest as DNS);
- ``keys/node-<i>``, ``keys/node-<i>.pub``: client ``i``'s SuperNode key (ECDSA P-384, OpenSSH
  format, as ``ssh-keygen -t ecdsa -b 384`` writes it), registered with ``flwr supernode register``
  before round 1: under ``--enable-supernode-auth`` the SuperLink gives the node its id from this key,
  so the id is the same across restarts and hosts and nobody without the key can take it.

Written with ``cryptography`` (Flower's own dependency), private files mode 600, into a folder
outside the repository's tree (:func:`outside_checkout` refuses one inside it unless ignored).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import DeployError

DAYS = 365


@dataclass(frozen=True)
class Identities:
    folder: Path
    num_clients: int

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    @property
    def server_cert(self) -> Path:
        return self.folder / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.folder / "server.key"

    def key(self, i: int) -> Path:
        return self.folder / "keys" / f"node-{i}"

    def public_key(self, i: int) -> Path:
        return self.folder / "keys" / f"node-{i}.pub"

    def public_key_pem(self, i: int) -> bytes:
        """Client ``i``'s public key as the SuperLink registers and lists it (PEM, SubjectPublicKeyInfo;
        ``flwr supernode register`` converts the OpenSSH file the same way)."""
        key = serialization.load_ssh_public_key(self.public_key(i).read_bytes())
        return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def _write(path: Path, data: bytes, private: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600 if private else 0o644)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys((*names, "localhost", "127.0.0.1")):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def make_identities(folder: Path, cert_names: Sequence[str], num_clients: int) -> Identities:
    """A CA, the SuperLink's certificate for ``cert_names`` and ``num_clients`` SuperNode keys in
    ``folder`` (made if absent); returns their paths."""
    outside_checkout(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # a host whose clock is a little behind
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flchurn-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + dt.timedelta(days=DAYS))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "superlink")]))
              .issuer_name(ca_name).public_key(server_key.public_key())
              .serial_number(x509.random_serial_number()).not_valid_before(now)
              .not_valid_after(now + dt.timedelta(days=DAYS))
              .add_extension(_san(cert_names), critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    ids = Identities(folder, num_clients)
    _write(folder / "ca.key", _pem_key(ca_key), private=True)
    _write(ids.ca_cert, ca.public_bytes(serialization.Encoding.PEM), private=False)
    _write(ids.server_key, _pem_key(server_key), private=True)
    _write(ids.server_cert, server.public_bytes(serialization.Encoding.PEM), private=False)
    for i in range(num_clients):
        key = ec.generate_private_key(ec.SECP384R1())
        _write(ids.key(i), key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                             serialization.NoEncryption()), private=True)
        pub = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        _write(ids.public_key(i), pub + f" flchurn-node-{i}\n".encode(), private=False)
    return ids


def load_identities(folder: Path, num_clients: int) -> Identities:
    """Keys and certificates made before (gen-certs.sh or :func:`make_identities`); an error names
    the first missing file."""
    ids = Identities(folder, num_clients)
    wanted = [ids.ca_cert, ids.server_cert, ids.server_key]
    wanted += [p for i in range(num_clients) for p in (ids.key(i), ids.public_key(i))]
    for path in wanted:
        if not path.is_file():
            raise DeployError(f"certificates folder {folder}: {path.relative_to(folder)} is missing (make them with "
                              f"docker/gen-certs.sh {folder} {num_clients}, or leave the folder out to have them made)")
    return ids


def outside_checkout(folder: Path) -> None:
    """Refuse to write keys into a git checkout's tracked tree (a folder git does not ignore)."""
    probe = folder.resolve()
    while not probe.exists():
        probe = probe.parent
    try:
        top = subprocess.run(["git", "-C", str(probe), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return  # no git: nothing to commit them to
    if top.returncode != 0:
        return
    ignored = subprocess.run(["git", "-C", top.stdout.strip(), "check-ignore", "-q", str(folder.resolve() / "x")],
                             capture_output=True, timeout=10)
    if ignored.returncode != 0:
        raise DeployError(f"{folder} is inside the git checkout {top.stdout.strip()} and not ignored: private keys "
                          "there are one `git add` away from a commit; choose a folder outside it")
