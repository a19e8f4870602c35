"""One operator at a time: leader election on a ``coordination.k8s.io/v1`` Lease.

The operator's Deployment runs two replicas. Every job's controller lives in the
leader's process, so only the leader may run kopf; the other waits, and takes over
when the leader's Lease runs out (it crashed, its node died, it lost the API server).
The new leader adopts every job's running pods (:mod:`trainguard.kube.adopt`): a
takeover restarts no job.

The rules are client-go's (``k8s.io/client-go/tools/leaderelection``):

- a candidate takes the Lease when nobody holds it, or when its record has not
  changed for ``lease_seconds`` *as seen by this candidate's clock* (the holder's
  ``renewTime`` is never compared with our clock: nodes' clocks differ);
- every write carries the ``resourceVersion`` it read, so two candidates racing for
  an expired Lease cannot both win (the API server refuses the second with 409);
- the leader renews every ``renew_seconds``; when it cannot renew for
  ``lease_seconds`` (or finds another holder), it has lost: the operator exits at once
  rather than run jobs a new leader may already run (its pods keep running).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.kube.api import Conflict, KubeApi, KubeError, NotFound
from trainguard.kube.status import rfc3339

__all__ = ["LeaderElector", "LeaseTimings"]

logger = logging.getLogger(__name__)

Obj = dict[str, object]


@dataclass(frozen=True)
class LeaseTimings:
    lease_seconds: float = 15.0  # a holder silent this long has lost the Lease
    renew_seconds: float = 5.0  # how often the leader renews
    retry_seconds: float = 2.0  # how often a candidate looks

    def __post_init__(self) -> None:
        if not (self.retry_seconds > 0 and 0 < self.renew_seconds < self.lease_seconds):
            raise ValueError("lease timings: need 0 < renew < lease and retry > 0")


class LeaderElector:
    """Acquire (blocking), then renew on a thread; see the module docstring."""

    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        identity: str,
        timings: LeaseTimings = LeaseTimings(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.timings = timings
        self._clock = clock
        self._wall = wall
        self._seen: tuple[str, str, str] | None = None  # (holder, renewTime, transitions)
        self._seen_at = 0.0  # our clock when the record last changed
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, stop: threading.Event | None = None) -> bool:
        """Block until this candidate leads (True), or ``stop`` is set (False)."""
        stop = stop or self._stop
        announced = False
        while not stop.is_set():
            holder = self.try_once()
            if holder == self.identity:
                logger.info("leading: took Lease %s/%s", self.namespace, self.name)
                return True
            if not announced and holder:
                logger.info(
                    "standing by: Lease %s/%s is held by %s", self.namespace, self.name, holder
                )
                announced = True
            stop.wait(self.timings.retry_seconds)
        return False

    def keep(self, lost: Callable[[str], None]) -> None:
        """Renew on a daemon thread; ``lost(why)`` is called once if leadership is lost."""

        def renew() -> None:
            while not self._stop.wait(self.timings.renew_seconds):
                holder = self.try_once()
                if holder == self.identity:
                    continue
                silent = self._clock() - self._renewed_at
                lease = f"Lease {self.namespace}/{self.name}"
                if holder or silent >= self.timings.lease_seconds:
                    lost(
                        f"{lease} is held by {holder}"
                        if holder
                        else f"could not renew {lease} for {silent:.0f} s"
                    )
                    return

        self._thread = threading.Thread(target=renew, name="tg-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and give the Lease up (the standby takes it at once)."""
        self._stop.set()
        try:
            lease = self.api.get_lease(self.namespace, self.name)
            if _holder(lease) == self.identity:
                spec = dict(lease.get("spec") or {})
                spec["holderIdentity"] = ""
                lease["spec"] = spec
                self.api.update_lease(self.namespace, self.name, lease)
        except KubeError as exc:
            logger.warning("cannot release Lease %s/%s: %s", self.namespace, self.name, exc)

    def try_once(self) -> str | None:
        """One look: take or renew the Lease when this candidate may. Returns its holder
        after the look (this identity when leading), or None when it cannot be told."""
        now, wall = self._clock(), self._wall()
        try:
            lease = self.api.get_lease(self.namespace, self.name)
        except NotFound:
            return self._create(now, wall)
        except KubeError as exc:
            logger.warning("cannot read Lease %s/%s: %s", self.namespace, self.name, exc)
            return None
        spec = dict(lease.get("spec") or {})
        holder = str(spec.get("holderIdentity") or "")
        record = (holder, str(spec.get("renewTime") or ""), str(spec.get("leaseTransitions") or 0))
        if record != self._seen:
            self._seen, self._seen_at = record, now
        expired = now - self._seen_at >= self._duration(spec)
        if holder and holder != self.identity and not expired:
            return holder
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder != self.identity:
            spec["acquireTime"] = rfc3339(wall, micro=True)
            spec["leaseTransitions"] = transitions + 1
        spec["holderIdentity"] = self.identity
        spec["leaseDurationSeconds"] = max(1, round(self.timings.lease_seconds))
        spec["renewTime"] = rfc3339(wall, micro=True)
        lease["spec"] = spec
        try:
            self.api.update_lease(self.namespace, self.name, lease)  # carries resourceVersion
        except Conflict:
            return None  # another candidate wrote first: look again
        except KubeError as exc:
            logger.warning("cannot update Lease %s/%s: %s", self.namespace, self.name, exc)
            return None
        self._renewed_at = now
        return self.identity

    def _create(self, now: float, wall: float) -> str | None:
        stamp = rfc3339(wall, micro=True)
        body: Obj = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, round(self.timings.lease_seconds)),
                "acquireTime": stamp,
                "renewTime": stamp,
                "leaseTransitions": 0,
            },
        }
        try:
            self.api.create_lease(self.namespace, body)
        except Conflict:
            return None
        except KubeError as exc:
            logger.warning("cannot create Lease %s/%s: %s", self.namespace, self.name, exc)
            return None
        self._renewed_at = now
        return self.identity

    def _duration(self, spec: dict[str, object]) -> float:
        """The holder's own lease duration (it may differ from ours), else ours."""
        value = spec.get("leaseDurationSeconds")
        return float(value) if isinstance(value, int) and value > 0 else self.timings.lease_seconds


def _holder(lease: Obj) -> str:
    spec = lease.get("spec")
    return str(spec.get("holderIdentity") or "") if isinstance(spec, dict) else ""
