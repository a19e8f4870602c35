"""The health agent's objects (``trainguard install --health-agent``; the Helm chart's
``healthAgent.enabled``): a ServiceAccount, a ClusterRole on nodes (get, patch: it reads
and labels its own Node; RBAC cannot say "its own", see the README), its binding, and a
DaemonSet running ``python -m trainguard.kube.health_agent`` on every Node.

The agent's pod runs as a non-root user with a read-only root filesystem, no
capabilities and no hostPath: its checks write to an ``emptyDir`` (the Node's ephemeral
storage). It tolerates every taint (it must run on the Nodes it labels unhealthy, GPU
Nodes tainted ``nvidia.com/gpu`` included). Reading the kernel log (XID and NVRM lines
in ``/dev/kmsg``) needs the host's devices and CAP_SYSLOG: only ``kernel_log``
(``--health-agent-kernel-log``, ``healthAgent.kernelLog``) makes the container
privileged, as root, and passes ``--kmsg``; the agent's namespace must then allow
privileged pods (Pod Security "privileged").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from trainguard.kube.config import (
    HEALTH_AGENT_LABELS,
    HEALTH_AGENT_NAME,
    NODE_NAME_ENV,
    Obj,
    OperatorConfig,
)

__all__ = ["HEALTH_AGENT_RULES", "WORK_DIR", "HealthAgentOptions", "health_agent_objects"]

_RBAC: Final = "rbac.authorization.k8s.io"
WORK_DIR: Final = "/tmp/trainguard-health"
"""Where the agent's disk check writes (in its emptyDir)."""
HEALTH_AGENT_RULES: Final[list[Obj]] = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
]


@dataclass(frozen=True)
class HealthAgentOptions:
    """How the health agent's DaemonSet runs (see the module docstring)."""

    kernel_log: bool = False


def health_agent_objects(
    namespace: str, image: str, settings: OperatorConfig, options: HealthAgentOptions
) -> list[Obj]:
    """The ServiceAccount, ClusterRole, ClusterRoleBinding and DaemonSet."""
    labels = dict(HEALTH_AGENT_LABELS)
    meta = {"name": HEALTH_AGENT_NAME, "labels": dict(labels)}
    subject = {"kind": "ServiceAccount", "name": HEALTH_AGENT_NAME, "namespace": namespace}
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {**meta, "namespace": namespace},
        },
        {
            "apiVersion": f"{_RBAC}/v1",
            "kind": "ClusterRole",
            "metadata": dict(meta),
            "rules": HEALTH_AGENT_RULES,
        },
        {
            "apiVersion": f"{_RBAC}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": _RBAC, "kind": "ClusterRole", "name": HEALTH_AGENT_NAME},
            "subjects": [subject],
        },
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {**meta, "namespace": namespace},
            "spec": {
                "selector": {"matchLabels": dict(labels)},
                "template": {
                    "metadata": {"labels": dict(labels)},
                    "spec": _pod_spec(image, settings, options),
                },
            },
        },
    ]


def _pod_spec(image: str, settings: OperatorConfig, options: HealthAgentOptions) -> Obj:
    hyperpod = "true" if settings.hyperpod_labels else "false"
    if options.kernel_log:
        # /dev/kmsg: the host's devices (privileged) and CAP_SYSLOG (root).
        pod_context: Obj = {"runAsUser": 0}
        context: Obj = {"privileged": True, "readOnlyRootFilesystem": True}
    else:
        pod_context = {"runAsNonRoot": True, "runAsUser": 65532}
        context = {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
    return {
        "serviceAccountName": HEALTH_AGENT_NAME,
        "securityContext": pod_context,
        # Every Node, whatever its taints: the ones it labels unhealthy too.
        "tolerations": [{"operator": "Exists"}],
        "containers": [
            {
                "name": "health-agent",
                "image": image,
                "command": ["python", "-m", "trainguard.kube.health_agent"],
                "args": ["--work-dir", WORK_DIR, *(["--kmsg"] if options.kernel_log else [])],
                "env": [
                    {
                        "name": NODE_NAME_ENV,
                        "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                    },
                    {"name": "TRAINGUARD_HYPERPOD_LABELS", "value": hyperpod},
                ],
                "resources": {
                    "requests": {"cpu": "50m", "memory": "128Mi"},
                    "limits": {"memory": "1Gi"},
                },
                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                "securityContext": context,
            }
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
