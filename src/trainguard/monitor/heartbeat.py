"""Reading the heartbeat files written by `trainguard.heartbeat()` (agent side).

The agent points ``TRAINGUARD_HEARTBEAT_DIR`` at a directory of its own per attempt
and reads it with `read_heartbeats`; the controller judges staleness job-wide with
`trainguard.monitor.hang.HeartbeatWatch`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from trainguard.heartbeat import HEARTBEAT_DIR_ENV, heartbeat_file
from trainguard.wire.status import Beat

__all__ = ["HEARTBEAT_DIR_ENV", "Beat", "heartbeat_file", "read_heartbeats"]

_FILE = re.compile(r"rank-(\d+)")
_MAX_FILE_BYTES = 4096


def read_heartbeats(directory: str | Path) -> dict[int, Beat]:
    """Every rank's latest beat in ``directory``; missing, partial or garbage files are skipped."""
    beats: dict[int, Beat] = {}
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return beats
    for path in entries:
        name = _FILE.fullmatch(path.name)
        if name is None:
            continue
        beat = _read(path)
        if beat is not None:
            beats[int(name.group(1))] = beat
    return beats


def _read(path: Path) -> Beat | None:
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(_MAX_FILE_BYTES))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    step, t = data.get("step"), data.get("time")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        return None
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return None
    return Beat(step=step, time=float(t))
