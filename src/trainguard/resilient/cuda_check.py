"""Is this process's CUDA context still usable? Asked of a survivor before it rejoins.

A fault can leave a sticky CUDA error (an illegal address, an Xid) in the context: every
later CUDA call fails, or hangs. Such a rank must not rejoin with its state; it exits
with :data:`EXIT_CUDA_UNHEALTHY`, so that the agent restarts its process (a fresh
context), and the new process takes its state from a healthy peer.

The check runs a small kernel and a synchronize in a daemon thread, waited on for at most
the timeout: a hung device cannot hang the check. A process that never used CUDA skips it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Final

import torch

__all__ = ["EXIT_CUDA_UNHEALTHY", "check_cuda", "kernel_and_sync"]

EXIT_CUDA_UNHEALTHY: Final = 70
"""A survivor's CUDA context is broken (EX_SOFTWARE): restart the process, do not rejoin."""


def kernel_and_sync() -> None:
    """A small kernel on the current device, then a synchronize (raises on a CUDA error)."""
    probe = torch.ones(256, device="cuda")
    probe.mul_(2.0)
    torch.cuda.synchronize()
    if float(probe.sum().item()) != 512.0:
        raise RuntimeError(f"CUDA check kernel computed {probe.sum().item()}, not 512")


def check_cuda(timeout: float, probe: Callable[[], None] | None = None) -> str | None:
    """Why this process's CUDA context is unusable, or None when it is (or was never used).

    ``probe`` (for tests) replaces :func:`kernel_and_sync`, and is run even where CUDA was
    never initialised.
    """
    if probe is None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        probe = kernel_and_sync
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            probe()
            outcome.append(None)
        except BaseException as exc:  # reported to the caller, never lost in the thread
            outcome.append(exc)

    thread = threading.Thread(target=run, name="trainguard-cuda-check", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        return f"a CUDA kernel and synchronize did not finish within {timeout:g} s"
    error = outcome[0]
    if error is not None:
        return f"CUDA check failed: {type(error).__name__}: {str(error)[:200]}"
    return None
