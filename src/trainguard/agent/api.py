"""The agent API's routes: authentication, validation with the wire models, dispatch.

Transport-free: :class:`AgentApi` turns ``(method, path, body)`` into a :class:`Reply`,
so the agent's HTTP server (:mod:`trainguard.agent.server`) and any other front end
serve exactly the same API. The routes and their bodies are listed in
:mod:`trainguard.wire.requests`. Errors are ``{"error": "..."}`` with 400 (a bad body,
naming the field), 401 (token), 404 (path), 405 (method), 409 (refused now), 413 (a
body over its route's bound, :meth:`AgentApi.body_limit`).
Handlers only validate and queue; the supervisor's thread does the work.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from trainguard.agent.lease import ControllerLease
from trainguard.agent.monitoring import build_monitor
from trainguard.agent.rank_log import LOGS_PATH, rank_log_reply
from trainguard.auth import bearer_ok
from trainguard.wire.base import WireError, parse_json
from trainguard.wire.requests import (
    Accepted,
    AssignRequest,
    AttachRequest,
    AttemptRequest,
    InjectRequest,
    PersistRequest,
    ReplaceRequest,
    StopRequest,
)
from trainguard.wire.status import NodeStatus

__all__ = [
    "MAX_JSON_BYTES",
    "AgentApi",
    "NodeControl",
    "Refused",
    "Reply",
    "error_reply",
    "json_reply",
]

MAX_JSON_BYTES = 1024 * 1024
"""The bound of a JSON body (an assignment with its env and log rules is a few KiB)."""


class Refused(Exception):
    """A request the node cannot take now (409)."""


class NodeControl(Protocol):
    """What the API drives: the agent's supervisor (or a simulated node in the bench)."""

    node_id: str

    def snapshot(self) -> NodeStatus: ...
    def request_start(self, request: AttemptRequest) -> None: ...
    def request_rejoin(self, request: AttemptRequest) -> None: ...
    def request_replace(self, request: ReplaceRequest) -> None: ...
    def request_stop(self, request: StopRequest) -> None: ...
    def request_persist(self, request: PersistRequest) -> None: ...
    def request_inject(self, request: InjectRequest) -> None: ...
    def request_attach(self, request: AttachRequest) -> None: ...
    def request_assign(self, request: AssignRequest) -> None: ...
    def request_shutdown(self, reason: str) -> None: ...


@dataclass(frozen=True)
class Reply:
    """An HTTP reply: status, JSON body; ``after`` runs once the reply has been sent."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    after: Callable[[], None] | None = None


def json_reply(status: int, payload: dict[str, Any], **headers: str) -> Reply:
    return Reply(status, json.dumps(payload).encode(), dict(headers))


def error_reply(status: int, message: str, **headers: str) -> Reply:
    """``{"error": message}``: how every refusal of the agent API reads."""
    return json_reply(status, {"error": message}, **headers)


class AgentApi:
    """The agent API of one node (see the module docstring)."""

    ROUTES: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("GET", "/status"),
            ("GET", LOGS_PATH),
            ("POST", "/start"),
            ("POST", "/rejoin"),
            ("POST", "/replace"),
            ("POST", "/stop"),
            ("POST", "/persist"),
            ("POST", "/inject"),
            ("POST", "/attach"),
            ("POST", "/assign"),
            ("POST", "/shutdown"),
        }
    )
    BODILESS: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {("GET", "/status"), ("GET", LOGS_PATH), ("POST", "/shutdown")}
    )

    def __init__(
        self,
        node: NodeControl,
        token: str,
        lease: ControllerLease | None = None,
        log_root: Path | None = None,
    ) -> None:
        """``lease``: touched by every request of the controller (not by replica pushes
        from peer agents, which go elsewhere, nor by a read of a rank's log);
        ``log_root``: the job's log directory on this host, which ``GET /logs`` serves
        (:mod:`trainguard.agent.rank_log`; without it, a 404)."""
        if not token:
            raise ValueError("token must not be empty")
        self.node = node
        self._token = token.encode()
        self.lease = lease
        self.log_root = log_root

    def authorized(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries this job's bearer token."""
        return bearer_ok(header, self._token)

    def route(self, method: str, path: str) -> Reply | None:
        """None when ``method path`` is a route; else its 404 or 405 (check before reading
        a body)."""
        path = path.split("?", 1)[0]
        if (method, path) in self.ROUTES:
            return None
        allowed = [m for m, p in self.ROUTES if p == path]
        if allowed:
            return error_reply(405, f"{path} takes {allowed[0]}", Allow=allowed[0])
        return error_reply(404, f"no such path: {path}")

    def body_limit(self, method: str, path: str) -> int:
        """The most bytes of body a route takes (check before reading a body): none for
        ``GET /status`` and ``POST /shutdown``, :data:`MAX_JSON_BYTES` for the others."""
        return 0 if (method, path.split("?", 1)[0]) in self.BODILESS else MAX_JSON_BYTES

    def handle(self, method: str, path: str, body: bytes) -> Reply:
        """An authorized request (see :meth:`authorized`) to a route; ``path`` may
        carry a query (``GET /logs`` reads it)."""
        target, path = path, path.split("?", 1)[0]
        if self.lease is not None and path != LOGS_PATH:  # a log read is not the controller
            self.lease.touch()
        unknown = self.route(method, path)
        if unknown is not None:
            return unknown
        limit = self.body_limit(method, path)
        if len(body) > limit:
            detail = "takes no body" if limit == 0 else f"body larger than {limit} bytes"
            return error_reply(413, f"{method} {path} {detail}")
        if path == LOGS_PATH:
            if self.log_root is None:
                return error_reply(404, "this agent serves no logs")
            return json_reply(*rank_log_reply(self.log_root, target))
        try:
            return self._dispatch(path, body)
        except WireError as exc:
            return error_reply(400, str(exc))
        except Refused as exc:
            return error_reply(409, str(exc))

    def _dispatch(self, path: str, body: bytes) -> Reply:
        node = self.node
        if path == "/status":
            return Reply(200, node.snapshot().model_dump_json().encode())
        if path in ("/start", "/rejoin"):
            request = self._attempt_request(body)
            if path == "/start":
                node.request_start(request)
            else:
                node.request_rejoin(request)
            return self._accepted(attempt=request.assignment.attempt)
        if path == "/replace":
            replace = parse_json(ReplaceRequest, body, "replace")
            node.request_replace(replace)
            return self._accepted(attempt=replace.attempt)
        if path == "/stop":
            stop = parse_json(StopRequest, body or b"{}", "stop")
            node.request_stop(stop)
            return self._accepted()
        if path == "/persist":
            persist = parse_json(PersistRequest, body, "persist")
            node.request_persist(persist)
            return self._accepted(step=persist.step)
        if path == "/inject":
            node.request_inject(parse_json(InjectRequest, body, "inject"))
            return self._accepted()
        if path == "/attach":
            node.request_attach(parse_json(AttachRequest, body, "attach"))
            return self._accepted()
        if path == "/assign":
            node.request_assign(parse_json(AssignRequest, body, "assign"))
            return self._accepted()
        assert path == "/shutdown"
        return Reply(
            202,
            Accepted().model_dump_json().encode(),
            after=lambda: node.request_shutdown("shutdown requested"),
        )

    def _attempt_request(self, body: bytes) -> AttemptRequest:
        request = parse_json(AttemptRequest, body, "")
        assignment = request.assignment
        if assignment.node_id != self.node.node_id:
            raise WireError(
                f"assignment.node_id: this agent is {self.node.node_id!r}, "
                f"got {assignment.node_id!r}"
            )
        try:
            build_monitor(assignment.monitor)
        except ValueError as exc:
            raise WireError(f"assignment.monitor.{exc}") from None
        return request

    @staticmethod
    def _accepted(attempt: int | None = None, step: int | None = None) -> Reply:
        reply = Accepted(attempt=attempt, step=step)
        return Reply(202, reply.model_dump_json(exclude_none=True).encode())
