"""torchft: four replica groups of one gloo rank each, its lighthouse, a launcher loop.

A run starts ``torchft_lighthouse`` and :data:`REPLICAS` processes of
``torchft_train.py`` in the peers' environment, SIGKILLs replica 3 once step ``S`` was
recorded (the same fault, injected the way the torchrun baselines' is), and restarts that
replica as soon as its process is gone, as a launcher (torchrun, Kubernetes) would. The
other replicas never stop: the lighthouse drops the dead one from the quorum once its
heartbeats stop (``heartbeat_timeout_ms``) and the next quorum trains on three; the
restarted one heals from a live replica over HTTP and rejoins a later quorum.

The record is computed from replica 0's steps by ``bench.recovery.from_steps``, as for
trainguard (a new membership is a new incarnation; a step that ran through the kill into
the new membership counts as after it: ``worlds.absorbed_steps``), plus the world size
of the first step after the fault and how long until the world was back to four.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, replace

from bench.baseline import free_port, signal_at_step
from bench.peers.env import PeerEnv
from bench.peers.procs import PEERS_DIR, Procs
from bench.peers.worlds import absorbed_steps, world_after
from bench.recovery import FAULTY_RANK, FaultRecord, FaultSetup, from_steps
from bench.steps import read_steps

REPLICAS = 4


@dataclass(frozen=True)
class Lighthouse:
    """``torchft_lighthouse``'s flags (None: its default)."""

    heartbeat_timeout_ms: int | None = None  # default 5000
    join_timeout_ms: int | None = None  # default 60000
    quorum_tick_ms: int | None = None  # default 100

    def argv(self) -> list[str]:
        flags = {
            "--heartbeat_timeout_ms": self.heartbeat_timeout_ms,
            "--join_timeout_ms": self.join_timeout_ms,
            "--quorum_tick_ms": self.quorum_tick_ms,
        }
        return [a for k, v in flags.items() if v is not None for a in (k, str(v))]


DEFAULTS = Lighthouse()
TUNED = Lighthouse(heartbeat_timeout_ms=1000, join_timeout_ms=1000, quorum_tick_ms=50)
COLLECTIVE_TIMEOUT_S = 10.0  # the Manager's timeout (collectives, should_commit, healing)


def run(env: PeerEnv, setup: FaultSetup, lighthouse: Lighthouse) -> FaultRecord:
    out = setup.workdir / "out"
    procs = Procs(setup.workdir / "logs")
    port = free_port()
    address = f"http://127.0.0.1:{port}"
    faulty = f"replica{FAULTY_RANK}"

    def start_replica(r: int) -> None:
        procs.start(
            f"replica{r}",
            [
                env.python,
                "-W",
                "ignore",
                str(PEERS_DIR / "torchft_train.py"),
                "--replica",
                str(r),
                "--replicas",
                str(REPLICAS),
                "--lighthouse",
                address,
                "--steps",
                str(setup.args.steps),
                "--step-sleep",
                str(setup.args.step_sleep),
                "--timeout",
                str(COLLECTIVE_TIMEOUT_S),
                "--out",
                str(out),
            ],
            env={"TORCHFT_LIGHTHOUSE": address},
        )

    restarted_at: float | None = None
    try:
        procs.start(
            "lighthouse",
            [
                str(env.bin / "torchft_lighthouse"),
                "--min_replicas",
                "1",
                "--bind",
                f"[::]:{port}",
                *lighthouse.argv(),
            ],
        )
        time.sleep(0.5)
        for r in range(REPLICAS):
            start_replica(r)
        steps = lambda: read_steps(out / "steps.txt")  # noqa: E731
        fault_at = signal_at_step(
            steps,
            lambda _rank: procs.target(faulty),
            FAULTY_RANK,
            setup.step,
            signal.SIGKILL,
            setup.timeout,
        )
        if fault_at is not None and procs.wait_exit(faulty, 30.0) is not None:
            start_replica(FAULTY_RANK)  # the launcher's restart
            restarted_at = time.time()
        names = [f"replica{r}" for r in range(REPLICAS)]
        finished = procs.wait_all(names, setup.timeout)
        codes = procs.returncodes()
    finally:
        procs.stop()
    record = from_steps(
        absorbed_steps(steps(), fault_at),
        fault_at,
        None,
        "" if finished else "did not finish in time",
    )
    world = world_after(out / "worlds.txt", fault_at, record.stall_s, REPLICAS)
    detail = {
        "lighthouse": lighthouse.argv() or "defaults",
        "restarted_after_s": None
        if restarted_at is None or fault_at is None
        else restarted_at - fault_at,
        "returncodes": codes,
        **world,
    }
    if not record.recovered:
        detail["log_tail"] = procs.log_tail("replica0")
    return replace(record, detail=detail)
