"""Host memory for snapshots and transfers: fault it in ahead of use, and page-lock it for
CUDA copies.

Both run without the GIL, so a background thread can prepare the next slots while the
training loop runs: :func:`populate` calls ``madvise(MADV_POPULATE_WRITE)`` through
ctypes (Python's ``mmap.madvise`` holds the GIL), and :func:`register` calls
``cudaHostRegister`` through torch's binding of the CUDA runtime, which releases it.
:class:`Prefault` runs :func:`populate` in a thread ahead of data arriving in fresh memory
(a replacement's tensors receiving a peer's state; a restore's tensors the state lacked,
copied from the memory tier).

Measured on an H100 machine (torch 2.11, 4 GiB in a ``/dev/shm`` mapping): faulting in
took 1.7 s, registering 0.17 s; a device-to-host copy into the registered mapping ran at
55 GB/s (0.078 s), as into ``pin_memory`` tensors, against 12 GB/s (0.33 s) unregistered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Final

import torch

__all__ = ["MADV_POPULATE_WRITE", "Prefault", "populate", "register", "unregister"]

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14; not exported by Python 3.11's mmap module
_REGISTER_PORTABLE: Final = 1  # cudaHostRegisterPortable
_PAGE: Final = os.sysconf("SC_PAGE_SIZE")
PREFAULT_STEP: Final = 8 << 20
"""Bytes :class:`Prefault` faults in at a time, taking each stream's next range in turn."""
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


POPULATE_CHUNK: Final = 64 << 20
"""With a ``pause``, :func:`populate` faults in this many bytes between two calls of it."""


def populate(address: int, nbytes: int, pause: Callable[[], None] | None = None) -> bool:
    """Fault in ``nbytes`` of writable memory at ``address`` (a shared mapping, or a
    process's own anonymous memory; the contents are left as they are); False where the
    kernel cannot (before 5.14): the caller then maps with ``MAP_POPULATE``.

    ``address`` is rounded down to its page (``madvise`` needs a page-aligned start; the
    page is in the same mapping). ``pause`` is called before each :data:`POPULATE_CHUNK`
    bytes (it may block: a slot prepared in the background waits there while a save
    copies)."""
    start = address - address % _PAGE
    span = nbytes + address - start
    chunk = span if pause is None else POPULATE_CHUNK
    for offset in range(0, span, max(chunk, 1)):
        if pause is not None:
            pause()
        size = min(chunk, span - offset)
        if _libc.madvise(start + offset, size, MADV_POPULATE_WRITE) == 0:
            continue
        errno = ctypes.get_errno()
        if errno in (22, 38):  # EINVAL, ENOSYS: the advice is unknown to this kernel
            return False
        raise OSError(errno, f"madvise(MADV_POPULATE_WRITE) of {size} bytes: {os.strerror(errno)}")
    return True


def register(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` at ``address`` for CUDA copies; False (logged) where it cannot."""
    if not torch.cuda.is_available():
        return False
    # Portable: page-locked for every CUDA context, not only the current device's.
    error = torch.cuda.cudart().cudaHostRegister(address, nbytes, _REGISTER_PORTABLE)
    if int(error) != 0:  # cudaSuccess
        log.warning(
            "cannot page-lock %d bytes of snapshot memory for CUDA (%s); "
            "copies run at pageable speed", nbytes, error,
        )  # fmt: skip
        return False
    return True


def unregister(address: int) -> None:
    """Undo :func:`register` (before the memory is unmapped)."""
    error = torch.cuda.cudart().cudaHostUnregister(address)
    if int(error) != 0:
        log.warning("cudaHostUnregister of snapshot memory failed: %s", error)


class Prefault:
    """Faults in byte ranges of host memory in a thread, ahead of data arriving there.

    A receive into fresh memory (a hot spare's tensors, made with ``torch.empty`` and never
    touched) takes a page fault per 4 KiB page in the middle of the copy: on the quiet
    2-core VM a gloo receive of 1 GB ran at 1.67 GB/s into fresh memory, 2.53 GB/s with
    this thread faulting in ahead of it, 3.20 GB/s into faulted memory
    (``python -m bench.receive_memory --gb 1``). ``streams``:
    the ranges ``(address, nbytes)`` in the order data arrives in each stream (one per
    sender, arriving at once); the thread takes :data:`PREFAULT_STEP` bytes of each stream
    in turn. The contents are never changed, so the thread may fall behind the data or
    overlap it: it then only costs the walk over pages already present. Where the kernel
    cannot populate, it stops at once and the receive faults as it would have.
    """

    def __init__(self, streams: Sequence[Sequence[tuple[int, int]]]) -> None:
        self._steps = [_steps(stream) for stream in streams if stream]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-prefault", daemon=True)

    def __enter__(self) -> Prefault:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start faulting in (what ``with`` does on entry), for a caller whose copies come
        later than it can wait in a ``with``."""
        if self._steps:
            self._thread.start()

    def stop(self) -> None:
        """Stop, and wait for the thread (what ``with`` does on exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        pending = [iter(steps) for steps in self._steps]
        while pending and not self._stop.is_set():
            for stream in list(pending):
                step = next(stream, None)
                if step is None:
                    pending.remove(stream)
                    continue
                try:
                    if not populate(*step):
                        return
                except OSError as exc:  # memory unlike what it was said to be: not needed
                    log.debug("prefault stopped: %s", exc)
                    return
                if self._stop.is_set():
                    return


def _steps(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` cut into pieces of at most :data:`PREFAULT_STEP` bytes, in order."""
    return [
        (address + offset, min(PREFAULT_STEP, nbytes - offset))
        for address, nbytes in ranges
        for offset in range(0, nbytes, PREFAULT_STEP)
    ]
