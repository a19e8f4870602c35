"""A gloo rank that calls ``scale_requested()`` in a loop, through three phases.

    elastic_worker.py --out DIR --store FILE --rank R --world N

1. ``quiet``: 40 calls with ``every=2`` and nothing asked: each should be False.
2. ``signal``: ``elastic_event_detected()`` until True (the test sends SIGUSR1 to one
   rank), then ``clear_scale_request()``.
3. ``file``: ``scale_requested(every=4)`` until True (the test creates one rank's
   ``TRAINGUARD_ELASTIC_FILE``).

After the first call of phases 2 and 3 it writes ``<out>/ready-<phase>-<R>``; at the
end, ``<out>/result-<R>.json``: the calls that said True in phase 1 and the call that
said True in phases 2 and 3.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from trainguard.elastic import clear_scale_request, elastic_event_detected, scale_requested

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path, required=True)
parser.add_argument("--store", type=Path, required=True)
parser.add_argument("--rank", type=int, required=True)
parser.add_argument("--world", type=int, required=True)
args = parser.parse_args()

dist.init_process_group(
    "gloo",
    init_method=f"file://{args.store}",
    rank=args.rank,
    world_size=args.world,
    timeout=timedelta(seconds=180),
)


def until_true(phase: str, check: Callable[[], bool]) -> int:
    calls = 0
    while True:
        calls += 1
        if check():
            return calls
        if calls == 1:
            (args.out / f"ready-{phase}-{args.rank}").write_text("")
        time.sleep(0.005)


quiet = [call for call in range(1, 41) if scale_requested(every=2)]
signalled = until_true("signal", elastic_event_detected)
clear_scale_request()
filed = until_true("file", lambda: scale_requested(every=4))
result = {"quiet": quiet, "signal": signalled, "file": filed}
(args.out / f"result-{args.rank}.json").write_text(json.dumps(result))
dist.destroy_process_group()
