"""A new operator takes a running TrainingJob over: no job restarts because its operator did.

The controller of every job lives in the operator's process; when that process dies
(a crash, a lost node, a rollout, the standby taking the Lease), the job's pods and
their workers keep training. The operator that takes over rebuilds the controller from
two sources:

- what the dead one recorded in the TrainingJob's ``status``: ``takeover`` (the
  attempts with their rendezvous, the restarts decided: the restart budget goes on
  where it was), the fault timeline (``faults``) and each node's pod (``nodes``);
  :func:`takeover_record` writes it with every status patch, :func:`recorded` reads it;
- what the pods' agents say now (:func:`live_pods`): every node's pod runs, its agent
  answers with the job's token, is that pod's agent (its incarnation is the pod's name)
  and runs the newest attempt.

When all agree, the job is adopted as it runs (:func:`trainguard.control.resume.adopt`:
no restart, no lost step) and each agent is told where to report (``POST /attach``).
Otherwise the job restarts from its newest checkpoint on fresh pods, numbered after the
recorded attempts and not counted against its restart budget (its own code did not
fail). A job with no record (never started, or written by an older operator) starts
as new.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.control.assignment import StoreEndpoint
from trainguard.control.attempt import standby
from trainguard.control.controller import JobController
from trainguard.control.policy import RestartRecord, RestartScope
from trainguard.control.resume import Recorded, RecordedAttempt, RecordedElastic
from trainguard.kube.api import KubeApi, KubeError
from trainguard.kube.config import Obj
from trainguard.kube.node import PodNode
from trainguard.kube.pods import job_selector
from trainguard.platform.resume import live_status

__all__ = ["LivePod", "live_pods", "recorded", "takeover_record"]

logger = logging.getLogger(__name__)

AGENT_TIMEOUT = 5.0


def takeover_record(controller: JobController) -> Obj:
    """What a successor needs that the rest of the status does not say (``status.takeover``)."""
    current = controller.current
    return {
        "startedAt": controller.started_at,
        "attempts": [
            {
                "number": a.number,
                "phase": a.phase.value,
                "startedAt": a.started_at,
                "endedAt": a.ended_at,
                "reason": a.reason,
                "rendezvous": (
                    {"addr": a.endpoint.addr, "port": a.endpoint.port} if a.endpoint else None
                ),
            }
            for a in controller.attempts
        ],
        "restarts": [{"time": r.time, "scope": r.scope.value} for r in controller.history],
        "nodes": list(controller.nodes),
        # Nodes up ahead of a scale-up are not adopted: their ids go back to the pool.
        "growth": [*(standby(current.activity) if current else ()), *controller.growth],
        "elastic": (
            {
                "failures": controller.elastic.failures,
                "lastScaling": controller.elastic.last_scaling,
                "target": controller.elastic.target,
            }
            if controller.elastic is not None
            else None
        ),
    }


def recorded(status: Mapping[str, Any] | None) -> Recorded | None:
    """The dead operator's record of the job, or None when there is none to go on (a
    record that does not parse is logged and treated as none)."""
    takeover = (status or {}).get("takeover")
    if not isinstance(takeover, Mapping) or takeover.get("startedAt") is None:
        return None
    try:
        attempts = tuple(
            RecordedAttempt(
                int(a["number"]),
                str(a["phase"]),
                float(a["startedAt"]),
                None if a.get("endedAt") is None else float(a["endedAt"]),
                a.get("reason"),
                _endpoint(a.get("rendezvous")),
            )
            for a in takeover.get("attempts") or []
        )
        if [a.number for a in attempts] != list(range(len(attempts))):
            raise ValueError("attempts are not numbered 0, 1, ...")
        restarts = tuple(
            RestartRecord(float(r["time"]), RestartScope(str(r["scope"])))
            for r in takeover.get("restarts") or []
        )
        faults = tuple(f for f in (status or {}).get("faults") or [] if isinstance(f, Mapping))
        nodes = tuple(str(n) for n in takeover.get("nodes") or [])
        growth = takeover.get("growth")
        return Recorded(
            float(takeover["startedAt"]),
            attempts,
            restarts,
            faults,
            nodes,
            None if growth is None else tuple(str(n) for n in growth),
            _elastic(takeover.get("elastic")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        logger.warning("status.takeover cannot be read (%s): the job starts as new", exc)
        return None


def _elastic(data: Any) -> RecordedElastic | None:
    if not isinstance(data, Mapping):
        return None
    last, target = data.get("lastScaling"), data.get("target")
    return RecordedElastic(
        int(data.get("failures") or 0),
        None if last is None else float(last),
        None if target is None else int(target),
    )


def _endpoint(data: Any) -> StoreEndpoint | None:
    if not isinstance(data, Mapping):
        return None
    return StoreEndpoint(str(data["addr"]), int(data["port"]))


@dataclass(frozen=True)
class LivePod:
    node_id: str
    pod: Obj  # as listed
    url: str

    @property
    def name(self) -> str:
        return str(self.pod["metadata"]["name"])


def live_pods(
    api: KubeApi,
    namespace: str,
    job: str,
    status: Mapping[str, Any],
    token: str,
    attempt: int,
    nodes: int,
    agent_port: int,
) -> tuple[list[LivePod], str | None]:
    """Every node's pod whose agent still runs ``attempt`` (in node-rank order), or why
    the job cannot be adopted (then the list is empty)."""
    recorded_nodes = [n for n in status.get("nodes") or [] if isinstance(n, Mapping)]
    ranked = sorted(
        (n for n in recorded_nodes if isinstance(n.get("nodeRank"), int)),
        key=lambda n: int(n["nodeRank"]),
    )
    if len(ranked) != nodes:
        return [], f"{len(ranked)} of {nodes} nodes have a recorded rank"
    try:
        listed = {p["metadata"]["name"]: p for p in api.list_pods(namespace, job_selector(job))}
    except KubeError as exc:
        return [], f"cannot list the job's pods: {exc}"
    found = []
    for entry in ranked:
        node_id, name = str(entry.get("nodeId")), str(entry.get("pod"))
        pod = listed.get(name)
        node = PodNode(node_id, name)
        node.observe(pod)
        ended = node.ended() if pod is not None else (f"pod {name} is gone", None)
        url = node.agent_url(agent_port)
        if ended is not None:
            return [], ended[0]
        if node.phase != "Running" or url is None:
            return [], f"pod {name} is {node.phase}"
        answer, why = live_status(
            url,
            token,
            node_id,
            attempt,
            incarnation=name,  # that pod's agent
            who=f"{node_id} ({name})",
            timeout=AGENT_TIMEOUT,
        )
        if answer is None:
            return [], why
        assert pod is not None
        found.append(LivePod(node_id, pod, url))
    return found, None
