"""Where a job's durable checkpoints stand: the newest durable step against the newest
step its schedule asked to persist, from the job's events.

``describe`` (text and ``-o json``'s ``checkpoints``), ``trainguard report`` and the end of
``trainguard run`` show it, so a job whose newest asked-for step never reached the
durable tier does not look clean: ``step 100 (the schedule asked for 400: not durable)``.

Pure: it reads events (the controller's ``CheckpointPersisting``, ``CheckpointCommitted``,
``CheckpointPersistFailed`` and ``CheckpointNotDurable``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from trainguard.control.events import Event, EventKind

__all__ = ["DurableState", "durable_state"]


@dataclass(frozen=True)
class DurableState:
    """``durable_step``: the newest step committed to the durable tier (None: none);
    ``asked_step``: the newest step the schedule asked to persist (None: none asked);
    ``failures``: persists that failed (each was asked for again or superseded)."""

    durable_step: int | None
    asked_step: int | None
    failures: int
    # A step newer than the newest durable one failed, or the job ended without it.
    lost: bool = False

    @property
    def pending(self) -> bool:
        """The newest asked-for step is not durable (yet, or for good: see ``missing``)."""
        if self.asked_step is None:
            return False
        return self.durable_step is None or self.durable_step < self.asked_step

    @property
    def missing(self) -> bool:
        """The newest asked-for step is not durable, and is not merely on its way: a
        newer step than the newest durable one failed, or the job ended without it."""
        return self.pending and self.lost

    def line(self) -> str:
        """``step 100 (the schedule asked for 400: not durable)``, ``step 400``, or
        ``step 380 (step 400 being persisted)``."""
        if self.durable_step is None and self.asked_step is None:
            return "-"
        shown = "none" if self.durable_step is None else f"step {self.durable_step}"
        if self.missing:
            shown += f" (the schedule asked for {self.asked_step}: not durable)"
        elif self.pending:
            shown += f" (step {self.asked_step} being persisted)"
        if self.failures:
            shown += f"; {self.failures} failed persist{'s' if self.failures > 1 else ''}"
        return shown

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DurableState:
        """The state :meth:`to_json` gave (``describe -o json``'s ``checkpoints``)."""
        return cls(
            data["durable_step"], data["asked_step"], data["failed_persists"], data["missing"]
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "durable_step": self.durable_step,
            "asked_step": self.asked_step,
            "missing": self.missing,
            "failed_persists": self.failures,
        }


def durable_state(events: Iterable[Event]) -> DurableState:
    """The job's durable checkpoints as its events tell them."""
    durable: int | None = None
    asked: int | None = None
    failed: list[int] = []
    ended_short = False
    for e in events:
        step = e.data.get("step")
        if not isinstance(step, int):
            continue
        if e.kind == EventKind.CHECKPOINT_COMMITTED and e.data.get("tier", "durable") == "durable":
            durable = step if durable is None else max(durable, step)
        elif e.kind in (EventKind.CHECKPOINT_PERSISTING, EventKind.CHECKPOINT_NOT_DURABLE):
            asked = step if asked is None else max(asked, step)
            ended_short |= e.kind == EventKind.CHECKPOINT_NOT_DURABLE
        elif e.kind == EventKind.CHECKPOINT_PERSIST_FAILED:
            failed.append(step)
    lost = ended_short or any(durable is None or s > durable for s in failed)
    return DurableState(durable, asked, len(failed), lost)
