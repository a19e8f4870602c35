"""A light worker (no torch) that loses steps to a crash and resumes from a checkpoint.

Rank 1 prints ``Step N`` every 10 ms; on attempt 0 it SIGKILLs itself after step
``--kill-at``. On a later attempt it reports restoring ``--resume-from`` (the
``CheckpointRestored`` worker event the Checkpointer sends) and, like a script that logs
every ``--log-every`` steps, prints only every tenth step from there. The other ranks
print no steps: on attempt 0 they wait (as DDP ranks block on a dead peer) until stopped.
"""

import argparse
import os
import signal
import time

from trainguard.monitor import worker_events

parser = argparse.ArgumentParser()
parser.add_argument("--kill-at", type=int, default=208)
parser.add_argument("--resume-from", type=int, default=200)
parser.add_argument("--steps", type=int, default=250)
parser.add_argument("--log-every", type=int, default=10)
args = parser.parse_args()

rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if rank != 1:
    time.sleep(60 if attempt == 0 else 0.5)
    raise SystemExit(0)
start = 0
if attempt > 0:
    start = args.resume_from
    worker_events.emit("CheckpointRestored", f"rank 1 restored step {start}", step=start,
                       tier="memory", seconds=0.0)  # fmt: skip
for step in range(start + 1, args.steps + 1):
    time.sleep(0.01)
    if attempt == 0 or step % args.log_every == 0:
        print(f"Step {step}", flush=True)
    if attempt == 0 and step == args.kill_at:
        time.sleep(0.5)  # its last line read before it dies
        os.kill(os.getpid(), signal.SIGKILL)
