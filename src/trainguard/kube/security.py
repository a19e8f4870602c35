"""What a job's pod template may ask of the Kubernetes node it lands on.

The operator creates a job's pods with its own rights, so whoever may create a
TrainingJob gets pods from a template of their choosing. By default the operator refuses
templates that would reach past their container onto the node: privileged containers,
the node's network, PID or IPC namespace, ``hostPath`` volumes, Windows host processes,
privilege escalation, and capabilities beyond the ones Kubernetes' *baseline* Pod Security
Standard allows. An operator installed with ``--allow-privileged-pods`` runs them. The
cluster's own Pod Security admission, where enabled, applies on top of this.

:func:`privileged_requests` is pure: the operator fails such a job (naming the field) and
``trainguard submit`` refuses it up front.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ALLOW_FLAG", "BASELINE_CAPABILITIES", "privileged_requests"]

ALLOW_FLAG = "--allow-privileged-pods"

# The capabilities a container may add under the baseline Pod Security Standard.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)

_HOST_NAMESPACES = (
    ("hostNetwork", "the node's network namespace"),
    ("hostPID", "the node's PID namespace"),
    ("hostIPC", "the node's IPC namespace"),
)
_CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def privileged_requests(spec: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(field path, problem)`` for every node-level privilege the job's pod templates ask
    for (``spec``: the TrainingJob's ``spec`` as JSON, camelCase); empty when none."""
    problems: list[tuple[str, str]] = []
    for index, group in enumerate(_list(spec.get("replicaSpecs"))):
        template = _dict(_dict(group).get("template"))
        problems += _pod_requests(_dict(template.get("spec")), f"spec.replicaSpecs[{index}]")
    return [(path, f"{what} {_REFUSED}") for path, what in problems]


_REFUSED = f"is refused (the operator allows it only when installed with {ALLOW_FLAG})"


def _pod_requests(pod: Mapping[str, Any], group: str) -> list[tuple[str, str]]:
    where = f"{group}.template.spec"
    found: list[tuple[str, str]] = []
    for key, what in _HOST_NAMESPACES:
        if pod.get(key) is True:
            found.append((f"{where}.{key}", what))
    for index, volume in enumerate(_list(pod.get("volumes"))):
        if "hostPath" in _dict(volume):
            found.append((f"{where}.volumes[{index}].hostPath", "a hostPath volume"))
    found += _host_process(_dict(pod.get("securityContext")), f"{where}.securityContext")
    for kind in _CONTAINER_LISTS:
        for index, container in enumerate(_list(pod.get(kind))):
            context = _dict(_dict(container).get("securityContext"))
            found += _container_requests(context, f"{where}.{kind}[{index}].securityContext")
    return found


def _container_requests(context: Mapping[str, Any], where: str) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    if context.get("privileged") is True:
        found.append((f"{where}.privileged", "privileged mode"))
    if context.get("allowPrivilegeEscalation") is True:
        found.append((f"{where}.allowPrivilegeEscalation", "privilege escalation"))
    added = _list(_dict(context.get("capabilities")).get("add"))
    for index, capability in enumerate(added):
        name = str(capability).upper().removeprefix("CAP_")
        if name not in BASELINE_CAPABILITIES:
            found.append((f"{where}.capabilities.add[{index}]", f"capability {capability}"))
    return found + _host_process(context, where)


def _host_process(context: Mapping[str, Any], where: str) -> list[tuple[str, str]]:
    if _dict(context.get("windowsOptions")).get("hostProcess") is True:
        return [(f"{where}.windowsOptions.hostProcess", "a Windows host process")]
    return []


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
