"""The node's batch cache: fixed-size slots in one memory-mapped file, shared by the
node's processes, each slot one batch slice with a checksummed header.

A slot holds rows ``[lo, hi)`` of global batch ``step`` (the key: the sequence position,
so any rank, renumbered or replaced, finds the rows its slice needs). Layout of a slot::

    [0, 64)        fixed header: magic, seq, step, lo, hi, meta_len, payload_len, crc
    [64, 4096)     meta: JSON, the batch's structure and each tensor's dtype, shape, offset
    [4096, size)   payload: the tensors' raw bytes

Nothing is pickled: a batch is a tree of dicts, tuples and lists whose leaves are tensors
(or JSON scalars), as ``default_collate`` makes. ``crc`` is zlib's CRC-32 of the key,
meta and payload.

Publication is a sequence lock: the one writer of a node (the reader holding the node's
lock, see `reader`) makes ``seq`` odd, writes the meta, payload and fields, then makes
``seq`` even again. A consumer copies the slot and keeps the copy only when ``seq`` was
even and unchanged across the copy and the checksum matches; anything else (a write in
progress, a writer SIGKILLed halfway, a flipped bit) is a miss, never used. The ordering
relies on the stores to a shared mapping becoming visible in program order, which x86's
memory model gives (on weaker models the checksum still rejects a torn slot).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["Key", "SlotFile", "decode", "encode_meta", "tensors_of"]

MAGIC = 0x54474443  # "TGDC"
FIXED = struct.Struct("<IIqqqqIQI")  # magic, pad, seq, step, lo, hi, meta_len, payload_len, crc
KEY = struct.Struct("<qqq")
HEADER_BYTES = 4096
META_BYTES = HEADER_BYTES - 64
EMPTY_STEP = -1


@dataclass(frozen=True, order=True)
class Key:
    """Rows ``[lo, hi)`` of global batch ``step``."""

    step: int
    lo: int
    hi: int


def tensors_of(batch: Any, out: list[torch.Tensor]) -> Any:
    """The JSON tree of ``batch`` (leaves: ``{"t": index}`` into ``out``, where its tensors
    are appended, or ``{"v": scalar}``). Raises TypeError naming anything else."""
    if isinstance(batch, torch.Tensor):
        out.append(batch)
        return {"t": len(out) - 1}
    if isinstance(batch, dict):
        if not all(isinstance(k, str) for k in batch):
            raise TypeError("a batch dict's keys must be strings")
        return {"dict": {k: tensors_of(v, out) for k, v in batch.items()}}
    if isinstance(batch, tuple | list):
        kind = "list" if isinstance(batch, list) else "tuple"
        return {kind: [tensors_of(v, out) for v in batch]}
    if batch is None or isinstance(batch, bool | int | float | str):
        return {"v": batch}
    raise TypeError(
        f"a batch may hold tensors, dicts, tuples, lists and scalars, not {type(batch).__name__}"
    )


def encode_meta(tree: Any, tensors: list[torch.Tensor]) -> tuple[bytes, list[torch.Tensor]]:
    """The meta JSON of a batch and its tensors as flat bytes (uint8), in payload order."""
    specs, parts, offset = [], [], 0
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        dtype = str(tensor.dtype).removeprefix("torch.")
        specs.append({"dtype": dtype, "shape": list(tensor.shape), "offset": offset})
        parts.append(flat)
        offset += flat.numel()
    meta = json.dumps({"tree": tree, "tensors": specs}, separators=(",", ":")).encode()
    return meta, parts


def decode(meta: bytes, payload: bytearray) -> Any:
    """The batch a slot's meta and (copied) payload describe; raises ValueError if bad."""
    try:
        description = json.loads(meta)
        specs = description["tensors"]
        raw = (
            torch.frombuffer(payload, dtype=torch.uint8)
            if payload
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors = []
        for spec in specs:
            dtype = getattr(torch, spec["dtype"])
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"not a dtype: {spec['dtype']}")
            shape = [int(n) for n in spec["shape"]]
            size = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            start = int(spec["offset"])
            tensors.append(raw[start : start + size].view(dtype).reshape(shape))
        return _build(description["tree"], tensors)
    except (KeyError, TypeError, AttributeError, RuntimeError, json.JSONDecodeError) as exc:
        raise ValueError(f"bad slot meta: {exc}") from exc


def _build(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if "t" in tree:
        return tensors[tree["t"]]
    if "dict" in tree:
        return {k: _build(v, tensors) for k, v in tree["dict"].items()}
    if "tuple" in tree:
        return tuple(_build(v, tensors) for v in tree["tuple"])
    if "list" in tree:
        return [_build(v, tensors) for v in tree["list"]]
    return tree["v"]


@dataclass(frozen=True)
class Header:
    seq: int
    key: Key
    meta_len: int
    payload_len: int
    crc: int


class SlotFile:
    """``count`` slots of ``slot_bytes`` in the file ``path`` (created at that size when
    ``create``; an existing file of another size is an error naming it)."""

    def __init__(self, path: Path, slot_bytes: int, count: int, *, create: bool = False) -> None:
        if slot_bytes <= HEADER_BYTES or slot_bytes % 4096 or count < 1:
            raise ValueError(f"slot_bytes {slot_bytes}/count {count}: slots must be pages, > 1")
        self.path, self.slot_bytes, self.count = path, slot_bytes, count
        self._map = _mapped(path, slot_bytes * count, create)
        # A hint beside it: each slot's step (the headers stay the authority), so that a
        # consumer finds a step's slots in a few pages rather than touching every slot's.
        self._hint_map = _mapped(path.with_name(path.name + ".steps"), 8 * count, create)
        # Views of the mappings (released in close): the slots' bytes, the hint.
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._hint = torch.frombuffer(self._hint_map, dtype=torch.int64)
        if create:
            self._hint.fill_(EMPTY_STEP)

    def close(self) -> None:
        del self._bytes, self._hint
        self._map.close()
        self._hint_map.close()

    def header(self, slot: int) -> Header | None:
        """Slot ``slot``'s header, None when it is empty, being written or malformed."""
        base = slot * self.slot_bytes
        magic, _, seq, step, lo, hi, meta_len, payload_len, crc = FIXED.unpack_from(self._map, base)
        if magic != MAGIC or seq == 0 or seq % 2 or step == EMPTY_STEP:
            return None
        if meta_len > META_BYTES or payload_len > self.slot_bytes - HEADER_BYTES:
            return None
        return Header(seq, Key(step, lo, hi), meta_len, payload_len, crc)

    def headers(self) -> list[Header | None]:
        """Every slot's header; the hint made to agree with them (the writer, at its start)."""
        found = [self.header(slot) for slot in range(self.count)]
        for slot, head in enumerate(found):
            self._hint[slot] = EMPTY_STEP if head is None else head.key.step
        return found

    def holding(self, step: int) -> dict[Key, int]:
        """The slots that hold rows of ``step``, by key (one vectorised look at every slot's
        step field, then the headers of those only)."""
        found = {}
        for slot in torch.nonzero(self._hint == step).flatten().tolist():
            head = self.header(slot)
            if head is not None and head.key.step == step:
                found[head.key] = slot
        return found

    def read(self, slot: int, expect: Key) -> tuple[Any, str]:
        """A copy of the batch in ``slot`` if it still holds ``expect`` intact: (batch, "")
        or (None, why: "moved" for a slot rewritten meanwhile, "corrupt" for a checksum
        mismatch or bad meta)."""
        head = self.header(slot)
        if head is None or head.key != expect:
            return None, "moved"
        base = slot * self.slot_bytes
        meta = bytes(self._map[base + 64 : base + 64 + head.meta_len])
        start = base + HEADER_BYTES
        with memoryview(self._map) as view:
            payload = bytearray(view[start : start + head.payload_len])
        if FIXED.unpack_from(self._map, base)[2] != head.seq:
            return None, "moved"
        crc = zlib.crc32(payload, zlib.crc32(meta, zlib.crc32(KEY.pack(*_fields(expect)))))
        if crc != head.crc:
            return None, "corrupt"
        try:
            return decode(meta, payload), ""
        except ValueError:
            return None, "corrupt"

    def write(self, slot: int, key: Key, meta: bytes, parts: list[torch.Tensor]) -> None:
        """Publish ``key``'s batch in ``slot`` (the node's one writer only)."""
        payload_len = sum(part.numel() for part in parts)
        if len(meta) > META_BYTES or payload_len > self.slot_bytes - HEADER_BYTES:
            raise ValueError(
                f"a batch of {payload_len} bytes ({len(meta)} of meta) does not fit a slot of "
                f"{self.slot_bytes - HEADER_BYTES}: raise slot_bytes"
            )
        base = slot * self.slot_bytes
        seq = FIXED.unpack_from(self._map, base)[2]
        seq += 1 if seq % 2 == 0 else 0  # odd: being written (a dead writer left it odd)
        self._set_seq(base, seq)
        self._map[base + 64 : base + 64 + len(meta)] = meta
        crc = zlib.crc32(meta, zlib.crc32(KEY.pack(*_fields(key))))
        offset = base + HEADER_BYTES
        with memoryview(self._map) as view:
            for part in parts:
                self._bytes[offset : offset + part.numel()].copy_(part)
                crc = zlib.crc32(view[offset : offset + part.numel()], crc)
                offset += part.numel()
        FIXED.pack_into(
            self._map, base, MAGIC, 0, seq, key.step, key.lo, key.hi, len(meta), payload_len, crc
        )
        self._set_seq(base, seq + 1)
        self._hint[slot] = key.step

    def invalidate(self, slot: int) -> None:
        """Make ``slot`` empty (the writer: a corrupt slot is never read again)."""
        base = slot * self.slot_bytes
        seq = FIXED.unpack_from(self._map, base)[2]
        seq += 1 if seq % 2 == 0 else 0
        self._set_seq(base, seq)
        struct.pack_into("<q", self._map, base + 16, EMPTY_STEP)
        self._set_seq(base, seq + 1)
        self._hint[slot] = EMPTY_STEP

    def _set_seq(self, base: int, seq: int) -> None:
        struct.pack_into("<q", self._map, base + 8, seq)


def _mapped(path: Path, size: int, create: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    try:
        if create and os.fstat(fd).st_size == 0:
            os.ftruncate(fd, size)
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, expected {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _fields(key: Key) -> tuple[int, int, int]:
    return key.step, key.lo, key.hi
