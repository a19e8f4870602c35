"""An unmodified worker that prints its world once, then ``Step N`` every 10 ms (no torch)."""

import os
import sys
import time

print(f"world {os.environ['WORLD_SIZE']} rank {os.environ['RANK']}", flush=True)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
for step in range(1, steps + 1):
    time.sleep(0.01)
    print(f"Step {step}", flush=True)
