"""The few Slurm commands trainguard runs, each a thin edge around one ``scontrol`` or
``srun`` call: what went wrong comes back as a sentence, never an exception."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["drain", "kill_wait", "node_step", "requeue"]

COMMAND_TIMEOUT = 30.0


def drain(node: str, reason: str) -> str | None:
    """``scontrol update nodename=NODE state=drain reason=...``; why it failed, or None."""
    return _scontrol("update", f"nodename={node}", "state=drain", f"reason={reason}")


def requeue(job_id: str) -> str | None:
    """``scontrol requeue JOB``: Slurm ends the job and runs it again (its
    ``SLURM_RESTART_COUNT`` one more); why it failed, or None."""
    return _scontrol("requeue", job_id)


def node_step(
    node: str, argv: Sequence[str], env: Mapping[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """A step of one task on ``node`` running ``argv`` (a host daemon of the job): its own
    step, so that a node lost ends only it (``--no-kill``: the job runs on), sharing the
    allocation with the batch script (``--overlap``)."""
    command = [
        "srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--no-kill", "--overlap",
        "--kill-on-bad-exit=0", f"--job-name=trainguard-{node}", "--export=ALL", *argv,
    ]  # fmt: skip
    with log.open("ab") as out:
        return subprocess.Popen(
            command, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def kill_wait(default: float = 30.0) -> float:
    """Slurm's ``KillWait``: the seconds between the SIGTERM of ``scancel`` (or of a job
    reaching its time limit) and the SIGKILL that follows."""
    try:
        done = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True,
            timeout=COMMAND_TIMEOUT, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return default
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "KillWait":
            digits = value.strip().split()[0] if value.strip() else ""
            return float(digits) if digits.isdigit() else default
    return default


def _scontrol(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
            check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol {' '.join(args[:2])}: {exc}"
    if done.returncode != 0:
        return f"scontrol {' '.join(args[:2])}: {(done.stderr or done.stdout).strip()}"
    return None
