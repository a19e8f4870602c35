"""A SIGTERM handler: the test signals the worker once it is ready; the handler cleans up
and exits 7."""

import os
import signal
import sys
import time
from pathlib import Path

out = os.environ["OUT"]


def on_term(signum: int, frame: object) -> None:
    print(f"got signal {signum}", flush=True)
    Path(out, "result-0.txt").write_text("cleaned up")
    sys.exit(7)


signal.signal(signal.SIGTERM, on_term)
Path(out, "ready").write_text(str(os.getpid()))
for _ in range(600):
    time.sleep(0.1)
print("never signalled")
