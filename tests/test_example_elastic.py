"""Elastic mode of the GPT example (``train.py --resilient --global-batch G``), CPU only.

Which samples a rank takes at a step is a pure function of (G, steps, world size, rank,
the attempt's first step), checked here for world sizes 1 to 4 and across world-size
changes; one plain single-process run (the resilient wrapper's one-rank group, no
trainguard controller) checks the log lines and that the split does not change training.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from trainguard.elastic import batch_split
from trainguard.monitor.progress import ProgressMatcher
from trainguard.resilient.run import Run, StateProgress
from trainguard.spec.load import load_job

REPO = Path(__file__).resolve().parents[1]
GPT_DIR = REPO / "examples" / "gpt"
GPT_TRAIN = GPT_DIR / "train.py"
JOB_ELASTIC = GPT_DIR / "job-elastic.yaml"
RUN_TIMEOUT = 120.0
G = 12
STEPS = 5

if str(GPT_DIR) not in sys.path:  # elastic_batches imports data.py from beside it
    sys.path.insert(0, str(GPT_DIR))

import elastic_batches as eb  # noqa: E402

import data as gpt_data  # noqa: E402

ELASTIC_LINE = re.compile(
    r"^Elastic: world (\d+), global batch (\d+) = (\d+) per rank x (\d+) accumulation "
    r"x (\d+) ranks$"
)


def attempt(world_size: int, rank: int, start_step: int = 0) -> Run:
    """A real ``Run`` of an attempt at ``world_size`` that starts after ``start_step`` steps."""
    return Run(
        rank=rank,
        local_rank=0,
        world_size=world_size,
        attempt=0,
        state_source="self" if start_step else "none",
        progress=StateProgress(has_state=start_step > 0, steps=start_step),
        interrupted=lambda: False,
    )


def taken(
    world_size: int, first_step: int, end_step: int, max_per_rank: int, steps: int = STEPS
) -> dict[int, list[int]]:
    """Every rank's samples of steps ``first_step..end_step`` (1-based, inclusive) at
    ``world_size``, by step, in rank order."""
    out: dict[int, list[int]] = {}
    plans = [
        eb.plan_attempt(attempt(world_size, r, first_step - 1), G, max_per_rank, steps)
        for r in range(world_size)
    ]
    for step in range(first_step, end_step + 1):
        out[step] = []
        for plan in plans:
            micro = plan.step_samples(step)
            assert len(micro) == plan.split.accumulation_steps
            assert all(len(m) == plan.split.per_rank for m in micro)
            out[step] += [k for m in micro for k in m]
    return out


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 32, (2048,), generator=torch.Generator().manual_seed(3)).int()


# --- the sample mapping -------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("max_per_rank", [1, 2, 4, 8, 12])
def test_every_sample_is_taken_once_at_any_world_size(world_size: int, max_per_rank: int) -> None:
    by_step = taken(world_size, 1, STEPS, max_per_rank)
    for step, samples in by_step.items():
        assert sorted(samples) == list(range((step - 1) * G, step * G))
    assert sorted(k for s in by_step.values() for k in s) == list(range(STEPS * G))


def test_the_world_may_change_between_attempts() -> None:
    """Attempts at 4, 3, 1 and 2 ranks (each from the step the last one got to)."""
    segments = [(4, 1, 1), (3, 2, 3), (1, 4, 4), (2, 5, 5)]
    samples: list[int] = []
    for world_size, first, end in segments:
        for step, step_samples in taken(world_size, first, end, max_per_rank=4).items():
            assert sorted(step_samples) == list(range((step - 1) * G, step * G))
            samples += step_samples
    assert sorted(samples) == list(range(STEPS * G))


@pytest.mark.parametrize(("world_size", "batch_size"), [(1, 12), (2, 6), (3, 4), (4, 3), (3, 8)])
def test_one_accumulation_step_takes_the_default_modes_slice(
    tokens: torch.Tensor, world_size: int, batch_size: int
) -> None:
    """G == batch_size * world_size: a rank's batch is get_batch's, window for window."""
    global_batch = batch_size * world_size
    for rank in range(world_size):
        plan = eb.plan_attempt(attempt(world_size, rank), global_batch, batch_size, STEPS)
        assert (plan.split.per_rank, plan.split.accumulation_steps) == (batch_size, 1)
        for step in range(1, STEPS + 1):
            [samples] = plan.step_samples(step)
            x, y = eb.sample_batch(tokens, samples, global_batch=global_batch, block_size=8, seed=5)
            ex, ey = gpt_data.get_batch(
                tokens,
                step=step,
                rank=rank,
                world_size=world_size,
                batch_size=batch_size,
                block_size=8,
                seed=5,
            )
            assert torch.equal(x, ex) and torch.equal(y, ey)


def test_a_sample_is_its_steps_window(tokens: torch.Tensor) -> None:
    """Sample k: window k % G of step k // G + 1, also in a list that spans steps."""
    samples = [5, 11, 12, 30, 2]
    x, y = eb.sample_batch(tokens, samples, global_batch=G, block_size=8, seed=1)
    for row, k in enumerate(samples):
        step, window = eb.step_of(k, G)
        assert (step, window) == (k // G + 1, k % G)
        ex, ey = gpt_data.get_batch(
            tokens, step=step, rank=0, world_size=1, batch_size=G, block_size=8, seed=1
        )
        assert torch.equal(x[row], ex[window]) and torch.equal(y[row], ey[window])


def test_a_global_batch_that_does_not_split_is_refused() -> None:
    with pytest.raises(eb.ElasticBatchError, match=r"cannot be split evenly over 5 ranks"):
        eb.plan_attempt(attempt(5, 0), G, 8, STEPS)
    assert isinstance(eb.ElasticBatchError("x"), ValueError)


# --- log lines ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("samples", "text"),
    [
        ([], "none"),
        ([7], "7"),
        ([196, 197, 198, 199], "196-199"),
        ([0, 1, 2, 6, 7, 8], "0-2,6-8"),
        ([3, 5, 6], "3,5-6"),
    ],
)
def test_compact_ranges(samples: list[int], text: str) -> None:
    assert eb.compact_ranges(samples) == text
    assert eb.parse_ranges(text) == samples


def test_the_log_lines() -> None:
    split = batch_split(G, 3, 8)
    line = eb.samples_line(17, split, 1, [196, 197, 198, 199])
    assert line == "Samples step 17 world 3: [192, 204) rank 1: 196-199"
    found = eb.SAMPLES_LINE.match(line)
    assert found is not None
    assert found.groupdict() == {
        "step": "17",
        "world": "3",
        "first": "192",
        "end": "204",
        "rank": "1",
        "ranges": "196-199",
    }
    elastic = eb.elastic_line(batch_split(G, 2, 3))
    assert elastic == "Elastic: world 2, global batch 12 = 3 per rank x 2 accumulation x 2 ranks"
    assert ELASTIC_LINE.match(elastic)
    # Printed before run.completed (and by every rank): never taken for progress.
    progress = ProgressMatcher()
    assert progress.match(line) is None and progress.match(elastic) is None
    assert progress.match("Batch 17 Loss: 1.00000, lr: 0.001000") == 17


# --- flags and the job spec ---------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpt_train_elastic", GPT_TRAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--global-batch", "12"], "--global-batch needs --resilient"),
        (["--resilient", "--global-batch", "0"], "--global-batch must be >= 1"),
        (["--resilient", "--log-samples"], "--log-samples needs --global-batch"),
    ],
)
def test_bad_elastic_flags_are_usage_errors(
    gpt: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpt.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_elastic_flags(gpt: ModuleType) -> None:
    args = gpt.parse_args([])
    assert (args.global_batch, args.log_samples) == (None, False)
    args = gpt.parse_args(["--resilient", "--global-batch", "12", "--log-samples"])
    assert (args.global_batch, args.log_samples) == (12, True)


def test_the_elastic_job_splits_its_batch_at_every_size() -> None:
    job = load_job(JOB_ELASTIC)
    policy = job.spec.elastic_policy
    assert policy is not None and policy.min_replicas == 2 and policy.max_replicas == 4
    assert job.spec.trainguard.in_process_restart
    argv = [*job.spec.replica_specs[0].template.spec.containers[0].command]
    argv += job.spec.replica_specs[0].template.spec.containers[0].args or []
    global_batch = int(argv[argv.index("--global-batch") + 1])
    max_per_rank = int(argv[argv.index("--batch-size") + 1])
    assert "--resilient" in argv and job.spec.nproc_per_node == "1"
    for world_size in range(policy.min_replicas, policy.max_replicas + 1):
        batch_split(global_batch, world_size, max_per_rank)  # raises if it does not split


# --- a one-rank run -----------------------------------------------------------------------

SMALL_GPT = [
    *("--n-layer", "1", "--d-model", "16", "--n-head", "2", "--block-size", "16"),
    *("--vocab-size", "32", "--data-tokens", "4096", "--steps", str(STEPS)),
    *("--device", "cpu", "--backend", "gloo", "--memory-ckpt-every", "0", "--resilient"),
]


def plain_env() -> dict[str, str]:
    """No launcher, no trainguard job: the wrapper's one-rank group (a HashStore)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_", "MASTER_"))
        and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    # Its own memory tier: the default (/dev/shm/.../local) is shared by every plain run.
    env["TRAINGUARD_CHECKPOINT_MEMORY_DIR"] = tempfile.mkdtemp(prefix="tg-test-memory-")
    return env


class Runs:
    """One-rank runs of SMALL_GPT, by their extra flags; each saves its final weights."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple[str, ...], tuple[list[str], dict[str, torch.Tensor]]] = {}

    def get(self, *flags: str) -> tuple[list[str], dict[str, torch.Tensor]]:
        if flags not in self._done:
            work = self.root / f"run{len(self._done)}"
            work.mkdir()
            final = work / "final.pt"
            argv = [*SMALL_GPT, *flags, "--data-dir", str(self.root / "data")]
            done = subprocess.run(
                [sys.executable, str(GPT_TRAIN), *argv, "--save-final", str(final)],
                cwd=work,
                env=plain_env(),
                capture_output=True,
                text=True,
                timeout=RUN_TIMEOUT,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            weights = torch.load(final, weights_only=True)
            self._done[flags] = (done.stdout.splitlines(), weights)
        return self._done[flags]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    yield Runs(tmp_path_factory.mktemp("gpt-elastic"))


@pytest.mark.e2e
def test_one_rank_run_logs_its_split_and_samples(runs: Runs) -> None:
    """--batch-size 8 (the default) caps the micro-batch: 12 = 6 x 2 accumulation."""
    lines, _ = runs.get("--global-batch", str(G), "--log-samples")
    assert lines[0] == "Attempt 0: training from step 0 (state from none), world_size 1, device cpu"
    found = ELASTIC_LINE.match(lines[1])
    assert found is not None and found.groups() == ("1", "12", "6", "2", "1")
    samples = [m for line in lines if (m := eb.SAMPLES_LINE.match(line))]
    assert [int(m["step"]) for m in samples] == list(range(1, STEPS + 1))
    for m in samples:
        step = int(m["step"])
        assert (m["world"], m["rank"]) == ("1", "0")
        assert (int(m["first"]), int(m["end"])) == ((step - 1) * G, step * G)
        assert m["ranges"] == f"{(step - 1) * G}-{step * G - 1}"
        # Right before its Batch line: printed before run.completed.
        batch = next(i for i, line in enumerate(lines) if line.startswith(f"Batch {step} Loss"))
        assert lines[batch - 1] == m.group(0)
    assert lines[-1] == f"Training complete: step {STEPS}"


@pytest.mark.e2e
def test_the_split_does_not_change_training(runs: Runs) -> None:
    """G == batch_size x world: the weights of the default resilient mode, bit for bit.
    With accumulation the same G samples per step: the same weights up to rounding."""
    _, default = runs.get("--batch-size", str(G))
    lines, one_step = runs.get("--batch-size", str(G), "--global-batch", str(G))
    assert lines[1] == "Elastic: world 1, global batch 12 = 12 per rank x 1 accumulation x 1 ranks"
    assert not any(line.startswith("Samples ") for line in lines)
    _, accumulated = runs.get("--global-batch", str(G), "--log-samples")
    assert default.keys() == one_step.keys() == accumulated.keys()
    for name, tensor in default.items():
        assert torch.equal(tensor, one_step[name]), name
        torch.testing.assert_close(accumulated[name], tensor, rtol=0, atol=1e-5)
