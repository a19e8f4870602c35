"""Save blocking of sharded state: trainguard's ``Checkpointer.save`` against DCP's ``async_save``.

    torchrun --standalone --nproc-per-node 4 bench/sharded_ckpt.py --layout hsdp \\
        --hidden 256 --repeats 5 --out /tmp/sharded-ckpt.json

The state is :mod:`bench.sharded_train`'s transformer, ``fully_shard``-ed as there, with
Adam, after one training step (so the moments exist): ``{"model": model, "optim":
optimizer}``, DTensors of this rank's shards. Repetitions interleave the two sides, each
save started idle (the previous one waited for, untimed):

- ``trainguard_save_s``: ``Checkpointer.save(step, state)`` into a memory tier under
  ``/dev/shm`` (its slots pre-faulted by a first, untimed save, as in training after the
  first step), to its return; the checksum goes on in the background;
- ``baseline_dcp_async_save_s``: ``torch.distributed.checkpoint.async_save`` of the same
  state to local disk, to its return, the state given as DCP's tutorial does (a
  ``Stateful`` whose ``state_dict()`` is ``get_state_dict(model, optimizer)``, which DCP
  calls inside ``async_save``, as torchtitan's checkpointer does), on a gloo group of its
  own (its background thread runs collectives); the staging copy, the plan and the
  write's start are inside, the write itself goes on in the background.

Each repetition's time is the slowest rank's (every rank waits for it to return). Rank 0
writes ``--out``: the per-rank state bytes and each side's times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # the bench package, also when run as a script

from bench import sharded_train  # noqa: E402


class AppState:
    """DCP's ``Stateful`` for a model and its optimizer (the DCP tutorial's ``AppState``)."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def measure(layout: str, hidden: int, repeats: int, workdir: Path, shm: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainguard.checkpoint import Checkpointer

    rank, world = dist.get_rank(), dist.get_world_size()
    model = sharded_train.build(hidden)
    sharded_train.shard(model, layout, init_device_mesh, fully_shard)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = sharded_train.SeqRecorder(workdir / "out", rank, world, "ckpt")
    rec.step(1, model, optim, 0.0)
    rec.close()
    state = {"model": model, "optim": optim}
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    ckpt = Checkpointer(memory_dir=str(shm), job_id="bench-sharded", environ=environ)
    ckpt.save(0, state)  # the slots faulted in, as after a training run's first save
    ckpt.wait()
    ours: list[float] = []
    theirs: list[float] = []
    app = {"app": AppState(model, optim)}
    # DCP's own group, as its docs advise for async_save: its background thread's
    # collectives (the metadata's gather) must not interleave with this thread's.
    dcp_group = dist.new_group(backend="gloo")
    for rep in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(rep + 1, state)
        ours.append(slowest(time.perf_counter() - t0))
        ckpt.wait()
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(
            app, checkpoint_id=workdir / "dcp" / f"step-{rep + 1}", process_group=dcp_group
        )
        theirs.append(slowest(time.perf_counter() - t0))
        future.result()
    ckpt.close()
    size = torch.tensor([sharded_train.state_bytes(state)], dtype=torch.float64)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    return {
        "layout": layout,
        "world": world,
        "state_bytes_per_rank": int(size.item()),
        "trainguard_save_s": ours,
        "baseline_dcp_async_save_s": theirs,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=("fsdp", "hsdp"), default="fsdp")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    # The memory tier in RAM, DCP's checkpoint on local disk (every rank writes its part).
    name = f"tg-sharded-ckpt-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}"
    disk = Path("/var/tmp" if Path("/var/tmp").is_dir() else tempfile.gettempdir()) / name
    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()) / name
    try:
        result = measure(args.layout, args.hidden, args.repeats, disk, shm)
        if dist.get_rank() == 0:
            args.out.write_text(json.dumps(result))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(disk, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
