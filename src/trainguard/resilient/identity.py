"""Who this worker is: its rank from torchrun's environment, or a hot spare's assignment."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.agent.filewatch import REREAD_SECONDS, DirWatch
from trainguard.resilient.protocol import (
    ATTEMPT_ENV,
    SPARE_ID_ENV,
    ResilientAttempt,
    read_spare,
)

__all__ = ["Identity", "attempt_from_env", "resolve_identity"]


@dataclass(frozen=True)
class Identity:
    rank: int
    local_rank: int
    first_attempt: int
    """The oldest attempt this worker may join (a spare joins its assignment's attempt)."""
    spare_id: int | None = None


def resolve_identity(control_dir: Path, poll_interval: float) -> Identity:
    """This worker's rank; a hot spare first waits (without limit) for its assignment."""
    spare = os.environ.get(SPARE_ID_ENV)
    if spare is None:
        return Identity(_env_int("RANK"), _env_int("LOCAL_RANK", 0), _env_int(ATTEMPT_ENV, 0))
    spare_id = _parse_int(SPARE_ID_ENV, spare)
    # Woken by the control directory's changes (inotify) where it can be watched: the
    # assignment is the start of a recovery, and a poll's latency would add to its stall.
    watch = DirWatch.open([control_dir])
    try:
        while (assignment := read_spare(control_dir, spare_id)) is None:
            if watch is not None:
                watch.wait(REREAD_SECONDS)
            else:
                time.sleep(poll_interval)
    finally:
        if watch is not None:
            watch.close()
    for name in ("RANK", "ROLE_RANK"):
        os.environ[name] = str(assignment.rank)
    os.environ["LOCAL_RANK"] = str(assignment.local_rank)
    os.environ[ATTEMPT_ENV] = str(assignment.attempt)
    return Identity(assignment.rank, assignment.local_rank, assignment.attempt, spare_id)


def attempt_from_env(barrier_timeout: float) -> ResilientAttempt | None:
    """The attempt torchrun's environment describes, or None without MASTER_ADDR/PORT."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    return ResilientAttempt(
        attempt=_env_int(ATTEMPT_ENV, 0),
        master_addr=os.environ["MASTER_ADDR"],
        master_port=_env_int("MASTER_PORT"),
        world_size=_env_int("WORLD_SIZE"),
        barrier_timeout_seconds=barrier_timeout,
    )


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"environment variable {name} is not set")
        return default
    return _parse_int(name, value)


def _parse_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
