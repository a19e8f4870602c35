"""Build a `TrainingJob` from torchrun-style command-line arguments.

`trainguard run --nnodes 2 --nproc-per-node 2 train.py --lr 0.1` means the same job as a
one-group YAML spec whose container command is `[python, -u, train.py, --lr, 0.1]`.
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from trainguard.spec.load import SpecError, problems_of
from trainguard.spec.model import TrainingJob

CLI_SOURCE = "command line"
CLI_GROUP_NAME = "worker"
DEFAULT_MAX_RESTARTS = 3
"""The torchrun form's restart budget when ``--max-restarts`` is not given. torchrun's is
0, but a job run under trainguard is run to survive faults: 3 restarts ride out a crash or
a lost node or two, and a script that fails at every start still fails within a minute."""

# Spec fields set from command-line flags, so errors can name the flag the user typed.
_FLAG_OF_FIELD = {
    "metadata.name": "--name",
    "spec.nprocPerNode": "--nproc-per-node",
    "spec.replicaSpecs[0].replicas": "--nnodes",
    "spec.runPolicy.jobMaxRetryCount": "--max-restarts",
}


def dns_name(text: str) -> str:
    """Lowercase DNS-1123 label derived from `text` ("My_Train.v2" -> "my-train-v2")."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:63].strip("-")
    return name or "job"


def cli_job(
    script: str,
    script_args: Sequence[str],
    nnodes: int | tuple[int, int],
    nproc_per_node: str | int,
    max_restarts: int,
    name: str | None = None,
    module: bool = False,
    no_python: bool = False,
) -> TrainingJob:
    """The job `trainguard run [flags] script args...` describes; SpecError if it is bad.
    ``nnodes``: a count, or torchrun's elastic ``(MIN, MAX)``: the job starts on MIN nodes
    and may grow to MAX (``elasticPolicy``)."""
    low, high = nnodes if isinstance(nnodes, tuple) else (nnodes, nnodes)
    if module and no_python:
        raise SpecError(CLI_SOURCE, [("--no-python", "cannot be combined with -m/--module")])
    if module:
        command = [sys.executable, "-u", "-m", script, *script_args]
        stem = script.rsplit(".", 1)[-1]
    else:
        path = Path(script)
        if path.is_file():
            script = str(path.resolve())
        elif not (no_python and shutil.which(script)):
            problem = "is a directory" if path.is_dir() else "file not found"
            raise SpecError(CLI_SOURCE, [(script, problem)])
        if no_python:
            command = [script, *script_args]
        else:
            command = [sys.executable, "-u", script, *script_args]
        stem = path.stem
    data = {
        "apiVersion": "trainguard.dev/v1",
        "kind": "TrainingJob",
        "metadata": {"name": name if name is not None else dns_name(stem)},
        "spec": {
            "nprocPerNode": nproc_per_node,
            "replicaSpecs": [
                {
                    "name": CLI_GROUP_NAME,
                    "replicas": low,
                    **({"maxReplicas": high} if high > low else {}),
                    "template": {"spec": {"containers": [{"name": "worker", "command": command}]}},
                }
            ],
            "runPolicy": {"jobMaxRetryCount": max_restarts},
            **({"elasticPolicy": {"minReplicas": low, "maxReplicas": high}} if high > low else {}),
        },
    }
    try:
        return TrainingJob.model_validate(data)
    except ValidationError as err:
        problems = [(_FLAG_OF_FIELD.get(path, path), msg) for path, msg in problems_of(err)]
        raise SpecError(CLI_SOURCE, problems) from None
