"""The platform's book of what it saw of every node: the newest status and contact facts.

Polls, pushes and failed requests all write here, from their own threads; the drive loop
reads a consistent copy (:meth:`ReportBook.reports`) whenever it looks, and sleeps in
:meth:`ReportBook.wait` until a push (or a finished poll cycle) wakes it.

- A node is **reset** when the platform launches an agent for it, with that agent's
  incarnation: a status of any other incarnation (a replaced agent, still talking) is
  dropped. The newest status wins by the agent's ``seq``, so a slow poll can never
  replace a newer push.
- Every answer resets the node's failed-contact count; every poll or request that got
  none adds one, and notes how long the node has been silent since its last answer.
  What those mean is the controller's call (:mod:`trainguard.control.contact`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum

from trainguard.control.reports import NodeReport
from trainguard.wire.status import NodeStatus

__all__ = ["ReportBook", "Taken"]


class Taken(StrEnum):
    """What became of a status offered to the book."""

    TAKEN = "taken"
    STALE = "stale"  # the node's agent, but older than what is known: dropped
    FOREIGN = "foreign"  # not the current agent of a node of this job: dropped


@dataclass
class _Entry:
    report: NodeReport
    incarnation: str
    url: str | None = None
    answered_at: float = field(default_factory=time.monotonic)  # or reset, if never


class ReportBook:
    """See the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._wake = threading.Event()

    # -- the platform's side -----------------------------------------------------------

    def reset(self, node_id: str, incarnation: str, launched_at: float | None = None) -> None:
        """A new agent was launched for ``node_id``: nothing is known of it yet
        (``launched_at``: when, for one launched after its attempt's launch)."""
        with self._lock:
            report = NodeReport(node_id, launched_at=launched_at)
            self._entries[node_id] = _Entry(report, incarnation)

    def awaiting_host(self, node_id: str, since: float) -> None:
        """No host can run ``node_id`` yet; the platform waits for one since ``since``."""
        with self._lock:
            entry = self._entries.get(node_id)
            if entry is not None and entry.report.awaiting_host is None:
                entry.report = replace(entry.report, awaiting_host=since)

    def forget(self, node_id: str) -> None:
        with self._lock:
            self._entries.pop(node_id, None)

    def located(self, node_id: str, url: str, host: str | None = None) -> None:
        """The node's agent serves at ``url`` (on ``host``)."""
        with self._lock:
            entry = self._entries.get(node_id)
            if entry is not None:
                entry.url = url
                if host:
                    entry.report = replace(entry.report, host=host)

    def gone(self, node_id: str, why: str) -> None:
        """The platform knows the node's agent is gone (process exited, pod deleted)."""
        with self._lock:
            entry = self._entries.get(node_id)
            if entry is not None and entry.report.gone is None:
                entry.report = replace(entry.report, gone=why)
                self._wake.set()

    def answered(self, status: NodeStatus, *, push: bool = False) -> Taken:
        """A status from a poll or a push; dropped when it is not from the node's current
        agent, or older than what is known. A push that is taken wakes the loop."""
        with self._lock:
            entry = self._entries.get(status.node_id)
            if entry is None or status.incarnation != entry.incarnation:
                return Taken.FOREIGN
            known = entry.report.status
            if known is not None and status.seq < known.seq:
                return Taken.STALE
            entry.report = replace(
                entry.report, status=status, failed_contacts=0, error=None, silent_for=0.0
            )
            entry.answered_at = time.monotonic()
            if push:
                self._wake.set()
            return Taken.TAKEN

    def failed(self, node_id: str, error: str) -> None:
        """A poll or a request to the node got no answer."""
        with self._lock:
            entry = self._entries.get(node_id)
            if entry is not None:
                count = entry.report.failed_contacts + 1
                silent = time.monotonic() - entry.answered_at
                entry.report = replace(
                    entry.report, failed_contacts=count, error=error, silent_for=silent
                )

    # -- readers -----------------------------------------------------------------------

    def url(self, node_id: str) -> str | None:
        with self._lock:
            entry = self._entries.get(node_id)
            return entry.url if entry is not None else None

    def urls(self) -> dict[str, str]:
        """Every located node's agent URL."""
        with self._lock:
            return {n: e.url for n, e in self._entries.items() if e.url is not None}

    def reports(self) -> dict[str, NodeReport]:
        """What is known of every node now (the reports are immutable values)."""
        with self._lock:
            return {n: e.report for n, e in self._entries.items()}

    # -- the loop's pace ---------------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def wait(self, timeout: float) -> bool:
        """Until something worth looking at arrived (True), or ``timeout`` seconds."""
        woken = self._wake.wait(timeout)
        self._wake.clear()
        return woken
