"""``torch.distributed.checkpoint`` storage on trainguard's tiers (memory, then durable).

::

    from trainguard.checkpoint.dcp import TieredStorageReader, TieredStorageWriter
    dcp.save(sd, storage_writer=TieredStorageWriter(step=100))                    # memory
    dcp.async_save(sd, storage_writer=TieredStorageWriter(step=100, durable=True))
    dcp.load(sd, storage_reader=TieredStorageReader())          # newest step; or step=N

Settings come from the environment like the Checkpointer's (``TRAINGUARD_CHECKPOINT_*``,
``TRAINGUARD_JOB_ID``, see :mod:`trainguard.checkpoint.config`); keywords override.
``checkpoint_id`` (``dcp.save(..., checkpoint_id=...)``) may name the step: ``200``,
``"200"`` or ``"step-200"``.

Layout. Memory: ``<memory_dir>/dcp/step-<N>/rank-<R>.data`` (the rank's write items,
tensors as raw bytes, BytesIO items as their bytes), ``rank-<R>.json`` (its meta: job,
step, rank, world size, size, xxh3-128 checksum) and ``metadata.json`` (DCP's
``Metadata`` as JSON, written last by the coordinator: the step's commit). Durable:
a :class:`DurableTier` at ``<durable_url>/dcp/<job_id>/``: shard 0 holds the metadata
file, shard ``R + 1`` rank R's data and meta; the coordinator commits the step with
``world_size + 1`` shards once every rank has written. Every file is written under a
temporary name and renamed. Nothing is ever unpickled by this module; DCP's own
``DefaultLoadPlanner.load_bytes`` does ``torch.load(value, weights_only=False)`` on
BytesIO items (non-tensor values) in torch 2.13, as with any DCP storage.

Reading verifies each rank file's checksum and identity before use; a corrupt or
missing memory file falls back to the durable copy, else :class:`DcpCheckpointError`
names the step, rank and file. The memory tier is node-local: a load that needs another
node's rank file (or the coordinator's ``metadata.json``) reads it from the durable
tier. Memory keeps the newest ``memory_keep`` steps; durable keeps ``durable_keep``.
Only ``use_collectives=True`` (DCP's default) is supported.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import mmap
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.copying import PinnedStaging
from trainguard.checkpoint.dcp_metadata import Location, metadata_from_json, metadata_to_json
from trainguard.checkpoint.durable import DurableError, DurableTier
from trainguard.checkpoint.shard import FORMAT, ShardInvalid, check_identity, checksum

__all__ = ["DcpCheckpointError", "TieredStorageReader", "TieredStorageWriter"]

log = logging.getLogger(__name__)

DEFAULT_MEMORY_KEEP = 3
METADATA_FILE = "metadata.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def metadata_from_peers(step: int, mine: bytes | None) -> bytes | None:
    """``metadata.json`` of ``step``: this rank's, or else a rank's that has it.

    Only the coordinator's node writes it, so a node that lost its memory tier (and got
    its ranks' files back from a peer's replica) or any other node reads it over the
    process group (gloo, :func:`~trainguard.collectives.control_group`) from the lowest
    rank that has it. Every rank of the load calls this (DCP's ``read_metadata`` runs on
    each); without a process group, or when no rank of the same step has it, it is
    ``mine``.
    """
    import torch.distributed as dist

    from trainguard.collectives import control_group

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    group = control_group()
    offer = torch.tensor([step, len(mine) if mine is not None else -1], dtype=torch.int64)
    offers = [torch.empty_like(offer) for _ in range(dist.get_world_size())]
    dist.all_gather(offers, offer, group=group)
    if any(int(o[0]) != step for o in offers) or all(int(o[1]) >= 0 for o in offers):
        return mine  # every rank has it (or the ranks load different steps: not shared)
    holders = [rank for rank, o in enumerate(offers) if int(o[1]) >= 0]
    if not holders:
        return None
    source = holders[0]
    data = torch.empty(int(offers[source][1]), dtype=torch.uint8)
    if mine is not None and dist.get_rank() == source:
        data = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    dist.broadcast(data, src=source, group=group)
    return mine if mine is not None else data.numpy().tobytes()


class DcpCheckpointError(RuntimeError):
    """A DCP checkpoint that cannot be written or read; names the step, rank and file."""


@dataclass(frozen=True)
class _RankPlan:
    """What the coordinator tells each rank in ``SavePlan.storage_data``."""

    rank: int
    world_size: int


def _parse_step(value: Any) -> int:
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if isinstance(text, str):
        text = text.removeprefix("step-")
        if text.isdigit():
            return int(text)
    elif isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    raise ValueError(f"checkpoint_id/step must be a step number >= 0, got {value!r}")


class _Tiers:
    """The memory directory and the optional durable tier of one job's DCP checkpoints."""

    def __init__(self, overrides: dict[str, Any], durable: bool | None, memory_keep: int):
        self.config = CheckpointConfig.from_env(**overrides)
        self.root = os.path.join(self.config.memory_dir, "dcp")
        if memory_keep < 1:
            raise ValueError(f"memory_keep must be >= 1, got {memory_keep}")
        self.memory_keep = memory_keep
        if durable and not self.config.durable:
            raise ValueError("durable=True needs a durable_url (argument or job config)")
        use = self.config.durable if durable is None else durable
        self.durable: DurableTier | None = None
        if use and self.config.durable_url:
            url = self.config.durable_url.rstrip("/") + "/dcp"
            self.durable = DurableTier(url, self.config.job_id, self.config.storage_options)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"step-{step}")

    def memory_steps(self) -> list[int]:
        """Ascending steps whose memory directory holds a metadata file."""
        with contextlib.suppress(FileNotFoundError):
            return sorted(
                int(m[1])
                for name in os.listdir(self.root)
                if (m := _STEP_DIR.match(name))
                and os.path.exists(os.path.join(self.root, name, METADATA_FILE))
            )
        return []

    def rank_meta(
        self, step: int, rank: int, world_size: int, nbytes: int, digest: str
    ) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kind": "dcp-rank",
            "job_id": self.config.job_id,
            "step": step,
            "rank": rank,
            "world_size": world_size,
            "nbytes": nbytes,
            "checksum": digest,
        }


def _write_atomic(path: str, data: bytes | memoryview) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as file:
        file.write(data)
    os.replace(tmp, path)


def _map_file(path: str) -> mmap.mmap | bytearray:
    """The file's bytes, writable (copy-on-write) so tensors can view them without a copy."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return bytearray()
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)


class TieredStorageWriter(StorageWriter):  # type: ignore[misc]  # torch's is Any to mypy
    """Writes a DCP checkpoint of ``step`` to the memory tier (and durable with ``durable``).

    Keywords override the environment: ``memory_dir``, ``durable_url``,
    ``storage_options``, ``job_id``, ``durable_keep``; ``memory_keep`` steps stay in memory.
    """

    def __init__(
        self,
        step: int | None = None,
        *,
        durable: bool = False,
        memory_keep: int = DEFAULT_MEMORY_KEEP,
        **overrides: Any,
    ) -> None:
        super().__init__()
        self.step = None if step is None else _parse_step(step)
        self._tiers = _Tiers(overrides, durable, memory_keep)
        self._staging = PinnedStaging()
        self.rank = 0
        self.save_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _parse_step(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            _parse_step(checkpoint_id)
        except ValueError:
            return False
        return True

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"step-{self._step()}", save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise DcpCheckpointError("TieredStorageWriter needs use_collectives=True")
        self.rank = int(kwargs.get("rank") or 0)
        self._step()

    def _step(self) -> int:
        if self.step is None:
            raise DcpCheckpointError("TieredStorageWriter: no step (pass step= or checkpoint_id=)")
        return self.step

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        world = len(plans)
        return [
            SavePlan(p.items, _RankPlan(rank, world), p.planner_data, p.usable)
            for rank, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future: Future[list[WriteResult]] = Future()
        try:
            future.set_result(self._write_rank(plan, planner))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _write_rank(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        step, tiers = self._step(), self._tiers
        info = plan.storage_data
        if not isinstance(info, _RankPlan):
            raise DcpCheckpointError(f"step {step}: plan was not prepared by TieredStorageWriter")
        rank, world = info.rank, info.world_size
        step_dir = tiers.step_dir(step)
        os.makedirs(step_dir, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # a rewrite uncommits the step first
            os.unlink(os.path.join(step_dir, METADATA_FILE))
        data_path = os.path.join(step_dir, f"rank-{rank}.data")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(step_dir, f"rank-{rank}.json"))
        results: list[WriteResult] = []
        tmp = f"{data_path}.tmp-{os.getpid()}"
        resolved = [planner.resolve_data(item) for item in plan.items]
        staged = self._staging.stage([d for d in resolved if isinstance(d, torch.Tensor)])
        with open(tmp, "wb") as file:
            for item, data in zip(plan.items, resolved, strict=True):
                start = file.tell()
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    file.write(data.getbuffer())
                else:
                    assert isinstance(data, torch.Tensor)
                    host = staged.get(id(data))
                    flat = host if host is not None else data.detach().contiguous().reshape(-1)
                    if flat.numel():
                        file.write(memoryview(flat.view(torch.uint8).numpy()))
                location = Location(rank, start, file.tell() - start)
                results.append(WriteResult(item.index, location.length, location))
        os.replace(tmp, data_path)
        blob = _map_file(data_path)
        view = memoryview(blob)
        meta = tiers.rank_meta(step, rank, world, len(view), checksum(view))
        _write_atomic(os.path.join(step_dir, f"rank-{rank}.json"), json.dumps(meta).encode())
        if tiers.durable is not None:
            tiers.durable.write_shard(step, rank + 1, view, meta)
        del view
        self._prune_own(rank)
        return results

    def _prune_own(self, rank: int) -> None:
        """Remove this rank's files of memory steps beyond the newest ``memory_keep``."""
        steps = sorted(int(m[1]) for n in os.listdir(self._tiers.root) if (m := _STEP_DIR.match(n)))
        for old in steps[: -self._tiers.memory_keep]:
            for suffix in (".json", ".data"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self._tiers.step_dir(old), f"rank-{rank}{suffix}"))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        step, tiers = self._step(), self._tiers
        world = len(results)
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        metadata.storage_meta = self.storage_meta()
        body = metadata_to_json(metadata)
        blob = json.dumps(
            {
                "format": FORMAT,
                "kind": "dcp-metadata",
                "job_id": tiers.config.job_id,
                "step": step,
                "world_size": world,
                "checksum": checksum(json.dumps(body, sort_keys=True).encode()),
                "metadata": body,
            },
            sort_keys=True,
        ).encode()
        _write_atomic(os.path.join(tiers.step_dir(step), METADATA_FILE), blob)
        if tiers.durable is not None:
            meta = {"format": FORMAT, "kind": "dcp-metadata", "job_id": tiers.config.job_id,
                    "step": step, "world_size": world, "checksum": checksum(blob)}  # fmt: skip
            tiers.durable.write_shard(step, 0, blob, meta)
            if not tiers.durable.commit(step, world + 1):
                raise DcpCheckpointError(f"step {step}: durable shards missing, not committed")
            tiers.durable.prune(tiers.config.durable_keep)
        for old in tiers.memory_steps()[: -tiers.memory_keep]:
            shutil.rmtree(tiers.step_dir(old), ignore_errors=True)


class TieredStorageReader(StorageReader):  # type: ignore[misc]
    """Reads a DCP checkpoint: ``step`` (default: the newest), memory first, then durable.

    After a load, ``sources`` maps each rank file read to the tier it came from.
    """

    def __init__(self, step: int | None = None, **overrides: Any) -> None:
        super().__init__()
        self.step = None if step is None else _parse_step(step)
        self._tiers = _Tiers(overrides, None, DEFAULT_MEMORY_KEEP)
        self._storage: dict[MetadataIndex, Location] = {}
        self._world_size = 0
        self._metadata: Metadata | None = None
        self.loaded_step: int | None = None
        self.sources: dict[str, str] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _parse_step(checkpoint_id)
        self._storage = {}
        self.sources = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return TieredStorageWriter.validate_checkpoint_id(checkpoint_id)

    def _resolve_step(self) -> int:
        if self.step is not None:
            return self.step
        durable = self._tiers.durable.committed_steps() if self._tiers.durable else []
        steps = set(self._tiers.memory_steps()) | set(durable)
        if not steps:
            url = self._tiers.durable.url if self._tiers.durable else None
            where = self._tiers.root + (f" or {url}" if url else "")
            raise DcpCheckpointError(f"no DCP checkpoint in {where}")
        return max(steps)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        step = self._resolve_step()
        path = os.path.join(self._tiers.step_dir(step), METADATA_FILE)
        problems: list[str] = []
        mine: bytes | None = None
        try:
            with open(path, "rb") as file:
                mine = file.read()
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
        blob = metadata_from_peers(step, mine)
        if blob is not None:
            self.sources["metadata"] = "memory" if mine is not None else "peer"
        else:
            blob = self._durable_blob(step, 0, problems)
            self.sources["metadata"] = "durable"
        try:
            metadata, world = self._parse_metadata(blob, step)
        except (ShardInvalid, ValueError, KeyError, TypeError) as exc:
            if self.sources["metadata"] == "durable":
                raise DcpCheckpointError(f"step {step}: metadata invalid: {exc}") from None
            problems.append(f"{path}: {exc}")
            metadata, world = self._parse_metadata(self._durable_blob(step, 0, problems), step)
            self.sources["metadata"] = "durable"
        self.loaded_step, self._world_size = step, world
        return metadata

    def _parse_metadata(self, blob: bytes | bytearray, step: int) -> tuple[Metadata, int]:
        # Parsed as JSON and verified (identity, checksum): a peer's copy is no more trusted.
        doc = json.loads(blob)
        if not isinstance(doc, dict) or doc.get("kind") != "dcp-metadata":
            raise ShardInvalid("not a trainguard DCP metadata file")
        world = doc.get("world_size")
        if not isinstance(world, int):
            raise ShardInvalid(f"malformed world_size {world!r}")
        check_identity(doc | {"rank": 0}, job_id=self._tiers.config.job_id,
                       world_size=world, step=step, rank=0)  # fmt: skip
        if checksum(json.dumps(doc["metadata"], sort_keys=True).encode()) != doc["checksum"]:
            raise ShardInvalid("checksum mismatch")
        return metadata_from_json(doc["metadata"]), int(world)

    def _durable_blob(self, step: int, shard: int, problems: list[str]) -> bytes:
        """Durable shard ``shard`` of ``step`` with its checksum verified, else an error."""
        what = "metadata" if shard == 0 else f"rank {shard - 1}"
        if self._tiers.durable is None:
            raise DcpCheckpointError(f"step {step} {what}: {'; '.join(problems)} (no durable tier)")
        try:
            data, meta = self._tiers.durable.read_shard(step, shard)
            if checksum(data) != meta.get("checksum"):
                raise ShardInvalid(f"checksum mismatch in durable shard {shard}")
        except (DurableError, ShardInvalid) as exc:
            problems.append(str(exc))
            raise DcpCheckpointError(f"step {step} {what}: {'; '.join(problems)}") from None
        return data

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise DcpCheckpointError("metadata has no storage_data")
        self._storage = metadata.storage_data
        self._metadata = metadata

    def _chunk(self, index: MetadataIndex) -> tuple[torch.dtype, torch.Size]:
        """The dtype and shape of the stored chunk ``index`` names."""
        entry = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata else None
        if isinstance(entry, TensorStorageMetadata):
            for chunk in entry.chunks:
                if index.offset is None or chunk.offsets == index.offset:
                    return entry.properties.dtype, chunk.sizes
        raise DcpCheckpointError(f"step {self.loaded_step}: no tensor chunk {index} in metadata")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _rank_blob(self, step: int, rank: int) -> mmap.mmap | bytearray:
        """Rank's data file, verified; from memory, else from the durable tier."""
        step_dir = self._tiers.step_dir(step)
        data_path = os.path.join(step_dir, f"rank-{rank}.data")
        try:
            with open(os.path.join(step_dir, f"rank-{rank}.json"), "rb") as file:
                meta = json.loads(file.read())
            check_identity(meta, job_id=self._tiers.config.job_id,
                           world_size=self._world_size, step=step, rank=rank)  # fmt: skip
            blob = _map_file(data_path)
            if len(blob) != meta.get("nbytes"):
                raise ShardInvalid(f"has {len(blob)} bytes, meta says {meta.get('nbytes')}")
            if checksum(memoryview(blob)) != meta.get("checksum"):
                raise ShardInvalid("checksum mismatch")
            self.sources[f"rank-{rank}"] = "memory"
            return blob
        except (OSError, ValueError, ShardInvalid) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            problem = f"{data_path}: {reason}"
            log.warning("DCP step %d rank %d: %s; trying the durable tier", step, rank, problem)
        data = bytearray(self._durable_blob(step, rank + 1, [problem]))
        self.sources[f"rank-{rank}"] = "durable"
        return data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        future: Future[None] = Future()
        try:
            self._read(plan, planner)
            future.set_result(None)
        except Exception as exc:
            future.set_exception(exc)
        return future

    def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        assert self.loaded_step is not None
        blobs: dict[int, mmap.mmap | bytearray] = {}
        for item in plan.items:
            where = self._storage[item.storage_index]
            if where.rank not in blobs:
                blobs[where.rank] = self._rank_blob(self.loaded_step, where.rank)
            blob = blobs[where.rank]
            if where.start + where.length > len(blob):
                raise DcpCheckpointError(
                    f"step {self.loaded_step} rank {where.rank}: item {item.storage_index.fqn} "
                    "lies outside the data file"
                )
            raw = memoryview(blob)[where.start : where.start + where.length]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(raw)))
                continue
            target = planner.resolve_tensor(item).detach()
            chunk = self._chunk(item.storage_index)
            dtype = chunk[0]
            if where.length:
                stored = torch.frombuffer(raw, dtype=dtype).reshape(chunk[1])
            else:
                stored = torch.empty(chunk[1], dtype=dtype)
            source = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
            if target.size() != source.size():
                raise DcpCheckpointError(
                    f"{item.storage_index.fqn}: stored {tuple(source.size())}, "
                    f"target {tuple(target.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)


# ---- Metadata <-> JSON (never pickle) ---------------------------------------------------
