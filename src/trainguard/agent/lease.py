"""When the controller last reached this agent, and whether the agent may still change
what lasts.

On several hosts a node can be cut off from the network while it runs. The controller
declares it lost once it failed to reach its agent ``unreachable_after`` times in a row
(each attempt bounded by ``contactTimeoutSeconds``); the agent, for its part, stops
committing to the durable tier once no request of the controller reached it for
``fence_after`` seconds, chosen shorter than that bound (``--fence-after``). Both count
from the same moment (the last exchange before the cut) on their own clocks, so a node
is fenced before it is declared lost and nothing it writes afterwards reaches durable
storage: a lease, with clocks that only need to run at the same rate.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ControllerLease"]


class ControllerLease:
    """The time of the controller's latest request (see the module doc)."""

    def __init__(
        self, fence_after: float | None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``fence_after``: seconds without the controller after which writes that last
        are refused (None: never, on one machine)."""
        self.fence_after = fence_after
        self._clock = clock
        self._last = clock()

    def touch(self) -> None:
        """The controller reached this agent just now."""
        self._last = self._clock()

    def age(self) -> float:
        return self._clock() - self._last

    def fenced(self) -> str | None:
        """Why this agent must not change what lasts now, or None."""
        if self.fence_after is None:
            return None
        age = self.age()
        if age <= self.fence_after:
            return None
        return (
            f"fenced: no request from the controller for {age:.1f}s (fence after "
            f"{self.fence_after:g}s): it may have declared this node lost"
        )
