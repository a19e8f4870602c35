"""State sync at the start of an attempt: the ranks that lack state get it from a peer.

Every rank offers ``(has_state, steps)`` (``steps``: the number of completed steps its
state holds) through an ``all_gather``. The source is the lowest rank with the most
completed steps; it sends its state to every rank without state or behind it, point to
point (``send``/``recv``) on the attempt's process group. Nothing is pickled: a header
(two int64: metadata length, data length), the metadata as JSON bytes (step, tensor
layout, the state's tree with its plain values), then every tensor packed into one
uint8 buffer. A receiver builds its state from the metadata alone, so it does not need
a matching structure of its own (a fresh AdamW has no state before its first step).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.state import Layout, TensorEntry, flatten, restore
from trainguard.resilient.protocol import StateSource
from trainguard.resilient.run import Progress
from trainguard.resilient.state import Stateful

__all__ = [
    "Offer",
    "SyncPlan",
    "decode_state",
    "encode_state",
    "exchange_offers",
    "plan_sync",
    "receive_state",
    "send_state",
    "synchronise",
]


@dataclass(frozen=True)
class Offer:
    """What one rank holds: whether it has state, and how many steps that state completed."""

    has_state: bool
    steps: int


@dataclass(frozen=True)
class SyncPlan:
    """Who sends (None: no rank has state), who receives, and the step everyone resumes at."""

    source: int | None
    receivers: tuple[int, ...]
    steps: int


def plan_sync(offers: Sequence[Offer]) -> SyncPlan:
    """The source is the lowest rank with the most completed steps; the rest catch up to it."""
    holders = [(rank, o.steps) for rank, o in enumerate(offers) if o.has_state]
    if not holders:
        return SyncPlan(None, (), 0)
    steps = max(s for _, s in holders)
    source = min(rank for rank, s in holders if s == steps)
    receivers = tuple(rank for rank, o in enumerate(offers) if not o.has_state or o.steps < steps)
    return SyncPlan(source, receivers, steps)


def exchange_offers(offer: Offer) -> list[Offer]:
    """Every rank's offer, in rank order (a collective on the default group)."""
    mine = torch.tensor([int(offer.has_state), offer.steps], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [Offer(bool(t[0].item()), int(t[1].item())) for t in gathered]


def encode_state(state: Stateful, steps: int) -> tuple[bytes, torch.Tensor]:
    """``state`` as JSON metadata and one uint8 buffer holding every tensor."""
    layout, tensors = flatten({"state": state.state_dict()})
    data = torch.empty(layout.nbytes, dtype=torch.uint8)
    with torch.no_grad():
        for entry, tensor in zip(layout.entries, tensors, strict=True):
            entry.view(data).copy_(tensor.detach().cpu())
    meta = {
        "steps": steps,
        "entries": [e.to_json() for e in layout.entries],
        "nbytes": layout.nbytes,
        "tree": layout.tree,
    }
    return json.dumps(meta).encode(), data


def decode_state(state: Stateful, meta: bytes, data: torch.Tensor) -> int:
    """Load what :func:`encode_state` produced into ``state``; returns its steps."""
    raw: dict[str, Any] = json.loads(meta)
    entries = [TensorEntry.from_json(e) for e in raw["entries"]]
    built: dict[str, Any] = {}
    restore(built, Layout(entries, int(raw["nbytes"]), raw["tree"]), data)
    state.load_state_dict(built["state"])
    return int(raw["steps"])


def send_state(state: Stateful, steps: int, receivers: Sequence[int]) -> int:
    """Send ``state`` (having completed ``steps``) to each receiver; returns the bytes sent."""
    meta, data = encode_state(state, steps)
    meta_tensor = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    header = torch.tensor([len(meta), data.numel()], dtype=torch.int64)
    for rank in receivers:
        dist.send(header, rank)
        dist.send(meta_tensor, rank)
        dist.send(data, rank)
    return len(receivers) * (len(meta) + int(data.numel()))


def receive_state(state: Stateful, source: int) -> tuple[int, int]:
    """Load the state ``source`` sends into ``state``; returns (steps, bytes received)."""
    header = torch.empty(2, dtype=torch.int64)
    dist.recv(header, source)
    meta_tensor = torch.empty(int(header[0].item()), dtype=torch.uint8)
    dist.recv(meta_tensor, source)
    data = torch.empty(int(header[1].item()), dtype=torch.uint8)
    dist.recv(data, source)
    steps = decode_state(state, meta_tensor.numpy().tobytes(), data)
    return steps, meta_tensor.numel() + data.numel()


def synchronise(
    state: Stateful, progress: Progress, fallback: Callable[[], int | None] | None
) -> tuple[StateSource, str]:
    """Bring every rank to the same state; returns this rank's source and a description.

    With no rank holding state, every rank calls ``fallback()`` (which restores the state
    from a checkpoint and returns the number of completed steps, or None); without a
    checkpoint the run starts at step 0 from the state as initialised.
    """
    rank = dist.get_rank()
    plan = plan_sync(exchange_offers(Offer(progress.has_state, progress.steps)))
    source: StateSource
    if plan.source is None:
        steps = fallback() if fallback is not None else None
        progress.steps = steps or 0
        source = "none" if steps is None else "checkpoint"
        detail = "no checkpoint" if steps is None else f"checkpoint at step {steps}"
    elif rank in plan.receivers:
        started = time.perf_counter()
        progress.steps, nbytes = receive_state(state, plan.source)
        source = "peer"
        detail = (
            f"peer rank {plan.source} at step {progress.steps} "
            f"({nbytes / 1e6:.1f} MB in {time.perf_counter() - started:.3f} s)"
        )
    else:
        if rank == plan.source and plan.receivers:
            send_state(state, progress.steps, plan.receivers)
        source = "self"
        detail = f"own memory at step {progress.steps}"
    progress.has_state = True
    return source, detail
