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
import hmac
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from trainguard.platform.book import Taken
from trainguard.wire.base import WireError, parse_json
from trainguard.wire.status import NodeStatus

logger = logging.getLogger(__name__)

__all__ = ["MAX_REPORT_BYTES", "Inbox"]

MAX_REPORT_BYTES = 4 * 1024 * 1024
START_TIMEOUT = 10.0


@dataclass(frozen=True)
class _Job:
    token: bytes
    take: Callable[[NodeStatus], Taken]


class Inbox:
    """Receives pushed statuses for any number of jobs; see the module docstring."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, public_url: str | None = None):
        """``public_url``: the base URL agents reach this server at, when not
        ``http://host:port`` (e.g. a Kubernetes Service's name)."""
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        # Bind here, so that a port in use is an OSError before any thread starts.
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        bound = int(sock.getsockname()[1])
        self.url = (public_url or f"http://{_host(host)}:{bound}").rstrip("/")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tg-inbox", daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        asyncio.run_coroutine_threadsafe(self._serve(sock), self._loop).result(START_TIMEOUT)

    def register(self, key: str, token: str, take: Callable[[NodeStatus], Taken]) -> str:
        """Take the pushes of job ``key``; returns the URL its agents push to."""
        with self._lock:
            self._jobs[key] = _Job(token.encode(), take)
        return f"{self.url}/report/{key}"

    def unregister(self, key: str) -> None:
        with self._lock:
            self._jobs.pop(key, None)

    def close(self) -> None:
        if self._runner is not None:
            runner = self._runner
            with contextlib.suppress(Exception):  # best effort: a finished job must end
                asyncio.run_coroutine_threadsafe(runner.cleanup(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    async def _serve(self, sock: socket.socket) -> None:
        app = web.Application(client_max_size=MAX_REPORT_BYTES)
        app.router.add_post("/report/{key:.+}", self._report)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock, backlog=4096).start()

    async def _report(self, request: web.Request) -> web.Response:
        with self._lock:
            job = self._jobs.get(request.match_info["key"])
        scheme, _, credential = request.headers.get("Authorization", "").partition(" ")
        # An unknown job looks like a wrong token: no caller learns which jobs exist.
        if (
            job is None
            or scheme.lower() != "bearer"
            or not hmac.compare_digest(credential.strip().encode(), job.token)
        ):
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
