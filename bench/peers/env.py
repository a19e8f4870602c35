"""The peers' own Python environment, made by the benchmark (never the project's).

    python -m bench.peers.env            # make or check it; prints what each peer has

One virtual environment, by default ``/var/tmp/trainguard-bench-peers`` (outside the
repository; ``$TRAINGUARD_BENCH_PEERS`` moves it), with the project's torch version and
every peer, installed in one ``pip install`` pass (a pass that fails is retried peer by
peer, so one peer that cannot install skips only itself). A peer is *available* when
its probe imports in that environment; otherwise the reason (pip's or the import's last
line) is what the results say instead of figures. The environment is kept between runs
and made again when :data:`REQUIREMENTS` or the torch version change.

SageMaker's checkpointing library ships its in-memory service stand-in (a FastAPI app,
``tests/local_tests/membrain_server.py``) in its source distribution only: the
environment fetches that sdist with ``pip download`` and keeps the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ROOT = Path("/var/tmp/trainguard-bench-peers")
PEERS: dict[str, list[str]] = {
    # peer -> its requirements (beside torch); the import that proves it is there
    "torchft": ["torchft"],
    "nvrx": ["nvidia-resiliency-ext"],
    # its wheel declares requests and xxhash only; it imports boto3, s3torchconnector and
    # tenacity too (its own lock file has them); the stand-in is a FastAPI app
    "sagemaker": [
        "amzn-sagemaker-checkpointing",
        "boto3",
        "s3torchconnector",
        "tenacity",
        "fastapi",
        "uvicorn",
    ],
    "dlrover": ["dlrover[torch]", "grpcio"],
}
COMMON = ["numpy"]
PROBES: dict[str, str] = {
    "torchft": "import torchft, os, sys; "
    "sys.exit(0 if os.path.exists(os.path.join(os.path.dirname(sys.executable), "
    "'torchft_lighthouse')) else 'its wheel has no torchft_lighthouse binary')",
    "nvrx": "import nvidia_resiliency_ext.inprocess",
    "sagemaker": "import amzn_sagemaker_checkpointing.checkpointing.filesystem, uvicorn",
    "dlrover": "import dlrover.trainer.torch.flash_checkpoint.ddp",
}
DISTRIBUTIONS = {
    "torchft": "torchft",
    "nvrx": "nvidia-resiliency-ext",
    "sagemaker": "amzn-sagemaker-checkpointing",
    "dlrover": "dlrover",
}
MEMBRAIN = "membrain_server.py"


def torch_requirement() -> str:
    """The project's torch version, without its local part (``2.13.0+cu130`` -> ``==2.13.0``)."""
    import torch

    return "torch==" + torch.__version__.split("+")[0]


REQUIREMENTS = [torch_requirement(), *COMMON, *(r for reqs in PEERS.values() for r in reqs)]


@dataclass
class PeerEnv:
    """The environment and what each peer has: its version, or why it is skipped."""

    root: Path
    versions: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    install_s: float | None = None

    @property
    def python(self) -> str:
        return str(self.root / "venv" / "bin" / "python")

    @property
    def bin(self) -> Path:
        return self.root / "venv" / "bin"

    @property
    def membrain(self) -> Path:
        return self.root / MEMBRAIN

    def has(self, peer: str) -> bool:
        return peer in self.versions

    def to_json(self) -> dict[str, object]:
        return {
            "path": str(self.root / "venv"),
            "torch": self.versions.get("torch"),
            "versions": self.versions,
            "skipped": self.skipped,
            "install_s": self.install_s,
        }


def _run(argv: list[str], timeout: float = 1200) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:g} s"
    return done.returncode, (done.stdout + done.stderr).strip()


def _last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    return lines[-1].strip() if lines else text.strip()


def _stamp() -> str:
    return hashlib.sha256(json.dumps(REQUIREMENTS).encode()).hexdigest()[:16]


def prepare(root: Path | None = None) -> PeerEnv:
    """Make (or reuse) the environment; probe every peer."""
    import time

    root = root or Path(os.environ.get("TRAINGUARD_BENCH_PEERS", DEFAULT_ROOT))
    env = PeerEnv(root)
    stamp_file = root / "requirements.stamp"
    failed: dict[str, str] = {}
    if not (stamp_file.exists() and stamp_file.read_text() == _stamp()):
        began = time.monotonic()
        failed = _install(env)
        env.install_s = time.monotonic() - began
        if not failed:
            stamp_file.write_text(_stamp())
    for peer, probe in PROBES.items():
        if peer in failed:
            env.skipped[peer] = f"pip could not install it: {failed[peer]}"
            continue
        code, out = _run([env.python, "-W", "ignore", "-c", probe], timeout=300)
        if code != 0:
            env.skipped[peer] = f"does not import: {_last_line(out)}"
    names = ["torch", *(DISTRIBUTIONS[p] for p in PEERS if p not in env.skipped)]
    code, out = _run(
        [
            env.python,
            "-c",
            "import json, sys; from importlib.metadata import version; "
            "print(json.dumps({n: version(n) for n in sys.argv[1:]}))",
            *names,
        ],
        timeout=120,
    )
    if code == 0:
        found = json.loads(out.splitlines()[-1])
        env.versions["torch"] = found.pop("torch")
        for peer in PEERS:
            if peer not in env.skipped:
                env.versions[peer] = found[DISTRIBUTIONS[peer]]
    if env.has("sagemaker") and not env.membrain.exists():
        why = _fetch_membrain(env)
        if why is not None:
            env.skipped["sagemaker"] = why
            env.versions.pop("sagemaker", None)
    return env


def _install(env: PeerEnv) -> dict[str, str]:
    """One pip pass; where it fails, one pass per peer. The peers that failed, and why."""
    env.root.mkdir(parents=True, exist_ok=True)
    if not Path(env.python).exists():
        code, out = _run([sys.executable, "-m", "venv", str(env.root / "venv")], timeout=300)
        if code != 0:
            return {p: f"python -m venv failed: {_last_line(out)}" for p in PEERS}
    pip = [env.python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    base = [torch_requirement(), *COMMON]
    code, out = _run([*pip, *REQUIREMENTS])
    if code == 0:
        return {}
    failed: dict[str, str] = {}
    code, out = _run([*pip, *base])
    if code != 0:
        return {p: f"torch: {_last_line(out)}" for p in PEERS}
    for peer, reqs in PEERS.items():
        code, out = _run([*pip, *base, *reqs])
        if code != 0:
            failed[peer] = _last_line(out)
    return failed


def _fetch_membrain(env: PeerEnv) -> str | None:
    """The stand-in from the library's sdist (the version installed); None, or why not."""
    where = env.root / "sdist"
    version = env.versions["sagemaker"]
    code, out = _run(
        [
            env.python,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-binary",
            "amzn-sagemaker-checkpointing",
            "-d",
            str(where),
            f"amzn-sagemaker-checkpointing=={version}",
        ],
        timeout=300,
    )
    sdists = sorted(where.glob("*.tar.gz"))
    if code != 0 or not sdists:
        return f"its sdist (for the test stand-in) could not be fetched: {_last_line(out)}"
    with tarfile.open(sdists[-1]) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith("/" + MEMBRAIN)), None)
        data = tar.extractfile(member) if member is not None else None
        if data is None:
            return f"its sdist has no {MEMBRAIN} (the in-memory service stand-in)"
        env.membrain.write_bytes(data.read())
    return None


if __name__ == "__main__":
    print(json.dumps(prepare().to_json(), indent=2))
