"""One job on several hosts: the same ``trainguard run ... --rdzv-endpoint HOST:PORT`` on
each (torchrun's way).

- :mod:`~trainguard.hosts.run`: the command line; which role this host plays;
- :mod:`~trainguard.hosts.controller_host`: the host that owns the endpoint (controller
  and node 0), with :mod:`~trainguard.hosts.service` (joins, leases) and
  :mod:`~trainguard.hosts.launcher` (nodes launched through the hosts' daemons);
- :mod:`~trainguard.hosts.daemon`: every other host (join, launch agents, keep the
  lease, fence itself when cut off);
- :mod:`~trainguard.hosts.roster`: which host is which node (pure);
- :mod:`~trainguard.hosts.addresses`, :mod:`~trainguard.hosts.security`: where this host
  is, and the token and TLS a job beyond loopback needs.
"""
