"""Peer replicas of the memory checkpoint tier: copies of a node's snapshots in other nodes' RAM.

Each agent pushes the files of its node's memory tier to the next ``replicas``
nodes (ring order of the attempt's node ranks) over the agent API
(:mod:`trainguard.agent.replica_push`: a pass's files in one batch per peer,
:mod:`trainguard.agent.replica_batch`), and keeps the copies it receives under its own
replica directory (also RAM; :class:`ReplicaStore`). When a node is replaced, its new
agent finds its memory tier empty and pulls its files back from whichever peer holds
them (all of them in one request), before its workers start; the workers'
Checkpointer then finds them as if they had never been lost. A node that takes a lost
node's place under another id (a spare) pulls the lost node's files: its assignment's
``replica_source`` names it (the shards are named by global rank, and the spare runs
the lost node's ranks).

DCP steps (``trainguard.checkpoint.dcp``: ``dcp/step-<N>/rank-<R>.data``, its
``rank-<R>.json`` and the coordinator's ``metadata.json``) are pushed the same way: the
newest step's rank files here (data, then the meta, which carries the checksum and
is written last), then its ``metadata.json`` where this node has it. A peer keeps the
newest :data:`DCP_KEEP` steps of each source.

Consistency: only shards whose meta carries a checksum are pushed (data, then
meta), and files are read while the worker may be rewriting them, so a copy
can be torn. That is safe because a replica is never trusted blindly: when a
node pulls its shards back, every shard whose data does not match its meta's
checksum is deleted before the workers start, and a torn copy on a peer is
replaced by the next push. Each received file appears under its final name
atomically (tmp + rename), so a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import re
import shutil
import threading
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

from trainguard.agent.meta_cache import MetaCache
from trainguard.agent.replica_batch import (
    BATCH_QUERY,
    BatchStream,
    ReplicaError,
    ReplicaRoomError,
    file_part,
    read_frame,
    safe_relpath,
    write_file,
)
from trainguard.checkpoint.files import checksum
from trainguard.checkpoint.tier_dir import private_dir
from trainguard.http_client import open_url

__all__ = [
    "REPLICA_PATH",
    "ReplicaError",
    "ReplicaRoomError",
    "ReplicaStore",
    "replica_peers",
    "restore_from_peers",
]

logger = logging.getLogger(__name__)

REPLICA_PATH = "/replica/"
TRANSFER_TIMEOUT_SECONDS = 60.0
DCP_KEEP = 2
"""DCP steps of each source a peer keeps (a newer one arriving removes the older ones)."""
_DCP_STEP = re.compile(r"^dcp/step-(\d+)/")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def dcp_steps(dcp: Path) -> dict[int, Path]:
    """Step -> directory of the DCP steps under ``dcp``."""
    found = {}
    for path in dcp.iterdir() if dcp.is_dir() else []:
        if match := _STEP_DIR.match(path.name):
            found[int(match[1])] = path
    return found


def _safe_name(name: str) -> str:
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ReplicaError(f"node id {name!r} is not a plain name")
    return name


class Shard(NamedTuple):
    """A checksummed shard of a memory tier: its files, version, rank and step."""

    meta: str
    data: str
    version: tuple[int, int]  # the meta's (mtime_ns, size)
    rank: int
    step: int


def checksummed_shards(root: Path, metas: MetaCache | None = None) -> list[Shard]:
    """Every shard in a memory tier whose meta has a checksum (``metas``: the metas read
    before, read again only if changed). One listing of ``root`` and a ``stat`` per meta
    (a data file is known from the listing)."""
    metas = metas if metas is not None else MetaCache()
    try:
        names = set(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        names = set()
    shards = []
    paths = set()
    for name in sorted(n for n in names if n.endswith(".meta") and not n.startswith(".")):
        path = os.path.join(root, name)
        paths.add(path)
        data = name[: -len(".meta")] + ".data"
        try:
            st, meta = metas.read(path)
        except (OSError, ValueError):
            continue  # being rewritten; the next pass sees it
        if not isinstance(meta, dict) or not meta.get("checksum") or data not in names:
            continue
        rank, step = meta.get("rank"), meta.get("step")
        if isinstance(rank, int) and isinstance(step, int):
            version = (st.st_mtime_ns, st.st_size)
            shards.append(Shard(name, data, version, rank, step))
    metas.forget_except(paths)
    return shards


def newest_whole_step(shards: Sequence[Shard]) -> list[Shard]:
    """The shards of the newest step every rank here has (a restore needs all of a node's
    ranks at one step); older slots are superseded, and a peer keeps what it had of them."""
    steps: dict[int, set[int]] = {}
    for shard in shards:
        steps.setdefault(shard.rank, set()).add(shard.step)
    common = set.intersection(*steps.values()) if steps else set()
    if not common:
        return []
    step = max(common)
    return [shard for shard in shards if shard.step == step]


def dcp_step_files(root: Path) -> list[tuple[str, str | None, tuple[int, int]]]:
    """The newest DCP step's files here to push, in order: (file, the file written just
    before it that must go first or None, the version of the file): each rank's
    ``rank-<R>.json`` after its data, then ``metadata.json``. Empty if there is none."""
    steps = dcp_steps(root / "dcp")
    if not steps:
        return []
    step_dir = steps[max(steps)]
    files: list[tuple[str, str | None, tuple[int, int]]] = []
    for meta in [*sorted(step_dir.glob("rank-*.json")), step_dir / "metadata.json"]:
        try:
            st = meta.stat()
        except OSError:
            continue
        data = meta.with_suffix(".data")
        first = str(data.relative_to(root)) if meta.name != "metadata.json" else None
        files.append((str(meta.relative_to(root)), first, (st.st_mtime_ns, st.st_size)))
    return files


def drop_unverified(root: Path) -> list[str]:
    """Delete every shard under ``root`` whose data does not match its meta's checksum."""
    dropped = []
    for meta_path in sorted(root.glob("*.meta")):
        data_path = meta_path.with_suffix(".data")
        try:
            meta = json.loads(meta_path.read_bytes())
            nbytes = int(meta["nbytes"])
            with open(data_path, "rb") as f:
                ok = checksum(f.read(nbytes)) == meta["checksum"]
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            meta_path.unlink(missing_ok=True)
            data_path.unlink(missing_ok=True)
            dropped.append(meta_path.name)
    return dropped


def list_files(root: Path) -> list[dict[str, Any]]:
    """Every regular file under ``root``: relative path, size and mtime (ns)."""
    files = []
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            if path.is_file() and not path.name.startswith(".tmp-"):
                st = path.stat()
                files.append(
                    {
                        "path": str(path.relative_to(root)),
                        "size": st.st_size,
                        "mtime_ns": st.st_mtime_ns,
                    }
                )
    return files


class _Target(NamedTuple):
    """Where a replica file is held: its path (and as a string), its directory, its
    source's directory, and whether it is a DCP step's."""

    path: Path
    name: str
    parent: Path
    held: Path
    dcp: bool


_TARGETS_KEPT = 1024
"""The most replica paths a store keeps worked out (then it starts over)."""


class ReplicaStore:
    """The copies this node holds of other nodes' memory tiers: ``<root>/<source node>/...``.

    ``max_bytes`` (the agent's ``--max-replica-bytes``): the most bytes of replicas it
    holds, of every peer together; None: as much as the filesystem has room for.

    The store is the one writer under ``root``: it counts the bytes it holds as it
    writes and prunes (the files are walked once, at the first receipt, and again only
    for :meth:`room` and before a refusal, in case some were removed behind its back),
    so a file of a batch costs no walk of every file held.
    """

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: dict[Path, int] | None = None  # every file held (or being received)
        self._held = 0  # their bytes
        self._walks = 0  # walks of the files held so far
        self._dirs: set[Path] = set()  # directories made (and checked) private
        self._targets: dict[tuple[str, str], _Target] = {}  # (source, relpath) -> where

    def room(self, source: str, relpath: str) -> int:
        """The most bytes a received ``source/relpath`` may have: the free space of the
        replicas' filesystem (RAM), and what ``max_bytes`` leaves beside the other files
        held (the file it replaces does not count), counted afresh (a walk of the files
        held: for a single file's ``PUT``; a batch's files count as they come).
        :class:`ReplicaError` for a bad path."""
        target = self.root / _safe_name(source) / safe_relpath(relpath)
        with self._lock:
            self._sizes = None
            return self._room(target)

    def receive(self, source: str, relpath: str, stream: BatchStream, length: int) -> None:
        """Write ``length`` bytes of ``stream`` to ``source/relpath`` (atomically: nothing
        of it stays when the stream fails or ends early), if :meth:`room` has room for
        them (else :class:`ReplicaRoomError`, before a byte is read)."""
        self._receive(source, relpath, stream, length, set())

    def receive_batch(self, source: str, stream: BatchStream) -> list[str]:
        """Write every file of the batch in ``stream`` under ``source``, in its order,
        each bounded by :meth:`room` before its bytes are read; the paths stored.
        :class:`ReplicaError` (:class:`ReplicaRoomError`) at the first bad (too large)
        file: those before it stand, nothing of it does."""
        stored = []
        checked: set[Path] = set()  # directories found standing in this batch
        while (frame := read_frame(stream)) is not None:
            self._receive(source, frame.path, stream, frame.size, checked)
            stored.append(frame.path)
        return stored

    def _receive(
        self, source: str, relpath: str, stream: BatchStream, length: int, checked: set[Path]
    ) -> None:
        """:meth:`receive`; ``checked``: directories already made or found this batch."""
        target = self._target(source, relpath)
        if target.dcp and self._prune_dcp(target.held, relpath):
            checked.clear()  # a directory it removed is made again if a file needs it
        walks = self._claim(target.path, length, relpath)
        stored = False
        try:
            if target.parent not in checked:
                self._private_dir(target.parent)
                checked.add(target.parent)
            write_file(target.name, stream, length, relpath)
            stored = True
        finally:
            # Stored: counted as claimed, unless the files were walked meanwhile (the
            # walk may have seen the file it replaced). Not: the file it was to replace.
            if not stored or walks != self._walks:
                self._recount(target.path)

    def _target(self, source: str, relpath: str) -> _Target:
        """Where ``source/relpath`` is held; :class:`ReplicaError` for a bad path. A push
        names the same files each time (a step's slots), so they are worked out once."""
        key = (source, relpath)
        target = self._targets.get(key)
        if target is None:
            held = self.root / _safe_name(source)
            path = held / safe_relpath(relpath)
            target = _Target(path, str(path), path.parent, held, relpath.startswith("dcp/"))
            if len(self._targets) >= _TARGETS_KEPT:  # new DCP steps, sources: start over
                self._targets.clear()
            self._targets[key] = target
        return target

    def _room(self, target: Path) -> int:
        """:meth:`room` for ``target``, with the lock held."""
        room = _free_bytes(self.root)
        if self.max_bytes is not None:
            sizes = self._counted()
            room = min(room, self.max_bytes - (self._held - sizes.get(target, 0)))
        return max(0, room)

    def _claim(self, target: Path, size: int, relpath: str) -> int:
        """Count ``size`` bytes for ``target`` (in place of its file's) if there is room;
        how many walks of the files held the count is from."""
        with self._lock:
            room = self._room(target)
            if size > room and self.max_bytes is not None:
                self._sizes = None  # before refusing: count what is really there
                room = self._room(target)
            if size > room:
                raise ReplicaRoomError(f"replica {relpath}: {size} bytes, room for {room}")
            sizes = self._counted()
            self._held += size - sizes.get(target, 0)
            sizes[target] = size
            return self._walks

    def _recount(self, target: Path) -> None:
        """Count ``target`` as it is on disk."""
        try:
            size: int | None = target.stat().st_size
        except FileNotFoundError:
            size = None
        with self._lock:
            sizes = self._counted()
            self._held -= sizes.pop(target, 0)
            if size is not None:
                sizes[target] = size
                self._held += size

    def _counted(self) -> dict[Path, int]:
        """Every file held and its size (walked the first time), with the lock held."""
        if self._sizes is None:
            self._sizes = {path: _size(path) for path in _files(self.root)}
            self._held = sum(self._sizes.values())
            self._walks += 1
        return self._sizes

    def _private_dir(self, directory: Path) -> None:
        """Make ``directory`` (and its parents) private (:func:`private_dir`), once while
        it stands (one removed behind the store's back is made again)."""
        if directory not in self._dirs or not os.path.isdir(directory):
            private_dir(directory)
            self._dirs.add(directory)

    @contextlib.contextmanager
    def batch(self, source: str) -> Iterator[tuple[list[tuple[bytes, IO[bytes], int]], int]]:
        """Every file held of ``source``, opened, as a batch's parts (header, file, size:
        data before its meta), and the batch's length; the files are closed after. A
        file replaced meanwhile is sent as it was when opened (replicas are renamed in)."""
        parts: list[tuple[bytes, IO[bytes], int]] = []
        with contextlib.ExitStack() as stack:
            root = self.root / _safe_name(source)
            for entry in list_files(root):
                try:
                    f = stack.enter_context(open(root / entry["path"], "rb"))
                except FileNotFoundError:
                    continue  # an older DCP step pruned meanwhile
                parts.append(file_part(f, entry["path"]))
            yield parts, sum(len(header) + size for header, _, size in parts)

    def _prune_dcp(self, held: Path, relpath: str) -> bool:
        """The first file of a DCP step N arriving: remove the steps before the newest
        DCP_KEEP (and stop counting their files); whether it removed any."""
        match = _DCP_STEP.match(relpath)
        if match is None or (held / "dcp" / f"step-{match[1]}").is_dir():
            return False
        steps = {*dcp_steps(held / "dcp"), int(match[1])}
        for old in sorted(steps)[:-DCP_KEEP]:
            gone = held / "dcp" / f"step-{old}"
            shutil.rmtree(gone, ignore_errors=True)
            with self._lock:
                self._dirs = {d for d in self._dirs if not d.is_relative_to(gone)}
                if self._sizes is not None:
                    for path in [p for p in self._sizes if p.is_relative_to(gone)]:
                        self._held -= self._sizes.pop(path)
        return len(steps) > DCP_KEEP

    def listing(self, source: str) -> list[dict[str, Any]]:
        return list_files(self.root / _safe_name(source))

    def path(self, source: str, relpath: str) -> Path:
        path = self.root / _safe_name(source) / safe_relpath(relpath)
        if not path.is_file():
            raise FileNotFoundError(f"no replica {source}/{relpath}")
        return path


def _files(root: Path) -> list[Path]:
    """Every file under ``root`` but those being received (``.tmp-*``)."""
    if not root.is_dir():
        return []
    return [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".tmp-")]


def _size(path: Path) -> int:
    """``path``'s size; 0 if it went away meanwhile (a replica being replaced)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _free_bytes(path: Path) -> int:
    """Free bytes of the filesystem ``path`` is (or will be) on."""
    try:
        st = os.statvfs(path)  # there once a replica came; before, a parent answers
        return st.f_bavail * st.f_frsize
    except (FileNotFoundError, NotADirectoryError):
        pass
    for candidate in path.parents:
        try:
            st = os.statvfs(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue
        return st.f_bavail * st.f_frsize
    return 0


def replica_url(base: str, source: str, relpath: str = "") -> str:
    tail = urllib.parse.quote(f"{source}/{relpath}" if relpath else source)
    return f"{base}{REPLICA_PATH}{tail}"


def restore_from_peers(
    node_id: str,
    memory_dir: Path,
    peers: Mapping[str, str],
    token: str,
    source: str | None = None,
) -> str | None:
    """Fill an empty memory tier from the first peer holding ``source``'s replica: the
    node that last ran this node's ranks (a node this one replaces; default: itself).
    Each peer's replica comes in one request (a batch); one that fails midway is
    removed, and the next peer is asked.

    Returns the peer's node id, or None when nothing was restored.
    """
    source = source or node_id
    if list_files(memory_dir):
        return None
    for peer_id, base in peers.items():
        if peer_id in (node_id, source):
            continue
        try:
            with open_url(
                f"{replica_url(base, source)}?{BATCH_QUERY}",
                token,
                timeout=TRANSFER_TIMEOUT_SECONDS,
            ) as response:
                count = _receive_all(memory_dir, response)
        except (OSError, http.client.HTTPException, ReplicaError) as exc:  # a bad reply too
            logger.info("no replica of %s on %s: %s", source, peer_id, exc)
            _empty(memory_dir)
            continue
        if not count:
            continue
        dropped = drop_unverified(memory_dir)
        if dropped:
            logger.warning("replica shards from %s failed their checksum: %s", peer_id, dropped)
        logger.info("restored %d memory-tier files of %s from %s", count, source, peer_id)
        return peer_id
    return None


def _receive_all(memory_dir: Path, stream: BatchStream) -> int:
    """Write the batch in ``stream`` under ``memory_dir``; the files written."""
    count = 0
    while (frame := read_frame(stream)) is not None:
        target = memory_dir / safe_relpath(frame.path)
        private_dir(target.parent)
        write_file(target, stream, frame.size, frame.path)
        count += 1
    return count


def _empty(memory_dir: Path) -> None:
    """Remove what a failed restore wrote (the memory tier was empty before it)."""
    for path in memory_dir.iterdir() if memory_dir.is_dir() else []:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def replica_peers(node_id: str, peers: Mapping[str, str], replicas: int) -> list[str]:
    """The URLs of the next ``replicas`` nodes after ``node_id`` in ring order."""
    order = list(peers)
    if node_id not in order or replicas <= 0:
        return []
    i = order.index(node_id)
    ring = order[i + 1 :] + order[:i]
    return [peers[n] for n in ring[: min(replicas, len(ring))]]
