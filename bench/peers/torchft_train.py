"""One torchft replica group (one process, gloo) training ``_workload``'s MLP.

    python torchft_train.py --replica R --replicas N --lighthouse ADDR --steps S --out DIR

Run in the peers' environment by :mod:`bench.peers.torchft_peer`, one process per replica
group. The loop is torchft's ``train_ddp`` example's: the
quorum starts before the step, the gradients are averaged by ``Manager.allreduce`` over
the quorum's live replicas, and the optimizer steps only where ``should_commit`` agrees.
A replica that (re)joins heals from a live one over torchft's HTTP transport (model,
optimizer and the Manager's step). Replica 0 records the committed steps; its
incarnation changes with the membership (the quorum id or the number of participants:
the lighthouse can keep the quorum id when a member is dropped).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import TCPStore
from torchft import Manager, Optimizer, ProcessGroupGloo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workload import Records, batch, model, publish_pid


def average_gradients(manager: Manager, net: torch.nn.Module) -> None:
    """The gradients averaged over the quorum's replicas in one all-reduce (one bucket,
    as DDP does for this model). torchft 0.2.0's ``DistributedDataParallel`` is not used:
    its comm hook asserts (``assert fut._fut``) once the Manager has errored, which kills
    the surviving replicas at the first fault."""
    grads = [p.grad for p in net.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    manager.allreduce(flat).wait()  # a no-op after an error; should_commit then says no
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--replicas", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=10.0, help="collectives, s")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    publish_pid(args.out, args.replica)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    net, optim = model()

    def load_state_dict(state: dict[str, object]) -> None:
        net.load_state_dict(state["model"])  # type: ignore[arg-type]
        optim.load_state_dict(state["optim"])  # type: ignore[arg-type]

    def state_dict() -> dict[str, object]:
        return {"model": net.state_dict(), "optim": optim.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=60),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"bench_{args.replica}",
    )
    ft_optim = Optimizer(manager, optim)
    records = Records(args.out, write=args.replica == 0)
    membership, epoch = (-1, 0), 0
    while (step := manager.current_step()) < args.steps:
        start = time.time()
        ft_optim.zero_grad()  # starts the quorum (async, beside the forward pass)
        x = batch(step + 1, args.replica, args.replicas)
        time.sleep(args.step_sleep)
        net(x).pow(2).mean().backward()
        average_gradients(manager, net)
        ft_optim.step()  # steps only where should_commit agrees; then current_step + 1
        if manager.current_step() > step:
            end = time.time()
            now = (manager._quorum_id, manager.num_participants())  # no public accessor
            if now != membership:
                membership, epoch = now, epoch + 1
            records.step(f"m{epoch}", manager.current_step(), start, end, now[1])
    manager.shutdown(wait=False)
    os._exit(0)  # the lighthouse may be gone: nothing left to wait for


if __name__ == "__main__":
    main()
