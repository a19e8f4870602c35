"""Host memory for snapshots: fault it in ahead of use, and page-lock it for CUDA copies.

Both run without the GIL, so a background thread can prepare the next slots while the
training loop runs: :func:`populate` calls ``madvise(MADV_POPULATE_WRITE)`` through
ctypes (Python's ``mmap.madvise`` holds the GIL), and :func:`register` calls
``cudaHostRegister`` through torch's binding of the CUDA runtime, which releases it.

Measured on an H100 machine (torch 2.11, 4 GiB in a ``/dev/shm`` mapping): faulting in
took 1.7 s, registering 0.17 s; a device-to-host copy into the registered mapping ran at
55 GB/s (0.078 s), as into ``pin_memory`` tensors, against 12 GB/s (0.33 s) unregistered.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Final

import torch

__all__ = ["MADV_POPULATE_WRITE", "populate", "register", "unregister"]

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE: Final = 23  # Linux >= 5.14; not exported by Python 3.11's mmap module
_REGISTER_PORTABLE: Final = 1  # cudaHostRegisterPortable
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def populate(address: int, nbytes: int) -> bool:
    """Fault in ``nbytes`` of a writable shared mapping at ``address``; False where the
    kernel cannot (before 5.14): the caller then maps with ``MAP_POPULATE``."""
    if _libc.madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return True
    errno = ctypes.get_errno()
    if errno in (22, 38):  # EINVAL, ENOSYS: the advice is unknown to this kernel
        return False
    raise OSError(errno, f"madvise(MADV_POPULATE_WRITE) of {nbytes} bytes: {os.strerror(errno)}")


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
