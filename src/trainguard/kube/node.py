"""One node of a job on Kubernetes, as the API server shows it: its current pod.

The platform (:mod:`trainguard.kube.kube_platform`) lists the job's pods and gives each
:class:`PodNode` its pod; what the node's agent says comes through the transport. Facts
only: a pod that is gone, being deleted or ended, where its agent serves, which machine
it runs on. Whether that makes the node lost is the controller's call.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.http_client import url_host
from trainguard.kube.config import Obj
from trainguard.kube.status import PodInfo, parse_time

__all__ = ["PodNode"]


@dataclass
class PodNode:
    """One node id's current pod (``pod``: as last listed; None until then, or once gone)."""

    node_id: str
    pod_name: str
    pod: Obj | None = None
    seen: bool = False  # the pod was listed at least once

    def observe(self, pod: Obj | None) -> None:
        self.pod = pod
        if pod is not None:
            self.seen = True

    @property
    def pod_ip(self) -> str | None:
        ip = ((self.pod or {}).get("status") or {}).get("podIP")
        return str(ip) if ip else None

    @property
    def host(self) -> str | None:
        host = ((self.pod or {}).get("spec") or {}).get("nodeName")
        return str(host) if host else None

    @property
    def phase(self) -> str:
        return str(((self.pod or {}).get("status") or {}).get("phase") or "Pending")

    def agent_url(self, port: int) -> str | None:
        return None if self.pod_ip is None else f"http://{url_host(self.pod_ip)}:{port}"

    def ended(self) -> tuple[str, float | None] | None:
        """Why the pod can no longer run the job (and when it ended, if known), or None."""
        if self.pod is None:
            return (f"pod {self.pod_name} is gone", None) if self.seen else None
        if (self.pod.get("metadata") or {}).get("deletionTimestamp"):
            return f"pod {self.pod_name} is being deleted", None
        if self.phase in ("Failed", "Succeeded"):
            exit_code, finished = _termination(self.pod)
            how = f" (exit code {exit_code})" if exit_code is not None else ""
            status = self.pod.get("status") or {}
            if status.get("reason") == "Evicted":  # by the kubelet (node pressure)
                how = f" (evicted: {status.get('message') or 'by the kubelet'})"
            return f"pod {self.pod_name} {self.phase.lower()}{how}", finished
        return None

    def info(self, state: str) -> PodInfo:
        return PodInfo(self.node_id, self.pod_name, self.pod_ip, self.host, state)


def _termination(pod: Obj) -> tuple[int | None, float | None]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            code = terminated.get("exitCode")
            return (int(code) if code is not None else None), parse_time(
                terminated.get("finishedAt")
            )
    return None, None
