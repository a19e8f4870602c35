"""Where agents push their news: the controller side of "report first".

One :class:`Inbox` is an HTTP server (:class:`~trainguard.http_server.RouteServer`: a
burst of thousands of pushes costs no thread each). Each job registers under a key
with its own token and a callback; an agent of that job POSTs its
:class:`~trainguard.wire.status.NodeStatus` to ``<url>/report/<key>`` with the job's
bearer token, and the callback (the job's :class:`~trainguard.platform.book.ReportBook`)
takes it and wakes the job's loop. The token is checked before the body is read; a body
that does not fit the model gets a 400 naming the field, a status of an agent the job
no longer has a 409 (a status older than one already known is accepted and dropped).
An unknown job gets the same 401 as a wrong token. Loopback unless told otherwise.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

from trainguard.auth import bearer_ok
from trainguard.http_server import RouteServer
from trainguard.platform.book import ReportBook, Taken
from trainguard.platform.transport import AgentTransport
from trainguard.wire.base import WireError, parse_json
from trainguard.wire.status import NodeStatus

__all__ = ["Inbox", "agent_transport"]


@dataclass(frozen=True)
class _Job:
    token: bytes
    take: Callable[[NodeStatus], Taken]


class Inbox(RouteServer):
    """Receives pushed statuses for any number of jobs; see the module docstring."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        public_url: str | None = None,
        *,
        routes: Sequence[web.RouteDef] = (),
        tls: ssl.SSLContext | None = None,
    ):
        """``public_url``: the base URL agents reach this server at, when not
        ``http://host:port`` (e.g. a Kubernetes Service's name); ``routes``: more
        handlers on the same server (a multi-host job's joins); ``tls``: serve HTTPS."""
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        reports = web.post("/report/{key:.+}", self._report)
        super().__init__(
            host, port, [reports, *routes], public_url=public_url, tls=tls, name="tg-inbox"
        )

    def register(self, key: str, token: str, take: Callable[[NodeStatus], Taken]) -> str:
        """Take the pushes of job ``key``; returns the URL its agents push to."""
        with self._lock:
            self._jobs[key] = _Job(token.encode(), take)
        return f"{self.url}/report/{key}"

    def unregister(self, key: str) -> None:
        with self._lock:
            self._jobs.pop(key, None)

    async def _report(self, request: web.Request) -> web.Response:
        with self._lock:
            job = self._jobs.get(request.match_info["key"])
        # An unknown job looks like a wrong token: no caller learns which jobs exist.
        if job is None or not bearer_ok(request.headers.get("Authorization"), job.token):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401)
        try:
            status = parse_json(NodeStatus, await request.read(), "status")
        except WireError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        if job.take(status) is Taken.FOREIGN:
            return web.json_response(
                {"error": f"not the current agent of a node of this job: {status.node_id}"},
                status=409,
            )
        return web.json_response({"accepted": True}, status=202)


def agent_transport(
    inbox: Inbox | None,
    key: str,
    token: str,
    *,
    poll_interval: float,
    timeout: float,
    book: ReportBook | None = None,
) -> AgentTransport:
    """A job's line to its agents, wired alike on every platform: the report book (a new
    one unless given), the job's key in ``inbox`` (its agents push there into the book;
    None: polled only), and the transport that polls them and sends them requests (its
    ``book`` and ``report_url``). The caller starts and closes it, and unregisters ``key``."""
    book = book or ReportBook()
    report_url = None
    if inbox is not None:
        report_url = inbox.register(key, token, lambda status: book.answered(status, push=True))
    return AgentTransport(
        book, token, poll_interval=poll_interval, timeout=timeout, report_url=report_url
    )
