"""The operator's probes: ``/healthz`` (the process answers) and ``/readyz`` (it leads).

Both replicas of the operator are alive; only the leader is ready, so the operator's
Service sends the agents' pushed reports and Prometheus' scrapes to the leader alone.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from trainguard.http_server import RouteServer
from trainguard.netlimits import ConnLimits

__all__ = ["serve_probes"]


def serve_probes(
    port: int,
    ready: Callable[[], bool],
    host: str = "0.0.0.0",
    limits: ConnLimits | None = None,
) -> RouteServer:
    """Serve the probes on their own thread; returns the server (``close()`` stops it)."""

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        if ready():
            return web.Response(text="leading\n")
        return web.Response(text="standing by\n", status=503)

    routes = [web.get("/healthz", healthz), web.get("/readyz", readyz)]
    return RouteServer(host, port, routes, name="tg-probes", limits=limits)
