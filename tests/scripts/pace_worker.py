"""A light worker that prints ``Step N`` at its own pace, without collectives (no torch):
each rank progresses on its own, so a throttled rank falls behind the others."""

import sys
import time

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
for step in range(1, steps + 1):
    time.sleep(seconds)
    print(f"Step {step}", flush=True)
