"""The pusher of a node's memory tier to its replica peers (see :mod:`trainguard.agent.replicas`).

A pass sends each peer, in one request (a batch, :mod:`trainguard.agent.replica_batch`),
every file of the newest whole step that changed since that peer last took it. Passes
follow the memory tier's commits: an ``inotify`` watch on it (and on its DCP step
directories) wakes the pusher when a meta is renamed in (passes at least
:data:`MIN_GAP_SECONDS` apart), with a pass every :data:`SAFETY_PASS_SECONDS` besides;
where it cannot be watched, it looks every :data:`PUSH_INTERVAL_SECONDS`. Nothing runs
while nothing changes. Saves that come faster than a push coalesce: the next pass takes
the newest step only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import urllib.parse
from pathlib import Path
from typing import IO

from trainguard.agent.client import AgentClient, AgentError
from trainguard.agent.filewatch import COMMITS, DirWatch
from trainguard.agent.meta_cache import MetaCache
from trainguard.agent.replica_batch import file_part
from trainguard.agent.replicas import (
    TRANSFER_TIMEOUT_SECONDS,
    checksummed_shards,
    dcp_step_files,
    dcp_steps,
    newest_whole_step,
    replica_url,
)
from trainguard.checkpoint.tier_dir import TierDirError, private_dir

__all__ = ["MIN_GAP_SECONDS", "PUSH_INTERVAL_SECONDS", "SAFETY_PASS_SECONDS", "ReplicaPusher"]

logger = logging.getLogger(__name__)

PUSH_INTERVAL_SECONDS = 0.5
"""Where inotify is missing: how often the pusher looks for changed files."""
SAFETY_PASS_SECONDS = 5.0
"""Where the pusher is woken by changes: its pass when none came (a missed one, a push
that failed and is due again)."""
MIN_GAP_SECONDS = 0.5
"""Where the pusher is woken by changes: the least time from one pass to the next. The
commits of a burst (a save commits a few files per rank) make one pass, and at 8 saves a
second a pass takes the newest of 4 steps (as the 0.5 s poll did: pushing each step would
cost the agents 4 times the CPU); the first commit after a quiet spell goes at once."""


Unit = tuple[str, str | None, tuple[int, int]]
"""What a pass pushes as one: (a meta, the data that goes before it or None, the meta's
version)."""


class ReplicaPusher:
    """Pushes changed files of this node's memory tier to its replica peers, in the
    background: one batch per peer per pass, a pass as soon as a file is committed there
    (``inotify``; every :data:`SAFETY_PASS_SECONDS` besides), or every ``interval``
    where the memory tier cannot be watched."""

    def __init__(
        self,
        node_id: str,
        memory_dir: Path,
        peer_urls: list[str],
        token: str,
        interval: float = PUSH_INTERVAL_SECONDS,
        safety_interval: float = SAFETY_PASS_SECONDS,
    ) -> None:
        self.node_id = node_id
        self.memory_dir = memory_dir
        self._root = str(memory_dir)
        self.peer_urls = peer_urls
        self.token = token
        self.interval = interval
        self.safety_interval = safety_interval
        self._pushed: dict[tuple[str, str], tuple[int, int]] = {}  # (peer, meta) -> version
        self._metas = MetaCache()  # the memory tier's metas, parsed once per version
        # Kept-alive connections: one per file pushed cost both agents more CPU (and the
        # receiver a thread) than the copying.
        self._peers = {
            url: AgentClient(url, token, timeout=TRANSFER_TIMEOUT_SECONDS) for url in peer_urls
        }
        self._batch_path = urllib.parse.urlsplit(replica_url("", node_id)).path
        self._stop = threading.Event()
        self._watch: DirWatch | None = None
        self._watched: set[tuple[Path, int]] = set()  # (directory, inode) watched
        self._thread = threading.Thread(target=self._run, name="trainguard-replicas", daemon=True)

    @property
    def watching(self) -> bool:
        """Whether changes wake the pusher (else it polls every ``interval``)."""
        return self._watch is not None

    def start(self) -> None:
        if self.peer_urls:
            try:  # the workers create it too; the agent watches it before they start
                self._watch = DirWatch.open([private_dir(self.memory_dir)], COMMITS)
            except (TierDirError, OSError) as exc:
                logger.info("cannot watch %s (%s): polling instead", self.memory_dir, exc)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.poke()
        if self._thread.is_alive():
            self._thread.join(TRANSFER_TIMEOUT_SECONDS)

    def push_once(self) -> int:
        """Push the shards of the newest step every rank of this node has checksummed, if
        they changed since their last push, to each peer in one batch; returns shards
        pushed (counted once per peer).

        Only shards whose meta carries a checksum leave the node (a copy-complete meta
        without one is trusted on its own node only); data goes first, then the meta.
        One step per pass: at 8 saves a second the older slots would be pushed only to
        be replaced (half the agents' CPU went to those pushes and their receipt).
        """
        units: list[Unit] = [
            (shard.meta, shard.data, shard.version)
            for shard in newest_whole_step(checksummed_shards(self.memory_dir, self._metas))
        ]
        units += dcp_step_files(self.memory_dir)
        pushed = 0
        for peer in self.peer_urls:
            due = [unit for unit in units if self._pushed.get((peer, unit[0])) != unit[2]]
            if due and not self._stop.is_set():
                pushed += self._push(peer, due)
        return pushed

    def _push(self, peer: str, due: list[Unit]) -> int:
        """One batch of ``due``'s files to ``peer``; the units it carried."""
        with contextlib.ExitStack() as files:
            parts: list[tuple[bytes, IO[bytes], int]] = []
            sent = []
            for unit in due:
                try:
                    for rel in (unit[1], unit[0]):
                        if rel is not None:
                            f = files.enter_context(open(os.path.join(self._root, rel), "rb", 0))
                            parts.append(file_part(f, rel))
                except OSError as exc:  # a slot dropped since the scan: the next pass
                    logger.debug("replica push of %s skipped: %s", unit[0], exc)
                    continue
                sent.append(unit)
            if not parts:
                return 0
            try:
                self._peers[peer].upload(self._batch_path, parts)
            except (OSError, AgentError) as exc:
                logger.warning("replica push of %d shards to %s failed: %s", len(sent), peer, exc)
                return 0
        for meta_rel, _, version in sent:
            self._pushed[(peer, meta_rel)] = version
        return len(sent)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                self._watch_dcp()
                self.push_once()
                if self._watch is None:
                    self._stop.wait(self.interval)
                elif self._watch.wait(self.safety_interval)[0]:
                    self._stop.wait(max(0.0, MIN_GAP_SECONDS - (time.monotonic() - began)))
                    self._watch.wait(0)
        finally:
            for peer in self._peers.values():
                peer.close()
            if self._watch is not None:
                self._watch.close()

    def _watch_dcp(self) -> None:
        """Watch the DCP directory and its step directories too (inotify watches one
        directory, not what is under it); before the pass that reads them."""
        if self._watch is None:
            return
        dcp = self.memory_dir / "dcp"
        present = set()
        for directory in [dcp, *dcp_steps(dcp).values()]:
            with contextlib.suppress(OSError):
                present.add((directory, directory.stat().st_ino))
        for key in present - self._watched:
            self._watch.add(key[0])
        self._watched = present
