""":class:`DistributedDataParallel`: torch's DDP, made again for each attempt's group.

A DDP binds to the process group that is up when it is made; after an in-process restart
that group is gone. This stand-in takes the same arguments, makes the DDP at its first
use (a call, or any attribute DDP has) and again at the first use after the default group
changed, and registers the communication hooks it was given on each one. Made inside the
training loop, never at construction: a hot spare runs the line that constructs it while
the other ranks are in the loop, and making a DDP is a collective (it broadcasts the
module's state from rank 0). ``module``, ``parameters()``, ``train()`` and ``eval()`` are
the module's and make nothing.

After a fault the ranks' state was just synchronised from the holders of the newest step
(:mod:`trainguard.resilient.sync` calls :func:`mark_in_sync`): every rank holds the same
parameters and buffers, so the DDP made for that attempt skips its initial broadcast
(torch's ``init_sync=False``; at 1.5 GB of state that broadcast cost seconds), unless the
script passed ``init_sync`` itself. The first attempt's DDP, and one after a restore from
a checkpoint, broadcasts as torch's does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as TorchDDP

__all__ = ["DistributedDataParallel", "mark_in_sync"]

_in_sync: list[int] = []  # id() of the default group whose ranks hold one state


def mark_in_sync(in_sync: bool) -> None:
    """Whether every rank of the current default group now holds the same state (set at
    each attempt's state sync; a DDP made on that group then skips its broadcast)."""
    _in_sync[:] = [id(dist.group.WORLD)] if in_sync else []


class DistributedDataParallel:
    """``torch.nn.parallel.DistributedDataParallel(module, *args, **kwargs)``, for the
    current attempt's process group (see the module doc)."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        self.module = module
        self._args = args
        self._kwargs = kwargs
        self._hooks: list[tuple[object, Callable[..., Any]]] = []
        self._ddp: TorchDDP | None = None
        self._group: object = None  # the default group self._ddp was made on

    @property
    def ddp(self) -> TorchDDP:
        """The DDP of the current default group (made now if it has none yet)."""
        group = dist.group.WORLD
        if self._ddp is None or self._group is not group:
            self._ddp = None  # the old one (and its group) goes before the new one is made
            kwargs = dict(self._kwargs)
            if _in_sync == [id(group)]:
                kwargs.setdefault("init_sync", False)
            made = TorchDDP(self.module, *self._args, **kwargs)
            for state, hook in self._hooks:
                made.register_comm_hook(state, hook)
            self._ddp, self._group = made, group
        return self._ddp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """Register ``hook`` on this DDP and on every one made after it."""
        self._hooks.append((state, hook))
        if self._ddp is not None:
            self._ddp.register_comm_hook(state, hook)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        parameters: Iterator[torch.nn.Parameter] = self.module.parameters(recurse)
        return parameters

    def train(self, mode: bool = True) -> DistributedDataParallel:
        self.module.train(mode)
        if self._ddp is not None:
            self._ddp.train(mode)
        return self

    def eval(self) -> DistributedDataParallel:
        return self.train(False)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (or a copy/pickle probe): never make a DDP
            raise AttributeError(name)
        return getattr(self.ddp, name)
