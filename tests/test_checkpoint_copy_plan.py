"""save()'s copy plan: reused while the state's structure holds, rebuilt when it changes.

Each test saves through a plan, changes the structure (an optimizer's first step, a
resized tensor, a dtype, a new key), saves again, and restores the step bit for bit in a
new Checkpointer; the meta of the slot must describe the new structure.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.copy_plan import plan_for
from trainguard.checkpoint.shard import encode_meta, make_meta


def _ckpt(memory_dir: str) -> Checkpointer:
    return Checkpointer(memory_dir=memory_dir, job_id="plan", environ={})


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got: Any, want: Any) -> None:
    """``got`` equals ``want`` bit for bit (tensors: dtype, shape and bytes)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert (got.dtype, got.shape) == (want.dtype, want.shape)
        assert torch.equal(_bits(got), _bits(want))
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want)
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _assert_same(g, w)
    else:
        assert type(got) is type(want) and got == want


def _meta_shapes(memory_dir: str, step: int) -> dict[str, tuple[str, list[int]]]:
    """The tensors (path -> dtype, shape) in the meta of ``step``'s slot."""
    for meta_path in Path(memory_dir).glob("rank-0-slot-*.meta"):
        meta = json.loads(meta_path.read_text())
        if meta["step"] == step:
            return {
                "/".join(map(str, t["path"])): (t["dtype"], t["shape"]) for t in meta["tensors"]
            }
    raise AssertionError(f"no slot holds step {step}")


def _saved_then_restored(shm: str, states: list[dict[str, Any]], blank: dict[str, Any]) -> None:
    """Save each of ``states`` (steps 1, 2, ...) through one Checkpointer, then restore the
    last into ``blank`` with a new one: it must equal the last state bit for bit."""
    ckpt = _ckpt(shm)
    try:
        for step, state in enumerate(states, start=1):
            assert ckpt.save(step, state)
    finally:
        ckpt.close()
    loader = _ckpt(shm)
    try:
        assert loader.load_latest(blank) == len(states)
    finally:
        loader.close()
    _assert_same(blank, states[-1])


def test_optimizer_state_appearing_after_the_first_step_is_saved(shm: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim, "step": 0}
    ckpt = _ckpt(shm)
    try:
        assert ckpt.save(0, state)  # no moments yet
        assert not any("exp_avg" in key for key in _meta_shapes(shm, 0))
        for step in (1, 2):
            model(torch.randn(4, 8)).square().sum().backward()
            optim.step()
            state["step"] = step
            assert ckpt.save(step, state)  # step 1: a new plan; step 2: the same one
        saved = copy.deepcopy({"model": model.state_dict(), "optim": optim.state_dict()})
        assert any("exp_avg" in key for key in _meta_shapes(shm, 2))
    finally:
        ckpt.close()
    torch.manual_seed(1)  # other weights, a fresh optimizer without moments
    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    loader = _ckpt(shm)
    try:
        assert loader.load_latest({"model": model2, "optim": optim2, "step": 0}) == 2
    finally:
        loader.close()
    _assert_same(model2.state_dict(), saved["model"])
    _assert_same(optim2.state_dict()["state"], saved["optim"]["state"])


def test_a_resized_tensor_is_saved_with_its_new_shape(shm: str) -> None:
    small = {"w": torch.randn(4, 4), "b": torch.randn(3), "step": 1}
    large = {"w": torch.randn(64, 4), "b": torch.randn(3), "step": 2}
    _saved_then_restored(shm, [small, large], {"w": torch.zeros(64, 4), "b": torch.zeros(3)})
    assert _meta_shapes(shm, 2)["w"] == ("float32", [64, 4])


def test_a_dtype_change_is_saved_with_its_new_dtype(shm: str) -> None:
    first = {"w": torch.randn(8, 8), "n": torch.arange(5)}
    # Same shapes; the first tensor's bytes halve, the second keeps its size, another dtype.
    second = {"w": torch.randn(8, 8).to(torch.bfloat16), "n": torch.arange(5).double()}
    blank = {"w": torch.zeros(8, 8, dtype=torch.bfloat16), "n": torch.zeros(5, dtype=torch.float64)}
    _saved_then_restored(shm, [first, second], blank)
    shapes = _meta_shapes(shm, 2)
    assert shapes["w"] == ("bfloat16", [8, 8]) and shapes["n"] == ("float64", [5])


def test_a_new_key_and_new_plain_values_are_saved(shm: str) -> None:
    first = {"a": torch.randn(5), "meta": {"lr": 0.1, "tag": "x"}}
    second = {"a": torch.randn(5), "meta": {"lr": 0.2, "tag": "y"}}  # the same plan
    third = {"a": torch.randn(5), "z": torch.randn(2, 2), "meta": {"lr": 0.3, "tag": 7}}
    blank = {"a": torch.zeros(5), "z": torch.zeros(2, 2), "meta": {}}
    _saved_then_restored(shm, [first, second, third], blank)


def test_the_plan_is_reused_only_for_the_same_structure() -> None:
    state: dict[Any, Any] = {"w": torch.randn(3, 2), 1: [torch.ones(2), 5]}
    plan, layout, _ = plan_for(state, None)
    same = {"w": torch.randn(3, 2), 1: [torch.zeros(2), 6]}
    again, layout2, tensors2 = plan_for(same, plan)
    assert again is plan and tensors2[0] is same["w"] and layout2.entries is layout.entries
    assert layout2.tree != layout.tree  # the plain value is this save's
    changed = [
        {"w": torch.randn(2, 3), 1: [torch.zeros(2), 6]},  # shape
        {"w": torch.randn(3, 2).half(), 1: [torch.zeros(2), 6]},  # dtype
        {"w": torch.randn(3, 2), "1": [torch.zeros(2), 6]},  # a key's type
        {"w": torch.randn(3, 2), 1: (torch.zeros(2), 6)},  # a container's kind
        {"w": torch.randn(3, 2), 1: [torch.zeros(2), 6.0]},  # a plain value's type
        {"w": torch.randn(3, 2), 1: [torch.zeros(2), torch.tensor(6)]},  # a new tensor
    ]
    for state in changed:
        assert plan_for(state, plan)[0] is not plan, state
    with pytest.raises(TypeError, match="dict key True"):
        plan_for({"w": torch.randn(3, 2), True: [torch.zeros(2), 6]}, plan)
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        plan_for({"w": torch.randn(3, 2), 1: [torch.zeros(2), object()]}, plan)


def test_a_state_without_tensors_is_saved(shm: str) -> None:
    _saved_then_restored(shm, [{"step": 1, "tag": "a"}, {"step": 2, "tag": "b"}], {})


def test_a_meta_with_encoded_entries_reads_as_one_without() -> None:
    plan, layout, _ = plan_for({"w": torch.randn(3, 2), "n": [torch.arange(4), 1.5]}, None)
    meta = make_meta(layout, job_id="j", step=3, rank=0, world_size=1, digest=None)
    cached = {**meta, "tensors": plan.entries_json, "checksum": "xxh3_128:00"}
    assert json.loads(encode_meta(cached)) == {**meta, "checksum": "xxh3_128:00"}
    assert json.loads(encode_meta(meta)) == meta
