"""One rank of NVRx's in-process restart (``nvidia_resiliency_ext.inprocess.Wrapper``).

    RANK=R WORLD_SIZE=5 MASTER_ADDR=... MASTER_PORT=P python nvrx_train.py --active 4 ...

Run in the peers' environment by :mod:`bench.peers.nvrx_peer`: ``--active`` + spares
processes, started directly (NVRx's own note: ``torchrun`` kills a node's other workers
when one dies, which defeats in-process restart). The Wrapper keeps ``--active`` ranks
active (``MaxActiveWorldSize``, then ``ShiftRanks``, its default), the rest wait as
spares. On a fault its monitor process sees the rank die, the others' monitor threads
run its ``AbortTorchDistributed`` (on gloo that is ``destroy_process_group``: a
collective in flight ends with gloo's timeout, ``--timeout``) and the wrapped function
is called again in every live process, the spare taking the dead rank's place. The
model and optimizer live outside the wrapped function, so the survivors keep them; on
each (re)start DDP broadcasts rank 0's parameters (the spare's come from there; its
optimizer momentum starts at zero) and rank 0's step count is broadcast. Rank 0 records
the steps, its incarnation being the Wrapper's restart iteration.
"""

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import nvidia_resiliency_ext.inprocess as inprocess
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workload import Records, batch, model, publish_pid

ARGS: argparse.Namespace
NET, OPTIM = model()
DONE = 0  # steps completed by this process (survives a restart)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=3.0, help="gloo's collective timeout, s")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args()


# No ``from __future__ import annotations``: the Wrapper finds the CallWrapper parameter
# by its annotation, which must be a class, not a string.
def train(base_store: dist.Store, call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:  # noqa: UP045
    global DONE
    assert call_wrapper is not None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.PrefixStore(str(call_wrapper.iteration), base_store)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=ARGS.timeout)
    )
    ddp = torch.nn.parallel.DistributedDataParallel(NET)  # broadcasts rank 0's parameters
    done = torch.tensor([DONE])
    dist.broadcast(done, 0)
    DONE = int(done.item())
    records = Records(ARGS.out, write=rank == 0)
    incarnation = f"i{call_wrapper.iteration}"
    for step in range(DONE + 1, ARGS.steps + 1):
        start = time.time()
        x = batch(step, rank, world)
        time.sleep(ARGS.step_sleep)
        loss = ddp(x).pow(2).mean()
        OPTIM.zero_grad()
        loss.backward()
        OPTIM.step()
        DONE = step
        call_wrapper.ping()
        records.step(incarnation, step, start, time.time(), world)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    global ARGS
    ARGS = parse()
    logging.basicConfig(level=logging.WARNING)
    initial_rank = int(os.environ["RANK"])
    publish_pid(ARGS.out, initial_rank)
    port = int(os.environ["MASTER_PORT"])
    base_store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        port + 1,
        is_master=initial_rank == 0,
        multi_tenant=True,
        wait_for_workers=False,
    )
    wrapped = inprocess.Wrapper(
        store_kwargs={"port": port + 2, "timeout": timedelta(seconds=60)},
        rank_assignment=inprocess.Compose(
            inprocess.rank_assignment.MaxActiveWorldSize(ARGS.active),
            inprocess.rank_assignment.ShiftRanks(),
        ),
        heartbeat_interval=timedelta(seconds=0.5),
        heartbeat_timeout=timedelta(seconds=5),
        monitor_thread_interval=timedelta(seconds=0.1),
        monitor_process_interval=timedelta(seconds=0.1),
        progress_watchdog_interval=timedelta(seconds=0.1),
        last_call_wait=timedelta(seconds=0.1),
        soft_timeout=timedelta(seconds=30),
        hard_timeout=timedelta(seconds=40),
        barrier_timeout=timedelta(seconds=60),
        completion_timeout=timedelta(seconds=60),
    )(train)
    wrapped(base_store)


if __name__ == "__main__":
    main()
