"""The durable checkpoint tier: rank shards and commit markers behind an fsspec URL.

Layout: ``<url>/<job_id>/step-<NNNNNNNNNN>/rank-<R>.bin`` (the bytes), ``rank-<R>.json``
(the caller's meta, written after the bytes) and ``COMMITTED`` (written last, by
:meth:`DurableTier.commit`, once every rank's meta is present).

Assumptions: an object appears under its final name only when complete (locally: a
temporary name in the same directory, fsync, ``os.replace``; S3: a PUT or a completed
multipart upload is atomic and unfinished uploads are never listed; other filesystems:
a temporary name, then ``fs.mv``). A shard counts only when its meta parses, and the
meta is written after the bytes; a step counts only with a marker written after every
meta. Pruning deletes a marker first; rewriting a shard deletes the step's marker and
the rank's meta first. So a writer killed anywhere leaves nothing that reads as present.
Checksums travel in the meta and are verified by the caller.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import fsspec  # type: ignore[import-untyped]
from fsspec.asyn import sync  # type: ignore[import-untyped]
from fsspec.implementations.local import LocalFileSystem  # type: ignore[import-untyped]

from trainguard.checkpoint.objects import put_local, put_renamed, put_s3

log = logging.getLogger(__name__)

STEP_DIGITS = 10
COMMITTED = "COMMITTED"
# Multipart part size on S3 (min 5 MiB) and the parts in flight at once.
DEFAULT_PART_SIZE = 64 * 2**20
DEFAULT_UPLOAD_CONCURRENCY = 4
# Bounded client behaviour on S3, so a dead endpoint fails in seconds. One retry layer
# (botocore's, which rewinds request bodies); ``retries`` in storage_options sets it.
DEFAULT_S3_RETRIES = 3
DEFAULT_S3_CONFIG: dict[str, Any] = {"connect_timeout": 2, "read_timeout": 60}

_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_META = re.compile(r"^rank-(\d+)\.json$")
_RANK_DATA = re.compile(r"^rank-(\d+)\.bin$")
_CONNECTION_ERRORS = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
}


class DurableError(Exception):
    """Durable storage failed; the message names the URL or object and the cause."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class ShardMissing(DurableError):
    """A rank's shard (its meta or its bytes) is absent or unreadable."""


def _cause(exc: BaseException) -> str:
    """A short human reason for a storage exception (never a traceback)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & _CONNECTION_ERRORS or isinstance(exc, ConnectionError | TimeoutError):
        return f"storage unreachable ({exc})"
    if isinstance(exc, PermissionError):
        return f"permission denied ({exc})"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on device"
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return "read-only file system"
    if isinstance(exc, FileNotFoundError):
        return f"not found ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _step_name(step: int) -> str:
    return f"step-{step:0{STEP_DIGITS}d}"


def _check_index(field: str, value: int, limit: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field} must be a non-negative integer, got {value!r}")
    if limit is not None and value >= limit:
        raise ValueError(f"{field} must be below {limit}, got {value!r}")


class DurableTier:
    """Shards of one job at ``<url>/<job_id>/``; a local path or any fsspec URL."""

    def __init__(
        self,
        url: str,
        job_id: str,
        storage_options: dict[str, Any] | None = None,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        upload_concurrency: int = DEFAULT_UPLOAD_CONCURRENCY,
    ) -> None:
        if not isinstance(url, str) or not url.strip():
            raise ValueError(f"url must be a non-empty path or URL, got {url!r}")
        if not isinstance(job_id, str) or not re.fullmatch(r"[A-Za-z0-9._-]+", job_id):
            raise ValueError(f"job_id must be letters, digits, '.', '_' or '-', got {job_id!r}")
        if job_id in (".", ".."):
            raise ValueError(f"job_id must not be {job_id!r}")
        if part_size < 5 * 2**20:
            raise ValueError(f"part_size must be at least 5 MiB, got {part_size}")
        if upload_concurrency < 1:
            raise ValueError(f"upload_concurrency must be >= 1, got {upload_concurrency}")
        self.url = url.rstrip("/") or url
        self.job_id = job_id
        self.part_size = part_size
        self.upload_concurrency = upload_concurrency
        options = dict(storage_options or {})
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        self._s3 = protocol in ("s3", "s3a")
        if self._s3:
            options = self._s3_options(options)
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except Exception as exc:
            raise DurableError(f"durable storage {url}: cannot open: {_cause(exc)}", exc) from None
        if self._s3:
            fs.retries = 1  # botocore retries (it rewinds bodies); s3fs's would not
        self._fs = fs
        self._local = isinstance(fs, LocalFileSystem)
        self._root = f"{root.rstrip('/')}/{job_id}"
        self._root_checked = False

    @staticmethod
    def _s3_options(options: dict[str, Any]) -> dict[str, Any]:
        retries = int(options.pop("retries", DEFAULT_S3_RETRIES))
        config = {**DEFAULT_S3_CONFIG, **options.get("config_kwargs", {})}
        config.setdefault("retries", {"max_attempts": retries, "mode": "standard"})
        options["config_kwargs"] = config
        options.setdefault("use_listings_cache", False)
        options.setdefault("skip_instance_cache", True)  # our retries setting is per instance
        return options

    # ---- public API -------------------------------------------------------------

    def write_shard(
        self, step: int, rank: int, data: memoryview | bytes, meta: dict[str, Any]
    ) -> None:
        """Write rank's bytes, then its meta; each object appears whole or not at all.

        Rewriting a shard first removes the step's COMMITTED marker and the rank's meta,
        so the step reads as uncommitted until :meth:`commit` is called again.
        """
        _check_index("step", step, 10**STEP_DIGITS)
        _check_index("rank", rank)
        try:
            meta_bytes = json.dumps(meta, sort_keys=True).encode()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"meta for step {step} rank {rank} is not JSON: {exc}") from None
        view = memoryview(data).cast("B")
        step_dir = self._step_dir(step)
        self._check_root()
        for stale in (f"{step_dir}/{COMMITTED}", f"{step_dir}/rank-{rank}.json"):
            with self._storage("cannot delete", stale, missing_ok=True):
                self._fs.rm_file(stale)
        self._put(f"{step_dir}/rank-{rank}.bin", view)
        self._put(f"{step_dir}/rank-{rank}.json", memoryview(meta_bytes))

    def read_shard(self, step: int, rank: int) -> tuple[bytes, dict[str, Any]]:
        """Rank's bytes and meta; :class:`ShardMissing` when either is absent or bad."""
        _check_index("step", step, 10**STEP_DIGITS)
        _check_index("rank", rank)
        meta_path = f"{self._step_dir(step)}/rank-{rank}.json"
        meta = self._read_metas([meta_path]).get(meta_path)
        if meta is None:
            raise ShardMissing(f"{self._name(meta_path)}: shard meta absent or invalid")
        data_path = f"{self._step_dir(step)}/rank-{rank}.bin"
        data = None
        with self._storage("cannot read", data_path, missing_ok=True):
            data = self._fs.cat_file(data_path)
        if data is None:
            raise ShardMissing(f"{self._name(data_path)}: shard data absent")
        return bytes(data), meta

    def steps(self) -> dict[int, set[int]]:
        """Step -> ranks whose meta is present and valid (steps with none are left out)."""
        listing = self._listing()
        metas = self._read_metas(
            f"{self._step_dir(s)}/rank-{r}.json" for s, names in listing.items() for r in names[0]
        )
        found: dict[int, set[int]] = {}
        for step, (meta_ranks, _, _) in listing.items():
            ranks = {r for r in meta_ranks if f"{self._step_dir(step)}/rank-{r}.json" in metas}
            if ranks:
                found[step] = ranks
        return found

    def commit(self, step: int, world_size: int) -> bool:
        """Write step's COMMITTED marker iff ranks 0..world_size-1 all have a valid meta.

        True when the step is (now or already) committed; False when a meta is missing.
        """
        _check_index("step", step, 10**STEP_DIGITS)
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        step_dir = self._step_dir(step)
        marker = f"{step_dir}/{COMMITTED}"
        if self._read_markers([step]).get(step, {}).get("world_size") == world_size:
            return True
        paths = [f"{step_dir}/rank-{r}.json" for r in range(world_size)]
        if len(self._read_metas(paths)) < world_size:
            return False
        body = {
            "job_id": self.job_id,
            "step": step,
            "world_size": world_size,
            "ranks": list(range(world_size)),
            "time": time.time(),
        }
        self._put(marker, memoryview(json.dumps(body).encode()))
        return True

    def committed_steps(self) -> list[int]:
        """Ascending steps with a valid COMMITTED marker and every rank's objects listed."""
        listing = self._listing()
        markers = self._read_markers([s for s, (_, _, c) in listing.items() if c])
        good = []
        for step, marker in markers.items():
            metas, datas, _ = listing[step]
            expected = set(range(int(marker["world_size"])))
            if expected <= metas and expected <= datas:
                good.append(step)
            else:
                missing = sorted(expected - (metas & datas))
                log.warning("%s is committed but misses ranks %s", self._step_url(step), missing)
        return sorted(good)

    def prune(self, keep: int) -> list[int]:
        """Delete committed steps beyond the newest ``keep``, and uncommitted steps older
        than the oldest kept one. Returns the deleted steps, ascending."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        committed = self.committed_steps()
        if not committed:
            return []
        kept = committed[-keep:]
        doomed = sorted(s for s in self._listing() if s < kept[0])
        for step in doomed:
            step_dir = self._step_dir(step)
            with self._storage("cannot delete", step_dir, missing_ok=True):
                self._fs.rm_file(f"{step_dir}/{COMMITTED}")  # first: never a partial commit
            with self._storage("cannot delete", step_dir, missing_ok=True):
                self._fs.rm(step_dir, recursive=True)
        if self._s3:
            self._abort_uploads(before=kept[0])
        return doomed

    # ---- naming and errors ----------------------------------------------------------

    def _step_dir(self, step: int) -> str:
        return f"{self._root}/{_step_name(step)}"

    def _name(self, path: str) -> str:
        """The object's URL as the user wrote the tier's URL."""
        return f"{self.url}/{path[len(self._root) - len(self.job_id) :]}"

    def _step_url(self, step: int) -> str:
        return self._name(self._step_dir(step))

    @contextmanager
    def _storage(self, action: str, path: str, missing_ok: bool = False) -> Iterator[None]:
        """Turn storage exceptions into a :class:`DurableError` naming the object."""
        try:
            yield
        except FileNotFoundError as exc:
            if self._s3:  # a missing bucket also reads as "not found"
                self._root_checked = False
                self._check_root()
            if not missing_ok:
                raise self._error(action, path, exc) from None
        except DurableError:
            raise
        except Exception as exc:
            raise self._error(action, path, exc) from None

    def _error(self, action: str, path: str, exc: BaseException) -> DurableError:
        return DurableError(f"durable storage: {action} {self._name(path)}: {_cause(exc)}", exc)

    def _check_root(self) -> None:
        """On S3, fail clearly (once per tier) when the bucket is missing or unreachable."""
        if self._root_checked or not self._s3:
            return
        bucket = self._root.split("/", 1)[0]
        try:
            self._fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            raise DurableError(
                f"durable storage {self.url}: bucket {bucket!r} does not exist"
            ) from None
        except Exception as exc:
            raise DurableError(f"durable storage {self.url}: {_cause(exc)}", exc) from None
        self._root_checked = True

    # ---- storage primitives ---------------------------------------------------------

    def _listing(self) -> dict[int, tuple[set[int], set[int], bool]]:
        """Step -> (ranks with a meta object, ranks with a data object, has COMMITTED)."""
        self._check_root()
        self._fs.invalidate_cache()
        paths: list[str] = []
        with self._storage("cannot list", self._root, missing_ok=True):
            paths = self._fs.find(self._root)
        found: dict[int, tuple[set[int], set[int], bool]] = {}
        for path in paths:
            parts = path[len(self._root) :].strip("/").split("/")
            if len(parts) != 2 or not (match := _STEP_DIR.match(parts[0])):
                continue
            metas, datas, _ = found.setdefault(int(match[1]), (set(), set(), False))
            if meta := _RANK_META.match(parts[1]):
                metas.add(int(meta[1]))
            elif data := _RANK_DATA.match(parts[1]):
                datas.add(int(data[1]))
            elif parts[1] == COMMITTED:
                found[int(match[1])] = (metas, datas, True)
        return found

    def _read_json(self, paths: Iterable[str]) -> dict[str, Any]:
        """Path -> parsed JSON for each path present; unparsable ones are warned about."""
        wanted = list(paths)
        if not wanted:
            return {}
        self._check_root()
        raw: dict[str, Any] = {}
        with self._storage("cannot read", wanted[0], missing_ok=True):
            raw = self._fs.cat(wanted, on_error="return")
        parsed: dict[str, Any] = {}
        for path in wanted:
            value = raw.get(path, raw.get(self._fs._strip_protocol(path)))
            if isinstance(value, FileNotFoundError) or value is None:
                continue
            if isinstance(value, BaseException):
                raise self._error("cannot read", path, value)
            try:
                parsed[path] = json.loads(value)
            except ValueError as exc:
                log.warning("ignoring %s: not valid JSON (%s)", self._name(path), exc)
        return parsed

    def _read_metas(self, paths: Iterable[str]) -> dict[str, dict[str, Any]]:
        metas = self._read_json(paths)
        for path in [p for p, meta in metas.items() if not isinstance(meta, dict)]:
            log.warning("ignoring %s: meta is not a JSON object", self._name(path))
            del metas[path]
        return metas

    def _read_markers(self, steps: list[int]) -> dict[int, dict[str, Any]]:
        """Step -> its COMMITTED marker, for markers that belong to this job and step."""
        paths = {f"{self._step_dir(s)}/{COMMITTED}": s for s in steps}
        markers: dict[int, dict[str, Any]] = {}
        for path, body in self._read_json(paths).items():
            step = paths[path]
            ok = isinstance(body, dict) and isinstance(body.get("world_size"), int)
            if ok and body.get("job_id") == self.job_id and body.get("step") == step:
                markers[step] = body
            else:
                log.warning("ignoring %s: not a marker of job %s", self._name(path), self.job_id)
        return markers

    def _abort_uploads(self, before: int) -> None:
        """Abort unfinished multipart uploads (writers killed mid-write) in steps before."""
        bucket, prefix = self._root.split("/", 1)
        try:
            listed = self._fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
            for upload in listed.get("Uploads", []):
                step = _STEP_DIR.match(upload["Key"][len(prefix) + 1 :].split("/", 1)[0])
                if step and int(step[1]) < before:
                    self._fs.call_s3(
                        "abort_multipart_upload",
                        Bucket=bucket,
                        Key=upload["Key"],
                        UploadId=upload["UploadId"],
                    )
        except Exception as exc:
            log.warning("%s: could not abort unfinished uploads: %s", self.url, _cause(exc))

    def _put(self, path: str, data: memoryview) -> None:
        """Publish ``data`` at ``path`` atomically."""
        with self._storage("cannot write", path):
            if self._local:
                put_local(path, data)
            elif self._s3:
                bucket, key = path.split("/", 1)
                sync(
                    self._fs.loop,
                    put_s3,
                    self._fs,
                    bucket,
                    key,
                    data,
                    self.part_size,
                    self.upload_concurrency,
                )
            else:
                put_renamed(self._fs, path, data, self.part_size)
