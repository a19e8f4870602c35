"""A light worker (no torch) that prints ``Step N`` lines, then exits 0; one rank instead
blocks forever, idle, after its last step: ``--linger-rank R`` (``--short K``: that rank
stops K steps early, its work not done)."""

import argparse
import os
import threading
import time

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--linger-rank", type=int, default=-1)
parser.add_argument("--short", type=int, default=0)
args = parser.parse_args()

rank = int(os.environ["RANK"])
lingers = rank == args.linger_rank
last = args.steps - (args.short if lingers else 0)
for step in range(1, last + 1):
    time.sleep(0.02)
    print(f"Step {step}", flush=True)
if lingers:
    print("done with my steps; now blocking forever", flush=True)
    threading.Event().wait()  # idle: no CPU, never returns
