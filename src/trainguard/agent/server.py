"""The agent's HTTP server: :class:`~trainguard.agent.api.AgentApi` over ``http.server``.

HTTP/1.1 with keep-alive (the controller reuses one connection per agent), one thread
per connection. The token is checked before a body is read; a body over
:data:`MAX_BODY_BYTES` is refused unread. Besides the API's JSON routes, it streams the
memory-tier replicas peers push and pull (``/replica/...``, see
:mod:`trainguard.agent.replicas`).
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trainguard.agent.api import AgentApi, NodeControl, Reply, error_reply, json_reply
from trainguard.agent.replicas import REPLICA_PATH, ReplicaError, ReplicaStore

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
IDLE_SECONDS = 300.0
"""A kept-alive connection with no request for this long is closed."""


class AgentHTTPServer(ThreadingHTTPServer):
    """Serves one node's API; binds on construction (port 0: any free port)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        host: str,
        port: int,
        node: NodeControl,
        token: str,
        replicas: ReplicaStore | None = None,
    ) -> None:
        self.api = AgentApi(node, token)
        self.replicas = replicas
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        """Serve on a background thread."""
        self._thread = threading.Thread(
            target=self.serve_forever, name="trainguard-agent-http", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
        self.server_close()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer that hung up is no news; anything else is logged once, briefly."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            logger.debug("connection from %s dropped: %s", client_address, error)
        else:
            logger.warning("request from %s failed: %r", client_address, error)


class _Handler(BaseHTTPRequestHandler):
    server: AgentHTTPServer
    server_version = "trainguard-agent"
    protocol_version = "HTTP/1.1"
    timeout = IDLE_SECONDS

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        api = self.server.api
        if not api.authorized(self.headers.get("Authorization")):
            self.close_connection = True  # the body, if any, stays unread
            self._send(error_reply(401, "missing or wrong bearer token"))
            return
        if self.path.startswith(REPLICA_PATH):
            self._replica(method)
            return
        unknown = api.route(method, self.path)
        if unknown is not None:
            self.close_connection = True
            self._send(unknown)
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            self._send(error_reply(400, "Content-Length: not a number"))
            return
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(error_reply(413, f"body larger than {MAX_BODY_BYTES} bytes"))
            return
        body = self.rfile.read(length) if length > 0 else b""
        reply = api.handle(method, self.path, body)
        try:
            self._send(reply)
        finally:  # even if the caller hung up before reading the reply
            if reply.after is not None:
                reply.after()

    def _replica(self, method: str) -> None:
        """``PUT /replica/<node>/<file>`` (streamed), ``GET /replica/<node>[/<file>]``."""
        store = self.server.replicas
        if store is None:
            self.close_connection = True
            self._send(error_reply(404, "this agent keeps no replicas (no memory tier)"))
            return
        rest = urllib.parse.unquote(self.path.split("?", 1)[0][len(REPLICA_PATH) :])
        source, _, relpath = rest.partition("/")
        try:
            if method == "PUT" and relpath:
                length = int(self.headers.get("Content-Length") or 0)
                store.receive(source, relpath, self.rfile, length)
                self._send(json_reply(201, {"stored": relpath}))
            elif method == "GET" and not relpath:
                self._send(json_reply(200, {"files": store.listing(source)}))
            elif method == "GET":
                path = store.path(source, relpath)
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(path.stat().st_size))
                self.end_headers()
                with open(path, "rb") as f:
                    shutil.copyfileobj(f, self.wfile, 4 * 1024 * 1024)
            else:
                self.close_connection = True
                self._send(error_reply(405, f"{method} {REPLICA_PATH}... is not supported"))
        except (ReplicaError, ValueError) as exc:
            self.close_connection = True
            self._send(error_reply(400, str(exc)))
        except FileNotFoundError as exc:
            self.close_connection = True
            self._send(error_reply(404, str(exc)))

    def _send(self, reply: Reply) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply.body)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(reply.body)
        self.wfile.flush()
