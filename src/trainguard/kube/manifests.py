"""What `trainguard install` applies: the CRD, the operator's identity, rights and Deployment.

RBAC is least privilege for what the operator does (every call is in ``kube/api.py``):

- TrainingJobs: kopf lists, watches and patches them (finalizer, its progress), the
  operator deletes expired ones and patches their ``status``;
- pods: list, create, delete (never read one, never exec);
- Services: create, delete (a job's headless Service);
- Secrets: get, create, delete, used on the job's agent-token Secret only (Kubernetes
  cannot name a Secret that does not exist yet in a rule, so the verbs are on the kind);
- Events: create; NetworkPolicies (unless turned off): create, delete (one per job);
- Kueue's Workloads: get, create, delete, one per job labelled with a Kueue queue
  (``kube/kueue.py``; nothing is asked of a cluster without Kueue).

The rights are a Role and RoleBinding in each namespace the operator runs jobs in
(``job_namespaces``, default ``default``); only ``all_namespaces`` makes them a
ClusterRole and ClusterRoleBinding, and the operator then watches every namespace.
In its own namespace, a Role on Leases (get, create, update) lets its two replicas
elect a leader (``kube/leader.py``).

One ClusterRole even in a namespaced install: Nodes are cluster-scoped, and a Role
cannot grant rights on them. The operator reads and writes node health labels and
taints (``kube/node_health.py``): nodes get, list, patch; never create, delete, watch.
An elastic job's capacity (``kube/capacity.py``) is what the Nodes' allocatable
resources hold less what the pods bound to them request: so the same ClusterRole lists
pods in every namespace (list only: never get, watch, nor any other verb). ``node_labels``
off (``--no-node-labels``) leaves it out, and the operator then neither labels Nodes nor
reads them.

kopf's cluster scanning is off, so no rights on CRDs or namespaces. The health agent's
DaemonSet (``--health-agent``) is :mod:`trainguard.kube.health_manifests`. The Helm
chart in ``deploy/helm/trainguard`` renders the same objects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import yaml

from trainguard.kube.config import (
    DEFAULT_IMAGE,
    DEFAULT_JOB_NAMESPACE,
    DEFAULT_NAMESPACE,
    GROUP,
    OPERATOR_LABELS,
    OPERATOR_NAME,
    OPERATOR_SERVICE,
    PLURAL,
    Obj,
    OperatorConfig,
)
from trainguard.kube.crd import crd
from trainguard.kube.health_manifests import HealthAgentOptions, health_agent_objects

LIVENESS_PORT = 8080
_LABELS = dict(OPERATOR_LABELS)
_RBAC = "rbac.authorization.k8s.io"

RBAC_RULES: list[Obj] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["list", "watch", "patch", "delete"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "create", "delete"]},
    {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "delete"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "delete"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {
        "apiGroups": ["kueue.x-k8s.io"],
        "resources": ["workloads"],
        "verbs": ["get", "create", "delete"],
    },
]
LEASE_RULES: list[Obj] = [
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "create", "update"],
    },
]
NODE_RULES: list[Obj] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
]
NODES_ROLE = f"{OPERATOR_NAME}-nodes"
NETWORK_POLICY_RULE: Obj = {
    "apiGroups": ["networking.k8s.io"],
    "resources": ["networkpolicies"],
    "verbs": ["create", "delete"],
}


def rbac_rules(settings: OperatorConfig) -> list[Obj]:
    """What the operator may do in a namespace it runs jobs in."""
    return [*RBAC_RULES, *([NETWORK_POLICY_RULE] if settings.network_policy else [])]


def rbac_objects(
    namespace: str,
    settings: OperatorConfig,
    job_namespaces: Sequence[str] = (DEFAULT_JOB_NAMESPACE,),
    all_namespaces: bool = False,
) -> list[Obj]:
    """A Role and RoleBinding per job namespace; with ``all_namespaces``, one ClusterRole
    and ClusterRoleBinding instead. The subject is the operator's ServiceAccount."""
    subject = {"kind": "ServiceAccount", "name": OPERATOR_NAME, "namespace": namespace}
    if all_namespaces:
        scopes: list[tuple[str, Obj]] = [("Cluster", {})]
    else:
        scopes = [("", {"namespace": ns}) for ns in dict.fromkeys(job_namespaces)]
    objects: list[Obj] = []
    for prefix, where in scopes:
        meta = {"name": OPERATOR_NAME, **where, "labels": dict(_LABELS)}
        objects += [
            {
                "apiVersion": f"{_RBAC}/v1",
                "kind": f"{prefix}Role",
                "metadata": dict(meta),
                "rules": rbac_rules(settings),
            },
            {
                "apiVersion": f"{_RBAC}/v1",
                "kind": f"{prefix}RoleBinding",
                "metadata": dict(meta),
                "roleRef": {"apiGroup": _RBAC, "kind": f"{prefix}Role", "name": OPERATOR_NAME},
                "subjects": [dict(subject)],
            },
        ]
    return objects


def node_objects(namespace: str) -> list[Obj]:
    """The ClusterRole on nodes and its ClusterRoleBinding (see the module docstring)."""
    meta = {"name": NODES_ROLE, "labels": dict(_LABELS)}
    subject = {"kind": "ServiceAccount", "name": OPERATOR_NAME, "namespace": namespace}
    return [
        {
            "apiVersion": f"{_RBAC}/v1",
            "kind": "ClusterRole",
            "metadata": dict(meta),
            "rules": NODE_RULES,
        },
        {
            "apiVersion": f"{_RBAC}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": _RBAC, "kind": "ClusterRole", "name": NODES_ROLE},
            "subjects": [subject],
        },
    ]


def leader_objects(namespace: str) -> list[Obj]:
    """The Role and RoleBinding on Leases in the operator's own namespace."""
    name = f"{OPERATOR_NAME}-leader"
    meta = {"name": name, "namespace": namespace, "labels": dict(_LABELS)}
    subject = {"kind": "ServiceAccount", "name": OPERATOR_NAME, "namespace": namespace}
    return [
        {"apiVersion": f"{_RBAC}/v1", "kind": "Role", "metadata": dict(meta), "rules": LEASE_RULES},
        {
            "apiVersion": f"{_RBAC}/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": _RBAC, "kind": "Role", "name": name},
            "subjects": [subject],
        },
    ]


def operator_objects(
    namespace: str = DEFAULT_NAMESPACE,
    image: str = DEFAULT_IMAGE,
    settings: OperatorConfig | None = None,
    job_namespaces: Sequence[str] = (DEFAULT_JOB_NAMESPACE,),
    all_namespaces: bool = False,
    health_agent: HealthAgentOptions | None = None,
) -> list[Obj]:
    """The operator's Namespace, ServiceAccount, Role(s) and binding(s) (see
    :func:`rbac_objects`; :func:`node_objects`), Deployment and Service; then the health
    agent's objects, when asked for.

    The operator watches ``job_namespaces`` (or every namespace). The Service serves its
    metrics and takes the reports the agents of every job push (at
    ``TRAINGUARD_REPORT_URL``, this Service's name in ``namespace``).
    """
    settings = replace(settings or OperatorConfig(), operator_namespace=namespace)
    meta = {"namespace": namespace, "labels": dict(_LABELS)}
    variables = {
        **settings.to_env(),
        "TRAINGUARD_REPORT_URL": settings.report_base_url(namespace),
    }
    env = [{"name": k, "value": v} for k, v in sorted(variables.items())]
    scope = (
        ["--all-namespaces"]
        if all_namespaces
        else [arg for ns in dict.fromkeys(job_namespaces) for arg in ("--namespace", ns)]
    )
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": OPERATOR_NAME, **meta}},
        *rbac_objects(namespace, settings, job_namespaces, all_namespaces),
        *(node_objects(namespace) if settings.node_labels else []),
        *(leader_objects(namespace) if settings.leader_election else []),
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": OPERATOR_NAME, **meta},
            "spec": {
                # A leader and a standby (kube/leader.py): only the leader runs jobs.
                "replicas": 2 if settings.leader_election else 1,
                "selector": {"matchLabels": dict(_LABELS)},
                "template": {
                    "metadata": {"labels": dict(_LABELS)},
                    "spec": {
                        "serviceAccountName": OPERATOR_NAME,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532},
                        "containers": [_operator_container(image, env, settings, scope)],
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
        *(
            health_agent_objects(namespace, image, settings, health_agent)
            if health_agent is not None
            else []
        ),
    ]


def _operator_container(
    image: str, env: list[Obj], settings: OperatorConfig, scope: list[str]
) -> Obj:
    return {
        "name": "operator",
        "image": image,
        "command": ["python", "-m", "trainguard.kube.operator"],
        "args": [*scope, "--liveness-port", str(LIVENESS_PORT)],
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
        # Only the leader is ready: the Service sends agents' reports and scrapes to it.
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "healthz"},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
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
    job_namespaces: Sequence[str] = (DEFAULT_JOB_NAMESPACE,),
    all_namespaces: bool = False,
    health_agent: HealthAgentOptions | None = None,
) -> list[Obj]:
    """The CRD first (the rest may refer to it), then the operator's objects."""
    return [
        crd(),
        *operator_objects(namespace, image, settings, job_namespaces, all_namespaces, health_agent),
    ]


def to_yaml(objects: list[Obj]) -> str:
    """A multi-document YAML stream, as ``kubectl apply -f -`` reads it."""
    return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objects)


__all__ = [
    "LEASE_RULES",
    "NETWORK_POLICY_RULE",
    "NODES_ROLE",
    "NODE_RULES",
    "RBAC_RULES",
    "all_objects",
    "leader_objects",
    "node_objects",
    "operator_objects",
    "rbac_objects",
    "rbac_rules",
    "to_yaml",
]
