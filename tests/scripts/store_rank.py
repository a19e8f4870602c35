"""A light rank for the rendezvous tests: per line on stdin ({"port": P}), leave the
last group (if any) and form a new one through ``env://`` at ``MASTER_ADDR``:P with
``TORCHELASTIC_USE_AGENT_STORE=True`` (every rank a client, as trainguard's workers),
all-reduce a one, print the sum."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

print("ready", flush=True)
for line in sys.stdin:
    order = json.loads(line)
    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()  # a peer may be dead
    os.environ["MASTER_PORT"] = str(order["port"])
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=120))
    value = torch.ones(1)
    dist.all_reduce(value)
    print(json.dumps({"sum": int(value.item())}), flush=True)
