"""The controller's side of a job across hosts, in :class:`~trainguard.platform.local.LocalRunner`.

What a job on several hosts adds to the run on one machine (hosts/controller_host.py
says why): the inbox listens on ``--rdzv-endpoint`` with the hosts' join and lease
routes; node 0's agent runs here, the others through their hosts' daemons
(:class:`~trainguard.hosts.launcher.HostsLauncher`); the run waits for the hosts to
join before its first attempt; the platform is wired to the hosts (:class:`HostsWiring`);
and at the end every host is told the job's end.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from trainguard.control.config import ControlConfig
from trainguard.control.controller import JobController, JobPhase
from trainguard.hosts.addresses import resolve
from trainguard.hosts.controller_host import ControllerHost, interface_env
from trainguard.hosts.launcher import HostsLauncher
from trainguard.hosts.service import HostsService
from trainguard.platform.base import Cancel
from trainguard.platform.control_config import fence_after
from trainguard.platform.inbox import Inbox
from trainguard.platform.local_platform import HostsWiring, LocalPlatform
from trainguard.platform.node import AgentLauncher
from trainguard.platform.target import Hosts, Slurm
from trainguard.spec.plan import JobPlan
from trainguard.spec.secrets import redact_spec

__all__ = ["AcrossHosts"]


class AcrossHosts:
    """A job across hosts, as its runner drives it; see the module docstring."""

    def __init__(
        self,
        target: Hosts | Slurm,
        job_id: str,
        plan: JobPlan,
        config: ControlConfig,
        say: Callable[[str], None],
        interrupted: Callable[[], str | None],
    ) -> None:
        """``interrupted``: why the run is stopped (Ctrl-C, SIGTERM), or None."""
        self.target = target
        self.controller: ControllerHost = target.controller
        self.job_id = job_id
        self.plan = plan
        self.config = config
        self._say = say
        self._interrupted = interrupted
        # How long a node no host can run yet waits for one to join or rejoin, as
        # torchrun's rendezvous waits for its nodes (a Slurm job's: not at all; it
        # requeues itself instead).
        self.host_wait = 0.0 if isinstance(target, Slurm) else self.controller.join_timeout
        self.platform: LocalPlatform | None = None  # set once built
        self._joiners_failed: list[str] = []  # the joiners that exited before joining

    @property
    def service(self) -> HostsService:
        assert self.controller.service is not None, "the hosts' service starts with the inbox"
        return self.controller.service

    def inbox(self, durable_url: str) -> Inbox:
        """Where agents push: the endpoint every host joins (the hosts' routes with it)."""
        hosts, config = self.controller, self.config
        service = hosts.start(
            self.job_id,
            config.node_ids,
            config.spare_node_ids,
            config.elastic_node_ids,
            redact_spec(self.plan.job.model_dump(mode="json", by_alias=True)),
            durable_url,
            self._say,
        )
        address = resolve(hosts.endpoint.host)
        return Inbox(address, hosts.endpoint.port, routes=service.routes(), tls=hosts.tls_server)

    def launcher(
        self, local: Callable[..., AgentLauncher], user_env: Mapping[str, str]
    ) -> HostsLauncher:
        """Node 0's agent here (``local``, given this host's address, the interface that
        reaches the controller unless ``user_env`` names one, the agents' fence and CA),
        the others on their hosts."""
        hosts = self.controller
        here = local(
            host=hosts.local.addr, host_env=interface_env(hosts.local, user_env),
            fence_after=fence_after(self.config.lost_after), tls_ca=hosts.tls_ca,
        )  # fmt: skip
        launcher = HostsLauncher(self.service, here, hosts.token, hosts.tls_client)
        launcher.busy = lambda: set(self.platform.nodes) if self.platform else set()
        launcher.on_no_host = self._no_host
        return launcher

    def wiring(self) -> HostsWiring:
        """The job, to its platform: the hosts hear of its events and progress, an
        elastic job's capacity is the hosts that renew their lease (a node whose host
        goes silent is taken away a little before it could be declared lost: its agent
        is fenced by then, agent/lease.py), and a node waits ``host_wait`` for a host."""
        service, lost_after = self.service, self.config.lost_after
        capacity_of = None
        if self.config.elastic is not None:
            silent_after = max(lost_after - 1.0, fence_after(lost_after))
            capacity_of = functools.partial(service.capacity, silent_after=silent_after)
        listeners = [self.controller.on_event, *self.controller.listeners]
        return HostsWiring(
            listeners, [service.set_phase], self.controller.partition, capacity_of, self.host_wait
        )

    def _no_host(self, node_id: str) -> None:
        """A node no host can run: a Slurm job (which requeues itself) ends, failed, and
        is told; any other job's node is lost, and the restart policy goes on."""
        if isinstance(self.target, Slurm) and self.platform is not None:
            reason = f"no host is left to run {node_id}"
            self.platform.cancel = Cancel(reason, phase=JobPhase.FAILED)
            self.target.on_no_host(node_id)

    def wait(self) -> list[str]:
        """Wait (``--join-timeout``) for a host to hold every node; the ones missing. A
        joiner that exits first (a Slurm step) is said at once, with its error; when
        those left can no longer hold every node, the wait ends."""
        hosts = self.controller
        joiners = self.target.joiners if isinstance(self.target, Slurm) else None
        needed = len(self.config.node_ids)
        self._say(
            f"waiting for {needed - 1} more hosts to join at {hosts.endpoint} "
            f"(--join-timeout {hosts.join_timeout:g}s)"
        )

        def stop() -> bool:
            if self._interrupted() is not None:
                return True
            if joiners is None:
                return False
            for line in joiners.exited():
                self._joiners_failed.append(line)
                self._say(line)
            return bool(self._joiners_failed) and joiners.running() + 1 < needed

        return self.service.wait_for(self.config.node_ids, hosts.join_timeout, stop=stop)

    def not_joined(self, missing: list[str]) -> tuple[str, JobPhase]:
        """Why the wait for hosts ended with nodes ``missing``, and how the job ends:
        Ctrl-C or SIGTERM (``Stopped``, not ``Lost``; the hosts that joined are told at
        :meth:`finish`), joiners that exited, or ``--join-timeout`` (``Failed``)."""
        if (why := self._interrupted()) is not None:
            return f"{why} while waiting for hosts to join", JobPhase.STOPPED
        reason = f"no host joined as {', '.join(missing)}"
        if self._joiners_failed:
            return reason + ": " + "; ".join(self._joiners_failed), JobPhase.FAILED
        return reason + (
            f" within {self.controller.join_timeout:g}s (--join-timeout): start `trainguard run` "
            f"on every host, with the same --rdzv-endpoint {self.controller.endpoint} and the "
            "same job"
        ), JobPhase.FAILED

    def finish(self, controller: JobController) -> None:
        """Every host learns the job's end (its phase, exit code and reason)."""
        phase = controller.phase
        code = 0 if phase is JobPhase.SUCCEEDED else 1
        self.controller.finish(phase.value, code, controller.reason or phase.value)
