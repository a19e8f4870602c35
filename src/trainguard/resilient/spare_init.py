""":func:`no_init_on_spare`: a hot spare builds its model without initialising it.

A hot spare that takes a rank over receives the whole state (parameters, optimizer state)
from a peer right after it builds its model: the random values the model's constructor
draws are overwritten before anything reads them. Drawing them is on the recovery's
critical path (about 1 s per GB of parameters here: ``uniform_``/``normal_`` over every
weight), so a script builds its model inside ``with resilient.no_init_on_spare():``.
In a hot spare, the context skips every in-place random fill (``uniform_``, ``normal_``,
``bernoulli_``, ..., and ``torch.nn.init``'s random initialisers, which
``reset_parameters`` uses), leaving the
tensors as ``torch.empty`` made them; everywhere else (a rank of the first attempt, plain
torchrun, plain python) it does nothing.

What the script keeps to: only state that a peer hands over (what is in the loop's
``state``) is built inside the context; a random tensor that is not in it (a fixed
random projection kept as a plain attribute, a non-persistent buffer) is built outside.
The spare never starts from its own values: when no rank holds state (every rank was
replaced) and no checkpoint has one either, the state sync raises
:class:`UninitialisedState` rather than train from uninitialised memory, and the process
exits (a process-level restart, whose new processes initialise as usual).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["UninitialisedState", "check_initialised", "mark_spare", "no_init_on_spare", "warm_up"]

_TENSOR_FILLS = ("uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_")
_INIT_FILLS = (  # torch.nn.init's random ones: the mode sees these, not the fills inside
    "uniform_",
    "normal_",
    "trunc_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "orthogonal_",
    "sparse_",
)
_RANDOM_FILLS = frozenset(
    [getattr(torch.Tensor, name) for name in (*_TENSOR_FILLS, "cauchy_", "log_normal_")]
    + [getattr(torch.nn.init, name) for name in _INIT_FILLS]
)
_skipped: list[bool] = []  # whether this process skipped an initialisation
_spare: list[bool] = []  # whether init_process_group started this process as a hot spare


class UninitialisedState(RuntimeError):
    """The state was built without initialisation and nothing overwrote it."""


class _SkipRandomFills(TorchFunctionMode):  # type: ignore[misc]  # torch: untyped
    """Returns the tensor of an in-place random fill unchanged."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            # torch.nn.init passes its tensor by keyword, a Tensor method as self
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor):
                _skipped[:] = [True]
                return target
        return func(*args, **kwargs)


@contextmanager
def no_init_on_spare(enabled: bool | None = None) -> Iterator[None]:
    """Inside, a hot spare skips in-place random fills (see the module doc).

    ``enabled``: None decides by this process (a hot spare under trainguard's in-process
    restarts); True or False forces it (tests, a script's own replacement logic).
    """
    if enabled is None:
        enabled = bool(_spare)
    if not enabled:
        yield
        return
    with _SkipRandomFills():
        yield


def mark_spare() -> None:
    """This process is a hot spare: :func:`init_process_group` started it as one."""
    _spare[:] = [True]


def warm_up() -> None:
    """Import, before a spare waits, what the script imports after the takeover anyway.

    The first optimizer a process makes imports ``torch._dynamo`` (with sympy: ~900
    modules), measured here at 1.0 s on a quiet machine and 10.9 s at load 20: all of it
    on the recovery's critical path when a spare builds its optimizer after it took a rank
    over. A platform where it does not import is left as it is (the script will tell).
    """
    with contextlib.suppress(Exception):  # the script's own import reports a failure
        import torch._dynamo  # noqa: F401  # the import is the point


def check_initialised() -> None:
    """Raise :class:`UninitialisedState` if this process skipped an initialisation (called
    when no rank holds state and no checkpoint restored it)."""
    if _skipped:
        raise UninitialisedState(
            "this hot spare built its state without initialising it "
            "(resilient.no_init_on_spare), and neither a peer nor a checkpoint holds one"
        )
