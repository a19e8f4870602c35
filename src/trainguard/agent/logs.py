"""Where worker output lives, and the tailer that follows it.

Layout under the job's log directory (shared by every agent of the job on one
machine; each global rank belongs to exactly one agent at a time)::

    DIR/attempt-{n}/rank-{R}/stdout.log   what the worker wrote, per attempt
    DIR/attempt-{n}/rank-{R}/stderr.log
    DIR/attempt-{n}/rank-{R}/error.json   torch elastic's error file, if any
    DIR/rank-{R}.log                      every attempt of rank R, appended,
                                          "=== trainguard: attempt {n} ===" first
    DIR/rank-{R}.log.1 .. .{keep}         its rotations, newest first

The agent's console (its stdout) gets every line of its workers as
``[rank{R}]: line``, once (a line torch already prefixed so keeps its one prefix). No
torch import here.

Disk use (``spec.trainguard.logs``: ``maxBytesPerRank`` = C, ``keep`` = K). ``rank-{R}.log``
is rotated by rename before it passes C, K old files kept (:mod:`trainguard.agent.logcap`):
at most C x (K + 1). A worker's ``stdout.log``/``stderr.log`` is a spool
(:mod:`trainguard.agent.spool`): the worker appends, the tailer reads and gives back the
disk space of what it has read once C/8 has piled up; an unread backlog past C/4 (a worker
writing faster than the tailer reads) is skipped but for its newest C/16, and
``rank-{R}.log`` says how many bytes were skipped. Per rank, at most C x (K + 2) at each
look of the tailer; between two looks a worker adds what it writes in 20 ms while it
writes fast (a pass read 64 KiB or more), or in ``interval`` when it starts a flood after
a quiet pass (the tailer looks at once while a worker is ahead of it). A spool the tailer
has finished with is truncated past 1 MiB (all of it is in ``rank-{R}.log``).

Between passes the tailer sleeps on an ``inotify`` watch of the ranks' directories
(:mod:`trainguard.agent.filewatch`): a write wakes it (a pass at once after a quiet spell,
at most one per ``interval`` while a worker keeps writing, with the 20 ms look for a flood
in between only after a busy pass), a rank that exits has its last lines read at once
(:meth:`LogTailer.finish_rank`), and a node whose workers print nothing costs no wake-ups
but one pass a second. Where inotify is missing it polls: a pass every ``interval``, a
look every 20 ms. The agent's ``interval`` is 0.25 s (``AgentTimings.tail_interval``): a
wake-up costs more CPU than matching a block of lines, and a worker that prints a line a
step (100 a second) is read in blocks of ~25 lines, 4 wake-ups a second (as few writes
to the console, and wake-ups of the runner's pump that copies it). Detection does not wait for the
pace: the lines a pass reads carry the time they were written by (the spool's
modification time, :meth:`LogTailer._written_at`), not the time they were read, so a hang
timer or a step's time is as exact as at a pass every 20 ms.

What a pass reads goes out as a block of whole lines: one write to the rank's log, writes
of whole lines up to ``PIPE_BUF`` bytes to the console (:meth:`Console.write_lines`), one
call of ``on_lines`` (the log rules and the progress scan a block with one RE2 search per
pattern and match, :mod:`trainguard.monitor.lines`; no Python runs per line).
"""

from __future__ import annotations

import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final

from trainguard.agent.filewatch import DirWatch
from trainguard.agent.logcap import RotatingFile
from trainguard.agent.spool import Spool
from trainguard.wire.logs import LogLimits

logger = logging.getLogger(__name__)

ATTEMPT_MARKER = "=== trainguard: attempt {attempt} ==="
STREAMS = ("stdout", "stderr")

LinesHook = Callable[[int, str, bytes, float], None]
"""``on_lines(rank, stream, block, t)``: whole worker lines (each ending in a newline),
written by unix time ``t`` (see :meth:`LogTailer._written_at`)."""

_READ_CHUNK = 64 * 1024
_CHECK_EVERY = 4 * _READ_CHUNK  # while reading, how often to look how far the writer is
_WATCH_INTERVAL = 0.02  # between passes, how often to look whether a spool grows fast
_QUIET_PASS = 1.0  # watched by inotify: a pass after this long without a change anyway
_BUSY_BYTES = _READ_CHUNK  # a pass that read this much: look for a flood till the next
SPOOL_KEPT_WHEN_DONE: Final = 1024 * 1024
"""A finished worker's spool file (all of it in rank-{R}.log) is emptied past this size."""


@dataclass(frozen=True)
class LogLayout:
    """Paths of the job's log directory ``root``."""

    root: Path

    def attempt_dir(self, attempt: int) -> Path:
        return self.root / f"attempt-{attempt}"

    def rank_dir(self, attempt: int, rank: int) -> Path:
        return self.attempt_dir(attempt) / f"rank-{rank}"

    def stdout(self, attempt: int, rank: int) -> Path:
        return self.rank_dir(attempt, rank) / "stdout.log"

    def stderr(self, attempt: int, rank: int) -> Path:
        return self.rank_dir(attempt, rank) / "stderr.log"

    def stream(self, attempt: int, rank: int, stream: str) -> Path:
        return self.rank_dir(attempt, rank) / f"{stream}.log"

    def error_file(self, attempt: int, rank: int) -> Path:
        return self.rank_dir(attempt, rank) / "error.json"

    def combined(self, rank: int) -> Path:
        """The human log of ``rank`` across all attempts."""
        return self.root / f"rank-{rank}.log"


class Console:
    """Worker lines prefixed with their rank, each in one write + flush.

    Several agents may share one terminal; whole-line writes keep their lines
    from interleaving mid-line. A broken console (closed pipe: the controller that read
    it died) is dropped without stopping the agent; with a ``fallback`` file, the line
    that broke it and every one after go there instead, for a resumed controller to
    follow (:func:`orphaned_console`).
    """

    def __init__(self, stream: BinaryIO | None = None, fallback: Path | None = None) -> None:
        self._stream = stream if stream is not None else sys.stdout.buffer
        self._fallback = fallback
        self._lock = threading.Lock()
        self._broken = False

    def write_line(self, rank: int, line: bytes) -> None:
        """``[rank{R}]: line``; a line that already starts so (torch.distributed's
        excepthook prefixes each line of a rank's traceback the same way) is left as is."""
        self.write_lines(rank, line + b"\n")

    def write_lines(self, rank: int, block: bytes) -> None:
        """Whole lines of ``rank`` (each ending in a newline), each prefixed as
        :meth:`write_line` does, a few whole lines per write + flush: each write holds at
        most ``PIPE_BUF`` bytes (or one longer line), so that on a shared pipe it cannot
        interleave with another agent's."""
        if not block:
            return
        pieces = _pipe_pieces(_prefixed(b"[rank%d]: " % rank, block))
        with self._lock:
            if not self._broken:
                for index, piece in enumerate(pieces):
                    try:
                        self._stream.write(piece)
                        self._stream.flush()
                    except (OSError, ValueError):
                        self._broken = True
                        pieces = pieces[index:]  # from the piece that broke it on
                        break
                else:
                    return
            if self._fallback is None:
                return
            try:
                with self._fallback.open("ab") as out:
                    out.write(b"".join(pieces))
            except OSError:
                self._fallback = None  # no room, no directory: the echo is lost, not the job


def _prefixed(prefix: bytes, block: bytes) -> bytes:
    """Each line of ``block`` with ``prefix`` in front, unless it starts with it."""
    if prefix not in block:  # the usual case: no line by line
        return prefix + block[:-1].replace(b"\n", b"\n" + prefix) + b"\n"
    lines = block[:-1].split(b"\n")
    return b"".join((line if line.startswith(prefix) else prefix + line) + b"\n" for line in lines)


def _pipe_pieces(shown: bytes) -> list[bytes]:
    """``shown`` (whole lines) cut at line ends into pieces of at most ``PIPE_BUF`` bytes
    (a longer line alone)."""
    if len(shown) <= select.PIPE_BUF:
        return [shown]
    pieces: list[bytes] = []
    start = 0
    while start < len(shown):
        end = shown.rfind(b"\n", start, start + select.PIPE_BUF) + 1
        if end <= start:  # one line longer than PIPE_BUF
            end = shown.find(b"\n", start + select.PIPE_BUF) + 1 or len(shown)
        pieces.append(shown[start:end])
        start = end
    return pieces


def orphaned_console(log_dir: Path, node_id: str) -> Path:
    """Where a node's agent writes its console once nobody reads its pipe."""
    return log_dir / f"console-{node_id}.orphaned.log"


@dataclass
class _Followed:
    """One worker stream being followed."""

    local_rank: int
    rank: int
    stream: str
    spool: Spool
    pending: bytes = b""
    read_at: float = field(default_factory=time.time)  # its last read that gave lines
    done: bool = False
    finishing: bool = False  # its process has exited: read to the end, then stop


class LogTailer:
    """Follows the stdout/stderr files of one attempt's workers on this node.

    Every complete line goes to the rank's combined log, to the console and to
    ``on_lines`` (a block of whole lines at a time). A partial last line is held until
    its newline arrives, or until the worker is known to have exited
    (:meth:`finish_rank`) or the tailer is stopped; :meth:`stop` drains everything
    before it returns. Disk use is bounded by ``limits`` (see the module docstring).
    """

    def __init__(
        self,
        layout: LogLayout,
        attempt: int,
        ranks: Mapping[int, int],
        *,
        interval: float,
        console: Console | None = None,
        on_lines: LinesHook | None = None,
        max_line_bytes: int = 1024 * 1024,
        limits: LogLimits | None = None,
    ) -> None:
        """``ranks`` maps local rank -> global rank; ``interval`` is the poll period (s);
        ``limits``: each rank's cap on disk (None: the defaults)."""
        self._layout = layout
        self._attempt = attempt
        self._ranks = dict(ranks)
        self.interval = interval  # may change while it runs (an armed injection reads faster)
        self._console = console
        self._on_lines = on_lines
        self._max_line = max_line_bytes
        self._limits = limits or LogLimits()
        self._followed = [
            _Followed(local, rank, stream, self._spool(layout.stream(attempt, rank, stream)))
            for local, rank in sorted(self._ranks.items())
            for stream in STREAMS
        ]
        self._combined: dict[int, RotatingFile] = {}
        self._watch: DirWatch | None = None  # None: poll the files' sizes
        self._polling = False  # True: poll, although watched (a file outside the watch)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._woken = threading.Event()  # poked (a rank finished, stop): pass at once
        self._hook_failed = False
        self._read_bytes = 0  # read by the tailer's thread since its last pass began
        self._thread = threading.Thread(
            target=self._run, name=f"trainguard-tail-attempt-{attempt}", daemon=True
        )

    def start(self) -> None:
        """Write the attempt marker to each combined log and start following."""
        self._layout.root.mkdir(parents=True, exist_ok=True)
        marker = ATTEMPT_MARKER.format(attempt=self._attempt).encode() + b"\n"
        for rank in sorted(self._ranks.values()):
            log = RotatingFile(self._layout.combined(rank), self._limits)  # closed by _run
            log.write(marker)
            log.flush()
            self._combined[rank] = log
        self._watch = DirWatch.open({f.spool.path.parent for f in self._followed})
        self._thread.start()

    def finish_rank(self, local_rank: int) -> None:
        """The worker has exited: read its files to the end and flush its partial line."""
        with self._lock:
            for followed in self._followed:
                if followed.local_rank == local_rank:
                    followed.finishing = True
            self._poke()

    def follow(self, local_rank: int, rank: int, paths: Mapping[str, Path]) -> None:
        """Also follow a new process of ``local_rank`` (an in-process restart's replacement)
        whose ``stdout``/``stderr`` files are ``paths``."""
        with self._lock:
            if rank not in self._combined:
                self._combined[rank] = RotatingFile(self._layout.combined(rank), self._limits)
            self._followed += [
                _Followed(local_rank, rank, stream, self._spool(paths[stream]))
                for stream in STREAMS
            ]
            if self._watch is not None and not all(
                self._watch.add(directory) for directory in {p.parent for p in paths.values()}
            ):
                self._polling = True  # poll every file from now on
            self._poke()

    def _poke(self) -> None:
        """Wake the tailer's wait for a change or for its next pass (with ``_lock``
        held)."""
        self._woken.set()
        if self._watch is not None:
            self._watch.poke()

    def relabel(self, ranks: Mapping[int, int]) -> None:
        """The workers' global ranks changed (``ranks``: local -> global; an elastic
        scaling in place): their next lines are labelled, and logged, as the new ones."""
        with self._lock:
            for rank in ranks.values():
                if rank not in self._combined:
                    self._combined[rank] = RotatingFile(self._layout.combined(rank), self._limits)
            for followed in self._followed:
                followed.rank = ranks.get(followed.local_rank, followed.rank)

    def _spool(self, path: Path) -> Spool:
        cap = self._limits.max_bytes_per_rank
        return Spool(path, trim=max(_READ_CHUNK, cap // 8), max_unread=cap // 4, tail=cap // 16)

    def stop(self, timeout: float) -> bool:
        """Drain every file and stop; False if the drain did not end within ``timeout``."""
        self._stop.set()
        with self._lock:
            self._poke()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                final = self._stop.is_set()
                self._woken.clear()  # a poke from now on is for the next pass
                self._read_bytes = 0
                behind = self._pass(final)
                if final:
                    return
                # A worker that writes faster than one pass reads: look again at once.
                self._idle(0 if behind else self.interval, self._read_bytes >= _BUSY_BYTES)
        except Exception:
            logger.exception("log tailer for attempt %d failed", self._attempt)
        finally:
            for followed in self._followed:
                followed.spool.close()
            for log in self._combined.values():
                log.close()
            with self._lock:
                if self._watch is not None:
                    self._watch.close()
                    self._watch = None

    def _idle(self, seconds: float, busy: bool) -> None:
        """Wait for the next pass. Watched (inotify): until a worker writes, or a rank
        finishes, or :data:`_QUIET_PASS` passes; no sooner than ``seconds`` after the last
        pass unless a worker floods. Else polling: ``seconds``, or less (a flood).
        ``busy``: the last pass read :data:`_BUSY_BYTES` or more (look for a flood)."""
        if seconds <= 0:
            return
        deadline = time.monotonic() + seconds
        with self._lock:
            watch = None if self._polling else self._watch
        if watch is not None:
            changed, poked = watch.wait(_QUIET_PASS)
            if poked or not changed:
                return
        self._pace(deadline, busy or watch is None)

    def _pace(self, deadline: float, flood_watch: bool) -> None:
        """Wait until ``deadline``, or less: until poked (a rank finished: its last lines
        are read at once; stopped), or (``flood_watch``) until a worker has written a lot
        since (a flood starts between two passes: its spool
        stays small). Without ``flood_watch`` (the workers wrote little lately) one
        sleep: a worker's first burst waits for the next pass, the skip bounds it."""
        if not flood_watch:
            self._woken.wait(max(0.0, deadline - time.monotonic()))
            return
        while (left := deadline - time.monotonic()) > 0:
            if self._woken.wait(min(left, _WATCH_INTERVAL)):
                return
            if self._flooding():
                return

    def _flooding(self) -> bool:
        with self._lock:
            spools = [f.spool for f in self._followed if not f.done]
        return any(s.file is not None and s.unread() > self._max_line for s in spools)

    def _pass(self, final: bool) -> bool:
        """Read every file once; True when one of them has more to read already."""
        behind = False
        with self._lock:
            followed_now = [(f, f.finishing) for f in self._followed]
        for followed, finishing in followed_now:
            if followed.done:
                continue
            if final or finishing:
                self._read(followed, None)
                if followed.pending:
                    self._emit(followed, followed.pending + b"\n")
                    followed.pending = b""
                followed.done = True
                followed.spool.finish(SPOOL_KEPT_WHEN_DONE)  # all of it is in rank-{R}.log
                continue
            behind = self._read(followed, self._max_line * 4) or behind
            followed.spool.release()
        with self._lock:
            logs = list(self._combined.values())
        for log in logs:
            log.flush()
        return behind

    def _read(self, followed: _Followed, budget: int | None) -> bool:
        """Read about ``budget`` bytes (None: to the end of the file) and emit their lines;
        True when it stopped before the end (the budget is spent, or the writer is so far
        ahead that most of its backlog was skipped; to the end, it goes on after a skip)."""
        spool = followed.spool
        if not spool.open():
            return False
        read = 0
        while budget is None or read < budget:
            chunk = spool.read(_READ_CHUNK)
            if not chunk:
                return False
            read += len(chunk)
            self._feed(followed, chunk)
            checking = read % _CHECK_EVERY < len(chunk)  # now and then
            if checking and spool.unread() > spool.max_unread:
                self._skip(followed)
                if budget is not None:
                    return True
        return True

    def _feed(self, followed: _Followed, chunk: bytes) -> None:
        """Emit the complete lines of ``chunk`` (after what is pending); keep the rest."""
        self._read_bytes += len(chunk)
        data = followed.pending + chunk
        cut = data.rfind(b"\n") + 1
        block, followed.pending = data[:cut], data[cut:]
        if len(followed.pending) > self._max_line:  # no newline in sight: cut it
            block += followed.pending + b"\n"
            followed.pending = b""
        self._emit(followed, block)

    def _skip(self, followed: _Followed) -> None:
        """The writer is too far ahead: skip its backlog but the newest part, and say so."""
        skipped, kept = followed.spool.skip()
        if skipped:
            if followed.pending:  # its end is among the skipped bytes
                self._emit(followed, followed.pending + b"\n")
                followed.pending = b""
            self._note(followed, skipped)
        if kept:
            self._feed(followed, kept)

    def _note(self, followed: _Followed, dropped: int) -> None:
        """Say in the rank's log (and the console) that ``dropped`` bytes were not kept."""
        line = (
            f"[trainguard] {dropped} bytes of rank {followed.rank}'s {followed.stream} not "
            "kept: written faster than the agent reads (spec.trainguard.logs.maxBytesPerRank)"
        ).encode()
        self._combined[followed.rank].write(line + b"\n")
        if self._console is not None:
            self._console.write_line(followed.rank, line)

    def _emit(self, followed: _Followed, block: bytes) -> None:
        """Whole lines (each ending in a newline): one write to the rank's log, whole-line
        writes to the console, one call of ``on_lines``."""
        if not block:
            return
        t = self._written_at(followed)
        self._combined[followed.rank].write(block)
        if self._console is not None:
            self._console.write_lines(followed.rank, block)
        if self._on_lines is None:
            return
        try:
            self._on_lines(followed.rank, followed.stream, block, t)
        except Exception:
            if not self._hook_failed:
                logger.exception("on_lines hook failed (further failures not logged)")
            self._hook_failed = True

    @staticmethod
    def _written_at(followed: _Followed) -> float:
        """When the lines read now were written, at the latest: the spool's modification
        time (its newest write, or the tailer's own hole punch or truncation in its
        previous pass, whichever came later), no earlier than the stream's previous read
        and no later than now (a network filesystem's clock that is not this machine's
        moves it by at most a pass). So the pace of the passes does not delay the time a
        rule or the progress sees."""
        now = time.time()
        file = followed.spool.file
        try:
            written = now if file is None else os.fstat(file.fileno()).st_mtime
        except OSError:
            written = now
        t = min(now, max(written, followed.read_at))
        followed.read_at = now
        return t
