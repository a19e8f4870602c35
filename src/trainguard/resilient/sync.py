"""State sync at the start of an attempt: the ranks that lack state get it from peers.

Every rank offers ``(has_state, steps, shard)`` (``steps``: the number of completed steps
its state holds; ``shard``: which shards it holds, :func:`trainguard.resilient.fsdp.shard_key`,
the same on every rank of a data-parallel job) through an ``all_gather``. The ranks that
hold the same shards at the job's most completed steps are those shards' holders
(:func:`holders`; in DDP every survivor): they send them to every rank of the same shards
without state or behind it, and the lowest of them is the plan's source for those ranks
(:class:`Transfer`). An HSDP rank thus takes its shards from the ranks at its place in
the other replicas. When some shard has no holder at that step (plain FSDP or tensor
parallelism lost a rank: no replica of its shards in memory), no peer can make the job
whole, and every rank restores from the checkpoint tiers (``fallback()``) instead: the
survivors roll back to the newest step the tiers hold for every rank.

The source sends a header and the metadata as JSON (step, tensor layout and devices, the
state's tree with its plain values, each DTensor's placement: DTensors travel as their
local shards, :mod:`trainguard.resilient.dtensors`), every other holder a header with its
layout's fingerprint, and then each holder sends a share of the tensors
(:mod:`trainguard.resilient.transfer`). Nothing is pickled. A receiver builds its state
from the metadata alone, so it does not need a matching structure of its own (a fresh
AdamW has no state before its first step), and receives each tensor into the state's own
tensor where one fits.

The offers, headers and metadata go over trainguard's control group (gloo, CPU tensors;
:func:`trainguard.collectives.control_group`). The data follows the tensors: CUDA
tensors over the default group when that group has NCCL for CUDA, the rest in host
memory over gloo. :func:`encode_state`/:func:`decode_state` turn a state into one buffer
and back (the same format, in one piece).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint.state import Layout, StateMismatch, TensorEntry, flatten, restore
from trainguard.checkpoint.stateful import apply, capture
from trainguard.collectives import control_group, device_backends
from trainguard.resilient.ddp import mark_in_sync
from trainguard.resilient.dtensors import globalise, localise
from trainguard.resilient.fsdp import shard_key
from trainguard.resilient.protocol import StateSource
from trainguard.resilient.run import StateProgress
from trainguard.resilient.spare_init import check_initialised
from trainguard.resilient.state import State
from trainguard.resilient.transfer import Route, transfer

__all__ = [
    "Offer",
    "Received",
    "SyncPlan",
    "Transfer",
    "data_device",
    "decode_state",
    "encode_state",
    "exchange_offers",
    "holders",
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
    return _metadata(steps, layout, tensors, dtensors), data


def _metadata(
    steps: int, layout: Layout, tensors: Sequence[torch.Tensor], dtensors: list[dict[str, Any]]
) -> bytes:
    """The JSON a receiver builds the state from: the step, the tensors' layout and
    devices, the state's tree with its plain values, each DTensor's placement."""
    meta = {
        "steps": steps,
        "entries": [e.to_json() for e in layout.entries],
        "devices": [t.device.type for t in tensors],
        "nbytes": layout.nbytes,
        "tree": layout.tree,
        "dtensors": dtensors,
    }
    return json.dumps(meta).encode()


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


@dataclass(frozen=True)
class Received:
    """What :func:`receive_state` loaded, and how long each phase took (seconds)."""

    steps: int
    nbytes: int
    layout_s: float  # the layout from the first source; the tensors to receive into
    data_s: float  # the bytes, from every source at once
    load_s: float  # handing the received tensors to the state's objects

    def describe(self) -> str:
        rate = self.nbytes / self.data_s / 1e9 if self.data_s > 0 else 0.0
        return (
            f"{self.nbytes / 1e6:.1f} MB in {self.layout_s + self.data_s + self.load_s:.3f} s: "
            f"layout {self.layout_s:.3f} s, data {self.data_s:.3f} s ({rate:.2f} GB/s), "
            f"load {self.load_s:.3f} s"
        )


def holders(offers: Sequence[Offer], steps: int, shard: int = 0) -> tuple[int, ...]:
    """The ranks whose state of ``shard`` completed ``steps``: each sends a share of it."""
    return tuple(
        rank
        for rank, o in enumerate(offers)
        if o.has_state and o.steps == steps and o.shard == shard
    )


def _digest(entries: Sequence[TensorEntry]) -> int:
    """A fingerprint of a layout: the sources of one transfer must agree on it."""
    text = json.dumps([e.to_json() for e in entries]).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little", signed=True)


def send_state(
    state: State, steps: int, receivers: Sequence[int], sources: Sequence[int] = ()
) -> int:
    """Send ``state`` (having completed ``steps``) to each receiver, a share from each of
    ``sources`` (this rank alone when empty; every one of them calls this); returns the
    bytes this rank sent. The lowest source also sends the layout."""
    rank = dist.get_rank()
    senders = tuple(sorted(sources)) or (rank,)
    local, dtensors = localise(capture(state))
    layout, tensors = flatten({"state": local})
    meta = b""
    if rank == senders[0]:
        meta = _metadata(steps, layout, tensors, dtensors)
    header = torch.tensor([len(meta), _digest(layout.entries)], dtype=torch.int64)
    control = control_group()
    for receiver in receivers:
        dist.send(header, receiver, group=control)
        if meta:
            dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), receiver, group=control)
    route = Route(tuple(range(len(tensors))), senders, tuple(receivers))
    return len(meta) * len(receivers) + transfer(list(tensors), [route], control)


def receive_state(
    state: State, source: int, sources: Sequence[int] = (), receivers: Sequence[int] = ()
) -> Received:
    """Load the state ``sources`` send (``source`` alone when empty) into ``state``.

    Each tensor is received into the state's own tensor where their key path, shape, dtype
    and device kind match (a model's parameters, an optimizer's moments), so it is neither
    unpacked nor copied again by ``load_state_dict``; anything else into a new tensor on
    the device kind it had on the sender (this process's current CUDA device for a CUDA
    one, host memory without CUDA), which ``load_state_dict`` then takes."""
    began = time.perf_counter()
    senders = tuple(sorted(sources)) or (source,)
    control = control_group()
    header = torch.empty(2, dtype=torch.int64)
    dist.recv(header, senders[0], group=control)
    meta_tensor = torch.empty(int(header[0].item()), dtype=torch.uint8)
    dist.recv(meta_tensor, senders[0], group=control)
    raw: dict[str, Any] = json.loads(meta_tensor.numpy().tobytes())
    entries = [TensorEntry.from_json(e) for e in raw["entries"]]
    digest = _digest(entries)
    for other in senders[1:]:
        dist.recv(header, other, group=control)
        if int(header[1].item()) != digest:
            raise StateMismatch(f"rank {other}'s state is laid out unlike rank {senders[0]}'s")
    targets = _targets(state, entries, raw.get("devices") or ["cpu"] * len(entries))
    receiving = time.perf_counter()
    rank = dist.get_rank()
    route = Route(tuple(range(len(entries))), senders, tuple(receivers) or (rank,))
    nbytes = meta_tensor.numel() + transfer(list(targets), [route], control)
    loading = time.perf_counter()
    built = _unflatten(raw["tree"], targets)["state"]
    globalise(built, raw.get("dtensors") or [])
    apply(state, built)
    done = time.perf_counter()
    return Received(
        int(raw["steps"]), nbytes, receiving - began, loading - receiving, done - loading
    )


def _targets(
    state: State, entries: Sequence[TensorEntry], kinds: Sequence[str]
) -> list[torch.Tensor]:
    """The tensors to receive ``entries`` into: ``state``'s own where they fit, else new."""
    layout, own = flatten({"state": localise(capture(state))[0]})
    mine = {entry.path: tensor for entry, tensor in zip(layout.entries, own, strict=True)}
    cuda = torch.cuda.is_available()
    targets = []
    for entry, kind in zip(entries, kinds, strict=True):
        device = (
            torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" and cuda else None
        )
        have = mine.get(entry.path)
        if (
            have is not None
            and tuple(have.shape) == entry.shape
            and have.dtype == entry.torch_dtype()
            and have.device.type == (device or torch.device("cpu")).type
            and have.is_contiguous()
        ):
            targets.append(have.detach())
        else:
            targets.append(torch.empty(entry.shape, dtype=entry.torch_dtype(), device=device))
    return targets


def _unflatten(tree: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The structure ``tree`` describes (:func:`flatten`'s), holding ``tensors`` themselves."""
    if not isinstance(tree, dict) or len(tree) != 1:
        raise StateMismatch("malformed state tree from the peer")
    ((kind, value),) = tree.items()
    if kind == "t":
        return tensors[int(value)]
    if kind == "v":
        return value
    if kind == "d":
        return {key: _unflatten(child, tensors) for key, child in value}
    if kind in ("l", "u"):
        children = [_unflatten(child, tensors) for child in value]
        return children if kind == "l" else tuple(children)
    raise StateMismatch(f"malformed state tree from the peer ({kind!r})")


def synchronise(
    state: State, progress: StateProgress, fallback: Callable[[], int | None] | None
) -> tuple[StateSource, str]:
    """Bring every rank to the same state; returns this rank's source and a description.

    With no rank holding state (or a shard without a holder at the newest step), every
    rank calls ``fallback()`` (which restores the state from a checkpoint and returns the
    number of completed steps, or None); without a checkpoint the run starts at step 0
    from the state as initialised.
    """
    rank = dist.get_rank()
    offers = exchange_offers(Offer(progress.has_state, progress.steps, shard_key()))
    plan = plan_sync(offers)
    source: StateSource
    sender = plan.source_of(rank)
    if plan.restore:
        if progress.has_state and fallback is None:
            raise RuntimeError(
                f"rank {rank}: {plan.reason}, and there are no checkpoint tiers to roll back "
                "to (resilient.loop's checkpoints, or restartable's fallback)"
            )
        steps = fallback() if fallback is not None else None
        if steps is None:
            check_initialised()  # a spare that skipped its init has nothing to start from
        progress.steps = steps or 0
        source = "none" if steps is None else "checkpoint"
        detail = "no checkpoint" if steps is None else f"checkpoint at step {steps}"
        if progress.has_state:
            detail += f" ({plan.reason})"
    elif sender is not None:
        mine = offers[rank].shard
        sources = holders(offers, plan.steps, mine)
        receivers = next(t.receivers for t in plan.transfers if rank in t.receivers)
        progress.has_state = False  # received in place: a partial state is no state
        received = receive_state(state, sender, sources, receivers)
        progress.steps = received.steps
        source = "peer"
        others = ",".join(str(r) for r in sources if r != sender)
        detail = (
            f"peer rank {sender}{f' with ranks {others}' if others else ''} "
            f"at step {progress.steps} ({received.describe()})"
        )
    else:
        for transfer in plan.transfers:
            sources = holders(offers, plan.steps, offers[transfer.source].shard)
            if rank in sources:
                send_state(state, progress.steps, transfer.receivers, sources)
        source = "self"
        detail = f"own memory at step {progress.steps}"
    mark_in_sync(not plan.restore)  # one state everywhere: DDP need not broadcast it
    progress.has_state = True
    return source, detail
