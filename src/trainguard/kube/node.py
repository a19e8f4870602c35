"""One node of a job on Kubernetes: its pod and a client of the agent inside (the pod manager).

It turns what it sees (the pod's phase and IP, the agent's ``GET /status``) into the
:class:`NodeReport` the controller reads, exactly as the local platform's node does
for an agent process: the agent status goes through the same translation.
"""

from __future__ import annotations

from typing import Any

from trainguard.agent.client import AgentClient, AgentError
from trainguard.control.assignment import NodeAssignment
from trainguard.control.reports import NodeReport, NodeState
from trainguard.kube.status import PodInfo, parse_time
from trainguard.platform.node import report_from_status

Obj = dict[str, Any]


class PodNode:
    """One node id's current pod; ``report()`` once per poll after ``observe()``."""

    def __init__(
        self,
        node_id: str,
        pod_name: str,
        token: str,
        created_at: float,
        agent_port: int,
        agent_timeout: float,
        unreachable_after_polls: int,
    ) -> None:
        self.node_id = node_id
        self.pod_name = pod_name
        self.created_at = created_at
        self._token = token
        self._agent_port = agent_port
        self._agent_timeout = agent_timeout
        self._unreachable_after = unreachable_after_polls
        self.pod: Obj | None = None
        self.seen = False  # the pod was listed at least once
        self.client: AgentClient | None = None
        self.answered = False  # the agent answered /status at least once
        self.failed_polls = 0
        self.broken = False
        self.pending: NodeAssignment | None = None  # a /start to send once every node answers
        self.last_state = "pending"
        self._error = ""

    # -- what the API server says ------------------------------------------------

    def observe(self, pod: Obj | None) -> None:
        self.pod = pod
        if pod is not None:
            self.seen = True
        ip = self.pod_ip
        if ip and self.client is None:
            self.client = AgentClient(
                f"http://{_host(ip)}:{self._agent_port}", self._token, self._agent_timeout
            )

    @property
    def pod_ip(self) -> str | None:
        return ((self.pod or {}).get("status") or {}).get("podIP")

    @property
    def host(self) -> str | None:
        return ((self.pod or {}).get("spec") or {}).get("nodeName")

    @property
    def phase(self) -> str:
        return str(((self.pod or {}).get("status") or {}).get("phase") or "Pending")

    @property
    def url(self) -> str:
        return self.client.base_url if self.client else ""

    def ended(self) -> tuple[str, float | None] | None:
        """Why the pod can no longer run the job (and when it ended), or None."""
        if self.pod is None:
            return (f"pod {self.pod_name} is gone", None) if self.seen else None
        if (self.pod.get("metadata") or {}).get("deletionTimestamp"):
            return f"pod {self.pod_name} is being deleted", None
        if self.phase in ("Failed", "Succeeded"):
            exit_code, finished = _termination(self.pod)
            how = f" (exit code {exit_code})" if exit_code is not None else ""
            return f"pod {self.pod_name} {self.phase.lower()}{how}", finished
        return None

    # -- what the controller reads ---------------------------------------------------

    def report(self, now: float, start_timeout: float) -> NodeReport:
        ended = self.ended()
        if self.broken or ended is not None:
            reason = ended[0] if ended else f"the agent of pod {self.pod_name} refused a request"
            self.last_state = "lost"
            return NodeReport(self.node_id, reachable=False, reason=reason)
        report = self._poll() if self.client is not None else None
        if report is not None:
            return report
        if not self.answered:  # no pod IP yet, or the agent is still coming up
            if now - self.created_at > start_timeout:
                self.last_state = "lost"
                return NodeReport(
                    self.node_id,
                    reachable=False,
                    reason=f"pod {self.pod_name} not serving within {start_timeout:g}s "
                    f"(phase {self.phase})",
                )
            self.last_state = "pending"
            return NodeReport(self.node_id, reachable=True, state=NodeState.READY)
        self.failed_polls += 1
        if self.failed_polls >= self._unreachable_after:
            self.last_state = "lost"
            return NodeReport(self.node_id, reachable=False, reason=self._error)
        return NodeReport(self.node_id, reachable=True, state=NodeState.STARTING)

    def _poll(self) -> NodeReport | None:
        """The agent's status as a report; None (and ``_error`` set) when it does not answer."""
        assert self.client is not None
        try:
            status = self.client.status()
        except AgentError as err:
            self._error = str(err)
            return None
        self.answered = True
        self.failed_polls = 0
        report = report_from_status(status)
        self.last_state = report.state.value
        return report

    def info(self) -> PodInfo:
        return PodInfo(self.node_id, self.pod_name, self.pod_ip, self.host, self.last_state)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _termination(pod: Obj) -> tuple[int | None, float | None]:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated:
            return terminated.get("exitCode"), parse_time(terminated.get("finishedAt"))
    return None, None
