"""Small process helpers shared by the local platform's pieces."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


CONTROLLER_GC_THRESHOLDS = (20_000, 20, 10)
"""Young-generation thresholds for a controller process (Python's defaults: 700, 10, 10)."""


def tune_gc_for_a_controller() -> None:
    """Collect the young generations less often in a controller process.

    A controller keeps every agent's newest status (dozens of small objects each) and
    replaces them all every poll cycle. With Python's default thresholds those objects
    survive two young collections before they are replaced, reach the old generation,
    and a full collection follows nearly every cycle: 0.2 s each with 4096 nodes, half
    the controller's CPU. Collected less often, most die young and cost nothing.
    """
    gen0, gen1, gen2 = gc.get_threshold()
    want0, want1, want2 = CONTROLLER_GC_THRESHOLDS
    gc.set_threshold(max(gen0, want0), max(gen1, want1), max(gen2, want2))
