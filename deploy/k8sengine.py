"""One host's SuperNodes in a Kubernetes cluster: :class:`KubernetesEngine`, the
:class:`deploy.hostengine.HostEngine` of the Deployments that ``python -m deploy k8s`` writes
(:mod:`deploy.k8s`), acted through the Kubernetes API with the official Python client.

A client goes on by scaling its Deployment to 1 replica and off by scaling it to 0 (the
``deployments/scale`` subresource, all the driver's Role may change); what is running, since when
and its output are read from its pod (``pods`` get/list/watch, ``pods/log`` get). Time comes from
the cluster: ``started_at`` is the container's ``state.running.startedAt`` as the node's kubelet
reported it. A crash (``kill``) deletes the pod with no grace (SIGKILL), which needs the Role's
``pods`` delete (``deploy k8s --allow-kill``).

Not run against a cluster here (none can be installed on the development machine); the tests
drive it through fake API objects that return the client's own model types (tests/test_k8s.py).
"""

from __future__ import annotations

import signal as signals
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .errors import DeployError
from .hostengine import HostEngine, HostUnreachable, NodeLaunch
from .hosts import HostSpec
from .k8s import (
    APP,
    CONTAINER,
    GRACE_S,
    LABEL_CLIENT,
    LABEL_HOST,
    LABEL_NAME,
    deployment_name,
    label_query,
    selector,
)

RBAC_HINT = "the driver's ServiceAccount needs the Role of 01-rbac.yaml (python -m deploy k8s)"


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An API client from a kubeconfig (``KUBECONFIG`` / ``~/.kube/config``; ``context``: one of
    its contexts), or the pod's ServiceAccount when the driver itself runs in the cluster."""
    import os

    from kubernetes import client, config

    if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig, context=context)


def _link_error(err: BaseException) -> bool:
    """A connection refused, reset or timed out (no answer), as against an answer."""
    try:
        from urllib3.exceptions import HTTPError
    except ImportError:  # pragma: no cover (the client depends on urllib3)
        return isinstance(err, OSError | TimeoutError)
    return isinstance(err, OSError | TimeoutError | HTTPError)


class KubernetesEngine:
    """The SuperNodes of ``host``'s clients, one Deployment each in ``namespace``.

    ``api_client``: a ``kubernetes.client.ApiClient`` (default: :func:`load_api_client`); ``apps``,
    ``core`` and ``watch``: the ``AppsV1Api``, the ``CoreV1Api`` and a ``kubernetes.watch.Watch``
    factory to use instead (tests)."""

    def __init__(self, host: HostSpec, namespace: str = "flchurn", *, api_client: Any = None, apps: Any = None,
                 core: Any = None, watch: Callable[[], Any] | None = None, allow_kill: bool = False,
                 request_timeout: float = 10.0, start_timeout: float = 300.0, poll: float = 0.5) -> None:
        self.host = host
        self.namespace = namespace
        self.allow_kill = allow_kill
        self.request_timeout = request_timeout
        self.start_timeout = start_timeout
        self.poll = poll
        if apps is None or core is None or watch is None:
            from kubernetes import client, watch as k8s_watch

            api_client = api_client if api_client is not None else load_api_client()
            apps = apps if apps is not None else client.AppsV1Api(api_client)
            core = core if core is not None else client.CoreV1Api(api_client)
            watch = watch if watch is not None else k8s_watch.Watch
        self.apps, self.core, self._watch = apps, core, watch
        self._last_logs: dict[int, str] = {}

    # --- the API, its errors named ---------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, missing_ok: bool = False, **kwargs: Any) -> Any:
        try:
            return fn(*args, _request_timeout=self.request_timeout, **kwargs)
        except Exception as err:  # ApiException, urllib3's errors, OSError
            status = getattr(err, "status", None)
            if isinstance(status, int) and status > 0:
                if status == 404 and missing_ok:
                    return None
                if status == 404:
                    raise DeployError(f"{what}: not found in namespace {self.namespace} (kubectl apply -f the "
                                      "folder python -m deploy k8s wrote, first)") from None
                if status in (401, 403):
                    raise DeployError(f"{what}: the API server refused it ({status} {getattr(err, 'reason', '')}): "
                                      f"{RBAC_HINT}") from None
                if status < 500:
                    raise DeployError(f"{what}: the API server answered {status} {getattr(err, 'reason', '')}") \
                        from None
            if (isinstance(status, int) and status >= 500) or _link_error(err):
                raise HostUnreachable(self.host.name, f"the Kubernetes API server did not answer {what} "
                                                      f"({type(err).__name__}: {err})") from None
            raise DeployError(f"{what}: an answer the client could not read ({type(err).__name__}: {err})") from None

    def _scale(self, client: int, replicas: int) -> None:
        self._call(f"scaling deployment {deployment_name(client)} to {replicas}",
                   self.apps.patch_namespaced_deployment_scale, deployment_name(client), self.namespace,
                   {"spec": {"replicas": replicas}})

    def _pods(self, labels: dict[str, str]) -> list[Any]:
        found = self._call(f"listing pods {label_query(labels)}", self.core.list_namespaced_pod, self.namespace,
                           label_selector=label_query(labels))
        return list(found.items or [])

    def _current(self, client: int) -> Any | None:
        """Client ``client``'s pod that is not being deleted (the newest, were there two)."""
        live = [p for p in self._pods(selector(client)) if p.metadata.deletion_timestamp is None]
        live.sort(key=lambda p: (p.metadata.creation_timestamp is not None, p.metadata.creation_timestamp))
        return live[-1] if live else None

    @staticmethod
    def _container(pod: Any) -> Any | None:
        for status in (pod.status.container_statuses or []) if pod.status else []:
            if status.name == CONTAINER:
                return status
        return None

    @classmethod
    def _running(cls, pod: Any) -> bool:
        c = cls._container(pod)
        return bool(pod.metadata.deletion_timestamp is None and c is not None and c.state and c.state.running)

    @classmethod
    def _exit_code(cls, pod: Any) -> int | None:
        c = cls._container(pod)
        if c is not None and c.state and c.state.terminated:
            return int(c.state.terminated.exit_code)
        return None

    @staticmethod
    def _client_of(pod: Any) -> int:
        return int(pod.metadata.labels[LABEL_CLIENT])

    def _pending_why(self, pod: Any | None) -> str:
        if pod is None:
            return "no pod was created (quota? the Deployment's events: kubectl describe deployment)"
        c = self._container(pod)
        if c is not None and c.state and c.state.waiting:
            return f"container waiting: {c.state.waiting.reason} {c.state.waiting.message or ''}".strip()
        for cond in (pod.status.conditions or []) if pod.status else []:
            if cond.status != "True" and cond.message:
                return f"pod {pod.status.phase}: {cond.reason}: {cond.message}"
        return f"pod {pod.status.phase if pod.status else 'without status'}"

    def _wait_gone(self, client: int, pod: Any, timeout: float) -> int | None:
        """Until ``pod`` is deleted; its container's exit code as last seen (None if never seen)."""
        name = pod.metadata.name
        code = self._exit_code(pod)
        deadline = time.monotonic() + timeout
        version = pod.metadata.resource_version
        while time.monotonic() < deadline:
            remaining = max(1, int(deadline - time.monotonic()))
            try:
                stream: Iterable[dict[str, Any]] = self._watch().stream(
                    self.core.list_namespaced_pod, self.namespace, field_selector=f"metadata.name={name}",
                    resource_version=version, timeout_seconds=remaining, _request_timeout=remaining + 5)
                for event in stream:
                    obj = event["object"]
                    seen = self._exit_code(obj)
                    if seen is not None and code is None:  # it exited: its last words, before the pod goes
                        self._last_logs[client] = self._read_log(name) or self._last_logs.get(client, "")
                    code = seen if seen is not None else code
                    if event["type"] == "DELETED":
                        return code
                    version = obj.metadata.resource_version or version
            except Exception as err:  # a broken watch: the list below tells whether the API still answers
                if getattr(err, "status", None) == 410:  # resource version too old
                    version = None
                time.sleep(self.poll)
            if all(p.metadata.name != name for p in self._pods(selector(client))):
                return code  # gone between two watches
        raise DeployError(f"client {client}'s pod {name} was still there {timeout:.0f} s after it was scaled to 0 "
                          f"(its node {self.host.k8s_node or self.host.name} may be unreachable)")

    def _read_log(self, pod_name: str) -> str:
        try:
            return str(self.core.read_namespaced_pod_log(pod_name, self.namespace, container=CONTAINER,
                                                         _request_timeout=self.request_timeout))
        except Exception:  # a pod that went away meanwhile: its output is lost with it
            return ""

    # --- HostEngine ---------------------------------------------------------------------------------

    def reachable(self, timeout: float = 2.0) -> str | None:
        try:
            self.core.list_namespaced_pod(self.namespace, limit=1, label_selector=f"{LABEL_NAME}={APP}",
                                          _request_timeout=timeout)
        except Exception as err:
            status = getattr(err, "status", None)
            if status in (401, 403):
                return f"the Kubernetes API server refused to list pods ({status}): {RBAC_HINT}"
            return f"the Kubernetes API server did not answer in {timeout:g} s ({type(err).__name__}: {err})"
        return None

    def start(self, launch: NodeLaunch) -> None:
        """Scale client ``launch.client``'s Deployment to 1 and return once its container runs.
        The Deployment, its Secret and its node config are the applied manifests' (built from the
        same :class:`NodeLaunch` by :mod:`deploy.k8s`); this Role cannot change them."""
        client = launch.client
        deadline = time.monotonic() + self.start_timeout
        # Recreate governs rollouts only: a scale 0 -> 1 makes the new pod while the old one still
        # terminates, and the SuperLink refuses a second session with one key. Wait for the old.
        for old in [p for p in self._pods(selector(client)) if p.metadata.deletion_timestamp is not None]:
            self._wait_gone(client, old, max(1.0, deadline - time.monotonic()))
        self._last_logs.pop(client, None)
        self._scale(client, 1)
        pod = None
        while time.monotonic() < deadline:
            pod = self._current(client)
            if pod is not None and self._running(pod):
                return
            c = self._container(pod) if pod is not None else None
            if c is not None and c.state and c.state.waiting and c.state.waiting.reason in (
                    "CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError",
                    "InvalidImageName"):
                raise DeployError(f"client {client}'s SuperNode on host {self.host.name} cannot start: "
                                  f"{self._pending_why(pod)}")
            time.sleep(self.poll)
        raise HostUnreachable(self.host.name, f"client {client}'s pod did not run within {self.start_timeout:g} s: "
                                              f"{self._pending_why(pod)}")

    def signal(self, client: int, sig: int) -> None:
        """SIGTERM: scale to 0 (the kubelet sends it, SIGKILL after the grace); SIGKILL: delete the
        pod with no grace (``--allow-kill``). Kubernetes sends no other signal."""
        if sig == signals.SIGTERM:
            self._scale(client, 0)
        elif sig == signals.SIGKILL:
            self._kill_allowed()
            pod = self._current(client)
            self._scale(client, 0)
            if pod is not None:
                self._delete_now(pod)
        else:
            raise DeployError(f"signal {sig}: Kubernetes sends a pod SIGTERM (scale to 0) or SIGKILL (delete with "
                              "no grace), no other")

    def _kill_allowed(self) -> None:
        if not self.allow_kill:
            raise DeployError("a crash (SIGKILL) deletes the pod with no grace: make the manifests with "
                              "python -m deploy k8s --allow-kill (the Role's pods delete) and pass allow_kill=True")

    def _delete_now(self, pod: Any) -> None:
        self._call(f"deleting pod {pod.metadata.name}", self.core.delete_namespaced_pod, pod.metadata.name,
                   self.namespace, grace_period_seconds=0, missing_ok=True)

    def stop(self, client: int, grace: float) -> int | None:
        """Scale to 0: SIGTERM, SIGKILL after the Deployment's terminationGracePeriodSeconds
        (:data:`deploy.k8s.GRACE_S`; a shorter ``grace`` deletes the pod with that grace, with
        ``--allow-kill``); returns once the pod is gone, with its container's exit code."""
        pod = self._current(client)
        self._scale(client, 0)
        if pod is None or not self._running(pod):
            return None
        self._last_logs[client] = self._read_log(pod.metadata.name)
        if grace < GRACE_S and self.allow_kill:
            self._call(f"deleting pod {pod.metadata.name}", self.core.delete_namespaced_pod, pod.metadata.name,
                       self.namespace, grace_period_seconds=max(0, int(grace)), missing_ok=True)
        return self._wait_gone(client, pod, max(grace, GRACE_S) + 60.0)

    def kill(self, client: int) -> int | None:
        self._kill_allowed()
        pod = self._current(client)
        self._scale(client, 0)
        if pod is None:
            return None
        self._last_logs[client] = self._read_log(pod.metadata.name)
        self._delete_now(pod)
        return self._wait_gone(client, pod, 60.0)

    def running(self) -> set[int]:
        pods = self._pods({LABEL_NAME: APP, LABEL_HOST: self.host.name})
        return {self._client_of(p) for p in pods if self._running(p) and self._client_of(p) in self.host.clients}

    def state(self, client: int) -> str:
        pod = self._current(client)
        if pod is not None:
            if self._running(pod):
                return "running"
            return "exited" if self._exit_code(pod) is not None else "created"
        scale = self._call(f"reading deployment {deployment_name(client)}'s scale",
                           self.apps.read_namespaced_deployment_scale, deployment_name(client), self.namespace,
                           missing_ok=True)
        return "absent" if scale is None else "exited"

    def started_at(self, client: int) -> str | None:
        pod = self._current(client)
        c = self._container(pod) if pod is not None else None
        if c is None or not (c.state and c.state.running) or c.state.running.started_at is None:
            return None
        started = c.state.running.started_at
        return started.isoformat() if hasattr(started, "isoformat") else str(started)

    def logs(self, client: int) -> str:
        pod = self._current(client)
        if pod is not None:
            return self._read_log(pod.metadata.name)
        return self._last_logs.get(client, "")

    def close(self) -> None:
        """Scale every client of this host to 0 (the objects stay: ``kubectl delete -f DIR``)."""
        for client in self.host.clients:
            self._call(f"scaling deployment {deployment_name(client)} to 0", self.apps.patch_namespaced_deployment_scale,
                       deployment_name(client), self.namespace, {"spec": {"replicas": 0}}, missing_ok=True)


if TYPE_CHECKING:
    def _is_a_host_engine(engine: KubernetesEngine) -> HostEngine:  # mypy checks the protocol
        return engine
