"""State sync at the start of an attempt: the ranks that lack state get it from a peer.

Every rank offers ``(has_state, steps, shard)`` (``steps``: the number of completed steps
its state holds; ``shard``: which shards it holds, :func:`trainguard.resilient.fsdp.shard_key`,
the same on every rank of a data-parallel job) through an ``all_gather``. The ranks that
hold the same shards are their holders: for each shard, the source is the lowest holder
with the most completed steps of the job, and it sends its state to every holder of that
shard without state or behind it, point to point (``send``/``recv``). An HSDP rank thus
takes its shards from the rank at its place in another replica. When some shard has no
holder at that step (plain FSDP or tensor parallelism lost a rank: no replica of its
shards in memory), no peer can make the job whole, and every rank restores from the
checkpoint tiers (``fallback()``) instead: the survivors roll back to the newest step the
tiers hold for every rank. Nothing is pickled: a header (three int64: metadata length,
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
from trainguard.resilient.dtensors import globalise, localise
from trainguard.resilient.fsdp import shard_key
from trainguard.resilient.protocol import StateSource
from trainguard.resilient.run import Progress
from trainguard.resilient.state import State

__all__ = [
    "Offer",
    "SyncPlan",
    "Transfer",
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
    """What one rank holds: whether it has state, how many steps that state completed, and
    which shards (equal on the ranks that hold the same ones)."""

    has_state: bool
    steps: int
    shard: int = 0


@dataclass(frozen=True)
class Transfer:
    """``source`` sends its state to ``receivers`` (the holders of the same shards)."""

    source: int
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class SyncPlan:
    """The transfers, the step everyone resumes at, and whether every rank restores from
    the checkpoint tiers instead (no rank holds state, or some shard has no holder at the
    newest step: ``reason`` says which)."""

    transfers: tuple[Transfer, ...]
    steps: int
    restore: bool = False
    reason: str = ""

    def source_of(self, rank: int) -> int | None:
        """The rank ``rank`` receives from, if any."""
        return next((t.source for t in self.transfers if rank in t.receivers), None)


def plan_sync(offers: Sequence[Offer]) -> SyncPlan:
    """For each shard, the lowest holder with the job's most completed steps sends to the
    holders of that shard without state or behind it (see the module doc)."""
    holders = [(rank, o) for rank, o in enumerate(offers) if o.has_state]
    if not holders:
        return SyncPlan((), 0, restore=True, reason="no rank holds state")
    steps = max(o.steps for _, o in holders)
    transfers: list[Transfer] = []
    for shard in sorted({o.shard for o in offers}):
        current = [rank for rank, o in holders if o.shard == shard and o.steps == steps]
        if not current:
            return SyncPlan(
                (), steps, restore=True, reason=f"no rank holds shard {shard} at step {steps}"
            )
        receivers = tuple(
            rank
            for rank, o in enumerate(offers)
            if o.shard == shard and (not o.has_state or o.steps < steps)
        )
        if receivers:
            transfers.append(Transfer(min(current), receivers))
    return SyncPlan(tuple(transfers), steps)


def exchange_offers(offer: Offer) -> list[Offer]:
    """Every rank's offer, in rank order (a collective on the control group)."""
    mine = torch.tensor([int(offer.has_state), offer.steps, offer.shard], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine, group=control_group())
    return [Offer(bool(t[0].item()), int(t[1].item()), int(t[2].item())) for t in gathered]


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
    local, dtensors = localise(capture(state))
    layout, tensors = flatten({"state": local})
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
        "dtensors": dtensors,
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
    globalise(built["state"], raw.get("dtensors") or [])
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
    offer = Offer(progress.has_state, progress.steps, shard_key())
    plan = plan_sync(exchange_offers(offer))
    source: StateSource
    sender = plan.source_of(rank)
    if plan.restore:
        if progress.has_state and fallback is None:
            raise RuntimeError(
                f"rank {rank}: {plan.reason}, and there are no checkpoint tiers to roll back "
                "to (resilient.loop's checkpoints, or restartable's fallback)"
            )
        steps = fallback() if fallback is not None else None
        progress.steps = steps or 0
        source = "none" if steps is None else "checkpoint"
        detail = "no checkpoint" if steps is None else f"checkpoint at step {steps}"
        if progress.has_state:
            detail += f" ({plan.reason})"
    elif sender is not None:
        started = time.perf_counter()
        progress.steps, nbytes = receive_state(state, sender)
        source = "peer"
        detail = (
            f"peer rank {sender} at step {progress.steps} "
            f"({nbytes / 1e6:.1f} MB in {time.perf_counter() - started:.3f} s)"
        )
    else:
        for transfer in plan.transfers:
            if transfer.source == rank:
                send_state(state, progress.steps, transfer.receivers)
        source = "self"
        detail = f"own memory at step {progress.steps}"
    progress.has_state = True
    return source, detail
