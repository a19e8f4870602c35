"""Small process helpers shared by the local platform's pieces."""

from __future__ import annotations

import contextlib
import os
import signal


def kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (agents and workers each lead their own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def alive(pid: int | None) -> bool:
    """True when a process with this pid exists (it may belong to another user)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
