"""Host avoidance: machines a replacement node should not land on, for every platform.

After a full job restart that replaced nodes (lost ones, or repeat offenders swapped for
spares), their hosts are the likeliest to fail again. The controller passes the list
with the nodes it launches; a platform that places nodes (Kubernetes: required node
anti-affinity) keeps new nodes off them, one that cannot (this machine) ignores it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["hosts_to_avoid"]


def hosts_to_avoid(
    previous: Sequence[str],
    replaced: Iterable[str],
    hosts: Mapping[str, str],
    limit: int,
) -> tuple[str, ...]:
    """The hosts to keep new nodes off: ``previous`` plus the hosts of the ``replaced``
    node ids (most recent last, each once), at most ``limit``
    (``maxNumRepeatOffendersToAvoid``; 0: avoid nothing)."""
    if limit <= 0:
        return ()
    avoid = list(previous)
    for node in replaced:
        host = hosts.get(node)
        if host:
            avoid = [h for h in avoid if h != host] + [host]
    return tuple(avoid[-limit:])
