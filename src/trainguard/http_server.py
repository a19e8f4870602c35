"""trainguard's one HTTP server: aiohttp, one event loop on its own thread.

:class:`RouteServer` serves aiohttp routes at ``host:port`` (the controller's inbox, the
hosts service and daemons, the rendezvous store service's control port, the operator's
probes, the metrics endpoint); a burst of thousands of requests costs no thread each.
The node agents keep their own small server (:mod:`trainguard.agent.server`; see
``docs/architecture.md`` for why).

Each server is held within the bounds of :mod:`trainguard.netlimits`. aiohttp caps a
request head's size but neither how many connections a peer opens nor, by default, how
long one may sit without a request (``keepalive_timeout`` 3630 s, which also times the
first request's head). :func:`gate` admits each new connection through a
:class:`~trainguard.netlimits.ConnTable` (closing it, or an older idle one, when a bound
is reached) and :func:`busy_middleware` tells the table which connections are serving;
``keepalive_timeout=head_seconds`` makes aiohttp close a connection whose head has not
arrived in time (it counts from the connection, or from the last reply).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from trainguard.http_client import url_host
from trainguard.netlimits import ConnLimits, ConnTable, QuietLog, conn_limits, quiet_loggers

__all__ = ["ListenError", "RouteServer", "busy_middleware", "gate", "loop_errors"]

logger = logging.getLogger("trainguard.net")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
START_TIMEOUT = 10.0
MAX_BODY = 4 * 1024 * 1024


class ListenError(OSError):
    """A server could not bind its address (in use, not this host's): a usage error where
    the user named it, unlike an OSError once the job runs (out of descriptors, say)."""


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
        max_body: int = MAX_BODY,
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
        self.url = (public_url or f"{scheme}://{url_host(host)}:{bound}").rstrip("/")
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


def gate(server: web.Server, table: ConnTable, quiet: QuietLog) -> None:
    """Admit ``server``'s connections through ``table``.

    aiohttp's :class:`web.Server` is told of each connection (``connection_made``, after
    accept, with its transport) and of its end (``connection_lost``); both are wrapped
    here, on this instance (the server is made by :class:`web.AppRunner`)."""
    made, lost = server.connection_made, server.connection_lost
    transports: dict[Any, asyncio.Transport] = {}

    def connection_made(handler: Any, transport: asyncio.Transport) -> None:
        made(handler, transport)
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        admitted, evict = table.admit(handler, peer)
        if evict is not None and (old := transports.pop(evict, None)) is not None:
            old.abort()
        if not admitted:
            quiet.note(f"refused:{peer}", f"refused a connection from {peer}: too many open")
            # After the handler's task has started (it is scheduled after this call):
            # closed before, the task finds its handler torn down and fails an assert.
            asyncio.get_running_loop().call_soon(transport.abort)
            return
        transports[handler] = transport

    def connection_lost(handler: Any, exc: BaseException | None = None) -> None:
        transports.pop(handler, None)
        table.release(handler)
        lost(handler, exc)

    server.connection_made = connection_made  # type: ignore[method-assign]
    server.connection_lost = connection_lost  # type: ignore[method-assign]


def busy_middleware(table: ConnTable) -> Middleware:
    """Mark a connection busy while it serves a request (a full table closes idle ones)."""

    @web.middleware
    async def busy(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = request.protocol
        table.busy(key, True)
        try:
            return await handler(request)
        finally:
            table.busy(key, False)

    return busy


def loop_errors(quiet: QuietLog) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """An event loop's exception handler: one rate-limited line, no traceback (asyncio's
    own prints one each time, e.g. for every accept refused for want of descriptors; it
    then pauses accepting for a second and goes on, which is what is wanted)."""

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", "event loop error"))
        exc = context.get("exception")
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        quiet.note(f"loop:{message[:40]}", f"{message}{detail}")

    return handle
