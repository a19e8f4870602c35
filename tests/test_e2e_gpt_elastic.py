"""The elastic GPT example (examples/gpt/job-elastic.yaml), 4 nodes x 1 process, in place.

One node is preempted with no spare: the job goes on with 3 nodes, its survivors in
their processes; capacity comes back: it grows to 4 again. Every step's global batch is
12 at every size, every sample of the run is taken once (``--log-samples``), no step is
run twice, and the final loss is within 2% of a fixed-size run (one process, the same
global batch, without faults).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import Trainguard
from test_run_elastic_inplace import scaled_in_place

REPO = Path(__file__).resolve().parents[1]
GPT_DIR = REPO / "examples" / "gpt"
if str(GPT_DIR) not in sys.path:
    sys.path.insert(0, str(GPT_DIR))

import elastic_batches as eb  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.long]

STEPS = 400
GLOBAL_BATCH = 12
ELASTIC_LINE = re.compile(
    r"^Elastic: world (\d+), global batch (\d+) = (\d+) per rank x (\d+) accumulation"
)
LOSS_LINE = re.compile(rf"^Batch {STEPS} Loss: ([0-9.]+)")


def job_file(tmp_path: Path) -> Path:
    job = yaml.safe_load((GPT_DIR / "job-elastic.yaml").read_text())
    container = job["spec"]["replicaSpecs"][0]["template"]["spec"]["containers"][0]
    container["command"] = [
        "python", str(GPT_DIR / "train.py"), "--backend", "gloo", "--device", "cpu"
    ]  # fmt: skip
    args = container["args"]
    args[args.index("--steps") + 1] = str(STEPS)
    args += ["--data-dir", str(tmp_path / "data")]
    job["spec"]["trainguard"]["pollIntervalSeconds"] = 0.3
    path = tmp_path / "job-elastic.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def fixed_size_loss(tmp_path: Path) -> float:
    """The same training at one fixed size: one process, global batch 12, no faults."""
    done = subprocess.run(
        [sys.executable, str(GPT_DIR / "train.py"), "--resilient", "--device", "cpu",
         "--global-batch", str(GLOBAL_BATCH), "--batch-size", "12", "--steps", str(STEPS),
         "--log-every", str(STEPS), "--data-dir", str(tmp_path / "data"),
         "--memory-ckpt-every", "0"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={**os.environ, "TRAINGUARD_CHECKPOINT_MEMORY_DIR": str(tmp_path / "memory")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    [loss] = [
        float(m.group(1)) for line in done.stdout.splitlines() if (m := LOSS_LINE.match(line))
    ]
    return loss


def test_gpt_scales_down_and_up_in_place_global_batch_kept_every_sample_once(
    tg: Trainguard, tmp_path: Path
) -> None:
    job = scaled_in_place(
        tg, job_file(tmp_path), "preempt:node=2@8s", "capacity:+1@14s", full=4, timeout=900
    )

    logs = Path(job["logs_dir"])
    lines = [line for f in sorted(logs.glob("rank-*.log")) for line in f.read_text().splitlines()]
    # The global batch, as logged at the start of every attempt.
    splits = [tuple(map(int, m.groups())) for line in lines if (m := ELASTIC_LINE.match(line))]
    assert [world for world, *_ in splits] == [4, 3, 4]
    for world, batch, per_rank, accumulation in splits:
        assert batch == GLOBAL_BATCH == per_rank * accumulation * world
    # Every sample once: each step's ranks took exactly its slice of the run's samples.
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        if m := eb.SAMPLES_LINE.match(line):
            by_step[int(m["step"])].append(
                {
                    "world": int(m["world"]),
                    "first": int(m["first"]),
                    "end": int(m["end"]),
                    "rank": int(m["rank"]),
                    "samples": eb.parse_ranges(m["ranges"]),
                }
            )
    assert sorted(by_step) == list(range(1, STEPS + 1))
    for step, taken in by_step.items():
        world = taken[0]["world"]
        first, end = (step - 1) * GLOBAL_BATCH, step * GLOBAL_BATCH
        assert {(t["world"], t["first"], t["end"]) for t in taken} == {(world, first, end)}
        ranks = sorted(t["rank"] for t in taken)
        samples = sorted(k for t in taken for k in t["samples"])
        if ranks != list(range(world)) and _preempted_in(step, by_step):
            # The preemption stopped this step's all-reduce, which some survivor left
            # (gloo's ring: its reduced gradient held every rank's samples) and the others
            # could not; the attempt after it starts from that survivor's state. Only the
            # ranks that finished logged it: each once, each its own slice.
            assert len(set(ranks)) == len(ranks), step
            assert len(set(samples)) == len(samples), step
            assert set(samples) <= set(range(first, end)), step
            continue
        assert ranks == list(range(world)), step  # once per rank
        assert samples == list(range(first, end))
    assert {taken[0]["world"] for taken in by_step.values()} == {3, 4}
    # The loss, against the same training at one fixed size.
    [loss] = [float(m.group(1)) for line in lines if (m := LOSS_LINE.match(line))]
    reference = fixed_size_loss(tmp_path)
    assert abs(loss - reference) <= 0.02 * reference, (loss, reference)


def _preempted_in(step: int, by_step: dict[int, list[dict[str, Any]]]) -> bool:
    """Whether ``step`` is the last one before the world shrank."""
    after = by_step.get(step + 1)
    return after is not None and after[0]["world"] < by_step[step][0]["world"]
