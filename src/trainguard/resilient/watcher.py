"""A thread that notices a newer attempt in ``attempt.json`` and aborts the current one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from trainguard.agent.filewatch import REREAD_SECONDS, DirWatch
from trainguard.resilient.protocol import ProtocolError, read_attempt

__all__ = ["AttemptWatcher"]

log = logging.getLogger(__name__)


class AttemptWatcher:
    """Reads ``attempt.json`` when its directory changes (inotify; every ``poll_interval``
    where inotify is missing); once a newer attempt than the armed one appears, calls
    ``on_newer(armed)`` (once per armed attempt) so that the main thread's collectives fail."""

    def __init__(
        self, control_dir: Path, poll_interval: float, on_newer: Callable[[int], None]
    ) -> None:
        self._control_dir = control_dir
        self._poll = poll_interval
        self._on_newer = on_newer
        self._cond = threading.Condition()
        self._armed: int | None = None
        self._latest = -1
        self._stopped = False
        self._watch = DirWatch.open([control_dir])
        self._thread = threading.Thread(target=self._run, name="trainguard-attempt", daemon=True)
        self._thread.start()

    def arm(self, attempt: int) -> None:
        """The main thread runs ``attempt`` now: abort it when a newer one appears."""
        with self._cond:
            self._armed = attempt

    def disarm(self) -> None:
        with self._cond:
            self._armed = None

    def newer_than(self, attempt: int) -> bool:
        """Whether an attempt newer than ``attempt`` has been seen."""
        with self._cond:
            return self._latest > attempt

    def wait_newer_than(self, attempt: int, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until an attempt newer than ``attempt`` is seen;
        whether one was."""
        with self._cond:
            return self._cond.wait_for(lambda: self._latest > attempt, timeout)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._watch is not None:
            self._watch.poke()
        self._thread.join()
        if self._watch is not None:
            self._watch.close()

    def _run(self) -> None:
        while not self._stopped:
            self._read()
            self._sleep()

    def _sleep(self) -> None:
        if self._watch is not None:  # until a change, stop()'s poke or the reread
            self._watch.wait(REREAD_SECONDS)
            return
        with self._cond:
            self._cond.wait_for(lambda: self._stopped, timeout=self._poll)

    def _read(self) -> None:
        try:
            current = read_attempt(self._control_dir)
        except (OSError, ProtocolError) as exc:
            log.warning("ignoring unreadable attempt file: %s", exc)
            return
        if current is None:
            return
        with self._cond:
            if current.attempt > self._latest:
                self._latest = current.attempt
                self._cond.notify_all()
            armed, fire = self._armed, self._armed is not None and self._latest > self._armed
            if fire:
                self._armed = None
        if fire and armed is not None:
            self._on_newer(armed)
