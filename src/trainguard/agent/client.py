"""Typed client of the agent API (stdlib ``urllib`` only; no torch import)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from trainguard.agent.status import DEFAULT_STOP_TIMEOUT, AgentStatus
from trainguard.control.assignment import NodeAssignment

DEFAULT_TIMEOUT = 5.0  # s per request


class AgentError(Exception):
    """The agent refused a request (``status`` is its HTTP status, if it answered)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class AgentUnreachable(AgentError):
    """No answer: connection refused, reset, or timed out."""


class AgentClient:
    """Talks to one node agent at ``base_url`` (e.g. ``http://127.0.0.1:8471``)."""

    def __init__(self, base_url: str, token: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.base_url = base_url.rstrip("/")
        self._token = token
        self.timeout = timeout

    def start(self, assignment: NodeAssignment) -> None:
        """Ask the agent to start ``assignment``'s workers (asynchronous)."""
        self._request("POST", "/start", {"assignment": assignment.to_json()})

    def stop(
        self,
        attempt: int | None,
        mode: str = "graceful",
        timeout: float = DEFAULT_STOP_TIMEOUT,
        capture_stacks: bool = False,
    ) -> None:
        """Stop ``attempt`` (None: whatever runs); ``mode``: ``graceful`` or ``process``.

        ``capture_stacks``: dump every worker's Python stack first (for a hang).
        Asynchronous: poll :meth:`status` until the state is ``stopped``.
        """
        payload = {"attempt": attempt, "mode": mode, "timeout": timeout}
        if capture_stacks:
            payload["capture_stacks"] = True
        self._request("POST", "/stop", payload)

    def status(self) -> AgentStatus:
        data = self._request("GET", "/status", None)
        try:
            return AgentStatus.from_json(data)
        except ValueError as exc:
            raise AgentError(f"{self.base_url}: bad status reply: {exc}") from None

    def rejoin(self, assignment: NodeAssignment) -> None:
        """In-process restart into ``assignment``'s attempt (asynchronous)."""
        self._request("POST", "/rejoin", {"assignment": assignment.to_json()})

    def persist(self, step: int, world_size: int, commit: bool) -> None:
        """Ask the agent to persist its memory shards of ``step`` (asynchronous; ``commit``:
        also commit the step once every rank's shard is durable)."""
        self._request(
            "POST", "/persist", {"step": step, "world_size": world_size, "commit": commit}
        )

    def shutdown(self) -> None:
        """Ask the agent to kill its workers and exit."""
        self._request("POST", "/shutdown", {})

    def _request(self, method: str, path: str, payload: dict[str, Any] | None) -> Any:
        url = self.base_url + path
        body = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(url, data=body, method=method)
        request.add_header("Authorization", f"Bearer {self._token}")
        if body is not None:
            request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise AgentError(f"{method} {url}: {exc.code} {_error_text(exc)}", exc.code) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise AgentUnreachable(f"{method} {url}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise AgentError(f"{method} {url}: reply is not JSON: {raw[:200]!r}") from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read()
    except (TimeoutError, OSError):
        return exc.reason
    try:
        data = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")[:500] or exc.reason
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return str(data["error"])
    return exc.reason
