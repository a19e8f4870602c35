"""How many of a job's pods the cluster's Nodes hold now: the capacity an elastic job is
told on Kubernetes. Pure: the platform lists the Nodes and the pods bound to them
(:class:`~trainguard.kube.elastic.NodeCapacity`) and asks :func:`capacity`.

A Node is **staying** (the job's pods there keep running) unless it is gone, cordoned
(``spec.unschedulable``), not ``Ready`` (a Node that reports no conditions at all counts
as ready), labelled ``node-health-status`` anything but ``Schedulable`` (HyperPod's
vocabulary, :mod:`trainguard.kube.node_labels`; no label: healthy), or tainted
``NoExecute`` where the pod does not tolerate it. It is **open** (a new pod may land
there) when it is staying, has no ``NoSchedule`` taint the pod does not tolerate, and
matches the pod's ``nodeSelector`` and required node affinity (``In``, ``NotIn``,
``Exists``, ``DoesNotExist``, ``Gt``, ``Lt`` on labels).

The capacity is, over open Nodes, how many copies of the pod's requests (``cpu``,
``memory``, ``nvidia.com/gpu``, any resource it asks for, and one of ``pods``) fit in
the Node's ``status.allocatable`` less what the other pods bound to it request (the
job's own pods are counted as copies, not as load); plus the job's pods on Nodes that
are staying but not open. A Node that reports no allocatable resources at all (an
emulated one) holds any number. The job's pods on Nodes that are not staying are
**leaving**: the job gives those nodes up ahead of the Node going away.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Final

from kubernetes.utils import parse_quantity

from trainguard.kube.config import Obj
from trainguard.kube.node_labels import SCHEDULABLE

__all__ = ["UNBOUNDED", "Capacity", "PodShape", "capacity", "pod_requests", "staying"]

UNBOUNDED: Final = 1 << 20
"""Pods a Node without allocatable resources holds (more than any job asks for)."""
ENDED: Final = ("Succeeded", "Failed")


def _quantity(value: object, where: str) -> Decimal:
    try:
        return Decimal(parse_quantity(value))  # type: ignore[no-untyped-call]
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ValueError(f"{where}: not a quantity: {value!r}") from exc


def pod_requests(spec: Mapping[str, Any]) -> dict[str, Decimal]:
    """What a pod asks the scheduler for: the sum over its containers of each resource's
    request (its limit where only that is given), at least each init container's, and
    one ``pods``."""
    total: dict[str, Decimal] = {}
    for container in spec.get("containers") or []:
        for name, amount in _container(container).items():
            total[name] = total.get(name, Decimal(0)) + amount
    for container in spec.get("initContainers") or []:
        for name, amount in _container(container).items():
            total[name] = max(total.get(name, Decimal(0)), amount)
    total["pods"] = Decimal(1)
    return {k: v for k, v in total.items() if v > 0}


def _container(container: Mapping[str, Any]) -> dict[str, Decimal]:
    resources = container.get("resources") or {}
    asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    where = f"container {container.get('name')!r} resources"
    return {str(k): _quantity(v, where) for k, v in asked.items()}


@dataclass(frozen=True)
class PodShape:
    """What decides where one of the job's pods may go and how much room it takes."""

    requests: Mapping[str, Decimal]
    selector: Mapping[str, str] = field(default_factory=dict)
    terms: Sequence[Obj] = ()  # required nodeSelectorTerms (any one; none: every Node)
    tolerations: Sequence[Obj] = ()

    @classmethod
    def of(cls, spec: Mapping[str, Any]) -> PodShape:
        """The shape of a pod with this ``spec`` (raises ValueError for bad quantities)."""
        affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or {}
        return cls(
            pod_requests(spec),
            dict(spec.get("nodeSelector") or {}),
            tuple(affinity.get("nodeSelectorTerms") or ()),
            tuple(spec.get("tolerations") or ()),
        )


@dataclass(frozen=True)
class Capacity:
    """The job's pods the Nodes hold now, and its nodes whose Node is going away."""

    pods: int
    leaving: tuple[str, ...] = ()  # job node ids, in the order given
    why: Mapping[str, str] = field(default_factory=dict)  # node id -> why it leaves
    pods_leaving: frozenset[str] = frozenset()  # their pods (a node's next pod is not)


def staying(
    node: Mapping[str, Any], health_key: str, tolerations: Sequence[Obj] = ()
) -> str | None:
    """Why the job's pods on this Node cannot stay (None: they can)."""
    spec, status = node.get("spec") or {}, node.get("status") or {}
    if spec.get("unschedulable"):
        return "cordoned"
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready" and condition.get("status") != "True":
            return f"not Ready ({condition.get('reason') or condition.get('status')})"
    health = ((node.get("metadata") or {}).get("labels") or {}).get(health_key)
    if health is not None and health != SCHEDULABLE:
        return f"labelled {health_key}={health}"
    return _taint(spec, tolerations, ("NoExecute",))


def _open(node: Mapping[str, Any], shape: PodShape) -> bool:
    labels = dict((node.get("metadata") or {}).get("labels") or {})
    name = (node.get("metadata") or {}).get("name")
    labels.setdefault("kubernetes.io/hostname", str(name))
    if any(labels.get(k) != v for k, v in shape.selector.items()):
        return False
    if shape.terms and not any(_term(t, labels) for t in shape.terms):
        return False
    return _taint(node.get("spec") or {}, shape.tolerations, ("NoSchedule",)) is None


def _term(term: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A node selector term's label expressions (field expressions are not read)."""
    for expr in term.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        value = labels.get(str(key))
        if op == "In":
            ok = value is not None and value in values
        elif op == "NotIn":
            ok = value not in values
        elif op == "Exists":
            ok = value is not None
        elif op == "DoesNotExist":
            ok = value is None
        elif op in ("Gt", "Lt") and value is not None and values:
            try:
                ok = int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
            except ValueError:
                ok = False
        else:
            ok = False
        if not ok:
            return False
    return True


def _taint(
    spec: Mapping[str, Any], tolerations: Sequence[Obj], effects: Iterable[str]
) -> str | None:
    """The first taint with one of ``effects`` that no toleration matches, as text."""
    for taint in spec.get("taints") or []:
        if taint.get("effect") in effects and not any(_tolerates(t, taint) for t in tolerations):
            value = f"={taint['value']}" if taint.get("value") else ""
            return f"tainted {taint.get('key')}{value}:{taint.get('effect')}"
    return None


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    if toleration.get("effect") not in (None, "", taint.get("effect")):
        return False
    if toleration.get("operator") == "Exists":
        return toleration.get("key") in (None, "", taint.get("key"))
    return bool(
        toleration.get("key") == taint.get("key")
        and (toleration.get("value") or "") == (taint.get("value") or "")
    )


def _fit(
    node: Mapping[str, Any], load: Mapping[str, Decimal], requests: Mapping[str, Decimal]
) -> int:
    """Copies of ``requests`` that fit in the Node's allocatable less ``load``."""
    raw = (node.get("status") or {}).get("allocatable") or {}
    if not raw:
        return UNBOUNDED
    name = (node.get("metadata") or {}).get("name")
    allocatable = {str(k): _quantity(v, f"node {name} allocatable") for k, v in raw.items()}
    copies = UNBOUNDED
    for resource, amount in requests.items():
        free = allocatable.get(resource, Decimal(0)) - load.get(resource, Decimal(0))
        copies = min(copies, max(0, int(free // amount)))
    return copies


def capacity(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    shape: PodShape,
    job_pods: Mapping[str, str],
    health_key: str,
) -> Capacity:
    """How many of the job's pods (``shape``) the ``nodes`` hold, given every pod bound to
    a Node (``pods``: the cluster's, or at least those on these Nodes) and the job's own
    current pods (``job_pods``: node id -> pod name). See the module docstring."""
    by_name = {str((n.get("metadata") or {}).get("name")): n for n in nodes}
    ours = {pod: node_id for node_id, pod in job_pods.items()}
    load: dict[str, dict[str, Decimal]] = {name: {} for name in by_name}
    hosts: dict[str, str] = {}  # job node id -> its pod's Node
    for pod in pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        host = spec.get("nodeName")
        if not host or (pod.get("status") or {}).get("phase") in ENDED:
            continue
        if meta.get("name") in ours:
            hosts[ours[meta["name"]]] = str(host)
        elif host in load:
            for resource, amount in pod_requests(spec).items():
                load[host][resource] = load[host].get(resource, Decimal(0)) + amount
    count, why = 0, {}
    ours_on: dict[str, int] = {}
    for node_id, host in hosts.items():
        ours_on[host] = ours_on.get(host, 0) + 1
        node = by_name.get(host)
        reason = "gone" if node is None else staying(node, health_key, shape.tolerations)
        if reason is not None:
            why[node_id] = f"its pod's Node {host} is {reason}"
    for name, node in by_name.items():
        if staying(node, health_key, shape.tolerations) is not None:
            continue
        if _open(node, shape):
            count += _fit(node, load[name], shape.requests)
        else:
            count += ours_on.get(name, 0)
    leaving = tuple(n for n in job_pods if n in why)
    going = frozenset(job_pods[n] for n in leaving)
    return Capacity(min(count, UNBOUNDED), leaving, why, going)
