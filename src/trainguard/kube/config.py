"""Names shared by the operator, the manifests and the CLI, and the operator's settings.

Every default lives here. The operator reads its settings from ``TRAINGUARD_*``
environment variables (set in its Deployment), so one image serves any cluster.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final

Obj = dict[str, Any]
"""A Kubernetes object as the API's JSON has it (camelCase keys)."""

GROUP: Final = "trainguard.dev"
VERSION: Final = "v1"
PLURAL: Final = "trainingjobs"
SINGULAR: Final = "trainingjob"
KIND: Final = "TrainingJob"
SHORT_NAMES: Final = ("tj",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"
API_VERSION_FULL: Final = f"{GROUP}/{VERSION}"
FINALIZER: Final = f"{GROUP}/cleanup"

# Labels on every object the operator makes for a job.
LABEL_JOB: Final = f"{GROUP}/job"
LABEL_NODE: Final = f"{GROUP}/node"
LABEL_ATTEMPT: Final = f"{GROUP}/attempt"
LABEL_MANAGED: Final = "app.kubernetes.io/managed-by"
MANAGER: Final = "trainguard"

# The pod env var holding the agent API token (from the job's Secret).
TOKEN_ENV: Final = "TRAINGUARD_AGENT_TOKEN"
TOKEN_KEY: Final = "token"
# The job's directory in every job pod (the agent's and its workers' env).
JOB_DIR_ENV: Final = "TRAINGUARD_JOB_DIR"
# Downward-API env vars of every job pod.
POD_IP_ENV: Final = "TRAINGUARD_POD_IP"
POD_NAME_ENV: Final = "TRAINGUARD_POD_NAME"

DEFAULT_NAMESPACE: Final = "trainguard-system"
# Where the operator runs jobs unless told otherwise (install's --job-namespace).
DEFAULT_JOB_NAMESPACE: Final = "default"
# What deploy/Dockerfile builds (`docker build -f deploy/Dockerfile -t trainguard:0.1.0 .`):
# a local name, for a cluster that has it (kind load docker-image); otherwise push it and
# pass --image (docs/kubernetes.md). Tagged with trainguard's version, never "latest".
DEFAULT_IMAGE: Final = "trainguard:0.1.0"

# Node health: HyperPod's two labels on every Kubernetes Node, under trainguard's prefix
# (GROUP) or, with OperatorConfig.hyperpod_labels, HyperPod's own; and the taint an
# unhealthy Node gets (its value: the Node's status), with the reason as an annotation.
HEALTH_STATUS_LABEL: Final = "node-health-status"
DEEP_HEALTH_LABEL: Final = "deep-health-check-status"
FAULT_TYPE_LABEL: Final = "fault-type"
FAULT_REASON_LABEL: Final = "fault-reason"
HYPERPOD_LABEL_PREFIX: Final = "sagemaker.amazonaws.com"
UNHEALTHY_TAINT: Final = f"{GROUP}/unhealthy"
HEALTH_REASON_ANNOTATION: Final = f"{GROUP}/node-health-reason"
# The health agent's DaemonSet (kube/health_agent.py): its name, labels, and the
# downward-API variable that names its Node.
HEALTH_AGENT_NAME: Final = "trainguard-health-agent"
HEALTH_AGENT_LABELS: Final = {
    "app.kubernetes.io/name": "trainguard",
    "app.kubernetes.io/component": "health-agent",
}
NODE_NAME_ENV: Final = "TRAINGUARD_NODE_NAME"

# The operator's Deployment, and its Service: /metrics, and the agents' pushed reports.
OPERATOR_NAME: Final = "trainguard-operator"
OPERATOR_SERVICE: Final = f"{OPERATOR_NAME}-metrics"
# Where a pod learns its own namespace.
SERVICE_ACCOUNT_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
# The Lease the operator's replicas elect their leader on (in the operator's namespace).
LEASE_NAME: Final = OPERATOR_NAME
# The labels of the operator's pods (job pods' NetworkPolicy lets these reach the agents).
OPERATOR_LABELS: Final = {
    "app.kubernetes.io/name": "trainguard",
    "app.kubernetes.io/component": "operator",
}


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of the operator; each field can be set by ``TRAINGUARD_<FIELD_UPPER>``."""

    # Node health labels: <prefix>/node-health-status and <prefix>/deep-health-check-status
    # under trainguard.dev, or HyperPod's sagemaker.amazonaws.com with hyperpod_labels.
    # Job pods only go to Nodes whose status label is absent or one of
    # node_healthy_values (required), and prefer deep-health-check-status Passed.
    hyperpod_labels: bool = False
    node_healthy_values: tuple[str, ...] = ("Schedulable",)
    # The operator labels and taints the Node of a job node found unhealthy, and moves a
    # job's pods off Nodes labelled UnschedulablePendingReplacement (or ...Reboot) by
    # others: a ClusterRole on nodes (get, list, patch). False: no rights on nodes.
    node_labels: bool = True
    # Ports inside every job pod: the agent API, and the base of the per-attempt rendezvous.
    agent_port: int = 8471
    rendezvous_port_base: int = 29500
    rendezvous_port_span: int = 1000
    # Paths inside job pods: agent logs, the memory checkpoint tier, the job dir
    # (TRAINGUARD_JOB_DIR; durable checkpoints default to <job dir>/durable).
    pod_log_dir: str = "/tmp/trainguard/logs"
    pod_memory_root: str = "/dev/shm/trainguard"
    pod_job_root: str = "/tmp/trainguard/jobs"
    # The patience of the operator with agents: the timeout of every request to one, and
    # how many contacts in a row (polls or requests) may go unanswered before a node that
    # answered before is lost.
    agent_timeout_seconds: float = 5.0
    unreachable_after_polls: int = 3
    # Where the operator serves /metrics (0: not at all).
    metrics_port: int = 9090
    # Where the operator takes the statuses agents push (one server for every job): bound
    # to report_host:report_port, reached by pods at report_url ("": the operator's
    # Service, see report_base_url). Unreachable, nothing breaks: the operator polls too.
    report_host: str = "0.0.0.0"
    report_port: int = 8472
    report_url: str = ""
    # The operator's own namespace: a job's NetworkPolicy lets the operator's pods there
    # reach the agents ("": the one of the operator's service account, see namespace()).
    operator_namespace: str = ""
    # Give every job a NetworkPolicy: its pods take traffic only from each other (any
    # port: rendezvous, NCCL, replica pushes) and from the operator (the agent port).
    network_policy: bool = True
    # Run pod templates that ask for privileged containers, host namespaces, hostPath
    # volumes, privilege escalation or added capabilities (refused when False).
    allow_privileged_pods: bool = False
    # Replicas of the operator elect a leader on a Lease in the operator's namespace
    # (kube/leader.py); only the leader runs jobs. A leader silent for lease_seconds is
    # replaced, and its successor adopts the running jobs (kube/adopt.py).
    leader_election: bool = True
    lease_seconds: float = 15.0

    @property
    def label_prefix(self) -> str:
        return HYPERPOD_LABEL_PREFIX if self.hyperpod_labels else GROUP

    @property
    def health_label(self) -> str:
        """The key of a Node's ``node-health-status`` label."""
        return f"{self.label_prefix}/{HEALTH_STATUS_LABEL}"

    @property
    def deep_health_label(self) -> str:
        """The key of a Node's ``deep-health-check-status`` label."""
        return f"{self.label_prefix}/{DEEP_HEALTH_LABEL}"

    @property
    def fault_type_label(self) -> str:
        """The key of a Node's ``fault-type`` label (beside ``node-health-status``)."""
        return f"{self.label_prefix}/{FAULT_TYPE_LABEL}"

    @property
    def fault_reason_label(self) -> str:
        """The key of a Node's ``fault-reason`` label (beside ``node-health-status``)."""
        return f"{self.label_prefix}/{FAULT_REASON_LABEL}"

    def namespace(self) -> str:
        """The operator's namespace: the setting, else its service account's, else the default."""
        if self.operator_namespace:
            return self.operator_namespace
        try:
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() or DEFAULT_NAMESPACE
        except OSError:
            return DEFAULT_NAMESPACE

    def report_base_url(self, namespace: str = DEFAULT_NAMESPACE) -> str:
        """The URL pods push their reports to, for an operator installed in ``namespace``."""
        return self.report_url or f"http://{OPERATOR_SERVICE}.{namespace}.svc:{self.report_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        """Defaults overridden by ``TRAINGUARD_*`` variables; ValueError names a bad one."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            key = f"TRAINGUARD_{f.name.upper()}"
            if key not in env:
                continue
            raw = env[key]
            default = getattr(cls(), f.name)
            try:
                if isinstance(default, tuple):
                    values[f.name] = tuple(v.strip() for v in raw.split(",") if v.strip())
                elif isinstance(default, bool):
                    values[f.name] = _boolean(raw)
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                elif isinstance(default, float):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw
            except ValueError:
                raise ValueError(f"{key}: not a valid {type(default).__name__}: {raw!r}") from None
        return cls(**values)  # type: ignore[arg-type]

    def to_env(self) -> dict[str, str]:
        """The variables that reproduce this config (for the operator's Deployment)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                text = ",".join(value)
            elif isinstance(value, bool):
                text = "true" if value else "false"
            else:
                text = str(value)
            out[f"TRAINGUARD_{f.name.upper()}"] = text
        return out


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes"):
        return True
    if word in ("0", "false", "no"):
        return False
    raise ValueError(text)
