"""Watching the kernel log for XID and NVRM lines (`KernelLogMonitor`).

Where the lines come from is pluggable (`KernelLogSource`):

- `KmsgSource`: ``/dev/kmsg``, read without blocking, only records logged after it was
  opened (it starts at the end). Reading it needs root or CAP_SYSLOG where
  ``kernel.dmesg_restrict`` is 1; where it cannot be opened there is no source.
- `FileSource`: a plain file read like ``tail -f`` (from its end when the source is
  made; a file that appears later, shrinks or is replaced is read from its start). Its
  path comes from ``$TRAINGUARD_KERNEL_LOG`` (`KERNEL_LOG_ENV`): the hook rehearsals and
  tests write kernel-log-style lines to; trainguard never writes to the real kernel log.

`default_sources` gives both where available. An event is reported once per monitor: a
GPU that logs the same XID a hundred times gives one finding (a log line does not
"clear"; the node is remedied by the finding anyway).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Final, Protocol

from trainguard.health.result import Evidence, Finding
from trainguard.health.xid import DriverEvent, parse_line

__all__ = [
    "KERNEL_LOG_ENV",
    "FileSource",
    "KernelLogMonitor",
    "KernelLogSource",
    "KmsgSource",
    "default_sources",
    "kmsg_message",
]

KERNEL_LOG_ENV: Final = "TRAINGUARD_KERNEL_LOG"
KMSG: Final = "/dev/kmsg"
_MAX_READ: Final = 1024 * 1024
"""Bytes a file source reads per poll (the rest waits for the next)."""
_MAX_RECORDS: Final = 10_000
"""Records ``/dev/kmsg`` gives per poll (the rest waits for the next)."""
_MAX_PARTIAL: Final = 64 * 1024
_MAX_KEYS: Final = 4096


class KernelLogSource(Protocol):
    """Kernel log lines, as they come."""

    @property
    def name(self) -> str: ...

    def read_lines(self) -> list[str]:
        """The complete lines logged since the last call; never blocks."""
        ...

    def close(self) -> None: ...


def kmsg_message(record: bytes) -> str:
    """The message of one ``/dev/kmsg`` record (``6,339,5140900,-;text\\n KEY=value``)."""
    text = record.decode("utf-8", errors="replace")
    _, _, message = text.partition(";")
    return message.split("\n", 1)[0]


class KmsgSource:
    """``/dev/kmsg`` from the moment it is opened; raises ``OSError`` where it cannot be."""

    def __init__(self, path: str = KMSG) -> None:
        self.name = path
        self._fd: int | None = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        os.lseek(self._fd, 0, os.SEEK_END)

    def read_lines(self) -> list[str]:
        if self._fd is None:
            return []
        lines: list[str] = []
        for _ in range(_MAX_RECORDS):
            try:
                record = os.read(self._fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue  # records were overwritten before we read them; go on after them
            if not record:
                break
            lines.append(kmsg_message(record))
        return lines

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FileSource:
    """A file read like ``tail -f``: what is appended after the source is made (or the
    whole file, when it appears later, shrinks or is replaced).

    A file truncated and rewritten past the old length between two reads is not noticed
    (its inode and size look like an append); the rehearsal hook only appends.
    """

    def __init__(self, path: str) -> None:
        self.name = path
        self._offset = 0
        self._inode: int | None = None
        self._partial = b""
        with contextlib.suppress(OSError):
            stat = os.stat(path)
            self._offset, self._inode = stat.st_size, stat.st_ino

    def read_lines(self) -> list[str]:
        try:
            stat = os.stat(self.name)
        except OSError:
            self._offset, self._inode, self._partial = 0, None, b""
            return []
        if stat.st_ino != self._inode or stat.st_size < self._offset:
            self._offset, self._inode, self._partial = 0, stat.st_ino, b""
        if stat.st_size == self._offset:
            return []
        try:
            with open(self.name, "rb") as file:
                file.seek(self._offset)
                data = file.read(_MAX_READ)
        except OSError:
            return []
        self._offset += len(data)
        *complete, partial = (self._partial + data).split(b"\n")
        self._partial = partial[-_MAX_PARTIAL:]
        return [line.decode("utf-8", errors="replace") for line in complete]

    def close(self) -> None:
        pass


def default_sources(
    env: Mapping[str, str] | None = None, kmsg: bool = True
) -> list[KernelLogSource]:
    """``$TRAINGUARD_KERNEL_LOG`` (when set) and, with ``kmsg``, ``/dev/kmsg`` (when it
    can be read)."""
    env = os.environ if env is None else env
    sources: list[KernelLogSource] = []
    if env.get(KERNEL_LOG_ENV):
        sources.append(FileSource(env[KERNEL_LOG_ENV]))
    if kmsg:
        with contextlib.suppress(OSError):
            sources.append(KmsgSource())
    return sources


class KernelLogMonitor:
    """XID and NVRM findings from its sources' new lines, each distinct event once.

    Application XIDs (see `trainguard.health.xid`) give no finding; they are counted in
    ``application_xids``.
    """

    name = "kernel-log"

    def __init__(self, sources: Sequence[KernelLogSource], interval: float = 1.0) -> None:
        self.sources = list(sources)
        self.interval = interval
        self.application_xids = 0
        self._seen: set[tuple[str, int | None, str | None, str]] = set()

    def poll(self, now: float) -> list[Finding]:
        findings: list[Finding] = []
        for source in self.sources:
            for line in source.read_lines():
                event = parse_line(line)
                if event is None:
                    continue
                if event.action is None:
                    self.application_xids += 1
                    continue
                if event.key in self._seen:
                    continue
                if len(self._seen) < _MAX_KEYS:
                    self._seen.add(event.key)
                findings.append(_finding(event, source.name, now))
        return findings

    def close(self) -> None:
        for source in self.sources:
            source.close()


def _finding(event: DriverEvent, source: str, now: float) -> Finding:
    assert event.action is not None
    where = f" on GPU {event.pci}" if event.pci else ""
    what = f"XID {event.code}" if event.kind == "XID" else "NVRM"
    evidence: Evidence = {
        "code": event.code,
        "pci": event.pci,
        "pid": event.pid,
        "line": event.line,
        "source": source,
    }
    message = f"{what}{where}: {event.description} ({event.action})"
    return Finding(event.kind, event.action, message, evidence, now)
