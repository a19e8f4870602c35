"""Where agents push their news: the controller side of "report first".

One :class:`Inbox` is an HTTP server (aiohttp, one event loop on its own thread, so a
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

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

from trainguard.auth import bearer_ok
from trainguard.netlimits import ConnLimits, ConnTable, QuietLog, conn_limits, quiet_loggers
from trainguard.platform.book import Taken
from trainguard.platform.http_gate import busy_middleware, gate, loop_errors
from trainguard.wire.base import WireError, parse_json
from trainguard.wire.status import NodeStatus

logger = logging.getLogger(__name__)

__all__ = ["MAX_REPORT_BYTES", "Inbox", "ListenError", "RouteServer"]

MAX_REPORT_BYTES = 4 * 1024 * 1024
START_TIMEOUT = 10.0


class ListenError(OSError):
    """A server could not bind its address (in use, not this host's): a usage error where
    the user named it, unlike an OSError once the job runs (out of descriptors, say)."""


@dataclass(frozen=True)
class _Job:
    token: bytes
    take: Callable[[NodeStatus], Taken]


class RouteServer:
    """An aiohttp server on its own event-loop thread: ``routes`` at ``host:port`` (0: any
    free port), HTTPS with ``tls``. Binds on construction (a port in use is an OSError
    before any thread starts); ``url`` is where it serves. Its connections are bounded by
    ``limits`` (:mod:`trainguard.netlimits`; default: by this process's descriptors)."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: Sequence[web.RouteDef],
        *,
        public_url: str | None = None,
        tls: ssl.SSLContext | None = None,
        max_body: int = MAX_REPORT_BYTES,
        name: str = "tg-server",
        limits: ConnLimits | None = None,
    ) -> None:
        quiet_loggers()
        self.connections = ConnTable(limits or conn_limits())
        self._quiet = QuietLog(logging.getLogger("trainguard.net"))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise ListenError(exc.errno, exc.strerror) from exc
        bound = int(sock.getsockname()[1])
        self.port = bound
        scheme = "https" if tls is not None else "http"
        self.url = (public_url or f"{scheme}://{_host(host)}:{bound}").rstrip("/")
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(loop_errors(self._quiet))
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        serving = self._serve(sock, routes, tls, max_body)
        asyncio.run_coroutine_threadsafe(serving, self._loop).result(START_TIMEOUT)

    def close(self) -> None:
        if self._runner is not None:
            runner = self._runner
            with contextlib.suppress(Exception):  # best effort: a finished job must end
                asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    async def _serve(
        self,
        sock: socket.socket,
        routes: Sequence[web.RouteDef],
        tls: ssl.SSLContext | None,
        max_body: int,
    ) -> None:
        app = web.Application(
            client_max_size=max_body, middlewares=[busy_middleware(self.connections)]
        )
        app.router.add_routes(routes)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=self.connections.limits.head_seconds,
        )
        await self._runner.setup()
        assert self._runner.server is not None
        gate(self._runner.server, self.connections, self._quiet)
        # asyncio accepts up to ``backlog`` connections in one go before any is looked
        # at: a batch that fits the descriptors left beside the admitted ones.
        backlog = min(1024, self.connections.limits.total)
        await web.SockSite(self._runner, sock, backlog=backlog, ssl_context=tls).start()


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


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
