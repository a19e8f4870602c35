"""A rank that trains DDP on an AttemptGroup until a collective fails, then aborts the group.

    gloo_abort.py --out DIR --rank R --world N --port P [--no-abort]

Small DDP buckets give every step many collectives, so a SIGKILLed peer dies in the
middle of one and some survivors wait on *live* peers. After its failure a rank writes
``<out>/error-<R>.json`` (time, message) and sleeps instead of exiting, so nobody is
unblocked by a peer's exit: only the abort can end the others' wait. ``--no-abort``
leaves the group alone (what a test shows the abort is needed for).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from trainguard.resilient.group import AttemptGroup
from trainguard.resilient.protocol import ResilientAttempt

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--world", type=int, required=True)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--no-abort", action="store_true")
args = parser.parse_args()

group = AttemptGroup(join_poll_interval=0.02, collective_timeout=600.0)
attempt = ResilientAttempt(
    attempt=0,
    master_addr="127.0.0.1",
    master_port=args.port,
    world_size=args.world,
    barrier_timeout_seconds=120.0,
)
group.join(attempt, args.rank, time.monotonic() + 120.0, lambda: False)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
steps = 0
try:
    while True:
        ddp(torch.randn(8, 128)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
        if steps % 20 == 0:
            (args.out / f"steps-{args.rank}").write_text(str(steps))
except Exception as exc:
    failed = time.time()
    if not args.no_abort:
        group.abort()
    error = {"time": failed, "steps": steps, "error": str(exc).splitlines()[0][:300]}
    (args.out / f"error-{args.rank}.json").write_text(json.dumps(error))
    time.sleep(600)  # never the reason a peer is unblocked
    os._exit(1)
