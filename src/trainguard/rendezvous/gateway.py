"""The door of the rendezvous store service: who may reach an attempt's store.

torch's ``TCPStore`` takes any client that connects, and by itself listens on every
interface. It has no credential the unmodified scripts of a job could present. So each
attempt's store listens on loopback alone (``master_listen_fd``: a socket bound here),
and the ranks reach it through a :class:`Gateway` (one asyncio loop, on its own thread)
listening on the job's address: loopback for a job on one host, the controller's
interface toward the other hosts across hosts (:mod:`trainguard.hosts.addresses`). The
gateway admits a connection only

- from a job host: the job's own address (and ``127.0.0.1``/``::1`` when that is
  loopback), or an address in the peers file
  (the controller writes each joined host's address there before it launches anything
  on it; re-read when an unknown address calls, at most every
  :data:`PEERS_REREAD_SECONDS`);
- within the connection bounds of :mod:`trainguard.netlimits` (per peer, in total);

and closes the heavy writers once the service's resident memory has grown by more than
``max_bytes`` (``$TRAINGUARD_STORE_MAX_MB``, default 1024) since it listened: a
connection that sent more than :data:`HEAVY_BYTES` within its current window of
:data:`HEAVY_WINDOW` seconds. A job's own ranks send bytes, not megabytes, to its store.
The memory is looked at on every chunk a heavy writer sends and, while any writer is
heavy, every :data:`MEMORY_CHECK_SECONDS`; with none (a job's ordinary run) the gateway
does nothing between connections. Refusals are one rate-limited log line each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainguard.netlimits import LOOPBACK, ConnLimits, ConnTable, QuietLog, conn_limits, is_loopback

__all__ = ["MAX_MB_ENV", "Gateway", "max_store_bytes", "resident_bytes"]

logger = logging.getLogger("trainguard.rendezvous")

MAX_MB_ENV = "TRAINGUARD_STORE_MAX_MB"
DEFAULT_MAX_MB = 1024
PEERS_REREAD_SECONDS = 0.5
HEAVY_BYTES = 1 << 20
HEAVY_WINDOW = 10.0
MEMORY_CHECK_SECONDS = 0.25
CHUNK = 1 << 16


def max_store_bytes() -> int:
    """How far the service's memory may grow (:data:`MAX_MB_ENV`); a bad value: default."""
    try:
        mb = int(os.environ.get(MAX_MB_ENV, DEFAULT_MAX_MB))
    except ValueError:
        mb = DEFAULT_MAX_MB
    return max(16, mb) << 20


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


class _Conn:
    """One proxied connection: its writer (to close it) and what it sent lately."""

    def __init__(self, peer: str, writer: asyncio.StreamWriter) -> None:
        self.peer = peer
        self.writer = writer
        self.window_start = time.monotonic()
        self.window_bytes = 0

    def sent(self, count: int) -> None:
        now = time.monotonic()
        if now - self.window_start > HEAVY_WINDOW:
            self.window_start, self.window_bytes = now, 0
        self.window_bytes += count

    def heavy(self, now: float) -> bool:
        """Whether it sent more than :data:`HEAVY_BYTES` in its current window."""
        return self.window_bytes > HEAVY_BYTES and now - self.window_start <= HEAVY_WINDOW


class Gateway:
    """Listens on ``host`` for each attempt's store and forwards admitted connections to
    the store's loopback port (see the module doc). Thread-safe; :meth:`close` stops it."""

    def __init__(
        self,
        host: str,
        peers_file: Path | None = None,
        *,
        limits: ConnLimits | None = None,
        max_bytes: int | None = None,
    ) -> None:
        self.host = host
        self._peers_file = peers_file
        self._peers: frozenset[str] = frozenset()
        self._peers_read = -float("inf")
        self.connections = ConnTable(limits or conn_limits())
        self._quiet = QuietLog(logger)
        self.max_bytes = max_store_bytes() if max_bytes is None else max_bytes
        self._baseline = resident_bytes()
        self._conns: dict[int, _Conn] = {}
        self._servers: dict[int, asyncio.Server] = {}  # store port -> its door
        self._guard: asyncio.Task[None] | None = None  # runs while a writer is heavy
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._loop_error)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="door")
        self._thread.start()

    def open(self, store_port: int) -> int:
        """The port where ``store_port`` (a store on loopback) is reached; opened once."""
        future = asyncio.run_coroutine_threadsafe(self._open(store_port), self._loop)
        return future.result(10.0)

    def close_door(self, store_port: int) -> None:
        """Stop listening for ``store_port`` (its attempt's store is dropped)."""
        asyncio.run_coroutine_threadsafe(self._close_door(store_port), self._loop).result(10.0)

    def close(self) -> None:
        for port in list(self._servers):
            with contextlib.suppress(Exception):
                self.close_door(port)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    # -- the loop's side -------------------------------------------------------------

    async def _open(self, store_port: int) -> int:
        server = self._servers.get(store_port)
        if server is None:

            async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                await self._serve(store_port, reader, writer)

            server = await asyncio.start_server(serve, self.host, 0, backlog=1024)
            self._servers[store_port] = server
        return int(server.sockets[0].getsockname()[1])

    async def _close_door(self, store_port: int) -> None:
        server = self._servers.pop(store_port, None)
        if server is not None:
            server.close()

    async def _serve(
        self, store_port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) else "?"
        key = id(writer)
        if not self._member(peer):
            self._quiet.note(
                f"stranger:{peer}", f"refused a store client from {peer}: not a job host"
            )
            writer.transport.abort()
            return
        admitted, evict = self.connections.admit(key, peer)
        if isinstance(evict, int) and (old := self._conns.get(evict)) is not None:
            old.writer.transport.abort()
        if not admitted:
            self._quiet.note(f"full:{peer}", f"refused a store client from {peer}: too many open")
            writer.transport.abort()
            return
        conn = self._conns[key] = _Conn(peer, writer)
        self.connections.busy(key, True)  # a store client idles between requests: keep it
        try:
            store_reader, store_writer = await asyncio.open_connection("127.0.0.1", store_port)
        except OSError as exc:
            self._quiet.note("store-down", f"store on port {store_port} unreachable: {exc}")
            self._drop(key)
            writer.transport.abort()
            return
        try:
            await asyncio.gather(
                _pump(reader, store_writer, conn, self._heavy_sent),
                _pump(store_reader, writer, None, None),
            )
        finally:
            self._drop(key)
            for w in (writer, store_writer):
                w.transport.abort()

    def _drop(self, key: int) -> None:
        self._conns.pop(key, None)
        self.connections.release(key)

    def _member(self, peer: str) -> bool:
        if peer == self.host or (peer in LOOPBACK and is_loopback(self.host)):
            return True
        if peer in self._peers:
            return True
        now = time.monotonic()
        if self._peers_file is not None and now - self._peers_read >= PEERS_REREAD_SECONDS:
            self._peers_read = now
            with contextlib.suppress(OSError, ValueError, TypeError):
                self._peers = frozenset(str(a) for a in json.loads(self._peers_file.read_text()))
        return peer in self._peers

    def _heavy_sent(self) -> None:
        """A heavy writer sent a chunk: look at the memory now, and every
        :data:`MEMORY_CHECK_SECONDS` for as long as any writer stays heavy (what it sent
        may still be on its way into the store)."""
        if self._guard is None or self._guard.done():
            self._guard = self._loop.create_task(self._guard_memory())
        self._check_memory()

    async def _guard_memory(self) -> None:
        while any(c.heavy(time.monotonic()) for c in self._conns.values()):
            await asyncio.sleep(MEMORY_CHECK_SECONDS)
            self._check_memory()

    def _check_memory(self) -> None:
        """Past the bound, close the heavy writers."""
        grown = resident_bytes() - self._baseline
        if grown > self.max_bytes:
            now = time.monotonic()
            heavy = [c for c in self._conns.values() if c.heavy(now)]
            for conn in heavy:
                self._quiet.note(
                    f"heavy:{conn.peer}",
                    f"closed a store client from {conn.peer}: the store grew by "
                    f"{grown >> 20} MiB (at most {self.max_bytes >> 20}; {MAX_MB_ENV})",
                )
                conn.writer.transport.abort()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        exc = context.get("exception")
        message = str(context.get("message", "error"))
        self._quiet.note(f"loop:{message[:40]}", f"{message}: {exc}" if exc else message)


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    conn: _Conn | None,
    check: Callable[[], None] | None,
) -> None:
    """Copy ``reader`` to ``writer`` until either ends (counting into ``conn``; a heavy
    writer's every chunk is ``check``ed before it goes on)."""
    try:
        while data := await reader.read(CHUNK):
            if conn is not None:
                conn.sent(len(data))
                if check is not None and conn.window_bytes > HEAVY_BYTES:
                    check()
                    if writer.transport.is_closing() or conn.writer.transport.is_closing():
                        break
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.transport.abort()  # one side ended: end the other
