"""``python -m deploy k8s --hosts FILE --out DIR``: the Kubernetes manifests of a deployment across
machines (docs/deployment.md, "Kubernetes"). The SuperLink, ServerApp and churn driver stay outside
the cluster, on the machine of the hosts file's ``[superlink] address``; every client's SuperNode
is one Deployment, pinned to the node its host names, that the driver scales between 0 and 1
replicas through the ``deployments/scale`` subresource (:class:`deploy.k8sengine.KubernetesEngine`).

What ``DIR`` holds (``kubectl apply -f DIR`` applies them in this order):

- ``00-namespace.yaml``: the namespace;
- ``01-rbac.yaml``: the driver's ServiceAccount, Role (``deployments/scale`` get/patch, ``pods``
  get/list/watch, ``pods/log`` get; ``pods`` delete only with ``--allow-kill``) and RoleBinding;
- ``02-ca.yaml``: a ConfigMap with the CA certificate the SuperLink's certificate is signed by;
- ``03-network-policy.yaml``: no ingress to any SuperNode pod (a SuperNode only dials out; its
  runtime API listens on 0.0.0.0 for the kubelet's probes, which no policy blocks);
- ``node-<i>.yaml`` for every client ``i``: the Secret with its SuperNode private key, the
  PersistentVolumeClaim of its ``state-dir`` (client state survives a scale to 0) and its Deployment;
- ``identity/`` (only when no ``--certs`` is given): the CA, the SuperLink's certificate and key and
  every node's key pair, made by :mod:`deploy.identity` (gen-certs.sh's layout).

Every object is built from the :class:`deploy.hostengine.NodeLaunch` every engine gets. Nothing is
written on an error; ``DIR`` is never a folder of the checkout that git does not ignore (keys).
"""

from __future__ import annotations

import argparse
import base64
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from client_app.timing import SWITCH as TIMING

from .errors import DeployError
from .flwr_cli import toml_value
from .hostengine import NodeLaunch
from .hosts import HostSpec, HostsPlan, load_hosts
from .identity import make_identities, outside_checkout
from .tuning import ENV as TUNING_ENV, NODE_CONFIG as TUNING_NODE_CONFIG

APP = "flchurn-supernode"  # app.kubernetes.io/name of every SuperNode object
LABEL_NAME = "app.kubernetes.io/name"
LABEL_CLIENT = "flchurn/client"
LABEL_HOST = "flchurn/host"
NODE_LABEL = "kubernetes.io/hostname"  # where a host's SuperNodes are placed (its k8s-node, else its name)
CONTAINER = "supernode"
RUNTIME_PORT = 9094  # the SuperNode's runtime API (--port), on 0.0.0.0 for the probes
GRACE_S = 10  # terminationGracePeriodSeconds: compose's stop_grace_period
APP_UID = 1000  # the image's user `app` (docker/Dockerfile)
CA_CONFIGMAP = "flchurn-ca"
DRIVER = "flchurn-driver"  # ServiceAccount, Role and RoleBinding of the churn driver
STATE_SIZE = "1Gi"
CA_PATH = "/certs/ca.crt"
KEY_PATH = "/keys/node"
SUPERNODE_COMMAND = ["python", "-m", "deploy.tuning", "supernode"]  # as docker/compose.tls.yml


def deployment_name(client: int) -> str:
    return f"flchurn-node-{client}"


def secret_name(client: int) -> str:
    return f"flchurn-node-{client}-key"


def claim_name(client: int) -> str:
    return f"flchurn-node-{client}-state"


def client_labels(client: int, host: str) -> dict[str, str]:
    return {LABEL_NAME: APP, LABEL_CLIENT: str(client), LABEL_HOST: host}


def selector(client: int) -> dict[str, str]:
    """The Deployment's selector (and the driver's pod query) for client ``client``."""
    return {LABEL_NAME: APP, LABEL_CLIENT: str(client)}


def label_query(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


@dataclass(frozen=True)
class K8sOptions:
    namespace: str = "flchurn"
    image: str | None = None  # None: each host's image (the hosts file's `image`, else its default)
    replicas: int = 1  # what `kubectl apply` sets; the driver scales 0 <-> 1 from there
    storage_class: str | None = None  # of the state claims (None: the cluster's default class)
    allow_kill: bool = False  # the driver may delete pods (churn-mode kill: a crash, SIGKILL)


class Keys(Protocol):
    """Where the CA certificate and every node's key pair are (gen-certs.sh's layout)."""

    @property
    def ca_cert(self) -> Path: ...

    def key(self, i: int) -> Path: ...

    def public_key(self, i: int) -> Path: ...


@dataclass(frozen=True)
class CertDir:
    """A ``--certs`` folder: ``ca.crt``, ``keys/node-<i>``, ``keys/node-<i>.pub``."""

    folder: Path

    @property
    def ca_cert(self) -> Path:
        return self.folder / "ca.crt"

    def key(self, i: int) -> Path:
        return self.folder / "keys" / f"node-{i}"

    def public_key(self, i: int) -> Path:
        return self.folder / "keys" / f"node-{i}.pub"

    def check(self, num_clients: int) -> None:
        wanted = [self.ca_cert] + [p for i in range(num_clients) for p in (self.key(i), self.public_key(i))]
        for path in wanted:
            if not path.is_file():
                raise DeployError(f"--certs {self.folder}: {path.relative_to(self.folder)} is missing (make them with "
                                  f"docker/gen-certs.sh {self.folder} {num_clients}, or leave --certs out to have "
                                  "them made)")


def check_server_names(certs: Path, plan: HostsPlan) -> None:
    """The SuperLink's certificate in ``certs`` (``server.pem``, when there) names the address the
    pods dial: otherwise every SuperNode fails its TLS handshake, seen only in the pods' logs."""
    import ipaddress

    from cryptography import x509

    path = certs / "server.pem"
    if not path.is_file():
        return
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as err:
        raise DeployError(f"--certs {certs}: server.pem is not a certificate with subject alternative names ({err})") \
            from None
    address = plan.superlink.address
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        kind, found = "DNS", address.lower() in {n.lower() for n in san.get_values_for_type(x509.DNSName)}
    else:
        kind, found = "IP", ip in san.get_values_for_type(x509.IPAddress)
    if not found:
        names = ", ".join(str(n.value) for n in san)
        raise DeployError(f"--certs {certs}: server.pem is for {names}, not for the [superlink] address {address!r} "
                          "the pods dial (their TLS handshake would fail); make it again with "
                          f"SAN_EXTRA=\"{kind}:{address}\" docker/gen-certs.sh {certs} {plan.num_clients}")


def superlink_target(plan: HostsPlan) -> str:
    """ADDRESS:PORT the SuperNodes dial: the hosts file's ``[superlink]``."""
    address, port = plan.superlink.address, plan.superlink.port
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def node_config(plan: HostsPlan, client: int) -> dict[str, Any]:
    """Client ``client``'s node config: as docker/compose.tls.yml's (``data-dir`` only when its host
    names one, mounted read-only at /data)."""
    host = plan.host_for(client)
    cfg: dict[str, Any] = {"partition-id": client, "num-partitions": plan.num_clients}
    if host.data_dir:
        cfg["data-dir"] = "/data"
    cfg["state-dir"] = "/state"
    cfg.update(TUNING_NODE_CONFIG)
    cfg[TIMING] = True
    return cfg


def node_launch(plan: HostsPlan, client: int, keys: Keys) -> NodeLaunch:
    return NodeLaunch(client=client, name=deployment_name(client), superlink=superlink_target(plan),
                      ca_cert=keys.ca_cert.read_bytes(), private_key=keys.key(client).read_bytes(),
                      node_config=node_config(plan, client), runtime_port=RUNTIME_PORT,
                      env={**TUNING_ENV, "OMP_NUM_THREADS": "1"})  # one compute thread a node, as compose's


def supernode_args(launch: NodeLaunch) -> list[str]:
    """The arguments of ``python -m deploy.tuning supernode`` (Flower's ``flower-supernode``)."""
    return ["--root-certificates", CA_PATH, "--superlink", launch.superlink,
            "--auth-supernode-private-key", KEY_PATH, "--host", "0.0.0.0", "--port", str(launch.runtime_port),
            "--node-config", " ".join(f"{k}={toml_value(v)}" for k, v in launch.node_config.items())]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _meta(name: str, opts: K8sOptions, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": opts.namespace}
    if labels:
        meta["labels"] = dict(labels)
    return meta


def namespace(opts: K8sOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": opts.namespace, "labels": {"app.kubernetes.io/part-of": "flchurn"}}}


def ca_configmap(ca_cert: bytes, opts: K8sOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(CA_CONFIGMAP, opts),
            "data": {"ca.crt": ca_cert.decode("ascii")}}


def key_secret(launch: NodeLaunch, host: str, opts: K8sOptions) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(secret_name(launch.client), opts, client_labels(launch.client, host)),
            "data": {"node": _b64(launch.private_key)}}


def state_claim(client: int, host: str, opts: K8sOptions) -> dict[str, Any]:
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": STATE_SIZE}}}
    if opts.storage_class:
        spec["storageClassName"] = opts.storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": _meta(claim_name(client), opts, client_labels(client, host)), "spec": spec}


def deployment(launch: NodeLaunch, host: HostSpec, image: str, opts: K8sOptions) -> dict[str, Any]:
    """Client ``launch.client``'s SuperNode: one replica at most, ``Recreate`` (never two pods with
    one key: the SuperLink refuses the second while the first is online), on its host's node."""
    labels = client_labels(launch.client, host.name)
    probe = {"tcpSocket": {"port": launch.runtime_port}}
    volumes: list[dict[str, Any]] = [
        {"name": "ca", "configMap": {"name": CA_CONFIGMAP, "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"name": "key", "secret": {"secretName": secret_name(launch.client), "defaultMode": 0o440,
                                   "items": [{"key": "node", "path": "node"}]}},
        {"name": "state", "persistentVolumeClaim": {"claimName": claim_name(launch.client)}},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "ca", "mountPath": "/certs", "readOnly": True},
        {"name": "key", "mountPath": "/keys", "readOnly": True},
        {"name": "state", "mountPath": "/state"},
    ]
    if host.data_dir:  # prepared data on that node (a hostPath: a namespace that admits them)
        volumes.append({"name": "data", "hostPath": {"path": host.data_dir, "type": "Directory"}})
        mounts.append({"name": "data", "mountPath": "/data", "readOnly": True})
    container: dict[str, Any] = {
        "name": CONTAINER, "image": image, "imagePullPolicy": "IfNotPresent",
        "command": list(SUPERNODE_COMMAND), "args": supernode_args(launch),
        "env": [{"name": k, "value": v} for k, v in launch.env.items()],
        "ports": [{"name": "runtime", "containerPort": launch.runtime_port, "protocol": "TCP"}],
        "readinessProbe": {**probe, "initialDelaySeconds": 2, "periodSeconds": 5},
        "livenessProbe": {**probe, "initialDelaySeconds": 30, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "nodeSelector": {NODE_LABEL: host.k8s_node or host.name},
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": GRACE_S,  # SIGTERM, then SIGKILL: `docker stop -t 10`
        "shareProcessNamespace": True,  # the pause process is PID 1 and reaps ClientApps (compose's init: true)
        "automountServiceAccountToken": False,  # a SuperNode never talks to the API server
        "securityContext": {"runAsNonRoot": True, "runAsUser": APP_UID, "runAsGroup": APP_UID, "fsGroup": APP_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": volumes,
    }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(launch.name, opts, labels),
            "spec": {"replicas": opts.replicas, "strategy": {"type": "Recreate"}, "revisionHistoryLimit": 2,
                     "selector": {"matchLabels": selector(launch.client)},
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}}}


def rbac(opts: K8sOptions) -> list[dict[str, Any]]:
    """The churn driver's identity in the namespace: scale the SuperNode Deployments, read pods."""
    pods = ["get", "list", "watch"] + (["delete"] if opts.allow_kill else [])
    rules = [{"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"]},
             {"apiGroups": [""], "resources": ["pods"], "verbs": pods},
             {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]}]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(DRIVER, opts)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(DRIVER, opts),
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(DRIVER, opts),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": DRIVER},
         "subjects": [{"kind": "ServiceAccount", "name": DRIVER, "namespace": opts.namespace}]},
    ]


def network_policy(opts: K8sOptions) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(f"{APP}-no-ingress", opts),
            "spec": {"podSelector": {"matchLabels": {LABEL_NAME: APP}}, "policyTypes": ["Ingress"], "ingress": []}}


def manifests(plan: HostsPlan, keys: Keys, opts: K8sOptions) -> dict[str, list[dict[str, Any]]]:
    """File name -> the objects it holds."""
    files: dict[str, list[dict[str, Any]]] = {
        "00-namespace.yaml": [namespace(opts)],
        "01-rbac.yaml": rbac(opts),
        "02-ca.yaml": [ca_configmap(keys.ca_cert.read_bytes(), opts)],
        "03-network-policy.yaml": [network_policy(opts)],
    }
    for client in range(plan.num_clients):
        host = plan.host_for(client)
        launch = node_launch(plan, client, keys)
        files[f"node-{client}.yaml"] = [key_secret(launch, host.name, opts), state_claim(client, host.name, opts),
                                        deployment(launch, host, opts.image or host.image, opts)]
    return files


def check_options(plan: HostsPlan, opts: K8sOptions) -> None:
    from .hosts import HOST_NAME_RE, HostsError, _loopback

    if _loopback(plan.superlink.address):
        raise HostsError(f"{plan.source} [superlink] address {plan.superlink.address!r} is a loopback address: the "
                         "cluster's pods cannot reach it; give the driver machine's address they can reach")
    if plan.superlink.port == 0:
        raise HostsError(f"{plan.source} [superlink] port: missing or 0 (a free port, chosen at launch): the manifests "
                         "carry the port the pods dial; give the SuperLink's --port (Flower's default: 8000)")
    if not HOST_NAME_RE.match(opts.namespace):
        raise DeployError(f"--namespace {opts.namespace!r}: must be a DNS label (lower-case letters, digits and '-')")
    if opts.replicas not in (0, 1):
        raise DeployError(f"--replicas {opts.replicas}: a client's Deployment has 0 or 1 replicas")


class _Dumper(yaml.SafeDumper):
    """Plain YAML: no ``&id001`` anchors for a mapping used twice."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _dump(docs: Sequence[Mapping[str, Any]]) -> str:
    return yaml.dump_all(list(docs), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def write_manifests(out: Path, plan: HostsPlan, opts: K8sOptions, certs: Path | None,
                    make_keys: Callable[[Path, Sequence[str], int], Keys] | None = None) -> list[Path]:
    """Check everything, then write ``out`` (absent or empty before); on any error nothing stays."""
    check_options(plan, opts)
    outside_checkout(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DeployError(f"--out {out}: exists and is not an empty folder (it would mix two deployments' keys); "
                          "give a new folder")
    keys: Keys
    if certs is not None:
        cert_dir = CertDir(certs)
        cert_dir.check(plan.num_clients)
        check_server_names(certs, plan)
        keys = cert_dir
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        out.chmod(0o700)  # Secrets and, without --certs, the CA key
        if certs is None:
            keys = (make_keys or make_identities)(out / "identity", plan.superlink.cert_names, plan.num_clients)
        written = []
        for name, docs in manifests(plan, keys, opts).items():
            path = out / name
            path.write_text(_dump(docs))
            if name.startswith("node-"):
                path.chmod(0o600)  # a Secret: a private key
            written.append(path)
        return written
    except BaseException:
        if made:
            shutil.rmtree(out, ignore_errors=True)
        else:
            for child in out.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        raise


def options(args: argparse.Namespace) -> K8sOptions:
    return K8sOptions(namespace=args.namespace, image=args.image, replicas=args.replicas,
                      storage_class=args.storage_class, allow_kill=args.allow_kill)


def k8s_main(args: argparse.Namespace) -> int:
    """``python -m deploy k8s``: exit 0 with the files written, 2 on a hosts-file or option mistake."""
    out = Path(args.out).expanduser()
    try:
        plan = load_hosts(args.hosts)
        written = write_manifests(out, plan, options(args), Path(args.certs).expanduser() if args.certs else None)
    except DeployError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a key or certificate that cannot be read, a folder that cannot be written
        print(f"error: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} manifests to {out} ({plan.num_clients} clients on {len(plan.hosts)} hosts, "
          f"namespace {args.namespace}); SuperNodes dial {superlink_target(plan)}")
    if not args.certs:
        print(f"keys and certificates: {out / 'identity'} (the SuperLink's: server.pem, server.key, ca.crt; register "
              "keys/node-*.pub with `flwr supernode register` before round 1)")
    print(f"apply: kubectl apply -f {out}")
    return 0
