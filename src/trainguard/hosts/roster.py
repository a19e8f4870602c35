"""Which host is which node: the controller's record of the hosts that joined its job.

Pure (no sockets, no clock: times are given). The rules, in the order they are checked:

- a host daemon that joins again (same ``host_id``: its reply was lost, it retried) gets
  the same answer, as long as it is in good standing;
- the job must be the same: a host started with another spec is refused, naming the
  fields that differ (``spec.nprocPerNode: 4 here, 2 on the controller``);
- another process on a host that already holds a node (same hostname and address) is
  refused: a host takes part once;
- ``--node-rank K`` claims ``node-K`` (K below the job's node count); a rank already
  taken is refused, naming the host holding it. Hosts without a rank take the lowest free
  node, in the order they join: give ranks on every host or on none;
- once every node is held, hosts join as spares (the spec's ``spares``, then the nodes an
  elastic job may grow onto) and wait to be launched; past those, a host is late and is
  refused;
- a host whose node was declared lost is fenced: its lease says ``lost``, and it may
  come back only as a new host (a new ``host_id``), which joins as a new spare;
- when the controller launches a node (:meth:`Roster.bind`), the host holding it takes
  it if its lease is fresh; a holder whose lease went stale is fenced, and the node goes
  to an idle host instead (a spare, or a host whose node the job no longer runs): the
  controller restarting a lost node "fresh, with the same id" lands on another host.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.wire.hosts import JoinRequest

__all__ = ["HostRecord", "JoinRefused", "Roster", "spec_differences"]


class JoinRefused(ValueError):
    """A join the controller turns down; the message says why, for the joining host."""


@dataclass
class HostRecord:
    host_id: str
    hostname: str
    addr: str
    ifname: str | None
    daemon_url: str | None  # None: the controller's own host (no daemon)
    node_id: str
    role: str  # "node" or "spare"
    joined_at: float
    lost: bool = False
    last_seen: float = 0.0

    @property
    def local(self) -> bool:
        return self.daemon_url is None


@dataclass
class Roster:
    """The hosts of one job (see the module doc)."""

    node_ids: tuple[str, ...]
    spare_ids: tuple[str, ...]
    spec: Mapping[str, Any]
    growth_ids: tuple[str, ...] = ()
    hosts: dict[str, HostRecord] = field(default_factory=dict)  # by host_id
    _fresh: int = 0  # new spare ids made for hosts that came back

    def add_controller_host(self, host_id: str, hostname: str, addr: str, ifname: str | None,
                            now: float) -> HostRecord:  # fmt: skip
        """The controller's own host: node 0."""
        record = HostRecord(host_id, hostname, addr, ifname, None, self.node_ids[0], "node", now)
        record.last_seen = now
        self.hosts[host_id] = record
        return record

    def join(self, request: JoinRequest, now: float) -> HostRecord:
        known = self.hosts.get(request.host_id)
        if known is not None:
            if known.lost:
                raise JoinRefused(
                    f"host {known.hostname} ({known.addr}) was declared lost as {known.node_id}: "
                    "it may rejoin only as a new host (restart trainguard run there)"
                )
            known.last_seen = now
            return known
        differences = spec_differences(self.spec, request.spec)
        if differences:
            shown = "; ".join(differences[:5])
            more = f" (and {len(differences) - 5} more)" if len(differences) > 5 else ""
            raise JoinRefused(
                f"host {request.hostname} was started with another job: {shown}{more}"
            )
        for other in self._live():
            if other.hostname == request.hostname and other.addr == request.addr:
                raise JoinRefused(
                    f"host {request.hostname} ({request.addr}) already takes part as "
                    f"{other.node_id}: run trainguard once per host"
                )
        node_id, role = self._place(request)
        record = HostRecord(
            request.host_id, request.hostname, request.addr, request.ifname,
            request.daemon_url, node_id, role, now, last_seen=now,
        )  # fmt: skip
        self.hosts[request.host_id] = record
        return record

    def _place(self, request: JoinRequest) -> tuple[str, str]:
        held = {h.node_id for h in self._live()}
        if request.node_rank is not None:
            rank = request.node_rank
            if rank >= len(self.node_ids):
                raise JoinRefused(
                    f"--node-rank {rank}: the job has {len(self.node_ids)} nodes "
                    f"(ranks 0 to {len(self.node_ids) - 1})"
                )
            wanted = self.node_ids[rank]
            holder = self.holder(wanted)
            if holder is not None:
                raise JoinRefused(
                    f"--node-rank {rank} is taken by host {holder.hostname} ({holder.addr})"
                )
            return wanted, "node"
        for node_id in self.node_ids:
            if node_id not in held and not self._used(node_id):
                return node_id, "node"
        for node_id in (*self.spare_ids, *self.growth_ids):
            if node_id not in held and not self._used(node_id):
                return node_id, "spare"
        if self._fresh < sum(1 for h in self.hosts.values() if h.lost):
            # A host that came back after being declared lost: a new spare, never its old id.
            self._fresh += 1
            known = len(self.node_ids) + len(self.spare_ids) + len(self.growth_ids)
            return f"node-{known + self._fresh - 1}", "spare"
        spares = len(self.spare_ids) + len(self.growth_ids)
        raise JoinRefused(
            f"host {request.hostname} is late: the job's {len(self.node_ids)} nodes and "
            f"{spares} spares are all taken"
        )

    def _used(self, node_id: str) -> bool:
        """A node id some host held before (lost since): never handed out again."""
        return any(h.node_id == node_id for h in self.hosts.values())

    def _live(self) -> Iterator[HostRecord]:
        return (h for h in self.hosts.values() if not h.lost)

    def bind(
        self, node_id: str, busy: set[str], now: float, stale_after: float
    ) -> HostRecord | None:
        """The host that runs ``node_id`` now (see the module doc); None: no host can.
        ``busy``: the nodes the job runs now (their hosts are not idle)."""
        holder = self.holder(node_id)
        if holder is not None and (holder.local or now - holder.last_seen <= stale_after):
            return holder
        if holder is not None:
            holder.lost = True  # silent: fenced, like a host whose node was declared lost
        idle = [
            h
            for h in self._live()
            if not h.local and h.node_id not in busy and now - h.last_seen <= stale_after
        ]
        if not idle:
            return None
        host = min(idle, key=lambda h: (h.role != "spare", h.joined_at))
        host.node_id, host.role = node_id, "node"
        return host

    def holder(self, node_id: str) -> HostRecord | None:
        """The live host holding ``node_id``."""
        return next((h for h in self._live() if h.node_id == node_id), None)

    def lose(self, node_id: str) -> HostRecord | None:
        """``node_id`` was declared lost: fence its host (it may rejoin as a new host)."""
        host = self.holder(node_id)
        if host is not None and not host.local:
            host.lost = True
        return host

    def joined(self, node_ids: Sequence[str]) -> list[str]:
        """Of ``node_ids``, those no live host holds yet."""
        return [n for n in node_ids if self.holder(n) is None]


def spec_differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two jobs (as JSON) differ, one ``path: ours on the controller, theirs on the
    host`` each, down to the innermost field (``spec.replicaSpecs[0].replicas``); a long
    value is shown from where the two part (``...proj/train2.py``), and lists of other
    lengths from their first differing item (``command[3:]``)."""
    if isinstance(ours, Mapping) and isinstance(theirs, Mapping):
        out: list[str] = []
        for key in sorted(set(ours) | set(theirs), key=str):
            here, there = ours.get(key, _MISSING), theirs.get(key, _MISSING)
            out += spec_differences(here, there, f"{path}.{key}" if path else str(key))
        return out
    if isinstance(ours, list) and isinstance(theirs, list):
        if len(ours) == len(theirs):
            return [d for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                    for d in spec_differences(a, b, f"{path}[{i}]")]  # fmt: skip
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
            min(len(ours), len(theirs)),
        )
        if first > 0:
            return [
                f"{path}[{first}:]: {_show(ours[first:])} on the controller, "
                f"{_show(theirs[first:])} on the host"
            ]
    if ours == theirs:
        return []
    start = _parting(ours, theirs) if isinstance(ours, str) and isinstance(theirs, str) else 0
    return [f"{path}: {_show(ours, start)} on the controller, {_show(theirs, start)} on the host"]


_MISSING = object()
_SHOWN = 60  # characters of a value in a refusal
_CONTEXT = 20  # characters kept before the first one that differs


def _parting(ours: str, theirs: str) -> int:
    """Where to start showing two strings that differ: a little before their first
    difference, when either is too long to show whole."""
    if max(len(repr(ours)), len(repr(theirs))) <= _SHOWN:
        return 0
    common = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    return max(0, common - _CONTEXT)


def _show(value: object, start: int = 0) -> str:
    if value is _MISSING:
        return "unset"
    text = "..." + repr(value[start:]) if isinstance(value, str) and start else repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."
