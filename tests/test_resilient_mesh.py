"""trainguard.resilient's mesh and fully_shard across a new default group, and DTensor
state handed to a peer, in this process (a one-rank gloo group, no trainguard job).

The attempt's group is aborted and made again the way ``AttemptGroup`` does it; the mesh
and the FSDP module made before must then work on the new group, and train on exactly as
a run without the change of group. The 2-rank and 4-rank cases run under trainguard in
tests/test_resilient_sharded.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import trainguard.resilient as resilient
from trainguard.resilient import fsdp, mesh
from trainguard.resilient.protocol import CONTROL_DIR_ENV
from trainguard.resilient.sync import decode_state, encode_state


@pytest.fixture
def attempt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A one-rank default group, as under trainguard (meshes and modules are kept)."""
    monkeypatch.setenv(CONTROL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(mesh, "_meshes", [])
    monkeypatch.setattr(mesh, "_listeners", [])
    monkeypatch.setattr(fsdp, "_modules", [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def new_attempt() -> None:
    """The next attempt's group: the old one aborted, a new one made (AttemptGroup's way)."""
    distributed_c10d._abort_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def model_and_optimizer(shard: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    for layer in (model[0], model[2], model):
        shard(layer)  # type: ignore[operator]
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(n))
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor)
        out[name] = param.full_tensor()
    return out


def test_a_mesh_and_its_sharded_module_train_on_in_the_next_attempt(attempt: None) -> None:
    device_mesh = resilient.init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    plain_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    expected, plain_opt = model_and_optimizer(lambda m: torch_fully_shard(m, mesh=plain_mesh))
    model, optimizer = model_and_optimizer(lambda m: resilient.fully_shard(m, mesh=device_mesh))
    for n in range(1, 4):
        step(expected, plain_opt, n)
    step(model, optimizer, 1)

    new_attempt()
    assert mesh.rebind(), "the mesh was made in the attempt before"
    assert device_mesh.get_group() is dist.group.WORLD  # a 1-D CPU mesh: the default group
    assert not mesh.rebind(), "once per attempt"
    for n in (2, 3):
        step(model, optimizer, n)
    got, want = weights(model), weights(expected)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_mesh_from_torch_is_refused(attempt: None) -> None:
    plain_mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    layer = torch.nn.Linear(2, 2)
    for given in (plain_mesh, None):
        with pytest.raises(ValueError, match=r"mesh made by trainguard\.resilient\."):
            resilient.fully_shard(layer, mesh=given)
    assert not isinstance(layer.weight, DTensor), "refused before sharding anything"


def test_sharded_state_moves_to_a_fresh_model_and_optimizer(attempt: None) -> None:
    """The DTensors go as their local tensors and come back as DTensors on the
    receiver's mesh: a fresh AdamW (no state yet) takes its moments too."""
    device_mesh = resilient.init_device_mesh(
        "cpu", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard")
    )
    sender, sender_opt = model_and_optimizer(lambda m: resilient.fully_shard(m, mesh=device_mesh))
    for n in (1, 2):
        step(sender, sender_opt, n)
    meta, data = encode_state({"model": sender, "optim": sender_opt}, steps=2)
    receiver, receiver_opt = model_and_optimizer(
        lambda m: resilient.fully_shard(m, mesh=device_mesh)
    )
    assert decode_state({"model": receiver, "optim": receiver_opt}, meta, data) == 2
    assert fsdp.shard_key() == 0  # (1, 1): one shard; the replicate dim is left out
    for n in (3, 4):
        step(sender, sender_opt, n)
        step(receiver, receiver_opt, n)
    got, want = weights(receiver), weights(sender)
    assert all(torch.equal(got[k], want[k]) for k in want)
