"""The torchrun tutorial's shape: a Trainer object, local to main(), holds the DDP model;
main() destroys the process group and returns (the model is freed right after)."""

import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class Data(Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.items = [
            (torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class Trainer:
    def __init__(self, model, data, optimizer) -> None:
        self.rank = int(os.environ["RANK"])
        self.model = DDP(model)
        self.data = data
        self.optimizer = optimizer

    def train(self, epochs: int) -> None:
        for epoch in range(epochs):
            self.data.sampler.set_epoch(epoch)
            for source, targets in self.data:
                self.optimizer.zero_grad()
                F.mse_loss(self.model(source), targets).backward()
                self.optimizer.step()
            print(f"[rank{self.rank}] epoch {epoch} done", flush=True)


def main(epochs: int) -> None:
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    data = Data(256)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data))
    trainer = Trainer(model, loader, optimizer)
    trainer.train(epochs)
    with open(os.path.join(os.environ["OUT"], f"result-{trainer.rank}.txt"), "w") as f:
        f.write(repr([round(v, 5) for v in model.weight.detach().flatten().tolist()]))
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
