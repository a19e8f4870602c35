"""``trainguard run``'s job: the controller in this process, one agent process per node.

:class:`LocalRunner` sets a job up (its directory, token, store row, the inbox agents
push to), runs :func:`~trainguard.platform.drive.drive` over a
:class:`~trainguard.platform.local_platform.LocalPlatform`, and tears everything down
whatever happens (every agent and worker stopped, the memory tiers removed). What the
user sees is its :class:`~trainguard.platform.console.Console`; what a job across hosts
adds, its :class:`~trainguard.platform.across_hosts.AcrossHosts`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from trainguard.agent.train_scripts import TrainScripts
from trainguard.agent.warm import StartOptions
from trainguard.agent.workers import HOST_WORKERS_ENV
from trainguard.checkpoint.tier_dir import user_root
from trainguard.control.controller import JobController, JobPhase
from trainguard.hosts.controller_host import AGENT_CONTACT_TIMEOUT
from trainguard.hosts.security import write_token_file
from trainguard.http_server import RouteServer
from trainguard.observe.cause import failure_cause
from trainguard.observe.job import JobObserver
from trainguard.observe.summary import fault_summary
from trainguard.platform.across_hosts import AcrossHosts
from trainguard.platform.console import Console
from trainguard.platform.control_config import control_config
from trainguard.platform.drive import drive
from trainguard.platform.inbox import Inbox, agent_transport
from trainguard.platform.inject import Injection
from trainguard.platform.inject_hook import InjectionHook, injector_for
from trainguard.platform.local_platform import LocalPlatform
from trainguard.platform.node import AgentLauncher, HealthLaunch, NodeLauncher
from trainguard.platform.procs import tune_gc_for_a_controller
from trainguard.platform.resume import resumed_begin
from trainguard.platform.store import JobNotFound, Store
from trainguard.platform.target import LOCAL, Hosts, Resume, Slurm, Target
from trainguard.platform.transport import DEFAULT_CONTACT_TIMEOUT
from trainguard.rendezvous.client import (
    StoreServiceHandle,
    find_service,
    rendezvous_mode,
    start_service,
)
from trainguard.spec.plan import JobPlan, NodeGroupPlan
from trainguard.spec.secrets import redact_spec, secret_storage_keys

EXIT_INTERRUPTED = 130
# Where the local platform keeps each node's memory checkpoint tier: this user's own
# (``/dev/shm/trainguard-<uid>``, 0700; checkpoint/tier_dir.py), a job's in ``<root>/<job>``.
MEMORY_ROOT = user_root()

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclass(frozen=True)
class MetricsOptions:
    """``--metrics-port``: where a run serves its metrics, and how long after its end."""

    port: int
    host: str = "127.0.0.1"
    linger: float = 0.0


class MetricsPortError(ValueError):
    """The metrics port cannot be bound (a usage error)."""


@dataclass(frozen=True)
class JobResult:
    job_id: str
    phase: JobPhase
    reason: str
    job_dir: Path

    @property
    def exit_code(self) -> int:
        return 0 if self.phase is JobPhase.SUCCEEDED else 1


def agent_launcher(
    plan: JobPlan,
    job_dir: Path,
    token_file: Path,
    memory_root: Path,
    groups: Mapping[str, tuple[int, NodeGroupPlan]],
    *,
    fail: Mapping[str, tuple[str, ...]] | None = None,
    host: str = "127.0.0.1",
    host_env: Mapping[str, str] | None = None,
    durable_url: str | None = None,
    fence_after: float | None = None,
    tls_ca: str | None = None,
    host_workers: int | None = None,
) -> AgentLauncher:
    """What launches this host's node agents for ``plan``: each node's group, its memory
    tier under ``memory_root``, the job's checkpoint settings (``durable_url``: where the
    durable tier is when the spec names none; default ``<job_dir>/durable``), ``host``:
    the address the agents bind, ``host_env``: more for every worker of this host (a
    multi-host job's ``GLOO_SOCKET_IFNAME``), ``fence_after``: the agents' durable-tier
    fence (agent/lease.py); ``fail``: rehearsed health-check failures; ``host_workers``:
    how many workers this host runs in all when its nodes share it (simulated nodes: the
    agents set ``OMP_NUM_THREADS=1`` by that count, not one node's)."""
    checkpointing = plan.job.spec.checkpointing
    config = json.dumps(checkpointing.env_json(durable_url or str(job_dir / "durable")))
    env = {
        node_id: {
            **(host_env or {}),
            "TRAINGUARD_JOB_DIR": str(job_dir),
            "TRAINGUARD_CHECKPOINT_MEMORY_DIR": str(memory_root / node_id / "memory"),
            "TRAINGUARD_CHECKPOINT_CONFIG": config,
            **({HOST_WORKERS_ENV: str(host_workers)} if host_workers is not None else {}),
        }
        for node_id in groups
    }
    by_node: dict[str, NodeGroupPlan] = {n: group for n, (_, group) in groups.items()}
    options = plan.job.spec.trainguard
    scripts = TrainScripts(tuple(options.pre_train_script), tuple(options.post_train_script))
    start = StartOptions(options.warm_start, tuple(options.preload_modules), scripts)
    grace = options.controller_grace_seconds
    health = HealthLaunch(options.health_checks.settings(), job_dir / "health", fail or {})
    return AgentLauncher(
        job_dir, token_file, by_node, env, start, grace, health,
        host=host, fence_after=fence_after, tls_ca=tls_ca,
    )  # fmt: skip


class LocalRunner:
    """Runs one job on this machine until it ends; see the module docstring.

    ``launcher`` (settable before :meth:`run`) starts each node's agent; by default an
    :class:`~trainguard.platform.node.AgentLauncher`.
    """

    def __init__(
        self,
        plan: JobPlan,
        store: Store,
        source: str,
        injections: Sequence[Injection] = (),
        out: TextIO | None = None,
        err: TextIO | None = None,
        live: bool = False,
        metrics: MetricsOptions | None = None,
        target: Target = LOCAL,
    ) -> None:
        """``target``: where the job runs (:mod:`trainguard.platform.target`)."""
        self.target = target
        slurm = target if isinstance(target, Slurm) else None
        self.continue_record = slurm is not None and slurm.continue_record
        across = isinstance(target, Hosts | Slurm)
        self.plan = plan
        self.store = store
        self.source = source
        # A resumed job (its controller died) keeps its id, directory and token.
        self.resume = target.job if isinstance(target, Resume) else None
        # Why a resume may not start new agents.
        self.restart_blocked = target.restart_blocked if isinstance(target, Resume) else None
        job_id = self.resume.id if self.resume else slurm.job_id if slurm else None
        self.job_id = job_id or f"{plan.name}-{secrets.token_hex(3)}"
        self.job_dir = store.root / "jobs" / self.job_id
        self.console = Console(self.job_id, out or sys.stdout, err or sys.stderr)
        self._say = self.console.say  # a line to the user
        self.logs_dir = self.job_dir / "logs"
        self.token_file = self.job_dir / "token"
        # Each node's memory tier: RAM that outlives its workers; removed when the job ends.
        self.memory_root = MEMORY_ROOT / self.job_id
        # Raises ValueError naming the SPEC when a target is out of range.
        self.injector = injector_for(injections, plan, across_hosts=across)
        # A rehearsal (--inject) times its injections by the loop's turns: no quiet polls.
        quiet = not across and not injections
        self.config, self.groups = control_config(
            plan, self.job_id, durable=True, hosts=across, quiet_polls=quiet
        )
        if slurm is not None and (stop_within := slurm.stop_within) is not None:
            grace = min(self.config.stop_grace_seconds, stop_within / 2)
            self.config = dataclasses.replace(
                self.config,
                stop_grace_seconds=grace,
                stop_slack_seconds=min(self.config.stop_slack_seconds, stop_within - grace),
            )
        self.hosts: AcrossHosts | None = None
        if isinstance(target, Hosts | Slurm):
            self.hosts = AcrossHosts(
                target, self.job_id, plan, self.config, self._say, self._interrupted_by
            )
            self.config = dataclasses.replace(self.config, host_wait=self.hosts.host_wait)
        self.launcher: NodeLauncher | None = None
        self.platform: LocalPlatform | None = None
        self._interrupts = 0
        self._first_signal = 0
        # Why a SIGTERM stops the job (a Slurm job's is scancel or its time limit).
        self.sigterm_reason = slurm.sigterm_reason if slurm else "terminated (SIGTERM)"
        self.metrics = metrics  # serve Prometheus metrics (--metrics-port)
        self._live_wanted = live  # the live line on ``out`` (a terminal; observe/live.py)

    @property
    def interrupted(self) -> bool:
        """True when Ctrl-C (or SIGTERM) ended the job."""
        return self._interrupts > 0

    def run(self) -> JobResult:
        tune_gc_for_a_controller()
        observer = JobObserver(self.job_id, self.plan.name)
        server = self._serve_metrics(observer)  # first: a port in use is a usage error
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        if self.resume is not None:
            token = self.token_file.read_text().strip()
            self.store.update_job(self.job_id, controller_pid=os.getpid(), phase="Running")
        else:
            token = self.hosts.controller.token if self.hosts else secrets.token_urlsafe(32)
            write_token_file(self.token_file, token)
        if self.resume is None and self.continue_record and self._has_record():
            self.store.update_job(self.job_id, controller_pid=os.getpid(), phase="Running")
        elif self.resume is None:
            self.store.create_job(
                self.job_id,
                self.plan.name,
                self.source,
                self.job_dir,
                self.plan.nnodes,
                self.plan.nproc_per_node,
                redact_spec(self.plan.job.model_dump(mode="json", by_alias=True)),  # no secret
            )
        self._warn_of_credentials()
        if self._live_wanted:
            self.console.start_live()
        durable_url = self.plan.job.spec.checkpointing.durable_url or str(self.job_dir / "durable")
        inbox = self.hosts.inbox(durable_url) if self.hosts else Inbox()
        transport = agent_transport(
            inbox,
            self.job_id,
            token,
            poll_interval=self.config.poll_interval,
            timeout=AGENT_CONTACT_TIMEOUT if self.hosts is not None else DEFAULT_CONTACT_TIMEOUT,
        )
        platform = self.platform = LocalPlatform(
            self.job_id,
            self.store,
            transport,
            self.launcher or self._agent_launcher(),
            memory_root=self.memory_root,
            hooks_root=self.job_dir / "health",
            preempt_grace=self._open_capacity_pool(),
            say=self._say,
            pump=self.console.pump,
            interrupted=self._interrupted_by,
            observer=observer,
            live=self.console.live,
            address=self.hosts.controller.local.addr if self.hosts else "127.0.0.1",
            hosts=self.hosts.wiring() if self.hosts else None,
        )
        if self.hosts is not None:
            self.hosts.platform = platform
        injection = InjectionHook(platform, self.injector)
        platform.console_dir = self.logs_dir  # adopted agents' consoles (resume)
        platform.answer_doorbell(self.job_dir)
        platform.rendezvous = self._rendezvous(token)
        controller = JobController(self.config, platform.endpoint)
        previous = self._install_signal_handlers()
        with self.console.copied_to(self.logs_dir / "console.log", self.config.log_limits):
            try:
                self._say(
                    f"job {self.job_id}: {self.plan.nnodes} nodes x {self.plan.nproc_per_node} "
                    f"processes; state in {self.job_dir}"
                )
                transport.start()
                if self.hosts is not None and (missing := self.hosts.wait()):
                    return self._end_before_start(controller, *self.hosts.not_joined(missing))
                begin = None
                if self.resume is not None:
                    begin = resumed_begin(
                        self.store, self.resume, token, platform, controller, self._say,
                        restart_blocked=self.restart_blocked,
                    )  # fmt: skip
                drive(controller, platform, begin=begin, hooks=[injection])
                return self._result(controller)
            finally:
                injection.close()  # stopped workers resumed: they can be shut down
                platform.close()
                if self.hosts is not None:
                    self.hosts.finish(controller)
                inbox.close()
                shutil.rmtree(self.memory_root, ignore_errors=True)
                self.console.end()
                if server is not None:
                    self._stop_metrics(server)
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    # -- internals -----------------------------------------------------------

    def _serve_metrics(self, observer: JobObserver) -> RouteServer | None:
        if self.metrics is None:
            return None
        from trainguard.observe.metrics import Metrics, serve  # ~14 MB: only when asked for

        metrics = Metrics()
        observer.metrics = metrics.job(self.plan.name)
        try:
            server = serve(metrics, self.metrics.port, self.metrics.host)
        except OSError as exc:
            raise MetricsPortError(
                f"--metrics-port {self.metrics.port}: cannot listen on "
                f"{self.metrics.host}: {exc.strerror or exc}"
            ) from None
        self._say(f"metrics: http://{self.metrics.host}:{server.port}/metrics")
        return server

    def _stop_metrics(self, server: RouteServer) -> None:
        """Keep serving for ``linger`` seconds (a last scrape sees the end), then stop."""
        assert self.metrics is not None
        if self.metrics.linger > 0 and not self.interrupted:
            self._say(f"metrics: serving {self.metrics.linger:g} s more for a last scrape")
            time.sleep(self.metrics.linger)
        server.close()

    def _open_capacity_pool(self) -> float | None:
        """An elastic job's pool of node slots: it starts at the job's size unless
        `trainguard scale` set it already. Returns the grace of a preempted node
        (gracefulShutdownTimeoutInSeconds; None: the job is not elastic, no pool)."""
        policy = self.config.elastic
        if policy is None:
            return None
        if self.store.job(self.job_id).capacity is None:
            self.store.set_capacity(self.job_id, len(self.config.node_ids))
        return policy.graceful_shutdown_timeout

    def _rendezvous(self, token: str) -> StoreServiceHandle | None:
        """The job's store service: the one a dead controller left (resume), else a new
        one; None where ``TRAINGUARD_RENDEZVOUS_STORE=rank0`` asks for rank 0's stores."""
        if rendezvous_mode() != "service":
            return None
        state = self.job_dir / "rendezvous.json"
        if self.resume is not None and (found := find_service(state, token)) is not None:
            return found
        grace = self.plan.job.spec.trainguard.controller_grace_seconds
        log = self.logs_dir / "rendezvous.log"
        if self.hosts is None:
            return start_service(state, token, grace, log)
        peers = self.job_dir / "rendezvous-peers.json"
        self.hosts.service.peers_file = peers  # each joined host's address, before its launch
        addr = self.hosts.controller.local.addr
        return start_service(state, token, grace, log, host=addr, peers_file=peers)

    def _warn_of_credentials(self) -> None:
        options = self.plan.job.spec.checkpointing.storage_options
        keys = [f"storageOptions.{key}" for key in secret_storage_keys(options)]
        if keys:
            self._say(
                f"warning: spec.checkpointing: {', '.join(keys)}: credentials in the spec "
                "(shown as ***); prefer the environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ...)"
            )

    def _agent_launcher(self) -> NodeLauncher:
        node_ids = self.config.node_ids
        fail = {
            node_ids[rank]: checks
            for rank, checks in self.injector.health_failures.items()
            if rank < len(node_ids)
        }
        local: Callable[..., AgentLauncher] = functools.partial(
            agent_launcher, self.plan, self.job_dir, self.token_file, self.memory_root,
            self.groups, fail=fail,
        )  # fmt: skip
        if self.hosts is not None:
            user_env = {k: v for _, g in self.groups.values() for k, v in g.env.items()}
            return self.hosts.launcher(local, user_env)
        most = max(len(node_ids), self.config.elastic.max_nodes if self.config.elastic else 0)
        return local(host_workers=most * self.plan.nproc_per_node)

    def _has_record(self) -> bool:
        try:
            self.store.job(self.job_id)
        except JobNotFound:
            return False
        return True

    def _end_before_start(
        self, controller: JobController, reason: str, phase: JobPhase
    ) -> JobResult:
        controller.start(time.time())
        controller.cancel(time.time(), reason, phase)
        self.store.update_job(self.job_id, phase=phase.value, reason=reason)
        self._say(f"job {self.job_id} {phase.value.lower()}: {reason}")
        return JobResult(self.job_id, phase, reason, self.job_dir)

    def _result(self, controller: JobController) -> JobResult:
        for injection in self.injector.pending:
            self._say(
                f"warning: --inject {injection.text} never fired: the job ended before "
                f"{injection.trigger} (or its target never ran)"
            )
        reason = controller.reason or ""
        self._say(f"job {self.job_id} {controller.phase.value.lower()}: {reason}")
        if controller.phase is JobPhase.FAILED:  # the fault that started it, if another
            cause = failure_cause(self.store.events(self.job_id))
            if cause is not None and cause != reason:
                self._say(f"cause: {cause}")
        shortfall = controller.checkpoints.shortfall()  # its newest asked-for step not durable
        if shortfall is not None:
            self._say(shortfall.message)
        summary = fault_summary(controller.timeline.records)
        if summary is not None:
            self._say(summary)
        self._say(f"logs:  {self.logs_dir}  (trainguard logs {self.job_id} [--rank R])")
        self._say(f"state: {self.store.root}  (trainguard describe {self.job_id})")
        return JobResult(self.job_id, controller.phase, reason, self.job_dir)

    def _interrupted_by(self) -> str | None:
        """Why the job is stopped from the terminal or by a signal; None: it is not."""
        if not self._interrupts:
            return None
        return (
            self.sigterm_reason
            if self._first_signal == signal.SIGTERM
            else ("interrupted (Ctrl-C)")
        )

    def _install_signal_handlers(self) -> dict[signal.Signals, SignalHandler]:
        if threading.current_thread() is not threading.main_thread():
            return {}

        def on_signal(signum: int, frame: FrameType | None) -> None:
            self._interrupts += 1
            self._first_signal = self._first_signal or signum
            if self.platform is not None:
                self.platform.book.wake()  # the loop looks at once
            if self._interrupts > 1:
                raise KeyboardInterrupt  # second Ctrl-C: stop waiting; cleanup still runs

        return {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
