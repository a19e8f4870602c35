"""Shared test helpers: run the trainguard CLI in a private state directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from netns_hosts import NamespaceHosts, factory
from slurm_cluster import SlurmCluster
from slurm_cluster import factory as slurm_factory
from trainguard.platform.inbox import Inbox

REPO = Path(__file__).resolve().parent.parent

# Jobs in the tests find each attempt's store on rank 0 unless a test (or the caller's
# environment) asks for the store service: the service imports torch (~3 s of CPU) for
# every job, and most tests' workers are light fake ones. tests/test_rendezvous_store.py
# tests the service; run an e2e file with TRAINGUARD_RENDEZVOUS_STORE=service to use it.
os.environ.setdefault("TRAINGUARD_RENDEZVOUS_STORE", "rank0")
SCRIPTS = Path(__file__).resolve().parent / "scripts"
FAKE_WORKER = SCRIPTS / "fake_worker.py"


class Trainguard:
    """The ``trainguard`` command bound to one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.env = {**os.environ, "TRAINGUARD_STATE_DIR": str(state_dir), "PYTHONUNBUFFERED": "1"}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "trainguard.cli", *args]

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*args),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.argv(*args),
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def describe(self, job: str) -> dict[str, Any]:
        done = self.run("describe", job, "-o", "json", timeout=60)
        assert done.returncode == 0, done.stderr
        data: dict[str, Any] = json.loads(done.stdout)
        return data

    def only_job(self) -> dict[str, Any]:
        done = self.run("list", "-o", "json", timeout=60)
        assert done.returncode == 0, done.stderr
        jobs = json.loads(done.stdout)
        assert len(jobs) == 1, jobs
        return self.describe(jobs[0]["id"])


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    """A job-side report inbox on loopback, closed after the test."""
    inbox = Inbox()
    yield inbox
    inbox.close()


@pytest.fixture
def shm() -> Iterator[str]:
    """A private directory in /dev/shm (where the memory tier lives; the temp directory
    where there is none), removed after the test."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = tempfile.mkdtemp(prefix="tg-test-", dir=base)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tg(tmp_path: Path) -> Trainguard:
    return Trainguard(tmp_path / "state")


def write_job(path: Path, name: str, command: list[str], **spec: Any) -> Path:
    """A TrainingJob of 2 nodes x 2 processes running ``command``; ``spec`` adds fields."""
    job = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nprocPerNode": 2,
            "replicaSpecs": [
                {
                    "name": "pods",
                    "replicas": 2,
                    "template": {"spec": {"containers": [{"name": "trainer", "command": command}]}},
                }
            ],
            **spec,
        },
    }
    path.write_text(yaml.safe_dump(job))
    return path


def wait_for(predicate: Callable[[], object], timeout: float = 60.0) -> None:
    """Poll ``predicate`` until it is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def worker_pids(out: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in out.glob("rank-*.json")]


@pytest.fixture
def namespace_hosts() -> Iterator[Callable[..., NamespaceHosts]]:
    """``make(count, prefix=None)``: network-namespace hosts on a bridge (tests/netns_hosts.py),
    all closed after the test; skips when this machine cannot make them (not root, no ip)."""
    with factory() as make:
        yield make


@pytest.fixture
def slurm_cluster(
    namespace_hosts: Callable[..., NamespaceHosts],
) -> Iterator[Callable[..., SlurmCluster]]:
    """``make(nodes=3, *, prefix=None, **cluster_kw)``: a real Slurm cluster, one slurmd per
    namespace host (tests/slurm_cluster.py), installed with apt-get when missing; closed
    before its hosts after the test; skips when this machine cannot run it (not root)."""
    with slurm_factory(namespace_hosts) as make:
        yield make
