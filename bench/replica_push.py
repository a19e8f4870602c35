"""How fast one node's memory tier reaches its replica peer: a real receiving agent.

    python -m bench.replica_push --sizes-mib 512 1536 --repeats 2 [--out push.json]
    python -m bench.replica_push --passes 800

A memory tier of one checksummed shard of each size (``rank-0-slot-0.data`` and its
``.meta``) is made in ``/dev/shm``; a real ``python -m trainguard.agent`` (the peer, its
memory tier beside it in ``/dev/shm``) takes the replicas, and this process pushes them
with :class:`~trainguard.agent.replicas.ReplicaPusher` (what the sending agent runs),
one :meth:`push_once` per repetition (the shard's meta is touched in between, so that
each pass pushes it all again). Per size and repetition:

- ``gb_s``: bytes pushed / the pass's wall time (until the peer has stored the meta);
- ``sender_cpu_s_per_gb``: this process's CPU time of the pass, per GB;
- ``receiver_cpu_s_per_gb``: the peer agent's CPU time (``/proc/<pid>/stat``), per GB,
  less what it spends idle in as long (measured for :data:`IDLE_SECONDS` first).

``--passes N`` measures the pushes of the overhead benchmark's tier instead (bench/train.py's
MLP: 2 ranks, 3 slots each of 704,512 bytes, a meta of a few KB): before each of N
passes both ranks commit a step (a meta renamed in), and the pass pushes it (1.41 MB);
``sender_cpu_ms_per_push`` (the pass's thread CPU) and ``receiver_cpu_ms_per_receipt``
(the peer agent's CPU over the N passes, per pass).

The machine's other work shares its cores: compare figures of one run (run it against
another tree with ``PYTHONPATH=that/src``; the agent is spawned with the same path).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.agent_cost import agent_command

try:
    from trainguard.agent.replica_push import ReplicaPusher
except ImportError:  # a tree from before the batches: the A of an A/B run
    from trainguard.agent.replicas import ReplicaPusher  # type: ignore[attr-defined,no-redef]

TOKEN = "bench-replica-push-token"
SERVE_TIMEOUT = 60.0
GB = 1e9
IDLE_SECONDS = 3.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _make_tier(memory: Path, nbytes: int) -> None:
    memory.mkdir(parents=True, exist_ok=True)
    block = os.urandom(1 << 20)
    with open(memory / "rank-0-slot-0.data", "wb") as out:
        for _ in range(nbytes >> 20):
            out.write(block)
    # The pusher only asks that a checksum be there (the puller checks it).
    meta = {"rank": 0, "step": 1, "nbytes": nbytes, "checksum": "xxh3_128:bench"}
    (memory / "rank-0-slot-0.meta").write_text(json.dumps(meta))


def _spawn_peer(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    (work / "peer").mkdir()
    memory = work / "peer" / "memory"
    command, port_file = agent_command(
        work, node_id="node-1", token=TOKEN, env={"TRAINGUARD_CHECKPOINT_MEMORY_DIR": str(memory)}
    )
    port_file.unlink(missing_ok=True)
    with open(work / "peer.stderr", "wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, cwd=work)
    deadline = time.monotonic() + SERVE_TIMEOUT
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"peer agent did not start: {(work / 'peer.stderr').read_text()}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def measure(work: Path, size_mib: int, repeats: int) -> list[dict[str, Any]]:
    memory = work / "node-0" / "memory"
    _make_tier(memory, size_mib << 20)
    nbytes = sum(p.stat().st_size for p in memory.iterdir())
    proc, url = _spawn_peer(work)
    rows = []
    try:
        idle0 = _cpu_seconds(proc.pid)
        time.sleep(IDLE_SECONDS)
        idle_rate = (_cpu_seconds(proc.pid) - idle0) / IDLE_SECONDS
        pusher = ReplicaPusher("node-0", memory, [url], TOKEN)
        held = work / "peer" / "replicas" / "node-0" / "rank-0-slot-0.meta"
        for _ in range(repeats):
            meta = memory / "rank-0-slot-0.meta"
            meta.write_bytes(meta.read_bytes())  # a new version: push it all again
            held.unlink(missing_ok=True)
            cpu0, peer0, t0 = time.process_time(), _cpu_seconds(proc.pid), time.perf_counter()
            pushed = pusher.push_once()
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            peer = _cpu_seconds(proc.pid) - peer0 - idle_rate * wall
            if pushed != 1 or not held.exists():
                raise SystemExit(f"push failed: {(work / 'peer.stderr').read_text()[-2000:]}")
            gb = nbytes / GB
            rows.append(
                {
                    "size_mib": size_mib,
                    "gb_s": round(gb / wall, 3),
                    "wall_s": round(wall, 3),
                    "sender_cpu_s_per_gb": round(cpu / gb, 3),
                    "receiver_cpu_s_per_gb": round(peer / gb, 3),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


SLOT_BYTES = 704_512
"""A slot of bench/train.py's MLP (hidden 256): 661,632 bytes of state, with headroom."""
RANKS = 2
SLOTS = 3


def _commit(memory: Path, rank: int, slot: int, step: int) -> None:
    """A step's commit as a rank makes it: its slot's meta written and renamed in."""
    tensors = [{"path": ["model", f"p{i}"], "dtype": "float32", "offset": i} for i in range(12)]
    meta = {"rank": rank, "step": step, "nbytes": SLOT_BYTES, "checksum": "xxh3_128:bench"}
    tmp = memory / f".rank-{rank}.meta.tmp"
    tmp.write_text(json.dumps({**meta, "tensors": tensors}))
    os.replace(tmp, memory / f"rank-{rank}-slot-{slot}.meta")


def measure_passes(work: Path, passes: int) -> dict[str, Any]:
    """The CPU of a push of the overhead benchmark's tier and of its receipt."""
    memory = work / "node-0" / "memory"
    memory.mkdir(parents=True)
    for rank in range(RANKS):
        for slot in range(SLOTS):
            (memory / f"rank-{rank}-slot-{slot}.data").write_bytes(os.urandom(SLOT_BYTES))
            _commit(memory, rank, slot, slot)
    proc, url = _spawn_peer(work)
    try:
        pusher = ReplicaPusher("node-0", memory, [url], TOKEN)
        sender = 0.0
        for i in range(SLOTS, SLOTS + 20 + passes):
            if i == SLOTS + 20:  # after a warm-up
                sender, peer0 = 0.0, _cpu_seconds(proc.pid)
            for rank in range(RANKS):
                _commit(memory, rank, i % SLOTS, i)
            began = time.thread_time()
            if pusher.push_once() != RANKS:
                raise SystemExit(f"push failed: {(work / 'peer.stderr').read_text()[-2000:]}")
            sender += time.thread_time() - began
        receiver = _cpu_seconds(proc.pid) - peer0
    finally:
        proc.terminate()
        proc.wait(30)
    return {
        "passes": passes,
        "sender_cpu_ms_per_push": round(sender / passes * 1e3, 3),
        "receiver_cpu_ms_per_receipt": round(receiver / passes * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[512, 1536])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--passes", type=int, default=None, help="the overhead tier, N passes")
    args = parser.parse_args(argv)
    if args.passes is not None:
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="tg-replica-bench-") as tmp:
            row = measure_passes(Path(tmp), args.passes)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(row, indent=2) + "\n")
        return 0
    rows = []
    for size in args.sizes_mib:
        with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="tg-replica-bench-") as tmp:
            rows += measure(Path(tmp), size, args.repeats)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
