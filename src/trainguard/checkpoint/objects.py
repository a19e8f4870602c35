"""Publishing one object atomically on each kind of storage the durable tier supports.

- local paths: a temporary name in the same directory, fsync, ``os.replace``,
  then fsync of the directory; the temporary file is removed on any error;
- S3: a single PUT, or a multipart upload that is aborted on failure; an S3
  object only becomes visible once complete;
- any other fsspec filesystem: a temporary name, then ``fs.mv``.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import uuid
from contextlib import suppress
from typing import Any

log = logging.getLogger(__name__)

LOCAL_WRITE_CHUNK = 256 * 2**20
S3_MAX_PARTS = 10_000


class MemoryReader(io.RawIOBase):
    """A seekable read-only file over a memoryview, so uploads stream without a full copy.

    Closing is a no-op: botocore rewinds the same body when it retries a request.
    """

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data
        self._pos = 0

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        n = min(len(target), len(self._data) - self._pos)
        target[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: len(self._data)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        """Stay usable; the caller owns the memory."""


def put_local(path: str, data: memoryview) -> None:
    """Local: a temporary name in the same directory, fsync, rename, fsync the directory."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            offset = 0
            while offset < len(data):
                offset += os.write(fd, data[offset : offset + LOCAL_WRITE_CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


async def put_s3(
    fs: Any, bucket: str, key: str, data: memoryview, part_size: int, concurrency: int
) -> None:
    """S3: one PUT, or a multipart upload (aborted on failure); visible only when complete."""
    if len(data) <= part_size:
        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=MemoryReader(data))
        return
    part_size = max(part_size, -(-len(data) // S3_MAX_PARTS))
    upload = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    upload_id = upload["UploadId"]
    slots = asyncio.Semaphore(concurrency)

    async def send(number: int, start: int) -> dict[str, Any]:
        async with slots:
            part = MemoryReader(data[start : start + part_size])
            out = await fs._call_s3(
                "upload_part",
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=part,
            )
            return {"PartNumber": number, "ETag": out["ETag"]}

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(send(i + 1, start))
                for i, start in enumerate(range(0, len(data), part_size))
            ]
        parts = [task.result() for task in tasks]
        await fs._call_s3(
            "complete_multipart_upload",
            Bucket=bucket,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": parts},
        )
    except BaseException:
        try:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        except Exception as exc:
            log.warning("could not abort the upload of s3://%s/%s: %s", bucket, key, exc)
        raise


def put_renamed(fs: Any, path: str, data: memoryview, block: int) -> None:
    """Any other fsspec filesystem: write a temporary name, then move it into place."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open(tmp, "wb", block_size=block) as f:
            for offset in range(0, len(data), block):
                f.write(data[offset : offset + block])
        fs.mv(tmp, path)
    except BaseException:
        with suppress(Exception):
            fs.rm_file(tmp)
        raise
