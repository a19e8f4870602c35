"""Pure builders of the objects a job owns: one pod per node, a headless Service, a token Secret.

Each pod is the replica group's pod template with the first container's entrypoint
replaced by the trainguard agent wrapping the user's command::

    python -m trainguard.agent --node-id node-1 --incarnation $(TRAINGUARD_POD_NAME)
        --token-env TRAINGUARD_AGENT_TOKEN --host $(TRAINGUARD_POD_IP) --port 8471
        --log-dir ... --env ... -- <user argv>

The pod's name is the agent's incarnation: a status from an earlier pod of the same
node id is never taken for its successor's.

The operator (not Kubernetes) restarts workers, so ``restartPolicy: Never``. Pods only
land on nodes whose health label is absent or healthy, and never on ``avoid_hosts``.
"""

from __future__ import annotations

import base64
import copy
import json
import sys
from collections.abc import Sequence
from typing import Any

from trainguard.agent.warm import StartOptions
from trainguard.kube.config import (
    GROUP,
    KIND,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_NODE,
    MANAGER,
    POD_IP_ENV,
    POD_NAME_ENV,
    TOKEN_ENV,
    TOKEN_KEY,
    VERSION,
    OperatorConfig,
)
from trainguard.spec import NodeGroupPlan, TrainingJob

Obj = dict[str, Any]

HOSTNAME_LABEL = "kubernetes.io/hostname"


def service_name(job: str) -> str:
    return job


def secret_name(job: str) -> str:
    return f"{job}-agent-token"


def pod_name(job: str, node_id: str, attempt: int, suffix: str) -> str:
    """``<job>-<node>-a<attempt>-<suffix>``: a new name for every pod (re)creation."""
    return f"{job}-{node_id}-a{attempt}-{suffix}"


def job_selector(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, LABEL_MANAGED: MANAGER}


def owner_reference(body: Obj) -> list[Obj]:
    """An ownerReference to the TrainingJob (none when the server gave it no uid)."""
    meta = body.get("metadata") or {}
    if not meta.get("uid"):
        return []
    return [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": meta["name"],
            "uid": meta["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def pod_argv(group: NodeGroupPlan) -> list[str]:
    """The worker argv inside the pod: the local plan's, with the image's ``python``.

    The plan resolves ``python`` and launcher lines to this interpreter's path; in a
    pod the image's ``python`` runs them. ``$`` is doubled because Kubernetes expands
    ``$(VAR)`` in a container's command and the plan has expanded them already.
    """
    argv = list(group.command)
    if argv and argv[0] == sys.executable:
        argv[0] = "python"
    return [arg.replace("$", "$$") for arg in argv]


def node_pod(
    job: TrainingJob,
    body: Obj,
    group_index: int,
    group: NodeGroupPlan,
    node_id: str,
    name: str,
    attempt: int,
    settings: OperatorConfig,
    avoid_hosts: Sequence[str] = (),
) -> Obj:
    """The pod of one node (``body`` is the TrainingJob as stored, for its raw template)."""
    job_name = job.metadata.name
    namespace = job.metadata.namespace
    template = copy.deepcopy(body["spec"]["replicaSpecs"][group_index]["template"])
    meta = template.get("metadata") or {}
    labels = {
        **(meta.get("labels") or {}),
        **job_selector(job_name),
        LABEL_NODE: node_id,
        LABEL_ATTEMPT: str(attempt),
    }
    spec = template["spec"]
    spec["restartPolicy"] = "Never"
    spec["hostname"] = node_id
    spec["subdomain"] = service_name(job_name)
    spec["affinity"] = _affinity(spec.get("affinity"), settings, avoid_hosts)
    container = spec["containers"][0]
    container.pop("args", None)
    container["command"] = [*_agent_argv(job, node_id, settings), "--", *pod_argv(group)]
    container["env"] = [
        *(container.get("env") or []),
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": secret_name(job_name), "key": TOKEN_KEY}},
        },
    ]
    ports = container.get("ports") or []
    container["ports"] = [*ports, {"name": "tg-agent", "containerPort": settings.agent_port}]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": labels,
            "annotations": meta.get("annotations") or {},
            "ownerReferences": owner_reference(body),
        },
        "spec": spec,
    }


def job_dir(job: TrainingJob, settings: OperatorConfig) -> str:
    return f"{settings.pod_job_root}/{job.metadata.namespace}/{job.metadata.name}"


def _agent_argv(job: TrainingJob, node_id: str, settings: OperatorConfig) -> list[str]:
    directory = job_dir(job, settings)
    memory = (
        f"{settings.pod_memory_root}/{job.metadata.namespace}-{job.metadata.name}/{node_id}/memory"
    )
    checkpoint = json.dumps(job.spec.checkpointing.env_json(f"{directory}/durable"))
    agent_env = {
        "TRAINGUARD_JOB_DIR": directory,
        "TRAINGUARD_CHECKPOINT_MEMORY_DIR": memory,
        "TRAINGUARD_CHECKPOINT_CONFIG": checkpoint.replace("$", "$$"),
    }
    argv = [
        "python",
        "-m",
        "trainguard.agent",
        "--node-id",
        node_id,
        "--incarnation",
        f"$({POD_NAME_ENV})",
        "--token-env",
        TOKEN_ENV,
        "--host",
        f"$({POD_IP_ENV})",
        "--port",
        str(settings.agent_port),
        "--log-dir",
        f"{settings.pod_log_dir}/$({POD_NAME_ENV})",
    ]
    for key, value in agent_env.items():
        argv += ["--env", f"{key}={value}"]
    options = job.spec.trainguard
    start = StartOptions(options.warm_start, tuple(options.preload_modules))
    return [*argv, *start.agent_flags()]


def _affinity(given: Obj | None, settings: OperatorConfig, avoid_hosts: Sequence[str]) -> Obj:
    """The template's affinity, with every required node term also asking for a healthy node."""
    affinity = copy.deepcopy(given or {})
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    key = settings.node_health_label
    health: list[list[Obj]] = [
        [{"key": key, "operator": "DoesNotExist"}],
        [{"key": key, "operator": "In", "values": list(settings.node_healthy_values)}],
    ]
    avoid: list[Obj] = (
        [{"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(avoid_hosts))}]
        if avoid_hosts
        else []
    )
    required["nodeSelectorTerms"] = [
        {**term, "matchExpressions": [*(term.get("matchExpressions") or []), *h, *avoid]}
        for term in terms
        for h in health
    ]
    return affinity


def headless_service(job: TrainingJob, body: Obj, settings: OperatorConfig) -> Obj:
    """Gives every pod the stable name ``<node-id>.<job>.<namespace>.svc``."""
    name = job.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": service_name(name),
            "namespace": job.metadata.namespace,
            "labels": job_selector(name),
            "ownerReferences": owner_reference(body),
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job_selector(name),
            "ports": [{"name": "tg-agent", "port": settings.agent_port}],
        },
    }


def token_secret(job: TrainingJob, body: Obj, token: str) -> Obj:
    """The agent API token of the job (pods read it from their environment)."""
    name = job.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name(name),
            "namespace": job.metadata.namespace,
            "labels": job_selector(name),
            "ownerReferences": owner_reference(body),
        },
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def secret_value(secret: Obj, key: str = TOKEN_KEY) -> str | None:
    data = secret.get("data") or {}
    if key in data:
        return base64.b64decode(data[key]).decode()
    value = (secret.get("stringData") or {}).get(key)
    return str(value) if value is not None else None
