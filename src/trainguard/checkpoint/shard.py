"""One rank's shard of a checkpoint: the data bytes and a JSON meta that describes them.

Meta (the same on every tier)::

    {"format": 1, "job_id": str, "step": int, "rank": int, "world_size": int,
     "nbytes": int, "tensors": [TensorEntry.to_json(), ...], "plain": <state tree>,
     "checksum": "xxh3_128:<32 hex>" | null, "created_at": <unix seconds>}

``checksum`` is null only in a memory-tier *copy-complete* meta (see
``trainguard.checkpoint.memory``); durable shards always carry it.
"""

from __future__ import annotations

import time
from typing import Any

from trainguard.checkpoint.files import CHECKSUM_ALGORITHM, checksum
from trainguard.checkpoint.state import Layout, TensorEntry

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT",
    "ShardInvalid",
    "checksum",
    "layout_of",
    "make_meta",
    "verify",
]

FORMAT = 1


class ShardInvalid(Exception):
    """A shard that must not be loaded: corrupt, incomplete, foreign or malformed."""


def make_meta(
    layout: Layout, *, job_id: str, step: int, rank: int, world_size: int, digest: str | None
) -> dict[str, Any]:
    """The meta of a shard laid out by ``layout`` (``digest`` None: not yet checksummed)."""
    return {
        "format": FORMAT,
        "job_id": job_id,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "nbytes": layout.nbytes,
        "tensors": [entry.to_json() for entry in layout.entries],
        "plain": layout.tree,
        "checksum": digest,
        "created_at": time.time(),
    }


def layout_of(meta: dict[str, Any]) -> Layout:
    """The layout a meta describes; :class:`ShardInvalid` if it is malformed."""
    try:
        entries = [TensorEntry.from_json(item) for item in meta["tensors"]]
        nbytes = int(meta["nbytes"])
        tree = meta["plain"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardInvalid(f"malformed meta: {exc!r}") from exc
    for entry in entries:
        if entry.offset < 0 or entry.nbytes < 0 or entry.offset + entry.nbytes > nbytes:
            raise ShardInvalid(f"malformed meta: tensor {entry.path} lies outside the data")
    return Layout(entries, nbytes, tree)


def check_identity(
    meta: dict[str, Any], *, job_id: str, world_size: int, step: int | None, rank: int
) -> None:
    """Raise :class:`ShardInvalid` unless ``meta`` belongs to this job, rank (and step)."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ShardInvalid(f"unknown format {found!r} (expected {FORMAT})")
    if meta.get("job_id") != job_id:
        raise ShardInvalid(f"belongs to job {meta.get('job_id')!r}, not {job_id!r}")
    if meta.get("world_size") != world_size:
        raise ShardInvalid(f"written with world size {meta.get('world_size')}, not {world_size}")
    if meta.get("rank") != rank:
        raise ShardInvalid(f"written by rank {meta.get('rank')}, not {rank}")
    if step is not None and meta.get("step") != step:
        raise ShardInvalid(f"holds step {meta.get('step')}, not {step}")
    if not isinstance(meta.get("step"), int):
        raise ShardInvalid(f"malformed step {meta.get('step')!r}")


def verify(
    data: memoryview | bytes,
    meta: dict[str, Any],
    *,
    job_id: str,
    world_size: int,
    rank: int,
    step: int | None = None,
    require_checksum: bool = True,
) -> Layout:
    """Check a shard before it is loaded; returns its layout or raises :class:`ShardInvalid`.

    Checks the format, job id, world size, rank, step, the data size and the checksum
    (a meta without a checksum passes only with ``require_checksum=False``).
    """
    check_identity(meta, job_id=job_id, world_size=world_size, step=step, rank=rank)
    layout = layout_of(meta)
    if len(data) < layout.nbytes:
        raise ShardInvalid(f"data has {len(data)} bytes, meta says {layout.nbytes}")
    expected = meta.get("checksum")
    if expected is None:
        if require_checksum:
            raise ShardInvalid("no checksum")
        return layout
    if not isinstance(expected, str) or not expected.startswith(f"{CHECKSUM_ALGORITHM}:"):
        raise ShardInvalid(f"unsupported checksum {expected!r}")
    actual = checksum(memoryview(data)[: layout.nbytes])
    if actual != expected:
        raise ShardInvalid(f"checksum mismatch: data {actual}, meta {expected}")
    return layout
