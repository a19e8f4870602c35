"""The bounds of :mod:`trainguard.netlimits` on the standard library's threaded HTTP
servers: the rendezvous service's control port, the operator's probes, and the metrics
endpoint (``wsgiref``, as ``prometheus_client`` serves it).

``ThreadingHTTPServer`` starts a thread per connection and waits on a request head for
ever; these servers take a connection only within the :class:`~trainguard.netlimits.
ConnLimits` (so threads are bounded too), give each read ``head_seconds``, and close a
connection whose head has not arrived whole within ``head_seconds`` (a reaper thread
looks every second). An error while serving is one rate-limited line, never a traceback;
request lines are not logged.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from trainguard.netlimits import ConnLimits, ConnTable, QuietLog, conn_limits

__all__ = [
    "BoundedHTTPServer",
    "BoundedHandler",
    "BoundedWSGIServer",
    "QuietWSGIHandler",
]

logger = logging.getLogger("trainguard.net")
REAP_INTERVAL = 1.0


class _Bounded:
    """The mixin: put before a ``socketserver`` server class."""

    daemon_threads = True
    limits: ConnLimits
    connections: ConnTable
    quiet: QuietLog

    def _start_bounds(self, limits: ConnLimits | None) -> None:
        self.limits = limits or conn_limits()
        self.connections = ConnTable(self.limits)
        self.quiet = QuietLog(logger)
        self._heads: dict[socket.socket, float] = {}  # connections still owing a head
        self._heads_lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._reap, daemon=True, name="tg-http-reaper").start()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        peer = str(client_address[0]) if isinstance(client_address, tuple) else "?"
        admitted, evict = self.connections.admit(request, peer)
        if evict is not None:
            _hang_up(evict)
        if not admitted:
            self.quiet.note(f"refused:{peer}", f"refused a connection from {peer}: too many open")
            return False
        request.settimeout(self.limits.head_seconds)
        with self._heads_lock:
            self._heads[request] = time.monotonic()
        return True

    def headed(self, request: socket.socket) -> None:
        """``request``'s head arrived: it is being served (no more head deadline)."""
        with self._heads_lock:
            self._heads.pop(request, None)
        self.connections.busy(request, True)

    def shutdown_request(self, request: Any) -> None:
        with self._heads_lock:
            self._heads.pop(request, None)
        self.connections.release(request)
        super().shutdown_request(request)  # type: ignore[misc]

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        peer = client_address[0] if isinstance(client_address, tuple) else "?"
        self.quiet.note(
            f"error:{type(exc).__name__}",
            f"request from {peer} failed: {type(exc).__name__}: {exc}",
        )

    def server_close(self) -> None:
        self._stopped.set()
        super().server_close()  # type: ignore[misc]

    def _reap(self) -> None:
        while not self._stopped.wait(REAP_INTERVAL):
            now = time.monotonic()
            with self._heads_lock:
                late = [s for s, t in self._heads.items() if now - t > self.limits.head_seconds]
            for sock in late:
                _hang_up(sock)


class BoundedHTTPServer(_Bounded, ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` within ``limits``; its handler is a :class:`BoundedHandler`."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        limits: ConnLimits | None = None,
    ) -> None:
        self._start_bounds(limits)
        super().__init__(address, handler)


class BoundedWSGIServer(_Bounded, WSGIServer):
    """``wsgiref``'s server, threaded and within ``limits``; handler
    :class:`QuietWSGIHandler`."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[WSGIRequestHandler],
        bind_and_activate: bool = True,
        limits: ConnLimits | None = None,
    ) -> None:
        self._start_bounds(limits)
        super().__init__(address, handler, bind_and_activate)

    def process_request(self, request: Any, client_address: Any) -> None:
        threading.Thread(
            target=self._serve_one, args=(request, client_address), daemon=True
        ).start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)


class BoundedHandler(BaseHTTPRequestHandler):
    """Tells its server when the head has arrived; logs nothing per request."""

    def parse_request(self) -> bool:
        ok = super().parse_request()
        if ok and isinstance(self.server, _Bounded):
            self.server.headed(self.connection)
        return ok

    def log_message(self, format: str, *args: Any) -> None:
        return

    def log_error(self, format: str, *args: Any) -> None:
        if isinstance(self.server, _Bounded):
            self.server.quiet.note("bad-request", f"bad request from {self.client_address[0]}")


class QuietWSGIHandler(BoundedHandler, WSGIRequestHandler):
    """:class:`BoundedHandler` for ``wsgiref``."""


def _hang_up(sock: Any) -> None:
    """Close a connection another thread may be reading: shut it down (its reader gets
    EOF and ends); the thread closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
