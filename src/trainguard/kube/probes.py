"""The operator's probes: ``/healthz`` (the process answers) and ``/readyz`` (it leads).

Both replicas of the operator are alive; only the leader is ready, so the operator's
Service sends the agents' pushed reports and Prometheus' scrapes to the leader alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer

from trainguard.bounded_http import BoundedHandler, BoundedHTTPServer

__all__ = ["serve_probes"]


def serve_probes(
    port: int, ready: Callable[[], bool], host: str = "0.0.0.0"
) -> ThreadingHTTPServer:
    """Serve the probes on a daemon thread; returns the server (``shutdown()`` stops it)."""

    class Probes(BoundedHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                code, body = 200, b"ok\n"
            elif path == "/readyz":
                code, body = (200, b"leading\n") if ready() else (503, b"standing by\n")
            else:
                code, body = 404, b"not found\n"
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = BoundedHTTPServer((host, port), Probes)  # a probe every few seconds: unlogged
    threading.Thread(target=server.serve_forever, name="tg-probes", daemon=True).start()
    return server
