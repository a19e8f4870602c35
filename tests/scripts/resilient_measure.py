"""Measure an in-process restart with a hot spare (3 gloo ranks, the script as agent).

    .venv/bin/python tests/scripts/resilient_measure.py --trials 3

Per trial: SIGKILL rank 2 after 10 steps, hand its rank to the spare, publish the next
attempt; prints the time from the kill to the survivors' collective error, from the
new attempt.json to the last rank's ack, and from the kill to the first step completed
in the new attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from test_resilient_recovery import Job

parser = argparse.ArgumentParser()
parser.add_argument("--trials", type=int, default=3)
args = parser.parse_args()

root = Path(tempfile.mkdtemp(prefix="resilient-measure-"))
events_dir = root / "events"
os.environ["TRAINGUARD_EVENT_DIR"] = str(events_dir)
for trial in range(args.trials):
    events_dir.mkdir()
    job = Job(root / f"trial-{trial}")
    job.start_spare(0)
    job.start_all()
    job.wait_for_steps(0, 10)
    killed = time.time()
    job.procs[2].kill()
    job.procs[2].wait()
    job.assign_spare(0, 2)
    job.next_attempt()
    published = time.time()
    job.check_success()
    events = [
        json.loads(line) for f in events_dir.glob("*.jsonl") for line in f.read_text().splitlines()
    ]
    errors = [
        e["data"]["fault_time"]
        for e in events
        if e["kind"] == "InProcessRestart" and e["data"]["attempt"] == 1
    ]
    acks = [e["time"] for e in events if e["kind"] == "AttemptJoined" and e["data"]["attempt"] == 2]
    resumed = min(
        e["time"]
        for rank in range(3)
        for e in job.events(rank)
        if e["event"] == "completed" and e["attempt"] == 2
    )
    print(
        f"trial {trial}: kill -> survivors' error {min(errors) - killed:.3f}-"
        f"{max(errors) - killed:.3f} s; attempt.json -> all ranks acked "
        f"{max(acks) - published:.3f} s; kill -> next completed step {resumed - killed:.3f} s",
        flush=True,
    )
    for f in events_dir.iterdir():
        f.unlink()
    events_dir.rmdir()
