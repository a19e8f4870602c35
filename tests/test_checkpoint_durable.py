"""The durable checkpoint tier against a local directory and a real S3 server (moto)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec  # type: ignore[import-untyped]
import pytest
import xxhash

from s3_server import S3Server, free_port, s3_bucket_url, s3_server  # noqa: F401
from trainguard.checkpoint.durable import DurableError, DurableTier, ShardMissing

REPO = Path(__file__).resolve().parent.parent
MiB = 2**20
PART = 5 * MiB  # the S3 minimum, so multipart uploads run with small test data


def payload(step: int, rank: int, size: int = 1000) -> bytes:
    seed = bytes([step % 251, rank % 251]) * 8
    return (seed * (size // len(seed) + 1))[:size]


def meta_of(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "xxh3_128": xxhash.xxh3_128_hexdigest(data)}


class Backend:
    """Where a tier under test lives, and how to open a second tier or poke at objects."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url = url
        self.options = options

    def tier(self, job_id: str = "job-1", **kwargs: Any) -> DurableTier:
        return DurableTier(self.url, job_id, dict(self.options), part_size=PART, **kwargs)

    def fs(self) -> Any:
        fs, root = fsspec.core.url_to_fs(self.url, **self.options, skip_instance_cache=True)
        return fs, root


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "local":
        yield Backend(str(tmp_path / "durable"), {})
    else:
        server: S3Server = request.getfixturevalue("s3_server")
        url = request.getfixturevalue("s3_bucket_url")
        yield Backend(f"{url}/ckpt", server.storage_options)


def test_round_trip_streams_memoryviews_and_lists_steps(backend: Backend) -> None:
    tier = backend.tier()
    big = bytearray(payload(3, 1, 12 * MiB + 17))  # multipart on S3 (3 parts)
    tier.write_shard(3, 0, payload(3, 0), meta_of(payload(3, 0)))
    tier.write_shard(3, 1, memoryview(big), meta_of(bytes(big)))
    tier.write_shard(7, 0, memoryview(payload(7, 0)).cast("B"), {"size": 1000})

    data, meta = tier.read_shard(3, 1)
    assert data == big and meta == meta_of(bytes(big))
    assert tier.read_shard(3, 0) == (payload(3, 0), meta_of(payload(3, 0)))
    assert tier.steps() == {3: {0, 1}, 7: {0}}
    assert tier.committed_steps() == []
    # Another job under the same URL is separate.
    assert backend.tier("job-2").steps() == {}


def test_absent_shards_are_shard_missing(backend: Backend) -> None:
    tier = backend.tier()
    with pytest.raises(ShardMissing, match=r"step-0000000004/rank-2\.json"):
        tier.read_shard(4, 2)
    tier.write_shard(4, 0, b"abc", {})
    fs, root = backend.fs()
    fs.rm_file(f"{root}/job-1/step-0000000004/rank-0.bin")
    with pytest.raises(ShardMissing, match=r"rank-0\.bin"):
        tier.read_shard(4, 0)
    assert issubclass(ShardMissing, DurableError)


def test_invalid_meta_reads_as_absent_with_a_warning(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    tier = backend.tier()
    tier.write_shard(5, 0, b"x" * 10, {"size": 10})
    tier.write_shard(5, 1, b"y" * 10, {"size": 10})
    fs, root = backend.fs()
    fs.pipe_file(f"{root}/job-1/step-0000000005/rank-1.json", b'{"size": 1')  # cut short
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint.durable"):
        with pytest.raises(ShardMissing):
            tier.read_shard(5, 1)
        assert tier.steps() == {5: {0}}
        assert tier.commit(5, 2) is False
    assert "step-0000000005/rank-1.json" in caplog.text and "not valid JSON" in caplog.text


def test_commit_needs_every_rank_and_is_idempotent(backend: Backend) -> None:
    tier = backend.tier()
    tier.write_shard(10, 0, b"a", {})
    assert tier.commit(10, 2) is False
    assert tier.committed_steps() == []
    tier.write_shard(10, 1, b"b", {})
    tier.write_shard(2, 0, b"c", {})
    assert tier.commit(10, 2) is True
    assert tier.commit(10, 2) is True
    assert tier.commit(2, 1) is True
    assert tier.committed_steps() == [2, 10]
    fs, root = backend.fs()
    marker = json.loads(fs.cat_file(f"{root}/job-1/step-0000000010/COMMITTED"))
    assert marker["world_size"] == 2 and marker["ranks"] == [0, 1]
    assert marker["job_id"] == "job-1" and marker["step"] == 10 and marker["time"] > 0


def test_rewriting_a_shard_uncommits_its_step_until_committed_again(backend: Backend) -> None:
    tier = backend.tier()
    tier.write_shard(1, 0, b"old", {"v": 1})
    assert tier.commit(1, 1)
    tier.write_shard(1, 0, b"new", {"v": 2})
    assert tier.committed_steps() == []
    assert tier.read_shard(1, 0) == (b"new", {"v": 2})
    assert tier.commit(1, 1)
    assert tier.committed_steps() == [1]


def test_foreign_or_corrupt_markers_do_not_count(backend: Backend) -> None:
    tier = backend.tier()
    for step in (1, 2):
        tier.write_shard(step, 0, b"z", {})
        assert tier.commit(step, 1)
    fs, root = backend.fs()
    foreign = {"job_id": "other", "step": 1, "world_size": 1}
    fs.pipe_file(f"{root}/job-1/step-0000000001/COMMITTED", json.dumps(foreign).encode())
    fs.pipe_file(f"{root}/job-1/step-0000000002/COMMITTED", b"garbage")
    assert tier.committed_steps() == []


def test_prune_keeps_the_newest_committed_and_newer_work(backend: Backend) -> None:
    tier = backend.tier()
    for step in range(1, 6):
        tier.write_shard(step, 0, b"s", {})
        tier.write_shard(step, 1, b"s", {})
        assert tier.commit(step, 2)
    tier.write_shard(0, 0, b"abandoned", {})  # uncommitted, older than every kept step
    tier.write_shard(6, 0, b"in progress", {})  # uncommitted, newer: still being written
    assert tier.prune(keep=2) == [0, 1, 2, 3]
    assert tier.committed_steps() == [4, 5]
    assert tier.steps() == {4: {0, 1}, 5: {0, 1}, 6: {0}}
    assert tier.prune(keep=2) == []
    with pytest.raises(ValueError, match="keep"):
        tier.prune(keep=0)


def test_other_fsspec_filesystems_write_a_temporary_name_then_move(tmp_path: Path) -> None:
    url = f"memory://{tmp_path.name}"
    tier = DurableTier(url, "job", part_size=PART)
    data = payload(1, 0, 6 * MiB)
    tier.write_shard(1, 0, memoryview(data), {"n": 1})
    assert tier.commit(1, 1) and tier.committed_steps() == [1]
    assert tier.read_shard(1, 0) == (data, {"n": 1})
    fs, root = fsspec.core.url_to_fs(url)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.find(root)) == [
        "COMMITTED",
        "rank-0.bin",
        "rank-0.json",
    ]


def test_bad_arguments_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="job_id"):
        DurableTier(str(tmp_path), "a/b")
    tier = DurableTier(str(tmp_path), "job")
    with pytest.raises(ValueError, match="step"):
        tier.write_shard(-1, 0, b"", {})
    with pytest.raises(ValueError, match="rank"):
        tier.read_shard(0, -2)
    with pytest.raises(ValueError, match="world_size"):
        tier.commit(0, 0)
    with pytest.raises(ValueError, match="meta"):
        tier.write_shard(0, 0, b"", {"x": object()})


# ---- storage faults ------------------------------------------------------------------


def test_unreachable_s3_endpoint_fails_fast_and_clearly() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    options = {"endpoint_url": dead, "key": "k", "secret": "s"}
    tier = DurableTier("s3://bucket/prefix", "job", options)
    started = time.monotonic()
    with pytest.raises(DurableError, match=r"s3://bucket/prefix.*storage unreachable") as info:
        tier.write_shard(1, 0, b"data", {})
    with pytest.raises(DurableError, match="storage unreachable"):
        tier.committed_steps()
    assert time.monotonic() - started < 60  # bounded retries, not botocore's defaults
    assert "Traceback" not in str(info.value) and info.value.__suppress_context__


def test_missing_bucket_is_a_clear_error(s3_server: S3Server) -> None:  # noqa: F811
    tier = DurableTier("s3://no-such-bucket/x", "job", s3_server.storage_options)
    for action in (
        lambda: tier.write_shard(1, 0, b"d", {}),
        lambda: tier.read_shard(1, 0),
        tier.steps,
        tier.committed_steps,
    ):
        with pytest.raises(DurableError, match="bucket 'no-such-bucket' does not exist"):
            action()


def _write_as_nobody(directory: Path) -> str:
    """Try a write as an unprivileged user (root ignores file modes); the error text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to nobody, report, never return into pytest
        message = "no error"
        try:
            os.setgid(65534)
            os.setuid(65534)
            DurableTier(str(directory), "job").write_shard(1, 0, b"x", {})
        except DurableError as exc:
            message = f"DurableError: {exc}"
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write_end, message.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    return text


def test_permission_denied_on_a_local_path() -> None:
    base = Path(tempfile.mkdtemp(prefix="tg-perm-"))
    locked = base / "locked"
    try:
        base.chmod(0o755)
        locked.mkdir(mode=0o555)
        if os.geteuid() == 0:
            text = _write_as_nobody(locked)
        else:
            try:
                DurableTier(str(locked), "job").write_shard(1, 0, b"x", {})
                text = "no error"
            except DurableError as exc:
                text = f"DurableError: {exc}"
        assert text.startswith("DurableError:"), text
        assert "permission denied" in text and str(locked) in text
    finally:
        locked.chmod(0o755)
        subprocess.run(["rm", "-rf", str(base)], check=True)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (needs root and a mount-capable container)."""
    mount_dir = tmp_path / "tiny"
    mount_dir.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_dir)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill: {done.stderr.strip()}")
    try:
        yield mount_dir
    finally:
        subprocess.run(["umount", str(mount_dir)], check=False)


def test_full_disk_leaves_no_partial_object(tiny_disk: Path) -> None:
    tier = DurableTier(str(tiny_disk), "job")
    tier.write_shard(1, 0, b"small", {})
    with pytest.raises(DurableError, match=r"rank-1\.bin: no space left on device"):
        tier.write_shard(1, 1, bytes(3 * MiB), {})
    step_dir = tiny_disk / "job" / "step-0000000001"
    assert sorted(p.name for p in step_dir.iterdir()) == ["rank-0.bin", "rank-0.json"]
    assert tier.steps() == {1: {0}}
    assert tier.commit(1, 2) is False


# ---- a writer killed mid-write -------------------------------------------------------

WRITER = """
import json, sys, xxhash
from trainguard.checkpoint.durable import DurableTier
url, options, size = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tier = DurableTier(url, "job", options, part_size=5 * 2**20, upload_concurrency=1)
for step in range(1, 1000):
    for rank in range(2):
        data = bytes([step % 256, rank]) * (size // 2)
        print("begin", step, rank, flush=True)
        tier.write_shard(step, rank, data, {"xxh3_128": xxhash.xxh3_128_hexdigest(data)})
    tier.commit(step, 2)
    print("committed", step, flush=True)
"""


def _partial_writes(backend: Backend, early: int | None = None) -> list[str]:
    """Objects being written: temporary files, or unfinished S3 uploads. With ``early``,
    only those with at most that many bytes (local) or parts (S3) written so far."""
    fs, root = backend.fs()
    if backend.url.startswith("s3://"):
        bucket, prefix = root.split("/", 1)
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/job/")
        found = []
        for upload in listed.get("Uploads", []):
            key, upload_id = upload["Key"], upload["UploadId"]
            if early is not None:
                try:
                    parts = fs.call_s3("list_parts", Bucket=bucket, Key=key, UploadId=upload_id)
                except FileNotFoundError:
                    continue  # the upload completed since it was listed
                if len(parts.get("Parts", [])) > early:
                    continue
            found.append(key)
        return found
    tmps = Path(root, "job").glob("step-*/rank-*.bin.tmp-*")
    return [str(p) for p in tmps if early is None or p.stat().st_size <= early]


def test_killing_the_writer_never_leaves_a_loadable_partial_checkpoint(backend: Backend) -> None:
    size = 16 * MiB  # four parts on S3, sent one at a time
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, backend.url, json.dumps(backend.options), str(size)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    partial: list[str] = []
    s3 = backend.url.startswith("s3://")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.split() == ["committed", "2"]:
                break
        else:
            pytest.fail("the writer ended before committing step 2")
        deadline = time.monotonic() + 120
        while not partial and proc.poll() is None and time.monotonic() < deadline:
            partial = _partial_writes(backend, early=1 if s3 else size // 2)
        os.kill(proc.pid, signal.SIGKILL)  # in the middle of the write seen above
    finally:
        proc.kill()
        proc.wait(30)
    assert partial, "never saw a write in progress"

    tier = backend.tier("job")
    committed = tier.committed_steps()
    assert committed[:2] == [1, 2], committed
    present = tier.steps()
    for step, ranks in present.items():
        for rank in ranks:
            data, meta = tier.read_shard(step, rank)
            assert len(data) == size and xxhash.xxh3_128_hexdigest(data) == meta["xxh3_128"]
    for step in committed:
        assert present[step] == {0, 1}
    # The killed write is still unfinished, and its shard is not there.
    assert _partial_writes(backend) == partial
    step_name, file_name = partial[0].split("/")[-2:]
    last, rank = int(step_name[len("step-") :]), int(file_name.split(".")[0][len("rank-") :])
    assert last not in committed and rank not in present.get(last, set())

    # Pruning removes the killed write along with the step it belonged to.
    tier.write_shard(last + 1, 0, b"x", {})
    tier.write_shard(last + 1, 1, b"x", {})
    assert tier.commit(last + 1, 2)
    pruned = tier.prune(keep=1)
    assert set(committed) <= set(pruned) <= set(range(1, last + 1))
    assert _partial_writes(backend) == []
    fs, root = backend.fs()
    fs.invalidate_cache()
    assert {p.rsplit("/", 2)[-2] for p in fs.find(f"{root}/job")} == {f"step-{last + 1:010d}"}
