"""Which backend a process group uses, and the gloo group trainguard's own collectives use.

The backend follows the tensors. ``init_process_group()`` without a backend gives a CUDA
machine an NCCL-only default group, on which a collective of CPU tensors fails ("No
backend type associated with device type cpu"). trainguard therefore initialises the
groups it owns with :func:`backend_string`: ``cpu:gloo,cuda:nccl`` where CUDA is there
(CPU tensors over gloo, CUDA tensors over NCCL), plain ``gloo`` elsewhere, or ``gloo``
for both when asked (two ranks sharing one GPU: NCCL refuses that).

trainguard's control collectives (state-sync offers and headers, the checkpoint
agreement) move a few integers on CPU, always over gloo: :func:`control_group` is the
default group when it has gloo for CPU tensors, else a gloo group of the same ranks made
once per default group (a user's ``init_process_group("nccl")``).

:func:`choose_device` is the device contract of a worker: ``cuda:LOCAL_RANK``, shared GPUs
only over gloo.
"""

from __future__ import annotations

import os
from typing import Final, Literal

import torch
import torch.distributed as dist

__all__ = [
    "BACKEND_CHOICES",
    "BACKEND_ENV",
    "DEVICE_CHOICES",
    "BackendChoice",
    "backend_string",
    "choose_device",
    "control_group",
    "device_backends",
    "forget_control_group",
    "resolve_choice",
]

BackendChoice = Literal["auto", "gloo", "nccl"]
BACKEND_CHOICES: Final[tuple[BackendChoice, ...]] = ("auto", "gloo", "nccl")
DEVICE_CHOICES: Final = ("auto", "cpu", "cuda")
BACKEND_ENV: Final = "TRAINGUARD_BACKEND"
"""The backend of the groups trainguard makes, when the code does not name one."""

# (default group, its control group): the default group is held, so no later group can
# take its place in this cache by reusing its id.
_control: list[tuple[dist.ProcessGroup, dist.ProcessGroup | None]] = []


def resolve_choice(choice: str | None) -> BackendChoice:
    """``choice``, else ``$TRAINGUARD_BACKEND``, else ``auto``; ValueError naming both."""
    value = choice if choice is not None else os.environ.get(BACKEND_ENV, "auto")
    value = value.strip().lower()
    if value not in BACKEND_CHOICES:
        where = "backend" if choice is not None else BACKEND_ENV
        raise ValueError(f"{where}={value!r}: must be one of {', '.join(BACKEND_CHOICES)}")
    return value


def backend_string(choice: BackendChoice, cuda: bool | None = None) -> str:
    """The ``init_process_group`` backend for ``choice`` (``cuda``: CUDA is usable).

    ``auto``: ``cpu:gloo,cuda:nccl`` with CUDA, else ``gloo``. ``nccl``: the same, and
    an error without CUDA. ``gloo``: ``gloo`` (it takes CUDA tensors too, slower).
    """
    has_cuda = torch.cuda.is_available() if cuda is None else cuda
    if choice == "gloo":
        return "gloo"
    if not has_cuda:
        if choice == "nccl":
            raise ValueError("backend nccl: no CUDA device is visible to this process")
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def device_backends(group: dist.ProcessGroup | None = None) -> dict[str, str]:
    """Device type -> backend of ``group`` (default: the default group), e.g. {"cpu": "gloo"}."""
    config = str(dist.get_backend_config(group))
    if ":" not in config:  # one backend for every device it supports
        return {"cpu": config} if config == "gloo" else {"cuda": config}
    pairs = (item.split(":", 1) for item in config.split(",") if ":" in item)
    return {device.strip(): backend.strip() for device, backend in pairs}


def forget_control_group() -> None:
    """Drop the cached groups (the default group is being destroyed or aborted)."""
    _control.clear()


def control_group() -> dist.ProcessGroup | None:
    """The gloo group for trainguard's CPU collectives (None: the default group).

    A collective: every rank of the default group calls it at the same point the first
    time (as every caller in trainguard does), since making a group is one.
    """
    default = dist.distributed_c10d._get_default_group()
    if not _control or _control[0][0] is not default:
        cpu = device_backends().get("cpu")
        _control[:] = [(default, None if cpu == "gloo" else dist.new_group(backend="gloo"))]
    return _control[0][1]


def choose_device(requested: str, local_rank: int, backend: str, cuda_count: int) -> torch.device:
    """The device of the worker with ``local_rank``: the contract of trainguard's scripts
    (``bench/train.py``; ``examples/gpt/train.py`` keeps a copy, to run without trainguard).

    ``auto`` is CUDA where a GPU is visible; a CUDA rank uses ``cuda:LOCAL_RANK``, or with
    ``backend`` gloo ``cuda:LOCAL_RANK % cuda_count`` (ranks share GPUs; NCCL refuses
    that). ValueError for a combination that cannot work (nccl without CUDA).
    """
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"--device={requested!r}: must be one of {', '.join(DEVICE_CHOICES)}")
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"--backend={backend!r}: must be one of {', '.join(BACKEND_CHOICES)}")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK={local_rank} is negative")
    if requested == "cpu" or (requested == "auto" and cuda_count < 1):
        if backend == "nccl":
            why = "--device cpu" if requested == "cpu" else "no CUDA device is visible"
            raise ValueError(f"--backend nccl needs CUDA tensors, but {why}")
        return torch.device("cpu")
    if cuda_count < 1:
        raise ValueError("--device cuda: no CUDA device is visible")
    if local_rank < cuda_count:
        return torch.device("cuda", local_rank)
    if backend == "gloo":
        return torch.device("cuda", local_rank % cuda_count)
    raise ValueError(
        f"LOCAL_RANK={local_rank} has no GPU of its own ({cuda_count} visible) and NCCL "
        "refuses two ranks on one GPU: pass --backend gloo to share the GPUs, or --device cpu"
    )
