"""Checkpoint file helpers that need no torch: shard checksums and the memory tier's hold.

The node agent persists and replicates memory-tier shards without importing torch; it
uses these, and the training side (:mod:`~trainguard.checkpoint.shard`,
:mod:`~trainguard.checkpoint.memory`) re-exports them.
"""

from __future__ import annotations

import contextlib
import json
import os

import xxhash

__all__ = ["CHECKSUM_ALGORITHM", "HOLD_FILE", "checksum", "hold_from", "write_hold"]

CHECKSUM_ALGORITHM = "xxh3_128"
HOLD_FILE = "hold.json"


def checksum(data: memoryview | bytes) -> str:
    """``xxh3_128:<hex>`` of ``data`` (xxhash releases the GIL while hashing)."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128(data).hexdigest()}"


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
    with open(tmp, "wb") as file:
        file.write(json.dumps({"from_step": from_step}).encode())
    os.replace(tmp, path)
