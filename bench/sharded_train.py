"""The ``sharded`` scenario's training script: a small transformer under FSDP2 or HSDP, on gloo.

``bench/train.py``'s flags, step records and pid files (its :class:`~bench.train.Recorder`);
the model is :class:`Transformer` (``--hidden`` wide, :data:`LAYERS` pre-norm blocks of
causal self-attention and an MLP, each block ``fully_shard``-ed, then the root, as
torchtitan does), trained with Adam on random sequences drawn from (step, rank).
``--layout``: ``fsdp`` (a 1-D mesh: every rank holds a quarter of the state at 4 ranks)
or ``hsdp`` (a 2 x N/2 mesh, replicate x shard: two replicas of N/2 shards).

``--ckpt`` picks the launcher's side:

- ``torch`` (plain torchrun): ``torch.distributed.checkpoint.save`` of the model's and the
  optimizer's state dicts (``get_state_dict``) every ``--ckpt-every`` steps into
  ``--ckpt-dir/step-N``; at start every rank loads the newest complete one (it has DCP's
  ``.metadata``);
- ``trainguard`` (a process-level restart): ``Checkpointer()`` configured by the job,
  ``save(step, {"model": model, "optim": optimizer})`` every step, ``load_latest`` at start;
- ``resilient`` (checkpointless): ``trainguard.resilient``'s ``init_process_group``,
  ``init_device_mesh``, ``fully_shard`` and ``@restartable``; a replaced HSDP rank takes
  its shards from its replica peer, plain FSDP falls back to the memory tier;
- ``none``.

    torchrun --standalone --nproc-per-node 4 bench/sharded_train.py --layout hsdp --out /tmp/s
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))  # the bench package, also when run as a script

from bench import train  # noqa: E402

LAYERS = 4
SEQ = 32
BATCH = 4  # sequences per rank per step
HEADS = 4


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, d // HEADS).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, dim: int, layers: int = LAYERS) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.norm(x)
        return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """bench/train.py's flags, and ``--layout``."""
    layout = argparse.ArgumentParser(add_help=False)
    layout.add_argument("--layout", choices=("fsdp", "hsdp"), default="fsdp")
    known, rest = layout.parse_known_args(argv)
    args = train.parse_args(rest)
    args.layout = known.layout
    return args


def shard(model: Transformer, layout: str, init_mesh: Any, shard_fn: Any) -> Any:
    """``shard_fn`` (``fully_shard``) on each block, then the root, on the layout's mesh."""
    world = dist.get_world_size()
    if layout == "hsdp":
        mesh = init_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for block in model.blocks:
        shard_fn(block, mesh=mesh)
    shard_fn(model, mesh=mesh)
    return mesh


def build(dim: int) -> Transformer:
    torch.manual_seed(0)
    return Transformer(dim)


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's local shards of ``{"model": ..., "optim": ...}``."""
    from torch.distributed.tensor import DTensor

    total = 0
    tensors = list(state["model"].state_dict().values())
    for moments in state["optim"].state_dict()["state"].values():
        tensors += [v for v in moments.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


class SeqRecorderBase(train.Recorder):
    """bench/train.py's recorder; each step's loss is the transformer's on its sequences."""

    def loss(self, step: int, model: nn.Module) -> torch.Tensor:
        gen = torch.Generator().manual_seed(step * self.world + self.rank)
        dim = model.norm.normalized_shape[0]
        x = torch.randn(BATCH, SEQ, dim, generator=gen)
        out: torch.Tensor = model(x).pow(2).mean()
        return out


class SeqRecorder(SeqRecorderBase):
    """Also writes ``<out>/state.json`` (rank 0's state bytes) after its first step."""

    def __init__(self, out: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(out, *args, **kwargs)
        self.out = out
        self.state: dict[str, Any] | None = None

    def step(
        self, step: int, model: nn.Module, optim: torch.optim.Optimizer, step_sleep: float
    ) -> None:
        super().step(step, model, optim, step_sleep)
        if self.rank == 0 and self.state is None:
            self.state = {"state_bytes_per_rank": state_bytes({"model": model, "optim": optim})}
            train.publish(self.out / "state.json", self.state)


def recorder(args: argparse.Namespace, rank: int, world: int, incarnation: str) -> SeqRecorder:
    return SeqRecorder(args.out, rank, world, incarnation, args.log_all_ranks, batch=BATCH)


def latest_dcp(ckpt_dir: Path) -> tuple[int, Path] | None:
    """The newest complete DCP checkpoint under ``ckpt_dir`` (``step-N/.metadata``)."""
    done = [
        (int(p.name.removeprefix("step-")), p)
        for p in ckpt_dir.glob("step-*")
        if p.name.removeprefix("step-").isdigit() and (p / ".metadata").exists()
    ]
    return max(done) if done else None


def main_plain(args: argparse.Namespace) -> None:
    """``--ckpt torch`` (DCP), ``trainguard`` (the Checkpointer) or ``none``, under any launcher."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.hidden)
    shard(model, args.layout, init_device_mesh, fully_shard)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    incarnation = (
        f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}."
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    start = 1
    ckpt: Any = None
    ckpt_dir = args.ckpt_dir or args.out / "dcp"
    if args.ckpt == "trainguard":
        from trainguard.checkpoint import Checkpointer

        ckpt = Checkpointer()
        start = (ckpt.load_latest(state) or 0) + 1
    elif args.ckpt == "torch" and (found := latest_dcp(ckpt_dir)) is not None:
        model_sd, optim_sd = get_state_dict(model, optim)
        saved = {"model": model_sd, "optim": optim_sd}
        dcp.load(saved, checkpoint_id=found[1])
        set_state_dict(
            model, optim, model_state_dict=saved["model"], optim_state_dict=saved["optim"]
        )
        start = found[0] + 1
    rec = recorder(args, rank, world, incarnation)
    for step in range(start, args.steps + 1):
        rec.step(step, model, optim, args.step_sleep)
        if args.ckpt == "trainguard":
            ckpt.save(step, state)
        elif args.ckpt == "torch" and step % args.ckpt_every == 0:
            model_sd, optim_sd = get_state_dict(model, optim)
            dcp.save(
                {"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir / f"step-{step}"
            )
    rec.close()
    if ckpt is not None:
        ckpt.close()
    finish()


def main_resilient(args: argparse.Namespace) -> None:
    """``--ckpt resilient``: checkpointless; an attempt is an incarnation."""
    import trainguard.resilient as resilient
    from trainguard.checkpoint import RankedCheckpointer

    resilient.init_process_group("gloo")
    model = build(args.hidden)
    shard(model, args.layout, resilient.init_device_mesh, resilient.fully_shard)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    checkpointers = RankedCheckpointer()

    def from_checkpoint() -> int | None:
        steps: int | None = checkpointers.get().load_latest(state)
        return steps

    @resilient.restartable(state, fallback=from_checkpoint)
    def loop(run: resilient.Run) -> None:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        rec = recorder(args, run.rank, run.world_size, f"{run_id}.{run.attempt}")
        try:
            for completed in range(run.start_step, args.steps):
                step = completed + 1  # steps are numbered from 1 here, from 0 in run
                rec.step(step, model, optim, args.step_sleep)
                run.completed(completed)
                checkpointers.get().save(step, state)
        finally:
            rec.close()
        dist.barrier()  # every rank done before any tears its group down

    loop()
    checkpointers.close()


def finish() -> None:
    """Every rank done before any tears its group down (see bench/train.py's main)."""
    import time

    dist.barrier()
    time.sleep(0.1)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.ckpt == "resilient":
        main_resilient(args)
    else:
        main_plain(args)


if __name__ == "__main__":
    main()
