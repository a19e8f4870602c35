"""Client of the agent API: the wire models over kept-alive HTTP/1.1 connections.

No torch. One :class:`AgentClient` per agent; it is safe to call from several threads at
once (each call takes an idle connection from a small pool, or opens one).

The HTTP is this module's own, on purpose, and only as much as the agent API needs: a
request with a ``Content-Length`` body, a reply with a status line, headers and a
``Content-Length`` body (both agent servers send nothing else; anything else is an
:class:`AgentError`). ``http.client`` parses every reply's headers through the
``email`` package, which made polling 4096 agents cost twice the CPU it does here.
"""

from __future__ import annotations

import os
import socket
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from pydantic import ValidationError

from trainguard.agent.blocking_socket import blocking
from trainguard.agent.rank_log import LOGS_PATH, LogPiece
from trainguard.http_client import error_text
from trainguard.wire.base import Wire
from trainguard.wire.base import error_text as wire_error
from trainguard.wire.requests import (
    AssignRequest,
    AttachRequest,
    AttemptRequest,
    InjectRequest,
    PersistRequest,
    ReplaceRequest,
    StopRequest,
)
from trainguard.wire.status import NodeStatus

__all__ = ["DEFAULT_TIMEOUT", "AgentClient", "AgentError", "AgentUnreachable", "StatusPoll"]

DEFAULT_TIMEOUT = 5.0  # s per request
MAX_REPLY_BYTES = 64 * 1024 * 1024
_POOL = 4  # idle connections kept per agent
_CHUNK = 65536

Part = tuple[bytes, IO[bytes], int]
"""Of an upload's body: some bytes, then the first bytes of a file (how many)."""


class AgentError(Exception):
    """The agent refused a request (``status`` is its HTTP status, if it answered)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class AgentUnreachable(AgentError):
    """No answer: connection refused, reset, or timed out."""


@dataclass(frozen=True)
class StatusPoll:
    """A status request sent on ``sock`` (a kept-alive connection if ``reused``), its
    reply not read yet (:meth:`AgentClient.status_of`)."""

    sock: socket.socket
    reused: bool


class _Dropped(Exception):
    """A kept-alive connection the agent closed before this request (retry once)."""


class AgentClient:
    """Talks to one node agent at ``base_url`` (e.g. ``http://127.0.0.1:8471``)."""

    def __init__(self, base_url: str, token: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.base_url = base_url.rstrip("/")
        parts = urllib.parse.urlsplit(self.base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"agent URL: expected http://HOST:PORT, got {base_url!r}")
        self._address = (parts.hostname, parts.port or 80)
        self._head = f"Host: {parts.netloc}\r\nAuthorization: Bearer {token}\r\n".encode()
        self.timeout = timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()

    def status(self) -> NodeStatus:
        return self._status(self._request("GET", "/status", None))

    def status_sent(self) -> StatusPoll:
        """Ask for the status and return at once: :meth:`status_of` reads the reply
        (once its socket is readable, so that one thread polls several agents at once)."""
        url = self.base_url + "/status"
        message = self._message("GET", "/status", None)
        for attempt in (0, 1):
            sock, reused = self._connection(url, "GET")
            try:
                sock.sendall(message)
            except OSError as exc:
                sock.close()
                if reused and attempt == 0:
                    continue  # the agent closed a kept-alive connection meanwhile
                raise AgentUnreachable(f"GET {url}: {exc or type(exc).__name__}") from None
            return StatusPoll(sock, reused)
        raise AssertionError("unreachable")

    def status_of(self, poll: StatusPoll) -> NodeStatus:
        """The reply to :meth:`status_sent`'s request (waiting for it at most the
        timeout); a kept-alive connection the agent had closed is retried once."""
        url = self.base_url + "/status"
        try:
            status, keep, reply = _reply(poll.sock)
        except _Dropped:
            poll.sock.close()
            if poll.reused:
                return self.status()
            raise AgentUnreachable(f"GET {url}: connection closed") from None
        except (OSError, ValueError) as exc:
            poll.sock.close()
            raise AgentUnreachable(f"GET {url}: {exc or type(exc).__name__}") from None
        return self._status(self._finish(poll.sock, "GET", url, status, keep, reply))

    def timed_out(self, poll: StatusPoll) -> AgentUnreachable:
        """Give up :meth:`status_sent`'s request: no reply within the timeout."""
        poll.sock.close()
        return AgentUnreachable(f"GET {self.base_url}/status: timed out")

    def _status(self, raw: bytes) -> NodeStatus:
        try:
            return NodeStatus.model_validate_json(raw)
        except ValidationError as exc:
            detail = wire_error(exc, "status")
            raise AgentError(f"{self.base_url}: bad status reply: {detail}") from None

    def start(self, request: AttemptRequest) -> None:
        """Ask the agent to start the request's workers (asynchronous)."""
        self._request("POST", "/start", request)

    def rejoin(self, request: AttemptRequest) -> None:
        """In-process restart into the request's attempt (asynchronous)."""
        self._request("POST", "/rejoin", request)

    def replace(self, request: ReplaceRequest) -> None:
        """Give stuck ranks new processes (asynchronous)."""
        self._request("POST", "/replace", request)

    def stop(self, request: StopRequest | None = None) -> None:
        """Stop an attempt (default: whatever runs, gracefully). Asynchronous: poll
        :meth:`status` until ``stopped``."""
        self._request("POST", "/stop", request or StopRequest())

    def persist(self, request: PersistRequest) -> None:
        """Ask the agent to persist a memory-tier step (asynchronous)."""
        self._request("POST", "/persist", request)

    def inject(self, request: InjectRequest) -> None:
        """Have the agent hold these step injections (replacing what it held)."""
        self._request("POST", "/inject", request)

    def attach(self, request: AttachRequest) -> None:
        """Take this agent over for a resumed job's controller (``POST /attach``)."""
        self._request("POST", "/attach", request)

    def assign(self, request: AssignRequest) -> None:
        """Give a standby agent (``--standby``) its node's incarnation."""
        self._request("POST", "/assign", request)

    def shutdown(self) -> None:
        """Ask the agent to kill its workers and exit."""
        self._request("POST", "/shutdown", None)

    def rank_log(self, rank: int, offset: int, rotation: int = 0) -> LogPiece:
        """A piece of rank ``rank``'s log on the agent's host (``GET /logs``; at most
        :data:`~trainguard.agent.rank_log.MAX_CHUNK` bytes from ``offset``);
        ``rotation``: its ``K``-th rotated file."""
        query = f"rank={int(rank)}&offset={int(offset)}&rotation={int(rotation)}"
        raw = self._request("GET", f"{LOGS_PATH}?{query}", None)
        try:
            return LogPiece.from_reply(raw)
        except ValueError as exc:
            raise AgentError(f"{self.base_url}{LOGS_PATH}: {exc}") from None

    def upload(self, path: str, parts: Sequence[Part]) -> None:
        """POST a body of ``parts`` to ``path``: each part's bytes, then the first
        ``size`` bytes of its file, sent with ``sendfile`` (a batch of replicas of
        memory-tier files), once the agent has said it takes it (``Expect:
        100-continue``: a refusal, e.g. 413, comes before the body). A file shorter
        than its size by then (rewritten meanwhile) is padded with zeros: a torn copy,
        which its meta's checksum tells."""
        size = sum(len(prefix) + n for prefix, _, n in parts)
        head = f"POST {path} HTTP/1.1\r\n".encode() + self._head
        head += b"Content-Type: application/octet-stream\r\nContent-Length: %d\r\n" % size
        head += b"Expect: 100-continue\r\n"
        self._send("POST", path, head + b"\r\n", parts)

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- HTTP ----------------------------------------------------------------------------

    def _request(self, method: str, path: str, payload: Wire | None) -> bytes:
        return self._send(method, path, self._message(method, path, payload))

    def _message(self, method: str, path: str, payload: Wire | None) -> bytes:
        """A request's bytes: its head, then ``payload``'s JSON if any."""
        body = payload.model_dump_json().encode() if payload is not None else b""
        head = f"{method} {path} HTTP/1.1\r\n".encode() + self._head
        if body or method == "POST":
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        return head + b"\r\n" + body

    def _send(self, method: str, path: str, message: bytes, parts: Sequence[Part] = ()) -> bytes:
        """One request (``message``, then ``file``'s bytes if any); retried once on a
        kept-alive connection the agent had closed."""
        url = self.base_url + path
        for attempt in (0, 1):
            sock, reused = self._connection(url, method)
            try:
                status, keep, reply = _exchange(sock, message, parts)
            except _Dropped:
                sock.close()
                if reused and attempt == 0:
                    continue  # the agent closed a kept-alive connection meanwhile
                raise AgentUnreachable(f"{method} {url}: connection closed") from None
            except (OSError, ValueError) as exc:
                sock.close()
                raise AgentUnreachable(f"{method} {url}: {exc or type(exc).__name__}") from None
            return self._finish(sock, method, url, status, keep, reply)
        raise AssertionError("unreachable")

    def _finish(
        self, sock: socket.socket, method: str, url: str, status: int, keep: bool, reply: bytes
    ) -> bytes:
        """Keep or close the connection a reply came on; the reply's body, or its error."""
        if keep:
            self._release(sock)
        else:
            sock.close()
        if status >= 400:
            raise AgentError(f"{method} {url}: {status} {error_text(reply)}", status)
        return reply

    def _connection(self, url: str, method: str) -> tuple[socket.socket, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        try:
            sock = socket.create_connection(self._address, self.timeout)
        except OSError as exc:
            raise AgentUnreachable(f"{method} {url}: {exc or type(exc).__name__}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < _POOL:
                self._idle.append(sock)
                return
        sock.close()


def _exchange(
    sock: socket.socket, message: bytes, parts: Sequence[Part] = ()
) -> tuple[int, bool, bytes]:
    """Send ``message`` (and ``parts``, if any, once the agent answers ``100
    Continue``), read one reply: (status, keep the connection, body).

    :class:`_Dropped` when the connection failed before any byte of a reply came back.
    """
    try:
        sock.sendall(message)
        data = sock.recv(_CHUNK)
        if parts and data.startswith(b"HTTP/1.1 100 "):
            while b"\r\n\r\n" not in data:
                more = sock.recv(_CHUNK)
                if not more:
                    raise ValueError("reply ended inside its headers")
                data += more
            data = data.partition(b"\r\n\r\n")[2]
            _send_parts(sock, parts)
            data = data or sock.recv(_CHUNK)
    except (ConnectionError, BrokenPipeError) as exc:
        raise _Dropped from exc
    return _reply(sock, data)


def _reply(sock: socket.socket, data: bytes | None = None) -> tuple[int, bool, bytes]:
    """Read one reply whose first bytes (``data``) may be in: (status, keep the
    connection, body); :class:`_Dropped` when the connection failed before any byte."""
    if data is None:
        try:
            data = sock.recv(_CHUNK)
        except ConnectionError as exc:
            raise _Dropped from exc
    if not data:
        raise _Dropped
    while b"\r\n\r\n" not in data:
        if len(data) > _CHUNK:
            raise ValueError("reply headers too large")
        more = sock.recv(_CHUNK)
        if not more:
            raise ValueError("reply ended inside its headers")
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP reply: {lines[0][:80]!r}")
    status = int(rest[:3])
    length: int | None = None
    keep = version == b"HTTP/1.1"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection":
            keep = value.strip().lower() != b"close"
        elif name == b"transfer-encoding":
            raise ValueError("chunked replies are not part of the agent API")
    if length is None:
        raise ValueError("reply without Content-Length")
    if length > MAX_REPLY_BYTES:
        raise ValueError(f"reply of {length} bytes is too large")
    chunks = [body]
    have = len(body)
    while have < length:
        more = sock.recv(min(_CHUNK, length - have))
        if not more:
            raise ValueError("reply ended inside its body")
        chunks.append(more)
        have += len(more)
    if have > length:
        raise ValueError("reply longer than its Content-Length")
    return status, keep, b"".join(chunks)


def _send_parts(sock: socket.socket, parts: Sequence[Part]) -> None:
    """Each part's bytes, then its file's (``sendfile``, the socket blocking meanwhile
    with its timeout as the kernel's: one call per file, not one per socket buffer)."""
    with blocking(sock):
        for prefix, file, size in parts:
            if prefix:  # MSG_MORE: it goes out with the file's first bytes, not alone
                sock.sendall(prefix, socket.MSG_MORE if size else 0)
            sent = 0
            while sent < size:
                got = os.sendfile(sock.fileno(), file.fileno(), sent, size - sent)
                if not got:
                    break
                sent += got
            left = size - sent
            while left > 0:  # the file shrank since its size was taken: zeros keep the framing
                pad = min(left, _CHUNK)
                sock.sendall(bytes(pad))
                left -= pad
