"""The files through which a node agent steers the resilient workers of its node.

Everything lives in ``$TRAINGUARD_CONTROL_DIR`` (one directory per node that outlives
in-process attempts). Every file is JSON and written atomically (a temporary file, then
``rename``), so a reader sees the old or the new content, never a partial one.

- ``attempt.json`` (agent -> workers), :class:`Attempt`: the attempt to join. A larger
  ``attempt`` than a worker's current one means "rejoin now": abort the process group
  and join the new one (rank 0 hosts the TCPStore on ``master_port``).
- ``spare-<k>.json`` (agent -> the hot spare started with ``TRAINGUARD_SPARE_ID=<k>``),
  :class:`SpareAssignment`: the identity the spare takes over.
- ``ack-rank-<R>.json`` (worker -> agent), :class:`Ack`: rank R joined ``attempt`` and
  finished its state sync; it resumes at ``step`` with state from ``state_source``.

A worker that cannot join an attempt within its ``barrier_timeout_seconds`` exits with
:data:`EXIT_BARRIER_TIMEOUT`; the agent then falls back to a process-level restart.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, get_args

__all__ = [
    "ATTEMPT_ENV",
    "ATTEMPT_FILE",
    "CONTROL_DIR_ENV",
    "EXIT_BARRIER_TIMEOUT",
    "SPARE_ID_ENV",
    "Ack",
    "Attempt",
    "ProtocolError",
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
_T = TypeVar("_T")


class ProtocolError(ValueError):
    """A control file is malformed (the message names the file and the field)."""


@dataclass(frozen=True)
class Attempt:
    """One attempt of the job: who hosts the rendezvous and how long joining may take."""

    attempt: int
    master_addr: str
    master_port: int
    world_size: int
    barrier_timeout_seconds: float

    def __post_init__(self) -> None:
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.barrier_timeout_seconds <= 0:
            raise ValueError(
                f"barrier_timeout_seconds must be > 0, got {self.barrier_timeout_seconds}"
            )


@dataclass(frozen=True)
class SpareAssignment:
    """The dead rank a hot spare takes over, and the attempt in which it joins."""

    rank: int
    local_rank: int
    attempt: int

    def __post_init__(self) -> None:
        if self.rank < 0 or self.local_rank < 0:
            raise ValueError(f"rank and local_rank must be >= 0, got {self.rank}/{self.local_rank}")


@dataclass(frozen=True)
class Ack:
    """A worker joined ``attempt`` and synced its state; it resumes at ``step``."""

    attempt: int
    pid: int
    step: int
    state_source: StateSource

    def __post_init__(self) -> None:
        if self.state_source not in STATE_SOURCES:
            raise ValueError(
                f"state_source must be one of {sorted(STATE_SOURCES)}, got {self.state_source!r}"
            )


def ack_path(control_dir: str | Path, rank: int) -> Path:
    return Path(control_dir) / f"ack-rank-{rank}.json"


def spare_path(control_dir: str | Path, spare_id: int) -> Path:
    return Path(control_dir) / f"spare-{spare_id}.json"


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` so that readers never see a partial file."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_attempt(control_dir: str | Path, attempt: Attempt) -> None:
    write_json_atomic(Path(control_dir) / ATTEMPT_FILE, asdict(attempt))


def write_spare(control_dir: str | Path, spare_id: int, assignment: SpareAssignment) -> None:
    write_json_atomic(spare_path(control_dir, spare_id), asdict(assignment))


def write_ack(control_dir: str | Path, rank: int, ack: Ack) -> None:
    write_json_atomic(ack_path(control_dir, rank), asdict(ack))


def read_attempt(control_dir: str | Path) -> Attempt | None:
    """The current attempt, or None while the agent has not written one."""
    path = Path(control_dir) / ATTEMPT_FILE
    raw = _read(path)
    if raw is None:
        return None
    return _parse(
        path,
        lambda: Attempt(
            attempt=_int(raw, "attempt"),
            master_addr=_str(raw, "master_addr"),
            master_port=_int(raw, "master_port"),
            world_size=_int(raw, "world_size"),
            barrier_timeout_seconds=_float(raw, "barrier_timeout_seconds"),
        ),
    )


def read_spare(control_dir: str | Path, spare_id: int) -> SpareAssignment | None:
    """Spare ``spare_id``'s assignment, or None while it has none."""
    path = spare_path(control_dir, spare_id)
    raw = _read(path)
    if raw is None:
        return None
    return _parse(
        path,
        lambda: SpareAssignment(
            rank=_int(raw, "rank"), local_rank=_int(raw, "local_rank"), attempt=_int(raw, "attempt")
        ),
    )


def read_ack(control_dir: str | Path, rank: int) -> Ack | None:
    """Rank ``rank``'s latest acknowledgement, or None if it has not written one."""
    path = ack_path(control_dir, rank)
    raw = _read(path)
    if raw is None:
        return None
    return _parse(
        path,
        lambda: Ack(
            attempt=_int(raw, "attempt"),
            pid=_int(raw, "pid"),
            step=_int(raw, "step"),
            state_source=_str(raw, "state_source"),  # type: ignore[arg-type]  # checked
        ),
    )


def _read(path: Path) -> dict[str, Any] | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ProtocolError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _parse(path: Path, build: Callable[[], _T]) -> _T:
    try:
        result = build()
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{path}: {exc}") from exc
    return result


def _field(raw: dict[str, Any], name: str) -> Any:
    if name not in raw:
        raise ValueError(f"missing field {name!r}")
    return raw[name]


def _int(raw: dict[str, Any], name: str) -> int:
    value = _field(raw, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"field {name!r} must be an integer, got {value!r}")
    return value


def _float(raw: dict[str, Any], name: str) -> float:
    value = _field(raw, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"field {name!r} must be a number, got {value!r}")
    return float(value)


def _str(raw: dict[str, Any], name: str) -> str:
    value = _field(raw, name)
    if not isinstance(value, str):
        raise TypeError(f"field {name!r} must be a string, got {value!r}")
    return value
