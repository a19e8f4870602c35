"""State sync at the start of an attempt: the ranks that lack state get it from a peer.

Every rank offers ``(has_state, steps)`` (``steps``: the number of completed steps its
state holds) through an ``all_gather``. The source is the lowest rank with the most
completed steps; it sends its state to every rank without state or behind it, point to
point (``send``/``recv``). Nothing is pickled: a header (three int64: metadata length,
data length, whether the data is a CUDA tensor), the metadata as JSON bytes (step,
tensor layout and devices, the state's tree with its plain values), then every tensor
packed into one uint8 buffer. A receiver builds its state from the metadata alone, so it
does not need a matching structure of its own (a fresh AdamW has no state before its
first step).

The offers, headers and metadata go over trainguard's control group (gloo, CPU tensors;
:func:`trainguard.collectives.control_group`). The data follows the tensors: a state
with CUDA tensors is packed on the GPU and sent over the default group when that group
has NCCL for CUDA; otherwise it is packed in host memory and sent over gloo.
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
from trainguard.checkpoint.stateful import apply, capture
from trainguard.collectives import control_group, device_backends
from trainguard.resilient.protocol import StateSource
from trainguard.resilient.run import Progress
from trainguard.resilient.state import State

__all__ = [
    "Offer",
    "SyncPlan",
    "data_device",
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
    """Every rank's offer, in rank order (a collective on the control group)."""
    mine = torch.tensor([int(offer.has_state), offer.steps], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine, group=control_group())
    return [Offer(bool(t[0].item()), int(t[1].item())) for t in gathered]


def data_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where the sync buffer lives: the GPU of the first CUDA tensor when the default
    group moves CUDA tensors over NCCL, else host memory."""
    first = next((tensor for tensor in tensors if tensor.is_cuda), None)
    if first is not None and device_backends().get("cuda") == "nccl":
        return first.device
    return torch.device("cpu")


def encode_state(
    state: State, steps: int, device: torch.device | None = None
) -> tuple[bytes, torch.Tensor]:
    """``state`` as JSON metadata and one uint8 buffer (on ``device``) of every tensor."""
    layout, tensors = flatten({"state": capture(state)})
    where = device if device is not None else data_device(tensors)
    data = torch.empty(layout.nbytes, dtype=torch.uint8, device=where)
    with torch.no_grad():
        for entry, tensor in zip(layout.entries, tensors, strict=True):
            entry.view(data).copy_(tensor.detach())
    meta = {
        "steps": steps,
        "entries": [e.to_json() for e in layout.entries],
        "devices": [t.device.type for t in tensors],
        "nbytes": layout.nbytes,
        "tree": layout.tree,
    }
    return json.dumps(meta).encode(), data


def decode_state(state: State, meta: bytes, data: torch.Tensor) -> int:
    """Load what :func:`encode_state` produced into ``state``; returns its steps.

    A tensor the state lacks is made on the device type it had on the sender (this
    process's current CUDA device for a CUDA one, host memory without CUDA).
    """
    raw: dict[str, Any] = json.loads(meta)
    entries = [TensorEntry.from_json(e) for e in raw["entries"]]
    kinds = raw.get("devices") or ["cpu"] * len(entries)
    cuda = torch.cuda.is_available()
    devices = [torch.device("cuda" if kind == "cuda" and cuda else "cpu") for kind in kinds]
    built: dict[str, Any] = {}
    restore(built, Layout(entries, int(raw["nbytes"]), raw["tree"]), data, devices)
    apply(state, built["state"])
    return int(raw["steps"])


def send_state(state: State, steps: int, receivers: Sequence[int]) -> int:
    """Send ``state`` (having completed ``steps``) to each receiver; returns the bytes sent."""
    meta, data = encode_state(state, steps)
    meta_tensor = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
    header = torch.tensor([len(meta), data.numel(), int(data.is_cuda)], dtype=torch.int64)
    control = control_group()
    for rank in receivers:
        dist.send(header, rank, group=control)
        dist.send(meta_tensor, rank, group=control)
        dist.send(data, rank, group=None if data.is_cuda else control)
    return len(receivers) * (len(meta) + int(data.numel()))


def receive_state(state: State, source: int) -> tuple[int, int]:
    """Load the state ``source`` sends into ``state``; returns (steps, bytes received)."""
    control = control_group()
    header = torch.empty(3, dtype=torch.int64)
    dist.recv(header, source, group=control)
    meta_tensor = torch.empty(int(header[0].item()), dtype=torch.uint8)
    dist.recv(meta_tensor, source, group=control)
    on_cuda = bool(header[2].item())
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else None
    data = torch.empty(int(header[1].item()), dtype=torch.uint8, device=device)
    dist.recv(data, source, group=None if on_cuda else control)
    steps = decode_state(state, meta_tensor.numpy().tobytes(), data)
    return steps, meta_tensor.numel() + data.numel()


def synchronise(
    state: State, progress: Progress, fallback: Callable[[], int | None] | None
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
