"""One connection of the agent's HTTP server: the request head, bounded body reads, replies.

Only as much HTTP/1.1 as the agent API needs (its one client,
:class:`~trainguard.agent.client.AgentClient`, sends nothing else; ``urllib`` and
``curl`` fit too): a request line, headers, and a body of ``Content-Length`` bytes. A
chunked body is refused (411), as is a head that is too large (431), malformed (400)
or of another protocol (505). Every reply has a ``Content-Length``.

Timeouts are the caller's: :class:`Connection` reads and writes with the socket's
timeout, and a body read can also have a deadline for the whole body.
"""

from __future__ import annotations

import contextlib
import fcntl
import http
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from trainguard.agent.api import Reply, error_reply
from trainguard.agent.blocking_socket import blocking

__all__ = ["Connection", "HttpError", "RequestHead", "head_end", "parse_head", "reply_bytes"]

MAX_HEADERS = 64
_CHUNK = 1024 * 1024
_PIPE_BYTES = 1024 * 1024


class HttpError(Exception):
    """A request the server answers with ``status`` and closes the connection on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def reply(self) -> Reply:
        return error_reply(self.status, str(self))


@dataclass(frozen=True)
class RequestHead:
    """A request line and its headers (names in lower case)."""

    method: str
    target: str
    version: str
    headers: dict[str, str]

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def keep_alive(self) -> bool:
        """HTTP/1.1 keeps the connection unless the client says ``close``; 1.0 never."""
        connection = self.headers.get("connection", "").lower()
        return self.version == "HTTP/1.1" and "close" not in connection

    @property
    def expects_continue(self) -> bool:
        return self.headers.get("expect", "").lower() == "100-continue"

    def content_length(self) -> int | None:
        """The body's declared size (None: none declared); :class:`HttpError` when it is
        not a plain count, or the body is chunked."""
        if "transfer-encoding" in self.headers:
            raise HttpError(411, "Transfer-Encoding is not supported: send a Content-Length")
        raw = self.headers.get("content-length")
        if raw is None:
            return None
        if not raw.isdigit() or len(raw) > 18:
            raise HttpError(400, f"Content-Length: expected a count of bytes, got {raw[:40]!r}")
        return int(raw)


def head_end(buffer: bytes | bytearray) -> int | None:
    """Where the body begins, once ``buffer`` holds a whole head (None: not yet)."""
    end = buffer.find(b"\r\n\r\n")
    return None if end < 0 else end + 4


def parse_head(raw: bytes) -> RequestHead:
    """The head in ``raw`` (up to and with its blank line); :class:`HttpError` if bad."""
    try:
        text = raw.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise HttpError(400, "request head is not text") from None
    lines = text[: -len("\r\n\r\n")].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise HttpError(400, f"bad request line: {lines[0][:80]!r}")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        if not version.startswith("HTTP/"):
            raise HttpError(400, f"bad request line: {lines[0][:80]!r}")
        raise HttpError(505, f"{version[:20]} is not supported: use HTTP/1.1")
    if not method.isalpha() or not method.isupper() or not target.startswith("/"):
        raise HttpError(400, f"bad request line: {lines[0][:80]!r}")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, f"more than {MAX_HEADERS} headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or " " in name or "\t" in name:
            raise HttpError(400, f"bad header line: {line[:80]!r}")
        key = name.lower()
        value = value.strip()
        if key == "content-length" and headers.get(key, value) != value:
            raise HttpError(400, "Content-Length given twice, differently")
        headers[key] = value
    return RequestHead(method, target, version, headers)


def reply_bytes(reply: Reply, close: bool, content_type: str = "application/json") -> bytes:
    """``reply`` as an HTTP/1.1 response; ``close``: with ``Connection: close``."""
    return reply_head(reply.status, len(reply.body), reply.headers, close, content_type) + (
        reply.body
    )


def reply_head(
    status: int, length: int, headers: dict[str, str], close: bool, content_type: str
) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    lines = [
        f"HTTP/1.1 {status} {phrase}",
        "Server: trainguard-agent",
        f"Content-Type: {content_type}",
        f"Content-Length: {length}",
    ]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class Connection:
    """A client's connection: its socket, the bytes read but not used yet, and when it
    was opened, last finished a request, and began sending the current head."""

    __slots__ = ("buffer", "head_since", "peer", "settled", "sock", "unsent")

    def __init__(self, sock: socket.socket, peer: str, now: float) -> None:
        self.sock = sock
        self.peer = peer
        self.buffer = bytearray()
        self.settled = now  # accepted, or its latest request answered
        self.head_since: float | None = None  # the first byte of a head came
        # The end of a reply the selector thread could not send at once (for a worker),
        # and whether to keep the connection after it.
        self.unsent: tuple[bytes, bool] | None = None

    def take_head(self) -> RequestHead:
        """Parse and consume the whole head at the start of the buffer."""
        end = head_end(self.buffer)
        assert end is not None, "take_head without a whole head"
        raw = bytes(self.buffer[:end])
        del self.buffer[:end]
        return parse_head(raw)

    def read_body(self, length: int, seconds: float) -> bytes:
        """Exactly ``length`` bytes of body, within ``seconds``: :class:`TimeoutError`
        when they do not come in time, :class:`ConnectionError` when the client hangs up
        first. The socket's timeout is as it was afterwards."""
        body = bytearray(self.buffer[:length])
        del self.buffer[: len(body)]
        timeout = self.sock.gettimeout()
        deadline = time.monotonic() + seconds
        try:
            while len(body) < length:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"body incomplete after {seconds:g} s")
                self.sock.settimeout(left)
                chunk = self.sock.recv(min(_CHUNK, length - len(body)))
                if not chunk:
                    raise ConnectionError(f"client hung up {length - len(body)} bytes early")
                body += chunk
        finally:
            self.sock.settimeout(timeout)
        return bytes(body)

    def body_stream(self, length: int) -> BodyStream:
        """A ``read(size)`` over the next ``length`` bytes of body (a streamed body); to
        close once read (a ``with`` block: it may hold a pipe)."""
        return BodyStream(self, length)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_reply(self, reply: Reply, close: bool) -> None:
        self.sock.sendall(reply_bytes(reply, close))

    def send_file(self, file: IO[bytes], size: int, close: bool) -> None:
        """A 200 whose body is ``size`` bytes of ``file`` (sent with ``sendfile``)."""
        self.send_parts([(b"", file, size)], size, close)

    def send_parts(
        self, parts: Sequence[tuple[bytes, IO[bytes], int]], size: int, close: bool
    ) -> None:
        """A 200 whose body (``size`` bytes) is each part's bytes, then the first bytes
        of its file (sent with ``sendfile``); the files must hold them (not shrink)."""
        self.sock.sendall(reply_head(200, size, {}, close, "application/octet-stream"))
        for prefix, file, count in parts:
            if prefix:
                self.sock.sendall(prefix)
            if count:
                self.sock.sendfile(file, 0, count)

    def close(self) -> None:
        """Close at once; a client still sending gets a reset, not a reply it cannot read."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class BodyStream:
    """``read(size)`` over a body: the buffered bytes first, then the socket's (each wait
    for bytes lasts at most the socket's timeout); ``b""`` once ``length`` bytes were read.

    From its first :meth:`splice_into` to :meth:`close`, the socket blocks (with its
    timeout as the kernel's, :func:`~trainguard.agent.blocking_socket.blocking`): once
    per body, not once per file of a batch."""

    def __init__(self, conn: Connection, length: int) -> None:
        self._conn = conn
        self._left = length
        self._pipe: tuple[int, int] | None = None
        self._bulk: contextlib.ExitStack | None = None  # the socket made blocking
        self._seconds = conn.sock.gettimeout()

    def read(self, size: int = -1, /) -> bytes:
        """``size`` bytes (all that is left if fewer), fewer only if the client hangs up."""
        want = self._left if size < 0 else min(size, self._left)
        if want <= 0:
            return b""
        buffer = self._conn.buffer
        chunk = bytearray(want)
        have = min(len(buffer), want)
        chunk[:have] = buffer[:have]
        del buffer[:have]
        view = memoryview(chunk)
        while have < want:
            got = self._recv_into(view[have:])
            if not got:
                break
            have += got
        self._left -= have
        return bytes(view[:have]) if have < want else bytes(chunk)

    def readinto(self, target: memoryview, /) -> int:
        """Fill ``target`` with the next bytes of body (the buffered ones first): how
        many came; fewer than asked only at the body's end or when the client hangs up."""
        want = min(len(target), self._left)
        buffer = self._conn.buffer
        have = min(len(buffer), want)
        target[:have] = buffer[:have]
        del buffer[:have]
        while have < want:
            got = self._recv_into(target[have:want])
            if not got:
                break
            have += got
        self._left -= have
        return have

    def splice_into(self, fd: int, count: int) -> int:
        """Write the next ``count`` bytes of body to the file ``fd``: the buffered ones,
        then straight from the socket through a pipe (``splice``: the bytes never pass
        through Python, and the kernel copies them once, not twice; one pipe for the
        whole body, kept for the thread's next body by :meth:`close`). How many were
        written: none only when the client hung up. :class:`TimeoutError` when a MiB
        of them (or the rest) does not come within the socket's timeout."""
        count = min(count, self._left)
        buffer = self._conn.buffer
        done = min(len(buffer), count)
        if done:  # what came with the request's head or a header line: a little
            with memoryview(buffer) as view:
                written = 0
                while written < done:
                    written += os.write(fd, view[written:done])
            del buffer[:done]
        sock = self._conn.sock
        if done < count and type(sock) is socket.socket:  # the kernel's bytes are the body
            if self._pipe is None:
                self._pipe = _take_pipe()
            try:
                if self._bulk is None:
                    self._bulk = contextlib.ExitStack()
                    self._bulk.enter_context(blocking(sock))
                done += _splice(sock, self._pipe, fd, count - done)
            except BlockingIOError:  # SO_RCVTIMEO ran out
                self._drop_pipe()  # it may hold bytes: none may go to the next file
                raise self._timed_out() from None
            except BaseException:
                self._drop_pipe()
                raise
        elif done < count:  # a wrapped socket (TLS): its bytes through Python
            chunk = self._recv(min(_CHUNK, count - done))
            done += len(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
        self._left -= done
        return done

    def readline(self, size: int = -1, /) -> bytes:
        """The body's next line, with its ``\\n``: at most ``size`` bytes (fewer at the
        body's end, or when the client hangs up); never reads past the body, nor more
        than ``size`` bytes past the line (the bytes after a batch's header line are a
        file's, for :meth:`splice_into`)."""
        buffer = self._conn.buffer
        limit = self._left if size < 0 else min(size, self._left)
        while True:
            end = buffer.find(b"\n", 0, limit)
            if end >= 0 or len(buffer) >= limit:
                take = end + 1 if end >= 0 else limit
                break
            got = self._recv(min(_CHUNK, limit - len(buffer)))
            if not got:
                take = min(len(buffer), limit)
                break
            buffer += got
        line = bytes(buffer[:take])
        del buffer[:take]
        self._left -= take
        return line

    def _recv(self, size: int) -> bytes:
        try:
            return self._conn.sock.recv(size)
        except BlockingIOError:  # blocking since a splice: SO_RCVTIMEO ran out
            raise self._timed_out() from None

    def _recv_into(self, view: memoryview) -> int:
        try:
            return self._conn.sock.recv_into(view)
        except BlockingIOError:  # blocking since a splice: SO_RCVTIMEO ran out
            raise self._timed_out() from None

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(f"timed out after {self._seconds} s")

    def close(self) -> None:
        """The socket as it was (if a splice made it blocking); the pipe (empty) kept
        for this thread's next body."""
        if self._bulk is not None:
            bulk, self._bulk = self._bulk, None
            bulk.close()
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            _give_back_pipe(pipe)

    def _drop_pipe(self) -> None:
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            os.close(pipe[0])
            os.close(pipe[1])

    def __enter__(self) -> BodyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_spare = threading.local()
"""Each thread's empty pipe between bodies (``pipe``): a body made one (and sized it)
and closed it again before; the agent's workers live as long as it does."""


def _take_pipe() -> tuple[int, int]:
    pipe: tuple[int, int] | None = getattr(_spare, "pipe", None)
    if pipe is None:
        return _open_pipe()
    _spare.pipe = None
    return pipe


def _give_back_pipe(pipe: tuple[int, int]) -> None:
    if getattr(_spare, "pipe", None) is None:
        _spare.pipe = pipe
    else:
        os.close(pipe[0])
        os.close(pipe[1])


def _open_pipe() -> tuple[int, int]:
    """A pipe for :func:`_splice`: (read end, write end), as large as allowed."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    with contextlib.suppress(OSError):  # a larger pipe, fewer calls (else 64 KiB)
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    return read_end, write_end


def _splice(sock: socket.socket, pipe: tuple[int, int], fd: int, count: int) -> int:
    """Move ``count`` bytes from ``sock`` to the file ``fd`` through ``pipe`` (empty
    before and after); how many moved (fewer: the peer hung up). The socket must block
    (:func:`~trainguard.agent.blocking_socket.blocking`), so that one call moves a pipe's
    worth of bytes (1 MiB) however they come in (a non-blocking one took what had come:
    many calls, and a ``select`` each): :class:`BlockingIOError` when a pipe's worth (or
    the rest) does not come within its receive timeout."""
    read_end, write_end = pipe
    moved = 0
    while moved < count:
        got = os.splice(sock.fileno(), write_end, min(_PIPE_BYTES, count - moved))
        if not got:
            break
        left = got
        while left:
            left -= os.splice(read_end, fd, left)
        moved += got
    return moved
