"""The connection bounds of :mod:`trainguard.netlimits` on an aiohttp server.

aiohttp caps a request head's size but neither how many connections a peer opens nor,
by default, how long one may sit without a request (``keepalive_timeout`` 3630 s, which
also times the first request's head). :func:`gate` admits each new connection through a
:class:`~trainguard.netlimits.ConnTable` (closing it, or an older idle one, when a bound
is reached) and :func:`busy_middleware` tells the table which connections are serving;
``keepalive_timeout=head_seconds`` makes aiohttp close a connection whose head has not
arrived in time (it counts from the connection, or from the last reply).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from trainguard.netlimits import ConnTable, QuietLog

__all__ = ["busy_middleware", "gate", "loop_errors"]

logger = logging.getLogger("trainguard.net")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
