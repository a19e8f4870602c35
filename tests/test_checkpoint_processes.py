"""The Checkpointer across real processes: a SIGKILL right after save(), and 2 gloo ranks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap

COMMON = textwrap.dedent(
    """
    import json, os, sys
    import torch, xxhash
    from trainguard.checkpoint import Checkpointer

    def make_state(seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(256, 128)
        optim = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(8, 256)).sum().backward()
            optim.step()
            optim.zero_grad()
        return {"model": model.state_dict(), "optim": optim.state_dict(),
                "big": torch.randn(4 << 20), "rng": torch.get_rng_state(),
                "step": seed, "data": {"offset": seed * 3}}

    def digest(state):
        h = xxhash.xxh3_128()
        def walk(node):
            if isinstance(node, torch.Tensor):
                h.update(str((node.dtype, tuple(node.shape))).encode())
                h.update(node.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            elif isinstance(node, dict):
                for k in sorted(node, key=str):
                    h.update(repr(k).encode()); walk(node[k])
            elif isinstance(node, (list, tuple)):
                for v in node: walk(v)
            else:
                h.update(repr(node).encode())
        walk(state)
        return h.hexdigest()
    """
)

KILLED = COMMON + textwrap.dedent(
    """
    ckpt = Checkpointer(memory_dir=sys.argv[1], job_id="kill-test")
    ckpt.save(5, make_state(5)); ckpt.wait()
    state = make_state(10)
    print(json.dumps({"digest": digest(state)}), flush=True)
    ckpt.save(10, state)
    os.kill(os.getpid(), 9)  # no wait(), no close()
    """
)

RESTORE = COMMON + textwrap.dedent(
    """
    ckpt = Checkpointer(memory_dir=sys.argv[1], job_id="kill-test")
    state = make_state(0)
    step = ckpt.load_latest(state)
    print(json.dumps({"step": step, "digest": digest(state)}), flush=True)
    ckpt.close()
    """
)

RANK = COMMON + textwrap.dedent(
    """
    import torch.distributed as dist
    from pathlib import Path
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mem = os.path.join(sys.argv[1], f"node{rank}")  # as if each rank were on its own node
    ckpt = Checkpointer(memory_dir=mem, memory_keep=3, job_id="gloo-test")
    digests = {}
    for step in (10, 20, 30):
        state = make_state(step + rank)
        digests[step] = digest(state)
        ckpt.save(step, state)
    ckpt.wait()
    ckpt.close()
    def meta_of(step):
        for p in Path(mem).glob("*.meta"):
            if json.loads(p.read_text())["step"] == step:
                return p
    if rank == 1:
        meta_of(30).unlink()  # rank 1 lacks step 30
    else:  # rank 0's step 20 is corrupt
        with open(meta_of(20).with_suffix(".data"), "r+b") as f:
            f.seek(7); b = f.read(1); f.seek(7); f.write(bytes([b[0] ^ 1]))
    dist.barrier()
    ckpt = Checkpointer(memory_dir=mem, memory_keep=3, job_id="gloo-test")
    state = make_state(99)
    step = ckpt.load_latest(state)
    ok = step is not None and digest(state) == digests[step]
    print(json.dumps({"rank": rank, "step": step, "ok": ok}), flush=True)
    ckpt.close()
    dist.destroy_process_group()
    """
)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _last_json(stdout: str) -> dict[str, object]:
    data: dict[str, object] = json.loads(stdout.strip().splitlines()[-1])
    return data


def test_sigkill_right_after_save_restores_bit_identical_within_its_attempt(shm: str) -> None:
    """Step 10 has no checksum (the process died first): loaded by the same rank within
    the same attempt, and by no later attempt, which restores step 5 instead."""
    attempt = {"TRAINGUARD_ATTEMPT": "0"}
    killed = subprocess.run(
        [sys.executable, "-c", KILLED, shm],
        env=_env(**attempt),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = _last_json(killed.stdout)

    def restore(attempt: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-c", RESTORE, shm],
            env=_env(TRAINGUARD_ATTEMPT=attempt),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done

    restored = restore("0")
    assert _last_json(restored.stdout) == {"step": 10, "digest": saved["digest"]}
    assert "Restored step 10 from memory" in restored.stdout
    later = restore("1")
    assert _last_json(later.stdout)["step"] == 5
    assert "not by rank 0 in attempt 1" in later.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_two_gloo_ranks_agree_on_newest_step_every_rank_can_load(shm: str) -> None:
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, shm],
            env=_env(
                RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                LOCAL_RANK=str(rank),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(_last_json(out))
    # 30 is missing on rank 1, 20 is corrupt on rank 0: both fall back to 10.
    assert results == [
        {"rank": 0, "step": 10, "ok": True},
        {"rank": 1, "step": 10, "ok": True},
    ]
