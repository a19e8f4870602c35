"""Tiered checkpoints in a real 4-rank DDP job (2 nodes x 2): restored state is bit-identical.

``tests/scripts/ckpt_worker.py`` prints a digest of its whole state (model,
AdamW state, step, RNG) at every save and after every restore.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from conftest import SCRIPTS, Trainguard, write_job
from trainguard.checkpoint.durable import DurableTier

pytestmark = pytest.mark.e2e
LINE = re.compile(r"rank (\d+) attempt (\d+) (saved|restored) step (\d+) digest (\w+)")


def job(tmp_path: Path, *args: str, **checkpointing: object) -> Path:
    command = [
        "python",
        str(SCRIPTS / "ckpt_worker.py"),
        "--steps",
        "40",
        "--step-sleep",
        "0.1",
        *args,
    ]
    return write_job(
        tmp_path / "job.yaml",
        "ckpt",
        command,
        runPolicy={"jobMaxRetryCount": 2},
        checkpointing={"memoryKeep": 3, "replicas": 1, **checkpointing},
    )


def digests(output: str) -> tuple[dict[tuple[int, int], str], dict[int, tuple[int, str]]]:
    """(rank, step) -> digest saved on attempt 0; rank -> (step, digest) restored on attempt 1."""
    saved, restored = {}, {}
    for m in LINE.finditer(output):
        rank, attempt, what, step, digest = m.groups()
        if what == "saved" and attempt == "0":
            saved[int(rank), int(step)] = digest
        elif what == "restored" and attempt == "1":
            restored[int(rank)] = (int(step), digest)
    return saved, restored


def run(tg: Trainguard, spec: Path, *inject: str) -> tuple[str, dict[int, tuple[int, str]]]:
    args = ["run", "-f", str(spec)]
    for i in inject:
        args += ["--inject", i]
    done = tg.run(*args, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    saved, restored = digests(output)
    events = [line for line in output.splitlines() if line.startswith("[trainguard]")]
    assert sorted(restored) == [0, 1, 2, 3], "every rank restores:\n" + "\n".join(events)
    steps = {step for step, _ in restored.values()}
    assert len(steps) == 1, f"ranks restored different steps: {restored}"
    for rank, (step, digest) in restored.items():
        assert saved[rank, step] == digest, f"rank {rank} step {step} is not what was saved"
    return output, restored


def test_rank_killed_right_after_save_restores_from_memory_bit_identical(
    tg: Trainguard, tmp_path: Path
) -> None:
    # Rank 2 SIGKILLs itself as soon as save(12) returns: no wait(), no background commit.
    # Its shard of step 12 is copy-complete; whether its checksum was written before the
    # kill is a race. With it, every rank restores 12; without it, the shard is trusted
    # only by its writer within its attempt, so the job falls back to step 11. Either
    # way, what is restored is bit-identical to what was saved.
    spec = job(tmp_path, "--die-after-save", "2@12", durableEverySteps=10)
    output, restored = run(tg, spec)
    [step] = {step for step, _ in restored.values()}
    assert step in (11, 12), restored
    assert re.search(rf"Restored step {step} from memory", output)
    # Each restore is an event of the job's timeline, with its tier and time.
    job_info = tg.only_job()
    events = [e for e in job_info["events"] if e["kind"] == "CheckpointRestored"]
    assert sorted(e["rank"] for e in events) == [0, 1, 2, 3]
    assert {e["data"]["tier"] for e in events} == {"memory"}
    assert {e["data"]["step"] for e in events} == {step}
    # The agents persisted the steps the controller picked (multiples of 10), and the
    # final step before the job ended; memory saves are events too.
    kinds = {e["kind"] for e in job_info["events"]}
    assert {"CheckpointSaved", "CheckpointPersisting", "CheckpointCommitted"} <= kinds
    committed = [
        e["data"]["step"] for e in job_info["events"] if e["kind"] == "CheckpointCommitted"
    ]
    assert committed[-1] == 40 and all(s % 10 == 0 for s in committed), committed
    durable = DurableTier(str(Path(job_info["job_dir"]) / "durable"), job_info["id"])
    assert durable.committed_steps() == sorted(committed)[-3:]  # durableKeep: 3


def test_lost_node_restores_from_a_peer_replica_bit_identical(
    tg: Trainguard, tmp_path: Path
) -> None:
    spec = job(tmp_path, memoryEverySteps=5)
    _, restored = run(tg, spec, "node-kill:node=1@step=22")
    assert restored[0][0] >= 5
    agent_log = (Path(tg.only_job()["job_dir"]) / "agents" / "node-1.log").read_text()
    assert "memory tier of node-1 restored from node-0's replica" in agent_log


def test_a_spare_in_a_lost_nodes_place_restores_from_its_replica_bit_identical(
    tg: Trainguard, tmp_path: Path
) -> None:
    # node-1 is lost and spare node-2 takes its ranks in a full job restart: node-2 has no
    # memory tier of its own, and pulls node-1's back from node-0's replica.
    spec = job(tmp_path, memoryEverySteps=5)
    data = yaml.safe_load(spec.read_text())
    data["spec"]["replicaSpecs"][0]["spares"] = 1
    spec.write_text(yaml.safe_dump(data))
    output, restored = run(tg, spec, "node-kill:node=1@step=22")
    assert "replacing node-1 -> node-2" in output
    assert restored[2][0] >= 5
    for rank in (2, 3):
        assert f"rank {rank} restored step {restored[rank][0]} from memory" in output
    agent_log = (Path(tg.only_job()["job_dir"]) / "agents" / "node-2.log").read_text()
    assert "memory tier of node-2 restored from node-0's replica of node-1" in agent_log
