"""The default process group of one attempt: join it, abort it, leave it.

Every attempt gets a fresh rendezvous namespace (``PrefixStore("trainguard/attempt-N")``)
on the attempt's TCPStore at ``master_addr:master_port``. With
``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun's convention, set by the agent when the
job's store service serves the attempt's store: :mod:`trainguard.rendezvous`) every rank
is a client of a store that is up before any rank starts; otherwise rank 0 hosts it, and
a rank 0 that keeps its address and port across attempts keeps serving the same store. Before
``init_process_group`` the ranks meet at a store barrier that a joining rank leaves when
the attempt's deadline passes or a newer attempt is announced, so joining never blocks
beyond the deadline.

Measured with gloo on torch 2.13 (CPU): after a peer is SIGKILLed, a survivor's pending
collective raises ``RuntimeError`` ("Connection reset by peer") within ~30 ms. Against a
SIGSTOPped peer it blocks until the collective timeout; ``ProcessGroup.abort()`` returns
at once and changes nothing (the collective even completes afterwards), and
``_abort_process_group()`` does not unblock the calling process's own collective either:
it drops the group, so the next collective fails, but while DDP holds the group its
sockets stay open and a peer blocked on this rank keeps waiting. :meth:`AttemptGroup.abort`
therefore also shuts the group's connections down (:mod:`trainguard.resilient.sockets`):
this rank's own blocked collective fails, and so do its peers' within milliseconds. A
collective blocked on a hung (stopped) peer ends the same way once any rank aborts.

An aborted group must not be destroyed right away. ``~ProcessGroupGloo`` joins its
worker threads while the destroying thread holds the GIL, and a worker thread that is
destroying a failed work needs the GIL (the work's thread-local state holds a Python
object): seen here as a survivor hanging forever when the failed step's traceback, and
with it the DDP reducer holding the group's last reference, was released. So
:meth:`AttemptGroup.abort` keeps every aborted group alive until the next attempt's group
is up; by then their worker threads have drained their queues (every work fails at once
on the shut-down connections, while this thread waits without the GIL) and are idle.

The group's backend is the job's choice (:mod:`trainguard.collectives`): on a CUDA
machine ``cpu:gloo,cuda:nccl``, so CPU tensors (trainguard's control collectives, a CPU
training loop) go over gloo and CUDA tensors over NCCL. The abort above covers both: the
gloo connections are shut down, and ``_abort_process_group`` aborts the NCCL
communicators (``ncclCommAbort``: a kernel waiting on a dead or stopped peer returns),
which are never destroyed while they may hang. The process keeps its CUDA context.
Measured on an H100 (torch 2.11, NCCL 2.28, world 1): the abort takes 0.8 s and CUDA
works after it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Final

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainguard.collectives import control_group, forget_control_group
from trainguard.resilient.protocol import ResilientAttempt
from trainguard.resilient.sockets import Connections, open_sockets

__all__ = [
    "AttemptGroup",
    "AttemptInterrupted",
    "BarrierTimeout",
    "StoreUnavailable",
    "attempt_sockets",
    "end_default_group",
    "is_collective_failure",
]

_STORE_PREFIX: Final = "trainguard/attempt-"
# What gloo's errors say; gloo raises plain RuntimeErrors, not torch.distributed.DistError.
_GLOO_MARKERS: Final = (
    "gloo",
    "Connection reset by peer",
    "Connection closed by peer",
    "Timed out waiting",
)


_TEARDOWN_GRACE_SECONDS: Final = 0.1


def end_default_group() -> None:
    """Wait for every rank, then destroy the default process group.

    Without the wait gloo sometimes aborts a rank at exit (torch 2.13). After it, this
    thread lets go of the GIL for a moment: the group's worker thread is still destroying
    the barrier's work, which needs the GIL, and ``~ProcessGroupGloo`` joins that thread
    while holding it (see the module doc). Seen as a benchmark rank hanging at exit after
    its last step, in 2 of about 40 runs.
    """
    # A barrier of CPU tensors, over gloo: ``dist.barrier()`` on a group with NCCL would
    # make an NCCL communicator on the current device (of a CPU training loop, too).
    dist.all_reduce(torch.zeros(1), group=control_group())
    time.sleep(_TEARDOWN_GRACE_SECONDS)
    forget_control_group()
    dist.destroy_process_group()


_joined: list[AttemptGroup] = []  # the AttemptGroup whose attempt this process is in


@contextlib.contextmanager
def attempt_sockets() -> Iterator[None]:
    """The connections opened inside (the groups of a device mesh) are the current
    attempt's: an abort shuts them down with the default group's, so a peer blocked on
    this rank in one of those groups fails too. Outside an attempt it does nothing."""
    before = open_sockets() if _joined else {}
    try:
        yield
    finally:
        for group in list(_joined):
            group.add_connections(before)


class AttemptInterrupted(RuntimeError):
    """A newer attempt was announced while this one was being joined or run."""


class BarrierTimeout(RuntimeError):
    """The ranks of an attempt did not all arrive before the deadline."""


class StoreUnavailable(RuntimeError):
    """Rank 0 cannot host the attempt's rendezvous store: its port is taken. No rank can
    join the attempt, so waiting for its deadline would only delay the restart."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a failed process group rather than from the user's code."""
    if isinstance(exc, (AttemptInterrupted, BarrierTimeout, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _GLOO_MARKERS)


class AttemptGroup:
    """Builds and tears down the default process group, one attempt at a time."""

    def __init__(
        self, join_poll_interval: float, collective_timeout: float, backend: str = "gloo"
    ) -> None:
        self._poll = join_poll_interval
        self._backend = backend
        self._collective_timeout = timedelta(seconds=collective_timeout)
        self._lock = threading.Lock()
        self._hosted: tuple[str, int, dist.TCPStore] | None = None
        self._client: dist.TCPStore | None = None
        self._joined: int | None = None
        self._connections: Connections | None = None  # the joined group's sockets
        self._retired: list[object] = []  # aborted groups, kept alive (see the module doc)
        self._hooked = False  # torch's excepthook is installed (by the first join)

    def join(
        self,
        attempt: ResilientAttempt,
        rank: int,
        deadline: float,
        newer_announced: Callable[[], bool],
    ) -> None:
        """Initialise the default process group of ``attempt`` as ``rank``.

        Raises :class:`BarrierTimeout` when not every rank arrives before ``deadline``
        (``time.monotonic()``), :class:`AttemptInterrupted` as soon as ``newer_announced()``
        holds, and torch's errors when the rendezvous itself fails.
        """
        if rank >= attempt.world_size:
            raise ValueError(f"rank {rank} is outside attempt {attempt.attempt}'s world")
        hosted = _agent_store()
        if rank != 0 and not hosted:
            self._wait_for_host(attempt, deadline, newer_announced)
        store = self._store(attempt, rank, _remaining(deadline, attempt), hosted)
        prefixed = dist.PrefixStore(f"{_STORE_PREFIX}{attempt.attempt}", store)
        prefixed.add("arrived", 1)
        while prefixed.add("arrived", 0) < attempt.world_size:
            if newer_announced():
                raise AttemptInterrupted(f"attempt {attempt.attempt} superseded while joining")
            if time.monotonic() >= deadline:
                raise BarrierTimeout(
                    f"attempt {attempt.attempt}: only {prefixed.add('arrived', 0)} of "
                    f"{attempt.world_size} ranks arrived within the barrier timeout"
                )
            time.sleep(self._poll)
        with self._lock:
            before, hook = open_sockets(), sys.excepthook
            dist.init_process_group(
                backend=self._backend,
                store=prefixed,
                rank=rank,
                world_size=attempt.world_size,
                timeout=timedelta(seconds=_remaining(deadline, attempt)),
            )
            self._connections = Connections.opened_since(before, attempt.master_port)
            if self._hooked:  # torch wraps sys.excepthook in a "[rankN]: " prefixer per init
                sys.excepthook = hook
            self._hooked = True
            distributed_c10d._set_pg_timeout(self._collective_timeout)
            self._joined = attempt.attempt
            self._retired.clear()  # their worker threads are idle by now
            _joined[:] = [self]

    def add_connections(self, before: Mapping[int, str]) -> None:
        """The sockets opened since ``before`` belong to the joined group (shut down by
        :meth:`abort` with its own)."""
        with self._lock:
            if self._connections is None:
                return
            added = Connections.opened_since(before, self._connections.store_port)
            fds = {**self._connections.fds, **added.fds}
            self._connections = Connections(fds, self._connections.store_port)

    def abort(self, attempt: int | None = None) -> None:
        """Drop the current process group (only if it is ``attempt``'s, when given).

        Safe from any thread; does not wait for the peers. Shuts the group's connections
        down first, so a collective blocked in this process fails, and so do the peers
        blocked on this rank, instead of waiting out their timeout.
        """
        with self._lock:
            if attempt is not None and attempt != self._joined:
                return
            self._joined = None
            if self in _joined:
                _joined.remove(self)
            if self._connections is not None:
                self._connections.shutdown()
                self._connections = None
            if dist.is_initialized():
                forget_control_group()
                self._retired.extend(distributed_c10d._world.pg_map)
                distributed_c10d._abort_process_group()

    def leave(self) -> None:
        """End the last attempt normally: wait for every rank, then destroy the group."""
        with self._lock:
            forget_control_group()
            if dist.is_initialized():
                end_default_group()
            self._joined = None
            self._connections = None
            self._retired.clear()
            if self in _joined:
                _joined.remove(self)
        self._client = None
        self._hosted = None

    def _wait_for_host(
        self, attempt: ResilientAttempt, deadline: float, newer_announced: Callable[[], bool]
    ) -> None:
        """Wait until rank 0 listens: TCPStore's own retries back off to ~0.5 s (torch 2.13)."""
        address = (attempt.master_addr, attempt.master_port)
        while True:
            try:
                socket.create_connection(address, timeout=self._poll).close()
                return
            except OSError:
                pass
            if newer_announced():
                raise AttemptInterrupted(f"attempt {attempt.attempt} superseded while joining")
            if time.monotonic() >= deadline:
                raise BarrierTimeout(
                    f"attempt {attempt.attempt}: rank 0 did not listen on "
                    f"{attempt.master_addr}:{attempt.master_port} within the barrier timeout"
                )
            time.sleep(self._poll)

    def _store(
        self, attempt: ResilientAttempt, rank: int, timeout: float, hosted: bool
    ) -> dist.TCPStore:
        address = (attempt.master_addr, attempt.master_port)
        if rank == 0 and not hosted:
            self._client = None
            if self._hosted is not None and self._hosted[:2] == address:
                return self._hosted[2]
            self._hosted = None  # frees the old port before binding the new one
            try:
                store = dist.TCPStore(
                    *address,
                    attempt.world_size,
                    is_master=True,
                    timeout=timedelta(seconds=timeout),
                    wait_for_workers=False,
                )
            except dist.DistNetworkError as exc:  # EADDRINUSE: the store binds every address
                raise StoreUnavailable(
                    f"attempt {attempt.attempt}: rank 0 cannot host the rendezvous store on "
                    f"port {attempt.master_port}: {str(exc).splitlines()[0][:200]}"
                ) from exc
            self._hosted = (*address, store)
            return store
        self._hosted = None
        self._client = None
        self._client = dist.TCPStore(
            *address, attempt.world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
        return self._client


def _agent_store() -> bool:
    """Whether the attempt's store is served for the ranks (torch's own test of it)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _remaining(deadline: float, attempt: ResilientAttempt) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise BarrierTimeout(f"attempt {attempt.attempt}: barrier timeout passed before joining")
    return left
