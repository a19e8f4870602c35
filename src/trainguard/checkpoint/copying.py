"""Copies between a training state and a snapshot buffer in host memory, CUDA included.

CPU tensors are copied in place, synchronously. CUDA tensors are copied on a side stream
with ``non_blocking=True``, which runs at DMA speed when the host buffer is page-locked
(the memory tier registers its slots for CUDA): the side stream first waits for the work
already queued on the caller's stream (the step that produced the state), and the
caller's stream is then ordered after the copies, so a later optimizer step cannot
change a tensor before its copy has read it. (So a non-blocking save frees the CPU at
once, while the GPU's next kernels still queue behind the copies.) That ordering also
makes ``record_stream`` unneeded: a state tensor freed after the save is reused only by
work queued on the caller's stream, after the copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from trainguard.checkpoint.state import ALIGNMENT, TensorEntry

__all__ = [
    "CopyDone",
    "PinnedStaging",
    "copy_into",
    "copy_to_host",
    "has_cuda",
    "on_device",
    "synchronize_devices",
]


class CopyDone:
    """Completion of :func:`copy_to_host`: ``wait()`` blocks until every byte is in host
    memory (at once for CPU-only state); safe from another thread."""

    def __init__(self, events: Sequence[tuple[int, Any]] = ()) -> None:
        self._events = list(events)  # (device index, event recorded after its copies)
        self.device = self._events[0][0] if self._events else None
        """The (first) CUDA device copied from; None for CPU-only state."""

    def wait(self) -> None:
        for device, event in self._events:
            with on_device(device):  # a thread's current device is 0 until set
                event.synchronize()
        self._events.clear()


def on_device(device: int | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)``; nothing for None (CPU)."""
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


def has_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    return any(tensor.is_cuda for tensor in tensors)


_side_streams: dict[int, Any] = {}  # device index -> this process's copy stream


def _index(device: torch.device) -> int:
    return int(device.index if device.index is not None else torch.cuda.current_device())


def _side_stream(device: torch.device) -> Any:
    index = _index(device)
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def copy_to_host(
    buffer: torch.Tensor, entries: Sequence[TensorEntry], tensors: Sequence[torch.Tensor]
) -> CopyDone:
    """Copy each tensor into its entry's view of ``buffer`` (see :func:`copy_into`)."""
    return copy_into([entry.view(buffer) for entry in entries], tensors)


def copy_into(views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> CopyDone:
    """Copy each tensor into its view of a host buffer; CUDA ones asynchronously (see the
    module doc). The returned :class:`CopyDone` says when all are there."""
    if not has_cuda(tensors):  # one call for all: no per-tensor dispatch from Python
        if tensors:  # (it refuses empty lists)
            with torch.no_grad():
                torch._foreach_copy_(list(views), list(tensors))
        return CopyDone()
    events = []
    host_views: list[torch.Tensor] = []
    host_tensors: list[torch.Tensor] = []
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    with torch.no_grad():
        for view, tensor in zip(views, tensors, strict=True):
            if not view.numel():
                continue
            if tensor.is_cuda:
                by_device.setdefault(tensor.device, []).append((view, tensor))
            else:
                host_views.append(view)
                host_tensors.append(tensor)
        if host_views:
            torch._foreach_copy_(host_views, host_tensors)
        for device, pairs in by_device.items():
            caller = torch.cuda.current_stream(device)
            side = _side_stream(device)
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                for view, tensor in pairs:
                    view.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
            caller.wait_event(done)
            events.append((_index(device), done))
    return CopyDone(events)


def synchronize_devices(state_tensors: Sequence[torch.Tensor]) -> None:
    """Wait for the copies queued into ``state_tensors``' devices (after a restore)."""
    for device in {t.device for t in state_tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


class PinnedStaging:
    """A page-locked host buffer, kept between saves, that CUDA tensors are staged in.

    :meth:`stage` copies every CUDA tensor into it at DMA speed (one synchronize for
    all, not one pageable copy each) and returns ``id(tensor)`` -> a flat uint8 host view
    of its bytes; CPU tensors are left out (written from where they are).
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def stage(self, tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        cuda = [t.detach().contiguous() for t in tensors if t.is_cuda]
        if not cuda:
            return {}
        sizes = [t.numel() * t.element_size() for t in cuda]
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)
        if self._buffer is None or self._buffer.numel() < offsets[-1]:
            self._buffer = None
            self._buffer = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=True)
        entries = [
            TensorEntry((i,), "uint8", (size,), offset, size)
            for i, (size, offset) in enumerate(zip(sizes, offsets, strict=False))
        ]
        raw = [t.reshape(-1).view(torch.uint8) for t in cuda]
        copy_to_host(self._buffer, entries, raw).wait()
        return {
            id(original): entry.view(self._buffer)
            for original, entry in zip((t for t in tensors if t.is_cuda), entries, strict=True)
        }
