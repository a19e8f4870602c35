"""``python -m trainguard.agent``: the node agent.

    python -m trainguard.agent --node-id ID (--token-file FILE | --token-env VAR) --log-dir DIR
        [--host 127.0.0.1] [--port 0] [--port-file FILE] [--parent-pid PID
        [--controller-grace SECONDS]]
        [--incarnation NAME] [--standby] [--cwd DIR] [--env KEY=VALUE]... [--cold-start]
        [--preload MODULE]... [--max-replica-bytes BYTES]
        [--pre-train-script JSON] [--post-train-script JSON]
        [--health JSON [--health-peers RANK,WORLD,ADDR,PORT] [--health-hooks DIR]
        [--health-fail CHECK]...] -- WORKER_ARGV...

The workers' extra environment may also come in ``$TRAINGUARD_JOB_ENV`` (a JSON object;
see :mod:`trainguard.agent.jobenv`): the way to hand them secrets, as ``--env`` is on the
command line, which every local user can read. ``--env`` wins over it for the same name.

Arguments are checked before the agent's own modules are imported, so a bad command line
fails fast. The agent never imports torch: it supervises, its workers train.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.agent.exec_worker import set_parent_death_signal
from trainguard.agent.jobenv import take_job_env
from trainguard.agent.train_scripts import parse_script_flag
from trainguard.auth import read_token_file

if TYPE_CHECKING:
    import ssl

    from trainguard.health.settings import HealthSettings
    from trainguard.health.suite import Peers

logger = logging.getLogger("trainguard.agent")

EXIT_PARENT_GONE = 1
EXIT_STUCK = 1
MAX_REPLICA_BYTES_ENV = "TRAINGUARD_MAX_REPLICA_BYTES"
MAX_CONTROLLER_GRACE = 7 * 24 * 3600.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainguard.agent",
        usage="%(prog)s --node-id ID (--token-file FILE | --token-env VAR) --log-dir DIR "
        "[options] -- WORKER_ARGV...",
        description="Run one node's workers, driven by the controller over HTTP.",
    )
    parser.add_argument("--node-id", required=True, help="this node's id (as in assignments)")
    token = parser.add_mutually_exclusive_group(required=True)
    token.add_argument("--token-file", type=Path, help="file holding the API token")
    token.add_argument("--token-env", metavar="VAR", help="environment variable holding the token")
    parser.add_argument("--log-dir", required=True, type=Path, help="the job's log directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: any free port)")
    parser.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    parser.add_argument(
        "--parent-pid",
        type=int,
        help="the controller that launched the agent: it dies with it (PR_SET_PDEATHSIG), or "
        "outlives it by --controller-grace",
    )
    parser.add_argument(
        "--controller-grace",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --parent-pid: keep the workers running this long after the controller is "
        "gone, for one to attach (POST /attach); 0: die with it",
    )
    parser.add_argument(
        "--incarnation",
        default="",
        help="this agent process's name among the node's agents (in every status it reports)",
    )
    parser.add_argument("--cwd", type=Path, help="working directory of the workers")
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="add to workers' env"
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="a spare host's agent, started before its node is needed: it warms its worker "
        "template and waits, running no health check and no attempt, until its host's "
        "daemon gives it the node's incarnation (POST /assign)",
    )
    parser.add_argument(
        "--cold-start",
        action="store_true",
        help="start every worker as a fresh interpreter (default: fork Python workers from "
        "a template process that has imported their modules)",
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="also import this module in the worker template",
    )
    parser.add_argument(
        "--pre-train-script",
        type=parse_script_flag,
        default=(),
        metavar="JSON",
        help="argv (a JSON list) run before each attempt's workers start; failing is a fault",
    )
    parser.add_argument(
        "--post-train-script",
        type=parse_script_flag,
        default=(),
        metavar="JSON",
        help="argv (a JSON list) run once the attempt's workers all exited 0; failing is a fault",
    )
    parser.add_argument(
        "--max-replica-bytes",
        type=replica_bytes,
        default=os.environ.get(MAX_REPLICA_BYTES_ENV) or None,
        metavar="BYTES",
        help="the most bytes of peers' memory-tier replicas this agent holds (default: "
        f"${MAX_REPLICA_BYTES_ENV}, else what the memory filesystem has room for)",
    )
    parser.add_argument(
        "--health",
        metavar="JSON",
        help="the job's spec.trainguard.healthChecks (JSON): on-start checks, monitors",
    )
    parser.add_argument(
        "--health-peers",
        metavar="RANK,WORLD,ADDR,PORT",
        help="this node's place in the connectivity check among the job's new nodes",
    )
    parser.add_argument(
        "--health-hooks",
        type=Path,
        metavar="DIR",
        help="rehearsal hooks: DIR/kernel.log is read as the kernel log, DIR/disk-full "
        "makes the space monitors report full",
    )
    parser.add_argument(
        "--health-fail",
        action="append",
        default=[],
        metavar="CHECK",
        help="fail this on-start check without running it (a rehearsal)",
    )
    parser.add_argument(
        "--fence-after",
        type=float,
        metavar="SECONDS",
        help="refuse to commit to the durable tier once the controller has not reached this "
        "agent for SECONDS (a job on several hosts: shorter than the controller's lost-node "
        "bound, so a node declared lost writes nothing that lasts); default: never",
    )
    parser.add_argument(
        "--tls-ca",
        type=Path,
        metavar="FILE",
        help="check an https report URL's certificate against this CA (a job's own)",
    )
    parser.add_argument("--log-level", default="INFO", help="agent log level (default: INFO)")
    return parser


def parse_health(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[HealthSettings, Peers | None] | None:
    """The --health* flags as a :class:`~trainguard.agent.health.HealthKeeper`'s
    settings (options, peers), or None without --health; parser.error on a bad one."""
    if args.health is None:
        return None
    from trainguard.health.settings import HealthSettings
    from trainguard.health.suite import Peers

    try:
        options = HealthSettings.from_json(args.health)
    except ValueError as exc:
        parser.error(f"--health: {exc}")
    peers = None
    if args.health_peers is not None:
        parts = args.health_peers.split(",")
        if len(parts) != 4 or not (parts[0] + parts[1] + parts[3]).isdigit() or not parts[2]:
            parser.error("--health-peers: expected RANK,WORLD,ADDR,PORT")
        rank, world, addr, port = parts
        peers = Peers(int(rank), int(world), addr, int(port))
    return options, peers


def replica_bytes(raw: str) -> int:
    """``--max-replica-bytes``: a positive count of bytes."""
    value = raw.strip()
    if not value.isdigit() or not 0 < int(value) < 2**63:
        raise argparse.ArgumentTypeError(f"expected a positive count of bytes, got {raw!r}")
    return int(value)


def read_token_env(name: str) -> str:
    """The API token in environment variable ``name`` (e.g. from a Kubernetes Secret)."""
    token = os.environ.get(name, "").strip()
    if not token:
        raise ValueError(f"--token-env: ${name} is not set or empty")
    return token


def parse_env(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or "\0" in item:  # quote no value: it may be a secret
            raise ValueError(f"--env: expected KEY=VALUE, got {key[:40]!r}{sep}...")
        env[key] = value
    return env


def write_port_file(path: Path, port: int) -> None:
    """Write ``port`` atomically (readers never see a partial file)."""
    from trainguard.atomic import write_text_atomic

    write_text_atomic(path, f"{port}\n", mode=0o644)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if "--" not in argv:
        parser.error("missing '-- WORKER_ARGV...' (the command each worker runs)")
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    worker_argv = argv[split + 1 :]
    if not worker_argv:
        parser.error("WORKER_ARGV after '--' is empty")

    if not 0 <= args.controller_grace <= MAX_CONTROLLER_GRACE:
        parser.error(f"--controller-grace: must be between 0 and {MAX_CONTROLLER_GRACE:g}")
    if args.parent_pid is not None:
        if not args.controller_grace:
            set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != args.parent_pid:
            print(f"trainguard agent: parent {args.parent_pid} is gone; exiting", file=sys.stderr)
            return EXIT_PARENT_GONE
    try:
        token = (
            read_token_file(args.token_file) if args.token_file else read_token_env(args.token_env)
        )
        agent_env = {**take_job_env(), **parse_env(args.env)}
    except ValueError as exc:
        parser.error(str(exc))
    if args.tls_ca is not None and not args.tls_ca.is_file():
        parser.error(f"--tls-ca: {args.tls_ca} is not a file")
    if args.cwd is not None and not args.cwd.is_dir():
        parser.error(f"--cwd: {args.cwd} is not a directory")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port: {args.port} is not a port number")
    if args.fence_after is not None and not 0 < args.fence_after < MAX_CONTROLLER_GRACE:
        parser.error(
            f"--fence-after: expected a positive number of seconds, got {args.fence_after}"
        )
    try:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--log-dir: cannot create {args.log_dir}: {exc.strerror}")

    from trainguard.agent.logcap import CappedStderrHandler  # its log file stays bounded

    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s agent {args.node_id} %(levelname)s %(name)s: %(message)s",
        handlers=[CappedStderrHandler()],
    )
    return _serve(args, token, agent_env, worker_argv, parser)


def _serve(
    args: argparse.Namespace,
    token: str,
    agent_env: dict[str, str],
    worker_argv: list[str],
    parser: argparse.ArgumentParser,
) -> int:
    # The agent's own modules only once the command line is known to be good.
    from trainguard.agent.controller_watch import ControllerWatch
    from trainguard.agent.lease import ControllerLease
    from trainguard.agent.logs import Console, LogLayout, orphaned_console
    from trainguard.agent.persist import MEMORY_DIR_ENV
    from trainguard.agent.replicas import ReplicaStore
    from trainguard.agent.server import AgentHTTPServer
    from trainguard.agent.supervisor import AgentSupervisor, AgentTimings
    from trainguard.agent.train_scripts import TrainScripts
    from trainguard.agent.warm import StartOptions
    from trainguard.agent.workers import reserved_env_keys
    from trainguard.wakeup import Wakeup

    clashes = sorted(set(agent_env) & reserved_env_keys())
    if clashes:
        parser.error(f"--env: {clashes} are set by the agent for every worker")

    timings = AgentTimings()
    lease = ControllerLease(args.fence_after)
    supervisor = AgentSupervisor(
        args.node_id,
        worker_argv,
        LogLayout(args.log_dir.resolve()),
        agent_env=agent_env,
        cwd=args.cwd.resolve() if args.cwd is not None else None,
        console=Console(sys.stdout.buffer, orphaned_console(args.log_dir.resolve(), args.node_id)),
        timings=timings,
        token=token,
        incarnation=args.incarnation,
        start_options=StartOptions(
            warm=not args.cold_start,
            preload=tuple(args.preload),
            scripts=TrainScripts(args.pre_train_script, args.post_train_script),
        ),
        fence=lease.fenced,
        tls=_client_tls(args.tls_ca),
    )
    supervisor.standby = args.standby
    # The main thread sleeps until a signal, the supervisor's end, or its controller's
    # (ControllerWatch.wait): no tick while nothing happens.
    wakeup = Wakeup()
    supervisor.on_done = wakeup.wake
    if args.parent_pid is not None and args.controller_grace:
        supervisor.controller = ControllerWatch(
            args.parent_pid, args.controller_grace, wakeup=wakeup
        )
    health = parse_health(args, parser)
    if health is not None:
        from trainguard.agent.health import HealthKeeper

        options, peers = health
        job_dir = agent_env.get("TRAINGUARD_JOB_DIR") or str(args.log_dir.resolve())
        supervisor.health = HealthKeeper(
            options,
            job_dir,
            supervisor.health_news,
            peers=peers,
            fail=args.health_fail,
            hooks=args.health_hooks,
        )
    memory_dir = agent_env.get(MEMORY_DIR_ENV)
    # Replicas of other nodes' memory tiers live beside this node's own (also in RAM).
    replicas = (
        ReplicaStore(Path(memory_dir).parent / "replicas", args.max_replica_bytes)
        if memory_dir
        else None
    )
    try:
        server = AgentHTTPServer(
            args.host,
            args.port,
            supervisor,
            token,
            replicas,
            lease=lease,
            log_root=args.log_dir.resolve(),
        )
    except OSError as exc:
        parser.error(f"--host/--port: cannot bind {args.host}:{args.port}: {exc.strerror}")
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: received.append(signum))
    wakeup.catch_signals()
    supervisor.start()
    server.start()
    if args.port_file is not None:
        write_port_file(args.port_file, server.port)
    logger.info("listening on %s:%d (pid %d)", args.host, server.port, os.getpid())
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        logger.warning("the agent API is reachable beyond this machine (%s)", args.host)

    exit_code = 0
    deadline: float | None = None
    watch, orphaned = supervisor.controller, False
    # The controller is gone for good (grace over, or, with no grace, it died): nobody
    # resumes from this node's memory tier; it is freed once the workers are stopped
    # (a worker still saving would otherwise make it again).
    free_tier = False
    while True:
        if deadline is not None:
            wakeup.wait(deadline - time.monotonic())
        elif watch is not None:
            watch.wait()
        else:
            wakeup.wait(None)
        if supervisor.done.is_set():
            break
        if received and deadline is None:
            name = signal.Signals(received[0]).name
            exit_code = 128 + received[0]
            supervisor.request_shutdown(f"agent received {name}")
            deadline = time.monotonic() + timings.shutdown_timeout
            # No grace: a SIGTERM with our parent gone is its death (PR_SET_PDEATHSIG).
            free_tier = _parent_gone(args.parent_pid)
        elif watch is not None and deadline is None:
            if watch.gone_for() is not None and not orphaned:
                orphaned = True
                logger.warning(
                    "controller pid %d is gone: the workers keep running for %g s "
                    "(trainguard resume re-attaches)", watch.pid, watch.grace,
                )  # fmt: skip
            if (why := watch.expired()) is not None:
                supervisor.request_shutdown(why)
                deadline = time.monotonic() + timings.shutdown_timeout
                free_tier = True
            elif orphaned and watch.gone_for() is None:
                orphaned = False
                logger.info("controller pid %d attached", watch.pid)
        elif deadline is not None and time.monotonic() > deadline:
            # Exiting is enough: the workers' parent-death signal kills them.
            logger.error("supervisor did not stop its workers in time; exiting anyway")
            if free_tier and memory_dir:
                _remove_memory(Path(memory_dir).parent)
            os._exit(EXIT_STUCK)
    server.stop()
    # Woken at once, the signal may have come while the parent was still exiting (its
    # forking thread first): look again now that the workers are stopped.
    free_tier = free_tier or (bool(received) and _parent_gone(args.parent_pid))
    if free_tier and memory_dir:
        _remove_memory(Path(memory_dir).parent)
    logger.info("agent exits: %s", supervisor.snapshot().reason)
    return exit_code


def _parent_gone(parent_pid: int | None) -> bool:
    """Whether the agent's parent (the controller that launched it) ended or is ending:
    this agent was handed to another parent, or the parent's main thread has exited (a
    zombie leader: the rest of it follows; its parent-death signal fires per thread)."""
    if parent_pid is None:
        return False
    if os.getppid() != parent_pid:
        return True
    from trainguard.agent.controller_watch import ENDED
    from trainguard.platform.procs import proc_stat

    stat = proc_stat(parent_pid)
    return stat is None or stat[0] in ENDED


def _client_tls(ca: Path | None) -> ssl.SSLContext | None:
    if ca is None:
        return None
    import ssl

    return ssl.create_default_context(cafile=str(ca))


def _remove_memory(node_dir: Path) -> None:
    """This node's memory tier and replicas (RAM); the job's directory once it is empty."""
    import contextlib
    import shutil

    shutil.rmtree(node_dir, ignore_errors=True)
    with contextlib.suppress(OSError):  # other nodes' tiers are still there
        node_dir.parent.rmdir()


if __name__ == "__main__":
    sys.exit(main())
