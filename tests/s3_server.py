"""A real S3 endpoint for tests: moto's standalone server on 127.0.0.1.

Reusable by any test module (``from s3_server import s3_server, s3_bucket_url``):

- ``s3_server`` (session scope) starts ``moto_server`` as a subprocess on a free loopback
  port, waits until it answers, yields an :class:`S3Server`, and stops it;
- ``s3_bucket_url`` (function scope) creates a fresh bucket and yields ``s3://<bucket>``.

Dummy credentials are set in the environment while the server runs, and loopback is
excluded from any proxy, so nothing leaves the machine.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 10.0
KEY = "testing"
SECRET = "testing"
REGION = "us-east-1"
ENV = {
    "AWS_ACCESS_KEY_ID": KEY,
    "AWS_SECRET_ACCESS_KEY": SECRET,
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_PROXY": HOST,
    "no_proxy": HOST,
}


@dataclass(frozen=True)
class S3Server:
    """A running moto S3 server."""

    endpoint_url: str
    key: str = KEY
    secret: str = SECRET

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server."""
        return {"endpoint_url": self.endpoint_url, "key": self.key, "secret": self.secret}

    def create_bucket(self, name: str | None = None) -> str:
        """Create a bucket (a fresh random name by default) and return its name."""
        import s3fs  # type: ignore[import-untyped]

        bucket = name or f"tg-{uuid.uuid4().hex[:12]}"
        fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
        fs.mkdir(bucket)
        return bucket


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _server_command(port: int) -> list[str]:
    script = Path(sys.executable).parent / "moto_server"
    found = str(script) if script.exists() else shutil.which("moto_server")
    base = [found] if found else [sys.executable, "-m", "moto.server"]
    return [*base, "-H", HOST, "-p", str(port)]


def _wait_until_up(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with {proc.returncode} before answering")
        try:
            with opener.open(f"{url}/moto-api/", timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not answer on {url} within {timeout} s")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    saved = {name: os.environ.get(name) for name in ENV}
    os.environ.update(ENV)
    port = free_port()
    url = f"http://{HOST}:{port}"
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            _server_command(port),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
        )
    try:
        _wait_until_up(proc, url, START_TIMEOUT)
        yield S3Server(endpoint_url=url)
    finally:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture
def s3_bucket_url(s3_server: S3Server) -> str:
    """``s3://<bucket>`` of a fresh, empty bucket."""
    return f"s3://{s3_server.create_bucket()}"
