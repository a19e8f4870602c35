"""Every rank's shard of a step, for a restore that reshards (another mesh or world size).

A Checkpointer's save is per rank: rank R's shard holds R's local part of each DTensor.
A rank of a new layout needs the parts of the saved ranks that overlap its own. Those
shards are found, for each saved rank, in

1. this node's memory directory (the tier's ``rank-<R>-slot-<i>`` files of the node's
   ranks, and of a lost node's ranks once the agent pulled its replica back),
2. the peer replicas this node's agent holds beside it (``<memory dir>/../replicas/
   <node>/``, :mod:`trainguard.agent.replicas`: the shards of the node before it in the
   ring), so that a restart on fewer nodes reshards from RAM, then
3. the durable tier (every rank's files of a committed step).

Only checksummed shards are read (any reader other than the writer within its attempt
needs the checksum, :func:`~trainguard.checkpoint.shard.unchecked_refusal`); each is
verified against its meta, and read into private memory: the ranks of the new layout
start saving into their slots once every rank has restored, and the slots read here may
be theirs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.checkpoint.shard import FORMAT, ShardInvalid, verify
from trainguard.checkpoint.sharding import Source
from trainguard.checkpoint.state import Layout, Path

__all__ = ["Saved", "as_tensor", "gather", "node_steps", "shard_sources"]

log = logging.getLogger(__name__)

_META = re.compile(r"^rank-(\d+)-slot-(\d+)\.meta$")


@dataclass(frozen=True)
class Saved:
    """One saved rank's verified shard of a step."""

    rank: int
    tier: str  # "memory" (this node's RAM: its tier or a peer's replica) or "durable"
    layout: Layout
    buffer: torch.Tensor


def _listing(directory: str) -> list[str]:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return sorted(os.listdir(directory))
    return []


def _metas(directory: str, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """(data path, meta) of every checksummed shard of ``job_id`` in a memory directory,
    then in the peer replicas held beside it."""
    replicas = os.path.join(os.path.dirname(directory.rstrip("/")), "replicas")
    paths = [os.path.join(directory, name) for name in _listing(directory)]
    for node in _listing(replicas):
        held = os.path.join(replicas, node)
        paths += [os.path.join(held, name) for name in _listing(held)]
    found = []
    for path in paths:
        if not _META.match(os.path.basename(path)):
            continue
        try:
            with open(path, "rb") as file:
                meta = json.loads(file.read())
        except (OSError, ValueError):
            continue  # being rewritten, or torn: not offered
        if (
            isinstance(meta, dict)
            and meta.get("format") == FORMAT
            and meta.get("job_id") == job_id
            and meta.get("checksum")
            and all(type(meta.get(k)) is int for k in ("rank", "step", "world_size"))
        ):
            found.append((path.removesuffix(".meta") + ".data", meta))
    return found


def node_steps(directory: str, job_id: str, world_size: int) -> set[int]:
    """Steps saved with another world size whose every rank's checksummed shard is in
    this node's memory directory (a restart with fewer or more ranks on this node)."""
    ranks: dict[tuple[int, int], set[int]] = {}
    for _, meta in _metas(directory, job_id):
        if meta["world_size"] != world_size:
            ranks.setdefault((meta["step"], meta["world_size"]), set()).add(meta["rank"])
    return {step for (step, world), held in ranks.items() if held == set(range(world))}


def _from_memory(
    directory: str, job_id: str, step: int, world: int | None
) -> tuple[int, dict[int, tuple[str, dict[str, Any]]]]:
    """The saved world size of ``step`` (0 if not found here) and rank -> its file here."""
    held: dict[int, tuple[str, dict[str, Any]]] = {}
    for data_path, meta in _metas(directory, job_id):
        if meta["step"] == step and (world is None or meta["world_size"] == world):
            world = meta["world_size"]
            held.setdefault(meta["rank"], (data_path, meta))
    return world or 0, held


def gather(
    step: int,
    *,
    directory: str,
    job_id: str,
    durable: Callable[[int, int], tuple[bytes, dict[str, Any]]] | None,
    world_size: int | None = None,
) -> list[Saved]:
    """Every saved rank's verified shard of ``step``, from memory, else ``durable``
    (``read_shard(step, rank)``); :class:`ShardInvalid` naming the first one missing."""
    world, held = _from_memory(directory, job_id, step, world_size)
    if not world and durable is not None:
        try:
            _, meta = durable(step, 0)
            world = int(meta.get("world_size", 0))
        except Exception as exc:  # unreadable: this rank reports the step unavailable
            raise ShardInvalid(f"step {step}: rank 0's durable shard: {exc}") from exc
    if world < 1:
        raise ShardInvalid(f"step {step}: no shard of it here or in the durable tier")
    saved = []
    for rank in range(world):
        check = functools.partial(verify, job_id=job_id, world_size=world, rank=rank, step=step)
        if rank in held:
            data_path, meta = held[rank]
            try:
                with open(data_path, "rb") as file:
                    data = file.read(int(meta["nbytes"]))
                layout = check(data, meta)
                saved.append(Saved(rank, "memory", layout, as_tensor(data)))
                continue
            except (OSError, ValueError, ShardInvalid) as exc:
                log.warning("memory tier: %s unusable for step %d: %s", data_path, step, exc)
        if durable is None:
            raise ShardInvalid(f"step {step}: rank {rank}'s shard is not on this node")
        try:
            data, meta = durable(step, rank)
        except Exception as exc:
            raise ShardInvalid(f"step {step}: rank {rank}'s shard: {exc}") from exc
        layout = check(data, meta)
        saved.append(Saved(rank, "durable", layout, as_tensor(data)))
    return saved


def shard_sources(saved: list[Saved]) -> dict[Path, list[Source]]:
    """Key path -> every saved rank's DTensor entry of it, with that rank's buffer."""
    sources: dict[Path, list[Source]] = {}
    for shard in saved:
        for entry in shard.layout.entries:
            if entry.sharding is not None:
                sources.setdefault(entry.path, []).append((entry, shard.buffer))
    return sources


def as_tensor(data: bytes) -> torch.Tensor:
    """Read-only bytes as a flat uint8 tensor, without a copy (only ever read from)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)
