"""A light worker for tests/test_secrets.py: proves it got secrets without showing them.

It writes, under --out, the sha256 of each named environment variable (never the value)
and of each ``storageOptions`` entry of TRAINGUARD_CHECKPOINT_CONFIG, with its pid; then it
waits for --release to exist (while the test looks at every process), and exits 0.
"""

import argparse
import hashlib
import json
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--release", required=True)
parser.add_argument("--names", nargs="*", default=[])
args = parser.parse_args()


def digest(value: object) -> str:
    return hashlib.sha256(str(value).encode()).hexdigest()


rank = int(os.environ["RANK"])
config = json.loads(os.environ.get("TRAINGUARD_CHECKPOINT_CONFIG", "{}"))
options = config.get("storageOptions") or {}
record = {
    "pid": os.getpid(),
    "env": {name: digest(os.environ[name]) for name in args.names if name in os.environ},
    "storage": {key: digest(value) for key, value in options.items()},
    "job_env_leaked": "TRAINGUARD_JOB_ENV" in os.environ,
}
path = os.path.join(args.out, f"rank-{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(path + ".tmp", path)
print(f"rank {rank} has its secrets", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(args.release) and time.monotonic() < deadline:
    time.sleep(0.05)
