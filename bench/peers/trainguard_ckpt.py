"""trainguard's memory tier: save blocking and restore of the state the peers save.

    python -m bench.peers.trainguard_ckpt --mib 64 --repeats 3 --dir DIR --out FILE.json

The counterpart of ``sagemaker_ckpt.py`` (same state, same repetitions): a
``Checkpointer`` on a memory directory, ``load_latest`` first (nothing to restore; it
prepares the slots, as a training script's start does); per repetition ``save_s`` is
``save()`` until it returns (then ``wait()``, untimed), and ``restore_s`` a new
Checkpointer's ``load_latest`` into the zeroed state (a restarted process's restore).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.peers._workload import checkpoint_parser, save_restore, state_of
from trainguard.checkpoint import Checkpointer


def main() -> None:
    p = checkpoint_parser(__doc__)
    p.add_argument("--dir", type=Path, required=True)
    args = p.parse_args()
    state = state_of(args.mib)
    ckpt = Checkpointer(memory_dir=str(args.dir), job_id="bench-peers", environ={})
    ckpt.load_latest(state)

    def save(step: int) -> object:
        ckpt.save(step, state)
        return ckpt.wait

    def restore(step: int) -> dict[str, torch.Tensor] | None:
        loader = Checkpointer(memory_dir=str(args.dir), job_id="bench-peers", environ={})
        restored = loader.load_latest(state)
        loader.close()
        if restored != step:
            raise SystemExit(f"trainguard_ckpt: restored step {restored}, saved {step}")
        return None

    figures = save_restore(state, args.repeats, save, restore)  # type: ignore[arg-type]
    ckpt.close()
    args.out.write_text(json.dumps(figures))


if __name__ == "__main__":
    main()
