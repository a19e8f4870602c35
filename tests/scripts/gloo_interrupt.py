"""A DDP rank whose attempt is interrupted from another thread in the middle of ``backward``.

    gloo_interrupt.py --out DIR --rank R --port P [--delay S]

Two ranks train DDP (small buckets: several all-reduces per step) on an AttemptGroup. At
step 5, once ``backward`` has begun, a thread of rank 1 interrupts the group
(:meth:`AttemptGroup.interrupt`, as the thread watching for a newer attempt does) after
``--delay`` seconds. Each rank writes ``<out>/result-<R>.json``: whether its step raised
a collective failure, and how long after the interrupt began; then it aborts the group.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from trainguard.resilient.group import AttemptGroup, is_collective_failure
from trainguard.resilient.protocol import Attempt

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--port", type=int, required=True)
parser.add_argument("--delay", type=float, default=0.0)
args = parser.parse_args()

group = AttemptGroup(join_poll_interval=0.02, collective_timeout=600.0)
attempt = Attempt(
    attempt=0, master_addr="127.0.0.1", master_port=args.port, world_size=2,
    barrier_timeout_seconds=120.0,
)  # fmt: skip
group.join(attempt, args.rank, time.monotonic() + 120.0, lambda: False)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
step, began = 0, 0.0


def interrupt(grad: torch.Tensor) -> torch.Tensor:
    global began
    if args.rank == 1 and step == 5 and not began:
        began = time.monotonic()
        threading.Thread(target=stop, args=(args.delay,)).start()
    return grad


def stop(delay: float) -> None:
    time.sleep(delay)
    group.interrupt(0)


model[-1].weight.register_hook(interrupt)  # the first gradient of backward
ddp = DistributedDataParallel(model, bucket_cap_mb=0.05)
result: dict[str, object] = {"raised": False}
try:
    for step in range(1, 1000):
        ddp(torch.randn(8, 128)).sum().backward()
        if step > 5 and args.rank == 1:
            break
except Exception as exc:
    result = {"raised": True, "collective": is_collective_failure(exc), "step": step}
result["seconds"] = time.monotonic() - began if began else None
(args.out / f"result-{args.rank}.json").write_text(json.dumps(result))
group.abort()
os._exit(0)
