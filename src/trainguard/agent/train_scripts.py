"""The job's pre- and post-train scripts (hyperpodrun's ``--pre-train-script`` and
``--post-train-script``; ``spec.trainguard.preTrainScript``/``postTrainScript``).

A node agent runs the pre-train command before it starts an attempt's workers (at every
start, restarts included) and the post-train command once all of the attempt's workers on
the node exited 0, before it reports the attempt complete. Each runs without a shell, in
the workers' directory and with their environment (no rank variables: it is the node's,
not a rank's). A command that cannot start or exits non-zero is the node's fault: the
message names it, its exit, and ends with the last lines of its output, which is also
kept whole in ``<log dir>/<node>-<pre|post>-train.log``.

Both run on the agent's supervisor thread: a stop that arrives meanwhile is handled once
the command has ended. hyperpodrun documents no time limit for them, and neither is one
set here.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["OUTPUT_TAIL_LINES", "TrainScripts", "parse_script_flag", "run_train_script"]

PRE_FLAG = "--pre-train-script"
POST_FLAG = "--post-train-script"
OUTPUT_TAIL_LINES = 10  # of a failed script's output, in its fault's message
_TAIL_LINE_CHARS = 300


@dataclass(frozen=True)
class TrainScripts:
    """The node's pre- and post-train commands (argv; empty: none)."""

    pre: tuple[str, ...] = ()
    post: tuple[str, ...] = ()

    def agent_flags(self) -> list[str]:
        """The agent's command-line flags for these (each argv as a JSON list)."""
        flags: list[str] = []
        if self.pre:
            flags += [PRE_FLAG, json.dumps(list(self.pre))]
        if self.post:
            flags += [POST_FLAG, json.dumps(list(self.post))]
        return flags


def parse_script_flag(text: str) -> tuple[str, ...]:
    """An agent flag's value (a JSON list of strings) as argv; ValueError if it is not."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON: {err}") from None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a non-empty JSON list of strings")
    return tuple(value)


def run_train_script(
    phase: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: Path | None,
    log_file: Path,
) -> str | None:
    """Run ``phase``'s ("pre-train" or "post-train") command to its end; None when it exits
    0, else the fault's message (with the tail of its output)."""
    logger.info("running the %s script: %s", phase, list(argv))
    log_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            list(argv),
            env={**os.environ, **env},
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            check=False,
        )
    except OSError as err:
        return f"{phase} script {argv[0]} could not start: {err}"
    log_file.write_bytes(done.stdout)
    if done.returncode == 0:
        return None
    code = done.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
    lines = done.stdout.decode(errors="replace").splitlines()[-OUTPUT_TAIL_LINES:]
    tail = "\n".join(line[:_TAIL_LINE_CHARS] for line in lines)
    output = f"; its output ends:\n{tail}" if tail else " (no output)"
    return f"{phase} script {argv[0]} {how}{output}"
