"""What the platform tells the controller about each node: facts, never verdicts.

A :class:`NodeReport` holds the agent's own latest status (the wire model, as it came)
and what the platform saw of the node: consecutive contacts that failed, or proof that
the node is gone (its agent process exited, its pod was deleted). Whether that makes the
node lost is :func:`trainguard.control.contact.contact`'s call. A :class:`Refusal` is an
agent saying no to a request (it answered: that is not a failed contact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trainguard.wire.status import NodeState, NodeStatus

__all__ = ["NodeReport", "NodeState", "Refusal", "RequestKind"]

RequestKind = Literal["start", "rejoin", "replace", "stop", "persist"]


@dataclass(frozen=True)
class NodeReport:
    """One node as the platform sees it now."""

    node_id: str
    # The agent's latest status (a poll's answer or a push), None while it never answered.
    status: NodeStatus | None = None
    # Polls or requests in a row that got no answer since the last one that did.
    failed_contacts: int = 0
    # Seconds from the node's last answer to its latest failed contact (0 while it answers).
    silent_for: float = 0.0
    # Why the platform knows the node is gone (agent process exited, pod deleted), if it is.
    gone: str | None = None
    # The last failed contact's error, for the reason of a lost node.
    error: str | None = None
    # The machine the node runs on, when the platform knows it (host avoidance).
    host: str | None = None
    # Since when (wall clock) the platform waits for a host to run the node (its launch
    # found none: ControlConfig.host_wait); None: not waiting.
    awaiting_host: float | None = None
    # When (wall clock) its agent was launched, where that came after the attempt's
    # launch (it waited for a host): its start timeout counts from then.
    launched_at: float | None = None

    def about(self, attempt: int) -> NodeStatus | None:
        """The status, if it is about ``attempt`` (an agent may lag behind the controller)."""
        status = self.status
        return status if status is not None and status.attempt == attempt else None


@dataclass(frozen=True)
class Refusal:
    """An agent refused a request (HTTP 4xx): ``message`` is its reason."""

    node_id: str
    request: RequestKind
    attempt: int | None
    message: str
