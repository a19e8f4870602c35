"""One rank's shard of a checkpoint: the data bytes and a JSON meta that describes them.

Meta (the same on every tier)::

    {"format": 1, "job_id": str, "step": int, "rank": int, "world_size": int,
     "nbytes": int, "tensors": [TensorEntry.to_json(), ...], "plain": <state tree>,
     "checksum": "xxh3_128:<32 hex>" | null, "created_at": <unix seconds>,
     "writer": {"rank": int, "attempt": int | null}}

``checksum`` is null only in a memory-tier *copy-complete* meta (see
``trainguard.checkpoint.memory``); durable shards always carry it. Such a shard cannot be
verified, so it is loaded only by its ``writer``: the same rank, within the same attempt
(:func:`unchecked_refusal`). ``writer.attempt`` is null where the writer's attempt is
unknown; its shards then need their checksum everywhere.
"""

from __future__ import annotations

import json
import time
from typing import Any

from trainguard.checkpoint.files import CHECKSUM_ALGORITHM, checksum
from trainguard.checkpoint.state import Layout, TensorEntry

__all__ = [
    "CHECKSUM_ALGORITHM",
    "FORMAT",
    "EncodedEntries",
    "ShardInvalid",
    "checksum",
    "encode_meta",
    "layout_of",
    "make_meta",
    "unchecked_refusal",
    "verify",
    "verify_data",
]

FORMAT = 1


class ShardInvalid(Exception):
    """A shard that must not be loaded: corrupt, incomplete, foreign or malformed."""


def make_meta(
    layout: Layout,
    *,
    job_id: str,
    step: int,
    rank: int,
    world_size: int,
    digest: str | None,
    attempt: int | None = None,
    entries: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The meta of a shard laid out by ``layout`` (``digest`` None: not yet checksummed),
    written by ``rank`` in ``attempt`` (None: unknown); ``entries``: the JSON of
    ``layout.entries`` when the caller has it already (save()'s copy plan)."""
    return {
        "format": FORMAT,
        "job_id": job_id,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "nbytes": layout.nbytes,
        "tensors": [e.to_json() for e in layout.entries] if entries is None else entries,
        "plain": layout.tree,
        "checksum": digest,
        "created_at": time.time(),
        "writer": {"rank": rank, "attempt": attempt},
    }


class EncodedEntries(list[dict[str, Any]]):
    """A meta's ``"tensors"`` list together with its JSON, encoded once (save()'s copy
    plan keeps one while the state's structure holds; never changed after that)."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        super().__init__(entries)
        self.json = json.dumps(entries, separators=(",", ":"))


def encode_meta(meta: dict[str, Any]) -> bytes:
    """``meta`` as compact JSON; its ``"tensors"`` from their cached JSON when they are
    :class:`EncodedEntries` (then last: JSON objects are unordered)."""
    tensors = meta.get("tensors")
    if not isinstance(tensors, EncodedEntries):
        return json.dumps(meta, separators=(",", ":")).encode()
    rest = json.dumps({k: v for k, v in meta.items() if k != "tensors"}, separators=(",", ":"))
    return f'{rest[:-1]}{"," if len(rest) > 2 else ""}"tensors":{tensors.json}}}'.encode()


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
    attempt: int | None = None,
    data_too: bool = True,
) -> Layout:
    """Check a shard before it is loaded; returns its layout or raises :class:`ShardInvalid`.

    Checks the format, job id, world size, rank, step, the data size and the checksum
    whenever the meta has one. A meta without a checksum passes only when ``rank``
    wrote it within ``attempt`` (the loader's attempt; None: never), see
    :func:`unchecked_refusal`. ``data_too=False`` leaves the checksum to a later
    :func:`verify_data` (the caller then loads nothing before that has passed).
    """
    check_identity(meta, job_id=job_id, world_size=world_size, step=step, rank=rank)
    layout = layout_of(meta)
    if len(data) < layout.nbytes:
        raise ShardInvalid(f"data has {len(data)} bytes, meta says {layout.nbytes}")
    expected = meta.get("checksum")
    if expected is None:
        refusal = unchecked_refusal(meta, rank=rank, attempt=attempt)
        if refusal is not None:
            raise ShardInvalid(refusal)
        return layout
    if not isinstance(expected, str) or not expected.startswith(f"{CHECKSUM_ALGORITHM}:"):
        raise ShardInvalid(f"unsupported checksum {expected!r}")
    if data_too:
        verify_data(data, meta, layout)
    return layout


def verify_data(data: memoryview | bytes, meta: dict[str, Any], layout: Layout) -> None:
    """:class:`ShardInvalid` unless ``data`` matches the meta's checksum (if it has one);
    the rest of the meta checked by :func:`verify` first."""
    expected = meta.get("checksum")
    if expected is None:
        return
    actual = checksum(memoryview(data)[: layout.nbytes])
    if actual != expected:
        raise ShardInvalid(f"checksum mismatch: data {actual}, meta {expected}")


def unchecked_refusal(meta: dict[str, Any], *, rank: int, attempt: int | None) -> str | None:
    """Why ``rank`` in ``attempt`` may not load this shard without a checksum; None if it may.

    Nothing can show that such a shard's data is still what was copied, so only its own
    writer trusts it: the same rank, within the same (known) attempt, on the node whose
    memory holds it. Any other reader, a later attempt of the same rank included, needs
    the checksum.
    """
    writer = meta.get("writer")
    if attempt is None:
        return "no checksum, and the attempt loading it is unknown"
    if not isinstance(writer, dict):
        return "no checksum, and no writer recorded"
    by = (writer.get("rank"), writer.get("attempt"))
    if not all(type(x) is int for x in by) or by != (rank, attempt):
        return (
            f"no checksum, and written by rank {by[0]} in attempt {by[1]}, "
            f"not by rank {rank} in attempt {attempt}"
        )
    return None
