"""A gloo group, then ``Step N`` every 20 ms (for injections), then a barrier: a worker
whose every attempt forms its group through the attempt's rendezvous store."""

import sys
import time

import torch.distributed as dist

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
dist.init_process_group("gloo")
for step in range(1, steps + 1):
    time.sleep(0.02)
    print(f"Step {step}", flush=True)
dist.barrier()
time.sleep(0.1)
dist.destroy_process_group()
