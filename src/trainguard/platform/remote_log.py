"""``trainguard logs JOB --rank R`` on the controller's host, for a rank another host
runs: its log is read from the agent of the node that holds the rank, on that host
(``GET /logs``, :mod:`trainguard.agent.rank_log`), with the job's token.

The node and its agent's address are the store's (the controller keeps them); the token
is the job's ``token`` file. The rotated files come first, oldest first, then
``rank-R.log``; with ``--follow`` the log is read on until the job ends, following the
rank to the host that runs it next (a spare host that took its node). A host that does
not answer is said, with where the file lives there, and the command fails.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainguard.agent.client import AgentClient, AgentError, AgentUnreachable
from trainguard.platform.store import JobRow, Store

__all__ = ["RemoteRank", "follow_remote", "remote_holder"]

LOOPBACK = ("127.0.0.1", "::1", "localhost")
REQUEST_TIMEOUT = 5.0
UNREACHABLE_GRACE = 15.0
"""With --follow: how long an agent that stops answering is retried before giving up
(a restart replaces the node's agent: the store names the new one within a few seconds)."""


@dataclass(frozen=True)
class RemoteRank:
    """Where a rank runs on another host: its node, that host, its agent's URL."""

    node_id: str
    host: str
    agent_url: str


def remote_holder(store: Store, job: JobRow, rank: int) -> RemoteRank | None:
    """The node on another host that holds ``rank`` now, per the store, or None."""
    for node in store.nodes(job.id):
        url = node["agent_url"] or ""
        host = url.split("//", 1)[-1].rsplit(":", 1)[0].strip("[]")
        if rank in node["ranks"] and host and host not in LOOPBACK:
            return RemoteRank(node["node_id"], host, url)
    return None


def follow_remote(
    store: Store,
    job: JobRow,
    rank: int,
    holder: RemoteRank,
    follow: bool,
    running: Callable[[], bool],
    write: Callable[[bytes], None],
) -> int:
    """Copy ``rank``'s log from ``holder``'s host to ``write``; the exit code."""
    try:
        token = (Path(job.job_dir) / "token").read_text().strip()
    except OSError as exc:
        return _fail(f"cannot read the job's token ({exc.strerror}): {_where(job, rank, holder)}")
    reader = _Reader(holder, token, rank, write)
    failing_since: float | None = None
    while True:
        try:
            reader.read_on()
            failing_since = None
        except AgentUnreachable as exc:
            if not follow:
                return _fail(f"{_gone(holder, exc)}: {_where(job, rank, holder)}")
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since > UNREACHABLE_GRACE or not running():
                return _fail(f"{_gone(holder, exc)}: {_where(job, rank, holder)}")
        except AgentError as exc:
            if exc.status != 404 or not follow:
                return _fail(f"{holder.node_id} on host {holder.host}: {exc}")
        if not follow:
            return 0
        if not running():  # what was written while we looked at the phase, if still there
            with contextlib.suppress(AgentError):
                reader.read_on()
            return 0
        time.sleep(0.25)
        moved = remote_holder(store, job, rank)
        if moved is not None and moved.agent_url != holder.agent_url:
            holder = moved  # the node restarted, or a spare host took it: read there
            reader = _Reader(holder, token, rank, write)
            failing_since = None


class _Reader:
    """Reads one host's copy of a rank's log on from where it stopped."""

    def __init__(self, holder: RemoteRank, token: str, rank: int, write: Callable[[bytes], None]):
        self.client = AgentClient(holder.agent_url, token, timeout=REQUEST_TIMEOUT)
        self.rank, self.write = rank, write
        self.offset: int | None = None  # None: the rotated files are still to read

    def read_on(self) -> None:
        if self.offset is None:
            first = self.client.rank_log(self.rank, 0)
            for rotation in range(first.rotations, 0, -1):  # the oldest first
                self._copy(rotation, 0)
            self.offset = 0
        piece = self.client.rank_log(self.rank, self.offset)
        if piece.size < self.offset:  # rotated meanwhile: the old file's rest first
            self._copy(1, self.offset)
            self.offset = 0
        self.offset = self._copy(0, self.offset)

    def _copy(self, rotation: int, offset: int) -> int:
        """Copy one file from ``offset`` to its end (as it is now); the offset reached."""
        while True:
            piece = self.client.rank_log(self.rank, offset, rotation)
            self.write(piece.data)
            offset = piece.offset + len(piece.data)
            if not piece.data or offset >= piece.size:
                return offset


def _gone(holder: RemoteRank, exc: Exception) -> str:
    return (
        f"{holder.node_id}'s host {holder.host} does not answer "
        f"(its agent {holder.agent_url}: {exc})"
    )


def _where(job: JobRow, rank: int, holder: RemoteRank) -> str:
    return (
        f"rank {rank}'s log is on host {holder.host}, in jobs/{job.id}/logs/rank-{rank}.log "
        f"under trainguard's state directory there: run trainguard logs {job.id} --rank "
        f"{rank} on that host"
    )


def _fail(message: str) -> int:
    print(f"trainguard: {message}", file=sys.stderr)
    return 1
