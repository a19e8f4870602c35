"""A light worker for control-plane tests: no torch, starts in milliseconds.

It records its environment and pid under --out, prints a line, and then does
what it is told: exit with a code on one rank and attempt, or sleep.
"""

import argparse
import json
import os
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument(
    "--fail-attempts",
    type=int,
    default=0,
    help="fail on attempts [0, N); -1 fails on every attempt",
)
parser.add_argument("--exit-code", type=int, default=3)
parser.add_argument(
    "--raise-rank", type=int, default=-1, help="this rank raises ValueError on every attempt"
)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--beats", type=int, default=0, help="call trainguard.heartbeat N times")
parser.add_argument(
    "--freeze-rank",
    type=int,
    default=-1,
    help="on attempt 0, this rank stops beating halfway and sleeps",
)
args = parser.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
os.makedirs(args.out, exist_ok=True)
record = os.path.join(args.out, f"rank-{rank}-attempt-{attempt}.json")
with open(record + ".tmp", "w") as f:  # then renamed: a test never reads half a record
    json.dump({"pid": os.getpid(), "env": dict(os.environ), "argv": sys.argv}, f)
os.replace(record + ".tmp", record)
print(f"hello from rank {rank} attempt {attempt}", flush=True)
print(f"stderr line from rank {rank}", file=sys.stderr, flush=True)

if rank == args.raise_rank:
    time.sleep(0.2)
    raise ValueError("lr must be positive")
if rank == args.fail_rank and (args.fail_attempts < 0 or attempt < args.fail_attempts):
    time.sleep(0.5)
    sys.exit(args.exit_code)
for step in range(args.beats):
    if rank == args.freeze_rank and attempt == 0 and step == args.beats // 2:
        time.sleep(600)
    import trainguard

    trainguard.heartbeat(step=step)
    time.sleep(0.1)
time.sleep(args.sleep)
print(f"rank {rank} done", flush=True)
