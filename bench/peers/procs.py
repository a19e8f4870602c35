"""Processes of a peer's run: started in the peers' environment, signalled, stopped.

Every peer process gets its own log file under the run's directory; :class:`Procs`
signals only the processes it started, through their ``Popen`` (never reaped before
``poll`` sees them gone, so their pid cannot have been reused).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent


class Child:
    """A started process, signalled the way ``bench.runs.Proc`` is."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)


class Procs:
    """Named processes of one run, each logging to ``<logs>/<name>.log``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.exited: dict[str, float] = {}  # name -> when it was seen gone

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it)
        self.procs[name] = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.exited.pop(name, None)

    def target(self, name: str) -> Child | None:
        """The live process ``name`` (for ``bench.baseline.signal_at_step``)."""
        proc = self.procs.get(name)
        return Child(proc) if proc is not None and proc.poll() is None else None

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def wait_exit(self, name: str, timeout: float) -> float | None:
        """When ``name`` was seen gone (Unix time), None if still running at ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive(name):
                return time.time()
            time.sleep(0.01)
        return None

    def wait_all(self, names: Sequence[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for name in names:
            proc = self.procs[name]
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
        return all(self.procs[n].poll() is not None for n in names)

    def returncodes(self) -> dict[str, int | None]:
        return {name: proc.poll() for name, proc in self.procs.items()}

    def stop(self) -> None:
        """SIGKILL what is left: each started process's session, its children too, also
        where the process itself has exited (DLRover's saver outlives its trainer)."""
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def log_tail(self, name: str, lines: int = 5) -> str:
        path = self.logs / f"{name}.log"
        if not path.exists():
            return ""
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        return " | ".join(line.strip() for line in text[-lines:])
