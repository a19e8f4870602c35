"""Checkpointer settings: defaults, the job's environment, keyword overrides.

Under trainguard the node agent sets::

    TRAINGUARD_CHECKPOINT_CONFIG      JSON {"memoryEverySteps", "memoryKeep", "durableUrl",
                                      "durableEverySteps", "durableEverySeconds",
                                      "durableKeep", "replicas", "storageOptions",
                                      "durableWriter": "agent"}
    TRAINGUARD_CHECKPOINT_MEMORY_DIR  the node's memory-tier directory (agent-owned)
    TRAINGUARD_JOB_ID                 shards of other jobs are never loaded
    TRAINGUARD_ATTEMPT                the attempt (plain torchrun: TORCHELASTIC_RESTART_COUNT);
                                      read at each save and load, see writer_attempt()
    RANK, WORLD_SIZE                  torchrun's

Outside trainguard the same variables may be set by hand; otherwise the defaults below
apply (memory tier only, under ``/dev/shm``). Keyword arguments override both.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from trainguard.checkpoint.memory import default_memory_dir

__all__ = ["ATTEMPT_ENV", "CONFIG_ENV", "JOB_ID_ENV", "MEMORY_DIR_ENV", "CheckpointConfig"]

log = logging.getLogger(__name__)

CONFIG_ENV = "TRAINGUARD_CHECKPOINT_CONFIG"
MEMORY_DIR_ENV = "TRAINGUARD_CHECKPOINT_MEMORY_DIR"
JOB_ID_ENV = "TRAINGUARD_JOB_ID"
ATTEMPT_ENV = "TRAINGUARD_ATTEMPT"  # as trainguard.wire.control_files.ATTEMPT_ENV
TORCHRUN_ATTEMPT_ENV = "TORCHELASTIC_RESTART_COUNT"

DEFAULT_COMMIT_TIMEOUT = 60.0
"""Seconds rank 0 waits for every rank's durable shard of a step before giving up on it."""

_JSON_NAMES = {
    "memoryEverySteps": "memory_every_steps",
    "memoryKeep": "memory_keep",
    "durableUrl": "durable_url",
    "durableEverySteps": "durable_every_steps",
    "durableEverySeconds": "durable_every_seconds",
    "durableKeep": "durable_keep",
    "replicas": "replicas",
    "storageOptions": "storage_options",
    "durableWriter": "durable_writer",
}
DURABLE_WRITERS = ("worker", "agent")
"""Who writes the durable tier: the Checkpointer's own background thread (outside
trainguard), or the node agent when the controller asks (under trainguard: every node
persists the same step, chosen with a view of every rank)."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Everything a :class:`~trainguard.checkpoint.Checkpointer` needs (validated)."""

    memory_every_steps: int = 1
    memory_keep: int = 2
    memory_dir: str = ""  # "" -> default_memory_dir()
    durable_url: str | None = None
    durable_every_steps: int | None = None
    durable_every_seconds: float | None = None
    durable_keep: int = 3
    storage_options: dict[str, Any] = field(default_factory=dict)
    replicas: int = 0
    job_id: str = "local"
    rank: int = 0
    world_size: int = 1
    commit_timeout: float = DEFAULT_COMMIT_TIMEOUT
    durable_writer: str = "worker"

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> CheckpointConfig:
        """Settings from ``environ`` (default ``os.environ``), then ``overrides``.

        An override of None keeps the environment's value (``durable_url=""`` turns the
        durable tier off).
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        raw = env.get(CONFIG_ENV)
        if raw:
            values.update(_parse_config_json(raw))
        if env.get(MEMORY_DIR_ENV):
            values["memory_dir"] = env[MEMORY_DIR_ENV]
        job_id = env.get(JOB_ID_ENV) or env.get("TORCHELASTIC_RUN_ID")
        if job_id:
            values["job_id"] = job_id
        for name, var in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
            if env.get(var):
                try:
                    values[name] = int(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r}: not an integer") from None
        known = {f.name for f in fields(cls)}
        for name in overrides:
            if name not in known:
                raise TypeError(f"Checkpointer: unknown setting {name!r}; known: {sorted(known)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        if not config.memory_dir:
            config = replace(config, memory_dir=default_memory_dir(env))
        config.validate()
        return config

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        positive = {
            "memory_every_steps": self.memory_every_steps,
            "memory_keep": self.memory_keep,
            "durable_keep": self.durable_keep,
            "world_size": self.world_size,
        }
        for name, value in positive.items():
            _require_int(name, value, minimum=1)
        _require_int("replicas", self.replicas, minimum=0)
        _require_int("rank", self.rank, minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is not below world_size {self.world_size}")
        if self.durable_every_steps is not None:
            _require_int("durable_every_steps", self.durable_every_steps, minimum=1)
        seconds = self.durable_every_seconds
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0
        ):
            raise ValueError(f"durable_every_seconds: must be a number > 0, got {seconds!r}")
        if self.durable_url is not None and not isinstance(self.durable_url, str):
            raise ValueError(f"durable_url: must be a string, got {self.durable_url!r}")
        if not isinstance(self.storage_options, dict):
            raise ValueError(f"storage_options: must be a dict, got {self.storage_options!r}")
        if not self.job_id or not isinstance(self.job_id, str):
            raise ValueError(f"job_id: must be a non-empty string, got {self.job_id!r}")
        if self.durable_writer not in DURABLE_WRITERS:
            raise ValueError(
                f"durable_writer: must be one of {', '.join(DURABLE_WRITERS)}, "
                f"got {self.durable_writer!r}"
            )
        if self.commit_timeout <= 0:
            raise ValueError(f"commit_timeout: must be > 0, got {self.commit_timeout!r}")

    @property
    def durable(self) -> bool:
        """Whether a durable tier is configured."""
        return bool(self.durable_url)


def _parse_config_json(raw: str) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{CONFIG_ENV}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_ENV}: must be a JSON object, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in _JSON_NAMES:
            log.warning("%s: ignoring unknown setting %r", CONFIG_ENV, key)
            continue
        if value is not None or key == "durableUrl":
            values[_JSON_NAMES[key]] = value
    try:
        CheckpointConfig(**values).validate()
    except ValueError as exc:
        raise ValueError(f"{CONFIG_ENV}: {_camel(str(exc))}") from None
    return values


def _camel(message: str) -> str:
    """Name settings in an error as the JSON spells them."""
    for camel, snake in _JSON_NAMES.items():
        if message.startswith(f"{snake}:"):
            return camel + message[len(snake) :]
    return message


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: must be an integer >= {minimum}, got {value!r}")


def writer_attempt(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's attempt, as a shard's writer: ``TRAINGUARD_ATTEMPT`` (set by the
    agent, and changed in place by an in-process restart), else torchrun's restart count;
    None when neither is set (or not an integer): an unknown attempt."""
    env = os.environ if environ is None else environ
    for name in (ATTEMPT_ENV, TORCHRUN_ATTEMPT_ENV):
        raw = env.get(name)
        if raw:
            try:
                return int(raw)
            except ValueError:
                if (name, raw) not in _WARNED:
                    _WARNED.add((name, raw))
                    log.warning("%s=%r: not an integer; the attempt is unknown", name, raw)
                return None
    return None


_WARNED: set[tuple[str, str]] = set()
