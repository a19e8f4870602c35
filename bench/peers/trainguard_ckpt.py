"""trainguard's memory tier: save blocking and restore of the state the peers save.

    python -m bench.peers.trainguard_ckpt --mib 64 --repeats 3 --dir DIR --out FILE.json

The counterpart of ``sagemaker_ckpt.py`` (same state, same repetitions): a
``Checkpointer`` on a memory directory, ``load_latest`` first (nothing to restore; it
prepares the slots, as a training script's start does); per repetition ``save_s`` is
``save()`` until it returns (then ``wait()``, untimed), and ``restore_s`` a new
Checkpointer's ``load_latest`` into the zeroed state (a restarted process's restore).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.peers._workload import state_of
from trainguard.checkpoint import Checkpointer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    state = state_of(args.mib)
    ckpt = Checkpointer(memory_dir=str(args.dir), job_id="bench-peers", environ={})
    ckpt.load_latest(state)
    saves, restores, identical = [], [], True
    for step in range(1, args.repeats + 1):
        for t in state.values():
            t.add_(1.0)
        saved = {k: t.clone() for k, t in state.items()}
        start = time.perf_counter()
        ckpt.save(step, state)
        saves.append(time.perf_counter() - start)
        ckpt.wait()
        for t in state.values():
            t.zero_()
        loader = Checkpointer(memory_dir=str(args.dir), job_id="bench-peers", environ={})
        start = time.perf_counter()
        restored = loader.load_latest(state)
        restores.append(time.perf_counter() - start)
        loader.close()
        identical = identical and restored == step
        identical = identical and all(torch.equal(state[k], saved[k]) for k in state)
    ckpt.close()
    args.out.write_text(
        json.dumps({"save_s": saves, "restore_s": restores, "identical": identical})
    )


if __name__ == "__main__":
    main()
