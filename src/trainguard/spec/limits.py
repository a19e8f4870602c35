"""Upper limits on what a job spec brings in from outside, kept in one place.

A spec comes from a user's file, a command line or a Kubernetes object, so nothing in it
is trusted to be small: a typo such as ``replicas: 1000000000000`` must be an error (exit
2, naming the field), not a controller that dies of MemoryError; a duration must be
finite and short enough for every timer (``time.sleep`` and ``Event.wait`` overflow near
2**63 ns); and a YAML alias bomb must be refused before anything expands it.

The caps are far above real use. HyperPod clusters run thousands of nodes and the scale
benchmark drives 16,384, so a job may have up to 65,536 nodes; one machine running a job
locally (one agent process per node, about 0.6 GB each with torch imported) is held to a
much smaller number, which an environment variable raises (`local_limit`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

# --- documents --------------------------------------------------------------------------
MAX_SPEC_FILE_BYTES: Final = 1 << 20
"""A spec file is read up to this many bytes (1 MiB); a larger one is refused unparsed."""
MAX_SPEC_SIZE: Final = 4 << 20
"""The spec's size as JSON with every YAML alias expanded (what is stored), at most 4 MiB."""
MAX_TEMPLATE_SIZE: Final = 512 << 10
"""A replica group's pod template as JSON, at most 512 KiB (etcd keeps objects < 1.5 MiB)."""
MAX_ARG_BYTES: Final = 128 << 10
"""A worker's argument or environment value once $(VAR) references are expanded (Linux's
MAX_ARG_STRLEN: execve refuses a longer one)."""
MAX_NESTING: Final = 64
"""Nesting depth of the spec's mappings and lists (a pod template needs about 15)."""

# --- counts -----------------------------------------------------------------------------
MAX_NODES: Final = 65_536
"""Nodes of a group, of the whole job, spares, elastic bounds."""
MAX_NPROC_PER_NODE: Final = 1024
"""Workers per node."""
MAX_WORLD_SIZE: Final = 1 << 20
"""Ranks of the whole job (nodes x workers per node)."""
MAX_RESTARTS: Final = 100_000
"""Any count of restarts (jobMaxRetryCount, restartPolicy's counts)."""
MAX_HOT_SPARES: Final = 1024
"""Hot spare worker processes of the job."""
MAX_LOG_RULES: Final = 100
"""Log monitoring rules (every rule looks at every output line)."""
MAX_DATA_POINTS: Final = 10_000
"""A log rule's metricEvaluationDataPoints."""
MAX_EVERY_STEPS: Final = 1_000_000_000
"""Checkpoint intervals in steps."""
MAX_MEMORY_KEEP: Final = 100
"""Snapshots each rank keeps in node memory."""
MAX_DURABLE_KEEP: Final = 100_000
"""Durable checkpoints kept."""
MAX_CHECKPOINT_REPLICAS: Final = 64
"""Peers holding a copy of a node's memory snapshots."""
MAX_DISCRETE_VALUES: Final = 4096
"""Entries of elasticPolicy.replicaDiscreteValues."""

# --- durations (seconds; every one must also be finite) ----------------------------------
MAX_DURATION_SECONDS: Final = 366 * 86_400.0
"""Deadlines, windows, periods and timeouts: at most a year."""
MAX_GRACE_SECONDS: Final = 3600.0
"""stopGracePeriodSeconds: the time workers get after SIGTERM."""
MAX_POLL_INTERVAL_SECONDS: Final = 60.0
"""pollIntervalSeconds: how often the controller polls its agents."""
MAX_RATIO: Final = 1000.0
"""stragglerThreshold, a ratio of paces."""

# --- one machine (trainguard run) -------------------------------------------------------
MAX_LOCAL_NODES_ENV: Final = "TRAINGUARD_MAX_LOCAL_NODES"
MAX_LOCAL_NODES: Final = 64
"""Nodes (agent processes, spares included) that `trainguard run` starts on one machine."""
MAX_LOCAL_WORKERS_ENV: Final = "TRAINGUARD_MAX_LOCAL_WORKERS"
MAX_LOCAL_WORKERS: Final = 1024
"""Worker processes (hot spares included) that `trainguard run` starts on one machine."""


def local_limit(env: str, default: int) -> int:
    """A limit of one machine: ``default``, or a positive integer in ``$env`` (bad: default)."""
    raw = os.environ.get(env, "").strip()
    if raw.isdigit() and 0 < int(raw) <= MAX_WORLD_SIZE:
        return int(raw)
    return default


class JsonSize:
    """The size of data as JSON (about what ``json.dumps`` writes) and its nesting depth,
    with a shared object (a YAML alias) counted each time it is reached.

    Each distinct object is measured once (memoized by identity), so the work follows
    the data as loaded, not as expanded: an alias bomb of a few hundred bytes is measured
    in microseconds at its full, astronomical size. A cycle counts as infinitely large and
    deep; nothing deeper than ``MAX_NESTING`` is descended into."""

    _INFINITE = 1 << 62

    def __init__(self, data: object) -> None:
        self._memo: dict[int, tuple[int, int]] = {}
        self._open: set[int] = set()
        self._keep: list[object] = []  # keeps every measured object (and so its id) alive
        self.size, self.depth = self._measure(data, 0)

    def _measure(self, item: object, depth: int) -> tuple[int, int]:
        if isinstance(item, str | bytes):
            return len(item) + 2, 0
        children = _children(item)
        if children is None:  # a number, a boolean, null, a date
            return 8, 0
        key = id(item)
        if key in self._memo:
            return self._memo[key]
        if key in self._open or depth >= MAX_NESTING:
            return self._INFINITE, MAX_NESTING + 1  # a cycle, or too deep to go on
        self._open.add(key)
        size, height = 2, 0
        for child in children:
            child_size, child_height = self._measure(child, depth + 1)
            size, height = size + child_size + 1, max(height, child_height + 1)
        self._open.discard(key)
        self._keep.append(item)
        self._memo[key] = size, height
        return size, height

    def path_over(self, data: object, limit: int) -> list[int | str]:
        """Where `data` (the object measured) passes `limit`: the path to its innermost part
        that alone does (for an alias bomb, the first level that explodes)."""
        loc: list[int | str] = []
        for _ in range(MAX_NESTING):
            pairs: list[tuple[object, object]] = []
            if isinstance(data, Mapping):
                pairs = list(data.items())
            elif isinstance(data, list | tuple):
                pairs = list(enumerate(data))
            over = [(k, v) for k, v in pairs if self._measure(v, 0)[0] > limit]
            if not over:
                break
            key, data = over[0]
            loc.append(key if isinstance(key, int | str) else str(key))
        return loc


def _children(item: object) -> list[object] | None:
    """The keys and values of a mapping, the items of a list; None for a scalar."""
    if isinstance(item, Mapping):
        return [part for pair in item.items() for part in pair]
    if isinstance(item, list | tuple | set | frozenset):
        return list(item)
    return None


def describe_bytes(count: int) -> str:
    """1048576 -> "1 MiB", 524288 -> "512 KiB"."""
    if count % (1 << 20) == 0:
        return f"{count >> 20} MiB"
    return f"{count >> 10} KiB"
