"""The agent's durable writer: persists the node's memory-tier shards of a step, on request.

The controller sees every node's memory tier (``checkpoint.memory_steps`` in the agent
status) and picks the step to persist, so every node persists the *same* step; it sends
``POST /persist {"step", "world_size", "commit"}`` to every node of the attempt, where
``step`` means "the first step at or after this one that the ranks save" (a step already
in memory, or one a few steps ahead). Each agent then, in its own background thread
(training never waits for it):

1. asks its ranks to hold that snapshot (``hold.json`` in the memory tier, see
   :mod:`trainguard.checkpoint.memory`), so the training loop does not overwrite it, and
   waits until every local rank has it;
2. waits until each shard's meta carries its checksum (a worker's ``save()`` commits a
   *copy-complete* meta without one and adds it moments later, in the background), then
   copies each local rank's shard out of its memory slot into private memory, and checks
   the copy: the slot's meta must be unchanged after the copy (the worker unlinks a
   slot's meta before it reuses the slot) and the data must match the meta's checksum.
   A step that is gone from memory, torn or corrupt, or whose checksum never came (its
   worker died first, or it was not added in ``commit_timeout``), is reported as failed,
   naming the file, and never written: nothing here can tell such data from a corrupt
   copy, and a durable shard is trusted by every rank of every later attempt;
3. writes each shard to the durable tier (data, then meta; both atomic), and releases
   the hold;
4. on the node told to ``commit``: waits until every rank's shard of the step is
   present in the durable tier, writes the step's COMMITTED marker and prunes old steps.

The agent reports what it wrote, committed and failed in its status; the controller
turns that into events and picks the next step. The controller has one request in flight
at a time, so a request that comes while another still waits (for its ranks' step, a
checksum, or the other nodes' shards) means the controller gave the waiting one up, after
a fault: it stops there, without a failure of its own, and the new one runs.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.agent.meta_cache import MetaCache
from trainguard.checkpoint.files import checksum, hold_from, write_hold
from trainguard.wire.status import CheckpointStatus, MemoryStep

if TYPE_CHECKING:
    from trainguard.checkpoint.durable import DurableTier

logger = logging.getLogger(__name__)

MEMORY_DIR_ENV = "TRAINGUARD_CHECKPOINT_MEMORY_DIR"
CONFIG_ENV = "TRAINGUARD_CHECKPOINT_CONFIG"

COMMIT_TIMEOUT_SECONDS = 120.0
"""How long the committing node waits for every rank's shard of a step; also how long a
node waits for its ranks to save the requested step."""
COMMIT_POLL_SECONDS = 0.5
HOLD_POLL_SECONDS = 0.05
HISTORY = 16
"""Steps remembered per list (written, committed, failed) in the status."""

_META = re.compile(r"^rank-(\d+)-slot-(\d+)\.meta$")


class PersistFailed(Exception):
    """A step could not be persisted from this node (the message says why)."""


class Superseded(Exception):
    """A newer request came while this one waited: the controller sends one at a time,
    so it has given this one up (failed it, after a fault): not reported as failed."""


@dataclass(frozen=True)
class DurableSettings:
    """Where and how this node persists: from the job's checkpoint config."""

    url: str
    job_id: str
    keep: int = 3
    storage_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config_json(cls, raw: str | None, job_id: str) -> DurableSettings | None:
        """Settings from ``TRAINGUARD_CHECKPOINT_CONFIG``; None when there is no durable tier."""
        try:
            config = json.loads(raw or "{}")
        except ValueError:
            return None
        if not isinstance(config, dict) or not config.get("durableUrl"):
            return None
        return cls(
            url=str(config["durableUrl"]),
            job_id=job_id,
            keep=int(config.get("durableKeep") or 3),
            storage_options=dict(config.get("storageOptions") or {}),
        )


@dataclass(frozen=True)
class MemoryShardFile:
    rank: int
    step: int
    meta_path: Path
    meta: dict[str, Any]


def scan_memory(
    root: Path, metas: MetaCache | None = None
) -> dict[int, dict[int, MemoryShardFile]]:
    """Step -> rank -> shard, for every copy-complete shard in a node's memory tier
    (``metas``: the metas read before, read again only if changed)."""
    metas = metas if metas is not None else MetaCache()
    found: dict[int, dict[int, MemoryShardFile]] = {}
    if not root.is_dir():
        return found
    seen = set()
    for path in root.iterdir():
        match = _META.match(path.name)
        if match is None:
            continue
        seen.add(path)
        try:
            meta = metas.read(path)[1]
            step, rank = int(meta["step"]), int(meta["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being rewritten or foreign; the next scan sees it
        if rank != int(match.group(1)):
            continue
        found.setdefault(step, {})[rank] = MemoryShardFile(rank, step, path, meta)
    metas.forget_except(seen)
    return found


def reread(shard: MemoryShardFile) -> MemoryShardFile:
    """``shard`` with its meta as it is now; :class:`PersistFailed` once it is gone."""
    try:
        meta = json.loads(shard.meta_path.read_bytes())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or meta.get("step") != shard.step:
        raise PersistFailed(f"rank {shard.rank}'s step {shard.step} was overwritten in memory")
    return MemoryShardFile(shard.rank, shard.step, shard.meta_path, meta)


def read_shard(shard: MemoryShardFile) -> tuple[bytes, dict[str, Any]]:
    """A private copy of a memory shard and its meta, verified against the meta's checksum.

    :class:`PersistFailed` when the shard was overwritten, has no checksum, or does not
    match it: a shard leaves the node only with a checksum its data matches.
    """
    nbytes = int(shard.meta["nbytes"])
    data_path = shard.meta_path.with_suffix(".data")
    with open(data_path, "rb") as f:
        data = f.read(nbytes)
    after = reread(shard).meta
    if len(data) != nbytes:
        raise PersistFailed(f"rank {shard.rank}'s step {shard.step} was overwritten in memory")
    expected = after.get("checksum")
    if expected is None:
        raise PersistFailed(
            f"rank {shard.rank}'s step {shard.step} has no checksum ({shard.meta_path}): "
            "its data cannot be verified, so it is not persisted"
        )
    digest = checksum(data)
    if expected != digest:
        raise PersistFailed(
            f"rank {shard.rank}'s step {shard.step} does not match its checksum "
            f"({data_path}: data {digest}, meta {expected}); not persisted"
        )
    return data, after


@dataclass(frozen=True)
class _Request:
    from_step: int
    world_size: int
    commit: bool
    ranks: tuple[int, ...]  # this node's ranks


class DurablePersister:
    """Persists requested steps of one node's memory tier in a background thread."""

    def __init__(
        self,
        memory_dir: Path,
        settings: DurableSettings,
        *,
        commit_timeout: float = COMMIT_TIMEOUT_SECONDS,
        workers_alive: Callable[[], bool] = lambda: True,
        fence: Callable[[], str | None] = lambda: None,
    ) -> None:
        """``fence``: why nothing may be written to the durable tier now (a node that the
        controller may have declared lost, :mod:`trainguard.agent.lease`), else None;
        asked before every shard and before the commit."""
        self._fence = fence
        self.memory_dir = memory_dir
        self._metas = MetaCache()  # the memory tier's metas, parsed once per version
        self.settings = settings
        self.commit_timeout = commit_timeout
        self._workers_alive = workers_alive
        self._tier: DurableTier | None = None
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        self._lock = threading.Lock()
        self._busy: int | None = None
        self._written: list[int] = []
        self._committed: list[int] = []
        self._failed: dict[int, str] = {}
        self._thread = threading.Thread(target=self._run, name="trainguard-persist", daemon=True)
        self._thread.start()

    def request(self, from_step: int, world_size: int, commit: bool, ranks: list[int]) -> None:
        """Queue a request: persist the first step ``>= from_step`` that ``ranks`` save."""
        self._requests.put(_Request(from_step, world_size, commit, tuple(ranks)))

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=1.0)

    def status(self) -> CheckpointStatus:
        """Memory steps (step -> this node's ranks, forced flag) and the durable writes so far."""
        memory = {
            step: MemoryStep(
                ranks=tuple(sorted(shards)),
                force=any(bool(s.meta.get("persist")) for s in shards.values()),
            )
            for step, shards in scan_memory(self.memory_dir, self._metas).items()
        }
        with self._lock:
            return CheckpointStatus(
                memory_steps=memory,
                persisting=self._busy,
                written=tuple(self._written),
                committed=tuple(self._committed),
                failed=dict(self._failed),
            )

    # -- the background thread ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            with self._lock:
                self._busy = request.from_step
            write_hold(str(self.memory_dir), request.from_step)
            with self._lock:
                self._failed.pop(request.from_step, None)  # an earlier try's
            try:
                self._persist(request)
            except Superseded:
                logger.warning(
                    "durable checkpoint from step %d given up: a newer request came",
                    request.from_step,
                )  # fmt: skip
            except Exception as exc:
                message = str(exc) if isinstance(exc, PersistFailed) else f"{exc!r}"
                logger.warning(
                    "durable checkpoint from step %d failed: %s", request.from_step, message
                )
                with self._lock:
                    self._failed[request.from_step] = message
                    for step in sorted(self._failed)[:-HISTORY]:
                        del self._failed[step]
            finally:
                if hold_from(str(self.memory_dir)) == request.from_step:
                    write_hold(str(self.memory_dir), None)
                with self._lock:
                    self._busy = None

    def _held_step(self, request: _Request) -> tuple[int, dict[int, MemoryShardFile]]:
        """The step this node's ranks hold for ``request``, once every one has it."""
        deadline = time.monotonic() + self.commit_timeout
        while True:
            memory = scan_memory(self.memory_dir, self._metas)
            firsts = {
                rank: min(
                    (
                        s
                        for s, shards in memory.items()
                        if s >= request.from_step and rank in shards
                    ),
                    default=None,
                )
                for rank in request.ranks
            }
            found = set(firsts.values())
            if None not in found:
                if len(found) > 1:
                    raise PersistFailed(f"ranks of this node saved different steps: {firsts}")
                step = found.pop()
                assert step is not None
                return step, {rank: memory[step][rank] for rank in request.ranks}
            self._check_superseded()
            if not self._workers_alive():
                raise PersistFailed(
                    f"the workers exited before saving a step >= {request.from_step}"
                )
            if time.monotonic() > deadline:
                raise PersistFailed(
                    f"no step >= {request.from_step} saved by ranks {list(request.ranks)} "
                    f"within {self.commit_timeout:.0f} s"
                )
            time.sleep(HOLD_POLL_SECONDS)

    def _persist(self, request: _Request) -> None:
        started = time.monotonic()
        step, shards = self._held_step(request)
        with self._lock:
            written = step in self._written
        if not written:
            checked = self._checksummed(step, shards)
            copies = [read_shard(shard) for _, shard in sorted(checked.items())]
            tier = self._open()
            for data, meta in copies:
                self._check_fence(step)
                tier.write_shard(step, int(meta["rank"]), data, meta)
            del copies
            with self._lock:
                self._written.append(step)
                _trim(self._written)
            logger.info(
                "step %d: ranks %s persisted to %s in %.2f s",
                step, sorted(shards), self.settings.url, time.monotonic() - started,
            )  # fmt: skip
        if request.commit:
            self._commit(step, request.world_size)

    def _checksummed(
        self, step: int, shards: dict[int, MemoryShardFile]
    ) -> dict[int, MemoryShardFile]:
        """``shards`` once each meta carries its checksum, which the worker's checkpointer
        adds in the background right after ``save()``; :class:`PersistFailed` when one
        never does (its worker is gone, or ``commit_timeout`` passed)."""
        deadline = time.monotonic() + self.commit_timeout
        while True:
            shards = {rank: reread(shard) for rank, shard in shards.items()}
            missing = [s for _, s in sorted(shards.items()) if s.meta.get("checksum") is None]
            if not missing:
                return shards
            self._check_superseded()
            why = None
            if not self._workers_alive():
                why = "the workers exited before adding it"
            elif time.monotonic() > deadline:
                why = f"it was not added within {self.commit_timeout:.0f} s"
            if why is not None:
                files = ", ".join(str(s.meta_path) for s in missing)
                raise PersistFailed(
                    f"step {step}: ranks {[s.rank for s in missing]} have no checksum "
                    f"({files}); {why}, and an unverified shard is never persisted"
                )
            time.sleep(HOLD_POLL_SECONDS)

    def _check_superseded(self) -> None:
        """:class:`Superseded` when a newer request waits (asked between waits)."""
        if not self._requests.empty():
            raise Superseded

    def _check_fence(self, step: int) -> None:
        why = self._fence()
        if why is not None:
            raise PersistFailed(f"step {step}: not written: {why}")

    def _commit(self, step: int, world_size: int) -> None:
        tier = self._open()
        deadline = time.monotonic() + self.commit_timeout
        self._check_fence(step)
        while not tier.commit(step, world_size):
            if time.monotonic() > deadline:
                raise PersistFailed(
                    f"step {step}: not every rank's shard reached {self.settings.url} "
                    f"within {self.commit_timeout:.0f} s"
                )
            time.sleep(COMMIT_POLL_SECONDS)
            self._check_superseded()
            self._check_fence(step)
        pruned = tier.prune(self.settings.keep)
        with self._lock:
            self._committed.append(step)
            _trim(self._committed)
        logger.info("step %d committed to %s (pruned %s)", step, self.settings.url, pruned)

    def _open(self) -> DurableTier:
        if self._tier is None:
            s = self.settings
            from trainguard.checkpoint.durable import DurableTier  # fsspec: on first use

            self._tier = DurableTier(s.url, s.job_id, s.storage_options)
        return self._tier


def _trim(items: list[int]) -> None:
    del items[:-HISTORY]


def make_persister(
    agent_env: Mapping[str, str],
    job_id: str,
    workers_alive: Callable[[], bool],
    fence: Callable[[], str | None] = lambda: None,
) -> DurablePersister | None:
    """The node's durable writer, from the agent's environment: its memory tier
    (``TRAINGUARD_CHECKPOINT_MEMORY_DIR``) and the job's checkpoint config; None without
    a durable tier."""
    memory_dir = agent_env.get(MEMORY_DIR_ENV)
    settings = DurableSettings.from_config_json(agent_env.get(CONFIG_ENV), job_id)
    if not memory_dir or settings is None:
        return None
    return DurablePersister(Path(memory_dir), settings, workers_alive=workers_alive, fence=fence)
