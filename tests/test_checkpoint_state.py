"""Flattening a nested training state and restoring it in place."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from trainguard.checkpoint.state import StateMismatch, flatten, plan_restore, restore


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "step": 3,
        "data": {"epoch": 2, "offset": 1234, "name": "shard-7", "frac": 0.25, "done": False},
        "none": None,
        "ints": torch.arange(5, dtype=torch.int64),
        "half": torch.randn(3, 2).to(torch.bfloat16),
        "flags": torch.tensor([True, False]),
        "empty": torch.empty(0, 4),
        "view": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
    }


def _pack(state: Any) -> tuple[Any, torch.Tensor]:
    layout, tensors = flatten(state)
    buffer = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for entry, tensor in zip(layout.entries, tensors, strict=True):
        entry.view(buffer).copy_(tensor)
        assert entry.offset % 64 == 0
    return layout, buffer


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a: Any, b: Any, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(_bytes(a), _bytes(b)), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for key in a:
            _assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b and type(a) is type(b), path


def test_round_trip_is_bit_identical_and_in_place() -> None:
    model, optimizer = _trained()
    saved = _state(model, optimizer)
    expected = copy.deepcopy(saved)
    layout, buffer = _pack(saved)

    torch.manual_seed(1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    target = _state(fresh_model, fresh_opt)
    target["data"] = {}
    target["step"] = 0
    target["view"] = torch.zeros(4, 3)
    weight = fresh_model[0].weight
    rng = target["rng"]

    restore(target, layout, buffer)

    _assert_same(expected, target)
    assert fresh_model[0].weight is weight and torch.equal(weight, model[0].weight)
    assert target["rng"] is rng
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    # The fresh optimizer never stepped: its state was added, then loaded the usual way.
    fresh_opt.load_state_dict(target["optim"])
    for p, q in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], fresh_opt.state[q]["exp_avg_sq"])
    assert fresh_opt.param_groups[0]["lr"] == 1e-2


def test_restore_into_stepped_optimizer_updates_its_tensors() -> None:
    model, optimizer = _trained()
    layout, buffer = _pack(_state(model, optimizer))
    other_model, other_opt = _trained()
    other_model(torch.randn(4, 6)).sum().backward()
    other_opt.step()
    exp_avg = other_opt.state[next(iter(other_model.parameters()))]["exp_avg"]
    restore(_state(other_model, other_opt), layout, buffer)
    assert torch.equal(exp_avg, optimizer.state[next(iter(model.parameters()))]["exp_avg"])


def test_unsupported_leaf_names_its_key_path() -> None:
    with pytest.raises(TypeError, match=r"state\['optim'\]\['param_groups'\]\[0\]\['extra'\]"):
        flatten({"optim": {"param_groups": [{"extra": {1, 2}}]}})
    with pytest.raises(TypeError, match=r"state\['x'\]: dict key"):
        flatten({"x": {(1, 2): 3}})


def test_mismatch_names_key_and_changes_nothing() -> None:
    saved = {"a": torch.ones(3), "b": torch.ones(2, 2), "n": 5}
    layout, buffer = _pack(saved)
    a = torch.zeros(3)
    target = {"a": a, "b": torch.zeros(4), "n": 0}
    with pytest.raises(StateMismatch, match=r"state\['b'\].*float32\[2, 2\].*float32\[4\]"):
        restore(target, layout, buffer)
    assert torch.equal(a, torch.zeros(3)) and target["n"] == 0

    with pytest.raises(StateMismatch, match=r"state\['a'\].*int64"):
        restore({"a": torch.zeros(3, dtype=torch.int64), "b": torch.zeros(2, 2)}, layout, buffer)
    with pytest.raises(StateMismatch, match=r"state\['extra'\]: not in the checkpoint"):
        restore({"a": a, "b": torch.zeros(2, 2), "extra": torch.zeros(1)}, layout, buffer)
    with pytest.raises(StateMismatch, match=r"state\['l'\]: checkpoint has 2 items"):
        lay2, buf2 = _pack({"l": [torch.ones(1), 2]})
        restore({"l": [torch.ones(1)]}, lay2, buf2)


def test_tensors_the_state_lacks_are_faulted_in_ahead_and_restored_bit_identical() -> None:
    # Several of host_memory.PREFAULT_STEP, of sizes that are not whole pages; the plan
    # allocates them (and faults them in on a thread), its run fills them.
    saved = {
        "moments": [torch.randn(3_000_001), torch.randn(2, 2_621_447).to(torch.bfloat16)],
        "small": torch.arange(7),
    }
    layout, buffer = _pack(saved)
    target: dict[str, Any] = {"moments": None, "small": torch.zeros(7, dtype=torch.int64)}
    run = plan_restore(target, layout, buffer)
    assert target["moments"] is None  # nothing changes before the plan runs
    run()
    _assert_same(saved, target)
    buffer.fill_(0)  # the new tensors own their memory: the slot may be reused at once
    _assert_same(saved, target)
