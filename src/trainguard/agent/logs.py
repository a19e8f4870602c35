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
in between only after a busy pass), and a node whose workers print nothing costs no
wake-ups but one pass a second. Where inotify is missing it polls: a pass every
``interval``, a look every 20 ms.

A chunk's complete lines go to the rank's log in one write and to the console in writes
of whole lines up to ``PIPE_BUF`` bytes (:meth:`Console.write_lines`), then one by one to
``on_line``.
"""

from __future__ import annotations

import logging
import select
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

from trainguard.agent.filewatch import DirWatch
from trainguard.agent.logcap import RotatingFile
from trainguard.agent.spool import Spool
from trainguard.wire.logs import LogLimits

logger = logging.getLogger(__name__)

ATTEMPT_MARKER = "=== trainguard: attempt {attempt} ==="
STREAMS = ("stdout", "stderr")

LineHook = Callable[[int, str, str, float], None]
"""``on_line(rank, stream, line, t)``: a worker line (no newline), read at unix time ``t``."""

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
        self.write_lines(rank, (line,))

    def write_lines(self, rank: int, lines: Sequence[bytes]) -> None:
        """Several lines of ``rank``, each prefixed as :meth:`write_line` does, a few
        whole lines per write + flush: each write holds at most ``PIPE_BUF`` bytes (or one
        longer line), so that on a shared pipe it cannot interleave with another agent's."""
        if not lines:
            return
        prefix = b"[rank%d]: " % rank
        shown = [(line if line.startswith(prefix) else prefix + line) + b"\n" for line in lines]
        pieces: list[bytes] = []
        start, size = 0, 0
        for end, line in enumerate(shown):
            if size and size + len(line) > select.PIPE_BUF:
                pieces.append(b"".join(shown[start:end]))
                start, size = end, 0
            size += len(line)
        pieces.append(b"".join(shown[start:]))
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
    done: bool = False
    finishing: bool = False  # its process has exited: read to the end, then stop


class LogTailer:
    """Follows the stdout/stderr files of one attempt's workers on this node.

    Every complete line goes to the rank's combined log, to the console and to
    ``on_line``. A partial last line is held until its newline arrives, or until
    the worker is known to have exited (:meth:`finish_rank`) or the tailer is
    stopped; :meth:`stop` drains everything before it returns. Disk use is bounded by
    ``limits`` (see the module docstring).
    """

    def __init__(
        self,
        layout: LogLayout,
        attempt: int,
        ranks: Mapping[int, int],
        *,
        interval: float,
        console: Console | None = None,
        on_line: LineHook | None = None,
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
        self._on_line = on_line
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
        """Wake the tailer's wait for a change (with ``_lock`` held)."""
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
        """Wait until ``deadline``, or less: until stopped, or (``flood_watch``) until a
        worker has written a lot since (a flood starts between two passes: its spool
        stays small). Without ``flood_watch`` (the workers wrote little lately) one
        sleep: a worker's first burst waits for the next pass, the skip bounds it."""
        if not flood_watch:
            self._stop.wait(max(0.0, deadline - time.monotonic()))
            return
        while (left := deadline - time.monotonic()) > 0:
            if self._stop.wait(min(left, _WATCH_INTERVAL)):
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
                    self._emit(followed, followed.pending)
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
        *lines, followed.pending = (followed.pending + chunk).split(b"\n")
        if len(followed.pending) > self._max_line:  # no newline in sight: cut it
            lines.append(followed.pending)
            followed.pending = b""
        self._emit_lines(followed, lines)

    def _skip(self, followed: _Followed) -> None:
        """The writer is too far ahead: skip its backlog but the newest part, and say so."""
        skipped, kept = followed.spool.skip()
        if skipped:
            if followed.pending:  # its end is among the skipped bytes
                self._emit(followed, followed.pending)
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

    def _emit(self, followed: _Followed, line: bytes) -> None:
        self._emit_lines(followed, [line])

    def _emit_lines(self, followed: _Followed, lines: list[bytes]) -> None:
        """A chunk's complete lines: one write to the rank's log and one to the console
        (not one per line), then each line to ``on_line``."""
        if not lines:
            return
        t = time.time()
        self._combined[followed.rank].write(b"\n".join(lines) + b"\n")
        if self._console is not None:
            self._console.write_lines(followed.rank, lines)
        if self._on_line is None:
            return
        rank, stream, hook = followed.rank, followed.stream, self._on_line
        for line in lines:
            try:
                hook(rank, stream, line.decode(errors="replace"), t)
            except Exception:
                if not self._hook_failed:
                    logger.exception("on_line hook failed (further failures not logged)")
                self._hook_failed = True
