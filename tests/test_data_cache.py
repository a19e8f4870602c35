"""trainguard.data: the slot format, the reader's decisions, and the cache in one process
(sequence, renumbered ranks, corrupt slots, iterable sources)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.data import DataCache
from trainguard.data.plan import Consumer, cover, victim, wanted
from trainguard.data.slots import Key, SlotFile, encode_meta, tensors_of
from trainguard.elastic.data import epoch_order


class Samples(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample i: ``x`` = [i, i, i] (float32), ``y`` = i; each read logged."""

    def __init__(self, length: int = 96, delay: float = 0.0) -> None:
        self.length, self.delay, self.reads = length, delay, []  # type: ignore[var-annotated]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.reads.append(i)
        time.sleep(self.delay)
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(i)}


@pytest.fixture
def rank_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    def set_rank(rank: int, world: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_RANK", str(rank))

    set_rank(0, 1)
    return set_rank


def test_slot_round_trip_and_checksum(tmp_path: Path) -> None:
    slots = SlotFile(tmp_path / "slots", 8192, 2, create=True)
    batch = {
        "ids": torch.arange(12, dtype=torch.int64).reshape(4, 3),
        "pair": (torch.ones(4, 2, dtype=torch.bfloat16), [torch.zeros(4, dtype=torch.bool)]),
        "n": 7,
    }
    tensors: list[torch.Tensor] = []
    meta, parts = encode_meta(tensors_of(batch, tensors), tensors)
    key = Key(5, 0, 4)
    slots.write(1, key, meta, parts)
    got, why = slots.read(1, key)
    assert why == "" and got["n"] == 7 and isinstance(got["pair"], tuple)
    assert torch.equal(got["ids"], batch["ids"]) and got["pair"][0].dtype == torch.bfloat16
    assert slots.read(1, Key(5, 0, 2)) == (None, "moved")
    assert slots.holding(5) == {key: 1} and slots.header(0) is None
    with open(tmp_path / "slots", "r+b") as f:  # one flipped payload bit
        f.seek(8192 + 4096 + 3)
        byte = f.read(1)[0]
        f.seek(8192 + 4096 + 3)
        f.write(bytes([byte ^ 1]))
    assert slots.read(1, key) == (None, "corrupt")
    slots.invalidate(1)
    assert slots.header(1) is None
    with pytest.raises(TypeError, match="not object"):
        tensors_of({"bad": object()}, [])


def test_cover_wanted_victim() -> None:
    index = {Key(3, 0, 4): 0, Key(3, 4, 8): 1, Key(4, 0, 8): 2}
    assert cover(Key(3, 0, 8), index) == [(Key(3, 0, 4), 0), (Key(3, 4, 8), 1)]
    assert cover(Key(4, 4, 8), index) == [(Key(4, 0, 8), 2)]
    assert cover(Key(5, 0, 8), index) is None
    a = Consumer(1, 10, 0, 4, -1, 0.0, True)
    b = Consumer(2, 12, 4, 8, -1, 0.0, False)  # gone: protected, not prefetched for
    assert wanted([a, b], 2) == [Key(10, 0, 4), Key(11, 0, 4)]
    held = {Key(7, 0, 4): 0, Key(9, 0, 4): 1, Key(30, 0, 4): 2, Key(11, 4, 8): 3}
    assert victim(held, [5], [a, b], 2, 2) == 5  # a free slot first
    assert victim(held, [], [a, b], 2, 2) == 0  # the oldest behind every consumer
    assert victim({Key(9, 0, 4): 1, Key(30, 0, 4): 2}, [], [a], 2, 2) == 2  # the farthest ahead
    assert victim({Key(9, 0, 4): 1, Key(11, 4, 8): 3}, [], [a, b], 2, 2) is None


def test_sequence_ranks_and_renumbering(tmp_path: Path, rank_env: Any) -> None:
    """Global batch s is the epoch order's s-th slice; ranks get their rows; a rank of a
    smaller world (renumbered) gets its rows from the pieces others' slices left."""
    data = Samples(96)
    rank_env(1, 2)
    with DataCache(data, 8, shuffle=True, seed=3, directory=tmp_path, ahead=4) as cache:
        assert cache.steps_per_epoch == 12
        for step in (0, 1):
            start = step * 8
            assert cache.batch(step)["y"].tolist() == list(
                epoch_order(96, 3)[start + 4 : start + 8]
            )
        rank_env(0, 2)
        first = cache.batch(1)["y"].tolist()
        rank_env(0, 1)  # the ranks' prefetching stays in epoch 0: each sample read once
        whole = cache.batch(1)
        assert whole["y"].tolist()[:4] == first and whole["x"].shape == (8, 3)
        assert all(data.reads.count(i) == 1 for i in whole["y"].tolist())  # from the cache
        assert cache.batch(13)["y"].tolist() == list(epoch_order(96, 4)[8:16])  # epoch 1
        rank_env(0, 3)
        with pytest.raises(ValueError, match="global_batch 8 is not a multiple of world 3"):
            cache.batch(2)


def test_iteration_state_dict_and_corrupt_slot(tmp_path: Path) -> None:
    data = Samples(64)
    with DataCache(data, 4, directory=tmp_path) as cache:
        assert [b["y"][0].item() for _, b in zip(range(3), cache, strict=False)] == [0, 4, 8]
        assert cache.state_dict() == {"step": 3}
        cache.load_state_dict({"step": 1})
        assert next(iter(cache))["y"].tolist() == [4, 5, 6, 7]
        with pytest.raises(ValueError, match="step must be an int"):
            cache.load_state_dict({"step": "1"})
        slots = SlotFile(next(tmp_path.iterdir()) / "slots", *_layout(tmp_path))
        slot = slots.holding(1)[Key(1, 0, 4)]
        with open(slots.path, "r+b") as f:
            f.seek(slot * slots.slot_bytes + 4096)
            f.write(b"\xff" * 8)
        assert cache.batch(1)["y"].tolist() == [4, 5, 6, 7]  # read again, never the slot's
        deadline = time.monotonic() + 30
        while slots.read(slot, Key(1, 0, 4))[1] == "corrupt":  # emptied, then refilled
            assert time.monotonic() < deadline, "the reader left the corrupt slot"
            time.sleep(0.01)
        slots.close()


def test_iterable_source(tmp_path: Path) -> None:
    loader = torch.utils.data.DataLoader(Samples(40), batch_size=4)
    with DataCache(loader, 4, directory=tmp_path, ahead=3, lookback=2) as cache:
        assert cache.steps_per_epoch is None
        assert [cache.batch(s)["y"][0].item() for s in (0, 1, 2, 7, 3)] == [0, 4, 8, 28, 12]
        with pytest.raises(RuntimeError, match="ended before batch 10"):
            cache.batch(10)


def test_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="global_batch 200 > the dataset's 96"):
        DataCache(Samples(), 200, directory=tmp_path)
    with pytest.raises(ValueError, match="name"):
        DataCache(Samples(), 8, directory=tmp_path, name="../x")


def _layout(root: Path) -> tuple[int, int]:
    import json

    layout = json.loads((next(root.iterdir()) / "layout.json").read_text())
    return layout["slot_bytes"], layout["count"]
