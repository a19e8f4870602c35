"""The one module that talks to the Kubernetes API server.

Objects go in and come out as plain JSON dicts in the API's own camelCase form (as
``kubectl get -o json`` shows them), never as the client library's model classes, so
the rest of the package is independent of the ``kubernetes`` client's version. Every
call is synchronous; a failure is a :class:`KubeError` (``NotFound``, ``Conflict``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from trainguard.kube.config import GROUP, PLURAL, VERSION, Obj

# Per-request timeout (connect, read) in seconds.
DEFAULT_REQUEST_TIMEOUT = (5.0, 30.0)


class KubeError(Exception):
    """The API server refused a request or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class NotFound(KubeError):
    pass


class ConfigError(KubeError):
    """The kubeconfig (or the pod's service account) cannot be used."""


class Conflict(KubeError):
    pass


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class KubeApi:
    """Typed access to the few resources trainguard uses."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self._apply_apis: dict[str, Any] = {
            "apiextensions.k8s.io/v1": client.ApiextensionsV1Api(api_client),
            "rbac.authorization.k8s.io/v1": client.RbacAuthorizationV1Api(api_client),
            "apps/v1": client.AppsV1Api(api_client),
            "v1": self.core,
        }

    @classmethod
    def connect(cls, kubeconfig: str | None = None, context: str | None = None) -> KubeApi:
        """In a pod (and no kubeconfig given): its service account; else the kubeconfig."""
        configuration = client.Configuration()
        try:
            if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
            else:
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=kubeconfig, context=context, client_configuration=configuration
                )
        except (config.ConfigException, OSError, TypeError) as exc:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise ConfigError(f"cannot load the kubeconfig {where}: {exc}") from None
        return cls(client.ApiClient(configuration))

    @property
    def server(self) -> str:
        return str(self.api_client.configuration.host)

    # -- TrainingJobs ----------------------------------------------------------------

    def create_job(self, namespace: str, body: Obj) -> Obj:
        return self.create_object(GROUP, VERSION, namespace, PLURAL, body)

    def get_job(self, namespace: str, name: str) -> Obj:
        return self.get_object(GROUP, VERSION, namespace, PLURAL, name)

    def list_jobs(self, namespace: str | None) -> list[Obj]:
        if namespace is None:
            data = self._json(self.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
        else:
            data = self._json(
                self.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL
            )
        return list(data.get("items") or [])

    def patch_job_status(self, namespace: str, name: str, status: Obj) -> None:
        patch = self.custom.patch_namespaced_custom_object_status
        self._json(patch, GROUP, VERSION, namespace, PLURAL, name, {"status": status})

    def delete_job(self, namespace: str, name: str) -> None:
        self.delete_object(GROUP, VERSION, namespace, PLURAL, name)

    # -- pods, services, secrets, events ---------------------------------------------

    def create_pod(self, namespace: str, body: Obj) -> Obj:
        return self._json(self.core.create_namespaced_pod, namespace, body)

    def list_pods(self, namespace: str, selector: Mapping[str, str]) -> list[Obj]:
        text = ",".join(f"{k}={v}" for k, v in selector.items())
        data = self._json(self.core.list_namespaced_pod, namespace, label_selector=text)
        # Filtered here too: cheap, and correct against servers that ignore the selector.
        return [
            pod
            for pod in data.get("items") or []
            if matches(pod.get("metadata", {}).get("labels") or {}, selector)
        ]

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete a pod; one that is already gone is fine."""
        with contextlib.suppress(NotFound):
            self._json(self.core.delete_namespaced_pod, name, namespace)

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        raw = self._call(self.core.read_namespaced_pod_log, name, namespace, container=container)
        return raw.decode("utf-8", errors="replace")

    def create_service(self, namespace: str, body: Obj) -> Obj:
        return self._json(self.core.create_namespaced_service, namespace, body)

    def create_secret(self, namespace: str, body: Obj) -> Obj:
        return self._json(self.core.create_namespaced_secret, namespace, body)

    def read_secret(self, namespace: str, name: str) -> Obj:
        return self._json(self.core.read_namespaced_secret, name, namespace)

    def create_network_policy(self, namespace: str, body: Obj) -> Obj:
        return self._json(self.networking.create_namespaced_network_policy, namespace, body)

    def delete_owned(
        self, namespace: str, service: str, secret: str, network_policy: str | None = None
    ) -> None:
        """Delete a job's Service, Secret and NetworkPolicy (any may be gone already)."""
        calls: list[tuple[Callable[..., Any], str]] = [
            (self.core.delete_namespaced_service, service),
            (self.core.delete_namespaced_secret, secret),
        ]
        if network_policy is not None:
            calls.append((self.networking.delete_namespaced_network_policy, network_policy))
        for call, name in calls:
            with contextlib.suppress(NotFound):
                self._json(call, name, namespace)

    def create_event(self, namespace: str, body: Obj) -> None:
        self._json(self.core.create_namespaced_event, namespace, body)

    def list_events(self, namespace: str, involved_name: str) -> list[Obj]:
        data = self._json(
            self.core.list_namespaced_event,
            namespace,
            field_selector=f"involvedObject.name={involved_name}",
        )
        return [
            e
            for e in data.get("items") or []
            if (e.get("involvedObject") or {}).get("name") == involved_name
        ]

    # -- Nodes (cluster-scoped: node health labels and taints) --------------------------

    def get_node(self, name: str) -> Obj:
        return self._json(self.core.read_node, name)

    def list_nodes(self, label: str, values: Sequence[str]) -> list[Obj]:
        """The Nodes whose label ``label`` has one of ``values`` (a set-based selector)."""
        selector = f"{label} in ({','.join(values)})"
        data = self._json(self.core.list_node, label_selector=selector)
        # Filtered here too: cheap, and correct against servers that ignore the selector.
        return [
            node
            for node in data.get("items") or []
            if (node.get("metadata", {}).get("labels") or {}).get(label) in values
        ]

    def all_nodes(self) -> list[Obj]:
        """Every Node (an elastic job's capacity, ``kube/capacity.py``)."""
        return list(self._json(self.core.list_node).get("items") or [])

    def bound_pods(self) -> list[Obj]:
        """Every pod bound to a Node and not ended, in every namespace (what the Nodes'
        resources hold)."""
        selector = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
        data = self._json(self.core.list_pod_for_all_namespaces, field_selector=selector)
        return list(data.get("items") or [])

    def patch_node(self, name: str, patch: Obj) -> Obj:
        """A JSON merge patch of the Node (a list in it, such as ``spec.taints``, replaces
        the Node's; ``metadata.resourceVersion`` in it makes a changed Node a
        :class:`Conflict`)."""
        return self._json(
            self.core.patch_node, name, patch, _content_type="application/merge-patch+json"
        )

    # -- custom resources of other projects (Kueue's Workloads) --------------------------

    def get_object(self, group: str, version: str, namespace: str, plural: str, name: str) -> Obj:
        return self._json(
            self.custom.get_namespaced_custom_object, group, version, namespace, plural, name
        )

    def create_object(
        self, group: str, version: str, namespace: str, plural: str, body: Obj
    ) -> Obj:
        return self._json(
            self.custom.create_namespaced_custom_object, group, version, namespace, plural, body
        )

    def delete_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> None:
        self._json(
            self.custom.delete_namespaced_custom_object, group, version, namespace, plural, name
        )

    # -- the operators' leader election -----------------------------------------------

    def get_lease(self, namespace: str, name: str) -> Obj:
        return self._json(self.coordination.read_namespaced_lease, name, namespace)

    def create_lease(self, namespace: str, body: Obj) -> Obj:
        return self._json(self.coordination.create_namespaced_lease, namespace, body)

    def update_lease(self, namespace: str, name: str, body: Obj) -> Obj:
        """Write ``body``'s spec, on the condition that the Lease is still at ``body``'s
        resourceVersion (a merge patch that names it: the API server answers 409,
        :class:`Conflict`, when the Lease changed since it was read)."""
        version = (body.get("metadata") or {}).get("resourceVersion")
        patch = {"metadata": {"resourceVersion": version}, "spec": body.get("spec") or {}}
        return self._json(self.coordination.patch_namespaced_lease, name, namespace, patch)

    # -- install / uninstall -------------------------------------------------------

    def apply(self, obj: Obj) -> str:
        """Create ``obj``, or merge-patch it when it exists; returns what was done."""
        _kind, name, namespace = self._target(obj)
        create, patch, _ = self._verbs(obj)
        try:
            self._json(create, *([namespace] if namespace else []), obj)
            return "created"
        except Conflict:
            self._json(patch, name, *([namespace] if namespace else []), obj)
            return "configured"

    def remove(self, obj: Obj) -> str:
        """Delete ``obj``; returns ``deleted`` or ``not found``."""
        _kind, name, namespace = self._target(obj)
        _, _, delete = self._verbs(obj)
        try:
            self._json(delete, name, *([namespace] if namespace else []))
        except NotFound:
            return "not found"
        return "deleted"

    def _target(self, obj: Obj) -> tuple[str, str, str | None]:
        meta = obj.get("metadata") or {}
        return str(obj["kind"]), str(meta["name"]), meta.get("namespace")

    def _verbs(self, obj: Obj) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        api = self._apply_apis.get(str(obj.get("apiVersion")))
        if api is None:
            raise KubeError(f"cannot apply apiVersion {obj.get('apiVersion')!r}")
        snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in str(obj["kind"]))
        scope = "namespaced_" if (obj.get("metadata") or {}).get("namespace") else ""
        return (
            getattr(api, f"create_{scope}{snake[1:]}"),
            getattr(api, f"patch_{scope}{snake[1:]}"),
            getattr(api, f"delete_{scope}{snake[1:]}"),
        )

    # -- plumbing --------------------------------------------------------------------

    def _call(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes:
        try:
            response = call(
                *args, _preload_content=False, _request_timeout=DEFAULT_REQUEST_TIMEOUT, **kwargs
            )
        except ApiException as exc:
            raise _error(exc) from None
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # refused, reset, timed out
            raise KubeError(f"{self.server}: {exc}") from None
        return bytes(response.data)

    def _json(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Obj:
        raw = self._call(call, *args, **kwargs)
        data = json.loads(raw) if raw else {}
        return data if isinstance(data, dict) else {}


def _error(exc: ApiException) -> KubeError:
    message = str(exc.reason or "")
    body = exc.body
    if body:
        try:
            message = str(json.loads(body).get("message") or message)
        except (ValueError, AttributeError):
            message = str(body)[:300]
    status = int(exc.status) if exc.status else None
    text = f"{status} {message}".strip()
    if status == 404:
        return NotFound(text, status)
    if status == 409:
        return Conflict(text, status)
    return KubeError(text, status)
