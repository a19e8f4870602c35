"""What a client that shows no token can cost a trainguard server: bounded.

Every port trainguard opens answers the network before it knows who is calling, so each
server bounds what an unauthenticated peer can hold (issue 38):

- **Connections**, per peer address and in total (:class:`ConnLimits`,
  :class:`ConnTable`). The total follows the process's file-descriptor limit (a quarter
  of ``RLIMIT_NOFILE``), so a flood of idle connections never takes the descriptors the
  job's own work needs. A full table closes its oldest idle connection for a new one
  (the job's clients reconnect); a peer at its own cap is refused.
- **Time to send a request head** (``head_seconds``): a connection that sends nothing, or
  a head byte by byte (slowloris), is closed.
- **Log volume.** Junk from the network is one line at most every
  :data:`NOTE_INTERVAL` seconds per kind of junk (:class:`QuietLog`,
  :func:`quiet_loggers`), never a traceback; the loggers of aiohttp and asyncio, which
  print one per bad request or refused accept, are tamed the same way.

Running out of descriptors anyway (another process's doing) is survived: asyncio and the
agent's server pause accepting for a moment and go on.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import resource
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

__all__ = [
    "LOOPBACK",
    "NOTE_INTERVAL",
    "ConnLimits",
    "ConnTable",
    "QuietLog",
    "conn_limits",
    "is_loopback",
    "quiet_loggers",
    "raise_nofile",
]

NOTE_INTERVAL = 10.0  # s between two log lines about the same kind of junk
LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
"""This host's own clients (agents push to the controller's inbox from 127.0.0.1)."""
NOISY_LOGGERS = ("aiohttp.server", "aiohttp.access", "aiohttp.web", "aiohttp.internal", "asyncio")


@dataclass(frozen=True)
class ConnLimits:
    """Bounds of one server's connections (see the module doc)."""

    per_peer: int = 64
    """Connections one address may hold; 127.0.0.1 and ::1 count against ``total`` only
    (the job's own agents on the controller's host, up to 64)."""
    total: int = 256
    head_seconds: float = 10.0
    """A connection's first request head, and each next one after a reply, must arrive
    within this."""

    def __post_init__(self) -> None:
        if self.per_peer < 1 or self.total < 1 or self.head_seconds <= 0:
            raise ValueError("ConnLimits: expected positive bounds")


def conn_limits(per_peer: int = 64, total: int = 256, head_seconds: float = 10.0) -> ConnLimits:
    """:class:`ConnLimits` whose total fits this process's descriptors: at most a quarter
    of the soft ``RLIMIT_NOFILE`` (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        total = max(16, min(total, soft // 4))
    return ConnLimits(min(per_peer, total), total, head_seconds)


def raise_nofile() -> None:
    """Lift the soft descriptor limit to the hard one (what a process may do unasked):
    more room before a burst of connections could starve the job."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class ConnTable:
    """The open connections of one server, keyed by any hashable (a transport, a
    socket), with their peer and whether a request is being served. Thread-safe.

    :meth:`admit` says whether a new connection may stay, and which older one to close
    for it (the table being full): the oldest that is not serving a request."""

    def __init__(self, limits: ConnLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._conns: dict[Hashable, tuple[str, float]] = {}  # key -> peer, since
        self._busy: set[Hashable] = set()
        self._per_peer: dict[str, int] = {}

    def admit(self, key: Hashable, peer: str) -> tuple[bool, Hashable | None]:
        """(whether ``key`` is admitted, a connection to close for it or None)."""
        with self._lock:
            counted = peer not in LOOPBACK
            if counted and self._per_peer.get(peer, 0) >= self.limits.per_peer:
                return False, None
            evict: Hashable | None = None
            if len(self._conns) >= self.limits.total:
                idle = [k for k in self._conns if k not in self._busy]
                if not idle:
                    return False, None
                evict = min(idle, key=lambda k: self._conns[k][1])
                self._drop(evict)
            self._conns[key] = (peer, time.monotonic())
            if counted:
                self._per_peer[peer] = self._per_peer.get(peer, 0) + 1
            return True, evict

    def busy(self, key: Hashable, serving: bool) -> None:
        """``key`` started (True) or finished (False) serving a request."""
        with self._lock:
            if key not in self._conns:
                return
            if serving:
                self._busy.add(key)
            else:
                self._busy.discard(key)
                peer, _ = self._conns[key]
                self._conns[key] = (peer, time.monotonic())  # idle from now

    def release(self, key: Hashable) -> None:
        with self._lock:
            self._drop(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._conns)

    def _drop(self, key: Hashable) -> None:
        entry = self._conns.pop(key, None)
        self._busy.discard(key)
        if entry is not None and entry[0] not in LOOPBACK:
            left = self._per_peer.get(entry[0], 1) - 1
            if left > 0:
                self._per_peer[entry[0]] = left
            else:
                self._per_peer.pop(entry[0], None)


class QuietLog:
    """One log line per kind of event every ``interval`` seconds, saying how many of
    that kind went unsaid since. Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        interval: float = NOTE_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # kind -> when said, unsaid since

    def note(self, kind: str, message: str, level: int = logging.WARNING) -> bool:
        """Log ``message`` unless ``kind`` was logged within the interval; whether it was."""
        now = self._clock()
        with self._lock:
            said, unsaid = self._last.get(kind, (-float("inf"), 0))
            if now - said < self._interval:
                self._last[kind] = (said, unsaid + 1)
                return False
            self._last[kind] = (now, 0)
            if len(self._last) > 1024:  # kinds are ours, but keep the table small anyway
                self._last = {kind: (now, 0)}
        more = f" ({unsaid} more like it since)" if unsaid else ""
        self._logger.log(level, "%s%s", " ".join(message.split())[:300], more)
        return True


class _OneLine(logging.Filter):
    """A log record from a noisy library, made one line (no traceback) and rate-limited
    by its message's first words."""

    def __init__(self) -> None:
        super().__init__()
        self._quiet = QuietLog(logging.getLogger("trainguard.net"))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text = f"{text}: {type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
        self._quiet.note(f"{record.name}:{text[:40]}", f"{record.name}: {text}", record.levelno)
        return False  # said through the quiet log, or not at all


_tamed = threading.Lock()
_TAMED: list[str] = []


def quiet_loggers() -> None:
    """Make aiohttp's and asyncio's loggers one rate-limited line per kind of error, never
    a traceback (a bad request from the network printed one each). Idempotent."""
    with _tamed:
        for name in NOISY_LOGGERS:
            if name in _TAMED:
                continue
            logging.getLogger(name).addFilter(_OneLine())
            _TAMED.append(name)
