"""``GET /logs?rank=R&offset=N[&rotation=K]``: a piece of one rank's log, for a host that
does not hold it (``trainguard logs JOB --rank R`` on the controller's host of a job
across hosts; the client is :mod:`trainguard.platform.remote_log`).

The agent serves its job's log directory on its host (:class:`~trainguard.agent.logs.LogLayout`):
``rank-{R}.log``, or its rotation ``rank-{R}.log.{K}``. The request names a rank and
offsets, never a path: each is a decimal number, and the file opened is built from them
(``O_NOFOLLOW``: a link there is refused). A reply holds at most :data:`MAX_CHUNK` bytes
from ``offset``; the caller asks again from ``offset + len(data)`` until it has ``size``.
The reply is JSON (``data`` in base64): ``{"rank", "rotation", "offset", "size",
"rotations", "data"}``, ``rotations`` the number of rotated files there (1..K present).
A rank with no log there is a 404, a bad number a 400.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import os
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = ["LOGS_PATH", "MAX_CHUNK", "LogPiece", "rank_log_reply"]

Answer = tuple[int, dict[str, Any]]
"""An HTTP status and its JSON body (``{"error": ...}`` for a refusal)."""

LOGS_PATH: Final = "/logs"
MAX_CHUNK: Final = 256 * 1024
"""The most bytes of log one reply carries (base64 makes the body a third larger)."""
_MAX_NUMBER: Final = 1 << 48  # a rank, offset or rotation past this is not one
_MAX_ROTATIONS: Final = 1000


@dataclass(frozen=True)
class LogPiece:
    """One reply of ``GET /logs``: ``data`` is the file's bytes from ``offset``."""

    offset: int
    size: int
    rotations: int
    data: bytes

    @classmethod
    def from_reply(cls, raw: bytes) -> LogPiece:
        """The piece in a reply body; ValueError naming what is wrong in it."""
        try:
            body = json.loads(raw)
            piece = cls(
                int(body["offset"]),
                int(body["size"]),
                int(body["rotations"]),
                base64.b64decode(body["data"], validate=True),
            )
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            raise ValueError(f"a log reply that is not one: {exc!r}") from None
        if min(piece.offset, piece.size, piece.rotations) < 0 or len(piece.data) > MAX_CHUNK:
            raise ValueError("a log reply out of bounds")
        return piece


def rank_log_reply(root: Path, target: str) -> Answer:
    """The answer to ``GET target`` (``/logs?rank=...``) for the log directory ``root``."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(target).query, keep_blank_values=True)
    try:
        rank = _number(query, "rank", None)
        offset = _number(query, "offset", 0)
        rotation = _number(query, "rotation", 0)
    except ValueError as exc:
        return _error(400, str(exc))
    if rotation > _MAX_ROTATIONS:
        return _error(400, f"rotation: at most {_MAX_ROTATIONS}, got {rotation}")
    name = f"rank-{rank}.log" + (f".{rotation}" if rotation else "")
    try:
        fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return _error(404, f"no log of rank {rank} on this host ({root / name})")
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return _error(409, f"{root / name} is a symbolic link: not served")
        return _error(409, f"cannot read {root / name}: {exc.strerror}")
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(min(offset, size))
        data = f.read(MAX_CHUNK) if offset < size else b""
    return (
        200,
        {
            "rank": rank,
            "rotation": rotation,
            "offset": min(offset, size),
            "size": size,
            "rotations": _rotations(root, rank),
            "data": base64.b64encode(data).decode("ascii"),
        },
    )


def _error(status: int, message: str) -> Answer:
    return status, {"error": message}


def _number(query: dict[str, list[str]], name: str, default: int | None) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise ValueError(f"{name}: required (a decimal number)")
        return default
    text = values[-1]
    if len(values) > 1 or not text.isdecimal() or not text.isascii() or len(text) > 15:
        raise ValueError(f"{name}: expected one decimal number, got {values!r}")
    value = int(text)
    if value >= _MAX_NUMBER:
        raise ValueError(f"{name}: {value} is too large")
    return value


def _rotations(root: Path, rank: int) -> int:
    """How many rotated files of ``rank`` there are: ``.1`` .. ``.K`` without a gap."""
    count = 0
    while count < _MAX_ROTATIONS and (root / f"rank-{rank}.log.{count + 1}").is_file():
        count += 1
    return count
