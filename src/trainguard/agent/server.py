"""The agent's HTTP server: :class:`~trainguard.agent.api.AgentApi` over HTTP/1.1.

Kept-alive connections (the controller reuses a few per agent, each replica peer one),
with bounded threads, connections, heads, bodies and time; every number is in
:class:`ServerLimits`:

- One thread, the *selector*, accepts connections, watches every idle one and reads
  each request's head. A request whose head is in goes to a pool of at most
  ``workers`` threads, which check its token, read its body, answer and hand the
  connection back; but the selector answers a status poll (an authorized ``GET
  /status``, the controller's twice a second) itself, without blocking: a reply the
  socket does not take at once is finished by a worker. An idle connection costs a
  file descriptor, never a thread: however many are open, the server has 1 +
  ``workers`` threads.
- At most ``connections`` are open. One more closes the open connection that has gone
  longest without finishing a request (idle, or still sending its head; never one a
  worker serves). A client's kept-alive connection closed that way is reopened by it
  (:class:`~trainguard.agent.client.AgentClient` retries once).
- A head must be in within ``head_seconds`` of its first byte and fit ``head_bytes``
  (else 408, 431); a connection with no request for ``idle_seconds`` is closed; a body
  must be in within ``io_seconds`` (408), and every write or streamed read waits at
  most as long.
- The token is checked once the head is in, before any byte of the body is read. A
  request refused before its body (401, 404, 405, 411, 413) is answered and its
  connection closed with the body unread.
- Bodies are bounded per route (:meth:`AgentApi.body_limit`); a replica file (a ``PUT``
  or one of a batch's) by the room of the memory tier's replicas
  (:meth:`ReplicaStore.room`), and at most ``replica_transfers`` replica requests stream
  at once (503 beyond), which leaves workers for the controller.
- A client that hangs up is one debug line. An unexpected error is a 500 and one
  warning line (its traceback only at debug level).

A worker's part, one request, is :mod:`trainguard.agent.http_handler`'s; the protocol's
pieces (head, body reads, replies) are :mod:`trainguard.agent.http_conn`'s.

Besides the API's JSON routes, it streams the memory-tier replicas peers push and pull
(``/replica/...``, see :mod:`trainguard.agent.replicas`; a pass's files in one batch,
:mod:`trainguard.agent.replica_batch`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.agent.api import MAX_JSON_BYTES, AgentApi, NodeControl
from trainguard.agent.http_conn import Connection, HttpError, head_end, reply_bytes
from trainguard.agent.http_handler import RequestHandler
from trainguard.agent.lease import ControllerLease
from trainguard.agent.replicas import ReplicaStore
from trainguard.netlimits import LOOPBACK

__all__ = ["MAX_BODY_BYTES", "AgentHTTPServer", "ServerLimits"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = MAX_JSON_BYTES
"""The largest JSON body of any route."""


@dataclass(frozen=True)
class ServerLimits:
    """What one agent's HTTP server allows (see the module docstring).

    An agent serves one controller (one request at a time per poll or send, on 1-4
    kept-alive connections) and the peers that push replicas to it (one connection and
    one transfer each): far below these numbers.
    """

    workers: int = 8
    """Threads serving requests (the selector thread is one more)."""
    replica_transfers: int = 6
    """Replica requests (a file, or a batch of them) streamed at once; the other workers
    stay free for the controller."""
    connections: int = 64
    """Connections open at once."""
    per_peer: int = 32
    """Connections one address may hold (127.0.0.1 and ::1 count against ``connections``
    only): a flood from one host cannot take every slot from the controller."""
    head_bytes: int = 16 * 1024
    head_seconds: float = 10.0
    idle_seconds: float = 120.0
    io_seconds: float = 30.0
    backlog: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.replica_transfers < self.workers:
            raise ValueError("ServerLimits: expected 1 <= replica_transfers < workers")
        if self.connections <= self.workers:
            raise ValueError("ServerLimits: expected connections > workers")
        if self.per_peer < 1:
            raise ValueError("ServerLimits: expected per_peer >= 1")
        if min(self.head_seconds, self.idle_seconds, self.io_seconds) <= 0:
            raise ValueError("ServerLimits: timeouts must be positive")


_LISTENER = "listener"
_WAKE = "wake"


class AgentHTTPServer:
    """Serves one node's API; binds on construction (port 0: any free port)."""

    def __init__(
        self,
        host: str,
        port: int,
        node: NodeControl,
        token: str,
        replicas: ReplicaStore | None = None,
        limits: ServerLimits | None = None,
        lease: ControllerLease | None = None,
        log_root: Path | None = None,
    ) -> None:
        self.api = AgentApi(node, token, lease, log_root)
        self.replicas = replicas
        self.limits = limits or ServerLimits()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=self.limits.backlog)
        self.socket.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.socket, selectors.EVENT_READ, _LISTENER)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._lock = threading.Lock()
        self._open: set[Connection] = set()  # every connection (under _lock)
        self._waiting: set[Connection] = set()  # in the selector (its thread only)
        self._returned: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self._work: queue.SimpleQueue[Connection | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle_workers = threading.Semaphore(0)
        self._handler = RequestHandler(
            self.api, replicas, self.limits.io_seconds, self.limits.replica_transfers
        )
        self._accept_paused_until: float | None = None
        self._accept_warned = -math.inf
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.socket.getsockname()[1])

    def start(self) -> None:
        """Serve on a background thread."""
        self._thread = threading.Thread(target=self._run, name="trainguard-agent-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close every connection (requests under way are cut off)."""
        self._stopping.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            connections, self._open = list(self._open), set()
        for conn in connections:
            conn.close()
        for _ in self._workers:
            self._work.put(None)
        self._selector.close()
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()

    def connection_count(self) -> int:
        with self._lock:
            return len(self._open)

    # -- the selector thread --------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._turn()
            except Exception as exc:  # never stop serving: a bug costs one line a turn
                if self._stopping.is_set():
                    return
                logger.warning("HTTP server: %r", exc)
                logger.debug("the traceback of %r", exc, exc_info=True)
                time.sleep(0.1)

    def _turn(self) -> None:
        timeout = self._next_deadline(time.monotonic())
        for key, _ in self._selector.select(timeout):
            if key.data is _LISTENER:
                self._accept()
            elif key.data is _WAKE:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                self._read(key.data)
        self._take_back()
        self._expire(time.monotonic())

    def _next_deadline(self, now: float) -> float:
        limits = self.limits
        soonest = now + limits.idle_seconds
        for conn in self._waiting:
            if conn.head_since is not None:
                soonest = min(soonest, conn.head_since + limits.head_seconds)
            else:
                soonest = min(soonest, conn.settled + limits.idle_seconds)
        if self._accept_paused_until is not None:
            soonest = min(soonest, self._accept_paused_until)
        return max(0.0, soonest - now)

    def _accept(self) -> None:
        for _ in range(32):
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: try again shortly
                now = time.monotonic()
                if now - self._accept_warned > 60.0:
                    self._accept_warned = now
                    logger.warning("cannot accept connections for now: %s", exc)
                self._selector.unregister(self.socket)
                self._accept_paused_until = now + 0.5
                return
            if self._over_peer_cap(address):
                sock.close()
                continue
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(sock, _peer(address), time.monotonic())
            with self._lock:
                self._open.add(conn)
                count = len(self._open)
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._waiting.add(conn)
            if count > self.limits.connections:
                self._evict()

    def _over_peer_cap(self, address: Any) -> bool:
        """Whether ``address``'s host already holds :attr:`ServerLimits.per_peer`
        connections (then a debug line)."""
        host = str(address[0]) if isinstance(address, tuple) and address else "?"
        if host in LOOPBACK:
            return False
        prefix = f"{host}:"
        with self._lock:
            held = sum(1 for c in self._open if c.peer.startswith(prefix))
        if held < self.limits.per_peer:
            return False
        logger.debug("%s: refused: it holds %d connections", host, held)
        return True

    def _evict(self) -> None:
        """Close the waiting connection that has gone longest without finishing a
        request (idle, or still sending its head)."""
        victim = min(self._waiting, key=lambda c: c.settled)
        logger.debug(
            "%s: closed: over %d connections, and the longest without a request",
            victim.peer,
            self.limits.connections,
        )
        self._drop(victim)

    def _read(self, conn: Connection) -> None:
        limit = self.limits.head_bytes
        try:
            data = conn.sock.recv(limit)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            logger.debug("%s: connection dropped: %s", conn.peer, exc)
            self._drop(conn)
            return
        if not data:  # the client closed it
            self._drop(conn)
            return
        if conn.head_since is None:
            conn.head_since = time.monotonic()
        conn.buffer += data
        end = head_end(conn.buffer)
        while end is not None and end <= limit:
            answered = self._answer_here(conn, end)
            if answered is None:  # not a status poll: a worker's
                self._dispatch(conn)
            if not answered:
                return
            end = head_end(conn.buffer)  # pipelined: the next head is in
        if end is not None or len(conn.buffer) > limit:
            self._refuse(conn, HttpError(431, f"request head larger than {limit} bytes"))

    def _answer_here(self, conn: Connection, end: int) -> bool | None:
        """Answer a status poll on this thread: it never blocks (a worker sends what the
        socket does not take at once). True: the connection waits for its next request
        here; False: it was closed or handed to a worker; None: not a status poll."""
        answer = self._handler.quick(conn, end)
        if answer is None:
            return None
        data, keep = answer
        try:
            sent = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            logger.debug("%s: connection dropped: %s", conn.peer, exc)
            self._drop(conn)
            return False
        if sent < len(data):
            conn.unsent = (data[sent:], keep)
            self._dispatch(conn)
            return False
        if not keep:
            self._drop(conn)
            return False
        now = time.monotonic()
        conn.settled = now
        conn.head_since = now if conn.buffer else None
        return True

    def _expire(self, now: float) -> None:
        limits = self.limits
        for conn in list(self._waiting):
            if conn.head_since is not None and now - conn.head_since > limits.head_seconds:
                seconds = limits.head_seconds
                self._refuse(conn, HttpError(408, f"request head incomplete after {seconds:g} s"))
            elif conn.head_since is None and now - conn.settled > limits.idle_seconds:
                logger.debug("%s: closed after %g s idle", conn.peer, limits.idle_seconds)
                self._drop(conn)
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self.socket, selectors.EVENT_READ, _LISTENER)

    def _take_back(self) -> None:
        """Wait again on the connections workers have answered a request on."""
        now = time.monotonic()
        while True:
            try:
                conn = self._returned.get_nowait()
            except queue.Empty:
                return
            if self._stopping.is_set():
                self._forget(conn)
                continue
            conn.settled = now
            conn.head_since = now if conn.buffer else None
            conn.sock.setblocking(False)
            if head_end(conn.buffer) is not None:  # pipelined: the next head is in
                self._work_on(conn)
                continue
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
            self._waiting.add(conn)

    def _dispatch(self, conn: Connection) -> None:
        self._selector.unregister(conn.sock)
        self._waiting.discard(conn)
        self._work_on(conn)

    def _work_on(self, conn: Connection) -> None:
        self._work.put(conn)
        if self._idle_workers.acquire(blocking=False):
            return
        if len(self._workers) < self.limits.workers:
            name = f"trainguard-agent-http-{len(self._workers)}"
            thread = threading.Thread(target=self._work_forever, name=name, daemon=True)
            self._workers.append(thread)
            thread.start()

    def _refuse(self, conn: Connection, error: HttpError) -> None:
        """Answer ``error`` if the socket takes it at once, and close."""
        logger.debug("%s: %d %s", conn.peer, error.status, error)
        with contextlib.suppress(OSError):
            conn.sock.send(reply_bytes(error.reply(), close=True))
        self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        if conn in self._waiting:
            self._waiting.discard(conn)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(conn.sock)
        self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        with self._lock:
            self._open.discard(conn)
        conn.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: the selector wakes anyway
            self._wake_w.send(b"x")

    # -- the workers ----------------------------------------------------------------------

    def _work_forever(self) -> None:
        while True:
            conn = self._work.get()
            if conn is None:
                return
            if conn.unsent is not None:
                keep = self._handler.finish(conn)
            else:
                keep = self._handler.serve(conn)
            if keep and not self._stopping.is_set():
                self._returned.put(conn)
                self._wake()
            else:
                self._forget(conn)
            self._idle_workers.release()


def _peer(address: Any) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)
