"""A light worker that prints ``Step N`` every 10 ms (no torch): for exact injection."""

import sys
import time

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 300
for step in range(1, steps + 1):
    time.sleep(0.01)
    print(f"Step {step}", flush=True)
