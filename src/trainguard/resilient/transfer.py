"""The data path of a peer state transfer: named tensors, from source ranks to receivers.

Every participant calls :func:`transfer` with the same :class:`Route` list (a pure
function of what every rank agreed on: the state's layout and who holds it) and its own
tensors, indexed as the layout numbers them: a source the tensors it sends, a receiver the
tensors it receives into (its own where they fit, so nothing is unpacked or copied again
afterwards). Ranks in no route do nothing.

A route's tensors are cut into *pieces* (:func:`pieces`): a large tensor goes in slices
of at most ``chunk_bytes``, sent from and received into the tensor itself; small tensors
are packed together into buckets of up to ``bucket_bytes`` (one copy each side). Each
source of a route sends an equal share of the pieces (by bytes) to every receiver of the
route, all at once (``isend``/``irecv``: the sources' links and the receivers' links are
used in parallel, and a receiver unpacks a bucket while later pieces are still arriving).
A receiver's host memory is faulted in by a thread ahead of the data (a replacement's
tensors are fresh: :class:`~trainguard.checkpoint.host_memory.Prefault`).
In DDP every rank at the newest step holds the whole state, so a replacement takes it
from all of them at once; several replacements take it at the same time.

Where the bytes go: a piece of CUDA tensors goes over the default group when that group
has NCCL for CUDA (batched with ``batch_isend_irecv``, NCCL's way to post several
point-to-point operations); anything else over the gloo ``control`` group in host memory
(a CUDA tensor is staged through host memory then). Across hosts gloo uses the
interface ``GLOO_SOCKET_IFNAME`` names (torchrun's convention), else the one that reaches
the rendezvous host.

Assumptions: every source holds the same bytes for every tensor of its routes (the
caller checks that their layouts agree); a receiver's tensors are contiguous and of the
route's shapes and dtypes. A failure (a peer died mid-transfer) raises from the pending
work: the receivers' tensors are then partly written, and the caller treats their state
as lost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainguard.checkpoint.host_memory import Prefault
from trainguard.collectives import device_backends

__all__ = ["BUCKET_BYTES", "CHUNK_BYTES", "Piece", "Route", "pieces", "shares", "transfer"]

BUCKET_BYTES = 1 << 20
"""Tensors smaller than this are packed together, up to this many bytes a bucket."""
CHUNK_BYTES = 64 << 20
"""A larger tensor goes in slices of at most this many bytes."""
_IN_FLIGHT_BYTES = 256 << 20
"""A source packs at most this many bytes of buckets ahead of what has been sent."""


@dataclass(frozen=True)
class Route:
    """Tensors ``indices`` (of the layout every participant shares) go from ``sources``
    (each holds them all, and sends a share) to every one of ``receivers``."""

    indices: tuple[int, ...]
    sources: tuple[int, ...]
    receivers: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """One message: byte ranges ``(index, start, end)`` of tensors, sent as one buffer.

    ``packed``: several small tensors (whole) copied into a bucket; otherwise one slice
    of one tensor, sent from and received into the tensor itself."""

    parts: tuple[tuple[int, int, int], ...]
    packed: bool

    @property
    def nbytes(self) -> int:
        return sum(end - start for _, start, end in self.parts)


def pieces(
    sizes: Sequence[tuple[int, int]],
    bucket_bytes: int = BUCKET_BYTES,
    chunk_bytes: int = CHUNK_BYTES,
) -> list[Piece]:
    """The messages for tensors ``(index, nbytes)``, in order: small ones packed into
    buckets, large ones cut into slices (a pure function: every rank gets the same)."""
    result: list[Piece] = []
    bucket: list[tuple[int, int, int]] = []
    filled = 0
    for index, nbytes in sizes:
        if nbytes == 0:
            continue
        if nbytes < bucket_bytes:
            if filled + nbytes > bucket_bytes:
                result.append(Piece(tuple(bucket), packed=True))
                bucket, filled = [], 0
            bucket.append((index, 0, nbytes))
            filled += nbytes
            continue
        for start in range(0, nbytes, chunk_bytes):
            result.append(Piece(((index, start, min(nbytes, start + chunk_bytes)),), False))
    if bucket:
        result.append(Piece(tuple(bucket), packed=True))
    return result


def shares(items: Sequence[Piece], sources: int) -> list[list[Piece]]:
    """``items`` split into ``sources`` runs of about equal bytes, in order."""
    total = sum(piece.nbytes for piece in items)
    runs: list[list[Piece]] = [[] for _ in range(sources)]
    done = 0
    for piece in items:
        # The piece goes to the source whose share its middle byte falls in.
        middle = done + piece.nbytes // 2
        runs[min(sources - 1, middle * sources // max(total, 1))].append(piece)
        done += piece.nbytes
    return runs


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 view (it must be contiguous)."""
    return tensor.reshape(-1).view(torch.uint8)


def _wire(tensor: torch.Tensor, nccl: bool) -> torch.device:
    """Where a tensor's bytes travel: its GPU over NCCL, else host memory over gloo."""
    return tensor.device if tensor.is_cuda and nccl else torch.device("cpu")


class _Posted:
    """The works posted so far on one group, to wait for."""

    def __init__(self, group: dist.ProcessGroup | None, batched: bool) -> None:
        self.group = group
        self.batched = batched  # NCCL: post as one batch_isend_irecv
        self.ops: list[dist.P2POp] = []
        self.works: list[dist.Work] = []

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        if self.batched:
            self.ops.append(dist.P2POp(dist.isend, tensor, peer, self.group, tag))
        else:
            self.works.append(_posted(dist.isend(tensor, peer, group=self.group, tag=tag)))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> dist.Work | None:
        if self.batched:
            self.ops.append(dist.P2POp(dist.irecv, tensor, peer, self.group, tag))
            return None
        work = _posted(dist.irecv(tensor, peer, group=self.group, tag=tag))
        self.works.append(work)
        return work

    def flush(self) -> None:
        if self.ops:
            self.works.extend(dist.batch_isend_irecv(self.ops))
            self.ops = []

    def wait(self, work: dist.Work | None = None) -> None:
        """Wait for ``work`` (one this posted), or for every posted one.

        Each only once: a gloo work waited for twice waits for a message that never comes.
        """
        if work is not None:
            if any(posted is work for posted in self.works):  # else waited for already
                self.works = [posted for posted in self.works if posted is not work]
                work.wait()
            return
        self.flush()
        for posted in self.works:
            posted.wait()
        self.works = []


def _posted(work: dist.Work | None) -> dist.Work:
    assert work is not None, "isend/irecv return a work for a rank of the group"
    return work


def transfer(
    tensors: Sequence[torch.Tensor | None],
    routes: Sequence[Route],
    control: dist.ProcessGroup | None,
    *,
    bucket_bytes: int | None = None,
    chunk_bytes: int | None = None,
) -> int:
    """Move each route's tensors from its sources to its receivers (see the module doc);
    returns the bytes this rank sent or received.

    ``tensors[i]``: this rank's tensor ``i`` (None where it takes part in no route of
    ``i``); ``control``: the gloo group for host-memory pieces (None: the default group);
    ``bucket_bytes``/``chunk_bytes``: :data:`BUCKET_BYTES`/:data:`CHUNK_BYTES` when None.
    """
    bucket_bytes = bucket_bytes or BUCKET_BYTES
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    rank = dist.get_rank()
    nccl = device_backends().get("cuda") == "nccl"
    host = _Posted(control, batched=False)
    device = _Posted(None, batched=True)
    unpack: list[tuple[dist.Work | None, torch.Tensor, Piece]] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received on host, destination)
    moved_out: dict[int, torch.Tensor] = {}  # tensors copied to where they travel
    arriving: dict[int, list[tuple[int, int]]] = {}  # source -> host ranges, in order
    moved = 0
    tag = 0
    for route in routes:
        if rank not in route.sources and rank not in route.receivers:
            continue
        mine = [(i, _tensor(tensors, i)) for i in route.indices]
        sizes = [(i, t.numel() * t.element_size()) for i, t in mine]
        # Pieces never mix where they travel (a bucket is on one device).
        wires = {i: _wire(t, nccl) for i, t in mine}
        for wire in dict.fromkeys(wires.values()):
            posted = device if wire.type == "cuda" else host
            items = pieces([s for s in sizes if wires[s[0]] == wire], bucket_bytes, chunk_bytes)
            split = shares(items, len(route.sources))
            in_flight = 0
            for source, share in zip(route.sources, split, strict=True):
                for piece in share:
                    tag += 1
                    if rank == source:
                        buffer = _outgoing(piece, tensors, wire, moved_out)
                        for receiver in route.receivers:
                            if receiver != rank:
                                posted.send(buffer, receiver, tag)
                                moved += piece.nbytes
                        in_flight += piece.nbytes if piece.packed else 0
                        if in_flight > _IN_FLIGHT_BYTES:  # bound the packed copies
                            posted.wait()
                            in_flight = 0
                    elif rank in route.receivers:
                        buffer, direct = _incoming(piece, tensors, wire)
                        if direct and buffer.device.type == "cpu":
                            arriving.setdefault(source, []).append(
                                (buffer.data_ptr(), piece.nbytes)
                            )
                        work = posted.recv(buffer, source, tag)
                        moved += piece.nbytes
                        if piece.packed:
                            unpack.append((work, buffer, piece))
                        elif not direct:
                            staged.append((buffer, _slice(tensors, piece.parts[0])))
    with Prefault(list(arriving.values())):
        _complete(host, device, unpack, staged, tensors)
    return moved


def _complete(
    host: _Posted,
    device: _Posted,
    unpack: Sequence[tuple[dist.Work | None, torch.Tensor, Piece]],
    staged: Sequence[tuple[torch.Tensor, torch.Tensor]],
    tensors: Sequence[torch.Tensor | None],
) -> None:
    """Wait for the posted pieces, unpacking each bucket as it arrives, then copy the
    pieces staged in host memory to their devices."""
    host.flush()
    device.flush()
    with torch.no_grad():
        for work, buffer, piece in unpack:  # while later pieces still arrive
            if work is not None:
                host.wait(work)
            else:
                device.wait()
            offset = 0
            for part in piece.parts:
                _, start, end = part
                _slice(tensors, part).copy_(buffer[offset : offset + end - start])
                offset += end - start
        host.wait()
        device.wait()
        for buffer, target in staged:
            target.copy_(buffer)


def _tensor(tensors: Sequence[torch.Tensor | None], index: int) -> torch.Tensor:
    tensor = tensors[index]
    if tensor is None:
        raise ValueError(f"transfer: tensor {index} is in a route of this rank but not given")
    return tensor


def _slice(tensors: Sequence[torch.Tensor | None], part: tuple[int, int, int]) -> torch.Tensor:
    """A receiver's bytes ``part`` of its tensor (a view: the tensor is contiguous)."""
    index, start, end = part
    tensor = _tensor(tensors, index)
    if not tensor.is_contiguous():
        raise ValueError(f"transfer: a receiver's tensor {index} is not contiguous")
    return _flat(tensor)[start:end]


def _outgoing(
    piece: Piece,
    tensors: Sequence[torch.Tensor | None],
    wire: torch.device,
    moved_out: dict[int, torch.Tensor],
) -> torch.Tensor:
    """The buffer a source sends for ``piece``: the tensor's own slice where it can, else
    a slice of its copy where it travels (``moved_out``: one copy for all its slices)."""
    if not piece.packed:
        index, start, end = piece.parts[0]
        tensor = _tensor(tensors, index).detach()
        if tensor.device == wire and tensor.is_contiguous():
            return _flat(tensor)[start:end]
        if index not in moved_out:
            moved_out[index] = tensor.to(wire).contiguous()
        return _flat(moved_out[index])[start:end]
    buffer = torch.empty(piece.nbytes, dtype=torch.uint8, device=wire)
    offset = 0
    with torch.no_grad():
        for index, start, end in piece.parts:
            tensor = _tensor(tensors, index).detach()
            source = tensor if tensor.is_contiguous() else tensor.contiguous()
            buffer[offset : offset + end - start].copy_(_flat(source)[start:end])
            offset += end - start
    return buffer


def _incoming(
    piece: Piece, tensors: Sequence[torch.Tensor | None], wire: torch.device
) -> tuple[torch.Tensor, bool]:
    """The buffer a receiver receives ``piece`` into, and whether it is the destination."""
    if not piece.packed and _tensor(tensors, piece.parts[0][0]).device == wire:
        return _slice(tensors, piece.parts[0]), True
    return torch.empty(piece.nbytes, dtype=torch.uint8, device=wire), False
