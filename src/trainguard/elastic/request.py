"""Whether the controller asked for a scale event, agreed by every rank.

The ask reaches a worker in two ways, and either is enough:

- **a file**: the agent sets ``TRAINGUARD_ELASTIC_FILE`` (`ELASTIC_FILE_ENV`) in the
  worker's environment, to a path that does not exist when the attempt starts; creating
  it asks for a scale event. A worker looks at most every `FILE_CHECK_INTERVAL`
  seconds, never writes or removes it, and remembers a file once seen.
- **SIGUSR1** (`SCALE_SIGNAL`), as HyperPod's operator sends it: the handler only sets
  a flag. It is installed on the first call of `scale_requested` made in the main
  thread, over ``SIG_DFL`` or ``SIG_IGN`` only; a handler of the user's (or of any
  other library) is left alone, with a warning, and then only the file is read. Until
  it is installed, SIGUSR1's default action kills the process, so a sender should
  either start the workers with SIGUSR1 ignored (``SIG_IGN`` is inherited through fork
  and exec, by DataLoader workers too, and the handler replaces it), or signal only a
  process that `handles_scale_signal`, by its pid: its process group also holds its
  children (DataLoader workers, subprocesses), which SIGUSR1 would kill.

The ranks agree with an all-reduce MAX of their flag on the default process group
(what HyperPod's ``elastic_event_detected()`` does), so they see the request at the
same call even when the file or the signal reaches them at different steps. The tensor
is on the CPU when the group has a CPU backend (gloo, or ``"cpu:gloo,cuda:nccl"``),
otherwise on the current device of the group's accelerator (``torch.cuda.current_device()``
for NCCL). Not a gloo side group: that would open a full mesh of TCP connections
between all ranks and need gloo's network set up, on clusters where only NCCL's is;
the NCCL all-reduce goes where the training's collectives already go, at the cost of
one wait for the device's queued work per agreement (hence ``every``).

Assumptions: every rank calls `scale_requested` the same number of times with the same
``every`` (it is a collective, like any all-reduce), from one thread; the all-reduce
waits as long as the process group's own timeout allows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from types import FrameType
from typing import Any, Final

__all__ = [
    "AGREED_SUFFIX",
    "ARMED_SUFFIX",
    "ELASTIC_FILE_ENV",
    "FILE_CHECK_INTERVAL",
    "SCALE_SIGNAL",
    "agreement_device",
    "clear_scale_request",
    "device_type_for",
    "elastic_event_detected",
    "handles_scale_signal",
    "scale_requested",
]

ELASTIC_FILE_ENV: Final = "TRAINGUARD_ELASTIC_FILE"
"""Set by the agent: a path whose existence means "a scale event is requested"."""
ARMED_SUFFIX: Final = ".armed"
"""``<file>.armed``: created by a worker's first `scale_requested` call."""
AGREED_SUFFIX: Final = ".agreed"
"""``<file>.agreed``: created once `scale_requested` returns True (a rank that then
exits 0 stopped for the scaling; one that exits 0 without it finished its work)."""
SCALE_SIGNAL: Final = signal.SIGUSR1
"""The signal that asks for a scale event (HyperPod's)."""
FILE_CHECK_INTERVAL: Final = 0.05
"""Seconds between two looks at the request file."""


class _Watch:
    """This process's view of the request (one, `_watch`; the signal handler sets it)."""

    def __init__(self) -> None:
        self.signalled = False
        self.file_seen = False
        self.agreed = False
        self.calls = 0
        self.next_file_check = float("-inf")  # time.monotonic()
        self.handler_settled = False  # installed, or found another handler, in the main thread
        self.armed = False  # told the agent this worker reads requests (ARMED_SUFFIX)


_watch = _Watch()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _watch.signalled = True


def scale_requested(every: int = 1) -> bool:
    """Whether a scale event was requested: True on every rank at the same call.

    Call it once per step on every rank; when it returns True, save a checkpoint and
    return (the job restarts at the new size). Once True, it stays True.

    With ``torch.distributed`` initialised and more than one rank, the ranks agree on
    the first call and then on every ``every``-th call (all ranks must pass the same
    ``every``); calls between return False. Otherwise it returns this process's own
    flag at each call. Outside trainguard, with no signal, it returns False; it never
    imports torch itself, and a call that does not agree costs about a microsecond.
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"scale_requested: every must be an int >= 1, got {every!r}")
    watch = _watch
    if watch.agreed:
        return True
    if not watch.handler_settled:
        _install_handler(watch)
    if not watch.armed:
        _arm(watch)
    _look_at_file(watch)
    watch.calls += 1
    local = watch.signalled or watch.file_seen
    dist = _distributed()
    if dist is None:
        watch.agreed = local
    elif (watch.calls - 1) % every:
        return False
    else:
        watch.agreed = _agree(dist, local)
    if watch.agreed:
        _mark(AGREED_SUFFIX)
    return watch.agreed


elastic_event_detected = scale_requested
"""`scale_requested` under HyperPod's name."""


def clear_scale_request() -> None:
    """Forget a request once it is handled in-process, where the script goes on running.

    Every rank calls it at the same point; the agent must have removed the request file
    first, or it is seen again. Also starts counting calls for ``every`` afresh, and
    looks at the SIGUSR1 handler again at the next call.
    """
    global _watch
    _watch = _Watch()


def handles_scale_signal(pid: int) -> bool:
    """Whether process ``pid`` catches `SCALE_SIGNAL` (its ``SigCgt`` in ``/proc``).

    For the sender: SIGUSR1 sent to a process that does not catch it kills it. False
    when the process is gone or unreadable.
    """
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (SCALE_SIGNAL - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def _install_handler(watch: _Watch) -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal.signal() works in the main thread only; try again from there
    watch.handler_settled = True
    current = signal.getsignal(SCALE_SIGNAL)
    if current is _on_signal:
        return
    if current in (signal.SIG_DFL, signal.SIG_IGN):
        with contextlib.suppress(ValueError):  # not the main interpreter
            signal.signal(SCALE_SIGNAL, _on_signal)
        return
    warnings.warn(
        f"trainguard.elastic: SIGUSR1 already has a handler ({current!r}); it is kept, "
        f"and scale requests are read from ${ELASTIC_FILE_ENV} only",
        RuntimeWarning,
        stacklevel=3,
    )


def _arm(watch: _Watch) -> None:
    """Tell the agent this worker reads scale requests (``<file>.armed``): on a scaling
    it then waits ``gracefulShutdownTimeoutInSeconds`` for the ranks to save and exit
    before it signals them; an unmodified script gets SIGTERM at once."""
    watch.armed = True
    _mark(ARMED_SUFFIX)


def _mark(suffix: str) -> None:
    """Create ``<request file><suffix>`` for the agent (nothing outside trainguard)."""
    path = os.environ.get(ELASTIC_FILE_ENV)
    if path:
        with contextlib.suppress(OSError), open(path + suffix, "a"):
            pass


def _look_at_file(watch: _Watch) -> None:
    if watch.file_seen:
        return
    now = time.monotonic()
    if now < watch.next_file_check:
        return
    watch.next_file_check = now + FILE_CHECK_INTERVAL
    path = os.environ.get(ELASTIC_FILE_ENV)
    if path and os.path.exists(path):
        watch.file_seen = True


def _distributed() -> Any:
    """``torch.distributed`` when initialised with more than one rank, else None.

    Never imports torch: a process that has not imported ``torch.distributed`` has no
    process group.
    """
    dist: Any = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist if dist.get_world_size() > 1 else None


def _agree(dist: Any, local: bool) -> bool:
    """An all-reduce MAX of ``local`` over the default process group."""
    import torch

    device = agreement_device(dist)
    flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def agreement_device(dist: Any) -> Any:
    """The ``torch.device`` of the agreement's tensor for the default process group."""
    import torch

    group = dist.group.WORLD
    types = getattr(group, "_device_types", None)
    if types is not None:
        kinds = [torch.device(kind).type for kind in types]
    else:  # an older torch: judge by the backend's name
        backend = str(dist.get_backend(group))
        kinds = ["cpu"] if "gloo" in backend or "mpi" in backend else ["cuda"]
    kind = device_type_for(kinds)
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def device_type_for(kinds: Sequence[str]) -> str:
    """The device type to agree on, among those a process group supports (pure)."""
    if "cpu" in kinds or not kinds:
        return "cpu"
    return "cuda" if "cuda" in kinds else kinds[0]
