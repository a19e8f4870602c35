"""trainguard's synchronous HTTP client: a request with the job's bearer token, a JSON
answer (the hosts' daemons and service, the rendezvous store service, a peer agent's
replicas).

The controller's many calls to its node agents go through their own kept-alive client
(:class:`~trainguard.agent.client.AgentClient`), and an agent's pushes through its
reporter's kept-alive connection: both are on every job's hot path. A connection that
fails (refused, reset, timed out) raises its ``OSError``; an answer with an error status
an :class:`HTTPStatusError`; an answer that is not a JSON object a ``ValueError``.
"""

from __future__ import annotations

import http.client
import json
import ssl
import urllib.error
import urllib.request
from typing import Any

from trainguard.auth import bearer

__all__ = ["HTTPStatusError", "call_json", "error_text", "open_url", "url_host"]


class HTTPStatusError(OSError):
    """The server answered with an error; ``status`` its HTTP status, ``detail`` what
    it said (its ``{"error": ...}``, or the start of its body)."""

    def __init__(self, message: str, status: int, detail: str) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


def open_url(
    url: str,
    token: str,
    body: bytes | None = None,
    *,
    timeout: float,
    tls: ssl.SSLContext | None = None,
) -> http.client.HTTPResponse:
    """``GET url`` (``POST`` with ``body``, JSON) with ``token``; the open answer to read."""
    headers = bearer(token)
    if body is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, body, headers, method="GET" if body is None else "POST")
    try:
        reply: http.client.HTTPResponse = urllib.request.urlopen(
            request, timeout=timeout, context=tls
        )
    except urllib.error.HTTPError as exc:
        try:
            detail = error_text(exc.read())
        except OSError:
            detail = str(exc.reason)
        raise HTTPStatusError(f"{url}: HTTP {exc.code}: {detail}", exc.code, detail) from None
    return reply


def call_json(
    url: str,
    token: str,
    body: dict[str, Any] | None = None,
    *,
    timeout: float,
    tls: ssl.SSLContext | None = None,
) -> dict[str, Any]:
    """``POST body`` (``GET`` without one) to ``url`` with ``token``; the JSON object
    answered (an empty answer is ``{}``)."""
    data = None if body is None else json.dumps(body).encode()
    with open_url(url, token, data, timeout=timeout, tls=tls) as reply:
        answer = json.loads(reply.read() or b"{}")
    if not isinstance(answer, dict):
        raise ValueError(f"{url}: the answer is not a JSON object")
    return answer


def error_text(raw: bytes) -> str:
    """What an error answer says: its ``{"error": ...}``, else its first 500 characters."""
    try:
        data: Any = json.loads(raw)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return str(data["error"])
    return raw.decode(errors="replace")[:500]


def url_host(host: str) -> str:
    """``host`` as a URL names it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host
