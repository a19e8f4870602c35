""":func:`loop`: a torchrun script's training loop, checkpointless under trainguard.

A plain torchrun script becomes checkpointless in three places::

    resilient.init_process_group("gloo")            # was dist.init_process_group("gloo")
    ddp = resilient.DistributedDataParallel(model)  # was DistributedDataParallel(model)

    def train_step(step: int) -> None:              # was: for step in range(1, steps + 1):
        ...                                         # the loop's body, as it was
    resilient.loop(train_step, range(1, steps + 1), {"model": model, "optim": optimizer})

``loop`` calls ``train_step(n)`` for each step number ``n`` of ``steps``, in order, the
numbers as the script had them. Under trainguard's in-process restarts, when a peer dies
the survivors keep their processes and state, a replacement (a hot spare) takes its state
from a peer, and the loop goes on at the first step not every rank completed: no completed
step is redone. When no rank holds state (the first start, a full restart) every rank
restores ``state`` from the job's checkpoint tiers (memory, then durable), which the loop
saves to after each step (``save(n, state)``; ``spec.checkpointing`` says which steps are
kept and persisted). Without trainguard it is a plain loop over ``steps``.

A step is complete once every optimizer of ``state`` has stepped in it (a post-step hook),
or when ``train_step`` returns: a collective after the update (a loss all_reduce for the
log) that fails does not undo it, and the step is not run again. ``state`` is what a rank
hands a peer and what is checkpointed: a ``Stateful`` or a dict of them (model, optimizer,
scheduler, a data position), the same on every rank after each step, or for a sharded
model (:func:`trainguard.resilient.fully_shard`) on every rank holding the same shards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainguard.checkpoint.checkpointer import Checkpointer
from trainguard.checkpoint.config import CONFIG_ENV
from trainguard.checkpoint.ranked import RankedCheckpointer
from trainguard.resilient.config import ResilientConfig
from trainguard.resilient.restartable import run_resilient
from trainguard.resilient.run import Run
from trainguard.resilient.state import State, TrainState

__all__ = ["StepFunction", "loop"]

StepFunction = Callable[[int], object]
"""One step of training: the body of the script's loop, given the step's number."""


def loop(
    train_step: StepFunction,
    steps: Sequence[int],
    state: State,
    *,
    checkpoints: bool | Checkpointer | RankedCheckpointer = True,
    config: ResilientConfig | None = None,
) -> None:
    """Run ``train_step(n)`` for each ``n`` in ``steps``, across faults (see the module doc).

    ``checkpoints``: True saves to and restores from the job's checkpoint tiers under
    trainguard (``TRAINGUARD_CHECKPOINT_CONFIG``) and uses none elsewhere; False none; a
    ``Checkpointer`` (or ``RankedCheckpointer``) of the script's own, anywhere.
    """
    owned: RankedCheckpointer | None = None
    tiers: Callable[[], Checkpointer] | None = None
    if isinstance(checkpoints, Checkpointer):
        given = checkpoints
        tiers = lambda: given  # noqa: E731
    elif isinstance(checkpoints, RankedCheckpointer):
        tiers = checkpoints.get
    elif checkpoints and os.environ.get(CONFIG_ENV):
        owned = RankedCheckpointer()
        tiers = owned.get
    body = _Loop(train_step, steps, state, tiers)
    try:
        run_resilient(body, state, body.restore if tiers else None, config or ResilientConfig())
    finally:
        if owned is not None:
            owned.close()


class _Loop:
    """The training function of each attempt: steps ``run.start_step`` on."""

    def __init__(
        self,
        train_step: StepFunction,
        steps: Sequence[int],
        state: State,
        tiers: Callable[[], Checkpointer] | None,
    ) -> None:
        self.train_step = train_step
        self.steps = steps
        self.state = state
        self.tiers = tiers
        self.optimizers = _optimizers(state)
        self._step: tuple[Run, int] | None = None  # the step under way, until complete
        self._pending: list[torch.optim.Optimizer] = []  # optimizers yet to step in it

    def __call__(self, run: Run) -> None:
        hooks = [opt.register_step_post_hook(self._stepped) for opt in self.optimizers]
        try:
            for index in range(run.start_step, len(self.steps)):
                self._step, self._pending = (run, index), list(self.optimizers)
                self.train_step(self.steps[index])
                if self._step is not None:  # no optimizer stepped: complete at its end
                    self._step = None
                    run._advance(index)
                if self.tiers is not None:
                    self.tiers().save(self.steps[index], self.state)
                run._check(index)
        finally:
            self._step = None
            for hook in hooks:
                hook.remove()

    def _stepped(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """An optimizer's post-step hook: the step is complete once all have stepped."""
        if self._step is None:
            return
        self._pending = [opt for opt in self._pending if opt is not optimizer]
        if not self._pending:
            run, index = self._step
            self._step = None
            run._advance(index)

    def restore(self) -> int | None:
        """No rank holds state: the checkpoint tiers' newest step, as completed steps."""
        assert self.tiers is not None
        saved = self.tiers().load_latest(self.state)
        if saved is None:
            return None
        try:
            return self.steps.index(saved) + 1
        except ValueError:
            raise ValueError(
                f"resilient.loop: the checkpoint's step {saved} is not one of the loop's steps "
                f"({self.steps!r})"
            ) from None


def _optimizers(state: object) -> list[torch.optim.Optimizer]:
    """The optimizers in ``state`` (in its dicts, lists and tuples, or a TrainState's)."""
    if isinstance(state, torch.optim.Optimizer):
        return [state]
    if isinstance(state, TrainState):
        return _optimizers(state.optimizer)
    if isinstance(state, dict):
        return [opt for value in state.values() for opt in _optimizers(value)]
    if isinstance(state, (list, tuple)):
        return [opt for value in state for opt in _optimizers(value)]
    return []
