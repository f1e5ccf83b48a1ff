"""``python -m deploy k8s`` (deploy/k8s.py) and its engine (deploy/k8sengine.py), without a cluster:
every manifest parses into the Kubernetes API types of the official Python client and comes back
unchanged (no field silently dropped), one Deployment per client on its host's node with its
partition, the Secrets hold the keys' bytes, hosts-file mistakes exit 2 and write nothing; the
engine is driven through fake API objects that answer with the client's own model types."""

from __future__ import annotations

import base64
import copy
import datetime as dt
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes")
from kubernetes import client as k8s  # noqa: E402

from deploy.cli import main  # noqa: E402
from deploy.errors import DeployError  # noqa: E402
from deploy.hostengine import HostUnreachable, NodeLaunch  # noqa: E402
from deploy.hosts import HostSpec  # noqa: E402
from deploy.k8sengine import KubernetesEngine  # noqa: E402

MODELS = {  # kind -> (apiVersion, the client's model)
    "Namespace": ("v1", "V1Namespace"),
    "ServiceAccount": ("v1", "V1ServiceAccount"),
    "Role": ("rbac.authorization.k8s.io/v1", "V1Role"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "V1RoleBinding"),
    "ConfigMap": ("v1", "V1ConfigMap"),
    "NetworkPolicy": ("networking.k8s.io/v1", "V1NetworkPolicy"),
    "Secret": ("v1", "V1Secret"),
    "PersistentVolumeClaim": ("v1", "V1PersistentVolumeClaim"),
    "Deployment": ("apps/v1", "V1Deployment"),
}

HOSTS = """
[superlink]
address = "192.168.1.10"
port = 9092

[hosts.pi]
engine = "process"
clients = [0, 1]
k8s-node = "raspberrypi-4"

[hosts.lab]
engine = "process"
clients = [2, 3]
data-dir = "/srv/flchurn-data"
"""
NODE_OF = {0: "raspberrypi-4", 1: "raspberrypi-4", 2: "lab", 3: "lab"}
HOST_OF = {0: "pi", 1: "pi", 2: "lab", 3: "lab"}


def _make_certs(folder: Path, n: int) -> Path:
    """docker/gen-certs.sh's layout (ca.crt, keys/node-<i>{,.pub}), made fast (ECDSA, no CA signing:
    the command only copies the bytes)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    (folder / "keys").mkdir(parents=True)
    (folder / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n")
    for i in range(n):
        key = ec.generate_private_key(ec.SECP384R1())
        (folder / "keys" / f"node-{i}").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()))
        (folder / "keys" / f"node-{i}.pub").write_bytes(key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH) + f" flchurn-node-{i}\n".encode())
    return folder


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_certs(tmp_path_factory.mktemp("certs"), 4)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hosts") / "hosts.toml"
    path.write_text(HOSTS)
    return path


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory, hosts: Path, certs: Path) -> Path:
    folder = tmp_path_factory.mktemp("k8s") / "out"
    assert main(["k8s", "--hosts", str(hosts), "--out", str(folder), "--certs", str(certs),
                 "--namespace", "fl-test", "--image", "registry.lab:5000/flchurn:1"]) == 0
    return folder


def _docs(folder: Path) -> list[dict[str, Any]]:
    return [d for f in sorted(folder.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]


def _of(folder: Path, kind: str) -> list[dict[str, Any]]:
    return [d for d in _docs(folder) if d["kind"] == kind]


def _parse(doc: dict[str, Any]) -> Any:
    """The document as the client's model: the API's field names and types (pydantic-checked in the
    client's newer releases); an unknown field would be dropped, so the round trip must give it back."""
    api = k8s.ApiClient()
    obj = api._ApiClient__deserialize(copy.deepcopy(doc), MODELS[doc["kind"]][1])  # type: ignore[attr-defined]
    assert type(obj).__name__ == MODELS[doc["kind"]][1]
    return obj, api.sanitize_for_serialization(obj)


def test_every_manifest_parses_into_the_api_types_and_back(out: Path) -> None:
    docs = _docs(out)
    assert {d["kind"] for d in docs} == set(MODELS)
    for doc in docs:
        assert doc["apiVersion"] == MODELS[doc["kind"]][0], doc["kind"]
        _, back = _parse(doc)
        assert back == doc, f"{doc['kind']} {doc['metadata']['name']}: a field the API types do not know"
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "fl-test"


def test_the_round_trip_catches_a_misspelt_field(out: Path) -> None:
    doc = _of(out, "Deployment")[0]
    bad = copy.deepcopy(doc)
    bad["spec"]["template"]["spec"]["nodeSelectr"] = bad["spec"]["template"]["spec"].pop("nodeSelector")
    assert _parse(bad)[1] != bad
    wrong = copy.deepcopy(doc)
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(Exception):  # noqa: B017 (pydantic's ValidationError, or the client's own)
        _parse(wrong)


def _node_config(args: list[str]) -> dict[str, str]:
    text = args[args.index("--node-config") + 1]
    return dict(kv.split("=", 1) for kv in shlex.split(text))


def test_one_deployment_per_client_on_its_hosts_node(out: Path) -> None:
    deployments = {d["metadata"]["name"]: d for d in _of(out, "Deployment")}
    assert sorted(deployments) == [f"flchurn-node-{i}" for i in range(4)]
    for i in range(4):
        d = deployments[f"flchurn-node-{i}"]
        labels = {"app.kubernetes.io/name": "flchurn-supernode", "flchurn/client": str(i), "flchurn/host": HOST_OF[i]}
        assert d["metadata"]["labels"] == labels
        spec = d["spec"]
        assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
        assert spec["selector"]["matchLabels"] == {"app.kubernetes.io/name": "flchurn-supernode", "flchurn/client": str(i)}
        pod = spec["template"]["spec"]
        assert spec["template"]["metadata"]["labels"] == labels
        assert pod["nodeSelector"] == {"kubernetes.io/hostname": NODE_OF[i]}
        (c,) = pod["containers"]
        assert c["image"] == "registry.lab:5000/flchurn:1"
        assert c["command"] == ["python", "-m", "deploy.tuning", "supernode"]
        args = c["args"]
        for flag, value in [("--root-certificates", "/certs/ca.crt"), ("--superlink", "192.168.1.10:9092"),
                            ("--auth-supernode-private-key", "/keys/node"), ("--host", "0.0.0.0"), ("--port", "9094")]:
            assert args[args.index(flag) + 1] == value
        cfg = _node_config(args)
        assert cfg["partition-id"] == str(i) and cfg["num-partitions"] == "4"
        assert cfg["state-dir"] == "/state" and cfg["client-worker"] == "true"
        assert ("data-dir" in cfg) == (HOST_OF[i] == "lab")
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["tcpSocket"] == {"port": 9094}
        assert "resources" not in c  # the hosts file gives none
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["key"]["secret"]["secretName"] == f"flchurn-node-{i}-key"
        assert volumes["state"]["persistentVolumeClaim"]["claimName"] == f"flchurn-node-{i}-state"
        assert volumes["ca"]["configMap"]["name"] == "flchurn-ca"
        assert ("data" in volumes) == (HOST_OF[i] == "lab")
        assert pod["automountServiceAccountToken"] is False


def test_secrets_hold_the_key_bytes(out: Path, certs: Path) -> None:
    secrets = {d["metadata"]["name"]: d for d in _of(out, "Secret")}
    assert sorted(secrets) == [f"flchurn-node-{i}-key" for i in range(4)]
    for i in range(4):
        data = secrets[f"flchurn-node-{i}-key"]["data"]
        assert base64.b64decode(data["node"]) == (certs / "keys" / f"node-{i}").read_bytes()
    (ca,) = _of(out, "ConfigMap")
    assert ca["data"]["ca.crt"] == (certs / "ca.crt").read_text()
    assert all((out / f"node-{i}.yaml").stat().st_mode & 0o077 == 0 for i in range(4))


def test_the_drivers_role_only_scales_and_reads(out: Path, hosts: Path, certs: Path, tmp_path: Path) -> None:
    (role,) = _of(out, "Role")
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]
    (binding,) = _of(out, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "flchurn-driver", "namespace": "fl-test"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert main(["k8s", "--hosts", str(hosts), "--out", str(tmp_path / "o"), "--certs", str(certs),
                 "--allow-kill"]) == 0
    (killer,) = _of(tmp_path / "o", "Role")
    assert killer["rules"][1]["verbs"] == ["get", "list", "watch", "delete"]


BAD_HOSTS = [
    (HOSTS.replace("clients = [0, 1]", "clents = [0, 1]"), ["[hosts.pi]", "'clents'", "'clients'"]),
    (HOSTS.replace('k8s-node = "raspberrypi-4"', "k8s-node = 4"), ["[hosts.pi]", "k8s-node"]),
    (HOSTS.replace("clients = [2, 3]", "clients = [3]"), ["client(s) [2]"]),
    (HOSTS.replace("192.168.1.10", "127.0.0.1"), ["[superlink] address", "loopback"]),
    (HOSTS.replace("[hosts.lab]", "[hosts.Lab]"), ["[hosts.Lab]", "DNS label"]),
    (HOSTS.replace("port = 9092\n", ""), ["[superlink] port", "missing or 0"]),
]


@pytest.mark.parametrize(("text", "words"), BAD_HOSTS)
def test_hosts_file_mistakes_exit_2_and_write_nothing(text: str, words: list[str], certs: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    assert main(["k8s", "--hosts", str(path), "--out", str(tmp_path / "out"), "--certs", str(certs)]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def test_a_missing_key_exits_2_and_writes_nothing(hosts: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    few = _make_certs(tmp_path / "few", 3)
    assert main(["k8s", "--hosts", str(hosts), "--out", str(tmp_path / "out"), "--certs", str(few)]) == 2
    assert "keys/node-3 is missing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _server_pem(names: list[str]) -> bytes:
    """A self-signed server certificate for ``names`` (gen-certs.sh's server.pem stands in)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "superlink")])
    entries: list[x509.GeneralName] = []
    for n in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            entries.append(x509.DNSName(n))
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(entries), critical=False).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


def test_a_server_certificate_without_the_superlink_address_exits_2(hosts: Path, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    certs = _make_certs(tmp_path / "certs", 4)
    (certs / "server.pem").write_bytes(_server_pem(["superlink", "localhost", "127.0.0.1"]))  # no SAN_EXTRA
    assert main(["k8s", "--hosts", str(hosts), "--out", str(tmp_path / "out"), "--certs", str(certs)]) == 2
    err = capsys.readouterr().err
    assert "'192.168.1.10'" in err and 'SAN_EXTRA="IP:192.168.1.10"' in err
    assert not (tmp_path / "out").exists()
    (certs / "server.pem").write_bytes(_server_pem(["superlink", "192.168.1.10"]))
    assert main(["k8s", "--hosts", str(hosts), "--out", str(tmp_path / "out"), "--certs", str(certs)]) == 0


def test_out_is_never_a_tracked_folder_nor_a_full_one(hosts: Path, certs: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / ".gitignore").write_text("secret-out/\n")
    assert main(["k8s", "--hosts", str(hosts), "--out", str(repo / "k8s"), "--certs", str(certs)]) == 2
    assert "inside the git checkout" in capsys.readouterr().err and not (repo / "k8s").exists()
    assert main(["k8s", "--hosts", str(hosts), "--out", str(repo / "secret-out"), "--certs", str(certs)]) == 0
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    assert main(["k8s", "--hosts", str(hosts), "--out", str(full), "--certs", str(certs)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in full.iterdir()] == ["mine.txt"]


def test_without_certs_the_keys_are_made_beside_the_manifests(hosts: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["k8s", "--hosts", str(hosts), "--out", str(out)]) == 0
    ident = out / "identity"
    for name in ("ca.crt", "server.pem", "server.key", "keys/node-3", "keys/node-3.pub"):
        assert (ident / name).is_file(), name
    secrets = {d["metadata"]["name"]: d for d in _of(out, "Secret")}
    for i in range(4):
        assert base64.b64decode(secrets[f"flchurn-node-{i}-key"]["data"]["node"]) == (ident / f"keys/node-{i}").read_bytes()
    assert _of(out, "ConfigMap")[0]["data"]["ca.crt"] == (ident / "ca.crt").read_text()


def test_write_failure_leaves_nothing(hosts: Path, tmp_path: Path) -> None:
    from deploy.hosts import load_hosts
    from deploy.k8s import K8sOptions, write_manifests

    def broken(folder: Path, names: Any, n: int) -> Any:
        folder.mkdir(parents=True)
        (folder / "ca.key").write_text("half made")
        raise DeployError("no entropy")

    with pytest.raises(DeployError, match="no entropy"):
        write_manifests(tmp_path / "out", load_hosts(hosts), K8sOptions(), None, make_keys=broken)
    assert not (tmp_path / "out").exists()


# --- the engine, through fake API objects ---------------------------------------------------------

T0 = dt.datetime(2026, 12, 1, 10, 0, 0, tzinfo=dt.UTC)


def _pod(client: int, host: str, n: int, state: str = "running", exit_code: int = 0) -> Any:
    if state == "running":
        cstate = k8s.V1ContainerState(running=k8s.V1ContainerStateRunning(started_at=T0 + dt.timedelta(seconds=n)))
    elif state == "terminated":
        cstate = k8s.V1ContainerState(terminated=k8s.V1ContainerStateTerminated(exit_code=exit_code))
    else:
        cstate = k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(reason=state))
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=f"flchurn-node-{client}-abc{n}", resource_version=str(n),
                                  creation_timestamp=T0 + dt.timedelta(seconds=n),
                                  labels={"app.kubernetes.io/name": "flchurn-supernode", "flchurn/client": str(client),
                                          "flchurn/host": host}),
        status=k8s.V1PodStatus(phase="Running" if state == "running" else "Pending", container_statuses=[
            k8s.V1ContainerStatus(name="supernode", image="img", image_id="", ready=state == "running",
                                  restart_count=0, state=cstate)]))


class FakeCluster:
    """AppsV1Api + CoreV1Api + Watch of one namespace: scaling to 1 makes a running pod (or one in
    ``waiting``), scaling to 0 ends it with ``exit_code`` (seen through the watch)."""

    def __init__(self, host: str, clients: tuple[int, ...]) -> None:
        self.host = host
        self.replicas = dict.fromkeys(clients, 0)
        self.pods: dict[int, Any] = {}
        self.events: list[dict[str, Any]] = []
        self.calls: list[tuple[str, Any]] = []
        self.n = 0
        self.exit_code = 0
        self.waiting: str | None = None
        self.fail: Exception | None = None

    # AppsV1Api
    def patch_namespaced_deployment_scale(self, name: str, namespace: str, body: dict[str, Any], **kw: Any) -> Any:
        if self.fail:
            raise self.fail
        client = int(name.rsplit("-", 1)[1])
        if client not in self.replicas:
            raise k8s.ApiException(status=404, reason="Not Found")
        replicas = body["spec"]["replicas"]
        self.calls.append(("scale", (client, replicas)))
        self.replicas[client] = replicas
        if replicas == 1 and client not in self.pods:
            self.n += 1
            self.pods[client] = _pod(client, self.host, self.n, self.waiting or "running")
        elif replicas == 0 and client in self.pods:
            pod = self.pods.pop(client)
            ended = _pod(client, self.host, pod.metadata.creation_timestamp.second, "terminated", self.exit_code)
            ended.metadata.name = pod.metadata.name
            self.events = [{"type": "MODIFIED", "object": ended}, {"type": "DELETED", "object": ended}]
        return k8s.V1Scale(spec=k8s.V1ScaleSpec(replicas=replicas))

    def read_namespaced_deployment_scale(self, name: str, namespace: str, **kw: Any) -> Any:
        client = int(name.rsplit("-", 1)[1])
        if client not in self.replicas:
            raise k8s.ApiException(status=404, reason="Not Found")
        return k8s.V1Scale(spec=k8s.V1ScaleSpec(replicas=self.replicas[client]))

    # CoreV1Api
    def list_namespaced_pod(self, namespace: str, label_selector: str = "", **kw: Any) -> Any:
        if self.fail:
            raise self.fail
        want = dict(kv.split("=", 1) for kv in label_selector.split(",") if kv)
        items = [p for p in self.pods.values() if all(p.metadata.labels.get(k) == v for k, v in want.items())]
        return k8s.V1PodList(items=items)

    def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> str:
        return f"log of {name}"

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int | None = None,
                              **kw: Any) -> None:
        self.calls.append(("delete", (name, grace_period_seconds)))

    # Watch
    def __call__(self) -> FakeCluster:
        return self

    def stream(self, func: Any, *args: Any, **kw: Any) -> Any:
        events, self.events = self.events, []
        yield from events


def _engine(fake: FakeCluster, **kw: Any) -> KubernetesEngine:
    host = HostSpec(name=fake.host, engine="process", clients=tuple(fake.replicas), k8s_node="rpi")
    return KubernetesEngine(host, "fl-test", apps=fake, core=fake, watch=fake, poll=0.01, **kw)


def _launch(client: int) -> NodeLaunch:
    return NodeLaunch(client=client, name=f"flchurn-node-{client}", superlink="192.168.1.10:9092", ca_cert=b"ca",
                      private_key=b"key", node_config={"partition-id": client})


def test_engine_scales_between_0_and_1_and_reads_the_pod() -> None:
    fake = FakeCluster("pi", (0, 1))
    engine = _engine(fake)
    assert engine.reachable() is None
    assert engine.state(0) == "exited" and engine.state(7) == "absent"
    engine.start(_launch(0))
    assert fake.calls == [("scale", (0, 1))]
    assert engine.running() == {0} and engine.state(0) == "running"
    assert engine.started_at(0) == "2026-12-01T10:00:01+00:00"  # the kubelet's clock, as the API gives it
    assert engine.logs(0) == "log of flchurn-node-0-abc1"
    fake.exit_code = 0
    assert engine.stop(0, grace=10) == 0
    assert fake.calls[-1] == ("scale", (0, 0)) and engine.running() == set() and engine.state(0) == "exited"
    assert engine.stop(0, grace=10) is None  # not running
    assert engine.logs(0) == "log of flchurn-node-0-abc1"  # its last incarnation's
    engine.start(_launch(1))
    engine.close()
    assert fake.replicas == {0: 0, 1: 0}


def test_engine_kill_needs_the_delete_verb() -> None:
    fake = FakeCluster("pi", (0,))
    engine = _engine(fake)
    engine.start(_launch(0))
    with pytest.raises(DeployError, match="--allow-kill"):
        engine.kill(0)
    assert fake.replicas[0] == 1  # nothing done
    fake.exit_code = 137
    assert _engine(fake, allow_kill=True).kill(0) == 137
    assert fake.calls[-1] == ("delete", ("flchurn-node-0-abc1", 0))
    with pytest.raises(DeployError, match="SIGTERM"):
        engine.signal(0, signal.SIGHUP)


def test_engine_names_its_failures() -> None:
    fake = FakeCluster("pi", (0,))
    engine = _engine(fake, start_timeout=0.05)
    fake.waiting = "ContainerCreating"
    with pytest.raises(HostUnreachable, match="host pi unreachable: client 0's pod did not run"):
        engine.start(_launch(0))
    fake.pods.clear()
    fake.waiting = "ImagePullBackOff"
    with pytest.raises(DeployError, match="ImagePullBackOff"):
        engine.start(_launch(0))
    fake.fail = k8s.ApiException(status=403, reason="Forbidden")
    with pytest.raises(DeployError, match="01-rbac.yaml"):
        engine.stop(0, 10)
    assert "refused" in (engine.reachable() or "")
    fake.fail = ConnectionRefusedError("connection refused")
    with pytest.raises(HostUnreachable, match="host pi unreachable"):
        engine.running()
    assert "did not answer" in (engine.reachable() or "")


class _FakeServer:
    """A FakeCluster behind HTTP, as an API server answers it: the real client's requests reach it
    (paths, verbs, query strings, the watch's event stream), and each one is recorded."""

    def __init__(self, fake: FakeCluster) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import parse_qs, urlparse

        api = k8s.ApiClient()
        requests: list[tuple[str, str]] = []
        self.requests = requests

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any, text: bool = False) -> None:
                data = (body if text else json.dumps(api.sanitize_for_serialization(body))).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                requests.append((method, url.path + ("?watch" if query.get("watch") == "true" else "")))
                if self.headers.get("Content-Length"):
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                parts = url.path.strip("/").split("/")
                try:
                    if parts[:2] == ["apis", "apps"] and parts[-1] == "scale":
                        name, ns = parts[-2], parts[4]
                        if method == "PATCH":
                            return self._send(200, fake.patch_namespaced_deployment_scale(name, ns, body))
                        return self._send(200, fake.read_namespaced_deployment_scale(name, ns))
                    if parts[-1] == "pods" and query.get("watch") == "true":
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.end_headers()
                        for event in fake.stream(None):
                            line = {"type": event["type"], "object": api.sanitize_for_serialization(event["object"])}
                            self.wfile.write((json.dumps(line) + "\n").encode())
                        return None
                    if parts[-1] == "pods":
                        return self._send(200, fake.list_namespaced_pod(parts[3], query.get("labelSelector", "")))
                    if parts[-1] == "log":
                        return self._send(200, fake.read_namespaced_pod_log(parts[-2], parts[3]), text=True)
                    if method == "DELETE":
                        fake.delete_namespaced_pod(parts[-1], parts[3], int(query.get("gracePeriodSeconds", -1)))
                        return self._send(200, _pod(0, "pi", 0, "terminated"))
                except k8s.ApiException as err:
                    return self._send(err.status, k8s.V1Status(code=err.status, reason=err.reason))
                return self._send(404, k8s.V1Status(code=404, reason="NotFound"))

            def do_GET(self) -> None:
                self._route("GET")

            def do_PATCH(self) -> None:
                self._route("PATCH")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        config = k8s.Configuration(host=f"http://127.0.0.1:{self.server.server_address[1]}")
        self.api_client = k8s.ApiClient(config)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _granted(role: dict[str, Any]) -> set[tuple[str, str]]:
    return {(resource, verb) for rule in role["rules"] for resource in rule["resources"] for verb in rule["verbs"]}


def _needed(method: str, path: str) -> tuple[str, str]:
    parts = path.split("?")[0].strip("/").split("/")
    if parts[-1] == "scale":
        return "deployments/scale", {"GET": "get", "PATCH": "patch"}[method]
    if parts[-1] == "log":
        return "pods/log", "get"
    if parts[-1] == "pods":
        return "pods", "watch" if path.endswith("?watch") else "list"
    return "pods", {"GET": "get", "DELETE": "delete"}[method]


@pytest.mark.parametrize("allow_kill", [False, True])
def test_engine_over_http_asks_only_what_the_role_grants(allow_kill: bool, tmp_path: Path, hosts: Path,
                                                         certs: Path) -> None:
    flags = ["--allow-kill"] if allow_kill else []
    assert main(["k8s", "--hosts", str(hosts), "--out", str(tmp_path / "o"), "--certs", str(certs), *flags]) == 0
    (role,) = _of(tmp_path / "o", "Role")
    fake = FakeCluster("pi", (0, 1))
    server = _FakeServer(fake)
    try:
        host = HostSpec(name="pi", engine="process", clients=(0, 1), k8s_node="raspberrypi-4")
        engine = KubernetesEngine(host, "flchurn", api_client=server.api_client, allow_kill=allow_kill, poll=0.01)
        assert engine.reachable() is None
        engine.start(_launch(0))
        engine.start(_launch(1))
        assert engine.running() == {0, 1} and engine.state(0) == "running"
        assert engine.started_at(0) == "2026-12-01T10:00:01+00:00"
        assert engine.logs(0) == "log of flchurn-node-0-abc1"
        fake.exit_code = 0
        assert engine.stop(0, grace=10) == 0
        assert engine.state(0) == "exited" and engine.state(9) == "absent"
        if allow_kill:
            fake.exit_code = 137
            assert engine.kill(1) == 137
            assert ("delete", ("flchurn-node-1-abc2", 0)) in fake.calls
        engine.close()
        assert fake.replicas == {0: 0, 1: 0}
    finally:
        server.close()
    used = {_needed(m, p) for m, p in server.requests}
    assert used <= _granted(role), used - _granted(role)
    assert all(p.startswith(("/api/v1/namespaces/flchurn/", "/apis/apps/v1/namespaces/flchurn/"))
               for _, p in server.requests)
