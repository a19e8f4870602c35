"""NVRx: ``inprocess.Wrapper`` around the training loop, four active ranks and a spare.

A run starts ``ACTIVE + SPARES`` processes of ``nvrx_train.py`` in the peers' environment
(``RANK``/``WORLD_SIZE`` set directly, no torchrun), SIGKILLs the process that is rank 3
once step ``S`` was recorded, and lets the Wrapper recover: its monitor process reports
the death, the survivors abort (gloo: ``destroy_process_group``, the collective in
flight ends at gloo's timeout, :data:`GLOO_TIMEOUT_S`) and call the loop again with the
spare as rank 3. Nothing is restarted from outside. The record is computed from rank
0's steps by ``bench.recovery.from_steps`` (a new Wrapper iteration is a new incarnation).
"""

from __future__ import annotations

import signal
from dataclasses import replace

from bench.baseline import free_port, signal_at_step
from bench.peers.env import PeerEnv
from bench.peers.procs import PEERS_DIR, Procs
from bench.peers.worlds import world_after
from bench.recovery import FAULTY_RANK, FaultRecord, FaultSetup, from_steps
from bench.steps import read_steps

ACTIVE = 4
SPARES = 1
GLOO_TIMEOUT_S = 3.0
"""gloo's collective timeout: NVRx's abort destroys gloo groups but cannot interrupt a
collective in flight (its abort calls ``abort()`` on NCCL backends only)."""


def run(env: PeerEnv, setup: FaultSetup) -> FaultRecord:
    out = setup.workdir / "out"
    procs = Procs(setup.workdir / "logs")
    port = free_port()
    world = ACTIVE + SPARES
    names = [f"rank{r}" for r in range(world)]
    try:
        for r, name in enumerate(names):
            procs.start(
                name,
                [
                    env.python,
                    "-W",
                    "ignore",
                    str(PEERS_DIR / "nvrx_train.py"),
                    "--active",
                    str(ACTIVE),
                    "--steps",
                    str(setup.args.steps),
                    "--step-sleep",
                    str(setup.args.step_sleep),
                    "--timeout",
                    str(GLOO_TIMEOUT_S),
                    "--out",
                    str(out),
                ],
                env={
                    "RANK": str(r),
                    "LOCAL_RANK": str(r),
                    "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                },
            )
        steps = lambda: read_steps(out / "steps.txt")  # noqa: E731
        fault_at = signal_at_step(
            steps,
            lambda rank: procs.target(f"rank{rank}"),  # initial rank 3 is rank 3 until a fault
            FAULTY_RANK,
            setup.step,
            signal.SIGKILL,
            setup.timeout,
        )
        finished = procs.wait_all([n for n in names if n != f"rank{FAULTY_RANK}"], setup.timeout)
        codes = procs.returncodes()
    finally:
        procs.stop()
    record = from_steps(steps(), fault_at, None, "" if finished else "did not finish in time")
    detail = {
        "gloo_timeout_s": GLOO_TIMEOUT_S,
        "returncodes": codes,
        **world_after(out / "worlds.txt", fault_at, record.stall_s, ACTIVE),
    }
    if not record.recovered:
        detail["log_tail"] = procs.log_tail("rank0", 8)
    return replace(record, detail=detail)
