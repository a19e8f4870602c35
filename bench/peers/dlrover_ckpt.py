"""DLRover's flash checkpoint (``DdpCheckpointer``, memory storage): save blocking, restore.

    python dlrover_ckpt.py --mib 64 --repeats 3 --dir DIR --out FILE.json

Run in the peers' environment by :mod:`bench.peers.checkpoints`, without ``dlrover-run``:
the checkpointer then starts its own saver process (DLRover's fallback, which lives only
as long as the training process). One gloo rank. ``save_s``: ``save_checkpoint(step,
state, storage_type=StorageType.MEMORY)`` until it returns (a copy into its shared
memory); ``restore_s``: ``load_checkpoint()`` from that shared memory in the same process
(no restarted process: the saver would die with this one), and whether it came back equal.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workload import checkpoint_parser, init_gloo_alone, save_restore, state_of


def main() -> None:
    p = checkpoint_parser(__doc__)
    p.add_argument("--dir", type=Path, required=True)
    args = p.parse_args()
    from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

    os.environ.setdefault("LOCAL_RANK", "0")
    init_gloo_alone()
    state = state_of(args.mib)
    ckpt = DdpCheckpointer(str(args.dir))

    def save(step: int) -> None:
        ckpt.save_checkpoint(step, state, storage_type=StorageType.MEMORY)

    def restore(step: int) -> dict[str, torch.Tensor]:
        loaded = ckpt.load_checkpoint()
        got = loaded.get("model_states", loaded) if isinstance(loaded, dict) else {}
        return dict(got)

    figures = save_restore(state, args.repeats, save, restore)  # type: ignore[arg-type]
    args.out.write_text(json.dumps(figures))
    os._exit(0)  # its saver process and queues do not shut down on their own


if __name__ == "__main__":
    main()
