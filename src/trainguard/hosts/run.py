"""``trainguard run ... --rdzv-endpoint HOST:PORT``: one job on several hosts.

The same command on every host, in any order. Where ``HOST`` is this machine, it runs the
controller and node 0 (:mod:`trainguard.hosts.controller_host`); anywhere else, a host
daemon that joins it (:mod:`trainguard.hosts.daemon`). Every host's ``trainguard run``
exits with the job's result.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import shutil
import signal
import ssl
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from types import FrameType

from trainguard.hosts.addresses import (
    JobEndpoint,
    LocalAddress,
    is_local,
    parse_endpoint,
    route_to,
)
from trainguard.hosts.controller_host import ControllerHost, interface_env
from trainguard.hosts.daemon import HostDaemon
from trainguard.hosts.security import (
    TokenError,
    client_tls,
    job_token,
    server_tls,
    write_token_file,
)
from trainguard.netlimits import raise_nofile
from trainguard.observe.terminal import safe_cell
from trainguard.platform.control_config import control_config, fence_after
from trainguard.platform.launch import JobToRun, launch, usage
from trainguard.platform.local import EXIT_INTERRUPTED, MEMORY_ROOT, agent_launcher
from trainguard.platform.node import AgentLauncher
from trainguard.platform.store import JobNotFound, Store
from trainguard.platform.target import Hosts
from trainguard.platform.views import JOINED, TERMINAL_PHASES
from trainguard.spec.plan import JobPlan
from trainguard.spec.secrets import redact_spec
from trainguard.wire.hosts import JoinReply

__all__ = ["endpoint_of", "loopback_endpoint", "run_on_hosts", "say"]


def endpoint_of(args: argparse.Namespace, nnodes: int) -> JobEndpoint | None:
    """The job's endpoint: ``--rdzv-endpoint``, or torchrun's static ``--master-addr``
    when the job has more than one node; None for a job on this machine alone."""
    if args.rdzv_endpoint:
        try:
            return parse_endpoint(args.rdzv_endpoint)
        except ValueError as exc:
            raise ValueError(f"--rdzv-endpoint: {exc}") from None
    if args.master_addr and nnodes > 1:
        return JobEndpoint(args.master_addr, args.master_port)
    return None


def loopback_endpoint(endpoint: JobEndpoint, local: LocalAddress) -> str | None:
    """Why no other host can reach ``endpoint`` when this host serves it on a loopback
    address (Debian's hosts file maps the hostname to 127.0.1.1); None when it can."""
    if not ipaddress.ip_address(local.addr).is_loopback:
        return None
    named = not _is_address(endpoint.host)  # a name a hosts file maps here
    return (
        f"--rdzv-endpoint {endpoint} is {local.addr} on this host, a loopback address no "
        "other host can reach"
        + (f" (a hosts file line such as '127.0.1.1 {endpoint.host}')" if named else "")
        + ": the other hosts will wait for it; give this host's network address"
        + (" (or a name that resolves to it)" if named else "")
        + " on every host"
    )


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def run_on_hosts(args: argparse.Namespace, job: JobToRun, endpoint: JobEndpoint) -> int:
    """Where ``endpoint`` is this host, the job's controller and node 0; anywhere else a
    host daemon that joins it. The exit code."""
    raise_nofile()  # listening beyond loopback: the most descriptors this user may have
    try:
        token = job_token(args.token_file)
        tls_server = server_tls(args.tls_cert, args.tls_key)
        tls_client = client_tls(args.tls_ca, args.tls_cert)
    except TokenError as exc:
        return usage(str(exc))
    try:
        local = route_to(endpoint.host, endpoint.port)
    except OSError as exc:
        return usage(f"--rdzv-endpoint {endpoint}: no route to {endpoint.host}: {exc}")
    if not is_local(endpoint.host):
        if job.injections:
            return usage("--inject: give injections on the host that runs the controller")
        return _join(args, job.plan, job.store, endpoint, local, token, tls_server, tls_client)
    if (why := loopback_endpoint(endpoint, local)) is not None:
        print(f"[trainguard] warning: {why}", file=sys.stderr, flush=True)
    if args.node_rank not in (None, 0):
        return usage(
            f"--node-rank {args.node_rank}: the host that owns --rdzv-endpoint "
            f"({endpoint.host}) runs the controller and node 0"
        )
    partition = job.plan.job.spec.trainguard.partition_timeout_seconds
    controller = ControllerHost(
        endpoint, local, token, args.join_timeout, partition, tls_server, tls_client,
        args.tls_ca if tls_server is not None else None,
    )  # fmt: skip
    return launch(job, Hosts(controller))


def say(line: str) -> None:
    """A line of this host's console: one line, however a worker's error it quotes reads."""
    print(f"[trainguard] {safe_cell(line)}", file=sys.stderr, flush=True)


def _join(
    args: argparse.Namespace,
    plan: JobPlan,
    store: Store,
    endpoint: JobEndpoint,
    local: LocalAddress,
    token: str,
    tls_server: ssl.SSLContext | None,
    tls_client: ssl.SSLContext | None,
) -> int:
    spec = redact_spec(plan.job.model_dump(mode="json", by_alias=True))

    def make_launcher(reply: JoinReply) -> AgentLauncher:
        job_dir = store.root / "jobs" / reply.job_id
        (job_dir / "logs").mkdir(parents=True, exist_ok=True)
        token_file = job_dir / "token"
        write_token_file(token_file, token)  # the state directory may be the other hosts'
        config, groups = control_config(plan, reply.job_id, durable=True, hosts=True)
        user_env = {k: v for _, g in groups.values() for k, v in g.env.items()}
        _record_row(store, reply, plan, job_dir, endpoint, spec)
        return agent_launcher(
            plan,
            job_dir,
            token_file,
            MEMORY_ROOT / reply.job_id,
            groups,
            host=local.addr,
            host_env=interface_env(local, user_env),
            durable_url=reply.durable_url,
            fence_after=fence_after(config.lost_after),
            tls_ca=args.tls_ca if tls_client is not None else None,
        )

    daemon = HostDaemon(
        endpoint,
        token,
        local,
        spec,
        make_launcher,
        node_rank=args.node_rank,
        join_timeout=args.join_timeout,
        tls_server=tls_server,
        tls_client=tls_client,
        say=say,
        out=sys.stdout.buffer,
        # A tier this host holds by that name is an earlier job's (a Slurm job id again,
        # a daemon killed before it could free it): never restored from.
        first_launch=lambda reply, node_id: free_memory_tiers(
            MEMORY_ROOT / reply.job_id, [node_id]
        ),
        on_progress=lambda reply, phase, restarts: store.update_job(
            reply.job_id, phase=phase, restarts=restarts
        ),
    )
    say(f"joining the job at {daemon.controller_url} from {local.addr}")
    previous = _sigterm_interrupts()
    try:
        code = daemon.run()
    except KeyboardInterrupt:
        say("interrupted; this host's workers were stopped")
        return EXIT_INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if daemon.reply is not None:
        ended = daemon.progress[0] if daemon.progress is not None else None
        if ended not in TERMINAL_PHASES:  # no word of the end
            ended = "Succeeded" if code == 0 else "Failed"
        store.update_job(daemon.reply.job_id, phase=ended)
        free_memory_tiers(MEMORY_ROOT / daemon.reply.job_id, daemon.launched)
    return code


def _sigterm_interrupts() -> signal.Handlers | int | Callable[..., object] | None:
    """SIGTERM (``systemctl stop``, ``kill``) ends a joined host as Ctrl-C does: its
    agents and their workers are stopped, and it exits 130, in any phase (joining
    included). The handler it replaces; None off the main thread (nothing installed)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def free_memory_tiers(job_root: Path, node_ids: Iterable[str]) -> None:
    """The memory tiers (RAM) of the nodes this host ran, once it is out of the job: nobody
    resumes from them, and a later job given the same id (a Slurm job id after a
    reinstall) must not find them. Only these nodes': hosts may share ``/dev/shm``."""
    for node_id in node_ids:
        shutil.rmtree(job_root / node_id, ignore_errors=True)
    with contextlib.suppress(OSError):  # another host's nodes are still in it
        job_root.rmdir()


def _record_row(
    store: Store,
    reply: JoinReply,
    plan: JobPlan,
    job_dir: Path,
    endpoint: JobEndpoint,
    spec: dict[str, object],
) -> None:
    """This host's record of the job (`trainguard logs` here shows its ranks)."""
    try:
        store.job(reply.job_id)
    except JobNotFound:
        store.create_job(
            reply.job_id,
            plan.name,
            f"{JOINED}{endpoint} as {reply.node_id}",
            job_dir,
            plan.nnodes,
            plan.nproc_per_node,
            json.loads(json.dumps(spec)),
        )
