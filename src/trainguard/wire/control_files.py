"""The files through which a node agent steers the resilient workers of its node.

Everything lives in ``$TRAINGUARD_CONTROL_DIR`` (one directory per node that outlives
in-process attempts). Every file is JSON and written atomically (a temporary file, then
``rename``), so a reader sees the old or the new content, never a partial one.

- ``attempt.json`` (agent -> workers), :class:`ResilientAttempt`: the attempt to join. A larger
  ``attempt`` than a worker's current one means "rejoin now": abort the process group
  and join the new one (rank 0 hosts the TCPStore on ``master_port``), as the rank
  ``ranks`` gives its local rank (an elastic scaling in place renumbers the ranks).
- ``spare-<k>.json`` (agent -> the hot spare started with ``TRAINGUARD_SPARE_ID=<k>``),
  :class:`SpareAssignment`: the identity the spare takes over.
- ``ack-rank-<R>.json`` (worker -> agent), :class:`Ack`: rank R joined ``attempt`` and
  finished its state sync; it resumes at ``step`` with state from ``state_source``.

A worker that cannot join an attempt within its ``barrier_timeout_seconds`` exits with
:data:`EXIT_BARRIER_TIMEOUT`, and so does a rank 0 that cannot bind ``master_port`` for
the store (at once: no rank could join); the controller then falls back to a
process-level restart. An attempt in place whose rank 0 keeps its process keeps the
previous attempt's ``master_port``: that process serves the store already.
No torch here: the agent and light test workers read these files too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, get_args

from pydantic import Field

from trainguard.atomic import write_text_atomic
from trainguard.wire.base import Wire, WireError, parse_json

__all__ = [
    "ATTEMPT_ENV",
    "ATTEMPT_FILE",
    "CONTROL_DIR_ENV",
    "EXIT_BARRIER_TIMEOUT",
    "SPARE_ID_ENV",
    "STATE_SOURCES",
    "Ack",
    "ProtocolError",
    "ResilientAttempt",
    "SpareAssignment",
    "StateSource",
    "ack_path",
    "read_ack",
    "read_attempt",
    "read_spare",
    "spare_path",
    "write_ack",
    "write_attempt",
    "write_json_atomic",
    "write_spare",
]

CONTROL_DIR_ENV: Final = "TRAINGUARD_CONTROL_DIR"
SPARE_ID_ENV: Final = "TRAINGUARD_SPARE_ID"
ATTEMPT_ENV: Final = "TRAINGUARD_ATTEMPT"
ATTEMPT_FILE: Final = "attempt.json"

EXIT_BARRIER_TIMEOUT: Final = 75
"""Exit code of a worker that did not join an attempt in time (EX_TEMPFAIL)."""

StateSource = Literal["self", "peer", "checkpoint", "none"]
STATE_SOURCES: Final = frozenset(get_args(StateSource))
_F = TypeVar("_F", bound=Wire)


class ProtocolError(ValueError):
    """A control file is malformed (the message names the file and the field)."""


class ResilientAttempt(Wire):
    """One attempt of the job: who hosts the rendezvous and how long joining may take."""

    attempt: int = Field(ge=0)
    master_addr: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=1)
    barrier_timeout_seconds: float = Field(gt=0, allow_inf_nan=False)
    ranks: tuple[int, ...] = ()
    """This node's global ranks by local rank in this attempt (empty: as they were)."""


class SpareAssignment(Wire):
    """The dead rank a hot spare takes over, and the attempt in which it joins."""

    rank: int = Field(ge=0)
    local_rank: int = Field(ge=0)
    attempt: int = Field(ge=0)


class Ack(Wire):
    """A worker joined ``attempt`` and synced its state; it resumes at ``step``."""

    attempt: int = Field(ge=0)
    pid: int
    step: int = Field(ge=0)
    state_source: StateSource


def ack_path(control_dir: str | Path, rank: int) -> Path:
    return Path(control_dir) / f"ack-rank-{rank}.json"


def spare_path(control_dir: str | Path, spare_id: int) -> Path:
    return Path(control_dir) / f"spare-{spare_id}.json"


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` so that readers never see a partial file."""
    write_text_atomic(path, json.dumps(data))


def write_attempt(control_dir: str | Path, attempt: ResilientAttempt) -> None:
    write_json_atomic(Path(control_dir) / ATTEMPT_FILE, attempt.to_json())


def write_spare(control_dir: str | Path, spare_id: int, assignment: SpareAssignment) -> None:
    write_json_atomic(spare_path(control_dir, spare_id), assignment.to_json())


def write_ack(control_dir: str | Path, rank: int, ack: Ack) -> None:
    write_json_atomic(ack_path(control_dir, rank), ack.to_json())


def read_attempt(control_dir: str | Path) -> ResilientAttempt | None:
    """The current attempt, or None while the agent has not written one."""
    return _read(Path(control_dir) / ATTEMPT_FILE, ResilientAttempt)


def read_spare(control_dir: str | Path, spare_id: int) -> SpareAssignment | None:
    """Spare ``spare_id``'s assignment, or None while it has none."""
    return _read(spare_path(control_dir, spare_id), SpareAssignment)


def read_ack(control_dir: str | Path, rank: int) -> Ack | None:
    """Rank ``rank``'s latest acknowledgement, or None if it has not written one."""
    return _read(ack_path(control_dir, rank), Ack)


def _read(path: Path, model: type[_F]) -> _F | None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return parse_json(model, raw, "")
    except WireError as exc:
        raise ProtocolError(f"{path}: {exc}") from None
