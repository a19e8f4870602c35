"""``resilient.no_init_on_spare``: a hot spare skips random initialisation, nothing else
does, and a spare never trains from the uninitialised values."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import trainguard.resilient as resilient
from trainguard.resilient import spare_init
from trainguard.resilient.run import StateProgress
from trainguard.resilient.sync import synchronise


@pytest.fixture(autouse=True)
def fresh_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spare_init, "_skipped", [])  # the process's record, this test's own


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(64, 32)


def test_outside_a_spare_the_model_is_initialised_as_usual() -> None:
    with resilient.no_init_on_spare():  # no trainguard here: not a spare
        model = _linear()
    assert torch.equal(model.weight, _linear().weight)
    spare_init.check_initialised()  # nothing was skipped


def test_a_spare_skips_the_random_fills_and_keeps_the_rest() -> None:
    with resilient.no_init_on_spare(True):
        model = _linear()  # seeds the generator, then would draw kaiming_uniform_'s values
        ones = torch.nn.init.ones_(torch.empty(3))  # not random: done
        drawn = torch.empty(1000).normal_()  # random: skipped
    # No random number was drawn: the generator is where the seed left it. (Comparing
    # the weights with an initialised model's proves nothing: the memory the spare's
    # torch.empty gets may be a freed tensor's that held those very values.)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4)), "a random fill was drawn"
    assert model.weight.shape == (32, 64)
    assert torch.equal(ones, torch.ones(3))
    assert drawn.shape == (1000,)
    with pytest.raises(resilient.UninitialisedState):
        spare_init.check_initialised()


@pytest.fixture
def world_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("world_of_one")
def test_a_spare_without_a_peer_or_a_checkpoint_refuses_to_train() -> None:
    with resilient.no_init_on_spare(True):
        model = _linear()
    with pytest.raises(resilient.UninitialisedState):
        synchronise({"model": model}, StateProgress(), None)
    # A checkpoint that restores the state is fine.
    progress = StateProgress()
    synchronise({"model": model}, progress, lambda: 7)
    assert progress.steps == 7
