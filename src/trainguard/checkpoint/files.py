"""Checkpoint file helpers that need no torch: shard checksums and the memory tier's hold.

The node agent persists and replicates memory-tier shards without importing torch; it
uses these, and the training side (:mod:`~trainguard.checkpoint.shard`,
:mod:`~trainguard.checkpoint.memory`) re-exports them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable

import xxhash

from trainguard.checkpoint.tier_dir import open_private

__all__ = ["CHECKSUM_ALGORITHM", "HOLD_FILE", "checksum", "hold_from", "write_hold"]

CHECKSUM_ALGORITHM = "xxh3_128"
HOLD_FILE = "hold.json"


CHECKSUM_CHUNK = 16 * 1024 * 1024
"""With a ``pause``, :func:`checksum` hashes this many bytes between two calls of it."""


def checksum(data: memoryview | bytes, pause: Callable[[], None] | None = None) -> str:
    """``xxh3_128:<hex>`` of ``data`` (xxhash releases the GIL while hashing).

    ``pause`` is called before each :data:`CHECKSUM_CHUNK` bytes (it may block: the
    background checksum waits there while a save copies, so they do not share the memory
    bandwidth); the digest is the same as in one call.
    """
    if pause is None or len(data) <= CHECKSUM_CHUNK:
        return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128(data).hexdigest()}"
    view = memoryview(data).cast("B")
    hasher = xxhash.xxh3_128()
    for start in range(0, len(view), CHECKSUM_CHUNK):
        pause()
        hasher.update(view[start : start + CHECKSUM_CHUNK])
    return f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}"


def hold_from(directory: str) -> int | None:
    """The step the node agent asks to hold (``hold.json``); None when there is none."""
    try:
        with open(os.path.join(directory, HOLD_FILE), "rb") as file:
            value = json.loads(file.read()).get("from_step")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_hold(directory: str, from_step: int | None) -> None:
    """Ask the ranks of this node to hold their first snapshot at or after ``from_step``
    (None: release it). Atomic: tmp file + rename."""
    path = os.path.join(directory, HOLD_FILE)
    if from_step is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    tmp = f"{path}.tmp"
    with open_private(tmp) as file:
        file.write(json.dumps({"from_step": from_step}).encode())
    os.replace(tmp, path)
