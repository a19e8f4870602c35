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

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, NamedTuple, Protocol

from trainguard.checkpoint.tier_dir import open_private

__all__ = [
    "BATCH_QUERY",
    "MAX_HEADER_BYTES",
    "Frame",
    "ReplicaError",
    "ReplicaRoomError",
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


def safe_relpath(relpath: str) -> Path:
    path = Path(relpath)
    if not relpath or path.is_absolute() or ".." in path.parts or "\0" in relpath:
        raise ReplicaError(f"replica path {relpath!r} is not a plain relative path")
    return path


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
        header = json.loads(line)
    except ValueError:
        raise ReplicaError(f"replica batch: a header is not JSON: {line[:80]!r}") from None
    if not isinstance(header, dict) or set(header) != {"path", "size"}:
        raise ReplicaError(f"replica batch: expected a header {{path, size}}, got {line[:80]!r}")
    path, size = header["path"], header["size"]
    if not isinstance(path, str):
        raise ReplicaError(f"replica batch: path: expected a string, got {path!r}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ReplicaError(f"replica batch: {path!r}: size: expected a count, got {size!r}")
    safe_relpath(path)
    return Frame(path, size)


def write_file(target: Path, stream: BatchStream, size: int, what: str) -> None:
    """Write the next ``size`` bytes of ``stream`` to ``target`` (its directory made
    already, :func:`~trainguard.checkpoint.tier_dir.private_dir`) atomically (a temporary
    file renamed once whole: nothing of it stays when the stream fails or ends early)."""
    tmp = target.parent / f".tmp-{target.name}-{threading.get_ident()}"
    # A request's body (the agent's server) is spliced from its socket to the file;
    # other streams (a reply, in a restore) are read into a buffer and written.
    splice: Callable[[int, int], int] | None = getattr(stream, "splice_into", None)
    view = memoryview(bytearray(0 if splice else min(CHUNK_BYTES, max(size, 1))))
    remaining = size
    try:
        with open_private(tmp) as out:
            while remaining > 0:
                if splice is not None:
                    got = splice(out.fileno(), remaining)
                else:
                    got = stream.readinto(view[: min(len(view), remaining)])
                    out.write(view[:got])
                if not got:
                    raise ReplicaError(f"replica {what}: body ended {remaining} bytes early")
                remaining -= got
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
