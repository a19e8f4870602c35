"""Elastic training: when a job changes its number of nodes, and to which size.

HyperPod's ``elasticPolicy`` semantics, as pure decisions:

- **sizes** (:meth:`ElasticConfig.sizes`): ``minReplicas``, then every
  ``replicaIncrementStep`` up to ``maxReplicas`` (default step 1), or exactly the
  ``replicaDiscreteValues`` within the bounds;
- **scale down** (:meth:`ElasticWatch.observe`): nodes are being taken away (preempted:
  the platform's capacity fell under the job's size): at once, to the largest size the
  remaining capacity fits (never under ``minReplicas``: then the job waits, or fails);
- **faulty scale-down**: a lost node with no spare restarts fresh; if it is not up
  ``faultyScaleDownTimeoutInSeconds`` after the restart, the job goes on without it
  (control/recovery.py ``faulty_scale_down``);
- **scale up**: the capacity fits a larger size, has for ``scalingTimeoutInSeconds``,
  and the last restart is more than ``scaleUpSnoozeTimeInSeconds`` ago; after a scaling
  that failed (the new nodes did not come up), the wait doubles each time (anti-
  thrashing), and resets once a scaling sticks.

A scale-up's new nodes come up ahead, while the wait runs (:meth:`ElasticWatch.room`).
A scaling is a restart at the new size (the script resumes from its checkpoint at the
new ``WORLD_SIZE``), or a change of size in place for resilient workers
(control/rescale.py), decided by the controller and not counted against
``jobMaxRetryCount``: capacity changed, the job's code did not fail.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ElasticConfig", "ElasticWatch", "Scale"]

MAX_BACKOFF_DOUBLINGS = 6


@dataclass(frozen=True)
class ElasticConfig:
    min_nodes: int
    max_nodes: int
    increment: int | None = None
    discrete: tuple[int, ...] = ()
    scaling_timeout: float = 0.0  # capacity must stay this long before a scale-up
    graceful_shutdown_timeout: float = 0.0  # ranks' time to save and exit before a scaling
    scale_up_snooze: float = 0.0  # no scale-up this long after a restart
    # A lost node's fresh replacement not up this long after the restart: scale down
    # without it (None: wait for it as for any node, nodeStartTimeoutSeconds).
    faulty_scale_down_timeout: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"need 1 <= min ({self.min_nodes}) <= max ({self.max_nodes})")
        if not self.sizes():
            raise ValueError("no allowed size between min and max")

    def sizes(self) -> tuple[int, ...]:
        """The allowed node counts, ascending."""
        if self.discrete:
            return tuple(
                sorted({v for v in self.discrete if self.min_nodes <= v <= self.max_nodes})
            )
        return tuple(range(self.min_nodes, self.max_nodes + 1, self.increment or 1))

    def fit(self, available: int) -> int | None:
        """The largest allowed size within ``available`` nodes (None: under the minimum)."""
        fitting = [s for s in self.sizes() if s <= available]
        return fitting[-1] if fitting else None


@dataclass(frozen=True)
class Scale:
    """Restart the job on ``size`` nodes: drop ``drop`` (preempted first), or add nodes."""

    size: int
    reason: str
    drop: tuple[str, ...] = ()

    @property
    def down(self) -> bool:
        return bool(self.drop)


class ElasticWatch:
    """See the module docstring; one per job, fed at every look while an attempt runs."""

    def __init__(self, config: ElasticConfig) -> None:
        self.config = config
        self.failures = 0  # consecutive scalings whose nodes did not come up
        # How the platform takes nodes away, in the reasons ("preempted"; across hosts,
        # "cut off (its host went silent)").
        self.taken_as = "preempted"
        self.last_scaling: float | None = None
        self.target: int | None = None  # the size the last scaling aimed at
        self._ample_since: float | None = None  # capacity has fitted a larger size since

    def observe(
        self,
        now: float,
        nodes: Sequence[str],
        capacity: int | None,
        preempted: Sequence[str],
        last_restart: float | None,
    ) -> tuple[ElasticWatch, Scale | None]:
        """What to do now about the running attempt on ``nodes`` (node-rank order), given
        the platform's ``capacity`` (nodes the job may use; None: unknown) and the nodes
        being taken away; with the watch after this look (a new value)."""
        after, cfg, size = copy.copy(self), self.config, len(nodes)
        taken = set(preempted)
        gone = [n for n in nodes if n in taken]
        if gone or (capacity is not None and capacity < size):
            after._ample_since = None
            room = size - len(gone) if capacity is None else min(capacity, size - len(gone))
            target = cfg.fit(room)
            if target is None:
                return after, None  # under the minimum: the controller decides (wait, or fail)
            keep = [n for n in nodes if n not in gone][:target]
            drop = tuple(n for n in nodes if n not in keep)
            why = f"{', '.join(gone)} {self.taken_as}" if gone else f"capacity fell to {capacity}"
            return after, Scale(target, f"scale down {size} -> {target} nodes: {why}", drop)
        target = cfg.fit(capacity) if capacity is not None else None
        if target is None or target <= size:
            after._ample_since = None
            return after, None
        if after._ample_since is None:
            after._ample_since = now
        wait = cfg.scaling_timeout * (2 ** min(self.failures, MAX_BACKOFF_DOUBLINGS))
        if now - after._ample_since < wait:
            return after, None
        if last_restart is not None and now - last_restart < cfg.scale_up_snooze:
            return after, None
        after._ample_since = None
        return after, Scale(
            target,
            f"scale up {size} -> {target} nodes: capacity for {capacity} nodes "
            f"for {wait:g} s (scalingTimeoutInSeconds)",
        )

    def room(self, size: int, capacity: int | None) -> int | None:
        """The larger size the capacity fits now, before any wait (None: none): its nodes
        may come up ahead of the scale-up, while ``scalingTimeoutInSeconds`` runs. None
        after a failed scale-up too: then nodes come up only once it is decided."""
        target = self.config.fit(capacity) if capacity is not None else None
        if self.failures or target is None or target <= size:
            return None
        return target

    def scaled(self, now: float, target: int) -> ElasticWatch:
        """This watch after a scaling to ``target`` nodes at ``now`` (a new value)."""
        after = copy.copy(self)
        after.last_scaling, after.target = now, target
        return after

    def outcome(self, ok: bool) -> ElasticWatch:
        """This watch once the last scaling's new nodes came up (``ok``), or not: backoff
        grows (a new value)."""
        after = copy.copy(self)
        after.failures = 0 if ok else self.failures + 1
        return after
