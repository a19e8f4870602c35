"""What the agent's HTTP server does with one request whose head is in: check the token,
bound the body, read it, answer.

In this order, so that nothing of a body is read before it is allowed: the token (401),
the ``Content-Length`` (400; 411 for a chunked body), the route (404, 405), the route's
bound (413, :meth:`AgentApi.body_limit`), then the body within its time (408). A replica
``PUT`` (one file) or ``POST`` (a batch of files, :mod:`trainguard.agent.replica_batch`)
is streamed to RAM, each file bounded by :meth:`ReplicaStore.room` before its bytes are
read; at most ``replica_transfers`` replica requests stream at once (503 beyond). Every
refusal before the body closes the connection with the body unread; a batch refused
midway (a bad header: 400, a file too large: 413) closes it too.

Errors: a client that hangs up or stalls is one debug line; an unexpected one is a 500
and one warning line (its traceback at debug level). :meth:`RequestHandler.serve` never
raises.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import urllib.parse
from collections.abc import Iterator

from trainguard.agent.api import AgentApi, Reply, error_reply, json_reply
from trainguard.agent.http_conn import Connection, HttpError, RequestHead, parse_head, reply_bytes
from trainguard.agent.replica_batch import BATCH_QUERY
from trainguard.agent.replicas import REPLICA_PATH, ReplicaError, ReplicaRoomError, ReplicaStore

__all__ = ["RequestHandler"]

logger = logging.getLogger(__name__)

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_QUICK = b"GET /status "
"""The request line's start of the one request answered without a worker (a poll)."""


class RequestHandler:
    """Answers requests for ``api`` (and ``replicas``), each read and written with
    ``io_seconds`` of patience."""

    def __init__(
        self,
        api: AgentApi,
        replicas: ReplicaStore | None,
        io_seconds: float,
        replica_transfers: int,
    ) -> None:
        self.api = api
        self.replicas = replicas
        self.io_seconds = io_seconds
        self.replica_transfers = replica_transfers
        self._transfers = threading.BoundedSemaphore(replica_transfers)

    def serve(self, conn: Connection) -> bool:
        """Answer the request whose head is in ``conn``'s buffer; whether to keep the
        connection for the next one."""
        head: RequestHead | None = None
        try:
            conn.sock.settimeout(self.io_seconds)
            head = conn.take_head()
            return self._exchange(conn, head)
        except HttpError as error:
            _log_request(conn, head, error.status)
            with contextlib.suppress(OSError):
                conn.send_reply(error.reply(), close=True)
        except OSError as exc:  # hung up, reset, timed out
            logger.debug("%s: connection dropped: %s", conn.peer, exc or type(exc).__name__)
        except Exception as exc:
            with contextlib.suppress(OSError):
                conn.send_reply(_internal_error(conn, head, exc), close=True)
        return False

    def finish(self, conn: Connection) -> bool:
        """Send the end of the reply :meth:`quick` made (``conn.unsent``); whether to keep
        the connection."""
        assert conn.unsent is not None
        (data, keep), conn.unsent = conn.unsent, None
        try:
            conn.sock.settimeout(self.io_seconds)
            conn.send(data)
        except OSError as exc:  # hung up, reset, timed out
            logger.debug("%s: connection dropped: %s", conn.peer, exc or type(exc).__name__)
            return False
        return keep

    def quick(self, conn: Connection, end: int) -> tuple[bytes, bool] | None:
        """A status poll's reply, made without blocking: the reply's bytes and whether to
        keep the connection; None (nothing consumed) for any other request, or one that
        is refused (a worker answers those, :meth:`serve`). ``end``: where the head in
        ``conn``'s buffer ends."""
        buffer = conn.buffer
        if not buffer.startswith(_QUICK):
            return None
        try:
            head = parse_head(bytes(buffer[:end]))
            if head.path != "/status" or head.content_length() or head.expects_continue:
                return None
        except HttpError:
            return None
        if not self.api.authorized(head.headers.get("authorization")):
            return None
        del buffer[:end]
        keep = head.keep_alive
        try:
            reply = self.api.handle(head.method, head.target, b"")
        except Exception as exc:
            reply, keep = _internal_error(conn, head, exc), False
        _log_request(conn, head, reply.status)
        return reply_bytes(reply, close=not keep), keep

    def _exchange(self, conn: Connection, head: RequestHead) -> bool:
        api = self.api
        if not api.authorized(head.headers.get("authorization")):
            raise HttpError(401, "missing or wrong bearer token")
        length = head.content_length()
        if head.path.startswith(REPLICA_PATH):
            return self._replica(conn, head, length)
        unknown = api.route(head.method, head.path)
        if unknown is not None:
            _log_request(conn, head, unknown.status)
            conn.send_reply(unknown, close=True)
            return False
        limit = api.body_limit(head.method, head.path)
        if (length or 0) > limit:
            raise HttpError(413, _too_large(head, limit))
        body = self._body(conn, head, length or 0)
        reply = api.handle(head.method, head.target, body)
        _log_request(conn, head, reply.status)
        keep = head.keep_alive
        try:
            conn.send_reply(reply, close=not keep)
        finally:  # even if the caller hung up before reading the reply
            if reply.after is not None:
                reply.after()
        return keep

    def _body(self, conn: Connection, head: RequestHead, length: int) -> bytes:
        if length == 0:
            return b""
        if head.expects_continue:
            conn.send(_CONTINUE)
        try:
            return conn.read_body(length, self.io_seconds)
        except TimeoutError:
            raise HttpError(408, f"body incomplete after {self.io_seconds:g} s") from None

    def _replica(self, conn: Connection, head: RequestHead, length: int | None) -> bool:
        """``PUT /replica/<node>/<file>``, ``POST /replica/<node>`` (a batch; both
        streamed), ``GET /replica/<node>[/<file>]`` (``?batch=1``: all files, a batch)."""
        store = self.replicas
        if store is None:
            raise HttpError(404, "this agent keeps no replicas (no memory tier)")
        rest = urllib.parse.unquote(head.path[len(REPLICA_PATH) :])
        source, _, relpath = rest.partition("/")
        keep = head.keep_alive
        try:
            if head.method == "PUT" and relpath:
                if length is None:
                    raise HttpError(411, "a replica PUT needs a Content-Length")
                room = store.room(source, relpath)
                if length > room:
                    raise HttpError(413, f"replica {relpath}: {length} bytes, room for {room}")
                with self._transfer():
                    if head.expects_continue:
                        conn.send(_CONTINUE)
                    with conn.body_stream(length) as body:
                        store.receive(source, relpath, body, length)
                reply = json_reply(201, {"stored": relpath})
            elif head.method == "POST" and not relpath:
                if length is None:
                    raise HttpError(411, "a replica batch needs a Content-Length")
                with self._transfer():
                    if head.expects_continue:
                        conn.send(_CONTINUE)
                    with conn.body_stream(length) as body:
                        stored = store.receive_batch(source, body)
                reply = json_reply(201, {"stored": stored})
            elif length:
                raise HttpError(413, _too_large(head, 0))
            elif head.method == "GET" and not relpath and head.target.endswith(f"?{BATCH_QUERY}"):
                with self._transfer(), store.batch(source) as (parts, size):
                    conn.send_parts(parts, size, close=not keep)
                _log_request(conn, head, 200)
                return keep
            elif head.method == "GET" and not relpath:
                reply = json_reply(200, {"files": store.listing(source)})
            elif head.method == "GET":
                with self._transfer(), open(store.path(source, relpath), "rb") as f:
                    conn.send_file(f, os.fstat(f.fileno()).st_size, close=not keep)
                _log_request(conn, head, 200)
                return keep
            else:
                raise HttpError(405, f"{head.method} {REPLICA_PATH}... is not supported")
        except ReplicaRoomError as exc:
            raise HttpError(413, str(exc)) from None
        except (ReplicaError, ValueError) as exc:  # a bad name (a NUL byte, say), a bad batch
            raise HttpError(400, str(exc)) from None
        except FileNotFoundError as exc:
            raise HttpError(404, str(exc)) from None
        except (ConnectionError, TimeoutError):
            raise  # the client's side
        except OSError as exc:  # this node's memory: full, read-only, ...
            raise HttpError(507, f"replica {relpath}: {exc.strerror or exc}") from None
        _log_request(conn, head, reply.status)
        conn.send_reply(reply, close=not keep)
        return keep

    @contextlib.contextmanager
    def _transfer(self) -> Iterator[None]:
        if not self._transfers.acquire(blocking=False):
            n = self.replica_transfers
            raise HttpError(503, f"busy: {n} replica transfers under way; try again")
        try:
            yield
        finally:
            self._transfers.release()


def _too_large(head: RequestHead, limit: int) -> str:
    if limit == 0:
        return f"{head.method} {head.path} takes no body"
    return f"{head.method} {head.path}: body larger than {limit} bytes"


def _internal_error(conn: Connection, head: RequestHead | None, exc: Exception) -> Reply:
    """The 500 of an unexpected error, logged (one warning line, its traceback at debug
    level)."""
    what = f"{head.method} {head.path}" if head is not None else "request"
    logger.warning("%s: %s failed: %r", conn.peer, what, exc)
    logger.debug("%s: the traceback of %r", conn.peer, exc, exc_info=True)
    return error_reply(500, f"internal error ({type(exc).__name__})")


def _log_request(conn: Connection, head: RequestHead | None, status: int) -> None:
    if head is not None:
        logger.debug("%s: %s %s -> %d", conn.peer, head.method, head.path, status)
