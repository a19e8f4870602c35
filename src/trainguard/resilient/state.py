"""What a data-parallel rank holds in memory and hands to a peer that lacks it."""

from __future__ import annotations

from typing import Any

from trainguard.checkpoint.stateful import Stateful

__all__ = ["State", "Stateful", "TrainState"]

State = Stateful | dict[str, Any]
"""What the ranks hold and hand to a peer: a ``Stateful`` (a :class:`TrainState`), or a
dict of them and of plain values and tensors, as a checkpoint state
(:mod:`trainguard.checkpoint.stateful`)."""


class TrainState:
    """The model, the optimizer and any extra state of a training run, as one ``Stateful``.

    ``extra`` is another ``Stateful`` (an LR scheduler, a sampler) or a ``dict`` of tensors
    and plain values (``int``, ``float``, ``str``, ``bool``, ``None``, nested in dicts and
    lists), restored in place. Every rank must hold the same state after each step (pure
    data parallelism): a peer's copy replaces this rank's one as it is.
    """

    def __init__(
        self,
        model: Stateful,
        optimizer: Stateful | None = None,
        extra: Stateful | dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra = extra

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
        if isinstance(self.extra, dict):
            state["extra"] = dict(self.extra)
        elif self.extra is not None:
            state["extra"] = self.extra.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        expected = {"model"} | {
            name for name in ("optimizer", "extra") if getattr(self, name) is not None
        }
        if set(state_dict) != expected:
            raise ValueError(
                f"TrainState: state has parts {sorted(state_dict)}, this run has {sorted(expected)}"
            )
        self.model.load_state_dict(state_dict["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state_dict["optimizer"])
        if isinstance(self.extra, dict):
            self.extra.clear()
            self.extra.update(state_dict["extra"])
        elif self.extra is not None:
            self.extra.load_state_dict(state_dict["extra"])
