"""A thread that notices a newer attempt in ``attempt.json`` and aborts the current one."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from trainguard.resilient.protocol import ProtocolError, read_attempt

__all__ = ["AttemptWatcher"]

log = logging.getLogger(__name__)


class AttemptWatcher:
    """Polls ``attempt.json``; once a newer attempt than the armed one appears, calls
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

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._cond.wait_for(lambda: self._stopped, timeout=self._poll):
                    return
            try:
                current = read_attempt(self._control_dir)
            except (OSError, ProtocolError) as exc:
                log.warning("ignoring unreadable attempt file: %s", exc)
                continue
            if current is None:
                continue
            with self._cond:
                self._latest = max(self._latest, current.attempt)
                armed, fire = self._armed, self._armed is not None and self._latest > self._armed
                if fire:
                    self._armed = None
            if fire and armed is not None:
                self._on_newer(armed)
