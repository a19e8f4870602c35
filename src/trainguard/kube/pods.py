"""Pure builders of the objects a job owns: one pod per node, a headless Service, a token
Secret and a NetworkPolicy.

Each pod is the replica group's pod template with the first container's entrypoint
replaced by the trainguard agent wrapping the user's command::

    python -m trainguard.agent --node-id node-1 --incarnation $(TRAINGUARD_POD_NAME)
        --token-env TRAINGUARD_AGENT_TOKEN --host $(TRAINGUARD_POD_IP) --port 8471
        --log-dir ... -- <user argv, its $(VAR) left for Kubernetes>

No value of the job's ``env`` is ever written into the command: the template's ``env``
(values, ``valueFrom.secretKeyRef``, ...) is passed to the container as written, the
agent's own variables (job dir, memory tier, checkpoint config) are added to it as
``$TRAINGUARD_JOB_ENV``, and Kubernetes expands the ``$(VAR)`` of the user's command
from it when the pod starts.

The pod's name is the agent's incarnation: a status from an earlier pod of the same
node id is never taken for its successor's.

The operator (not Kubernetes) restarts workers, so ``restartPolicy: Never``. Pods only
land on nodes whose ``node-health-status`` label is absent or healthy (required node
affinity; HyperPod's default), prefer nodes whose ``deep-health-check-status`` is
``Passed``, never land on ``avoid_hosts``, and never tolerate trainguard's unhealthy taint
(:mod:`trainguard.kube.node_labels`).
"""

from __future__ import annotations

import base64
import copy
import json
import sys
from collections.abc import Sequence

from trainguard.agent.jobenv import JOB_ENV_VAR, encode_job_env
from trainguard.agent.persist import CONFIG_ENV, MEMORY_DIR_ENV
from trainguard.agent.train_scripts import TrainScripts
from trainguard.agent.warm import StartOptions
from trainguard.kube.config import (
    GROUP,
    JOB_DIR_ENV,
    KIND,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_MANAGED,
    LABEL_NODE,
    MANAGER,
    OPERATOR_LABELS,
    POD_IP_ENV,
    POD_NAME_ENV,
    TOKEN_ENV,
    TOKEN_KEY,
    VERSION,
    Obj,
    OperatorConfig,
)
from trainguard.kube.node_labels import untolerated
from trainguard.spec import NodeGroupPlan, TrainingJob

HOSTNAME_LABEL = "kubernetes.io/hostname"
DEEP_PASSED_WEIGHT = 100
"""The weight of the preference for a Node whose deep health checks passed (the most)."""


def service_name(job: str) -> str:
    return job


def secret_name(job: str) -> str:
    return f"{job}-agent-token"


def network_policy_name(job: str) -> str:
    return job


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


def _owned_meta(job: TrainingJob, body: Obj, name: str) -> Obj:
    """The metadata of an object the job owns: in its namespace, with its labels."""
    return {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": job_selector(job.metadata.name),
        "ownerReferences": owner_reference(body),
    }


def pod_argv(group: NodeGroupPlan) -> list[str]:
    """The worker argv inside the pod: the plan's (:func:`~trainguard.kube.plan.kube_plan`:
    ``$(VAR)`` unexpanded, a literal ``$`` as ``$$``), with the image's ``python``.

    The plan resolves ``python`` and launcher lines to this interpreter's path; in a
    pod the image's ``python`` runs them.
    """
    argv = list(group.command)
    if argv and argv[0] == sys.executable:
        argv[0] = "python"
    return argv


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
    if spec.get("tolerations"):
        spec["tolerations"] = untolerated(spec["tolerations"])
    container = spec["containers"][0]
    container.pop("args", None)
    container["command"] = [*_agent_argv(job, node_id, settings), "--", *pod_argv(group)]
    agent_env = encode_job_env(_agent_env(job, node_id, settings))[JOB_ENV_VAR]
    ours: list[Obj] = [
        # A literal value: `$` is doubled, as Kubernetes expands $(VAR) in env values.
        {"name": JOB_ENV_VAR, "value": agent_env.replace("$", "$$")},
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {
            "name": TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": secret_name(job_name), "key": TOKEN_KEY}},
        },
    ]
    names = {var["name"] for var in ours}
    given = [var for var in container.get("env") or [] if var.get("name") not in names]
    container["env"] = [*ours, *given]  # the template's env may refer to ours: $(VAR)
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


def _agent_env(job: TrainingJob, node_id: str, settings: OperatorConfig) -> dict[str, str]:
    """The variables the agent and its workers get besides the template's (handed to the
    agent in ``$TRAINGUARD_JOB_ENV``, see :mod:`trainguard.agent.jobenv`)."""
    directory = job_dir(job, settings)
    memory = (
        f"{settings.pod_memory_root}/{job.metadata.namespace}-{job.metadata.name}/{node_id}/memory"
    )
    checkpoint = json.dumps(job.spec.checkpointing.env_json(f"{directory}/durable"))
    return {
        JOB_DIR_ENV: directory,
        MEMORY_DIR_ENV: memory,
        CONFIG_ENV: checkpoint,
    }


def _agent_argv(job: TrainingJob, node_id: str, settings: OperatorConfig) -> list[str]:
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
    options = job.spec.trainguard
    scripts = TrainScripts(tuple(options.pre_train_script), tuple(options.post_train_script))
    start = StartOptions(options.warm_start, tuple(options.preload_modules), scripts)
    # The node's health checks and monitors (no connectivity peers here: that check is
    # skipped on a cluster, see the README's "Node health").
    health = ["--health", options.health_checks.settings().to_json()]
    return [*argv, *health, *start.agent_flags()]


def _affinity(given: Obj | None, settings: OperatorConfig, avoid_hosts: Sequence[str]) -> Obj:
    """The template's affinity, with every required node term also asking for a healthy
    node (and not one of ``avoid_hosts``), and a preference for a Node whose deep health
    checks passed."""
    affinity = copy.deepcopy(given or {})
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    key = settings.health_label
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
    passed = {"key": settings.deep_health_label, "operator": "In", "values": ["Passed"]}
    preferred = node.setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
    preferred.append({"weight": DEEP_PASSED_WEIGHT, "preference": {"matchExpressions": [passed]}})
    return affinity


def headless_service(job: TrainingJob, body: Obj, settings: OperatorConfig) -> Obj:
    """Gives every pod the stable name ``<node-id>.<job>.<namespace>.svc``."""
    name = job.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _owned_meta(job, body, service_name(name)),
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
        "metadata": _owned_meta(job, body, secret_name(name)),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def secret_value(secret: Obj, key: str = TOKEN_KEY) -> str | None:
    data = secret.get("data") or {}
    if key in data:
        return base64.b64decode(data[key]).decode()
    value = (secret.get("stringData") or {}).get(key)
    return str(value) if value is not None else None


def network_policy(job: TrainingJob, body: Obj, settings: OperatorConfig) -> Obj:
    """Who may reach the job's pods: each other, on any port (the rendezvous store on
    rank 0, NCCL/Gloo between workers, replica pushes to peer agents), and the operator's
    pods, on the agent port. Nothing else: other pods (other jobs' included) reach
    neither the agent API nor the unauthenticated rendezvous and collective ports.
    NetworkPolicies add up, so a policy of the namespace can let more in."""
    name = job.metadata.name
    operator = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": settings.namespace()}},
        "podSelector": {"matchLabels": dict(OPERATOR_LABELS)},
    }
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _owned_meta(job, body, network_policy_name(name)),
        "spec": {
            "podSelector": {"matchLabels": job_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": job_selector(name)}}]},
                {
                    "from": [operator],
                    "ports": [{"protocol": "TCP", "port": settings.agent_port}],
                },
            ],
        },
    }
