"""torch.multiprocessing.spawn inside the script: the children import it as __mp_main__."""

import os
from pathlib import Path

import torch.multiprocessing as mp


def work(index: int, out: str) -> None:
    with open(os.path.join(out, f"child-{index}.txt"), "w") as f:
        f.write(f"child {index} ran {__name__}")


if __name__ == "__main__":
    mp.spawn(work, args=(os.environ["OUT"],), nprocs=2)
    names = sorted(os.listdir(os.environ["OUT"]))
    print("children:", names)
    Path(os.environ["OUT"], "result-0.txt").write_text(repr(names))
