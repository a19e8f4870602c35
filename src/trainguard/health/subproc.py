"""Running a check's work in a child process with a time limit, answer as JSON.

The node agent never imports torch (it stays small), so the checks that need it run
``python -m trainguard.health.<module>`` (`module_argv`), and external tools (dcgmi)
run as they are. The child leads its own process group, so a timeout kills it and
whatever it started. The answer is the last line of its stdout that is a JSON object.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["Completed", "module_argv", "run_bounded"]

_TAIL_CHARS: Final = 2000


@dataclass(frozen=True)
class Completed:
    """How a bounded child process ended."""

    returncode: int | None
    """None: killed at the timeout."""
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def answer(self) -> dict[str, Any] | None:
        """The last stdout line that is a JSON object, or None."""
        for line in reversed(self.stdout.splitlines()):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
        return None

    def tail(self) -> str:
        """The end of stderr (else stdout), for a failure's message."""
        text = (self.stderr.strip() or self.stdout.strip())[-_TAIL_CHARS:]
        return text.splitlines()[-1] if text else ""


def module_argv(module: str, *args: str) -> list[str]:
    """``python -m module args...`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def run_bounded(
    argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
) -> Completed:
    """Run ``argv`` to its end or ``timeout`` seconds (then its process group is killed)."""
    process = subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
        env=None if env is None else dict(env),
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        stdout, stderr = process.communicate()
        return Completed(None, stdout, stderr)
    except BaseException:
        _kill_group(process)
        process.wait()
        raise
    return Completed(process.returncode, stdout, stderr)


def _kill_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
