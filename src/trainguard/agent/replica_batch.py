"""Many replica files in one HTTP body: per file a JSON header line, then its bytes.

A batch is ``{"path": "<relative path>", "size": <bytes>}\\n`` followed by exactly
``size`` bytes, once per file, and nothing else: a pusher sends every changed file of a
pass to a peer in one request (``POST /replica/<node>``), and a replacement pulls a
peer's whole replica of a node in one (``GET /replica/<node>?batch=1``). Nothing in it
is unpickled; a header is bounded (:data:`MAX_HEADER_BYTES`) and must be exactly those
two fields with a plain relative path. Each file is written under a temporary name and
renamed once whole (:func:`write_file`), so a torn batch leaves no partial file; the
files before the tear stand, each consistent by the replicas' rule (a shard's data goes
before its meta, whose checksum a pull checks).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, NamedTuple, Protocol

from trainguard.checkpoint.tier_dir import create_private

__all__ = [
    "BATCH_QUERY",
    "MAX_HEADER_BYTES",
    "Frame",
    "ReplicaError",
    "ReplicaRoomError",
    "check_relpath",
    "file_part",
    "frame_header",
    "read_frame",
    "safe_relpath",
    "write_file",
]

MAX_HEADER_BYTES = 4096
BATCH_QUERY = "batch=1"
"""The query of a ``GET /replica/<node>`` that asks for the files, not their listing."""
CHUNK_BYTES = 4 * 1024 * 1024


class ReplicaError(ValueError):
    """A replica request that names an unsafe or unknown path, or a malformed batch."""


class ReplicaRoomError(ReplicaError):
    """A replica file larger than the room this node has for it."""


class BatchStream(Protocol):
    """What a batch is read from: a request's body, a reply, a file."""

    def readline(self, size: int = -1, /) -> bytes: ...

    def readinto(self, buffer: memoryview, /) -> int: ...


class Frame(NamedTuple):
    """One file of a batch: its relative path and size."""

    path: str
    size: int


def check_relpath(relpath: str) -> str:
    """``relpath`` if it is a plain relative path (no root, no ``..``, no NUL byte), else
    :class:`ReplicaError`; string tests (a batch checks every header's)."""
    if not relpath or relpath[0] == "/" or "\0" in relpath or ".." in relpath.split("/"):
        raise ReplicaError(f"replica path {relpath!r} is not a plain relative path")
    return relpath


def safe_relpath(relpath: str) -> Path:
    """:func:`check_relpath`'s path."""
    return Path(check_relpath(relpath))


def frame_header(path: str, size: int) -> bytes:
    """The header line of a file of ``size`` bytes at ``path`` in a batch."""
    header = json.dumps({"path": path, "size": size}).encode() + b"\n"
    if len(header) > MAX_HEADER_BYTES:
        raise ReplicaError(f"replica path {path[:80]!r}...: too long for a batch header")
    return header


def file_part(file: IO[bytes], path: str) -> tuple[bytes, IO[bytes], int]:
    """An open file's part of a batch: its header, the file, its size (as it is now)."""
    size = os.fstat(file.fileno()).st_size
    return frame_header(path, size), file, size


def read_frame(stream: BatchStream) -> Frame | None:
    """The next file's header (its bytes follow in ``stream``); None at the batch's end.
    :class:`ReplicaError` for a header that is torn, too long, or not a frame."""
    line = stream.readline(MAX_HEADER_BYTES + 1)
    if not line:
        return None
    if not line.endswith(b"\n"):
        if len(line) > MAX_HEADER_BYTES:
            raise ReplicaError(f"replica batch: a header longer than {MAX_HEADER_BYTES} bytes")
        raise ReplicaError("replica batch: the body ended inside a header")
    try:
        header = json.loads(line.decode())
    except ValueError:  # UnicodeDecodeError too
        raise ReplicaError(f"replica batch: a header is not JSON: {line[:80]!r}") from None
    if not isinstance(header, dict) or set(header) != {"path", "size"}:
        raise ReplicaError(f"replica batch: expected a header {{path, size}}, got {line[:80]!r}")
    path, size = header["path"], header["size"]
    if not isinstance(path, str):
        raise ReplicaError(f"replica batch: path: expected a string, got {path!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ReplicaError(f"replica batch: {path!r}: size: expected a count, got {size!r}")
    check_relpath(path)
    return Frame(path, size)


def write_file(target: str | Path, stream: BatchStream, size: int, what: str) -> None:
    """Write the next ``size`` bytes of ``stream`` to ``target`` (its directory made
    already, :func:`~trainguard.checkpoint.tier_dir.private_dir`) atomically (a temporary
    file renamed once whole: nothing of it stays when the stream fails or ends early)."""
    parent, name = os.path.split(target)
    tmp = os.path.join(parent, f".tmp-{name}-{threading.get_ident()}")
    try:
        fd = create_private(tmp)
        try:
            _fill(fd, stream, size, what)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _fill(fd: int, stream: BatchStream, size: int, what: str) -> None:
    """Write the next ``size`` bytes of ``stream`` to the file ``fd``."""
    # A request's body (the agent's server) is spliced from its socket to the file;
    # other streams (a reply, in a restore) are read into a buffer and written.
    splice: Callable[[int, int], int] | None = getattr(stream, "splice_into", None)
    view = memoryview(bytearray(0 if splice else min(CHUNK_BYTES, max(size, 1))))
    remaining = size
    while remaining > 0:
        if splice is not None:
            got = splice(fd, remaining)
        else:
            got = stream.readinto(view[: min(len(view), remaining)])
            written = 0
            while written < got:
                written += os.write(fd, view[written:got])
        if not got:
            raise ReplicaError(f"replica {what}: body ended {remaining} bytes early")
        remaining -= got
