"""Objects in a state, read when it is saved and restored through their own methods.

torch.distributed.checkpoint's convention: a value with ``state_dict()`` and
``load_state_dict()`` (a module, an optimizer, a scheduler, :class:`RNGState`, a user's
object) stands for its state. :meth:`Checkpointer.save` reads ``state_dict()`` of each such
object *at that save*; :meth:`Checkpointer.load_latest` restores into what
``state_dict()`` returns then (in place: a module's parameters directly), and hands each
object its part with ``load_state_dict()``. So a state of objects cannot go stale, as a
``{"optim": optimizer.state_dict()}`` built once does (an Adam's state dict has no moments
before its first step, ``torch.get_rng_state()`` is a copy): nothing can tell such a
captured value from a right one, so the documented way passes the objects.

:func:`capture` and :func:`apply` are the two halves; the resilient state sync uses them
too. Objects may sit at any depth of the state's dicts, lists and tuples (not inside what a
``state_dict()`` returns). A container without one is used as it is (restored in place,
as before); one with one is copied, and :func:`apply` puts the restored values back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Stateful", "apply", "capture", "is_stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()``/``load_state_dict()``: a module, an optimizer, ..."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


def is_stateful(value: object) -> bool:
    """Whether ``value`` stands for its ``state_dict()`` (containers and tensors never do)."""
    if isinstance(value, (torch.Tensor, dict, list, tuple, str, int, float)) or value is None:
        return False
    return isinstance(value, Stateful)


def capture(state: Any, prepare: Callable[[Any], None] | None = None) -> Any:
    """``state`` with each object replaced by its ``state_dict()``, read now (after
    ``prepare(object)``, when given: a restore readies an optimizer's state first).

    Containers that hold no object are returned as they are (the same object); the others
    are shallow copies.
    """
    if isinstance(state, dict):
        items = {key: capture(value, prepare) for key, value in state.items()}
        return state if all(items[key] is value for key, value in state.items()) else items
    if isinstance(state, (list, tuple)):
        values = [capture(value, prepare) for value in state]
        if all(new is old for new, old in zip(values, state, strict=True)):
            return state
        return values if isinstance(state, list) else tuple(values)
    if is_stateful(state):
        if prepare is not None:
            prepare(state)
        return state.state_dict()
    return state


def apply(state: Any, restored: Any) -> Any:
    """Hand each object of ``state`` its part of ``restored`` (``load_state_dict``) and put
    the other restored values into ``state``'s containers; returns what ``state``'s own
    container should hold in its place (``state`` itself for a mutable container).

    ``restored`` is what :func:`capture` gave, restored in place, or a tree of the same
    shape built from nothing (a peer's state). A tensor is copied into ``state``'s tensor
    when their shapes and dtypes agree (references to it stay valid), else replaced.
    """
    if restored is state:
        return state  # captured as it was, and restored in place
    if is_stateful(state):
        state.load_state_dict(restored)
        return state
    if isinstance(state, dict) and isinstance(restored, dict):
        for key, value in restored.items():
            state[key] = apply(state.get(key), value)
        return state
    if isinstance(state, list) and isinstance(restored, list) and len(state) == len(restored):
        for index, value in enumerate(restored):
            state[index] = apply(state[index], value)
        return state
    if (
        isinstance(state, tuple)
        and isinstance(restored, (list, tuple))
        and len(state) == len(restored)
    ):
        return tuple(apply(old, new) for old, new in zip(state, restored, strict=True))
    if (
        isinstance(state, torch.Tensor)
        and isinstance(restored, torch.Tensor)
        and state.shape == restored.shape
        and state.dtype == restored.dtype
    ):
        with torch.no_grad():
            state.copy_(restored)
        return state
    return restored
