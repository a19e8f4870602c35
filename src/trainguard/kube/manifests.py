"""What `trainguard install` applies: the CRD, the operator's identity, rights and Deployment.

RBAC is least privilege for what the operator does: watch and patch TrainingJobs
(and their status), make and delete the pods, Services and token Secrets of jobs,
and record Events. kopf's cluster scanning is off, so no rights on CRDs or namespaces.
The Helm chart in ``deploy/helm/trainguard`` renders the same objects.
"""

from __future__ import annotations

from typing import Any

import yaml

from trainguard.kube.config import (
    DEFAULT_IMAGE,
    DEFAULT_NAMESPACE,
    GROUP,
    MANAGER,
    OPERATOR_NAME,
    OPERATOR_SERVICE,
    PLURAL,
    OperatorConfig,
)
from trainguard.kube.crd import crd

Obj = dict[str, Any]

LIVENESS_PORT = 8080
_LABELS = {"app.kubernetes.io/name": "trainguard", "app.kubernetes.io/component": "operator"}

RBAC_RULES: list[Obj] = [
    {
        "apiGroups": [GROUP],
        "resources": [PLURAL],
        "verbs": ["get", "list", "watch", "patch", "update", "delete"],
    },
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch", "update"]},
    {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["get", "list", "watch", "create", "delete"],
    },
    {"apiGroups": [""], "resources": ["services", "secrets"], "verbs": ["get", "create", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
]


def operator_objects(
    namespace: str = DEFAULT_NAMESPACE,
    image: str = DEFAULT_IMAGE,
    settings: OperatorConfig | None = None,
) -> list[Obj]:
    """The operator's Namespace, ServiceAccount, ClusterRole(Binding), Deployment, Service.

    The Service serves the operator's metrics and takes the reports the agents of every
    job push (at ``TRAINGUARD_REPORT_URL``, this Service's name in ``namespace``).
    """
    settings = settings or OperatorConfig()
    meta = {"namespace": namespace, "labels": dict(_LABELS)}
    variables = {
        **settings.to_env(),
        "TRAINGUARD_REPORT_URL": settings.report_base_url(namespace),
    }
    env = [{"name": k, "value": v} for k, v in sorted(variables.items())]
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_NAME, **meta}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": OPERATOR_NAME, "labels": dict(_LABELS)},
            "rules": RBAC_RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": OPERATOR_NAME, "labels": dict(_LABELS)},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": OPERATOR_NAME,
            },
            "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_NAME, "namespace": namespace}],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": OPERATOR_NAME, **meta},
            "spec": {
                "replicas": 1,  # the job controllers live in this process: one at a time
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": dict(_LABELS)},
                "template": {
                    "metadata": {"labels": dict(_LABELS)},
                    "spec": {
                        "serviceAccountName": OPERATOR_NAME,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                        "containers": [_operator_container(image, env, settings)],
                        # The root filesystem is read-only; Python and kopf get a /tmp.
                        "volumes": [{"name": "tmp", "emptyDir": {}}],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": OPERATOR_SERVICE, **meta},
            "spec": {
                "selector": dict(_LABELS),
                "ports": [
                    {"name": "metrics", "port": settings.metrics_port},
                    {"name": "reports", "port": settings.report_port},
                ],
            },
        },
    ]


def _operator_container(image: str, env: list[Obj], settings: OperatorConfig) -> Obj:
    return {
        "name": "operator",
        "image": image,
        "command": ["python", "-m", "trainguard.kube.operator", "--all-namespaces"],
        "args": ["--liveness-port", str(LIVENESS_PORT)],
        "env": env,
        "ports": [
            {"name": "metrics", "containerPort": settings.metrics_port},
            {"name": "reports", "containerPort": settings.report_port},
            {"name": "healthz", "containerPort": LIVENESS_PORT},
        ],
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "healthz"},
            "periodSeconds": 30,
            "timeoutSeconds": 10,
        },
        "resources": {
            "requests": {"cpu": "100m", "memory": "256Mi"},
            "limits": {"memory": "1Gi"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def all_objects(
    namespace: str = DEFAULT_NAMESPACE,
    image: str = DEFAULT_IMAGE,
    settings: OperatorConfig | None = None,
) -> list[Obj]:
    """The CRD first (the rest may refer to it), then the operator's objects."""
    return [crd(), *operator_objects(namespace, image, settings)]


def to_yaml(objects: list[Obj]) -> str:
    """A multi-document YAML stream, as ``kubectl apply -f -`` reads it."""
    return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objects)


__all__ = ["MANAGER", "OPERATOR_NAME", "RBAC_RULES", "all_objects", "operator_objects", "to_yaml"]
