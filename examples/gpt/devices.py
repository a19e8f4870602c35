"""Where a worker of the example trains, and over which backend (``--device``, ``--backend``).

Each worker uses ``cuda:LOCAL_RANK``; ranks may share a GPU only over gloo (NCCL refuses
two ranks on one GPU). The rules are trainguard's (``trainguard.collectives``), kept here
too so that the script runs with torch alone.
"""

import os
from collections.abc import Mapping

import torch

BACKEND_CHOICES = ("auto", "gloo", "nccl")
BACKEND_ENV = "TRAINGUARD_BACKEND"  # the default of --backend, as in trainguard.collectives
DEVICE_CHOICES = ("auto", "cpu", "cuda")


def resolve_backend(flag: str | None, env: Mapping[str, str] = os.environ) -> str:
    """``--backend``, else ``$TRAINGUARD_BACKEND``, else ``auto``; ValueError if unknown."""
    value = flag if flag is not None else env.get(BACKEND_ENV, "auto")
    value = value.strip().lower()
    if value not in BACKEND_CHOICES:
        where = "--backend" if flag is not None else f"env {BACKEND_ENV}"
        raise ValueError(f"{where}={value!r}: must be one of {', '.join(BACKEND_CHOICES)}")
    return value


def choose_device(requested: str, local_rank: int, backend: str, cuda_count: int) -> torch.device:
    """The device of the worker with ``local_rank``, given ``--device``, ``--backend`` and
    the number of visible GPUs; ValueError for a combination that cannot work.

    ``auto`` is CUDA where a GPU is visible. A CUDA worker uses ``cuda:LOCAL_RANK``; a
    node with more local ranks than GPUs needs ``--backend gloo``, and its ranks then
    share the GPUs (``cuda:LOCAL_RANK % cuda_count``): NCCL refuses two ranks on one GPU.
    ``--backend nccl`` needs CUDA. A copy of ``trainguard.collectives.choose_device``, so
    that this script runs with torch alone; tests/test_example_backend.py holds both to
    the same answers.
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


def group_backend(choice: str, device: torch.device) -> str:
    """The ``init_process_group`` backend of ``--backend`` for tensors on ``device``:
    trainguard's rule (``trainguard.collectives.backend_string``), also without trainguard.
    """
    cuda = device.type == "cuda"
    try:
        from trainguard.collectives import backend_string, resolve_choice
    except ImportError:  # the default mode needs torch only: the same rule
        if choice == "nccl" and not cuda:
            raise ValueError("backend nccl: no CUDA device is visible to this process") from None
        return "cpu:gloo,cuda:nccl" if cuda and choice != "gloo" else "gloo"
    return backend_string(resolve_choice(choice), cuda=cuda)


def cuda_device_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0
