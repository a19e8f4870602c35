"""The job's worker environment, handed to an agent through its own environment.

A process's command line is readable by every local user (``ps``, ``/proc/PID/cmdline``);
its environment only by its owner (``/proc/PID/environ`` is 0400). So the controller puts
the spec's env values (secrets among them) and the checkpoint settings (storage options)
in ``TRAINGUARD_JOB_ENV`` (a JSON object of strings) rather than in ``--env`` flags, and the
agent takes the variable out of its environment before it starts anything.

Stdlib only: the agent reads it before importing its own modules.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping

__all__ = ["JOB_ENV_VAR", "encode_job_env", "take_job_env"]

JOB_ENV_VAR = "TRAINGUARD_JOB_ENV"


def encode_job_env(env: Mapping[str, str]) -> dict[str, str]:
    """What to add to an agent's environment to hand it ``env`` (and no other's)."""
    return {JOB_ENV_VAR: json.dumps(dict(env))}


def take_job_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """The job env handed in ``environ`` (removed from it, so workers do not inherit the
    blob); ``ValueError`` when it is not a JSON object of strings (no value is quoted)."""
    raw = environ.pop(JOB_ENV_VAR, None)
    if raw is None:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        raise ValueError(f"${JOB_ENV_VAR}: not JSON") from None
    if not isinstance(data, dict):
        raise ValueError(f"${JOB_ENV_VAR}: expected a JSON object")
    env: dict[str, str] = {}
    for key, value in data.items():
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"${JOB_ENV_VAR}: bad variable name {key!r}")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"${JOB_ENV_VAR}: the value of {key} is not a string")
        env[key] = value
    return env
