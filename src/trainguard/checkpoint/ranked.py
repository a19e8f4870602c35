"""A ``Checkpointer`` that follows this process's rank and world size.

A ``Checkpointer`` is built for one rank in one world (its shards are named by both). A
resilient worker's rank can change while the process lives: a hot spare learns its rank
late, and an elastic scaling in place renumbers the ranks and changes the world size
(the wrapper updates ``RANK`` and ``WORLD_SIZE``). :class:`RankedCheckpointer` makes the
``Checkpointer`` on first use and makes it again, closing the old one, when they change.
"""

from __future__ import annotations

import os
from typing import Any

from trainguard.checkpoint.checkpointer import Checkpointer

__all__ = ["RankedCheckpointer"]


class RankedCheckpointer:
    """``get()``: the ``Checkpointer`` for the current ``RANK`` and ``WORLD_SIZE``;
    ``settings`` go to every one it makes."""

    def __init__(self, **settings: Any) -> None:
        self._settings = settings
        self._current: Checkpointer | None = None

    def get(self) -> Checkpointer:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        current = self._current
        if current is not None and (current.config.rank, current.config.world_size) != (
            rank,
            world,
        ):
            current.close()
            current = None
        if current is None:
            current = Checkpointer(**self._settings, rank=rank, world_size=world)
            self._current = current
        return current

    def close(self) -> None:
        """Close the current ``Checkpointer``, if one was made."""
        if self._current is not None:
            self._current.close()
            self._current = None
