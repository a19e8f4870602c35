"""A light resilient worker for control-plane tests: the agent protocol, no torch.

It speaks trainguard.resilient's file protocol the way the real wrapper does (a spare
waits for its spare-<k>.json; every worker acknowledges each attempt it joins), prints
"Batch N" progress lines from rank 0, and records every (pid, attempt) it runs as under
--out. Faults are injected by the test (SIGKILL) or by flags.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

# The control-file protocol without torch (the trainguard.resilient package imports it).
from trainguard.wire import control_files as protocol

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--step-sleep", type=float, default=0.1)
parser.add_argument(
    "--stuck-rank", type=int, default=-1, help="this rank never joins attempt 1 (any process)"
)
parser.add_argument(
    "--deadlock-rank",
    type=int,
    default=-1,
    help="this rank's process of attempt 0 never leaves it (as if deadlocked in a collective)",
)
parser.add_argument(
    "--give-up-rank",
    type=int,
    default=-1,
    help="this rank exits 75 (gave up the restart barrier) instead of joining attempt 1",
)
parser.add_argument(
    "--raise-before-step",
    action="store_true",
    help="every rank (and spare) raises the same ValueError once it joined, before any step",
)
args = parser.parse_args()

control = Path(os.environ["TRAINGUARD_CONTROL_DIR"])
spare_id = os.environ.get("TRAINGUARD_SPARE_ID")
if spare_id is not None:
    while (assignment := protocol.read_spare(control, int(spare_id))) is None:
        time.sleep(0.05)
    rank = assignment.rank
else:
    rank = int(os.environ["RANK"])
args.out.mkdir(parents=True, exist_ok=True)


def record(kind: str, attempt: int) -> None:
    line = json.dumps({"kind": kind, "rank": rank, "pid": os.getpid(), "attempt": attempt})
    with open(args.out / f"rank-{rank}.jsonl", "a") as f:
        f.write(line + "\n")


joined = -1
step = 0
role = "spare" if spare_id is not None else "worker"
while step < args.steps:
    current = protocol.read_attempt(control)
    if current is not None and current.attempt > joined:
        deadlocked = joined == 0 and rank == args.deadlock_rank
        if current.attempt == 1 and (rank == args.stuck_rank or deadlocked):
            time.sleep(600)  # neither leaves attempt 0 nor joins attempt 1
        if current.attempt == 1 and rank == args.give_up_rank:
            print(f"rank {rank} gives up joining attempt 1", file=sys.stderr, flush=True)
            sys.exit(protocol.EXIT_BARRIER_TIMEOUT)
        joined = current.attempt
        record(role, joined)
        ack = protocol.Ack(attempt=joined, pid=os.getpid(), step=step, state_source="self")
        protocol.write_ack(control, rank, ack)
        if args.raise_before_step:
            raise ValueError("mesh shape (2, 3) does not fit 4 ranks")
    if rank == 0:
        print(f"Batch {step} attempt {joined}", flush=True)
    step += 1
    time.sleep(args.step_sleep)
print(f"rank {rank} done", file=sys.stderr, flush=True)
